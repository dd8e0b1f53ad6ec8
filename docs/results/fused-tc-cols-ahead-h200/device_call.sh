#!/usr/bin/env bash
# fused-tc column-id prefetch distance: base (1 step) vs ca2 vs ca3, two alternating rounds.
set -u
X=/tmp/x; mkdir -p $X
for b in base ca2 ca3; do xz -dc .gpu/s/sb_$b.xz > $X/sb_$b; chmod +x $X/sb_$b; done
cd .gpu/h
R=$OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
B="--data-dir data $G --algorithms fused-tc --dtype f16 --head-dim 64,128 --heads 1,8 --no-check --reps 20 --warmup 5"
for r in 1 2; do for b in base ca2 ca3; do
  s=$(date +%s); timeout 90 $X/sb_$b $B > $R/t_${b}_$r.txt 2>&1; echo "$b $r rc=$? $(( $(date +%s)-s ))s"
done; done
python3 - $R <<'PY'
import sys,re,math
R=sys.argv[1]
def rd(f,alg='fused-tc'):
    d={}
    for l in open(f):
        m=re.match(r'\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
        if m and m[2]==alg: d[(m[1],m[3],m[4])]=float(m[6])
    return d
def rd2(v):
  a,b=rd(f'{R}/t_{v}_1.txt'),rd(f'{R}/t_{v}_2.txt'); return {k:min(a[k],b[k]) for k in a if k in b}
M=rd2('base')
for v in ('ca2','ca3'):
  N=rd2(v)
  for h in ('1','8'):
    rs=[(M[k]/N[k],k) for k in M if k in N and k[1]==h]
    if not rs: continue
    g=math.exp(sum(math.log(r) for r,_ in rs)/len(rs))
    print(v,'h'+h,len(rs),"base/new geo %.3f min %.3f %s max %.3f %s"%(g,min(rs)[0],min(rs)[1],max(rs)[0],max(rs)[1]))
  print(v, ' '.join('%s/h%s/d%s:%.4f->%.4f'%(k[0][:6],k[1],k[2],M[k],N[k]) for k in sorted(M) if k in N and k[0] in('pubmed','ogbn-arxiv','cora')))
PY
