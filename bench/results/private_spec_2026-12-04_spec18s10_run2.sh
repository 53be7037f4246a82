#!/bin/bash
# issue 18 item 2 (spec18-s10), second run: "fix" = commit 436caaa (main + the offload-only manifest's
# verify_steps, one-position MLP steps and pack17's 2-position attention steps; this branch's bench script),
# then this branch (interleaved chunk layout) at k = 3 again and at k = 7; same plan, one after the other.
. /work/main/.venv/bin/activate
R=/work/wt/spec18-s10/bench/results
run() {  # dir tag k
  cd $1 && PYTHONPATH=$PWD timeout 900 python bench/private_spec.py --k $3 --max-tokens 16 \
    --offload-plan /tmp/s10_off2.json --json $R/private_spec_2026-12-04_spec18s10_$2.json \
    > $R/private_spec_2026-12-04_spec18s10_$2.log 2>&1
  echo "$2 rc=$?"; date -u; uptime
}
date -u; uptime
run /tmp/s10-fix fix_k3 3
run /work/wt/spec18-s10 after2_k3 3
run /work/wt/spec18-s10 after_k7 7
