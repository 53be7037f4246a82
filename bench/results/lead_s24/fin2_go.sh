# Session 24, the leftover ~200 s: the attention kernels' card tests in full (the last call cut them at 30 s, 25 passed),
# then the persistent kernel's launch sweep on Qwen (P, warps, prefetch), to say why its stages were slow.
. .carry/setup.sh fin2 || exit 1
END=$(( T0 + 105 )); cap() { local l=$(( END - $(date +%s) )); l=$(( l < $1 ? l : $1 )); echo $(( l > 1 ? l : 1 )); }
O=/tmp/fin2; mkdir -p $O; pack() { cp /tmp/fin2.log $O/ 2>/dev/null; tar czf $OUT/fin2.tgz -C /tmp fin2; }
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. attention kernels on CUDA"
timeout $(cap 45) $PT tests/kernels/test_triton.py tests/kernels/test_kv_fp8.py tests/kernels/test_pdl.py -k "decode or prefill" \
  > $O/tests_attn.log 2>&1; el "rc=$?"; tail -3 $O/tests_attn.log | cut -c1-300; pack
el "2. persistent launch sweep, Qwen"
timeout $(cap 60) python3 -m bench.decode_persistent_gpu --shapes qwen2.5-0.5b --rounds 1 --json $O/sweep.json > $O/sweep.log 2>&1
el "rc=$?"; grep -v -i warn $O/sweep.log | grep -v '^{' | cut -c1-300 | tail -16; pack; el done
