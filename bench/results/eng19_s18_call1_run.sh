. .carry/setup.sh eng19
set -o pipefail
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
python3 bench/engine_step_split_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --repeats 3 --json $OUT/split.json 2>&1 | tee $OUT/split.log
el done
