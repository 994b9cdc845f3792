"""Fused-attention calls in a captured ACL graph, and rewriting their host lengths per replay.

torch_npu's fused attention (FIA) takes each request's query and key lengths as host ints,
which a captured ACL graph freezes. So inside a full-graph capture each call is recorded as a
task group (`torch.npu.graph_task_group_begin/end`, its `.out` form with a workspace sized by
`_<op>_get_max_workspace`) behind an `ExternalEvent` the graph waits on; before each replay
`update` re-issues every recorded call with the step's lengths on a side stream, between
`graph_task_update_begin/end`, and records its event. This is the path op-plugin documents
(`torch_npu.npu.graph_task_group_begin`, with an FIA example) and vllm-ascend runs.

torch_npu's alternative, capturing with `auto_dispatch_capture=True` and `NPUGraph.update`,
intercepts every op dispatched during the capture with a dispatch mode; the explicit groups
record only the calls that need it, and keep ownership with the backend that made them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvgraph.errors import GraphError


@dataclass
class CapturedCall:
    """One fused-attention call of a captured graph: what re-issuing it with new lengths needs."""

    op_name: str
    kwargs: dict[str, Any]  # every argument but the host lengths, `workspace` and `out`
    length_names: Sequence[str]  # the op's names for (cumulative query ends, key counts)
    workspace: torch.Tensor
    out: list[torch.Tensor]
    event: Any  # torch.npu.ExternalEvent
    handle: Any  # the task group


@dataclass
class CapturedCalls:
    """Every fused-attention call one full graph holds, in capture order."""

    calls: list[CapturedCall] = field(default_factory=list)
    workspaces: dict[str, torch.Tensor] = field(default_factory=dict)  # one per op, shared

    def __len__(self) -> int:
        return len(self.calls)


def capture_call(npu: Any, torch_npu: Any, captured: CapturedCalls, op_name: str,
                 kwargs: dict[str, Any], lengths: dict[str, list[int]],
                 out: list[torch.Tensor]) -> None:
    """Issue `op_name(**kwargs, **lengths)` into `out` as a task group of the graph being
    captured on the current stream, and record it in `captured`."""
    op = getattr(torch_npu, op_name)
    if not hasattr(op, "out") or not hasattr(torch_npu, f"_{op_name}_get_max_workspace"):
        raise GraphError(f"torch_npu.{op_name} has no .out form and workspace query, so its "
                         "host lengths cannot be updated in a captured graph")
    stream = npu.current_stream()
    # Calls of one graph run one after another on its stream, so they share one workspace,
    # sized by the first call (every layer of a model calls with the same shapes).
    workspace = captured.workspaces.get(op_name)
    if workspace is None:
        query_workspace = getattr(torch_npu, f"_{op_name}_get_max_workspace")
        workspace = captured.workspaces[op_name] = query_workspace(**kwargs, **lengths)
    event = npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    npu.graph_task_group_begin(stream)
    op.out(**kwargs, **lengths, workspace=workspace, out=out)
    handle = npu.graph_task_group_end(stream)
    captured.calls.append(CapturedCall(op_name, kwargs, tuple(lengths), workspace, out, event,
                                       handle))


def update(npu: Any, torch_npu: Any, captured: CapturedCalls, stream: Any,
           host_lengths: Callable[[], Sequence[list[int]]]) -> None:
    """Re-issue every captured call with this step's host lengths, before the graph replays.

    The replay before this one must have finished: it reads the parameters rewritten here
    (vllm-ascend synchronises the same way). In kvgraph's step loop the host has already read
    that step's logits, so the wait costs nothing.
    """
    if not captured.calls:
        return
    npu.current_stream().synchronize()
    values = host_lengths()
    with npu.stream(stream):
        for call in captured.calls:
            npu.graph_task_update_begin(stream, call.handle)
            getattr(torch_npu, call.op_name).out(**call.kwargs, **dict(zip(call.length_names,
                                                                           values)),
                                                 workspace=call.workspace, out=call.out)
            npu.graph_task_update_end(stream)
            call.event.record(stream)
