C=$PWD/.carry/gpufhe
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
echo "src $(cat COMMIT)"; date -u
timeout ${SESS_S:-330} python3 bench/gpu_sessions.py --weights $C/packed --procs 1,2,4,8 --sessions 1,8,32 --rounds 2 --out $OUT/sessions.json 2>&1 | tee $OUT/sessions.log
echo "rc=$? t+$(( $(date +%s) - T0 ))s"; nvidia-smi --query-gpu=memory.used --format=csv,noheader; date -u
