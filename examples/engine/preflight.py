"""The start-up checks of the entry points: what their flags ask for, checked before anything
heavy (loading the model, compiling, capturing), so that a mistake is one line on stderr and
exit status 2, not a traceback or a refusal after the engine was built.

In order: `--model`, an example model with one of its `--preset`s or a checkpoint directory
(checkpoint.py's `checkpoint_config`: config.json parses, names an architecture these examples
serve and that model's config accepts; weights and tokenizer.json are there; safetensors and
tokenizers import); the tensor-parallel size against torchrun's; a draft model
(`--speculative-config` method draft_model: not under tensor parallelism; what its `model`
names, by draft_model_source.py's `resolve`, a directory checked as `--model`'s; the target's
vocabulary); `--device` and each local rank's device; kvgraph's settings, flags and KVGRAPH_*
variables (the config's own checks); that the debug dump can be written; the packages the
script needs (serve.py: the `serve` extra). Each calls the rule where it lives. serve.py then
binds `--host`/`--port` (`bind`) before its engine is built, and serves on that socket.

What needs the model, or an attention backend (whose kernels are built when it is first made),
is found later, as before, by the same rules: weights that do not match the model, a
tensor-parallel size its heads cannot be shared over, a KV cache that does not fit, a backend
for another device or a block size it cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import socket
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from kvgraph.cache_dir import can_write
from kvgraph.errors import ConfigError, PlatformError
from kvgraph.kv_transfer.registry import kv_connector_class
from kvgraph.runtime.platforms import get_platform
from kvgraph.runtime.runner_args import check_device

from .checkpoint import checkpoint_config
from .draft_model_source import CheckpointSource, resolve
from .draft_startup import refuse_under_tensor_parallelism
from .engine_args import compilation_config
from .tp_launch import Rendezvous, rank_device, ranks_on_node, tensor_parallel_size

# What examples/serve.py serves with, and what a checkpoint is read with: the `serve` extra.
SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
CHECKPOINT_PACKAGES = ("safetensors", "tokenizers")
INSTALL_SERVE = 'pip install -e ".[serve]"'


class UsageError(Exception):
    """A mistake in how a script was started (a flag, a path, a missing package); the message
    names the flag and says what was expected and what came."""


def preflight(args: argparse.Namespace, models: Mapping[str, Any], prog: str,
              packages: Sequence[str] = ()) -> None:
    """Every check, in order: on the first that fails, exit 2 with one line (`usage_errors`).
    `packages`: what the script needs beyond the core (serve.py: SERVE_PACKAGES); those a
    checkpoint is read with are checked with `--model`."""
    with usage_errors(prog):
        check_start(args, models, packages)


@contextlib.contextmanager
def usage_errors(prog: str) -> Iterator[None]:
    """A UsageError inside becomes `prog: error: message` on stderr and exit status 2, as
    argparse's own errors (without the usage: the line says what to fix)."""
    try:
        yield
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def check_start(args: argparse.Namespace, models: Mapping[str, Any],
                packages: Sequence[str] = ()) -> None:
    """Every check, in order; a UsageError for the first that fails."""
    check_model(args, models)
    with refused("", ValueError):  # the message names the flag and torchrun's WORLD_SIZE
        world_size = tensor_parallel_size(args.tensor_parallel_size)
        refuse_under_tensor_parallelism(args, world_size)
    check_draft_model(args, models)
    check_devices(args.device, world_size)
    check_kvgraph(args)
    check_kv_transfer(args)
    require(packages, "the server")  # last: importing them takes longest


def check_kv_transfer(args: argparse.Namespace) -> None:
    """The connector `--kv-transfer-config` names exists, takes its settings, and runs here."""
    config = getattr(args, "kv_transfer_config", None)
    if config is None:
        return
    with refused("--kv-transfer-config", ConfigError):
        kv_connector_class(config).check_config(config)
    path = config.extra("shared_storage_path")
    if config.kv_connector == "SharedStorageConnector":
        check_writable("--kv-transfer-config shared_storage_path", Path(path))


@contextlib.contextmanager
def refused(flag: str, *errors: type[BaseException]) -> Iterator[None]:
    """`errors` raised inside become a UsageError, its message prefixed with `flag` (the flag
    and its value) unless that is empty."""
    try:
        yield
    except errors as error:
        raise UsageError(f"{flag}: {error}" if flag else str(error)) from None


def require(packages: Sequence[str], needed_by: str) -> None:
    """Import `packages`; a UsageError naming the first that will not, and the extra to install."""
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise UsageError(f"{needed_by} needs {name}, which does not import ({error}): "
                             f"{INSTALL_SERVE}") from None


def check_model(args: argparse.Namespace, models: Mapping[str, Any]) -> None:
    """`--model`: an example model with one of its presets, or a checkpoint directory that
    checkpoint.py can read, and the packages it reads one with."""
    if args.model in models:
        presets = sorted(models[args.model].presets)
        if args.preset not in presets:
            raise UsageError(f"--preset {args.preset}: expected a preset of the example model "
                             f"{args.model!r}, one of {presets}")
        return
    flag = f"--model {args.model}"
    if not Path(args.model).is_dir():
        found = "not a directory" if Path(args.model).exists() else "no such directory"
        raise UsageError(f"{flag}: {found}; expected a local Hugging Face checkpoint directory "
                         f"or an example model, one of {sorted(models)}")
    with refused(flag, FileNotFoundError, NotImplementedError, ValueError):
        checkpoint_config(args.model, models)
    require(CHECKPOINT_PACKAGES, f"{flag}: reading a checkpoint")


def check_draft_model(args: argparse.Namespace, models: Mapping[str, Any]) -> None:
    """`--speculative-config`'s draft model (after `--model`'s checks): an example model with
    one of its presets and at most its layers, or a checkpoint directory that checkpoint.py can
    read; either with the target's vocabulary (the draft shares its tokenizer)."""
    spec = getattr(args, "speculative_config", None)
    if spec is None or spec.method != "draft_model":
        return
    flag = f"--speculative-config model {spec.model}"
    with refused("--speculative-config model", ValueError):  # the message quotes the model
        source = resolve(spec.model, models, args.preset)
    with refused(flag, FileNotFoundError, NotImplementedError, ValueError):
        vocab_size = source.config(models).get("vocab_size")
    if isinstance(source, CheckpointSource):
        require(CHECKPOINT_PACKAGES, f"{flag}: reading a checkpoint")
    target = resolve(args.model, models, args.preset).config(models).get("vocab_size")
    if vocab_size != target:
        raise UsageError(f"{flag}: the draft model has vocab_size={vocab_size}, the target "
                         f"(--model {args.model}) {target}: a draft model shares the target's "
                         "tokenizer, so they must be equal")


def check_devices(device: str, world_size: int) -> None:
    """`--device`: a platform kvgraph has, and a device this process sees for every rank on
    this node (rank r on `<type>:r` under tensor parallelism)."""
    flag = f"--device {device}"
    with refused(flag, PlatformError):
        get_platform(device)  # first: for "npu" it loads torch_npu, which torch needs
    with refused("", ValueError):  # the message names --device
        devices = [device] if world_size == 1 else [
            rank_device(device, Rendezvous(rank, world_size, rank, world_size))
            for rank in range(ranks_on_node(world_size))]
    with refused(flag, RuntimeError):  # a PlatformError, or torch's for a malformed index
        for each in devices:
            check_device(each)


def check_kvgraph(args: argparse.Namespace) -> None:
    """kvgraph's settings, flags and KVGRAPH_* variables, by the config's own checks (with the
    device's defaults, as the engine builds it), and that the debug dump can be written."""
    try:
        config = compilation_config(args)
    except ConfigError as error:
        # kvgraph names the flag or variable of a value it parsed, but not that of one which a
        # device's default made wrong (capture sizes past the CPU's token budget).
        flag = "--" + error.field.replace("_", "-")
        given = getattr(args, error.field, None)
        named = given is None or flag in str(error)
        raise UsageError(str(error) if named else f"{flag} {given}: {error}") from None
    if config.debug_dump_path is not None:
        source = "--debug-dump-path" if args.debug_dump_path is not None else "KVGRAPH_DEBUG_DUMP"
        check_writable(f"{source} {config.debug_dump_path}", Path(config.debug_dump_path))


def check_writable(flag: str, path: Path) -> None:
    """A UsageError unless `path` is, or can be made as, a directory this process may write."""
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not can_write(existing):
        raise UsageError(f"{flag}: expected a directory this user may write (or make), but "
                         f"{existing} is {'not writable' if existing.is_dir() else 'a file'}")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free port) for the server to listen on once
    its engine is built; a UsageError naming the flag when that address cannot be had.

    Bound, not listening: until the server serves, connections are refused rather than left
    waiting. SO_REUSEADDR, as uvicorn binds: a port whose last server's connections linger
    in TIME_WAIT is free, and one another socket listens on is not (Linux lets two sockets
    that both set it and neither listens share a port: of two servers starting together on
    one, the second then fails when it listens).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise UsageError(_bind_error(host, port, error)) from None
    return sock


def _bind_error(host: str, port: int, error: OSError) -> str:
    """What binding `host`:`port` failing with `error` means, naming the flag at fault."""
    if isinstance(error, socket.gaierror):
        return f"--host {host}: expected an address or a host name, but it does not resolve " \
               f"({error.strerror})"
    reason = os.strerror(error.errno) if error.errno else str(error)
    if error.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine ({reason.lower()})"
    if error.errno == errno.EACCES and 0 < port < 1024:
        reason += "; ports below 1024 need privileges"
    return f"--port {port}: {reason[0].lower()}{reason[1:]} (host {host})"
