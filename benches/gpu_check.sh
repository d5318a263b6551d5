#!/usr/bin/env bash
# The GPU check of the workbench, on one machine with CUDA GPUs (sized for one H200 in under 8 minutes):
#   1. set-up: a Python with a CUDA build of torch, nvcc, the compiled extensions (built here if needed)
#   2. pytest -m gpu: the GPU path of the telemetry against torch.profiler, device memory, NCCL marks
#   3. MFU of the 1b preset in bf16 on one GPU (benches/mfu.py; target >= 50% of the datasheet peak)
#   4. telemetry on/off step time on the GPU(s) (benches/telemetry.py --device cuda; target <= 1.02x)
# Prints every figure, then a summary; exits non-zero if a part failed (a missed target is reported,
# not a failure: figures are measured, not asserted).
#
#   bash benches/gpu_check.sh                 # from the repository root
#   PYTHON=/path/to/python bash benches/gpu_check.sh
#   DEVICE=cpu bash benches/gpu_check.sh      # the script's own plumbing on a CPU machine (tiny model, gpu tests skip)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t wb-gpu-check.XXXXXX)}
declare -A RESULT=()
FAILED=0
START=$(date +%s)
DEVICE=${DEVICE:-cuda}

say() { printf '\n=== %s (%ds)\n' "$*" $(( $(date +%s) - START )); }

# run NAME SECONDS CMD...: runs one part with a timeout, keeps its output in $LOG_DIR/NAME.log, records pass/fail.
run() {
  local name=$1 limit=$2; shift 2
  say "$name (limit ${limit}s): $*"
  local rc=0
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log" || rc=${PIPESTATUS[0]}
  if [[ $rc -eq 0 ]]; then
    RESULT[$name]="ok"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    RESULT[$name]="TIMED OUT after ${limit}s"; FAILED=1
  else
    RESULT[$name]="FAILED (exit $rc)"; FAILED=1
  fi
}

# --- 1. set-up ---------------------------------------------------------------------------------------
say "set-up"
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
  PY="$ROOT/.venv/bin/python"
else
  PY=$(command -v python3 || true)
fi
if [[ -z "$PY" ]]; then
  echo "no Python found: run 'make setup TORCH=\"torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128\"'"
  exit 2
fi
echo "python: $PY"
if ! WB_DEVICE=$DEVICE "$PY" - <<'EOF'
import os
import sys
try:
    import torch
except ImportError:
    sys.exit("torch is not installed for this Python")
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, devices {torch.cuda.device_count()}")
if os.environ["WB_DEVICE"] == "cuda" and not torch.cuda.is_available():
    sys.exit("this torch has no usable CUDA device (a CPU build, or no driver)")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
import torch.distributed as dist
print(f"NCCL available: {dist.is_nccl_available()}")
EOF
then
  cat <<'EOF'
This check needs a CUDA build of torch. Install one into the repository's venv, e.g.:
  make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
(or point PYTHON= at an interpreter that has one), plus pytest and the package's dependencies
(`.venv/bin/pip install -e '.[test]'`), and nvcc (CUDA toolkit) on PATH or in $CUDA_HOME.
EOF
  exit 2
fi
if [[ -z "${CUDA_HOME:-}" && ! -x "$(command -v nvcc || true)" && -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDA_HOME=/usr/local/cuda
fi
if [[ $DEVICE == cuda ]] && ! "$PY" -c 'from workbench.telemetry import cuda; import sys; sys.exit(cuda.nvcc() is None)'; then
  echo "nvcc not found (neither \$CUDA_HOME/bin/nvcc nor on PATH): the CUDA telemetry library is built with it."
  echo "Install the CUDA toolkit (e.g. apt-get install cuda-nvcc-12-8) or set CUDA_HOME."
  exit 2
fi
run build 120 "$PY" -m workbench.telemetry.native --build
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
echo "device: $DEVICE, GPUs: $GPUS"

# --- 2. gpu tests ------------------------------------------------------------------------------------
run gpu_tests 120 "$PY" -m pytest -m gpu -q -rs tests/

# --- 3. MFU ------------------------------------------------------------------------------------------
if [[ $DEVICE == cuda ]]; then
  run mfu 120 "$PY" benches/mfu.py --device cuda --preset 1b --precision bf16 --batch-size 8 --seq-len 2048 \
    --warmup 3 --steps 10
else
  run mfu 120 "$PY" benches/mfu.py --device cpu --preset tiny --warmup 2 --steps 5
fi

# --- 4. telemetry on/off -----------------------------------------------------------------------------
run telemetry 100 "$PY" benches/telemetry.py --device "$DEVICE" --world-size 1

# --- summary -----------------------------------------------------------------------------------------
say "summary (logs in $LOG_DIR)"
echo "GPUs: $GPUS"
for part in build gpu_tests mfu telemetry; do
  printf '  %-10s %s\n' "$part" "${RESULT[$part]:-not run}"
done
tests_line=$(grep -E '(passed|failed|skipped|error)' "$LOG_DIR/gpu_tests.log" 2>/dev/null | tail -1 || true)
echo "  gpu tests: ${tests_line:-no result}"
mfu=$(grep -oE 'MFU_RATIO=[0-9.]+' "$LOG_DIR/mfu.log" 2>/dev/null | cut -d= -f2 || true)
ratio=$(grep -oE 'TELEMETRY_RATIO=[0-9.]+' "$LOG_DIR/telemetry.log" 2>/dev/null | cut -d= -f2 || true)
verdict() { awk -v x="$1" -v t="$2" -v op="$3" 'BEGIN { ok = (op == ">=") ? (x >= t) : (x <= t); print ok ? "met" : "NOT met" }'; }
if [[ -n "$mfu" ]]; then
  [[ $DEVICE == cuda ]] && what="1b bf16 on one GPU, of the datasheet peak" || what="tiny on CPU, of the measured peak"
  echo "  MFU ($what): $mfu (target >= 0.50: $(verdict "$mfu" 0.50 '>='))"
else
  echo "  MFU: no figure"
fi
if [[ -n "$ratio" ]]; then
  echo "  telemetry on/off step time: ${ratio}x (target <= 1.02: $(verdict "$ratio" 1.02 '<='))"
else
  echo "  telemetry on/off: no figure"
fi
echo "  total: $(( $(date +%s) - START )) s"
exit $FAILED
