#!/usr/bin/env bash
# The GPU checks, on a CUDA machine that already has the project installed (`make setup` there,
# or the offline wheelhouse install the README describes), with the default model:
#   1. parity: FlashInfer against the torch reference (random trees, KV lengths 1 to 4k,
#      GQA 1/3/8, head dims 64/128, page sizes 1/16, bf16 and fp16);
#   2. engine: SmolLM2 end to end with FlashInfer against the torch backend, HF greedy and HF
#      float32 greedy (mismatch rates, bf16 and fp16);
#   3. bench: a short benchmark: HumanEval, batch 1 and 16, HF and none vs lookahead (fixed and
#      adaptive), bf16.
#
#   make gpu-check                                   # with .venv from `make setup`
#   PYTHON=/path/to/python scripts/gpu_check.sh      # any interpreter with the project installed
#
# Results go to $OUT (default gpu_out/): gpu.txt (device and versions), parity.txt, engine.txt,
# bench.txt and bench/ (report.md, results.json, throughput.png). GPU_CHECKS picks steps
# (default "parity engine bench"); a failed step does not stop the others, and the exit status
# says whether any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-gpu_out}
STEPS=${GPU_CHECKS:-parity engine bench}
mkdir -p "$OUT_DIR"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
"$PY" -c 'import torch, flashinfer, transformers; print("torch", torch.__version__, "flashinfer", flashinfer.__version__, "transformers", transformers.__version__)' | tee -a "$OUT_DIR/gpu.txt"

failed=0
if [[ " $STEPS " == *" parity "* ]]; then
  echo "== 1. FlashInfer vs the torch reference"
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/attention/test_flashinfer_gpu.py 2>&1 | tee "$OUT_DIR/parity.txt" || failed=1
fi
if [[ " $STEPS " == *" engine "* ]]; then
  echo "== 2. SmolLM2 end to end"
  "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/engine/test_flashinfer_engine.py 2>&1 | tee "$OUT_DIR/engine.txt" || failed=1
fi
if [[ " $STEPS " == *" bench "* ]]; then
  echo "== 3. benchmark: HumanEval, batch 1 and 16"
  # Lossless is checked against HF in the same bf16: rounding can flip near-ties, so a
  # mismatch is reported in the table rather than failing the script.
  "$PY" -m batchserve.cli bench --dataset humaneval --num-prompts 16 --max-new-tokens 128 --batch-sizes 1,16 \
    --methods hf,none,lookahead-16,lookahead-adaptive --dtype bfloat16 --out "$OUT_DIR/bench" --allow-mismatch \
    2>&1 | tee "$OUT_DIR/bench.txt" | grep -v '%|' || failed=1
  cat "$OUT_DIR/bench/report.md" || failed=1
fi
exit $failed
