# engine19 session 8, call 2: the serving rows at 32/256 users (call 1's fastapi 0.165 wheel needed opentelemetry-api,
# carried here from the lead's venv as a plain folder; pure Python).
C=$PWD/.carry/engine19; G=$PWD/.carry/g16
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/s && tar -xf $C/src.tar -C /tmp/s && cd /tmp/s || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/whl/*.whl > $OUT/pip.log 2>&1
export PYTHONPATH=/tmp/s:/tmp/site:$C/site PYTHONUNBUFFERED=1
el "start $(cat $C/COMMIT)"
python3 -c "import fastapi, uvicorn, server.cli_serve; print('server imports ok')" || exit 1
python3 bench/random_model.py --like $C/like --out /tmp/smol > /dev/null || exit 1
el "serve start"
timeout 200 python3 bench/serve_bench.py --model /tmp/smol --device cuda --users 32 256 --duration 10 \
  --output-len 128 --input-len 100 --request-rate inf --engine-process on --offline --json $OUT/serve.json 2>&1 \
  | grep -v Warn | tee $OUT/serve.log | tail -30
el "done"
