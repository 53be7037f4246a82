# session 11 gpu17 device call (bash .carry/gpu17/run_s11.sh): wheels, the branch's code (src.tar), the client's
# crypto per ciphertext and thread scaling, the new CUDA test, then the 28-layer offload plan end to end (p32, 64
# tokens) with --sessions ${SESSIONS:-1,8}. STAGE=final also runs the gpu backend's CUDA tests first.
C=$PWD/.carry/gpu17
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${BUDGET_S:-585} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat $C/COMMIT) $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc; uptime
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 || { cat $OUT/home.log; exit 1; }
el "home ok"
timeout 60 python3 bench/client_crypto.py --threads 1,2,4,8 --json $OUT/crypto.json > $OUT/crypto.log 2>&1; el "crypto rc=$?"; cat $OUT/crypto.log
T="tests/server/test_private_batched.py"
[ "$STAGE" = final ] && T="$T tests/fhe/test_gpu_backend_cuda.py tests/fhe/test_gpu_backend_step.py tests/fhe/test_gpu_backend_mlp.py tests/fhe/test_gpu_backend_batched.py tests/fhe/test_gpu_backend_packed.py tests/server/test_private_device.py"
timeout ${TEST_S:-150} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -m gpu $T > $OUT/tests.log 2>&1
el "tests rc=$?"; tail -15 $OUT/tests.log
CIPHERLM_HOME=/tmp/home timeout $(left) python3 bench/private_e2e.py --device cuda \
  --offload-plan fhe/data/smollm2-135m-instruct.offload.json --prompt-tokens 32 --max-tokens 64 \
  --sessions ${SESSIONS:-1,8} --session-tokens 12 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$? $(date -u +%H:%M:%S)"
grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -40
grep "encrypted token" $OUT/e2e.log | head -4; grep "encrypted token" $OUT/e2e.log | tail -2
