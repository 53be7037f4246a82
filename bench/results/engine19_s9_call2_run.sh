# engine19 session 9, call 2: the same-run table at HEAD (no kernel change this session): both shapes,
# 1 and 256 requests with the transformers peer at 256, then 256-request repeats (ours only) while time is left
C=$PWD/.carry/engine19
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
END=$(( T0 + 265 )); cap() { local l=$(( END - $(date +%s) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p /tmp/s && tar -xf $C/src.tar -C /tmp/s && cd /tmp/s || exit 1
export PYTHONPATH=/tmp/s PYTHONUNBUFFERED=1
el "start $(cat $C/COMMIT) $(date -u +%FT%TZ)"
timeout $(cap) python3 bench/engine_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --concurrency 1,256 --hf-concurrency 256 \
  --json $OUT/run1.json 2>&1 | grep -v -i warn | grep -E "ours|decode|hf " | tee $OUT/run1.log
el "run1 done"
for r in 2 3; do
  timeout $(cap) python3 bench/engine_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --concurrency 256 --no-hf \
    --json $OUT/run$r.json 2>&1 | grep -E "ours|decode" | tee $OUT/run$r.log
  el "run$r done"
done
