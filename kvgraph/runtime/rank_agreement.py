"""Ranks that agree: every TP rank compiles, captures and runs the same sequence, or all fail
saying which rank and why.

A rank whose descriptor differs from its peers' would replay a graph whose collectives its
peers never join: on NCCL that is a hang, not an error (vllm#25906). So the runner checks, over
a gloo group of its own with a timeout (`TensorParallelGroup.cpu_group`), that the ranks
capture the same descriptors in the same order and, when asked, run the same descriptor each
step; and it ends each phase (compile, capture) by exchanging every rank's outcome, so an error
on one rank is raised on all of them as "rank N failed ...".

A rank blocked inside a model collective (its peer failed before joining it) waits for the TP
group's own timeout (`init_process_group(timeout=...)`), then joins the exchange; the failed
peer's message is also left in torch.distributed's store, so it is found even when the
exchange itself cannot complete.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Iterator

import torch.distributed as dist

from kvgraph.distributed import TensorParallelGroup
from kvgraph.errors import RunnerError

logger = logging.getLogger(__name__)

# Runners made in this process, in order: the same count on every rank, so a failure record
# in the shared store names the runner it belongs to.
_agreements = itertools.count()


class RankAgreement:
    """The agreement checks of one runner over its TP group (all no-ops at size 1)."""

    def __init__(self, tp: TensorParallelGroup):
        self.tp = tp
        self.active = tp.world_size > 1
        self._id = next(_agreements) if self.active else -1
        self._group = tp.cpu_group  # collective: every rank builds its runner at the same point

    def same(self, what: str, value: Any) -> None:
        """Raise RunnerError on every rank unless all ranks hold an equal `value`."""
        if not self.active:
            return
        values = self._gather(what, value)
        if any(v != values[0] for v in values):
            raise RunnerError(f"the tensor-parallel ranks disagree on {what}: "
                              f"{_difference(values)}. Every rank must run the same sequence, "
                              "or their collectives hang")

    @contextlib.contextmanager
    def together(self, what: str) -> Iterator[None]:
        """Run a phase on every rank; if it fails on any, raise "rank N failed ..." on all."""
        if not self.active:
            yield
            return
        try:
            yield
        except Exception as error:
            self._record_failure(error)
            self._outcomes(what, error)
            raise  # _outcomes raised already; kept for readers and type checkers
        self._outcomes(what, None)

    def _outcomes(self, what: str, error: BaseException | None) -> None:
        mine = None if error is None else _describe(error)
        try:
            outcomes = self._gather(what, mine)
        except RunnerError as unreachable:
            raise self._recorded_failure(what, mine, unreachable) from error or unreachable
        failed = [(rank, message) for rank, message in enumerate(outcomes) if message]
        if failed:
            raise RunnerError(_failure_message(what, failed)) from error

    def _gather(self, what: str, value: Any) -> list[Any]:
        values: list[Any] = [None] * self.tp.world_size
        try:
            dist.all_gather_object(values, value, group=self._group)
        except RuntimeError as error:
            raise RunnerError(
                f"rank {self.tp.rank} could not exchange {what} with its tensor-parallel peers "
                f"within {self.tp.timeout_s:g} s ({type(error).__name__}: "
                f"{_first_line(error)}): a peer died, failed earlier or is elsewhere") from error
        return values

    def _store_key(self, rank: int) -> str:
        return f"kvgraph/failure/{self._id}/rank{rank}"

    def _record_failure(self, error: BaseException) -> None:
        store = _default_store()
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(self._store_key(self.tp.rank), _describe(error))

    def _recorded_failure(self, what: str, mine: str | None, unreachable: RunnerError
                          ) -> RunnerError:
        """This rank's and its peers' failures (theirs as left in the store), or `unreachable`
        when there is none."""
        store = _default_store()
        failed = [] if mine is None else [(self.tp.rank, f"{mine} (its peers could not be "
                                                         "told: the exchange failed)")]
        for rank in range(self.tp.world_size):
            key = self._store_key(rank)
            with contextlib.suppress(Exception):
                if rank != self.tp.rank and store is not None and store.check([key]):
                    failed.append((rank, store.get(key).decode()))
        return RunnerError(_failure_message(what, failed)) if failed else unreachable


def _failure_message(what: str, failed: list[tuple[int, str]]) -> str:
    # A rank that failed only because a peer vanished from a collective is listed last.
    failed = sorted(failed, key=lambda item: (_is_consequence(item[1]), item[0]))
    return "; ".join(f"rank {rank} failed ({what}): {message}" for rank, message in failed)


def _is_consequence(message: str) -> bool:
    return any(word in message for word in ("DistBackendError", "timed out", "Timed out",
                                            "Connection closed", "Connection reset"))


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _difference(values: list[Any]) -> str:
    """Where the ranks' values part: the first differing entry of equal-typed lists."""
    if all(isinstance(v, (list, tuple)) for v in values):
        for i in range(max(map(len, values))):
            entries = [v[i] if i < len(v) else "(none)" for v in values]
            if any(e != entries[0] for e in entries):
                return f"entry {i} of {[len(v) for v in values]}: " + "; ".join(
                    f"rank {r}: {_short(e)}" for r, e in enumerate(entries))
    return "; ".join(f"rank {r}: {_short(v)}" for r, v in enumerate(values))


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
