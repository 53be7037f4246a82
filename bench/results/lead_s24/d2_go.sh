# Session 24, final call part B (<= 155 s): (1) the attention kernels with runtime partition / table width on CUDA
# (tests); (2) the 256-user served
# steady state vs the offline engine with the step counters and py-spy, and the Triton compiles during arrivals.
. .carry/setup.sh d2 || exit 1
END=$(( T0 + 150 )); left() { echo $(( END - $(date +%s) )); }
L=.carry/lead; PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. attention kernels on CUDA"
timeout 60 $PT tests/kernels/test_triton.py tests/kernels/test_kv_fp8.py tests/kernels/test_pdl.py -k "decode or prefill" \
  > $OUT/tests_attn.log 2>&1; el "rc=$?"; tail -3 $OUT/tests_attn.log
python3 bench/random_model.py --like $L/tok --out /tmp/smol > /dev/null || exit 1
PS=/tmp/site/bin/py-spy; $PS --version > /dev/null 2>&1 || PS=
mkdir -p /tmp/spy; S=""; [ -n "$PS" ] && S="--py-spy /tmp/spy --py-spy-bin $PS"
el "3. 256 users, defaults + offline, py-spy (gets $(left) s)"
timeout $(( $(left) - 5 )) python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 \
  --request-rate inf --clients 4 --duration 5 --users 256 --offline --label def $S --json $OUT/serve_def.json \
  > $OUT/serve_def.log 2>&1; el "rc=$?"
grep -v Warn $OUT/serve_def.log | grep -v '^{' | grep '|' | tail -5
python3 - $OUT/serve_def.json <<'PY'
import glob, json, os, sys
r = json.load(open(sys.argv[1]))["rows"][0]
t = r["started_at"]
new = sorted(os.path.basename(f) for f in glob.glob(os.path.expanduser("~/.triton/cache/*/*.json"))
             if os.path.getmtime(f) > t and not os.path.basename(f).startswith("__grp"))
print("Triton kernels first compiled after the arrivals began:", len(new), new)
print({k: r.get(k) for k in ("steps", "prefill_step_share", "ms_per_step", "tokens_per_step")})
PY
for f in /tmp/spy/*.txt; do [ -s $f ] || continue; echo "== $(basename $f)"
  python3 bench/profile_summary.py $f --rate 100 --top 30 2>/dev/null | head -70; done > $OUT/spy_summary.txt
tar czf $OUT/spy_raw.tgz -C /tmp spy 2>/dev/null
el done
