# session 11 gpu17 final device call (bash .carry/gpu17/final_s11.sh): wheels, the branch's code (src.tar), the CUDA
# tests of the gpu backend and the gpu worker (bounded), then the 28-layer offload plan end to end (p32, 64 tokens),
# then --sessions 1,8 with what is left of the budget.
C=$PWD/.carry/gpu17
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 CIPHERLM_HOME=/tmp/home
el "src $(cat $C/COMMIT) $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; uptime
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 || { cat $OUT/home.log; exit 1; }
el "home ok"
timeout ${TEST_S:-110} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -m "gpu and not model" --durations=8 \
  tests/server/test_private_batched.py tests/fhe/test_gpu_backend_cuda.py tests/fhe/test_gpu_backend_step.py \
  tests/fhe/test_gpu_backend_mlp.py tests/fhe/test_gpu_backend_batched.py tests/fhe/test_gpu_backend_packed.py \
  tests/server/test_private_device.py > $OUT/tests.log 2>&1
el "tests rc=$? $(date -u +%H:%M:%S)"; tail -14 $OUT/tests.log
timeout $(left) python3 bench/private_e2e.py --device cuda \
  --offload-plan fhe/data/smollm2-135m-instruct.offload.json --prompt-tokens 32 --max-tokens 64 \
  --sessions 1,8 --session-tokens 12 --json $OUT/e2e.json --server-log $OUT/server.log > $OUT/e2e.log 2>&1
el "e2e rc=$? $(date -u +%H:%M:%S)"
grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -32
grep "encrypted token" $OUT/e2e.log | head -3; grep "encrypted token" $OUT/e2e.log | tail -1
tail -5 $OUT/server.log
