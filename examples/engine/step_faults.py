"""The model step's faults kept with their requests: a batch whose step raises runs again one
request at a time, and only the requests that fail alone too end (see LLMEngine.step)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

import kvgraph
from kvgraph.kv_transfer import KVConnectorMetadata

from .errors import EngineDeadError
from .request import Request, RequestOutput
from .scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

Execute = Callable[[list[ScheduledChunk], KVConnectorMetadata | None], list[torch.Tensor]]
Fail = Callable[[Request, str, Exception], RequestOutput]


def forward_or_retry(chunks: list[ScheduledChunk], metadata: KVConnectorMetadata | None,
                     execute: Execute, fail: Fail
                     ) -> tuple[list[tuple[ScheduledChunk, torch.Tensor]], list[RequestOutput],
                                bool]:
    """Each chunk that ran, with its logits rows; the outputs of the requests that failed
    (`fail`ed); whether the batch ran again request by request.

    Retries run without the KV connector's metadata: its loads ran before the batch's
    forward, and the saves of a step that failed are not worth making."""
    try:
        return list(zip(chunks, execute(chunks, metadata))), [], False
    except EngineDeadError:
        raise  # no request's fault, and no retry can help
    except kvgraph.VerifyError as error:
        # The step's graphs and eager parted (verify_action "raise"): the step's answer is
        # in doubt for all its requests, and running each alone would check, and fail, again.
        return [], [fail(chunk.request, "verify found the graphs and eager apart on this step",
                         error) for chunk in chunks], False
    except Exception as error:  # noqa: BLE001 - whose fault it is, is found below
        logger.warning("a model step of %d requests failed (%s: %s); running each alone",
                       len(chunks), type(error).__name__, error)
    # Running a chunk again is safe: it rewrites the same cache slots with the same values.
    ran, failed = [], []
    for chunk in chunks:
        try:
            ran.append((chunk, execute([chunk], None)[0]))
        except EngineDeadError:
            raise
        except Exception as error:  # noqa: BLE001 - this request's fault
            failed.append((chunk.request, error))
    what = ("the model step failed for this request, in its batch and alone"
            if ran or len(chunks) == 1 else
            f"the model step failed for all {len(chunks)} requests of its batch and for "
            "each alone: it is broken, not one request")
    return ran, [fail(request, what, error) for request, error in failed], True
