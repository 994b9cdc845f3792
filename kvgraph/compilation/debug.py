"""Debug dumps: one session per runner (or per torch.compile), every stage as a readable file.

    <debug_dump_path>/          (<debug_dump_path>/rank_<r>/ when torch.distributed is initialised)
      index.md                  every file of the session, in order, linked
      events.jsonl              one JSON record per stage (what `python -m kvgraph.inspect` reads)
      compile-000/              one per Dynamo graph: its code, passes, split, pieces, builds
      capture.json  stats.json  verify.json   runtime reports, rewritten as they change

An event is `{"seq", "time", "stage", "name", "compile", "file", "seconds", "data"}`: `time` in
seconds since the session opened, `compile` the number of the compile it belongs to (None for
runtime events), `file` relative to the session dir (None when nothing was written).

Every file is also a structured-trace artifact (`kvgraph_<name>`; graphs as `graph_dump`
events) when `TORCH_TRACE` is set, so tlparse shows kvgraph's stages beside Dynamo's and
inductor's; a session without a directory emits only those.

A session dir that cannot be written is refused when the session opens (ConfigError); one that
fails later (a full disk, a deleted dir) costs one warning and ends the file dump: a dump never
fails a compile or a capture.
"""

from __future__ import annotations

import enum
import json
import logging
import shutil
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import fx

from kvgraph.errors import ConfigError

logger = logging.getLogger(__name__)

INDEX = "index.md"
EVENTS = "events.jsonl"
# The runtime reports a session keeps at its top, rewritten as they change.
REPORTS = ("capture", "stats", "verify")
# What a session replaces of an earlier dump in the same directory: only kvgraph's own names.
_OWN_NAMES = (INDEX, EVENTS, "compile-[0-9][0-9][0-9]", *(f"{name}.json" for name in REPORTS))
Payload = str | Callable[[], str]


def session_dir(path: str | Path) -> Path:
    """Where a session under `path` writes: `path/rank_<r>` in a distributed job, else `path`."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return Path(path) / f"rank_{distributed.get_rank()}"
    return Path(path)


class _WarningRecorder(logging.Handler):
    """Records kvgraph's warnings in the session while it is open (and alive: the logger must
    not keep a dropped runner's session)."""

    def __init__(self, session: DumpSession):
        super().__init__(logging.WARNING)
        self.session = weakref.ref(session)

    def emit(self, record: logging.LogRecord) -> None:
        session = self.session()
        if session is None:
            logging.getLogger("kvgraph").removeHandler(self)
            return
        session.event("warning", record.name, {"message": record.getMessage()})
        self._pass_on(record)

    def _pass_on(self, record: logging.LogRecord) -> None:
        """Print `record` as Python would have without this handler: a process that configured
        no logging shows warnings through `logging.lastResort`, which a logger stops using
        once any handler is on its way, so recording them would otherwise silence them."""
        last_resort = logging.lastResort
        if last_resort is None or record.levelno < last_resort.level:
            return
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            recorders = [h for h in logger.handlers if isinstance(h, _WarningRecorder)]
            if len(recorders) < len(logger.handlers):
                return  # a handler of the process's own shows it
            if recorders and recorders[0] is not self:
                return  # one recorder passes it on, not one per open session
            logger = logger.parent if logger.propagate else None
        last_resort.handle(record)


class DumpSession:
    """The debug dump of one runner or one torch.compile: numbered files, an index, events.

    `directory` None writes no files and only emits structured-trace artifacts.
    """

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.start = time.perf_counter()
        self.failed = directory is None
        self.compiles = 0
        self.compile: int | None = None  # the compile under way, whose files get its dir
        self.compile_id = None  # Dynamo's id of the last compile, for runtime trace events
        self._seq = 0
        self._files = 0
        self._listed_reports: set[str] = set()
        self._render_failed = False
        self._warnings = _WarningRecorder(self) if directory is not None else None
        if self._warnings:
            logging.getLogger("kvgraph").addHandler(self._warnings)

    @classmethod
    def open(cls, path: str | Path | None) -> DumpSession:
        """A session in `session_dir(path)`, emptied of an earlier kvgraph dump; with `path`
        None, one that only emits trace artifacts. A ConfigError if it cannot be written."""
        if path is None:
            return cls(None)
        directory = session_dir(path)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            _clear_earlier_dump(directory)
            (directory / INDEX).write_text("# kvgraph debug dump\n\n")
            (directory / EVENTS).write_text("")
        except OSError as error:
            raise ConfigError("debug_dump_path", f"debug_dump_path: cannot write a debug dump in "
                              f"{directory} ({error}); give a writable directory, or unset "
                              "it (KVGRAPH_DEBUG_DUMP, --debug-dump-path)") from None
        logger.info("kvgraph: writing the debug dump to %s (read it with python -m "
                    "kvgraph.inspect %s)", directory, directory)
        return cls(directory)

    @property
    def active(self) -> bool:
        """Whether anything is recorded: files, or a structured trace (`TORCH_TRACE`)."""
        from torch._logging._internal import trace_log

        return not self.failed or bool(trace_log.handlers)

    # --- stages ------------------------------------------------------------------------------

    def begin_compile(self) -> int:
        """Start the files of a new compile (one Dynamo graph); its number."""
        self.compile = self.compiles
        self.compiles += 1
        self._files = 0
        context = torch._guards.CompileContext.try_get()
        self.compile_id = context.compile_id if context is not None else None
        return self.compile

    def end_compile(self) -> None:
        self.compile = None

    def text(self, stage: str, name: str, payload: Payload, *, suffix: str = ".py",
             data: Any = None, seconds: float | None = None, graph: bool = False) -> None:
        """Write `payload` (a string, or a function making it) as the next file of the compile
        under way (else at the session's top), list it, record the event and trace it."""
        make = self._safe(name, payload if callable(payload) else (lambda: payload))
        file = None
        if not self.failed:
            file = self._file_name(name, suffix)
            if not self._write(file, make()):
                file = None
        self._trace(name, make, suffix, graph)
        self.event(stage, name, data, seconds, file)

    def graph(self, stage: str, name: str, gm: fx.GraphModule, **kwargs: Any) -> None:
        self.text(stage, name, lambda: gm.print_readable(print_output=False, include_stride=True,
                                                         include_device=True),
                  graph=True, **kwargs)

    def json(self, stage: str, name: str, data: Any, seconds: float | None = None) -> None:
        """`data` (or, when callable, what it returns: made only if something is recorded)
        as a JSON file, also kept in its event."""
        if callable(data):
            if not self.active:
                return
            data = self._safe(name, data)()
        self.text(stage, name, lambda: _to_json(data), suffix=".json", data=data,
                  seconds=seconds)

    def _safe(self, name: str, make: Callable[[], Any]) -> Callable[[], Any]:
        """`make`, whose error (a graph the dump code does not expect) becomes a note in the
        dump and one warning, never a failed compile."""
        def made() -> Any:
            try:
                return make()
            except Exception as error:  # noqa: BLE001 - a dump must not fail a compile
                if not self._render_failed:
                    self._render_failed = True
                    logger.warning("kvgraph: the debug dump could not describe %s (%s: %s); "
                                   "compiling on", name, type(error).__name__, error)
                return f"# kvgraph could not describe {name}: {type(error).__name__}: {error}\n"
        return made

    def runtime_json(self, name: str, data: Any, in_events: bool = False) -> None:
        """Write (or rewrite) the runtime report `<name>.json` at the session's top: capture,
        stats, verify. `in_events` also keeps this version in its event (for a report made
        a few times, whose every version counts: each `capture()`'s)."""
        file = None
        if not self.failed and self._write(f"{name}.json", _to_json(data), listed=False):
            file = f"{name}.json"
            if name not in self._listed_reports:
                self._listed_reports.add(name)
                self._append(INDEX, f"- [{file}]({file}) (runtime report)\n")
        self._trace(name, lambda: _to_json(data), ".json", graph=False)
        # Otherwise only the file holds it: events.jsonl would grow by a report per rewrite.
        self.event(name, name, data if in_events else None, file=file)

    def event(self, stage: str, name: str, data: Any = None, seconds: float | None = None,
              file: str | None = None) -> None:
        """Record one event in events.jsonl (no file of its own unless `file`)."""
        if self.failed:
            return
        record = {"seq": self._seq, "time": round(time.perf_counter() - self.start, 6),
                  "stage": stage, "name": name, "compile": self.compile, "file": file,
                  "seconds": seconds, "data": data}
        self._seq += 1
        self._append(EVENTS, json.dumps(record, default=_plain) + "\n")

    def close(self) -> None:
        """Stop recording warnings; files already written stay."""
        if self._warnings:
            logging.getLogger("kvgraph").removeHandler(self._warnings)
            self._warnings = None

    def __del__(self) -> None:
        self.close()

    # --- files -------------------------------------------------------------------------------

    def _file_name(self, name: str, suffix: str) -> str:
        if self.compile is None:
            return f"{name}{suffix}"
        number = f"{self._files:02d}-{name}{suffix}"
        self._files += 1
        return f"compile-{self.compile:03d}/{number}"

    def _write(self, file: str, text: str, listed: bool = True) -> bool:
        """Write `file`; after an error, warn once and stop the file dump."""
        try:
            path = self.directory / file
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
        except OSError as error:
            return self._fail(error)
        if listed:
            self._append(INDEX, f"- [{file}]({file})\n")
        return not self.failed

    def _append(self, file: str, text: str) -> None:
        try:
            with open(self.directory / file, "a") as out:
                out.write(text)
        except OSError as error:
            self._fail(error)

    def _fail(self, error: OSError) -> bool:
        if not self.failed:
            self.failed = True
            self.close()
            logger.warning("kvgraph: the debug dump in %s stops here: %s (compiling and running "
                           "go on without it)", self.directory, error)
        return False

    def _trace(self, name: str, make: Callable[[], str], suffix: str, graph: bool) -> None:
        from torch._logging import trace_structured

        title = f"kvgraph_{name}"
        where = ({} if self.compile is not None or torch._guards.CompileContext.current_trace_id()
                 else {"compile_id": self.compile_id} if self.compile_id is not None
                 else {"expect_trace_id": False})
        if graph:
            trace_structured("graph_dump", lambda: {"name": title}, payload_fn=make, **where)
        else:
            encoding = "json" if suffix == ".json" else "string"
            trace_structured("artifact", lambda: {"name": title, "encoding": encoding},
                             payload_fn=make, **where)


def _plain(value: Any) -> Any:
    """What JSON cannot hold, readably: an enum as its value, anything else as `str`."""
    return value.value if isinstance(value, enum.Enum) else str(value)


def _to_json(data: Any) -> str:
    return json.dumps(data, indent=2, default=_plain)


def _clear_earlier_dump(directory: Path) -> None:
    """Remove what an earlier session wrote here (kvgraph's own names only), so the index and
    events describe this session alone."""
    for pattern in _OWN_NAMES:
        for path in directory.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
