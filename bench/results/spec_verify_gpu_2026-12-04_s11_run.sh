# spec18-s11 device call: the branch's code (src.tar), GPU tests of the verify graphs, then bench/spec_verify_gpu.py
C=$PWD/.carry/spec18
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src PYTHONUNBUFFERED=1
el "src $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
timeout 150 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -rA tests/engine/test_spec_decode_gpu.py \
  tests/engine/test_model_runner.py tests/engine/test_engine_gpu.py \
  > $OUT/pytest.log 2>&1; el "pytest rc=$?"
grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" $OUT/pytest.log | tail -30
timeout $(( ${BUDGET_S:-270} - ($(date +%s) - T0) )) python3 bench/spec_verify_gpu.py --iters 50 --warmup 5 \
  --json $OUT/spec_verify.json > $OUT/bench.log 2>&1; el "bench rc=$? $(date -u +%FT%TZ)"
cat $OUT/bench.log | tail -40
