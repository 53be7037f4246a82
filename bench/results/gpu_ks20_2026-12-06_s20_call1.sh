# ks20 (issue 16, session 20), the one device call: (1) the decode step A/B of this session's fusions (SKIP_DIAG,
# FUSED_FINISH, FUSED_CORRECTION; --ab $AB) at 16/128/512, profiled at 128, 8 sessions; (2) the CUDA tests of the
# changed kernels (= SEAL at N = 8192 and the shipped size) and the packed path; (3) the packed prefill at the
# defaults ($PK_AB: an A/B beside it); (4) the sessions row 1/8/32 at 128, each session its own key set; (5) if time
# is left, LOCAL_WARPS 4 / 8 at 128.
. .carry/setup.sh ks20
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
smi() { nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw,memory.used --format=csv,noheader; }
smi
timeout ${AB_S:-110} python3 bench/gpu_step_ab.py --ab ${AB:-fuse} --profile --weights $C/packed --contexts ${CTX:-16,128,512} \
  --repeat ${REPEAT:-8} --sessions ${SESS:-8} --out $OUT/ab.json > $OUT/ab.log 2>&1
el "ab rc=$? $(date -u +%H:%M:%S)"; grep -v "^{\|^profile" $OUT/ab.log | tail -6
python3 -c "
import json;d=json.load(open('$OUT/ab.json'))
for n,p in d.get('profile_128',{}).items(): print(n, p['wall_ms_profiled'], p['kernels'], p['kernel_ms'], [(k[:24],v['n'],v['ms']) for k,v in list(p['top'].items())[:8]])
print('rot', d['rotate_ms_before'], d.get('rotate_ms_after'), d.get('sessions'), d.get('whole_steps'))"
timeout ${TEST_S:-55} $PT tests/fhe/test_gpu_backend_cuda.py tests/fhe/test_gpu_backend_packed.py \
  -k "${TESTS_K:-(n8192 and True-True) or (shipped and True-True) or (ntt_matches and True-True-True) or packed}" > $OUT/tests.log 2>&1
el "tests rc=$? $(date -u +%H:%M:%S)"; tail -4 $OUT/tests.log
smi
timeout ${PK_S:-80} python3 bench/gpu_packed.py --weights $C/packed --repeat 3 --skip-seal ${PK_AB} --out $OUT/packed.json > $OUT/packed.log 2>&1
el "packed rc=$? $(date -u +%H:%M:%S)"; grep -v "^ \|^{\|^}" $OUT/packed.log | tail -5
python3 -c "import json;d=json.load(open('$OUT/packed.json'));print({k:v for k,v in d.items() if k not in ('args',)})" | cut -c1-1500
LEFT=$(( ${END_S:-335} - $(date +%s) + T0 )); el "sessions get ${LEFT}s"
timeout $LEFT python3 bench/gpu_sessions.py --weights $C/packed --procs 1 --sessions 1,8,32 --rounds 3 --own-keys \
  --out $OUT/sessions.json > $OUT/sessions.log 2>&1
el "sessions rc=$? $(date -u +%H:%M:%S)"; grep "^{" $OUT/sessions.log | cut -c1-400
smi
LEFT=$(( ${END_S:-335} + 20 - $(date +%s) + T0 ))
if [ $LEFT -gt 30 ]; then
  timeout $LEFT python3 bench/gpu_step_ab.py --ab warps --weights $C/packed --contexts 128 --repeat 6 --sessions 0 \
    --out $OUT/warps.json > /tmp/warps.log 2>&1; el "warps rc=$?"; grep "decode @" /tmp/warps.log; tail -3 /tmp/warps.log | cut -c1-300
fi
el done
