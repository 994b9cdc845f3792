"""The example engine asks the device's platform for its defaults and never tests which device
it runs on: no device name compared, no per-device table, no device type split off a string.

The scan reads the engine's sources line by line; the patterns are checked against lines the
engine once had (its per-device tables and tests), so a scan that matches nothing fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted((ROOT / "examples" / "engine").glob("*.py")) + [
    ROOT / "examples" / "generate.py", ROOT / "examples" / "serve.py"]
NAME = r"""["'](?:cpu|cuda|npu|xpu|mps|hpu)["']"""  # a device type as a string literal
DEVICE_TESTS = {
    "a device name compared": re.compile(rf"[=!]=\s*{NAME}|{NAME}\s*[=!]="),
    # `kind in ("cpu", ...)`, `DECODE_CAPTURE_ONLY = ("cpu",)`
    "a device name looked up": re.compile(rf"(?:=|\bin)\s*[(\[{{]\s*{NAME}\s*[,)\]}}]"),
    "a per-device table": re.compile(rf"[{{,]\s*{NAME}\s*:"),
    "a device's type tested": re.compile(r"\.type\s*(?:[=!]=|\bin\b)|\bdevice_type\b"),
    "a device type split off a string": re.compile(
        r"""device\w*\s*\.\s*(?:split|partition)\(\s*["']:["']"""),
    "a device module used by name": re.compile(r"\btorch\.(?:cuda|npu)\b|getattr\(\s*torch\s*,"),
}
# Lines of examples/engine before the platform answered for the device (engine_args.py,
# burst_window.py, tp_launch.py, kv_sizing.py): each must be caught.
OLD_LINES = [
    'DEFAULT_TOKEN_BUDGETS = {"cpu": 1024}',
    'DECODE_CAPTURE_ONLY = ("cpu",)',
    '    device_type = args.device.split(":")[0]',
    '            and device_type in DEFAULT_GRAPH_MODES):',
    '    if args.pack_weights and torch.device(device).type == "cpu":',
    '            gap_ms = CPU_GAP_MS if device.split(":")[0] == "cpu" else 0.0',
    'BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}',
    '    kind, _, index = device.partition(":")',
    '    if kind != "cpu":',
    '        getattr(torch, kind).set_device(rendezvous.local_rank)',
    '    if device.type == "cpu" or not hasattr(module, "max_memory_allocated"):',
]
# What may stay: the flag's default device, and text for the user.
ALLOWED = [
    'group.add_argument("--device", default="cpu")',
    'help="on the CPU, pack linear weights once at load"',
    'logger.info("the engine runs in process %d", engine.pid)',
]


def device_tests(line: str) -> list[str]:
    """What `line` does that only code deciding by device type does."""
    return [what for what, pattern in DEVICE_TESTS.items() if pattern.search(line)]


@pytest.mark.parametrize("line", OLD_LINES)
def test_the_scan_catches_what_the_engine_once_did(line):
    assert device_tests(line), f"the scan misses {line!r}"


@pytest.mark.parametrize("line", ALLOWED)
def test_the_scan_leaves_the_flag_default_and_text_alone(line):
    assert not device_tests(line)


def test_the_engine_and_its_entry_points_test_no_device_type():
    found = [f"{path.relative_to(ROOT)}:{number}: {', '.join(tests)}: {line.strip()}"
             for path in SOURCES
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if (tests := device_tests(line))]
    assert not found, ("the engine decides by device type; ask the device's platform "
                       "(kvgraph.runtime.platforms.get_platform) instead:\n" + "\n".join(found))
