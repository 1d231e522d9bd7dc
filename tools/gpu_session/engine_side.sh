#!/bin/bash
# Device call 1 (carry .gpu-wheels/engine and .gpu-carry): the engine side, no Ray. Installs
# the wheels, writes the random-weight Llama-1B checkpoint, runs the GPU tests, the engine
# offline on the service's load (lockstep and staggered arrivals), the decode step against
# its floor. Everything lands in $OUT; /tmp keeps the checkpoint for serve_side.sh.
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu-wheels/engine/*.whl && touch /tmp/site/.engine || { echo "pip failed"; exit 3; }
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} | tee $OUT/env.txt
test -d /tmp/llama-1b || timeout 90 python3 -m tools.bench.gpu_service checkpoint --tokenizer .gpu-carry/tokenizer \
  --out /tmp/llama-1b > $OUT/checkpoint.log 2>&1; stamp "checkpoint rc=$?"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/unit/model/test_model_families.py \
  tests/unit/model/test_triton_attention.py > $OUT/test-gpu.log 2>&1; stamp "test-gpu rc=$?"; tail -2 $OUT/test-gpu.log
E="python3 -m tools.bench.gpu_service engine --model /tmp/llama-1b"
{ timeout 120 $E --levels 1 16 64 256 --json /tmp/engine.json
  timeout 60 $E --levels 64 --num-requests 192 --staggered; } > $OUT/engine.log 2>&1; stamp engine
grep -a "^engine" $OUT/engine.log; cp /tmp/engine.json $OUT/
timeout 150 python3 -m tools.bench.gpu --shape 1b 8b --skip-hf --requests 64 --json $OUT/gpu.json > $OUT/gpu.log 2>&1
stamp "decode floor rc=$?"; grep -a -E "^(1b|8b) " $OUT/gpu.log
