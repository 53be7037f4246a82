# Session 30 (lead): session 29's carried mix5 plus what issue 19's serving goals need from the same machine.
# 1) cuda_graph_mixed_tokens 2048 / 0 / 2048 / 0 at 256 users, the first with the offline peer (mix5 as written:
#    tail counts at the client, the API, the engine's queue and delivery; the clients' and the API's loop lag);
# 2) 1 and 32 users with the offline peer, under 2048 and under 0 (the issue's TPOT-at-1-user and 32-user rows);
# 3) one more 256-user pair, so each setting has three 256-user runs on one machine.
# Client: aiohttp, 8 processes; server: cipherlm serve with the batch-accept listener.
# Run: `bash .carry/mix6/go.sh` carrying .carry/lead (config.json + tokenizer files in tok/) and .carry/mix6.
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
R=/tmp/r6; mkdir -p $R $OUT; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/smi.txt
export PYTHONPATH=$PWD
python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1; el "model"
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 8 --duration 5"
show() { python3 -c "
import json,sys
J=json.load(open(sys.argv[1]))
for o in J['offline']: print('offline', {k: o.get(k) for k in ('users','out_tok_per_s','tpot_p50_ms','ms_per_step')})
for r in J['rows']:
    print({k: r.get(k) for k in ('users','out_tok_per_s','tpot_p50_ms','ttft_p50_ms','ttft_p99_ms','ttft_over_1s','server_ttft_over_1s','queue_time_over_1s','delivery_over_1s','api_loop_lag_over_0.1s','api_loop_lag_mean_ms','client_loop_lag_mean_ms','client_loop_lag_max_ms','client_cpu_us_per_token','api_cpu_us_per_token','requests','eager_step_share','prefill_step_share','ms_per_step')})
    if r.get('ttft_slowest'): print('slowest', r['ttft_slowest'][:5])" $1; }
for v in m2048:2048:256:--offline m0:0:256: m2048b:2048:256: m0b:0:256: \
         lo2048:2048:1,32:--offline lo0:0:1,32:--offline m2048c:2048:256: m0c:0:256:; do
  IFS=: read n m u x <<< "$v"; el "$n"
  [ $(( $(date +%s) - T0 )) -gt 500 ] && { el "no time for $n"; break; }
  timeout $([ -n "$x" ] && echo 90 || echo 45) $B --users ${u//,/ } --label $n --json $R/serve_$n.json \
    --engine-set cuda_graph_mixed_tokens=$m $x > $R/serve_$n.log 2>&1
  el "rc=$?"; grep "^| $n" $R/serve_$n.log; show $R/serve_$n.json
  tar czf $OUT/all.tgz -C $R .
done
el done
