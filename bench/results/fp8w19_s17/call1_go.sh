# fp8w19, session 17, one device call: the fp8 GPU tests, then bench/gemv_fp8_gpu.py (ceilings, layer GEMMs,
# engine batch-1 bf16/fp8/int4 and 256 requests bf16/fp8 on the Llama-3.2-1B and Qwen2.5-0.5B shapes)
C=$PWD/.carry/fp8w19
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
END=$(( T0 + 205 )); cap() { local l=$(( END - $(date +%s) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p /tmp/s && tar -xJf $C/tree.tar.xz -C /tmp/s && cd /tmp/s/tree || exit 1
export PYTHONPATH=/tmp/s/tree PYTHONUNBUFFERED=1
exec > >(tee $OUT/all.log) 2>&1
el "start $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,clocks.max.sm,memory.used --format=csv,noheader
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_capability())"
timeout 80 python3 -m pytest -q -c /dev/null --rootdir . -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning \
  tests/kernels/test_gemv_fp8.py tests/kernels/test_scaled_mm_fp8.py tests/engine/test_fp8.py tests/engine/test_fused.py \
  tests/engine/test_engine_gpu.py -k "fp8 or int4 or fused or gemv or scaled or quantiz or tuning" > $OUT/tests.log 2>&1
el "tests rc=$?"; tail -12 $OUT/tests.log
timeout $(cap) python3 -m bench.gemv_fp8_gpu --shapes llama3.2-1b,qwen2.5-0.5b --json $OUT/fp8.json 2>&1 | grep -v -i warn | cut -c1-420
el "bench done"
