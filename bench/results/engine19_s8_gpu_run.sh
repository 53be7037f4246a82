# engine19 session 8, one device call: int4 GEMM sweep with the x_per_row tunings + engine rows (bf16 vs int4,
# same run), the serving rows at 32/256 users (errors now named), then the fair 256-request bench.
C=$PWD/.carry/engine19; G=$PWD/.carry/g16
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
END=$(( T0 + ${BUDGET_S:-500} ))
cap() { local l=$(( END - $(date +%s) )); [ $l -lt $1 ] && echo $(( l > 1 ? l : 1 )) || echo $1; }
mkdir -p /tmp/s && tar -xf $C/src.tar -C /tmp/s && cd /tmp/s || exit 1
export PYTHONPATH=/tmp/s PYTHONUNBUFFERED=1
el "start $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,clocks.max.sm,memory.used --format=csv,noheader
(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/whl/*.whl > $OUT/pip.log 2>&1; echo rc=$? >> $OUT/pip.log) &
PIP=$!
timeout 60 python3 -m pytest -q -c /dev/null -p no:cacheprovider tests/kernels/test_gemv_int4_w32.py 2>&1 | tail -2
timeout $(cap 200) python3 -m bench.gemv_int4_gpu --json $OUT/gemv_int4.json 2>&1 | grep -v Warn | tee $OUT/gemv.log
el "int4 done"
wait $PIP; tail -2 $OUT/pip.log
export PYTHONPATH=/tmp/s:/tmp/site
python3 bench/random_model.py --like $C/like --out /tmp/smol > /dev/null || exit 1
el "serve start"
timeout $(cap 130) python3 bench/serve_bench.py --model /tmp/smol --device cuda --users 32 256 --duration 10 \
  --output-len 128 --input-len 100 --request-rate inf --engine-process on --offline --json $OUT/serve.json 2>&1 \
  | grep -v Warn | tee $OUT/serve.log | tail -20
el "engine_gpu (fair 256) start"
timeout $(cap 400) python3 bench/engine_gpu.py --shapes llama3.2-1b --concurrency 1,256 \
  --json $OUT/engine_gpu.json 2>&1 | grep -v Warn | tee $OUT/engine_gpu.log | tail -20
el "done"
