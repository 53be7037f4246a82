# gpu17's device call: GPU tests of the step graphs / fused NTT / merged inner product, then bench/gpu_step.py
C=$PWD/.carry/g16; G=$PWD/.carry/gpu17
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $G/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat $G/COMMIT)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc; uptime
timeout ${TEST_S:-150} python3 -m pytest -q -c /dev/null -p no:cacheprovider ${TESTS:-tests/fhe/test_gpu_backend_step.py \
  tests/fhe/test_gpu_backend_mlp.py tests/fhe/test_gpu_backend_batched.py \
  tests/fhe/test_gpu_backend_cuda.py} ${TEST_K:+-k "$TEST_K"} > $OUT/tests.log 2>&1
el "tests rc=$?"; tail -15 $OUT/tests.log
timeout ${BENCH_S:-300} python3 bench/gpu_step.py --batches ${BATCHES:-1,8,32} ${SWEEP:+--sweep $SWEEP} --out $OUT/gpu_step.json > $OUT/gpu_step.log 2>&1
el "bench rc=$?"; tail -c 6000 $OUT/gpu_step.log
