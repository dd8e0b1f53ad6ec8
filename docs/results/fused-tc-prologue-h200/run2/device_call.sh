#!/usr/bin/env bash
# fused-tc prologue records (unit_pre): base vs new, two alternating rounds (f16, 48 cases), then gpu_fused_tc + gpu_attention.
set -u
X=/tmp/x; mkdir -p $X/new
tar -C $X/new -xJf .gpu/s/bin33.tar.xz
xz -dc .gpu/s/sb_base.xz > $X/sb_base; chmod +x $X/sb_base; cp $X/new/spattn-bench $X/sb_new
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
R=$OUT
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
B="--data-dir data $G --algorithms fused-tc --dtype f16 --head-dim 64,128 --heads 1,8 --no-check --reps 20 --warmup 5"
for r in 1 2; do for b in base new; do
  s=$(date +%s); timeout 90 $X/sb_$b $B > $R/t_${b}_$r.txt 2>&1; echo "$b $r rc=$? $(( $(date +%s)-s ))s"
done; done
timeout 150 $X/new/attention-gpu_fused_tc --include-ignored --test-threads=2 --skip timings > $R/fused_tc.txt 2>&1; echo "gpu_fused_tc rc=$? $(grep -E '^test result' $R/fused_tc.txt)"
timeout 150 $X/new/attention-gpu_attention --include-ignored --test-threads=2 > $R/att.txt 2>&1; echo "gpu_attention rc=$? $(grep -E '^test result' $R/att.txt)"
grep -h "panicked" -A3 $R/fused_tc.txt $R/att.txt | head -8
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
M=rd2('base'); N=rd2('new')
for h in ('1','8'):
  for dd in ('64','128'):
    rs=[(M[k]/N[k],k) for k in M if k in N and k[1]==h and k[2]==dd]
    g=math.exp(sum(math.log(r) for r,_ in rs)/len(rs))
    print('h'+h,'d'+dd,len(rs),"base/new geo %.3f min %.3f %s max %.3f %s"%(g,min(rs)[0],min(rs)[1][0],max(rs)[0],max(rs)[1][0]))
rs=[M[k]/N[k] for k in M if k in N]; print('all',len(rs),'geo %.3f'%math.exp(sum(map(math.log,rs))/len(rs)))
print(' '.join('%s/h%s/d%s:%.4f->%.4f'%(k[0][:6],k[1],k[2],M[k],N[k]) for k in sorted(M) if k in N and k[0] in('pubmed','ogbn-arxiv','cora','rmat-18')))
PY
