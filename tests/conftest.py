"""Shared test setup: the `cuda` marker skips without a GPU; the compile cache dir and fresh
Dynamo state fixtures, a small tmpfs for full-disk faults, a check that no test leaves
torch.distributed initialised, and the compute threads and frozen start-up objects put back after
each test.

Test modules import no other test module: helpers shared between them live in tests/support/
(models, schedules and `dynamo_capture` in scenario.py, the attention references in
attention_reference.py, the example engine's and server's in engines.py and servers.py, and so
on: each module's docstring says what it holds), and fixtures shared by one directory's tests in
that directory's conftest.py (tests/examples/conftest.py's `checkpoint`,
tests/examples/models/conftest.py's `no_cache`)."""

import gc
import logging
import os
import subprocess
from pathlib import Path

# Without an NVIDIA GPU, Triton kernels run in Triton's CPU interpreter (set before Triton
# decorates any kernel: kvgraph imports its Triton backend only on first use).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# pytest-xdist's workers (`-n N`) share the cores: each gets its part of torch's threads, since
# OpenMP threads that outnumber the cores spin on each other's (a test that wants another
# count sets it, and `compute_threads_kept` puts this one back).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, torch.get_num_threads()
                              // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Helper modules' asserts get pytest's detailed messages, as a test module's do.
pytest.register_assert_rewrite("tests.support.attention_reference", "tests.support.scenario",
                               "tests.support.servers")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
    """One kvgraph (and so inductor) cache dir for the whole run, shared by pytest-xdist's
    workers (their base temp dirs share a parent): each cold compile happens once per run.
    Both caches write whole files by rename, so workers may fill it at once."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return str(tmp_path_factory.mktemp("kvgraph-cache"))
    shared = tmp_path_factory.getbasetemp().parent / "kvgraph-cache"
    shared.mkdir(mode=0o700, exist_ok=True)
    return str(shared)


@pytest.fixture
def inductor_config(compile_cache_dir):
    from kvgraph import CompilationConfig

    return CompilationConfig(piece_compiler="inductor", compile_sizes=(4,), cache_dir=compile_cache_dir)


def _reset_compile_state() -> None:
    from kvgraph.compilation.counters import compile_counters
    from kvgraph.runtime.graphs import graph_counters

    torch._dynamo.reset()
    compile_counters.reset()
    graph_counters.reset()


@pytest.fixture
def fresh_compile_state():
    """Dynamo's caches and kvgraph's counters cleared before and after the test: the one
    fixture for tests that trace or count (`pytestmark = pytest.mark.usefixtures(...)`)."""
    _reset_compile_state()
    yield
    _reset_compile_state()


class _CaptureFailures(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        if record.getMessage().startswith("kvgraph: capturing"):
            self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def captures_never_fail_silently(request):
    """A failed capture only warns (the runner goes on without that graph), so a parity test
    would still pass with graphs missing: here it fails the test, unless the test asks for
    `allow_capture_failures`."""
    handler = _CaptureFailures()
    logger = logging.getLogger("kvgraph.runtime.runner")
    logger.addHandler(handler)
    yield
    logger.removeHandler(handler)
    if "allow_capture_failures" not in request.fixturenames:
        assert not handler.messages, handler.messages


@pytest.fixture(autouse=True)
def tensor_parallel_size_one():
    """TP=1 is the default path: no test leaves torch.distributed initialised in the test
    process (two-rank tests spawn their ranks), so every other test runs without it."""
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), \
        "the test left torch.distributed initialised in the test process"


@pytest.fixture(autouse=True)
def compute_threads_kept():
    """Building an engine sets the process's compute threads (examples/engine/threads.py):
    each test gets back the count it started with, so no test runs on another's choice."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def start_up_objects_unfrozen():
    """Building an engine freezes start-up objects out of the collector's scans
    (examples/engine/startup_gc.py): after each test they are handed back, so engines that
    tests drop are still collected."""
    yield
    gc.unfreeze()


@pytest.fixture
def allow_capture_failures():
    """Marks a test that makes captures fail on purpose."""


@pytest.fixture
def tmpfs(tmp_path):
    """`mount(size)`: a new tmpfs of `size` bytes under tmp_path, unmounted after the test."""
    mounted = []

    def mount(size: int) -> Path:
        point = tmp_path / f"tmpfs-{len(mounted)}"
        point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                                 str(point)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root): {result.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "--lazy", str(point)], check=True)
