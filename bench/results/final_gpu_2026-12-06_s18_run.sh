# lead, session 18: merged main (COMMIT) on one GPU: the overlapped loop vs the synchronous one (eng19's call 2),
# then the GPU tests of the merged changes (overlap, strided NTT).
. .carry/setup.sh final
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
timeout 60 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/engine/test_engine_gpu.py -k "overlap or equals_cpu_reference" tests/engine/test_overlap.py 2>&1 | tail -5 | tee $OUT/tests_engine.log
el "engine tests"
timeout 200 python3 bench/engine_step_split_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --repeats 3 \
  --loops sync,overlap,sync+gcfreeze,overlap+gcfreeze --json $OUT/ab.json > $OUT/ab.log 2>&1; el "ab rc=$?"; tail -40 $OUT/ab.log
timeout 60 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/fhe/test_gpu_backend_strided.py tests/fhe/test_gpu_backend_cuda.py 2>&1 | tail -5 | tee $OUT/tests_fhe.log
el done
