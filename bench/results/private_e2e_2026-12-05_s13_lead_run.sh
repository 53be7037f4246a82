#!/bin/bash
# session 13 lead device calls (bash .carry/lead-s13/run.sh tests|e2e): merged main as the working tree.
C=$PWD/.carry/lead-s13
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CIPHERLM_HOME=/tmp/home
el "commit $(git rev-parse --short HEAD 2>/dev/null || cat $C/COMMIT) $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; uptime; nproc
if [ "$1" = tests ]; then
  timeout ${TEST_S:-300} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -m "gpu and not model" --durations=15 \
    tests/fhe tests/server/test_private_batched.py tests/server/test_private_device.py tests/engine/test_engine_gpu.py \
    tests/engine/test_spec_decode_gpu.py tests/kernels > $OUT/gpu_tests.log 2>&1
  el "tests rc=$? $(date -u +%H:%M:%S)"; tail -30 $OUT/gpu_tests.log
else
  python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 || { cat $OUT/home.log; exit 1; }
  el "home ok"
  timeout ${E2E_S:-480} python3 bench/private_e2e.py --device cuda --engine-gpu-share 0.35 \
    --offload-plan fhe/data/smollm2-135m-instruct.offload.json --prompt-tokens 32 --max-tokens 64 \
    --json $OUT/e2e.json --server-log $OUT/server.log > $OUT/e2e.log 2>&1
  el "e2e rc=$? $(date -u +%H:%M:%S)"
  grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -40
  tail -3 $OUT/server.log
fi
if [ "$1" = tests ]; then timeout 120 python3 $C/parse_ab.py > $OUT/parse_ab.log 2>&1; el "parse_ab rc=$?"; cat $OUT/parse_ab.log; fi
