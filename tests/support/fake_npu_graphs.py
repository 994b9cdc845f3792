"""A stand-in for `torch.npu`'s graph API on the CPU, for tests only, with frozen host arguments.

What it keeps of ACL graphs is what kvgraph's `ascend` backend must get right: a captured graph
replays its kernels with the host arguments they were captured with. Every op of the fake
torch_npu that takes host lengths asks `host_args` what to run with:
- during a capture (`torch.npu.graph(g)`) the call becomes a task of `g`, frozen with its host
  lists; between `graph_task_group_begin/end` it is a task group, whose handle can update it;
- between `graph_task_update_begin(stream, handle)` and `graph_task_update_end` on a side
  stream, the call rewrites the group's host lists and runs nothing;
- during a replay of `g` (`replaying(g)`, what `ACLGraphOnCpu` does: it reruns Python as
  kvgraph's CPU graph does) the k-th such call runs with task k's host lists, whatever the
  caller passed, so a backend that forgets to update a captured call reads stale lengths.
A group captured behind an `ExternalEvent` wait replays only if the event was recorded since
the last replay (on an NPU the replay would wait forever), and a group updated while its
graph's previous replay may still run is refused (`current_stream().synchronize()` first).
The API's names and arguments follow torch_npu 2.9-2.14 (read from its sources and op-plugin's
graph_task docs, 2026-12-02).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from kvgraph.runtime.platforms.cpu import CPUGraph, CPUPlatform


class Stream:
    def __init__(self, device: Any = None, name: str = "side"):
        self.name = name

    def synchronize(self) -> None:
        _state.synchronized = True


@dataclass
class Task:
    """One host-argument kernel of a captured graph."""

    op_name: str
    host: dict[str, list]
    group: TaskGroup | None = None


@dataclass
class TaskGroup:
    """A task group handle (what `graph_task_group_end` returns)."""

    graph: NPUGraph
    event: ExternalEvent | None
    task: Task | None = None
    updates: int = 0


class ExternalEvent:
    def __init__(self):
        self.recorded = False

    def wait(self, stream: Stream) -> None:
        if _state.capturing is not None:
            _state.capturing.waits.append(self)

    def reset(self, stream: Stream) -> None:
        if _state.capturing is None:
            self.recorded = False

    def record(self, stream: Stream) -> None:
        if stream is _state.default_stream:
            raise RuntimeError("the fake expects updates recorded on the update stream")
        self.recorded = True


@dataclass
class NPUGraph:
    tasks: list[Task] = field(default_factory=list)
    waits: list[ExternalEvent] = field(default_factory=list)
    replays: int = 0

    def reset(self) -> None:
        self.tasks.clear()

    def replay(self) -> None:
        raise NotImplementedError("the fake replays through ACLGraphOnCpu (it reruns Python)")


class _State:
    def __init__(self):
        self.default_stream = Stream(name="default")
        self.reset()

    def reset(self) -> None:
        self.current = self.default_stream
        self.capturing: NPUGraph | None = None
        self.group: TaskGroup | None = None
        self.updating: TaskGroup | None = None
        self.replaying: NPUGraph | None = None
        self.replay_index = 0
        self.synchronized = True  # no replay has run since the last synchronize
        self.capture_error: BaseException | None = None  # raised by the next capture
        self.empty_cache_calls = 0


_state = _State()


def host_args(op_name: str, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments a call of a host-argument op runs with; None: it updates a task group."""
    host = {name: value for name, value in kwargs.items() if isinstance(value, list)}
    if _state.updating is not None:
        group = _state.updating
        if group.task.op_name != op_name:
            raise RuntimeError(f"update of a {group.task.op_name} task group issued {op_name}")
        group.task.host, group.updates = host, group.updates + 1
        return None
    if _state.capturing is not None:
        task = Task(op_name, host, _state.group)
        if _state.group is not None:
            if _state.group.task is not None:
                raise RuntimeError("the fake holds one call per task group")
            _state.group.task = task
        _state.capturing.tasks.append(task)
        return kwargs
    if _state.replaying is not None:
        tasks, index = _state.replaying.tasks, _state.replay_index
        if index >= len(tasks) or tasks[index].op_name != op_name:
            raise RuntimeError(f"replay reached {op_name} call {index}, which was not captured")
        _state.replay_index += 1
        return {**kwargs, **tasks[index].host}
    return kwargs


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool: Any = None, stream: Any = None,
          auto_dispatch_capture: bool = False, capture_error_mode: str = "global"):
    """`torch.npu.graph`: empties the caches on entry (as torch_npu's does), then captures."""
    npu.empty_cache()
    npu.host_empty_cache()
    if _state.capture_error is not None:
        error, _state.capture_error = _state.capture_error, None
        raise error
    previous, _state.current = _state.current, Stream(name="capture")
    _state.capturing = npu_graph
    try:
        yield
        if _state.group is not None:
            raise RuntimeError("graph_task_group_begin without graph_task_group_end")
    finally:
        _state.capturing, _state.group, _state.current = None, None, previous


@contextlib.contextmanager
def replaying(npu_graph: NPUGraph):
    """A replay of `npu_graph`: its groups must have been updated (their events recorded)."""
    groups = [task.group for task in npu_graph.tasks if task.group is not None]
    unrecorded = [g for g in groups if g.event is not None and not g.event.recorded]
    if unrecorded:
        raise RuntimeError(f"replay waits on {len(unrecorded)} ExternalEvents nobody recorded "
                           "(on an NPU it would hang): update the task groups first")
    for group in groups:
        if group.event is not None:
            group.event.recorded = False  # the graph's event.reset
    _state.replaying, _state.replay_index = npu_graph, 0
    try:
        yield
        if _state.replay_index != len(npu_graph.tasks):
            raise RuntimeError(f"replay ran {_state.replay_index} of {len(npu_graph.tasks)} "
                               "captured host-argument calls")
    finally:
        _state.replaying = None
    npu_graph.replays += 1
    _state.synchronized = False


def graph_task_group_begin(stream: Stream) -> None:
    if _state.capturing is None or stream is not _state.current:
        raise RuntimeError("graph_task_group_begin needs the capturing stream")
    waited = _state.capturing.waits[-1] if _state.capturing.waits else None
    _state.group = TaskGroup(_state.capturing, waited)


def graph_task_group_end(stream: Stream) -> TaskGroup:
    group, _state.group = _state.group, None
    if group is None or group.task is None:
        raise RuntimeError("graph_task_group_end without a group holding one call")
    return group


def graph_task_update_begin(stream: Stream, handle: TaskGroup) -> None:
    if _state.capturing is not None or stream is not _state.current:
        raise RuntimeError("graph_task_update_begin needs the update stream as current stream "
                           "(torch.npu.stream(update_stream)), outside a capture")
    if stream is _state.default_stream:
        raise RuntimeError("the fake expects updates on a side stream")
    if not _state.synchronized:
        raise RuntimeError("a task group updated while the previous replay may still read it")
    _state.updating = handle


def graph_task_update_end(stream: Stream) -> None:
    _state.updating = None


@contextlib.contextmanager
def stream(side: Stream):
    previous, _state.current = _state.current, side
    try:
        yield
    finally:
        _state.current = previous


def _count_empty_cache() -> None:
    _state.empty_cache_calls += 1


npu = types.ModuleType("torch.npu")
npu.NPUGraph, npu.ExternalEvent, npu.Stream = NPUGraph, ExternalEvent, Stream
npu.graph, npu.stream = graph, stream
npu.graph_task_group_begin, npu.graph_task_group_end = graph_task_group_begin, graph_task_group_end
npu.graph_task_update_begin = graph_task_update_begin
npu.graph_task_update_end = graph_task_update_end
npu.current_stream = lambda device=None: _state.current
npu.synchronize = lambda device=None: None
npu.empty_cache = _count_empty_cache
npu.host_empty_cache = lambda: None
npu.graph_pool_handle = lambda: (0, 1)
npu.memory_snapshot = lambda: []
npu.state = _state


class ACLGraphOnCpu(CPUGraph):
    """kvgraph's CPU graph (reruns Python on replay) wrapped in the fake's capture and replay,
    so host arguments freeze as on an NPU."""

    def __init__(self, check_inputs: bool, name: str):
        super().__init__(check_inputs, name)
        self.npu_graph = NPUGraph()

    def capture(self, fn, args, pool):
        with graph(self.npu_graph, pool=pool):
            return super().capture(fn, args, pool)

    def replay(self, args):
        with replaying(self.npu_graph):
            return super().replay(args)

    def reset(self) -> None:
        super().reset()
        self.npu_graph.reset()


class NPUPlatformOnCpu(CPUPlatform):
    """The NPU platform's contract on CPU tensors: graphs freeze host arguments and shapes, and
    a batch runs once before it is captured."""

    needs_warmup = True
    freezes_shapes = True

    def __init__(self, attention_backend: str):
        self.attention_backend = attention_backend

    def make_graph(self, check_inputs, name="acl-graph", last=False):
        return ACLGraphOnCpu(check_inputs, name)


def install(monkeypatch) -> types.ModuleType:
    """Make `torch.npu` this fake for one test (torch has none without torch_npu)."""
    _state.reset()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu
