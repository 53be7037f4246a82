# Session 24, call 1 part A: (1) where Qwen's and Llama's bf16 batch-1 graphs spend their time, kernel by kernel
# (torch.profiler); (2) the 256-user serving A/B, repeated: defaults / admission_delay_steps=8, A B A B, offline once;
# (3) on an H200 only: the packed prefill as the SDK sends it. <= 330 s.
. .carry/setup.sh d1 || exit 1
END=$(( T0 + 325 )); left() { echo $(( END - $(date +%s) )); }
smi() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $OUT/smi.txt
el "1. batch-1 bf16 profile"
timeout 100 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16 --profile \
  --json $OUT/profile.json > $OUT/profile.log 2>&1; el "rc=$?"; grep "^|" $OUT/profile.log | head -12
L=.carry/lead
python3 bench/random_model.py --like $L/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 4 --duration 5 --users 256"
show() { grep -v Warn $1 | grep -v '^{' | grep '|' | tail -${2:-1}; }
tc() { find $HOME/.triton/cache -name '*.json' -printf '%T@ %f\n' 2>/dev/null | sort > $OUT/tcache_$1.txt; date +%s.%N >> $OUT/tcache_$1.txt; }
el "2. serving 256 users A/B/A/B"
timeout 60 $B --offline --label def1 --json $OUT/serve_def1.json > $OUT/serve_def1.log 2>&1; el "rc=$?"; show $OUT/serve_def1.log 4; tc def1
for r in d8_1:8 def2:0 d8_2:8; do n=${r%%:*}; d=${r#*:}; T=$(left); [ $T -gt 40 ] || break
  timeout 45 $B --label $n --engine-set admission_delay_steps=$d --json $OUT/serve_$n.json > $OUT/serve_$n.log 2>&1
  el "$n rc=$?"; show $OUT/serve_$n.log; tc $n; done
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ $(left) -gt 70 ]; then
  el "3. H200 packed prefill"
  timeout $(( $(left) - 5 )) python3 bench/gpu_packed.py --weights $L/packed --skip-seal --quick --repeat 3 \
    > $OUT/packed.log 2>&1; el "rc=$?"; tail -15 $OUT/packed.log; fi
smi | tee -a $OUT/smi.txt; el done
