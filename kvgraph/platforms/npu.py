"""The Ascend NPU platform: `torch.npu.NPUGraph` (ACL graphs) through `torch_npu`.

`torch_npu` is imported only here, when an NPU device is asked for: installed on a machine
without the Ascend toolkit it breaks on import, so nothing else in kvgraph may import it.
Not run on Ascend hardware by kvgraph's own tests.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kvgraph.errors import PlatformError
from kvgraph.platforms.base import check_addresses, input_addresses


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


class NPUGraph:
    """One `torch.npu.NPUGraph`; its outputs are the tensors produced during capture."""

    def __init__(self, npu: Any, check_inputs: bool):
        self.npu = npu
        self.check_inputs = check_inputs
        self.graph = npu.NPUGraph()
        self.outputs: Any = None
        self.addresses: list[int | None] = []
        self.memory_bytes = 0

    def capture(self, fn: Callable, args: Sequence[Any], pool: Any) -> Any:
        self.addresses = input_addresses(args)
        before = self.npu.memory_reserved()
        with self.npu.graph(self.graph, pool=pool):
            self.outputs = fn(*args)
        self.memory_bytes = self.npu.memory_reserved() - before
        return self.outputs

    def replay(self, args: Sequence[Any]) -> Any:
        if self.check_inputs:
            check_addresses(self.addresses, args, "npu-graph")
        self.graph.replay()
        return self.outputs


class NPUPlatform:
    name = "npu"
    device_type = "npu"
    attention_backend = "torch_native"
    needs_warmup = True

    def __init__(self) -> None:
        self.npu = import_torch_npu()
        self._pool: Any = None

    def make_graph(self, check_inputs: bool) -> NPUGraph:
        return NPUGraph(self.npu, check_inputs)

    def graph_pool(self) -> Any:
        if self._pool is None:
            self._pool = self.npu.graph_pool_handle()
        return self._pool

    def synchronize(self) -> None:
        self.npu.synchronize()

    def memory_in_use(self) -> int:
        return self.npu.memory_allocated()
