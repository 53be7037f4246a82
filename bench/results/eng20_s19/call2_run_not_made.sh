# eng20, session 19, call 2 (bench/results/eng20_s19/call2_predictions.md): serving with admission_delay_steps
# (GPU default 8) and stream_coalesce_streams (default 96) at 32/256 users with the offline engine, then 256
# users with both off; short (the shared device budget is low).
. .carry/setup.sh eng20
R=/tmp/r; mkdir -p $R
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader | tee $R/smi.txt
python3 bench/random_model.py --like $C/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 4 --duration 3"
el serve-default; timeout 80 $B --offline --label default --users 32 256 --json $R/serve_default.json > $R/serve_default.log 2>&1
el "rc=$?"; tail -5 $R/serve_default.log; grep -E "^\| default" $R/serve_default.log | head -2
el serve-off; timeout 45 $B --label off --users 256 --engine-set admission_delay_steps=0 --server-set stream_coalesce_streams=0 \
  --json $R/serve_off.json > $R/serve_off.log 2>&1; el "rc=$?"; grep -E "^\| off" $R/serve_off.log
el done
