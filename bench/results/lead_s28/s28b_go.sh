# Session 28's second device call (lead): a2. the L2 prefetch's "lines" mode A/B (Qwen bf16, Llama int4);
# b. the graph path before session 27 (caea674: gather, argmax and two uploads outside the graph, an event made
# per step) against now, bf16, B A A B; c. where a batch-1 step's time goes (device timeline, host split).
# Run: `bash .carry/multi.sh s28b:585` carrying .carry/lead, .carry/s28b (go.sh + tree-before.tar.xz),
# .carry/setup.sh, .carry/multi.sh.
. .carry/setup.sh s28b || exit 1
R=/tmp/r; mkdir -p $R /tmp/before; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
tar -xJf $C/tree-before.tar.xz -C /tmp/before
el "a2. the prefetch as one prefetch instruction a line, A/B"
for sf in qwen2.5-0.5b:bf16 llama3.2-1b:int4; do IFS=: read sh f <<< "$sf"
  timeout 70 python3 bench/int4_gpu.py --shapes $sh --formats $f --l2-prefetch-mb 0,32,32,0 --l2-prefetch-mode lines \
    --json $R/l2lines_$sh.json > $R/l2lines_$sh.log 2>&1
  el "$sh rc=$?"; grep -v '^{' $R/l2lines_$sh.log | tail -6
done
tar czf $OUT/all.tgz -C $R .
el "b. the graph path before / after session 27, bf16, B A A B"
i=0
for v in before after after before; do
  i=$((i + 1)); d=$([ $v = before ] && echo /tmp/before || echo $PWD)
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 60 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b \
    --formats bf16 --json $R/fold_${i}_$v.json) > $R/fold_${i}_$v.log 2>&1
  el "$v rc=$?"; grep -v '^{' $R/fold_${i}_$v.log | grep "^| " | tail -3
  tar czf $OUT/all.tgz -C $R .
done
el "c. a batch-1 step outside its graph: device timeline and host split"
timeout $(( 565 - $(date +%s) + T0 )) python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16 --profile \
  --json $R/profile.json > $R/profile.log 2>&1
el "profile rc=$?"; python3 - $R/profile.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["engine"]:
    t = r.get("timeline", {})
    print(r["shape"], r.get("step_ms"), r.get("replay_ms"), {k: t.get(k) for k in (
        "span_us_per_step", "busy_us_per_step", "idle_us_per_step", "largest_gaps_us", "rare_device_ops")},
          r.get("host"), r.get("error"))
PY
el done
