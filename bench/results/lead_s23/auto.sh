# The first call of session 23: pk23's packed-prefill A/B, then on an H200 issue 16's table (c2), elsewhere the
# seeded-upload checks and serving (c1).
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $g"
case "$g" in *H200*) bash .carry/multi.sh pk23:200 c2:370 ;; *) BUDGET=350 bash .carry/multi.sh pk23:200 c1:370 ;; esac
