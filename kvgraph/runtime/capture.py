"""A runner's capture phase: each descriptor's graphs in turn, largest first, where a failed
descriptor costs only its own graphs, and the summary and table of what the phase made."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from kvgraph.compilation.debug import DumpSession
from kvgraph.config import GraphMode
from kvgraph.forward_context import BatchDescriptor
from kvgraph.runtime.graphs import GraphSet, graph_key
from kvgraph.progress import Progress
from kvgraph.runtime.rank_agreement import RankAgreement

# The runner's log: capture was part of it, and users (and the tests' guard against silent
# capture failures) listen for these warnings there.
logger = logging.getLogger("kvgraph.runtime.runner")

GraphKey = tuple[GraphMode, BatchDescriptor]
CaptureOne = Callable[[GraphMode, BatchDescriptor], None]


def capture_graphs(graphs: GraphSet, wanted: list[GraphKey], capture_one: CaptureOne,
                   ranks: RankAgreement, dump: DumpSession) -> dict[str, Any]:
    """Capture each key of `wanted` that `graphs` lack, in order, with `capture_one(mode,
    descriptor)`, in one capture phase and together with the other ranks; the summary.

    `bytes` and `bytes_by_descriptor` in the summary are what all of `graphs` hold, not only
    this phase's; `failed` names the descriptors whose capture failed (logged, never raised).
    The summary and its table, a row per descriptor, go into the debug dump (capture.json).
    """
    keys = [key for key in wanted if not graphs.has(*key)]
    if keys:
        ranks.tp.check_capturable()
    ranks.same("the descriptors to capture, in order", [graph_key(*key) for key in keys])
    before = graphs.snapshot()["captures"]
    start = time.perf_counter()
    failed, table = [], []
    with (ranks.together("capture"), graphs.capture_phase(),
          Progress("descriptors captured", len(keys)) as progress):
        for mode, descriptor in keys:
            row = _capture_or_warn(graphs, mode, descriptor, capture_one)
            if row["error"]:
                failed.append(row["descriptor"])
            table.append(row)
            progress.advance()
    # A descriptor captured on one rank only would replay its collectives alone.
    ranks.same("the descriptors whose capture failed", failed)
    held = graphs.snapshot()
    summary = {"descriptors": len(keys) - len(failed), "graphs": held["captures"] - before,
               "seconds": time.perf_counter() - start, "bytes": held["graph_bytes"],
               "bytes_by_descriptor": held["bytes_by_descriptor"], "failed": failed}
    logger.info("kvgraph: captured %d descriptors (%d graphs: one per piece each) in %.2f s; "
                "this runner's graphs hold %.1f MiB", summary["descriptors"],
                summary["graphs"], summary["seconds"], summary["bytes"] / 2**20)
    dump.runtime_json("capture", {**summary, "table": table}, in_events=True)
    return summary


def _capture_or_warn(graphs: GraphSet, mode: GraphMode, descriptor: BatchDescriptor,
                     capture_one: CaptureOne) -> dict[str, Any]:
    """Capture one descriptor; its row of the capture table (`error` None if it worked)."""
    row = {"descriptor": graph_key(mode, descriptor), "mode": mode.value,
           "num_tokens": descriptor.num_tokens, "num_reqs": descriptor.num_reqs,
           "uniform_decode": descriptor.uniform_decode, "error": None}
    start = time.perf_counter()
    try:
        capture_one(mode, descriptor)
    except Exception as error:  # noqa: BLE001 - one descriptor's failure costs only its graph
        row["error"] = f"{type(error).__name__}: {error}"
        logger.warning("kvgraph: capturing %s failed (%s); its batches will run without "
                       "graphs", row["descriptor"], row["error"])
    row.update(graphs.descriptor_report(mode, descriptor), seconds=time.perf_counter() - start)
    return row
