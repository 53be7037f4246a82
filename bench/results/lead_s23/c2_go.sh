# Session 23, device call 2 (lead), issue 16's must-show table on one card in one call: one rotation and one
# relinearization vs SEAL (gpu_ckks), then bench/gpu_attention.py whole (block on real layer-3 weights vs SEAL,
# decode at 16/128/512, 32-token prefill, sessions 1/8/32, the 576x576 matmul vs TenSEAL mm), then the packed prefill.
. .carry/setup.sh c2 || exit 1
L=$PWD/.carry/lead
smi() { nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi; nproc; lscpu | grep -i "model name"; git log --oneline -1 2>/dev/null
timeout 70 python3 bench/gpu_ckks.py --steps 4 --repeat 10 --seal-repeat 3 --out $OUT/ckks.json > $OUT/ckks.log 2>&1
el "ckks rc=$?"; grep -v "^ \|^{\|^}" $OUT/ckks.log | tail -14
timeout ${ATT_S:-330} python3 bench/gpu_attention.py --weights $L/smollm2 --matmul-variants plain,hoist+graph+strided+batch --out $OUT/attention.json > $OUT/attention.log 2>&1
el "attention rc=$?"; grep -v "^ \|^}" $OUT/attention.log | cut -c1-600 | tail -12
[ -n "$PACKED" ] && { timeout ${PK_S:-90} bash -c "$PACKED" > $OUT/packed.log 2>&1; el "packed rc=$?"; grep -v "^ \|^{\|^}" $OUT/packed.log | tail -10; }
smi; el done
