#!/bin/bash
# issue 18 item 2 (spec18-s10), confirmation at the final code: private_spec k = 7, then the same at 436caaa
# (speculation on, one ciphertext per position for the MLP, pack17's attention) for the before row.
. /work/main/.venv/bin/activate
R=/work/wt/spec18-s10/bench/results
date -u; uptime
for d in /work/wt/spec18-s10:final /tmp/s10-fix:fix; do
  cd ${d%%:*} && PYTHONPATH=$PWD timeout 900 python bench/private_spec.py --k 7 --max-tokens 16 \
    --offload-plan /tmp/s10_off2.json --json $R/private_spec_2026-12-04_spec18s10_${d##*:}_k7.json \
    > $R/private_spec_2026-12-04_spec18s10_${d##*:}_k7.log 2>&1
  echo "${d##*:} k=7 rc=$?"; date -u; uptime
done
