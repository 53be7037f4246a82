# fuse19, session 16, call 2: the changed GPU tests, then the GEMV prologues alone per GEMM (sweep) and the
# batch-1 engine rows with RoPE+store only vs + tuned prologues, on one card
C=$PWD/.carry/fuse19
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
END=$(( T0 + 265 )); cap() { local l=$(( END - $(date +%s) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p /tmp/s && tar -xJf $C/tree.tar.xz -C /tmp/s && cd /tmp/s/tree || exit 1
export PYTHONPATH=/tmp/s/tree PYTHONUNBUFFERED=1
exec > >(tee $OUT/all2.log) 2>&1
el "start $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,clocks.max.sm,memory.used --format=csv,noheader
timeout 75 python3 -m pytest -q -c /dev/null --rootdir . -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning \
  tests/engine/test_engine_gpu.py -k "decode_fusions" > $OUT/tests2.log 2>&1; el "tests rc=$?"; tail -4 $OUT/tests2.log
timeout $(cap) python3 -m bench.gemv_prologue_gpu --shapes llama3.2-1b,qwen2.5-0.5b --json $OUT/prologue.json 2>&1 \
  | grep -v -i warn | cut -c1-600
el "done"
