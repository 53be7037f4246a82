# eng20, session 19, the one device call (bench/results/eng20_s19/call1_predictions.md): tree with the overlapped
# loop and gc_freeze as GPU defaults and the host cuts. (1) GPU tests; (2) sync vs overlap (and overlap with the
# start-up gc freeze lifted) on both shapes, 3 interleaved repeats, cProfile of each loop; (3) serving at
# 1/32/256 users with default settings, with the offline engine.
. .carry/setup.sh eng20
set -o pipefail
R=/tmp/r; mkdir -p $R
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee $R/smi.txt
timeout 60 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/engine/test_engine_gpu.py -k "overlap or equals_cpu_reference" tests/engine/test_spec_decode_gpu.py \
  tests/engine/test_overlap.py > $R/tests.log 2>&1; el "tests rc=$?"; tail -4 $R/tests.log
timeout 150 python3 bench/engine_step_split_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --repeats 3 \
  --loops sync,overlap,overlap+gcthaw --profile $R --json $R/ab.json > $R/ab.log 2>&1
el "ab rc=$?"; grep -E "same tokens|: 256 req" $R/ab.log; tail -2 $R/ab.log | cut -c1-300
python3 bench/random_model.py --like $C/tok --out /tmp/smol > /dev/null || exit 1
el serve; timeout 100 python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 \
  --request-rate inf --clients 4 --duration 3 --offline --label default --users 1 32 256 --json $R/serve_default.json \
  > $R/serve_default.log 2>&1; el "serve rc=$?"; tail -9 $R/serve_default.log
el done
