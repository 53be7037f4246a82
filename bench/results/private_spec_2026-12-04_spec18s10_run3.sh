#!/bin/bash
# issue 18 item 2 (spec18-s10), third run: chunks of 8 positions with the folded last group (this branch);
# per-part table first, then private_spec at k = 7 and k = 3, same plan, one after the other.
. /work/main/.venv/bin/activate
R=/work/wt/spec18-s10/bench/results
cd /work/wt/spec18-s10
date -u; uptime
PYTHONPATH=$PWD python bench/offload_packed_linear.py --chunk 4 8 \
  --out $R/offload_packed_linear_2026-12-04_spec18s10_m8.json > $R/offload_packed_linear_2026-12-04_spec18s10_m8.log 2>&1
echo "parts rc=$?"; date -u; uptime
for k in 7 3; do
  PYTHONPATH=$PWD timeout 900 python bench/private_spec.py --k $k --max-tokens 16 --offload-plan /tmp/s10_off2.json \
    --json $R/private_spec_2026-12-04_spec18s10_m8_k$k.json > $R/private_spec_2026-12-04_spec18s10_m8_k$k.log 2>&1
  echo "m8 k=$k rc=$?"; date -u; uptime
done
