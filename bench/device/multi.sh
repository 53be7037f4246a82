# bash bench/device/multi.sh NAME[:SECONDS] ...: each .carry/NAME/go.sh in turn in its own shell (its own tree if packed),
# with OUT=/tmp/o/NAME and at most SECONDS (default 300); each one's files and stdout come back as $OUT/NAME.tgz.
for a in "$@"; do
  n=${a%%:*}; s=${a#*:}; [ "$s" = "$a" ] && s=300
  mkdir -p /tmp/o/$n; echo "=== $n (cap ${s}s) $(date -u +%H:%M:%S)"
  (cd $(git rev-parse --show-toplevel 2>/dev/null || pwd) && OUT=/tmp/o/$n timeout -s INT $s bash .carry/$n/go.sh) 2>&1 | tee /tmp/o/$n/stdout.txt | tail -${TAILN:-40}
  tar czf $OUT/$n.tgz -C /tmp/o $n
done
