# serve19 session 14: the API process's CPU per streamed token, main (before) and this branch (after), in
# one run on the CPU. A tiny random model of SmolLM2's architecture with its real tokenizer (1 layer,
# hidden 64) so the engine core steps fast and the API's per-token cost shows; the same bench script
# (this branch's: it meters CPU per process) against both servers.
#   BASE=<a checkout of main>  bash bench/results/serve19_s14_cpu_ab.sh  [out-prefix]
set -e
HERE=$(cd "$(dirname "$0")/../.." && pwd)
BASE=${BASE:-/tmp/serve19-base}
OUTP=${1:-$HERE/bench/results/serve_cpu_$(date -u +%F)_s14}
PY=${PY:-python3}
ARGS=${ARGS:---device cpu --threads 1 --users 32 128 --duration 10 --output-len 128 --input-len 20 --request-rate inf}
[ -d /tmp/serve19-tiny ] || PYTHONPATH=$HERE $PY $HERE/bench/random_model.py --out /tmp/serve19-tiny \
  --set num_hidden_layers=1 hidden_size=64 intermediate_size=128 num_attention_heads=2 num_key_value_heads=1 head_dim=32
for side in before after; do
  SRC=$HERE; [ $side = before ] && SRC=$BASE
  extra=""; [ $side = after ] && extra="--offline"
  echo "== $side ($SRC @ $(git -C $SRC rev-parse --short HEAD 2>/dev/null || cat $SRC/COMMIT 2>/dev/null))"
  PYTHONPATH=$SRC $PY $HERE/bench/serve_bench.py --model /tmp/serve19-tiny $ARGS $extra \
    --json ${OUTP}_$side.json 2>&1 | grep -v Warn
done
