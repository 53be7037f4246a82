# mk22, session 21, the one device call (bench/results/mk22_s21/predictions.md): programmatic dependent launch
# (EngineConfig.cuda_pdl) for the batch-1 decode step, A/B/B/A on one card; the int4 GEMVs with PDL and with
# register prefetch; the GPU tests of the touched kernels.
. .carry/setup.sh mk22
END=$(( T0 + 318 )); cap() { local l=$(( END - $(date +%s) )); l=$(( l < $1 ? l : $1 )); echo $(( l > 1 ? l : 1 )); }
smi() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $OUT/smi.txt
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "pdl kernel tests"
timeout $(cap 50) $PT tests/kernels/test_pdl.py > $OUT/tests_pdl.log 2>&1; el "rc=$?"; tail -4 $OUT/tests_pdl.log
el "batch-1 step A/B/B/A"
timeout $(cap 125) python3 bench/int4_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --formats bf16,int4 \
  --pdl off,on,on,off --json $OUT/int4_pdl.json > $OUT/int4_pdl.log 2>&1; el "rc=$?"
show() { grep -v -i warn $1 | python3 -c "
import json,sys
for l in sys.stdin:
    if not l.startswith('{'): print(l.rstrip()[:230]); continue
    r=json.loads(l); e=r.get('error')
    print(r['shape'][:6], r['format'], 'pdl', r['pdl'], e[:150] if e else 'step %.3f ms replay %.3f ms share %.1f%% (replay %.1f%%)' % (
        r['step_ms'], r['replay_ms'], 100*r['share_measured'], 100*r['replay_share_measured']))"; }
show $OUT/int4_pdl.log
el "gemv pdl off/on, prefetch sweep, engine rows with the best"
timeout $(cap 85) python3 -m bench.gemv_int4_gpu --pdl-ab --shapes llama3.2-1b,qwen2.5-0.5b --json $OUT/gemv_pdl.json \
  > $OUT/gemv_pdl.log 2>&1; el "rc=$?"; show $OUT/gemv_pdl.log
el "gpu tests"
timeout $(cap 45) $PT tests/engine/test_engine_gpu.py -k "pdl or int4" > $OUT/tests_engine.log 2>&1; el "rc=$?"
tail -4 $OUT/tests_engine.log
timeout $(cap 60) $PT tests/kernels/test_gemv_int4_w32.py > $OUT/tests_w32.log 2>&1; el "rc=$?"; tail -3 $OUT/tests_w32.log
timeout $(cap 60) $PT tests/kernels/test_gemv_prologue.py > $OUT/tests_prologue.log 2>&1; el "rc=$?"
tail -3 $OUT/tests_prologue.log
smi | tee -a $OUT/smi.txt
el done
