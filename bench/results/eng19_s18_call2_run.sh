. .carry/setup.sh eng19
set -o pipefail
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
python3 bench/engine_step_split_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --repeats 3 \
  --loops sync,overlap,sync+gcfreeze,overlap+gcfreeze --json $OUT/ab.json 2>&1 | tee $OUT/ab.log
el bench done
timeout 45 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/engine/test_engine_gpu.py -k "overlap or equals_cpu_reference or placeholder" tests/engine/test_overlap.py tests/engine/test_model_runner.py 2>&1 | tee $OUT/tests.log
el done
