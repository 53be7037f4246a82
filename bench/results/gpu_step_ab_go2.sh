# ks17 second call: whole-step graphs off/on in turn, random keys (bench/gpu_step_ab.py)
C=$PWD/.carry/ks17
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xJf $C/tree.tar.xz -C /tmp/src && cd /tmp/src/tree || exit 1
export PYTHONPATH=/tmp/src/tree:/tmp/site PYTHONUNBUFFERED=1
el "src $(cat $C/COMMIT) $(date -u +%Y-%m-%dT%H:%M:%SZ)"; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
timeout ${AB_S:-40} python3 bench/gpu_step_ab.py --weights $C/smollm2 --contexts ${CTX:-128,512} --repeat ${REPEAT:-10} --sessions ${SESSIONS:-8} --out $OUT/ab.json > $OUT/ab.log 2>&1
el "ab rc=$? $(date -u +%H:%M:%S)"; grep -v "^{" $OUT/ab.log | tail -20; nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
