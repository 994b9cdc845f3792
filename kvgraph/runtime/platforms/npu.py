"""The Ascend NPU platform: `torch.npu.NPUGraph` (ACL graphs) through `torch_npu`.

`torch_npu` is imported only here, when an NPU device is asked for: installed on a machine
without the Ascend toolkit it breaks on import, so nothing else in kvgraph may import it.
Not run on Ascend hardware by kvgraph's own tests.
"""

from __future__ import annotations

from typing import Any

from kvgraph.errors import PlatformError
from kvgraph.runtime.platforms.base import StreamPlatform


def import_torch_npu() -> Any:
    """`torch_npu`, or a PlatformError saying why it cannot be used here."""
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError) as error:
        raise PlatformError(
            f"the NPU platform needs torch_npu with the Ascend toolkit (pip install "
            f"'kvgraph[npu]' on an Ascend machine); importing it failed: {error}"
        ) from error
    import torch

    return torch.npu


def npu_platform() -> StreamPlatform:
    npu = import_torch_npu()
    return StreamPlatform("npu", npu, npu.NPUGraph)
