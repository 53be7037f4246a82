# lead's device call (session 8): the 28-layer offload plan end to end, workers on the H200, after the merges;
# then concurrent sessions through one worker (steps batched across sessions), same server.
C=$PWD/.carry/g16; L=$PWD/.carry/lead
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $L/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat COMMIT)"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1 || { cat $OUT/home.log; exit 1; }
el "home ok"
CIPHERLM_HOME=/tmp/home timeout ${E2E_S:-500} python3 bench/private_e2e.py --device cuda \
  --offload-plan fhe/data/smollm2-135m-instruct.offload.json --prompt-tokens 32 --max-tokens ${E2E_TOKENS:-64} \
  --sessions ${E2E_SESSIONS:-1,8} --session-tokens ${E2E_STOKENS:-12} --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$?"; grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -45
