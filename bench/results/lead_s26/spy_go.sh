. .carry/setup.sh spy || exit 1
R=/tmp/r; mkdir -p $R; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
[ -d /tmp/smol ] || python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1
timeout 100 /tmp/site/bin/py-spy record --rate 200 --format raw -o $R/spy.txt -- python3 -m bench.core_served --model /tmp/smol \
  --device cuda --rounds 1 --steps 200 --mixed-tokens 0 --label spy0 > $R/spy.log 2>&1
tail -2 $R/spy.log
python3 bench/profile_summary.py $R/spy.txt --rate 200 --top 45 > $R/spy_summary.txt 2>&1; head -80 $R/spy_summary.txt
