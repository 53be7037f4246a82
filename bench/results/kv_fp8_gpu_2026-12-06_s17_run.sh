# fp8kv19, session 17, one device call: GPU tests of the fp8 KV pools (kernels vs references, engine vs
# bf16/fp32 pools, non-quantized kernel paths unchanged), then bench/engine_gpu.py with auto vs fp8_e4m3
# pools on the same weights, shape by shape (pool bytes per token, 1- and 256-request rows, batch-1 step,
# greedy agreement)
C=$PWD/.carry/fp8kv19
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
END=$(( T0 + 230 )); cap() { local l=$(( END - $(date +%s) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p /tmp/s && tar -xJf $C/tree.tar.xz -C /tmp/s && cd /tmp/s/tree || exit 1
export PYTHONPATH=/tmp/s/tree PYTHONUNBUFFERED=1
exec > >(tee $OUT/all.log) 2>&1
el "start $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,clocks.max.sm,memory.used --format=csv,noheader; python3 -V
timeout 95 python3 -m pytest -q -c /dev/null --rootdir . -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning \
  tests/kernels/test_kv_fp8.py tests/engine/test_engine_gpu.py tests/kernels/test_triton.py \
  tests/kernels/test_gemv_prologue.py \
  -k "fp8 or rope_store or test_store_kv or decode_split_k or prefill_varlen or equals_cpu_reference" \
  > $OUT/tests.log 2>&1; el "tests rc=$?"; tail -6 $OUT/tests.log
timeout $(cap) python3 bench/engine_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --concurrency 1,256 --no-hf \
  --kv-cache-dtype auto,fp8_e4m3 --json $OUT/engine_kv.json 2>&1 | grep -E "ours|decode|Error|error" | cut -c1-400
el "bench done $(date -u +%FT%TZ)"
