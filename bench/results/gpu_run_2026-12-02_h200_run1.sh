# The device call's body (bash .carry/gpufhe/run.sh): wheels, this branch's code, then the runs.
C=$PWD/.carry/gpufhe
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
el "start $(git -C $C/.. log -1 --format=%h 2>/dev/null) src $(cat /tmp/src/COMMIT)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc
python3 -c "import tenseal, fastapi, pydantic_settings, zstandard, rfc8785, cryptography, uvicorn; print('imports ok')" || exit 1
# the random-weight home (CPU) while the packed bench runs its GPU part alone
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 &
HM=$!
python3 bench/gpu_packed.py --weights $C/packed --repeat ${PK_REPEAT:-2} --out $OUT/packed.json --marker /tmp/gpu_done > $OUT/packed.log 2>&1 &
PK=$!
while [ ! -e /tmp/gpu_done ] && kill -0 $PK 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 260 ]; do sleep 2; done
el "packed GPU part done"; cat $OUT/packed.log
wait $HM; cat $OUT/home.log
el "e2e start"
CIPHERLM_HOME=/tmp/home timeout ${E2E_S:-330} python3 bench/private_e2e.py --device cuda --plan /tmp/home/plan.json \
  --prompt-tokens 32 --max-tokens ${E2E_TOKENS:-64} --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$?"; grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -40; grep "encrypted token" $OUT/e2e.log | head -3
el "tests"
timeout 90 python3 -m pytest -q -c /dev/null -p no:cacheprovider tests/fhe/test_gpu_backend_packed.py 2>&1 | tail -4
while kill -0 $PK 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 560 ]; do sleep 3; done
el "packed SEAL part"; tail -3 $OUT/packed.log
