#!/usr/bin/env bash
# Everything GPU-only in one go, on a machine with a CUDA GPU and torch already installed
# (nothing is downloaded). Logs and JSON go under $OUT (default ./gpu-check-out).
#   bash .ci/gpu_check.sh
# Each stage has its own timeout so one hang cannot eat the run, cut to what is left of the
# whole budget (8 minutes: a lent GPU has 15 minutes of device time, start-up included); the
# profile stage runs only if the stages before it left time for it. The most telling come first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
# kvgraph's compile cache (inductor's inside it), shared by the benchmark stages; not under $OUT,
# which should hold only logs and JSON.
CACHE=${KVGRAPH_CHECK_CACHE:-$(mktemp -d)}
BUDGET_S=480
PROFILE_S=100
export PYTHONUNBUFFERED=1
status=0

stage() {  # stage NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, remember a failure
  local name=$1 seconds=$2 left=$((BUDGET_S - SECONDS))
  shift 2
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${SECONDS}s gone of the ${BUDGET_S}s budget"
    status=1
    return
  fi
  [ "$seconds" -le "$left" ] || seconds=$left  # no stage may run past the whole budget
  echo "=== $name (timeout ${seconds}s)"
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

stage machine 30 bash -c 'date -u; nvidia-smi; python -c "
import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__)
print(torch.cuda.get_device_name())"; python -c "import transformers; print(\"transformers\", transformers.__version__)" || true'
stage install 90 pip install --no-deps --no-build-isolation -e .
stage pytest-cuda 180 python -m pytest -m cuda -q -p no:cacheprovider --timeout 120 \
  --continue-on-collection-errors --junitxml "$OUT/pytest-cuda.xml"
stage triton-kernels 120 python -m pytest tests/kvgraph/attention/backends/test_triton_backend.py -q -p no:cacheprovider \
  --timeout 60 --junitxml "$OUT/triton-kernels.xml"
stage attention-kernels 150 python -m examples.benchmarks.attention_kernels --device cuda \
  --dtype bfloat16 --json "$OUT/attention_kernels.json"
# Modes in order of interest: a run cut short keeps the rows it finished (JSON per row). Each
# kvgraph row records its graphs' memory for the default capture sizes: graph_bytes,
# bytes_by_descriptor and graph_bytes_vs_largest (sizes share one pool: target <= 1.5).
stage decode-latency 330 python -m examples.benchmarks.decode_latency --device cuda \
  --preset 1b --dtype bfloat16 --batch-sizes 1 8 64 --cache-dir "$CACHE" \
  --modes eager full_and_piecewise piecewise full_decode_only --json "$OUT/decode_latency.json"
# Tensor parallelism: a real NCCL all-reduce per layer (a size-1 group on one GPU) traced and
# captured in piecewise and full graphs, logits against eager; world size 2 runs only where two
# GPUs are (else skipped, saying so). The small preset keeps three modes' compiles inside 90 s.
stage tensor-parallel 90 python -m examples.benchmarks.tensor_parallel --device cuda \
  --preset small --dtype bfloat16 --modes full_and_piecewise piecewise full \
  --cache-dir "$CACHE" --json "$OUT/tensor_parallel.json"
if [ $((SECONDS + PROFILE_S)) -le "$BUDGET_S" ]; then
  stage decode-profile "$PROFILE_S" python -m examples.benchmarks.decode_latency --device cuda \
    --preset 1b --dtype bfloat16 --batch-sizes 1 64 --modes piecewise full_and_piecewise \
    --profile --cache-dir "$CACHE" --json "$OUT/decode_profile.json"
else
  echo "=== decode-profile: skipped, ${SECONDS}s gone of the ${BUDGET_S}s budget"
fi
exit $status
