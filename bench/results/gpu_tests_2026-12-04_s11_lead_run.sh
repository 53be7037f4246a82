# session 11 lead device call: the CUDA tests of merged main (gpu backend, gpu worker, engine graphs, Triton kernels)
C=$PWD/.carry/lead; W=$PWD/.carry/gpu17
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 CIPHERLM_HOME=/tmp/home
el "src $(cat $C/COMMIT) $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 bench/gpu_e2e_home.py --tokenizer $W/tok --home /tmp/home > $OUT/home.log 2>&1 || { tail -5 $OUT/home.log; }
el "home done"
timeout ${TEST_S:-330} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -m "gpu and not model" --durations=15 \
  tests/fhe/test_gpu_backend_cuda.py tests/fhe/test_gpu_backend_step.py tests/fhe/test_gpu_backend_mlp.py \
  tests/fhe/test_gpu_backend_batched.py tests/fhe/test_gpu_backend_packed.py tests/server/test_private_batched.py \
  tests/engine/test_spec_decode_gpu.py tests/engine/test_engine_gpu.py tests/kernels/ > $OUT/tests.log 2>&1
el "tests rc=$? $(date -u +%H:%M:%S)"; tail -30 $OUT/tests.log
