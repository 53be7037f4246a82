# fp8w19, session 17, call 2: the GPU tests the first call's 80 s cap cut off (fp8 engine tests), and the
# row-quantizer bytes after the reference's CUDA-division fix
C=$PWD/.carry/fp8w19
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/s && tar -xJf $C/tree.tar.xz -C /tmp/s && cd /tmp/s/tree || exit 1
export PYTHONPATH=/tmp/s/tree PYTHONUNBUFFERED=1
exec > >(tee $OUT/all.log) 2>&1
el "start $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 85 python3 -m pytest -q -c /dev/null --rootdir . -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/kernels/test_scaled_mm_fp8.py tests/engine/test_engine_gpu.py -k "quantizer or fp8 or int4" > $OUT/tests.log 2>&1
el "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -15
