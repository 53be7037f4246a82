# Session 27's second device call (lead): the engine's batch-1 step, same card, same run:
#  a. the L2 prefetch A/B/B/A (EngineConfig.cuda_l2_prefetch_mb 0 / 32), both shapes, bf16 and int4;
#  b. the graph path before this session (caea674, packed as .carry/s27b/tree-before.tar.xz: gather, argmax
#     and two uploads outside the graph, an event made per step) against now, bf16, alternating.
# Run: `bash .carry/multi.sh s27b:560` carrying .carry/lead, .carry/s27b, .carry/setup.sh, .carry/multi.sh.
. .carry/setup.sh s27b || exit 1
R=/tmp/r; mkdir -p $R /tmp/before; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
tar -xJf $C/tree-before.tar.xz -C /tmp/before
el "a. L2 prefetch A/B/B/A"
timeout 300 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16,int4 \
  --l2-prefetch-mb 0,32,32,0 --json $R/l2.json > $R/l2.log 2>&1
el "rc=$?"; grep -v '^{' $R/l2.log | tail -24; tar czf $OUT/all.tgz -C $R .
el "b. the graph path before / after this session, bf16, B A A B"
for v in before after after before; do
  d=$([ $v = before ] && echo /tmp/before || echo $PWD)
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 100 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b \
    --formats bf16 --json $R/fold_${v}_$(date +%s).json) > $R/fold_$v.log 2>&1
  el "$v rc=$?"; grep -v '^{' $R/fold_$v.log | grep "^| " | tail -3
  tar czf $OUT/all.tgz -C $R .
done
el done
