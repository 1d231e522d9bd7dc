#!/usr/bin/env bash
# Prepares, on the CPU machine, what a lent GPU machine needs for the whole service, in two
# folders that each fit one device call (64 MiB with the working tree):
#   .gpu-wheels/engine  the wheels the engine, the tests and the openai client need (no Ray)
#   .gpu-wheels/serve   Ray and what Ray Serve imports beside it
#   .gpu-carry/tokenizer the default model's tokenizer (the random checkpoint's)
# From ../shared/gpu/build-wheelhouse.sh's wheels, re-split: a second `pip install --target
# --upgrade` into the same folder replaces a namespace package's folder (opentelemetry) with
# its own part, so the serve wheels go to a folder of their own (serve_side.sh), carrying
# every opentelemetry/opencensus wheel; and grpcio-reflection is pinned to the image's
# grpcio (1.84: 1.85.1 refuses to import beside it).
# Usage, from the project root, after `make install`: tools/gpu_session/wheels.sh (then README.md here)
set -euo pipefail
grep -qx '/.gpu-wheels/' .git/info/exclude 2>/dev/null || echo /.gpu-wheels/ >> .git/info/exclude
grep -qx '/.gpu-carry/' .git/info/exclude 2>/dev/null || echo /.gpu-carry/ >> .git/info/exclude
rm -rf .gpu-wheels && OUT=.gpu-wheels/all ../shared/gpu/build-wheelhouse.sh
mkdir -p .gpu-wheels/engine .gpu-wheels/serve
mv .gpu-wheels/all/*/*.whl .gpu-wheels/engine/ && rm -rf .gpu-wheels/all
cd .gpu-wheels/engine
mv ray-* virtualenv-* grpcio_reflection-* ../serve/
cp opentelemetry* opencensus* ../serve/  # the namespace packages' parts, whole in the serve folder
pip_download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
rm ../serve/grpcio_reflection-*; pip_download ../serve grpcio-reflection==1.84.0
pip_download . openai distro jiter sniffio  # the client checks (tools/bench/gpu_service.py)
cd ../..
"${PYTHON:-.venv/bin/python}" - <<'P'
from transformers import AutoTokenizer
from workers.contract.model_config import BUILTIN_DEFAULT_MODEL
from workers.model.loader import prepare_model_dir
AutoTokenizer.from_pretrained(prepare_model_dir(BUILTIN_DEFAULT_MODEL)).save_pretrained(".gpu-carry/tokenizer")
P
du -sh .gpu-wheels/* .gpu-carry
