#!/usr/bin/env bash
# Every GPU check in one go, on a CUDA machine that has the project installed (`make setup` there,
# or the offline staging of ../shared/gpu), with the default model; about 8 minutes:
#   1. tests: the `gpu` tests, CUDA graphs first (a replayed bucket equals the same bucket eager,
#      bit for bit; the engine with graphs equals without at batch 1 and 8; prompt chunks between
#      replayed steps; capture time and memory), then FlashInfer against the torch reference and
#      the engine against HF;
#   2. bench: HumanEval, 8 prompts x 128 tokens at batch 1 and 16, bf16: hf, hf-static (static
#      cache + torch.compile), none and lookahead-adaptive, written to benchmarks/results/gpu-graphs/;
#   3. sharegpt: the same methods but hf on ShareGPT at 16 in flight (seated tok/s).
#
#   make gpu-check                                   # with .venv from `make setup`
#   PYTHON=/path/to/python scripts/gpu_check.sh      # any interpreter with the project installed
#
# Logs go to $OUT (default gpu_out/): gpu.txt (device and versions), tests.txt, bench.txt,
# sharegpt.txt; the bench reports to $RESULTS (default benchmarks/results/gpu-graphs/). GPU_CHECKS
# picks steps (default "tests bench sharegpt"); a failed step does not stop the others, and the
# exit status says whether any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-gpu_out}
RESULTS=${RESULTS:-benchmarks/results/gpu-graphs}
STEPS=${GPU_CHECKS:-tests bench sharegpt}
mkdir -p "$OUT_DIR" "$RESULTS"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
"$PY" -c 'import torch, flashinfer, transformers; print("torch", torch.__version__, "flashinfer", flashinfer.__version__, "transformers", transformers.__version__)' | tee -a "$OUT_DIR/gpu.txt"

failed=0
if [[ " $STEPS " == *" tests "* ]]; then
  echo "== 1. gpu tests"
  timeout 240 "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/runner/test_graphs_gpu.py \
    tests/attention/test_flashinfer_gpu.py tests/model/test_cuda_graph_gpu.py tests/engine/test_flashinfer_engine.py \
    2>&1 | tee "$OUT_DIR/tests.txt" || failed=1
fi
if [[ " $STEPS " == *" bench "* ]]; then
  echo "== 2. bench: HumanEval at 1 and 16, bf16"
  # Lossless is checked against HF in the same bf16: rounding can flip near-ties, so a
  # mismatch is reported in the table rather than failing the script.
  timeout 180 "$PY" -m batchserve.cli bench --dataset humaneval --num-prompts 8 --max-new-tokens 128 \
    --batch-sizes 1,16 --methods hf,hf-static,none,lookahead-adaptive --dtype bfloat16 --out "$RESULTS/humaneval" \
    --allow-mismatch 2>&1 | tee "$OUT_DIR/bench.txt" | grep -v '%|' || failed=1
  cat "$RESULTS/humaneval/report.md" || failed=1
fi
if [[ " $STEPS " == *" sharegpt "* ]]; then
  echo "== 3. bench: ShareGPT at 16, bf16"
  timeout 120 "$PY" -m batchserve.cli bench --dataset sharegpt --num-prompts 32 --max-new-tokens 128 \
    --batch-sizes 16 --methods none,lookahead-adaptive --dtype bfloat16 --out "$RESULTS/sharegpt" \
    --allow-mismatch 2>&1 | tee "$OUT_DIR/sharegpt.txt" | grep -v '%|' || failed=1
  cat "$RESULTS/sharegpt/report.md" || failed=1
fi
exit $failed
