#!/usr/bin/env bash
# The single prepared device check (CUDA machine, no network, < 9 minutes in all).
#
#   1. editable install against the machine's own torch / triton / Cython (no deps, no isolation)
#   2. the kernel tests natively on CUDA (tests/kernels); GGUF, fused-MoE and multi-LoRA
#      checks on CUDA (LoRA: Triton shrink/expand, then an engine batch vs transformers + PEFT)
#   3. benchmarks/kernels_quant_gemm.py  (INT4 g128 dequant-GEMM vs fp16 matmul)
#   4. benchmarks/kernels_attention.py   (paged decode attention, batch x context grid)
#   5. benchmarks/e2e_decode_gpu.py      (end-to-end decode, if present)
#   6. CUDA graphs: the runtime tests marked gpu (graphs == eager tokens), then
#      benchmarks/step_breakdown.py eager (--enforce-eager) and with graphs
#
# Every step runs under its own timeout (60+120+60+45+40+90+60+75+75 s = 10.4 min worst case;
# the steps usually take a fraction of it) so one hang
# cannot eat the budget; the script carries on after a failure and exits non-zero if any step
# failed. Logs and JSON go to benchmarks/results/
# and, when $OUT is set (the device runner's output folder), to $OUT as well.
# Usage: bash benchmarks/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
LOG_DIR=${OUT:-$RESULTS}
mkdir -p "$LOG_DIR"
unset TRITON_INTERPRET  # native CUDA kernels, never the interpreter
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
declare -a SUMMARY=()
FAILED=0
T0=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD...: run one step, log it, record pass/fail and seconds
  local name=$1 limit=$2
  shift 2
  local start rc
  start=$(date +%s)
  echo "=== [$name] $* (timeout ${limit}s)"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("$name: ok (${took}s)")
  else
    [ "$rc" -eq 124 ] && SUMMARY+=("$name: TIMEOUT after ${took}s") \
      || SUMMARY+=("$name: FAILED rc=$rc (${took}s)")
    FAILED=1
  fi
}

echo "=== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$LOG_DIR/device.log"
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'device', torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG_DIR/device.log"

step install 60 $PY -m pip install --no-deps --no-build-isolation -e .
step kernel_tests 120 $PY -m pytest tests/kernels -q -x -p no:cacheprovider
# GGUF on CUDA: the float-minimum dequant-GEMM (Q4_1/Q4_K/Q5_K) and the INT4/INT8 ones on real files
step gguf_cuda 60 $PY -m pytest tests/gguf/test_gguf_gpu.py tests/kernels/triton/test_quant_gemm.py -q -x -k "cuda or minimums" -p no:cacheprovider
# mixture of experts on CUDA: the Triton fused-MoE grouped GEMM vs the torch reference, Qwen3-MoE /
# Mixtral logits on it, and the engine (CUDA graphs on) giving transformers' greedy tokens
step fused_moe_cuda 45 $PY -m pytest tests/kernels/triton/test_fused_moe.py tests/kernels/triton/test_engine_moe.py -q -x -p no:cacheprovider
# multi-LoRA on CUDA: the Triton shrink/expand (BGMV) kernels vs the float64 definition, and one
# engine batch of base + two adapters equal to transformers + PEFT
step lora_cuda 40 bash -c "$PY -m pytest tests/kernels/triton/test_lora.py -q -x -p no:cacheprovider && \
  $PY -m pytest -m gpu tests/runtime/test_lora_engine.py -q -x -p no:cacheprovider"
step bench_quant_gemm 90 $PY benchmarks/kernels_quant_gemm.py
step bench_attention 60 $PY benchmarks/kernels_attention.py
if [ -f benchmarks/e2e_decode_gpu.py ]; then
  step bench_e2e_decode 75 $PY benchmarks/e2e_decode_gpu.py
else
  echo "=== [bench_e2e_decode] benchmarks/e2e_decode_gpu.py not found: skipped (the lead adds it)"
  SUMMARY+=("bench_e2e_decode: skipped (benchmarks/e2e_decode_gpu.py absent)")
fi

step cuda_graphs 75 bash -c "$PY -m pytest -m gpu tests/runtime -q -p no:cacheprovider && \
  $PY benchmarks/step_breakdown.py --steps 50 --engine-args device=cuda,enforce_eager=1 \
    --label cuda-eager && \
  $PY benchmarks/step_breakdown.py --steps 50 --engine-args device=cuda --label cuda-graphs"

if [ -n "${OUT:-}" ]; then
  cp "$RESULTS"/*.json "$OUT"/ 2>/dev/null || true
fi
echo "=== summary (total $(( $(date +%s) - T0 ))s)"
printf '%s\n' "${SUMMARY[@]}" | tee "$LOG_DIR/summary.txt"
exit $FAILED
