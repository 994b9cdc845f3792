"""A continuous-batching serving engine over `kvgraph.ModelRunner` (examples, not the library).

Core dependencies only at import: the checkpoint loader (safetensors, tokenizers), the chat
template (jinja2) and the server's packages are imported when first needed.
"""

from .async_engine import AsyncEngine
from .engine import LLMEngine
from .engine_args import add_engine_args, build_engine, run_if_worker
from .errors import EngineDeadError, RequestError, RequestFailed
from .request import Completion, FinishReason, Request, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "Completion",
    "EngineDeadError",
    "FinishReason",
    "LLMEngine",
    "Request",
    "RequestError",
    "RequestFailed",
    "RequestOutput",
    "SamplingParams",
    "add_engine_args",
    "build_engine",
    "run_if_worker",
]
