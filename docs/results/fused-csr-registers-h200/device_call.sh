#!/usr/bin/env bash
# Device call 52: fused-csr with V held raw (f16/bf16; floats for f32) + shift/32-bit unit
# index. gpu_attention, memcheck, fused-csr old (6ce96f8 kernels) vs new, two rounds.
set -u
X=/tmp/x; mkdir -p $X/new
tar -C $X/new -xJf .gpu/h/bin25.tar.xz
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
R=$OUT
timeout 260 $X/new/attention-gpu_attention --include-ignored --test-threads=2 > $R/att.txt 2>&1; echo "gpu_attention rc=$? $(grep -E '^test result' $R/att.txt)"
grep -hE "panicked" -A3 $R/att.txt | head -8
S="compute-sanitizer --error-exitcode 1 --require-cuda-init no --report-api-errors no"
timeout 60 $S --tool memcheck --kernel-name kns=fused_csr $X/new/attention-gpu_attention --include-ignored --test-threads=1 --exact fused_csr_row_orders > $R/mc.txt 2>&1
echo "memcheck fused_csr_row_orders rc=$? $(grep SUMMARY $R/mc.txt)"
mkdir -p $X/old; xz -dc ../o/bench23.xz > $X/old/spattn-bench; chmod +x $X/old/spattn-bench
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
B1="--data-dir data $G --algorithms fused-csr --dtype f16,f32 --head-dim 64,128 --heads 1,8 --no-check --reps 20 --warmup 5"
for i in 1 2; do for b in old new; do
  timeout 100 $X/$b/spattn-bench $B1 > $R/c_${b}_$i.txt 2>&1; echo "$b $i rc=$?"
done; done
python3 - $R <<'PY'
import sys,re,math
R=sys.argv[1]
def rd(f):
    d={}
    for l in open(f):
        m=re.match(r'\s+(\S+)\s+(fused-csr)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
        if m: d[(m[1],m[3],m[4],m[5])]=float(m[6])
    return d
T={(b,i):rd(f'{R}/c_{b}_{i}.txt') for b in ('old','new') for i in (1,2)}
for dt in ('f16','f32'):
  for h in ('1','8'):
    rs=[(min(T[('old',1)][k],T[('old',2)][k])/min(T[('new',1)][k],T[('new',2)][k]),k) for k in T[('old',1)] if k[3]==dt and k[1]==h and all(k in T[x] for x in T)]
    g=math.exp(sum(math.log(r) for r,_ in rs)/len(rs))
    print(dt,'h'+h,len(rs),"old/new geo %.3f min %.2f (%s) max %.2f (%s)"%(g,min(rs)[0],min(rs)[1][0],max(rs)[0],max(rs)[1][0]))
PY
