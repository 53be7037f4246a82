# serve19 session 14: the API process's CPU per streamed token, main (before) and this branch (after, and
# after with stream_interval = 4), in one run on the CPU. A tiny random model of SmolLM2's architecture
# with its real tokenizer (1 layer, hidden 64) so the engine core steps fast and the API's per-token cost
# shows; the same bench script (this branch's: it meters CPU per process) against every server.
#   BASE=<a checkout of main> PY=<python> bash bench/results/serve19_s14_cpu_ab.sh [out-prefix]
set -e
HERE=$(cd "$(dirname "$0")/../.." && pwd)
BASE=${BASE:-/tmp/serve19-base}
OUTP=${1:-$HERE/bench/results/serve_cpu_$(date -u +%F)_s14}
PY=${PY:-python3}
ARGS=${ARGS:---device cpu --threads 1 --users 32 128 --duration 10 --output-len 128 --input-len 20 --request-rate inf}
[ -d /tmp/serve19-tiny ] || PYTHONPATH=$HERE $PY $HERE/bench/random_model.py --out /tmp/serve19-tiny \
  --set num_hidden_layers=1 hidden_size=64 intermediate_size=128 num_attention_heads=2 num_key_value_heads=1 head_dim=32
run() {  # side src extra...
  local side=$1 src=$2; shift 2
  echo "== $side ($src @ $(cat $src/COMMIT 2>/dev/null || git -C $src rev-parse --short HEAD)) $(date -u +%T)"
  PYTHONPATH=$src $PY $HERE/bench/serve_bench.py --model /tmp/serve19-tiny $ARGS --label $side "$@" \
    --json ${OUTP}_$side.json 2>&1 | grep -v -e Warn -e '^{'
}
run before $BASE
run after $HERE
run after-interval4 $HERE --stream-interval 4 --offline
