"""The Ascend NPU platform: `torch.npu.NPUGraph` (ACL graphs) through `torch_npu`.

`torch_npu` is imported only here, when an NPU device is asked for: installed on a machine
without the Ascend toolkit it breaks on import, so nothing else in kvgraph may import it.
Attention defaults to the `ascend` backend (torch_npu's fused attention, whose full graphs are
updated before each replay) and cache blocks to 128 tokens, the block size its kernels and
vllm-ascend run. Not run on Ascend hardware by kvgraph's own tests.
"""

from __future__ import annotations

from typing import Any

from kvgraph.errors import GraphError, PlatformError
from kvgraph.runtime.platforms.stream import StreamGraph, StreamPlatform

# How CANN reports a capture that ran out of streams (vllm-ascend matches the same).
STREAM_EXHAUSTED_CODE = "207008"
STREAM_EXHAUSTED_MARKERS = ("insufficient_stream_resources", "stream resources are insufficient",
                            "insufficient stream resources")
NPU_BLOCK_SIZE = 128


def import_torch_npu() -> Any:
    """`torch_npu`, or a PlatformError saying why it cannot be used here."""
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError) as error:
        raise PlatformError(
            f"the NPU platform needs torch_npu with the Ascend toolkit (pip install "
            f"'kvgraph[npu]' on an Ascend machine, then source CANN's set_env.sh); importing it "
            f"failed: {error}. Where torch_npu is installed without CANN, `import torch` itself "
            f"fails through its autoload entry point: set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use "
            f"torch without it"
        ) from error
    import torch

    return torch.npu


def is_stream_exhaustion(error: BaseException) -> bool:
    """Whether a capture failed because the device ran out of streams (CANN error 207008)."""
    message = str(error).lower()
    return any(marker in message for marker in STREAM_EXHAUSTED_MARKERS) or (
        STREAM_EXHAUSTED_CODE in message and "stream" in message)


class ACLGraph(StreamGraph):
    """An NPUGraph capture whose stream exhaustion is re-raised with what to change."""

    def capture(self, fn, args, pool):
        try:
            return super().capture(fn, args, pool)
        except RuntimeError as error:
            if not is_stream_exhaustion(error):
                raise
            raise GraphError(
                f"{self.name}: the NPU ran out of streams capturing ACL graphs (CANN error "
                f"{STREAM_EXHAUSTED_CODE}). Capture fewer graphs: fewer or smaller "
                "capture_sizes, or graph_mode 'full_decode_only' (one graph per size instead of "
                f"one per piece); or use 'none' to check the rest works. ({error})") from error


def npu_platform() -> StreamPlatform:
    npu = import_torch_npu()
    # hccl: Ascend's collectives, which importing torch_npu registers with torch.distributed.
    return StreamPlatform("npu", npu, npu.NPUGraph, distributed_backend="hccl",
                          attention_backend="ascend",
                          default_block_size=NPU_BLOCK_SIZE, stream_graph=ACLGraph)
