# fuse19, session 16, one device call: GPU tests of the issue-19.2 fusions, then the batch-1 step
# without / with them (per-kernel profile) and the 1- and 256-request engine rows, all on one card
C=$PWD/.carry/fuse19
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
END=$(( T0 + 420 )); cap() { local l=$(( END - $(date +%s) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p /tmp/s && tar -xJf $C/tree.tar.xz -C /tmp/s && cd /tmp/s/tree || exit 1
export PYTHONPATH=/tmp/s/tree PYTHONUNBUFFERED=1
exec > >(tee $OUT/all.log) 2>&1
el "start $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,clocks.max.sm,memory.used --format=csv,noheader; python3 -V
timeout 170 python3 -m pytest -q -c /dev/null --rootdir . -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning \
  tests/kernels/test_gemv_prologue.py tests/engine/test_engine_gpu.py tests/kernels/test_gemv_int4_w32.py \
  > $OUT/tests.log 2>&1; el "tests rc=$?"; tail -4 $OUT/tests.log
timeout $(cap) python3 bench/int4_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --profile --variants off,fused+1pass \
  --json $OUT/int4_profile.json 2>&1 | grep -v -i warn | cut -c1-330
el "int4 profile done"
timeout $(cap) python3 bench/engine_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --concurrency 1,256 --no-hf --fusions off \
  --json $OUT/engine_off.json 2>&1 | grep -E "ours|decode"
el "engine off done"
timeout $(cap) python3 bench/engine_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --concurrency 1,256 --no-hf --fusions on \
  --json $OUT/engine_on.json 2>&1 | grep -E "ours|decode"
el "engine on done"
timeout $(cap) python3 bench/int4_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --variants fused \
  --json $OUT/int4_fused.json 2>&1 | grep -v -i warn | cut -c1-330
el "int4 fused (no one-pass) done"
