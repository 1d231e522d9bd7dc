#!/bin/bash
# Device call 2, sent at once after engine_side.sh on the same warm machine (carry
# .gpu-wheels/serve and .gpu-carry): Ray into a folder of its own, then `serve run` of
# configs/gpu.yaml on the checkpoint, the openai client's checks, the load, the table
# against engine_side.sh's engine figures.
export PYTHONUNBUFFERED=1
test -f /tmp/site/.engine -a -f /tmp/engine.json || { echo "machine was replaced: run engine_side.sh again"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-serve \
  .gpu-wheels/serve/*.whl || { echo "pip failed"; exit 3; }
export PYTHONPATH=$PWD:/tmp/site-serve:/tmp/site PATH=/tmp/site-serve/bin:/tmp/site/bin:$PATH
timeout 300 python3 -m tools.bench.gpu_service serve --model /tmp/llama-1b --levels 1 16 64 256 --ready-timeout 150 \
  --json $OUT/serve.json > $OUT/serve-bench.log 2>&1; echo "serve rc=$?"
grep -a "^check" $OUT/serve-bench.log; cp /tmp/engine.json $OUT/
python3 -m tools.bench.gpu_service table /tmp/engine.json $OUT/serve.json
