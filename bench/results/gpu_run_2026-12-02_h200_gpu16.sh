# gpu16's device call (bash .carry/g16/run.sh): wheels, this branch's code (src.tar), then the runs.
C=$PWD/.carry/g16
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat COMMIT)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc
python3 -c "import tenseal, fastapi, pydantic_settings, zstandard, rfc8785, cryptography, uvicorn; print('imports ok')" || exit 1
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 || { cat $OUT/home.log; exit 1; }
el "home ok; e2e (28-layer offload plan, workers on cuda)"
CIPHERLM_HOME=/tmp/home timeout ${E2E_S:-320} python3 bench/private_e2e.py --device cuda --plan /tmp/home/plan.json \
  --offload-plan fhe/data/smollm2-135m-instruct.offload.json --prompt-tokens 32 --max-tokens ${E2E_TOKENS:-32} \
  --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$?"; grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -32; grep "encrypted token" $OUT/e2e.log | head -3
el "gpu tests"
timeout 100 python3 -m pytest -q -c /dev/null -p no:cacheprovider tests/fhe/test_gpu_backend_mlp.py tests/fhe/test_gpu_backend_batched.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
el "gpu_mlp bench"
timeout $(( 575 - ($(date +%s) - T0) )) python3 bench/gpu_mlp.py --sessions 1,8,32 --out $OUT/gpu_mlp.json > $OUT/gpu_mlp.log 2>&1
el "bench rc=$?"; grep -v "^ \|^{$\|^}$" $OUT/gpu_mlp.log | tail -8
