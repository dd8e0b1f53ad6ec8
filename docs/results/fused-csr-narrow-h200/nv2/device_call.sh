#!/usr/bin/env bash
# Device call 62 (experiment): fused-csr two vectors a lane in the short-tile kernels (f32 D128,
# f16 D256) against the plain layout, same binary (SPATTN_FCSR_NV2 switches). Two rounds.
set -u
X=/tmp/x; mkdir -p $X/new
xz -dc .gpu/s/sb_nv2.xz > $X/new/spattn-bench; chmod +x $X/new/spattn-bench
cd .gpu/h
R=$OUT
SPATTN_FCSR_NV2=1 timeout 100 $X/new/spattn-bench --data-dir data --graph cora --graph pubmed --graph ppi-graphsaint --algorithms fused-csr --dtype f32,f16,bf16 --head-dim 128,256 --heads 1,8 --reps 3 --warmup 1 > /tmp/chk.txt 2>&1
echo "check rc=$? | $(grep -E "case runs:" /tmp/chk.txt)"
cp /tmp/chk.txt $R/check.txt
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
for r in 1 2; do for m in plain nv2; do
  if [ $m = nv2 ]; then export SPATTN_FCSR_NV2=1; else unset SPATTN_FCSR_NV2; fi
  timeout 60 $X/new/spattn-bench --data-dir data $G --algorithms fused-csr --dtype f32 --head-dim 128 --heads 1,8 --no-check --reps 20 --warmup 5 > $R/a_${m}_$r.txt 2>&1; echo "f32 $m $r rc=$?"
  timeout 60 $X/new/spattn-bench --data-dir data $G --algorithms fused-csr --dtype f16 --head-dim 256 --heads 1,8 --no-check --reps 20 --warmup 5 > $R/b_${m}_$r.txt 2>&1; echo "f16 $m $r rc=$?"
done; done
unset SPATTN_FCSR_NV2
python3 - $R <<'PY'
import sys,re,math
R=sys.argv[1]
def rd(f,alg='fused-csr'):
    d={}
    for l in open(f):
        m=re.match(r'\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
        if m and m[2]==alg: d[(m[1],m[3],m[4],m[5])]=float(m[6])
    return d
for p in 'ab':
  def rd2(v):
    a,b=rd(f'{R}/{p}_{v}_1.txt'),rd(f'{R}/{p}_{v}_2.txt'); return {k:min(a[k],b[k]) for k in a if k in b}
  P=rd2('plain');N=rd2('nv2')
  rs=[(P[k]/N[k],k) for k in P if k in N]
  for r,k in sorted(rs,key=lambda x:(x[1][1],x[1][0])): print("%-20s h%s d%s %s plain %.4f nv2 %.2f"%(k[0],k[1],k[2],k[3],P[k],r))
  print(p,len(rs),"plain/nv2 geo %.3f"%math.exp(sum(math.log(r) for r,_ in rs)/max(1,len(rs))))
PY
