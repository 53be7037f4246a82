# ks17 (session 17) device call: the whole-step graph tests, the decode step main vs new, then the CUDA tests
C=$PWD/.carry/ks17
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xJf $C/tree.tar.xz -C /tmp/src && cd /tmp/src/tree || exit 1
export PYTHONPATH=/tmp/src/tree:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat $C/COMMIT) $(date -u +%Y-%m-%dT%H:%M:%SZ) $(python3 -V)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning --durations=8"
timeout ${STEP_S:-90} $PT tests/fhe/test_gpu_backend_whole_step.py > $OUT/tests_whole_step.log 2>&1
el "whole-step tests rc=$? $(date -u +%H:%M:%S)"; tail -12 $OUT/tests_whole_step.log
[ -n "$SKIP_BENCH" ] || timeout ${BENCH_S:-200} python3 bench/gpu_decode.py --weights $C/smollm2 --variants ${VARIANTS:-main,new} --sessions "${SESSIONS-1,8,32}" --repeat ${REPEAT:-5} --out $OUT/decode.json > $OUT/decode.log 2>&1
el "bench rc=$? $(date -u +%H:%M:%S)"; grep -v "^ \|^{\|^}" $OUT/decode.log | tail -40
timeout ${TEST_S:-60} $PT tests/fhe/test_gpu_backend_cuda.py ${TESTS_K:+-k "$TESTS_K"} > $OUT/tests_cuda.log 2>&1
el "cuda tests rc=$? $(date -u +%H:%M:%S)"; tail -12 $OUT/tests_cuda.log
