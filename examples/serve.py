"""An OpenAI-style HTTP server over the continuous-batching engine and kvgraph's graph modes.

    python examples/serve.py --model PATH|llama|mla [--preset tiny] [--graph-mode ...] [--port N]

Endpoints: POST /v1/completions and /v1/chat/completions (the latter when the checkpoint has
a chat template), both streaming over server-sent events with `"stream": true`; GET /health,
/v1/models and /metrics (Prometheus). The engine runs in a process of its own
(engine/engine_process.py; `--engine-loop thread` keeps it in a thread of this one); handlers
only send it requests and await their tokens. Needs the `serve` extra (fastapi, uvicorn,
prometheus-client, safetensors, tokenizers, jinja2), imported only once the flags are parsed:
`--help` needs none of it. The app itself is examples/engine/http_app.py; this file parses the
flags, checks them (examples/engine/preflight.py: a mistake is one line and exit status 2, before
anything is built), binds the port, starts the engine and serves on that port.

Limits (their values in --help; constants of examples/engine/json_body.py): a request body
over MAX_BODY_MIB is a 413; one that nests arrays and objects deeper than MAX_JSON_DEPTH
levels, holds a lone surrogate in any string, or a number that is not finite, an integer
outside int64 or a bool where a number belongs, is a 400 naming the field. Streamed or not,
the status is sent once the request has its first token, so a request refused or failed that
early gets a real 4xx or 500. A failure while serving one request fails it alone (500), never
the others in flight. /metrics counts every response by endpoint and status, 500s included.

Tensor parallelism: `--tensor-parallel-size N` shards the model over N ranks. The engine's
process is rank 0: it spawns ranks 1..N-1 (torch.multiprocessing; a FileStore in a temp dir
is their rendezvous) and broadcasts each step's batch to them over a gloo group; every rank
runs it on its shard. The same flags work under torchrun, which starts every rank itself:

    torchrun --nproc-per-node 2 examples/serve.py --tensor-parallel-size 2 ...

(rank 0 serves, its engine in a thread; the others follow it). A rank that dies stops the
server: the requests in flight fail (500), /health answers 503, and the process exits with
status 1, its log naming the rank and its exit code (under torchrun, torchrun's report names
it). gloo on the CPU,
nccl on CUDA (rank r on cuda:r), hccl on Ascend; `--distributed-timeout` bounds every wait for
a peer.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if __name__ == "__main__" and sys.stderr.isatty() and not {"-h", "--help"} & set(sys.argv):
    # Importing torch, Dynamo and kvgraph takes seconds; a person at a terminal hears first.
    print(f"{Path(sys.argv[0]).name}: starting (importing torch and kvgraph)", file=sys.stderr,
          flush=True)

from kvgraph.runtime.platforms.cpu import CPUPlatform

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvgraph.kv_transfer import KVTransferConfig

if __package__:
    from .engine import AsyncEngine, EngineDeadError, add_engine_args, build_engine, run_if_worker
    from .engine.burst_window import MAX_GAP_MS, burst_window
    from .engine.engine_core import STARTUP_ERRORS
    from .engine.engine_process import EngineProcess, EngineStartError
    from .engine.flag_types import float_in, port, seconds
    from .engine.json_body import MAX_BODY_MIB, MAX_JSON_DEPTH
    from .engine.liveness import DEFAULT_STUCK_STEP_S, StepWatch
    from .engine.preflight import SERVE_PACKAGES, bind, preflight, usage_errors
    from .engine.startup_gc import freeze_startup_objects
    from .engine.termination import DEFAULT_SHUTDOWN_S
    from .engine.tp_launch import torchrun_rendezvous
    from .models import MODELS
else:  # run as `python examples/serve.py`: this folder, not the repo root, is on sys.path
    from engine import AsyncEngine, EngineDeadError, add_engine_args, build_engine, run_if_worker
    from engine.burst_window import MAX_GAP_MS, burst_window
    from engine.engine_core import STARTUP_ERRORS
    from engine.engine_process import EngineProcess, EngineStartError
    from engine.flag_types import float_in, port, seconds
    from engine.json_body import MAX_BODY_MIB, MAX_JSON_DEPTH
    from engine.liveness import DEFAULT_STUCK_STEP_S, StepWatch
    from engine.preflight import SERVE_PACKAGES, bind, preflight, usage_errors
    from engine.startup_gc import freeze_startup_objects
    from engine.termination import DEFAULT_SHUTDOWN_S
    from engine.tp_launch import torchrun_rendezvous
    from models import MODELS

PROG = Path(__file__).name
ENGINE_LOOPS = ("process", "thread")
LIMITS = (f"limits: request bodies up to {MAX_BODY_MIB} MiB (413 past it); JSON nested up to "
          f"{MAX_JSON_DEPTH} levels; numbers finite, integers within int64, strings valid "
          "Unicode (400 naming the field otherwise)")
logger = logging.getLogger("examples.serve")


class BackgroundServer:
    """Serves `app` from a thread on `host` and a free port (tests, benchmarks)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1"):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died during start-up")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()


def build_app(engine: AsyncEngine | EngineProcess, model_name: str,
              kv_transfer: KVTransferConfig | None = None) -> FastAPI:
    """engine/http_app.py's app over `engine`, imported here: it needs the serve extra."""
    if __package__:
        from .engine.http_app import build_app as http_app
    else:
        from engine.http_app import build_app as http_app
    return http_app(engine, model_name, kv_transfer)


def model_name(args: argparse.Namespace) -> str:
    path = Path(args.model)
    return path.name if path.is_dir() else f"{args.model}-{args.preset}"


def build_parser() -> argparse.ArgumentParser:
    """This script's flags: the engine's, kvgraph's and its own."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=LIMITS)
    add_engine_args(parser, preset="small")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default %(default)s: this machine only)")
    parser.add_argument("--port", type=port, default=8000,
                        help="the TCP port to listen on (default %(default)s; 0: any free one)")
    parser.add_argument("--engine-loop", choices=ENGINE_LOOPS, default="process",
                        help="where the engine steps: a process of its own (default; the server "
                        "and the engine then never wait for each other's GIL), or a thread of "
                        "the server's process (always so under torchrun)")
    parser.add_argument("--burst-gap-ms", type=float_in(0, MAX_GAP_MS), metavar="MS",
                        help="when a request wakes an idle engine, take the requests that "
                        "follow it each within MS of the last (for 4 gaps at most) before "
                        "stepping, so a burst is prefilled together (default: the device's, "
                        f"{CPUPlatform.default_burst_gap_ms:g} on the CPU, 0 on an accelerator; "
                        f"at most {MAX_GAP_MS:g})")
    parser.add_argument("--stuck-step-timeout", type=seconds(), metavar="SECONDS",
                        default=DEFAULT_STUCK_STEP_S,
                        help="/health answers 503 once one engine step has run this long "
                        "(default %(default)g)")
    parser.add_argument("--shutdown-timeout", type=seconds(0, 3600, low_open=False),
                        metavar="SECONDS", default=DEFAULT_SHUTDOWN_S,
                        help="on SIGTERM, how long requests in flight may go on before they "
                        "fail and the server exits (default %(default)g)")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class Terminated(Exception):
    """SIGTERM reached the server: stop as after Ctrl-C."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    preflight(args, MODELS, PROG, SERVE_PACKAGES)  # a mistake: one line and exit status 2
    worker_exit = run_if_worker(args, MODELS)  # under torchrun, ranks > 0 follow rank 0 here
    if worker_exit is not None:
        raise SystemExit(worker_exit)
    with usage_errors(PROG):  # a port in use is refused now, not once the engine is built
        listener = bind(args.host, args.port)
    with listener:
        run_server(args, listener)


def run_server(args: argparse.Namespace, listener: socket.socket) -> None:
    """Start the engine, then serve on `listener` until shut down; exit 1 if the engine does
    not start or dies."""
    # uvicorn takes SIGTERM while it serves, shuts down, then raises the signal again: here it
    # (or one during start-up) becomes an exception, so the `finally` below stops the engine
    # and its ranks and the process exits 0, rather than dying of the signal on the spot.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        engine = start_engine(args)  # logs the compile and capture summary
    # Before serving: a server that cannot load or compile its model never starts.
    except (EngineStartError, *STARTUP_ERRORS) as error:
        logger.error("not serving: %s", error)
        raise SystemExit(1) from None
    except Terminated:
        logger.info("SIGTERM during start-up: not serving")
        return
    try:
        fatal = serve(engine, args, listener)
    except (KeyboardInterrupt, Terminated):  # uvicorn raises them again once it has shut down
        fatal = None
    finally:
        engine.close()  # with tensor parallelism: the other ranks stop too
    if fatal is not None:
        logger.error("the server stopped: %s", fatal)
        raise SystemExit(1)


def start_engine(args: argparse.Namespace) -> AsyncEngine | EngineProcess:
    """The engine the server drives, built: in a process of its own, or (`--engine-loop
    thread`, or under torchrun, where this process is rank 0) in a thread of this one."""
    watch = StepWatch(args.stuck_step_timeout)
    if args.engine_loop == "process" and torchrun_rendezvous() is None:
        engine = EngineProcess(args, MODELS, step_watch=watch)
        logger.info("the engine runs in process %d", engine.pid)
        return engine
    if args.engine_loop == "process":
        logger.info("under torchrun the engine runs in a thread of rank 0's process")
    return AsyncEngine(build_engine(args, MODELS)[0], burst=burst_window(args), step_watch=watch)


def serve(engine: AsyncEngine | EngineProcess, args: argparse.Namespace,
          listener: socket.socket) -> EngineDeadError | None:
    """Serve on `listener` (bound to --host and --port) until shut down, or until the engine
    dies (then stop at once); why it died."""
    import uvicorn

    server: uvicorn.Server | None = None

    def stop_serving(error: EngineDeadError) -> None:
        server.should_exit = True  # from the engine's thread: uvicorn polls it

    engine.on_fatal = stop_serving
    app = build_app(engine, model_name(args), getattr(args, "kv_transfer_config", None))
    # Past the grace period, requests still in flight are cancelled, then the engine stops
    # (failing any left): a stuck engine or client cannot hold the server up.
    port = listener.getsockname()[1]  # --port 0's is the one bound
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="info",
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    # This process's start-up objects too (torch, the tokenizer, the app; the engine process
    # froze its own): one full collection of them took 152 ms, and the requests arriving
    # meanwhile reached the engine one step late (docs/serving.md, "Bursts of requests").
    freeze_startup_objects()
    logger.info("serving %s on http://%s:%d", model_name(args), args.host, port)
    server.run(sockets=[listener])
    return engine.fatal_error


if __name__ == "__main__":
    main()
