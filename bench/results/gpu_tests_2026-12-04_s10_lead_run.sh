# session 10 lead's device call: the CUDA tests of the gpu CKKS backend, the GPU worker path and the kernels
# on the merged main (the interleaved chunk layout included), against their torch/SEAL references.
C=$PWD/.carry/gpu17; L=$PWD/.carry/lead
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $L/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat COMMIT) $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout ${BUDGET_S:-170} python3 -m pytest -q -p no:cacheprovider -m "gpu and not model" --durations=15 \
  tests/fhe/test_gpu_backend_step.py tests/fhe/test_gpu_backend_batched.py tests/fhe/test_gpu_backend_mlp.py \
  tests/fhe/test_gpu_backend_packed.py tests/fhe/test_gpu_backend_cuda.py tests/server/test_private_device.py \
  2>&1 | tee $OUT/gpu_tests.log | tail -40
el "pytest rc=${PIPESTATUS[0]} $(date -u +%H:%M:%S)"
