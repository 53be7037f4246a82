# Session 27's second device call (lead): the engine's batch-1 step, same card, same run:
#  a. the L2 prefetch A/B/B/A (EngineConfig.cuda_l2_prefetch_mb 0 / 32), both shapes, bf16 and int4; a2. the
#     "lines" mode A/B on two rows;
#  b. the graph path before this session (caea674, packed as .carry/s27b/tree-before.tar.xz: gather, argmax
#     and two uploads outside the graph, an event made per step) against now, bf16, alternating.
# Run: `bash .carry/multi.sh s27b:560` carrying .carry/lead, .carry/s27b, .carry/setup.sh, .carry/multi.sh.
. .carry/setup.sh s27b || exit 1
R=/tmp/r; mkdir -p $R /tmp/before; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
tar -xJf $C/tree-before.tar.xz -C /tmp/before
el "a. L2 prefetch A/B/B/A"
timeout 270 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16,int4 \
  --l2-prefetch-mb 0,32,32,0 --json $R/l2.json > $R/l2.log 2>&1
el "rc=$?"; grep -v '^{' $R/l2.log | tail -24; tar czf $OUT/all.tgz -C $R .
el "a2. the prefetch as one prefetch instruction a line instead (in case a bulk prefetch from an exited program
does not land: s27a's microbench says), Qwen bf16 and Llama int4, A/B"
for sf in qwen2.5-0.5b:bf16 llama3.2-1b:int4; do IFS=: read sh f <<< "$sf"
  timeout 60 python3 bench/int4_gpu.py --shapes $sh --formats $f --l2-prefetch-mb 0,32 --l2-prefetch-mode lines \
    --json $R/l2lines_$sh.json > $R/l2lines_$sh.log 2>&1
  el "$sh rc=$?"; grep -v '^{' $R/l2lines_$sh.log | tail -5
done
tar czf $OUT/all.tgz -C $R .
el "b. the graph path before / after this session, bf16, B A A B"
i=0
for v in before after after before; do
  i=$((i + 1)); d=$([ $v = before ] && echo /tmp/before || echo $PWD)
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 60 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b \
    --formats bf16 --json $R/fold_${i}_$v.json) > $R/fold_${i}_$v.log 2>&1
  el "$v rc=$?"; grep -v '^{' $R/fold_${i}_$v.log | grep "^| " | tail -3
  tar czf $OUT/all.tgz -C $R .
done
el done
