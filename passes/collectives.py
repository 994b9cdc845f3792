"""Collectives and their waits: the pairs no pass may drop or move apart, and no split may cut.

Dynamo traces a functional collective into `_c10d_functional.<op>` followed by
`_c10d_functional.wait_tensor` on its result. The collective only starts the work; the wait is
where its result becomes valid. A pass that erased a wait would read a buffer still being
written, and a split that put the wait in another piece (or a graph of its own) would leave a
piece returning an unfinished result.
"""

from __future__ import annotations

from torch import fx

from passes.op_match import is_op_call

WAIT_TENSOR = "_c10d_functional::wait_tensor"


class CollectiveWaitError(RuntimeError):
    """A pass or a split broke a collective/wait pair; the message names the pass and the nodes."""


def waits(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's `wait_tensor` calls, in order."""
    return [node for node in gm.graph.nodes if is_op_call(node, (WAIT_TENSOR,))]


def wait_signature(gm: fx.GraphModule) -> list[str]:
    """What each wait waits on (its input's target), in order: equal before and after a pass
    that kept every pair."""
    return [str(wait.args[0].target if isinstance(wait.args[0], fx.Node) else wait.args[0])
            for wait in waits(gm)]


def check_waits_kept(before: list[str], gm: fx.GraphModule, pass_name: str) -> None:
    """Raise if `pass_name` dropped, added or re-pointed a wait (see `wait_signature`)."""
    after = wait_signature(gm)
    if after != before:
        raise CollectiveWaitError(
            f"pass {pass_name!r} changed the graph's collective waits: before it "
            f"{len(before)} wait_tensor calls on {before}, after it {len(after)} on {after}; "
            "passes must never drop, move or eliminate a wait_tensor")


def keep_waits_with_collectives(partition_of: dict[fx.Node, int]) -> None:
    """Put each wait in the partition of the node it waits on (in place), so a split never
    separates a collective from its wait, even when the collective is a splitting op."""
    for node, partition in list(partition_of.items()):
        if is_op_call(node, (WAIT_TENSOR,)) and isinstance(node.args[0], fx.Node):
            source = node.args[0]
            if source in partition_of:
                partition_of[node] = partition_of[source]
