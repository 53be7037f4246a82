# lead, session 19: one short call on merged main (COMMIT): (1) the engine's GPU tests under the new defaults
# (overlapped loop, gc_freeze, admission delay); (2) serving at 256 users with the defaults (admission_delay_steps 8,
# stream_coalesce_streams 96, offline engine beside it) and with both off (eng20's call 2, cut to 256 users);
# (3) the fhe CUDA tests of the batched switches and LAZY at N = 8192. ks19's A/Bs did not fit the last 397 s.
. .carry/setup.sh final
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
timeout 90 $PT tests/engine/test_engine_gpu.py tests/engine/test_spec_decode_gpu.py tests/engine/test_model_runner.py \
  tests/engine/test_overlap.py > $OUT/tests_engine.log 2>&1; el "engine tests rc=$?"; tail -4 $OUT/tests_engine.log
python3 bench/random_model.py --like $C/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 4 --duration 3"
timeout 60 $B --offline --label default --users 256 --json $OUT/serve_default.json > $OUT/serve_default.log 2>&1
el "serve default rc=$?"; grep -v Warn $OUT/serve_default.log | grep -v '^{' | tail -8
timeout 45 $B --label off --users 256 --engine-set admission_delay_steps=0 --server-set stream_coalesce_streams=0 \
  --json $OUT/serve_off.json > $OUT/serve_off.log 2>&1; el "serve off rc=$?"; grep -v Warn $OUT/serve_off.log | grep -v '^{' | tail -5
timeout 50 $PT tests/fhe/test_gpu_backend_cuda.py -k "(ntt_matches and True-True-True) or (n8192 and True-True)" > $OUT/tests_fhe.log 2>&1
el "fhe tests rc=$?"; tail -4 $OUT/tests_fhe.log
el done
