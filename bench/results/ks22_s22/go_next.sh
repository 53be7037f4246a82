# Next session's issue-16 call (written in session 22, lead): the seeded expansion's CUDA checks, which gate
# fhe.backends.gpu.uniform.CUDA_CHECKED, then the private end to end with seeded uploads (the flag set in the
# carried tree only) for TPOT and bytes; and the two test_private_batched CUDA tests, with the home of
# bench/gpu_e2e_home.py as CIPHERLM_HOME so the tiny model's fixture finds a default model without the network.
. .carry/setup.sh ks22
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader; nproc
timeout 100 $PT tests/fhe/test_gpu_backend_seeded.py > $OUT/tests.log 2>&1; el "tests rc=$?"; tail -4 $OUT/tests.log
timeout 60 python3 -m bench.seeded_expand --device cuda --repeat 30 --json $OUT/seeded_expand_cuda.json \
  > $OUT/expand.log 2>&1; el "expand rc=$?"; tail -12 $OUT/expand.log
timeout 100 python3 -m bench.worker_handoff --device cuda --repeat 15 --json $OUT/handoff_cuda.json \
  > $OUT/handoff.log 2>&1; el "handoff rc=$?"; tail -30 $OUT/handoff.log
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1; el "home rc=$?"
CIPHERLM_HOME=/tmp/home timeout 60 $PT -m "not heavy" tests/server/test_private_batched.py -k cuda > $OUT/batched.log 2>&1
el "batched rc=$?"; tail -3 $OUT/batched.log
sed -i 's/^CUDA_CHECKED = False$/CUDA_CHECKED = True/' fhe/backends/gpu/uniform.py && grep -n "^CUDA_CHECKED" fhe/backends/gpu/uniform.py
LEFT=$(( ${BUDGET:-330} - $(date +%s) + T0 )); el "e2e gets ${LEFT}s"
[ $LEFT -gt 60 ] && CIPHERLM_HOME=/tmp/home timeout $LEFT python3 bench/private_e2e.py --device cuda \
  --plan /tmp/home/plan.json --prompt-tokens 32 --max-tokens ${TOKENS:-32} --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$?"; grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -24; grep -c "encrypted token" $OUT/e2e.log
el done
