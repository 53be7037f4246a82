# Carried from session 29 (lead; its 288 s of device time could not start a machine). Session 28's mix3 put served tok/s at 1.32-1.48x with
# cuda_graph_mixed_tokens=2048 vs 0, but client TTFT p99 at 4.9 / 2.9 s against 0.4 / 0.6 s. Where did the slow
# first tokens wait? serve_bench's rows now carry ttft_slowest (send offset s, ms), and the server's own counts of
# requests over 1 s: to the first token as the API saw it, in the engine queue (arrival -> first step), and from the
# engine's first token to the API's stream (delivery). A client count far above the server's: the tail is the client's.
# The load client is now aiohttp (httpx capped a 2-core box's stub server at ~1/4 of what aiohttp reaches), so these
# rows are also the first served figures on a card whose client is not the limit; the rows give both event loops'
# lag (the clients', and the API's from cipherlm:api_event_loop_lag_seconds).
# Run: `bash .carry/mix5/go.sh` carrying .carry/lead (config.json + tokenizer files of the default model, in tok/)
# and .carry/mix5 (this file as go.sh); ~220 s after the machine starts.
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
R=/tmp/r5; mkdir -p $R $OUT; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/smi.txt
export PYTHONPATH=$PWD
python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1; el "model"
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 8 --duration 5 --users 256"
for v in m2048:2048:--offline m0:0 m2048b:2048 m0b:0; do IFS=: read n m x <<< "$v"; el "$n"
  [ $(( $(date +%s) - T0 )) -gt 160 ] && { el "no time for $n"; break; }
  timeout $([ -n "$x" ] && echo 80 || echo 45) $B --label $n --json $R/serve_$n.json --engine-set cuda_graph_mixed_tokens=$m $x > $R/serve_$n.log 2>&1
  el "rc=$?"; grep "^| $n" $R/serve_$n.log | tail -1
  python3 -c "
import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]
print({k: r.get(k) for k in ('out_tok_per_s','ttft_p50_ms','ttft_p99_ms','ttft_over_1s','server_ttft_over_1s','queue_time_over_1s','delivery_over_1s','api_loop_lag_over_0.1s','api_loop_lag_mean_ms','client_loop_lag_mean_ms','client_loop_lag_max_ms','client_cpu_us_per_token','api_cpu_us_per_token','requests','eager_step_share','prefill_step_share','ms_per_step')})
print('slowest', r['ttft_slowest'])" $R/serve_$n.json
  tar czf $OUT/all.tgz -C $R .
done
el done
