"""The two ends of each step's broadcast (over step_channel.py): rank 0's runner, the workers'
loop.

Rank 0's engine runs a `TensorParallelRunner`, which has the `ModelRunner` face the engine
uses; its `execute(chunks, kv_connector_metadata)` broadcasts both, then runs them on rank 0's
shard. Every worker runs `follow_steps`: receive a batch, run it, until rank 0 says stop. So
every rank runs the same `execute` calls in the same order (the engine's one-request-at-a-time
retries included: each is a broadcast too), which is what keeps their collectives paired. With
a KV connector, each rank's report comes back to rank 0 after every step all ranks ran, and a
transfer without a forward (`kv_connector.transfer`) is broadcast too (tp_kv_connector.py).

Failures:
- A batch every rank refuses (`kvgraph.BatchError`: checked before anything runs or any
  collective starts) raises on each; rank 0's engine deals with it as with one rank, the
  workers go on to the next message.
- Anything else is fatal (`RankFailed`): a worker that died, a broadcast that failed, a step
  that failed on rank 0 some other way (the ranks may have parted ways mid-step, and a
  collective cannot be taken back). The message names the dead rank and its exit code where
  rank 0 spawned it; under torchrun, torchrun's own report names it.
- A worker whose step fails other than by BatchError raises out of `follow_steps` (its process
  exits, logging why), and rank 0's next collective fails: see above. Gathering the KV
  connector reports is such a collective: it fails on a rank that died, and after the TP
  group's timeout on one that hangs.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Callable, Protocol, Sequence

import torch

import kvgraph
from kvgraph.kv_transfer import KVConnectorMetadata

from .errors import EngineDeadError
from .step_channel import STEP, STOP, TRANSFER, StepChannel
from .tp_kv_connector import TensorParallelKVConnector, report_to_rank_zero

# How long rank 0 waits for a worker's exit status once a socket to it closed: the socket closes
# as the worker dies, and its exit status comes after Python's teardown, which took over 2 s on
# a loaded 2-core VM (rank 0 then reported the closed socket without naming the rank). Only a
# failure waits, and only while no worker has exited.
EXIT_STATUS_WAIT_S = 15.0

logger = logging.getLogger(__name__)

# How much of a peer's error message goes into a RankFailed's.
BRIEF_CHARS = 160


class RankFailed(EngineDeadError):
    """A tensor-parallel rank died or failed: no rank can go on, so the engine stops.

    `rank` and `exitcode` name the rank when it is known (None otherwise).
    """

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class Workers(Protocol):
    """What rank 0 needs of the ranks it spawned (tp_workers.WorkerProcesses)."""

    pids: dict[int, int]

    def first_dead(self, wait_s: float = 0.0) -> tuple[int, int] | None: ...

    def stop(self) -> dict[int, int | None]: ...


def brief(error: BaseException) -> str:
    """`Type: first line of the message`, at most BRIEF_CHARS of it (gloo's run long)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > BRIEF_CHARS:
        text = text[:BRIEF_CHARS] + "..."
    return f"{type(error).__name__}: {text}"


def exit_description(exitcode: int) -> str:
    """`exit code N`, or the signal a negative code stands for."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            pass
    return f"exit code {exitcode}"


class TensorParallelRunner:
    """Rank 0's runner: a `ModelRunner` whose every `execute` is broadcast to the workers.

    It offers what the engine and the entry points use (`execute`, `kv_connector`, `limits`,
    `vocab_size`, `device`, `model`, `hidden_states`, `config`, `kv_caches`, `attn_backend`,
    `tp`, `stats`, `close`); nothing else, so nothing can run on rank 0 alone by mistake (a
    `capture` there would wait for the workers' part until the timeout). Logits are rank 0's:
    every rank holds the full logits after the replicated lm_head. `close()` tells the workers
    to stop, then waits for them; `on_close` (leaving the process group) runs last.
    """

    def __init__(self, runner: kvgraph.ModelRunner, channel: StepChannel,
                 workers: Workers | None = None, on_close: Callable[[], None] | None = None):
        self._runner = runner
        self._channel = channel
        self.workers = workers  # None under torchrun
        self._on_close = on_close
        self._failed: RankFailed | None = None
        self._closed = False
        self.steps_broadcast = 0
        self.kv_connector = runner.kv_connector and TensorParallelKVConnector(
            runner.kv_connector, channel, self._transfer_kv)

    # --- the ModelRunner face --------------------------------------------------------------

    limits = property(lambda self: self._runner.limits)
    vocab_size = property(lambda self: self._runner.vocab_size)
    device = property(lambda self: self._runner.device)
    model = property(lambda self: self._runner.model)
    hidden_states = property(lambda self: self._runner.hidden_states)
    config = property(lambda self: self._runner.config)
    kv_caches = property(lambda self: self._runner.kv_caches)
    attn_backend = property(lambda self: self._runner.attn_backend)
    tp = property(lambda self: self._runner.tp)

    @property
    def world_size(self) -> int:
        return self._channel.world_size

    def execute(self, chunks: Sequence[kvgraph.RequestChunk],
                kv_connector_metadata: KVConnectorMetadata | None = None) -> torch.Tensor:
        """Broadcast one step, then run it here; rank 0's logits, `[len(chunks), vocab]`.

        A BatchError is the batch's (every rank refused it); any other error is a RankFailed.
        """
        chunks = list(chunks)
        return self._everywhere(STEP, (chunks, kv_connector_metadata), "a model step",
                                lambda: self._runner.execute(chunks, kv_connector_metadata))

    def _transfer_kv(self, metadata: KVConnectorMetadata) -> None:
        self._everywhere(TRANSFER, metadata, "a KV transfer",
                         lambda: self._runner.kv_connector.transfer(metadata))

    def _everywhere(self, kind: str, payload: Any, what: str, run_here: Callable[[], Any]) -> Any:
        """Broadcast a message, run its part here, then (with a KV connector) merge every
        rank's report; what `run_here` returned."""
        if self._closed:
            raise kvgraph.RunnerError("this TensorParallelRunner was closed (its workers "
                                      "stopped); build a new engine to run the model")
        if self._failed is not None:
            raise self._failed
        self._broadcast(kind, payload)
        if self.kv_connector is not None:
            self.kv_connector.clear()
        try:
            result = run_here()
        except kvgraph.BatchError:
            raise  # refused before any collective, on every rank alike: all go on
        except Exception as error:  # noqa: BLE001 - fatal whatever it is; said so below
            raise self._fail(f"{what} failed on rank 0: {brief(error)}") from error
        if self.kv_connector is not None:
            try:
                self.kv_connector.collect()
            except Exception as error:  # noqa: BLE001 - a rank gone or stuck after its step
                raise self._fail("gathering the ranks' KV connector reports failed: "
                                 f"{brief(error)}") from error
        return result

    def check_ranks(self) -> None:
        """Raise the RankFailed of a spawned worker that has died (an idle engine asks, so that
        /health knows before the next request does)."""
        if self._failed is not None:
            raise self._failed
        if self._closed:
            return  # its workers were stopped on purpose
        if self.workers is not None and self.workers.first_dead() is not None:
            raise self._fail("it was found dead while the engine was idle")

    def _broadcast(self, kind: str, payload: Any) -> None:
        dead = self.workers.first_dead() if self.workers else None
        if dead is not None:
            raise self._fail("it was found dead before a step")
        try:
            self._channel.send(kind, payload)
        except Exception as error:  # noqa: BLE001 - a peer gone mid-broadcast
            raise self._fail(f"broadcasting a step failed: {brief(error)}") from error
        self.steps_broadcast += 1

    def _fail(self, what: str) -> RankFailed:
        """The fatal error to raise (kept: every later step raises it too), naming the dead
        rank when one of the spawned ones is dead."""
        dead = self.workers.first_dead(wait_s=EXIT_STATUS_WAIT_S) if self.workers else None
        if dead is not None:
            rank, code = dead
            message = (f"tensor-parallel rank {rank} (pid {self.workers.pids[rank]}) died, "
                       f"{exit_description(code)}, and the engine cannot run without it ({what})")
            self._failed = RankFailed(message, rank, code)
        else:
            self._failed = RankFailed(
                f"{what}; with tensor parallelism a failed step leaves the ranks out of step "
                "(a collective cannot be taken back), so the engine stops (a worker's log, "
                "or torchrun's report, says which rank failed)")
        return self._failed

    def stats(self) -> dict[str, Any]:
        """Rank 0's runner stats, and the TP size and how many steps were broadcast."""
        return {**self._runner.stats(),
                "tensor_parallel": {"size": self.world_size,
                                    "steps_broadcast": self.steps_broadcast}}

    def close(self) -> None:
        """Tell the workers to stop, close rank 0's runner and wait for the workers to exit
        (killing any that do not); then `on_close`. Safe to call twice, and after a failure."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._failed is None:
                self._channel.send(STOP)
        except Exception as error:  # noqa: BLE001 - a worker already gone; stop the rest anyway
            logger.warning("telling the workers to stop failed (%s)", error)
        finally:
            self._runner.close()
            if self.workers is not None:
                self.workers.stop()
            if self._on_close is not None:
                self._on_close()


def follow_steps(runner: kvgraph.ModelRunner, channel: StepChannel) -> int:
    """A worker's loop: run each step rank 0 broadcasts, until it says stop; the steps run.

    A batch refused with a BatchError is skipped (rank 0 refused it too). After any other step
    (or transfer) its KV connector's report goes to rank 0. Any other error is raised: this
    rank is out of step with the others and must stop. A rank 0 that went away without saying
    stop is a RankFailed.
    """
    steps = 0
    while True:
        try:
            kind, payload = channel.receive()
        except Exception as error:  # noqa: BLE001 - rank 0 is gone
            raise _rank_zero_gone(channel, error) from error
        if kind == STOP:
            return steps
        if kind not in (STEP, TRANSFER):
            raise RankFailed(f"rank {channel.rank}: unknown message {kind!r} from rank 0 "
                             f"(expected {STEP!r}, {TRANSFER!r} or {STOP!r})", rank=0)
        steps += 1
        try:
            if kind == STEP:
                runner.execute(*payload)
            else:
                runner.kv_connector.transfer(payload)
        except kvgraph.BatchError as error:
            logger.debug("rank %d: a batch refused on every rank: %s", channel.rank, error)
            continue
        try:
            report_to_rank_zero(runner, channel)
        except Exception as error:  # noqa: BLE001 - rank 0 is gone
            raise _rank_zero_gone(channel, error) from error


def _rank_zero_gone(channel: StepChannel, error: Exception) -> RankFailed:
    """A worker's error for a message from, or a report to, rank 0 that failed."""
    return RankFailed(f"rank {channel.rank}: rank 0 went away without saying stop "
                      f"({brief(error)})", rank=0)
