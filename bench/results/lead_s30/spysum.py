import sys, collections
self_c = collections.Counter(); incl = collections.Counter(); total = 0
for line in open(sys.argv[1]):
    line = line.rstrip()
    if not line: continue
    stack, _, n = line.rpartition(' ')
    n = int(n); total += n
    frames = stack.split(';')
    if 'idle' in sys.argv[2:] : pass
    self_c[frames[-1]] += n
    for f in set(frames): incl[f] += n
print('total', total)
print('--- self')
for f, n in self_c.most_common(25): print(f'{n/total*100:5.1f}% {f}')
print('--- inclusive')
for f, n in incl.most_common(40): print(f'{n/total*100:5.1f}% {f}')
