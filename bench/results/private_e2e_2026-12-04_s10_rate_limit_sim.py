# Session 10 (issue 17): the s8 H200 offload run's per-token times from the tenant's requests/min bucket alone.
# 600/min default, 112 step requests a token, the SDK sleeping Retry-After (whole seconds, >= 1) on a 429;
# step time from the run (2.2 s a token from token 3). Prints 2.2 s to token 8, ~6 s token 9, 11.2 s after:
# the run measured 2.2-2.4, 5.1, then 10.4-11.8 s (bench/results/private_e2e_2026-12-02_s8_offload28_gpu_p32_timeout.log).
import math
cap=600.0; level=cap; stamp=0.0; t=0.0
def take(now):
    global level, stamp
    level=min(cap, level+(now-stamp)*cap/60); stamp=now
    if level>=1: level-=1; return 0.0
    return (1-level)*60/cap
durs=[56.6,14.0]+[2.2]*30
for k,d in enumerate(durs,1):
    start=t; per=d/112
    for s in range(112):
        while True:
            w=take(t)
            if w==0: break
            t+=max(1,math.ceil(w))   # Retry-After: whole seconds, at least 1
        t+=per
    print(f"token {k}: {t-start:.1f} s")
