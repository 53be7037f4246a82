# Session 28's last device call (lead): mix3 put served tok/s at 1.32-1.48x with cuda_graph_mixed_tokens=2048 vs 0,
# but TTFT p99 at 4.9 / 2.9 s against 0.4 / 0.6 s. When were the slowest first tokens asked for (a start-up
# burst, or requests starved later)? serve_bench's rows now carry ttft_slowest (send offset s, TTFT ms).
# Run: `bash .carry/multi.sh mix4:330` carrying .carry/lead, .carry/mix4, .carry/setup.sh, .carry/multi.sh.
. .carry/setup.sh mix4 || exit 1
R=/tmp/r4; mkdir -p $R; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
[ -d /tmp/smol ] || python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 8 --duration 5 --users 256"
for v in m2048:2048 m0:0 m2048b:2048 m0b:0; do IFS=: read n m <<< "$v"; el "$n"
  timeout 60 $B --label $n --json $R/serve_$n.json --engine-set cuda_graph_mixed_tokens=$m > $R/serve_$n.log 2>&1
  el "rc=$?"; grep "^| $n" $R/serve_$n.log | tail -1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print('slowest', r['ttft_slowest'])" $R/serve_$n.json
  tar czf $OUT/all.tgz -C $R .
done
el done
