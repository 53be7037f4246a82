# eng20, session 19, device call 1 (bench/results/eng20_s19/call1_predictions.md): the overlapped loop vs the
# synchronous one (x gc.freeze) on both shapes with a cProfile of the host, the GPU tests, serving at 32/256 users
# with default settings and with async_scheduling=true, each with its offline engine.
. .carry/setup.sh eng20
set -o pipefail
R=/tmp/r; mkdir -p $R
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee $R/smi.txt
timeout 200 python3 bench/engine_step_split_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --repeats 3 \
  --loops sync,overlap,sync+gcfreeze,overlap+gcfreeze --profile $R --json $R/ab.json > $R/ab.log 2>&1
el "ab rc=$?"; grep -E "same tokens|: 256 req" $R/ab.log; tail -3 $R/ab.log | cut -c1-300
timeout 60 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/engine/test_engine_gpu.py -k "overlap or equals_cpu_reference or placeholder" tests/engine/test_overlap.py \
  tests/engine/test_model_runner.py > $R/tests.log 2>&1; el "tests rc=$?"; tail -4 $R/tests.log
python3 bench/random_model.py --like $C/tok --out /tmp/smol > /dev/null || exit 1
COMMON="--model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 4 --duration 4 --users 1 32 256 --offline"
sb() { local label=$1; shift; el "serve $label"
  timeout 95 python3 bench/serve_bench.py $COMMON --label $label "$@" --json $R/serve_$label.json > $R/serve_$label.log 2>&1
  el "rc=$?"; grep -E "^\| $label" $R/serve_$label.log; }
sb default
sb overlap --engine-set async_scheduling=true
el done
