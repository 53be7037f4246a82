# ks22, session 22 (issue 16): GPU workers expand seeded uploads on the device. (1) the CUDA tests (the Blake2xb
# kernel = its torch reference, the expansion = SEAL's load at N = 32768, the redraws on the card); (2) the expansion
# of one N = 32768, 12-prime c1 on the card against SEAL's load (bench/seeded_expand.py); (3) the worker's hand-off
# per attention step, SEAL's path / session 21's full uploads / seeded direct (bench/worker_handoff.py --device cuda);
# (4) with what time is left: the private end-to-end run on the branch (seeded uploads, zeros made ahead), 32 + N.
. .carry/setup.sh ks22
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader; nproc
timeout 100 $PT tests/fhe/test_gpu_backend_seeded.py > $OUT/tests.log 2>&1; el "tests rc=$?"; tail -4 $OUT/tests.log
timeout 60 python3 -m bench.seeded_expand --device cuda --repeat 30 --json $OUT/seeded_expand_cuda.json \
  > $OUT/expand.log 2>&1; el "expand rc=$?"; tail -12 $OUT/expand.log
timeout 100 python3 -m bench.worker_handoff --device cuda --repeat 15 --json $OUT/handoff_cuda.json \
  > $OUT/handoff.log 2>&1; el "handoff rc=$?"; tail -30 $OUT/handoff.log
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1; el "home rc=$?"
LEFT=$(( ${BUDGET:-318} - $(date +%s) + T0 )); el "e2e gets ${LEFT}s"
[ $LEFT -gt 60 ] && CIPHERLM_HOME=/tmp/home timeout $LEFT python3 bench/private_e2e.py --device cuda \
  --plan /tmp/home/plan.json --prompt-tokens 32 --max-tokens ${TOKENS:-16} --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$?"; grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -24; grep -c "encrypted token" $OUT/e2e.log
el done
