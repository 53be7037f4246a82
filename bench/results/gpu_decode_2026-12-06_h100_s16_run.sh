# ks16 (session 16) device call: the decode step before/after (main / shoup / new switches), then the CUDA tests
C=$PWD/.carry/ks16
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xJf $C/tree.tar.xz -C /tmp/src && cd /tmp/src/tree || exit 1
export PYTHONPATH=/tmp/src/tree:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat $C/COMMIT) $(date -u +%H:%M:%S) $(python3 -V)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; uptime
timeout ${BENCH_S:-330} python3 bench/gpu_decode.py --weights $C/smollm2 --variants ${VARIANTS:-main,shoup,new} --sessions "${SESSIONS-1,8,32}" --repeat ${REPEAT:-5} --out $OUT/decode.json > $OUT/decode.log 2>&1
el "bench rc=$? $(date -u +%H:%M:%S)"; grep -v "^ \|^{\|^}" $OUT/decode.log | tail -40
timeout ${TEST_S:-200} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q --durations=10 \
  tests/fhe/test_gpu_backend_cuda.py ${TESTS_K:+-k "$TESTS_K"} > $OUT/tests.log 2>&1
el "tests rc=$? $(date -u +%H:%M:%S)"; tail -15 $OUT/tests.log
