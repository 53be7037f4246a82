# ks19 (issue 16, session 19) device call 2: decode A/B (triton_ops.LAZY + evaluator.BATCH_SWITCHES off/on) at
# 16/128/512, 32 sessions, profiled at 128; the packed prefill A/B fhe.packed.SHIFT_GROUP 0/8 (interleaved) beside
# its figures (and BATCH_ROWS off/on); the CUDA tests of the lazy NTT, the batched switches and the packed path.
. .carry/setup.sh ks19
smi() { nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi
timeout ${AB_S:-75} python3 bench/gpu_step_ab.py --ab lazy+batch --profile --weights $C/packed --contexts ${CTX:-16,128,512} \
  --repeat ${REPEAT:-8} --sessions ${SESSIONS:-32} --out $OUT/ab.json > $OUT/ab.log 2>&1
el "ab rc=$? $(date -u +%H:%M:%S)"; grep -v "^{\|^profile" $OUT/ab.log | tail -5
python3 -c "
import json;d=json.load(open('$OUT/ab.json'))
for n,p in d.get('profile_128',{}).items(): print(n, p['wall_ms_profiled'], p['kernels'], p['kernel_ms'], list(p['top'].items())[:4])
print(d['rotate_ms_before'], d['rotate_ms_after'], d.get('whole_steps'))"
timeout ${PK_S:-75} python3 bench/gpu_packed.py --weights $C/packed --repeat 3 --skip-seal --ab-group 8 --ab-rows --out $OUT/packed.json > $OUT/packed.log 2>&1
el "packed rc=$? $(date -u +%H:%M:%S)"; grep -v "^ \|^{\|^}" $OUT/packed.log | tail -4
python3 -c "import json;d=json.load(open('$OUT/packed.json'));print(d)"
smi
timeout ${TEST_S:-55} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/fhe/test_gpu_backend_cuda.py tests/fhe/test_gpu_backend_packed.py \
  -k "${TESTS_K:-(ntt_matches and True-True-False-True) or (n8192 and True-True) or (shipped and True-True) or packed}" > $OUT/tests.log 2>&1
el "tests rc=$? $(date -u +%H:%M:%S)"; tail -4 $OUT/tests.log
el done
