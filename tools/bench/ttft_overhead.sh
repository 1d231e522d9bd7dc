#!/usr/bin/env bash
# TTFT overhead of the Serve path over the engine alone, concurrency 1 (target < 5 ms):
# the same templated prompt, 40 requests each, 4 output tokens; first through
# `serve run configs/default.yaml` + HTTP, then straight into LLMEngine.step().
# Usage: tools/bench/ttft_overhead.sh [requests]   Env: BIN (.venv/bin).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # Ray workers import this checkout
N=${1:-40}
OUT=bench-results/ttft-overhead
mkdir -p "$OUT"
$BIN/serve run configs/default.yaml >"$OUT/chatserve.log" 2>&1 &
SERVE_PID=$!
trap 'kill $SERVE_PID 2>/dev/null || true; $BIN/ray stop --force >/dev/null 2>&1 || true' EXIT
for _ in $(seq 300); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
$BIN/python -m tools.bench.load --url http://127.0.0.1:8000 --concurrency 1 --num-requests "$N" --max-tokens 4 \
  --json "$OUT/chatserve.json"
kill $SERVE_PID; wait $SERVE_PID 2>/dev/null || true
$BIN/ray stop --force >/dev/null 2>&1 || true
$BIN/python -m tools.bench.engine offline --concurrency 1 --num-requests "$N" --max-tokens 4 --json "$OUT/engine.json"
$BIN/python tools/bench/summary.py "$OUT"
