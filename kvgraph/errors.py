"""Exceptions kvgraph raises for input a caller can fix."""


class KVCacheError(ValueError):
    """A KV cache, spec or binding does not match the attention layer it is meant for."""


class ForwardContextError(RuntimeError):
    """Attention ran without the per-step forward context it reads its metadata from."""


class BatchError(ValueError):
    """A batch of request chunks cannot be turned into attention metadata."""


class PlatformError(RuntimeError):
    """The device asked for cannot be used (no such platform, or its runtime is missing)."""


class GraphError(RuntimeError):
    """A captured graph was replayed in a way that breaks the graph contract."""


class CompileError(RuntimeError):
    """The model could not be compiled as its config asks; the message and `__cause__` say why
    (an inductor build with `on_compile_error="raise"`, a compile cache kvgraph may not trust,
    a model Dynamo cannot trace)."""


class RunnerError(RuntimeError):
    """A ModelRunner cannot do what was asked: it was closed, or its model belongs to another
    live runner."""


class VerifyError(RuntimeError):
    """A verified step whose graphs gave other logits or cache writes than eager
    (`verify_action="raise"`); the message names the descriptor and where they part."""


class ConfigError(ValueError):
    """A setting (a config field, option, flag or `KVGRAPH_*` variable) cannot be used as given.

    `field` names the setting; the message says what was expected, what came and how to fix it.
    Also raised for a compile cache dir that kvgraph may not trust (see kvgraph/cache_dir.py).
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
