#!/usr/bin/env bash
# Device call 60 (experiment): fused-csr layouts forced per run: plain (32 lanes, narrow vectors),
# split (subgroups of the widest vectors sharing a unit), narrow (the split kernel with one
# subgroup per unit: 8 or 16 lanes of 8 f16 features, several units per warp). Two rounds.
set -u
X=/tmp/x; mkdir -p $X/new
xz -dc .gpu/s/sb_narrow.xz > $X/new/spattn-bench; chmod +x $X/new/spattn-bench
cd .gpu/h
R=$OUT
SPATTN_FCSR_MODE=narrow timeout 100 $X/new/spattn-bench --data-dir data --graph cora --graph pubmed --graph ppi-graphsaint --algorithms fused-csr --dtype f16,bf16,f32 --head-dim 64,128 --heads 1,8 --reps 3 --warmup 1 > /tmp/chk.txt 2>&1
echo "check rc=$? | $(grep -E "case runs:" /tmp/chk.txt)"
cp /tmp/chk.txt $R/check.txt
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
B1="--data-dir data $G --algorithms fused-csr --dtype f16 --head-dim 64,128 --heads 1,8 --no-check --reps 20 --warmup 5"
for r in 1 2; do for m in plain split narrow; do
  SPATTN_FCSR_MODE=$m timeout 60 $X/new/spattn-bench $B1 > $R/m_${m}_$r.txt 2>&1; echo "$m $r rc=$?"
done; done
python3 - $R <<'PY'
import sys,re,math
R=sys.argv[1]
def rd(f,alg='fused-csr'):
    d={}
    for l in open(f):
        m=re.match(r'\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
        if m and m[2]==alg: d[(m[1],m[3],m[4],m[5])]=float(m[6])
    return d
def rd2(v):
  a,b=rd(f'{R}/m_{v}_1.txt'),rd(f'{R}/m_{v}_2.txt'); return {k:min(a[k],b[k]) for k in a if k in b}
P=rd2('plain');S=rd2('split');N=rd2('narrow')
for k in sorted(P,key=lambda k:(k[2],k[1],k[0])):
  print("%-20s h%s d%-3s plain %.4f split %.2f narrow %.2f"%(k[0],k[1],k[2],P[k],P[k]/S[k],P[k]/N[k]))
PY
