#!/usr/bin/env bash
# CPU benchmark, one command: chatserve (full Serve HTTP path), then in the same run
# `transformers serve --continuous-batching` on the same converted model and load, then
# chatserve's engine offline at the same load (no Serve) and the raw model forward at
# batch 1; ends with a side-by-side table (tools/bench/summary.py).
# Usage: tools/bench/cpu_compare.sh [concurrency levels...]   (default: 1 16 32 64)
# Env: MAX_TOKENS (64), BIN (.venv/bin), SKIP_CHATSERVE / SKIP_TRANSFORMERS / SKIP_ENGINE=1,
# DIRECT_INGRESS=1 (chatserve as `make serve-direct` runs it: the client talks to the ingress
# replica's own port 8001, no Serve proxy in the path), STREAM_INTERVAL=N (chatserve's
# engine.stream_interval, default: the config's 1).
# Every side runs the dtype configs/default.yaml's `auto` resolves to on this CPU (bfloat16
# with AMX, else float32): transformers serve gets it as --dtype.
# Writes bench-results/{chatserve,transformers,engine}.json. Loopback only; bounded loops.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # Ray workers import this checkout
LEVELS=${*:-1 16 32 64}
OUT=bench-results
mkdir -p "$OUT"
MAX_TOKENS=${MAX_TOKENS:-64}
DTYPE=$($BIN/python -c "from workers.model.loader import resolve_dtype; print(str(resolve_dtype('auto', 'cpu')).removeprefix('torch.'))")
echo "== dtype on this CPU: $DTYPE"
CONFIG=configs/default.yaml
if [ -n "${STREAM_INTERVAL:-}" ]; then
  CONFIG=$OUT/default-stream-interval.yaml
  $BIN/python - "$STREAM_INTERVAL" "$CONFIG" <<'PY'
import sys, yaml
config = yaml.safe_load(open("configs/default.yaml"))
config["applications"][0]["args"]["models"][0]["engine"]["stream_interval"] = int(sys.argv[1])
yaml.safe_dump(config, open(sys.argv[2], "w"), sort_keys=False)
PY
fi
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; $BIN/ray stop --force >/dev/null 2>&1 || true; }
trap cleanup EXIT

wait_up() {  # url seconds
  for _ in $(seq "$2"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "server at $1 did not come up" >&2; return 1
}

if [ -z "${SKIP_CHATSERVE:-}" ]; then
  URL=http://127.0.0.1:8000
  if [ -n "${DIRECT_INGRESS:-}" ]; then
    export RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8001 RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8100
    URL=http://127.0.0.1:8001
  fi
  echo "== chatserve (serve run $CONFIG, clients at $URL)"
  $BIN/serve run "$CONFIG" >"$OUT/chatserve.log" 2>&1 &
  SERVE_PID=$!; PIDS+=("$SERVE_PID")
  wait_up "$URL" 300
  $BIN/python -m tools.bench.load --url "$URL" --concurrency $LEVELS \
    --max-tokens "$MAX_TOKENS" --json "$OUT/chatserve.json"
  kill "$SERVE_PID"; wait "$SERVE_PID" 2>/dev/null || true
  $BIN/ray stop --force >/dev/null 2>&1 || true
fi

if [ -z "${SKIP_TRANSFORMERS:-}" ]; then
  # transformers serve cannot load the GGUF directory itself; it loads our converted copy.
  MODEL_DIR=$($BIN/python -c "from workers.model.loader import prepare_model_dir; print(prepare_model_dir('builtin:smollm2-135m-instruct'))")
  echo "== transformers serve --continuous-batching $MODEL_DIR"
  mkdir -p "$OUT/hf-cache"  # transformers serve lists models from an HF cache dir; give it an empty one
  HF_HUB_OFFLINE=1 HF_HUB_CACHE="$PWD/$OUT/hf-cache" $BIN/transformers serve --continuous-batching --device cpu \
    --dtype "$DTYPE" --port 8001 "$MODEL_DIR" >"$OUT/transformers.log" 2>&1 &
  TF_PID=$!; PIDS+=("$TF_PID")
  wait_up http://127.0.0.1:8001 300
  $BIN/python -m tools.bench.load --url http://127.0.0.1:8001 --model "$MODEL_DIR" --concurrency $LEVELS \
    --max-tokens "$MAX_TOKENS" --no-ignore-eos --json "$OUT/transformers.json"  # it rejects ignore_eos
  kill "$TF_PID"; wait "$TF_PID" 2>/dev/null || true
fi

if [ -z "${SKIP_ENGINE:-}" ]; then
  echo "== chatserve engine offline, same load (no Serve, no HTTP)"
  $BIN/python -m tools.bench.engine --dtype "$DTYPE" offline --concurrency $LEVELS --max-tokens "$MAX_TOKENS" \
    --json "$OUT/engine.json"
  echo "== raw model forward, decode at batch 1"
  $BIN/python -m tools.bench.engine --dtype "$DTYPE" decode --batch 1
fi

echo "== summary"
$BIN/python tools/bench/summary.py "$OUT"
