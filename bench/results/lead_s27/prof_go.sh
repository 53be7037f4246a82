# Where a batch-1 step's time goes outside the decode graph (lead, session 27): step vs replay is 0.737 vs
# 0.680 ms on Qwen2.5-0.5B and 1.134 vs 1.043 ms on Llama-3.2-1B (session 24). The device-only timeline of the
# engine's own loop says whether the gap is the device idling (host-bound: each CUDA call costs the host
# ~0.1 ms in the sandbox) or device work outside the graph (uploads, gather, argmax, the token copy).
# Run: `bash .carry/multi.sh prof:110` carrying .carry/lead, .carry/prof (go.sh = this file), .carry/setup.sh,
# .carry/multi.sh.
. .carry/setup.sh prof || exit 1
R=/tmp/r; mkdir -p $R; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
timeout 100 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16 --profile \
  --json $R/profile.json > $R/profile.log 2>&1
el "profile rc=$?"; python3 - $R/profile.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["engine"]:
    t = r.get("timeline", {})
    print(r["shape"], r.get("step_ms"), r.get("replay_ms"), {k: t.get(k) for k in (
        "span_us_per_step", "busy_us_per_step", "idle_us_per_step", "largest_gaps_us", "rare_device_ops")},
          r.get("host"))
PY
el done
