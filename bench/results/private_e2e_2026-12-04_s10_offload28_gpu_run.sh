# session 10 gpu17 device call (bash .carry/gpu17/run.sh): wheels, the branch's code (src.tar), a random-weight
# SmolLM2-shaped home, then the 28-layer offload plan end to end (p32, 64 tokens), then 1 and 8 sessions.
C=$PWD/.carry/gpu17
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat COMMIT) $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc
python3 -c "import tenseal, fastapi, pydantic_settings, zstandard, rfc8785, cryptography, uvicorn, xgrammar; print('imports ok')" || exit 1
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 || { cat $OUT/home.log; exit 1; }
el "home ok"
CIPHERLM_HOME=/tmp/home timeout $(( ${BUDGET_S:-545} - ($(date +%s) - T0) )) python3 bench/private_e2e.py --device cuda \
  --offload-plan fhe/data/smollm2-135m-instruct.offload.json --prompt-tokens 32 --max-tokens 64 \
  --sessions 1,8 --session-tokens 12 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$? $(date -u +%H:%M:%S)"
grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -45
echo "per token (n:s):"; grep "encrypted token" $OUT/e2e.log | sed -E 's/.*token ([0-9]+):.* ([0-9.]+) s \(([0-9]+) steps\)$/\1:\2/' | tr '\n' ' '; echo
