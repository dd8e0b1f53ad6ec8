#!/usr/bin/env bash
# Device call 57 (es 2 / 4 layouts, tile 2, two rounds): fused-csr with the group's lanes split into subgroups that walk shares of a
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
for m in 2 4; do
  SPATTN_FCSR_EXP=$m timeout 100 $X/new/ga --include-ignored --test-threads=2 --exact fused_csr_row_orders head_dims_heads_and_tiny_graphs hub_row_and_extreme_scores > /tmp/t$m.txt 2>&1
  echo "tests mode $m rc=$? $(grep -E '^test result' /tmp/t$m.txt)"; grep -hE "panicked" -A3 /tmp/t$m.txt | head -6
done
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
B1="--data-dir data $G --algorithms fused-csr --dtype f16,f32 --head-dim 64,128 --heads 1,8 --no-check --reps 20 --warmup 5"
for r in 1 2; do
timeout 80 $X/old/spattn-bench $B1 > $R/c_main_$r.txt 2>&1; echo "main rc=$?"
for m in 2 4; do SPATTN_FCSR_EXP=$m timeout 80 $X/new/spattn-bench $B1 > $R/c_m${m}_$r.txt 2>&1; echo "mode $m rc=$?"; done
done
python3 - $R <<'PY'
import sys,re,math
R=sys.argv[1]
def rd(f):
    d={}
    for l in open(f):
        m=re.match(r'\s+(\S+)\s+(fused-csr)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
        if m: d[(m[1],m[3],m[4],m[5])]=float(m[6])
    return d
def rd2(v):
  a,b=rd(f'{R}/c_{v}_1.txt'),rd(f'{R}/c_{v}_2.txt'); return {k:min(a[k],b[k]) for k in a if k in b}
M=rd2('main')
for v in ('m2','m4'):
  N=rd2(v)
  for dt in ('f16','f32'):
    for dd in ('64','128'):
      rs=[(M[k]/N[k],k) for k in M if k in N and k[3]==dt and k[2]==dd]
      if not rs: continue
      g=math.exp(sum(math.log(r) for r,_ in rs)/len(rs))
      print(v,dt,'d'+dd,len(rs),"main/new geo %.3f min %.2f (%s h%s) max %.2f (%s h%s)"%(g,min(rs)[0],min(rs)[1][0],min(rs)[1][1],max(rs)[0],max(rs)[1][0],max(rs)[1][1]))

PY
