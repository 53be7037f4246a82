# serve19 session 14 (issue 19.4): served vs offline on one H100/H200, random SmolLM2-135M weights, the real
# tokenizer, 128 output tokens, back-to-back arrivals, 4 client processes per level (one httpx client runs
# out of CPU before the server at 256 users). In one call: main's serving code (before), this branch
# (after, + the offline engine), this branch with stream_interval = 4. Budget: under 5 minutes.
#
# Run from the root of a checkout of branch serve19-s14 (the "after" code). Needs:
#   $WHL   wheels (fastapi, uvicorn, starlette, pydantic(-core, -settings), httpx, httpcore, anyio, h11,
#          httptools, uvloop, tokenizers, prometheus-client, ...: the lead's usual set; no new one)
#   $LIKE  a folder with SmolLM2-135M's config.json + tokenizer files (no weights needed)
#   $BASE_TAR  optional: `git archive 9c868ee` (main before this branch) as a tar; absent: no "before" row
#   $SITE  optional: extra pure-Python folders for PYTHONPATH (fastapi 0.165 imports opentelemetry-api)
C=${CARRY:-$PWD/.carry/s14}
WHL=${WHL:-$C/whl}; LIKE=${LIKE:-$C/like}; BASE_TAR=${BASE_TAR:-$C/base.tar}; SITE=${SITE:-$C/site}
TMPD=${TMPD:-/tmp/serve19-s14}; OUT=${OUT:-$TMPD/out}; mkdir -p $OUT $TMPD; PY=${PY:-python3}  # MODEL_SET="--set ...", DEVICE=cpu: a smoke test off the GPU
HERE=$PWD; T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( 285 - ($(date +%s) - T0) )); }
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TMPD/site $WHL/*.whl > $OUT/pip.log 2>&1
export PYTHONPATH=$HERE:$TMPD/site:$SITE PYTHONUNBUFFERED=1
el "start $(git -C $HERE rev-parse --short HEAD 2>/dev/null || cat $HERE/COMMIT 2>/dev/null)"
$PY -c "import fastapi, uvicorn, server.cli_serve; print('server imports ok')" || exit 1
$PY bench/random_model.py --like $LIKE --out $TMPD/smol $MODEL_SET > /dev/null || exit 1
COMMON="--model $TMPD/smol --device ${DEVICE:-cuda} --output-len 128 --input-len 100 --request-rate inf --clients 4"
bench() {  # label src timeout args...
  local label=$1 src=$2 t=$3; shift 3
  [ $(left) -lt 20 ] && { el "skip $label: out of time"; return; }
  [ $t -gt $(left) ] && t=$(left)
  el "$label (timeout ${t}s)"
  PYTHONPATH=$src:$TMPD/site:$SITE timeout $t $PY $HERE/bench/serve_bench.py $COMMON --label $label "$@" \
    --json $OUT/serve_$label.json 2>&1 | grep -v Warn | tee $OUT/serve_$label.log | grep -v '^{' | tail -12
}
if [ -f "$BASE_TAR" ]; then
  mkdir -p $TMPD/base && tar -xf $BASE_TAR -C $TMPD/base
  bench before $TMPD/base 80 --users 1 32 256 --duration 6
fi
bench after $HERE 130 --users 1 32 256 --duration 6 --offline
bench after-interval4 $HERE 70 --users 32 256 --duration 6 --stream-interval 4
el "done"
