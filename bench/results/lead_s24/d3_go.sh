# Session 24, final call part C (<= 150 s, after d2 on the same machine): the 256-user serving A/B again,
# admission_delay_steps 8 / 0 / 8, each row with the engine's step counters; then, on an H200 only, the packed prefill.
. .carry/setup.sh d3 || exit 1
END=$(( T0 + 145 )); left() { echo $(( END - $(date +%s) )); }
L=.carry/lead
[ -d /tmp/smol ] || python3 bench/random_model.py --like $L/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 4 --duration 5 --users 256"
for r in d8a:8 def:0 d8b:8; do n=${r%%:*}; d=${r#*:}; [ $(left) -gt 38 ] || break
  timeout 42 $B --label $n --engine-set admission_delay_steps=$d --json $OUT/serve_$n.json > $OUT/serve_$n.log 2>&1
  el "$n rc=$?"; grep -v Warn $OUT/serve_$n.log | grep -v '^{' | grep '|' | tail -1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print({k: r.get(k) for k in ('steps','prefill_step_share','ms_per_step','tokens_per_step','api_cpu_us_per_token','core_cpu_us_per_token')})" $OUT/serve_$n.json 2>/dev/null
done
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ $(left) -gt 50 ]; then
  el "H200 packed prefill"; timeout $(( $(left) - 3 )) python3 bench/gpu_packed.py --weights $L/packed --skip-seal \
    --quick --repeat 3 > $OUT/packed.log 2>&1; el "rc=$?"; tail -12 $OUT/packed.log; fi
el done
