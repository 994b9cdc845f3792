"""What the benchmark scripts share: device sync, medians, copy bandwidth, machine, JSON out."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch

# A copy this large hides launch and cache effects: what is left is memory bandwidth.
COPY_BYTES = {"cuda": 2 * 2**30, "cpu": 256 * 2**20}
COPY_REPEATS = 10


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)  # torch.cuda, torch.npu


def median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds `fn()` takes, its device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a large device-to-device copy moves (bytes read + bytes written)."""
    size = COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocator work stay out of the timing
    seconds = statistics.median(timed(lambda: dst.copy_(src), device)
                                for _ in range(COPY_REPEATS))
    return 2 * size / seconds


def cpu_name() -> str:
    """The CPU's model name (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.machine()


def machine(device: torch.device) -> dict[str, Any]:
    """Where the numbers come from: device name, CPU count, versions, date."""
    name = (getattr(torch, device.type).get_device_name(device) if device.type != "cpu"
            else cpu_name())
    return {"device": name, "platform": platform.platform(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
