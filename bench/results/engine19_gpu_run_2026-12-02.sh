# The device call's body (bash .carry/engine19/run.sh): this branch's code as a tarball, server wheels,
# then the int4 GEMM sweep + engine rows, then the H200 serving rows beside the offline engine.
C=$PWD/.carry/engine19
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
END=$(( T0 + ${BUDGET_S:-400} ))  # the whole call's device time is capped: each step gets what is left
cap() { local l=$(( END - $(date +%s) )); [ $l -lt $1 ] && echo $(( l > 1 ? l : 1 )) || echo $1; }
mkdir -p /tmp/s && tar -xf $C/src.tar -C /tmp/s && cd /tmp/s || exit 1
export PYTHONPATH=/tmp/s PYTHONUNBUFFERED=1
el "start $(cat $C/COMMIT)"
# the server's wheels install on the CPU while the GPU part runs
(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $C/whl/*.whl > $OUT/pip.log 2>&1; echo rc=$? >> $OUT/pip.log) &
PIP=$!
[ -z "$SKIP_INT4" ] && timeout 60 python3 -m pytest -q -c /dev/null -p no:cacheprovider tests/kernels/test_gemv_int4_w32.py 2>&1 | tail -2
[ -z "$SKIP_INT4" ] && timeout $(cap 150) python3 -m bench.gemv_int4_gpu --json $OUT/gemv_int4.json 2>&1 | grep -v Warn | tee $OUT/gemv.log
el "int4 done"
[ -n "$NO_SERVE" ] && exit 0
wait $PIP; tail -2 $OUT/pip.log
export PYTHONPATH=/tmp/s:/tmp/site
python3 -c "import fastapi, uvicorn, pydantic_settings, cryptography, server.cli_serve; print('server imports ok')" || exit 1
python3 bench/random_model.py --like $C/like --out /tmp/smol > /dev/null || exit 1
el "serve start"
timeout $(cap 200) python3 bench/serve_bench.py --model /tmp/smol --device cuda --users 1 32 256 --duration 12 \
  --output-len 128 --input-len 100 --request-rate inf --engine-process on --offline --json $OUT/serve.json 2>&1 \
  | grep -v Warn | tail -25
[ -n "$SKIP_ENGINE" ] && exit 0
el "engine_gpu start"
timeout $(cap 90) python3 bench/engine_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --concurrency 256 --no-hf \
  --json $OUT/engine_gpu.json 2>&1 | grep -E "ours|decode" | tail -8
el "done"
