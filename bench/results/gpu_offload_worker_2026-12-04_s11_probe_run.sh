# session 11 gpu17 probe (bash .carry/gpu17/probe_s11.sh): the new CUDA test, then a gpu offload worker alone
# (start: encode + warm captures; warm steps per part), with tracebacks.
C=$PWD/.carry/gpu17
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 CIPHERLM_HOME=/tmp/home
el "src $(cat $C/COMMIT) $(date -u +%H:%M:%S)"
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 || { cat $OUT/home.log; exit 1; }
el "home ok"
timeout 150 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -x -m gpu tests/server/test_private_batched.py > $OUT/tests.log 2>&1
el "tests rc=$?"; tail -30 $OUT/tests.log
timeout ${PROBE_S:-330} python3 bench/gpu_offload_worker.py --json $OUT/worker.json > $OUT/worker.log 2>&1
el "worker rc=$?"; tail -40 $OUT/worker.log
nvidia-smi --query-gpu=memory.used --format=csv
