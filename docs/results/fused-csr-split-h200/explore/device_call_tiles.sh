#!/usr/bin/env bash
# Device call 56: fused-csr with the group's lanes split into subgroups that walk shares of a
# unit's edges (widest vectors, fewer shuffle levels), tile 4 (_s) or 2 (_s_t2), vs main.
set -u
X=/tmp/x; mkdir -p $X/old $X/new
xz -dc .gpu/s/sb_main.xz > $X/old/spattn-bench; chmod +x $X/old/spattn-bench
xz -dc .gpu/s/sb_split.xz > $X/new/spattn-bench; chmod +x $X/new/spattn-bench
xz -dc .gpu/s/ga_split.xz > $X/new/ga; chmod +x $X/new/ga
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
R=$OUT
# quick correctness of the split kernels first
for m in 4 2; do
  SPATTN_FCSR_EXP=$m timeout 100 $X/new/ga --include-ignored --test-threads=2 --exact fused_csr_row_orders head_dims_heads_and_tiny_graphs hub_row_and_extreme_scores > /tmp/t$m.txt 2>&1
  echo "tests mode $m rc=$? $(grep -E '^test result' /tmp/t$m.txt)"; grep -hE "panicked" -A3 /tmp/t$m.txt | head -6
done
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
B1="--data-dir data $G --algorithms fused-csr --dtype f16,f32 --head-dim 64,128 --heads 1,8 --no-check --reps 20 --warmup 5"
timeout 110 $X/old/spattn-bench $B1 > $R/c_main.txt 2>&1; echo "main rc=$?"
for m in 4 2; do SPATTN_FCSR_EXP=$m timeout 110 $X/new/spattn-bench $B1 > $R/c_m$m.txt 2>&1; echo "mode $m rc=$?"; done
python3 - $R <<'PY'
import sys,re,math
R=sys.argv[1]
def rd(f):
    d={}
    for l in open(f):
        m=re.match(r'\s+(\S+)\s+(fused-csr)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
        if m: d[(m[1],m[3],m[4],m[5])]=float(m[6])
    return d
M=rd(f'{R}/c_main.txt')
for v in ('m4','m2'):
  N=rd(f'{R}/c_{v}.txt')
  for dt in ('f16','f32'):
    for dd in ('64','128'):
      rs=[(M[k]/N[k],k) for k in M if k in N and k[3]==dt and k[2]==dd]
      if not rs: continue
      g=math.exp(sum(math.log(r) for r,_ in rs)/len(rs))
      print(v,dt,'d'+dd,len(rs),"main/new geo %.3f min %.2f (%s h%s) max %.2f (%s h%s)"%(g,min(rs)[0],min(rs)[1][0],min(rs)[1][1],max(rs)[0],max(rs)[1][0],max(rs)[1][1]))
k=('ogbn-arxiv','1','128','f16'); print('arxiv f16 h1 d128', M.get(k), rd(f'{R}/c_m4.txt').get(k), rd(f'{R}/c_m2.txt').get(k))
PY
