# session 13 crypto17 device call (bash .carry/crypto17-s13/run.sh, carry=[".carry/crypto17-s13"]): wheels, the
# branch's code (src.tar), the gpu-marked tests of the files this branch touched, the client's crypto on this
# machine's CPU (bench/client_crypto.py: seeded vs full uploads, the GPU worker's parse both ways, the forked pool),
# then the 28-layer offload plan end to end (p32, 64 tokens; the SDK's crypto pool at its default), then
# --sessions 1,8 with what is left of the budget (MODE=sessions: only that).
C=$PWD/.carry/crypto17-s13
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 CIPHERLM_HOME=/tmp/home
el "src $(cat $C/COMMIT) $(date -u +%H:%M:%S) python $(python3 -V 2>&1) numpy $(python3 -c 'import numpy; print(numpy.__version__)')"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; uptime; nproc
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 || { cat $OUT/home.log; exit 1; }
el "home ok"
if [ "${MODE:-full}" = full ]; then
  timeout ${TEST_S:-100} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -m "gpu and not model" --durations=6 \
    tests/server/test_private_batched.py tests/server/test_private_device.py > $OUT/tests.log 2>&1
  el "tests rc=$? $(date -u +%H:%M:%S)"; tail -8 $OUT/tests.log
  timeout 60 python3 bench/client_crypto.py --count 36 --threads 1 --processes 1,2,4,8 --json $OUT/client_crypto.json \
    > $OUT/client_crypto.log 2>&1
  el "client_crypto rc=$?"; cat $OUT/client_crypto.log
  timeout $(left) python3 bench/private_e2e.py --device cuda \
    --offload-plan fhe/data/smollm2-135m-instruct.offload.json --prompt-tokens 32 --max-tokens 64 ${E2E_ARGS} \
    --json $OUT/e2e.json --server-log $OUT/server.log > $OUT/e2e.log 2>&1
else
  timeout $(left) python3 bench/private_e2e.py --device cuda \
    --offload-plan fhe/data/smollm2-135m-instruct.offload.json --prompt-tokens 32 --max-tokens 16 ${E2E_ARGS} \
    --sessions 1,8 --session-tokens 12 --json $OUT/e2e.json --server-log $OUT/server.log > $OUT/e2e.log 2>&1
fi
el "e2e rc=$? $(date -u +%H:%M:%S)"
grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -40
grep "encrypted token" $OUT/e2e.log | head -3; grep "encrypted token" $OUT/e2e.log | tail -1
tail -4 $OUT/server.log
