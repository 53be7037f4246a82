# engine19 session 9, one device call: batch-1 decode step bf16 vs int4 on both shapes, kernel by kernel
C=$PWD/.carry/engine19
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/s && tar -xf $C/src.tar -C /tmp/s && cd /tmp/s || exit 1
export PYTHONPATH=/tmp/s PYTHONUNBUFFERED=1
el "start $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,clocks.max.sm,memory.used --format=csv,noheader
timeout 270 python3 bench/int4_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --profile --json $OUT/int4_profile.json 2>&1 | grep -v Warn | cut -c1-400 | tee $OUT/int4_profile.log
el "done"
