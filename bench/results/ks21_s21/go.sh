# ks21, session 21 (issue 16): (1) the GPU worker's hand-off per attention step, main's path vs the direct one, on
# this machine's CPU + CUDA (bench/worker_handoff.py); (2) in the background during the e2e's server start and key
# generation: the packed prefill at the defaults (cold and with the single-token steps' graphs captured), then the
# touched tests; (3) the private end-to-end run on the branch (full uploads, zeros made ahead), 32 prompt + 64 tokens.
. .carry/setup.sh ks21
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader; nproc
timeout 45 python3 -m bench.worker_handoff --device cuda --repeat 15 --json $OUT/handoff_cuda.json > $OUT/handoff.log 2>&1
el "handoff rc=$?"; tail -22 $OUT/handoff.log
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1; el "home rc=$?"; tail -1 $OUT/home.log
( el "packed start" > $OUT/bg.log
  timeout 110 python3 bench/gpu_packed.py --weights $C/packed --repeat 3 --skip-seal --quick --out $OUT/packed.json > $OUT/packed.log 2>&1
  el "packed rc=$?" >> $OUT/bg.log
  LT=$(( T0 + ${TESTS_END:-160} - $(date +%s) )); [ $LT -gt 5 ] && timeout -s INT $LT $PT -m "not heavy" \
    tests/server/test_private_device.py tests/server/test_private_batched.py -k cuda \
    > $OUT/tests.log 2>&1; el "tests rc=$? (limit ${LT}s)" >> $OUT/bg.log ) &
LEFT=$(( ${BUDGET:-322} - $(date +%s) + T0 )); el "e2e gets ${LEFT}s"
CIPHERLM_HOME=/tmp/home timeout $LEFT python3 bench/private_e2e.py --device cuda --plan /tmp/home/plan.json \
  --prompt-tokens 32 --max-tokens ${TOKENS:-64} --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$?"; wait; cat $OUT/bg.log; grep -v "^{" $OUT/packed.log | tail -4; tail -3 $OUT/tests.log
grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -30; grep -c "encrypted token" $OUT/e2e.log
el done
