"""The small-batch linear against F.linear: one pass over a model's weights.

Every linear weight of a Llama preset (fp32: the small one's are ~94 MiB, more than the caches
hold, so each pass reads them from memory, as a decode step does), multiplied by `rows` input
rows, first with `F.linear` and then with `kvgraph_cpu::small_batch_linear`, in alternating
order per round; one compute thread. Prints the median ms per pass and the ratio, writes JSON.
Past `small_batch_max_rows()` rows (16 with AVX-512, 48 with AVX2) the kernel hands the batch to
F.linear (MKL's sgemm), so in fp32 those rows show its cost of asking. `--dtype bfloat16` times
plain bf16 weights, which the kernel takes where oneDNN cannot pack bf16: F.linear is then
torch's own bf16 matmul, and past those rows the kernel widens to fp32 for MKL.

`--against REV` (a git revision, or a path to a .cpp file) also builds that version of
`small_batch_linear.cpp`, its op renamed into a namespace of its own, and times it in the same
rounds: an A/B of a kernel change on one machine at one moment, which on a shared VM is the only
comparison that holds (rounds there swing by tens of percent from one minute to the next).

`--onednn` also times oneDNN's linear over the same weights packed once for it
(`kvgraph::packed_linear`), what the engine runs for fp32 where that was measured fastest
(`kvgraph.cpu.packed_linear.packed_dtypes`).

    python -m examples.benchmarks.small_batch_linear [--preset small] [--rows 1 4 8 16 32] \
        [--dtype float32] [--against HEAD~1] [--onednn]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from examples.benchmarks.engine_worker import REPO
from examples.benchmarks.timing import machine, write_json
from examples.models.llama import PRESETS, Llama
from kvgraph.cpu import build
from kvgraph.cpu import packed_linear
from kvgraph.cpu.packed_linear import PACKING_BATCH_HINT
from kvgraph.cpu.small_batch_linear import small_batch_kernel_loaded

KERNEL_SOURCE = build.CSRC / "small_batch_linear.cpp"
# Where --against's build registers its op: apart from the kernel being measured.
AGAINST_NAMESPACE = "kvgraph_cpu_against"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--against", metavar="REV_OR_FILE",
                        help="also time this version of small_batch_linear.cpp (A/B)")
    parser.add_argument("--onednn", action="store_true",
                        help="also time oneDNN's linear over weights packed for it")
    parser.add_argument("--json", default="small_batch_linear.json")
    return parser.parse_args(argv)


def against_source(spec: str) -> str:
    """small_batch_linear.cpp as a file holds it, else as git revision `spec` holds it."""
    if Path(spec).is_file():
        return Path(spec).read_text()
    relative = KERNEL_SOURCE.resolve().relative_to(REPO).as_posix()
    shown = subprocess.run(["git", "show", f"{spec}:{relative}"], cwd=REPO, capture_output=True,
                           text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--against {spec!r}: not a file, nor a git revision holding {relative} "
                         f"({shown.stderr.strip()})")
    return shown.stdout


def load_against(source: str, directory: Path) -> Callable:
    """Build `source` as the CPU kernels are built, its op under AGAINST_NAMESPACE; its matmul."""
    from torch.utils import cpp_extension

    renamed = source.replace("(kvgraph_cpu,", f"({AGAINST_NAMESPACE},")
    if renamed == source:
        raise SystemExit("--against: the source registers no kvgraph_cpu ops to rename")
    path = directory / "small_batch_linear_against.cpp"
    path.write_text(renamed)
    build.put_ninja_on_path()
    cpp_extension.load("kvgraph_small_batch_against", [str(path)], extra_cflags=list(build.CFLAGS),
                       extra_ldflags=list(build.LDFLAGS), build_directory=str(directory),
                       is_python_module=False)
    op = getattr(torch.ops, AGAINST_NAMESPACE).small_batch_linear
    return lambda x, w: op(x, w, None)


def model_weights(preset: str) -> list[torch.Tensor]:
    """The preset's linear weights (`[out, in]`, fp32), the lm_head's included."""
    model = Llama.from_preset(preset, dtype=torch.float32, seed=0)
    return [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]


def pass_ms(matmul: Callable, inputs: dict[int, torch.Tensor], weights: list[torch.Tensor]
            ) -> float:
    start = time.perf_counter()
    for weight in weights:
        matmul(inputs[weight.shape[1]], weight)
    return 1e3 * (time.perf_counter() - start)


def onednn_matmul(weights: list[torch.Tensor]) -> Callable:
    """oneDNN's linear over `weights` packed once for it (looked up by the plain weight)."""
    packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, PACKING_BATCH_HINT)
              for w in weights}
    return lambda x, w: packed_linear.linear(x, packed[id(w)])


def measure(rows: int, weights: list[torch.Tensor], rounds: int,
            against: Callable | None = None, onednn: Callable | None = None) -> dict[str, Any]:
    inputs = {k: torch.randn(rows, k, dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}}
    matmuls = {"F.linear": nn.functional.linear,
               "small_batch": lambda x, w: torch.ops.kvgraph_cpu.small_batch_linear(x, w, None)}
    if against is not None:
        matmuls["against"] = against
    if onednn is not None:
        matmuls["oneDNN"] = onednn
    kinds = tuple(matmuls)
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    for kind in kinds:  # warm-up: first calls load and allocate
        pass_ms(matmuls[kind], inputs, weights)
    for round_index in range(rounds):
        for kind in (kinds if round_index % 2 == 0 else kinds[::-1]):
            samples[kind].append(pass_ms(matmuls[kind], inputs, weights))
    ms = {kind: statistics.median(s) for kind, s in samples.items()}
    row = {"rows": rows, "ms": ms, "ratio": ms["small_batch"] / ms["F.linear"]}
    if against is not None:
        row["ratio_to_against"] = ms["small_batch"] / ms["against"]
    if onednn is not None:
        row["onednn_ratio"] = ms["oneDNN"] / ms["F.linear"]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not small_batch_kernel_loaded():
        raise SystemExit("kvgraph's CPU kernels cannot be built here (see the log)")
    torch.set_num_threads(args.threads)
    weights = [w.to(getattr(torch, args.dtype)) for w in model_weights(args.preset)]
    mib = sum(w.numel() * w.element_size() for w in weights) / 2**20
    with tempfile.TemporaryDirectory(prefix="kvgraph-against-") as directory:
        against = (load_against(against_source(args.against), Path(directory))
                   if args.against else None)
        print(f"{args.preset} Llama's {len(weights)} linear weights ({mib:.0f} MiB "
              f"{args.dtype}), {args.threads} thread(s), {args.rounds} interleaved rounds; "
              "median ms per pass")
        onednn = onednn_matmul(weights) if args.onednn else None
        print(f"{'rows':>5}{'F.linear':>11}{'small_batch':>13}{'ratio':>8}"
              + (f"{'against':>10}{'new/against':>13}" if against else "")
              + (f"{'oneDNN':>9}{'ratio':>8}" if onednn else ""))
        payload = {"machine": machine(torch.device("cpu")), "args": vars(args),
                   "weights_mib": mib, "date": time.strftime("%Y-%m-%d"), "results": []}
        for rows in args.rows:
            row = measure(rows, weights, args.rounds, against, onednn)
            payload["results"].append(row)
            line = (f"{rows:>5}{row['ms']['F.linear']:>11.2f}{row['ms']['small_batch']:>13.2f}"
                    f"{row['ratio']:>8.2f}")
            if against:
                line += f"{row['ms']['against']:>10.2f}{row['ratio_to_against']:>13.2f}"
            if onednn:
                line += f"{row['ms']['oneDNN']:>9.2f}{row['onednn_ratio']:>8.2f}"
            print(line, flush=True)
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
