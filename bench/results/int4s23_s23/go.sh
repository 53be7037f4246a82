# int4s23, session 23, the device call (bench/results/int4s23_s23/predictions.md): the split-K int4 w32 GEMV
# launches (GemvInt4W32Tuning.split_k) on CUDA against the torch reference; the sweep of every split / prefetch
# launch per GEMM of Llama-3.2-1B then Qwen2.5-0.5B (CUDA graphs, PDL on, TB/s and share of the copy bandwidth,
# best per GEMM) with the engine's batch-1 rows bf16 / int4 default / int4 best / int4 default; then, if time is
# left, bench/int4_gpu.py on Llama with the sweep's best launches. <= 250 s.
. .carry/setup.sh int4s23 || exit 1
END=$(( T0 + 245 )); cap() { local l=$(( END - $(date +%s) )); l=$(( l < $1 ? l : $1 )); echo $(( l > 1 ? l : 1 )); }
smi() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $OUT/smi.txt
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. w32 GEMV on CUDA vs the torch reference (split-K launches among the tunings; counters reset; SiLU prologue)"
timeout $(cap 45) $PT tests/kernels/test_gemv_int4_w32.py > $OUT/tests_w32.log 2>&1; el "rc=$?"
tail -4 $OUT/tests_w32.log
el "2. split sweep per GEMM + engine rows (Llama first)"
timeout $(cap 175) python3 -m bench.gemv_int4_gpu --split-sweep --shapes llama3.2-1b,qwen2.5-0.5b \
  --json $OUT/split.json > $OUT/split.log 2>&1; el "rc=$?"
grep -E "^(copy|  BEST|\||BEST_W32)" $OUT/split.log | cut -c1-300
grep "^{" $OUT/split.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); e=r.get('error')
    print(r['shape'][:6], r['format'], r['tunings'], e[:150] if e else 'step %.3f ms (%.0f tok/s) replay %.3f ms share %.1f%%' % (
        r['step_ms'], r['tok_per_s'], r['replay_ms'], 100*r['share_measured']))"
if [ $(( END - $(date +%s) )) -gt 45 ] && [ -s $OUT/split.json ]; then
  el "3. bench/int4_gpu.py, Llama, bf16 and int4 with the sweep's best launches"
  timeout $(cap 60) python3 bench/int4_gpu.py --shapes llama3.2-1b --formats bf16,int4 --w32-tunings $OUT/split.json \
    --json $OUT/int4_best.json > $OUT/int4_best.log 2>&1; el "rc=$?"
  grep -v -i warn $OUT/int4_best.log | grep -v "^{" | tail -8
fi
smi | tee -a $OUT/smi.txt
el done
