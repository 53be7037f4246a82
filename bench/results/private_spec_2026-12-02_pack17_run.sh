#!/bin/bash
. /work/main/.venv/bin/activate
cd /work/wt/pack17
cp /tmp/spec_orig.py client_sdk/_speculate.py
PYTHONPATH=$PWD timeout 300 python -m pytest -q -x tests/server/test_private_offload.py -k speculative -p no:logging 2>&1 | grep -E "^E .*409|step_mismatch|passed|failed" | head -3
echo "orig done"; date -u
cp /tmp/spec_fixed.py client_sdk/_speculate.py
PYTHONPATH=$PWD timeout 300 python -m pytest -q -x tests/server/test_private_offload.py -k speculative --durations=2 -p no:logging 2>&1 | tail -4
echo "fixed done"; date -u; uptime
PYTHONPATH=$PWD timeout 500 python bench/private_spec.py --k 3 --max-tokens 16 --offload-plan /tmp/pack17_off2.json --json bench/results/private_spec_2026-12-02_pack17_off2.json > bench/results/private_spec_2026-12-02_pack17_off2.log 2>&1
echo "spec rc=$?"; date -u; uptime
