#!/usr/bin/env bash
# Device call 61: split groups for launches of <= 256 groups per SM, narrow groups above
# (short-tile kernels): gpu_attention, synccheck + memcheck
# of the fused_csr kernels, fused-csr old vs new (two rounds, f16/f32).
set -u
X=/tmp/x; mkdir -p $X/old $X/new
tar -C $X/new -xJf .gpu/s/bin29.tar.xz
xz -dc .gpu/s/sb_main.xz > $X/old/spattn-bench; chmod +x $X/old/spattn-bench
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
R=$OUT
timeout 240 $X/new/attention-gpu_attention --include-ignored --test-threads=2 > /tmp/att.txt 2>&1; echo "gpu_attention rc=$? $(grep -E '^test result' /tmp/att.txt)"
grep -hE "panicked" -A3 /tmp/att.txt | head -8
S="compute-sanitizer --error-exitcode 1 --require-cuda-init no --report-api-errors no"
for tool in synccheck memcheck; do for t in fused_csr_row_orders head_dims_heads_and_tiny_graphs; do
timeout 120 $S --tool $tool --kernel-name kns=fused_csr $X/new/attention-gpu_attention --include-ignored --test-threads=1 --exact $t > /tmp/san.txt 2>&1
echo "$tool $t rc=$? $(grep SUMMARY /tmp/san.txt) $(grep -E '^test result' /tmp/san.txt)"
done; done
cp /tmp/att.txt $R/tests.txt
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
B1="--data-dir data $G --algorithms fused-csr --dtype f16,f32 --head-dim 64,128 --heads 1,8 --no-check --reps 20 --warmup 5"
for r in 1 2; do for b in old new; do
  timeout 70 $X/$b/spattn-bench $B1 > $R/c_${b}_$r.txt 2>&1; echo "$b $r rc=$?"
done; done
B2="--data-dir data --graph pubmed --graph PROTEINS_full --graph deezer-RO --graph flickr --graph ogbn-arxiv --graph cora --algorithms fused-csr,unfused-csr --dtype f32 --head-dim 64 --heads 8 --no-check --reps 20 --warmup 5"
timeout 60 $X/new/spattn-bench $B2 > $R/auto.txt 2>&1; echo "auto rc=$?"
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
  a,b=rd(f'{R}/c_{v}_1.txt'),rd(f'{R}/c_{v}_2.txt'); return {k:min(a[k],b[k]) for k in a if k in b}
M=rd2('old'); N=rd2('new')
allr=[]
for dt in ('f16','f32'):
  for dd in ('64','128'):
    rs=[(M[k]/N[k],k) for k in M if k in N and k[3]==dt and k[2]==dd]
    if not rs: continue
    allr+=rs
    g=math.exp(sum(math.log(r) for r,_ in rs)/len(rs))
    print(dt,'d'+dd,len(rs),"main/new geo %.3f min %.2f (%s h%s) max %.2f (%s h%s)"%(g,min(rs)[0],min(rs)[1][0],min(rs)[1][1],max(rs)[0],max(rs)[1][0],max(rs)[1][1]))
print("all",len(allr),"geo %.3f"%math.exp(sum(math.log(r) for r,_ in allr)/len(allr)), "below 0.97:", sorted([(round(r,2),k) for r,k in allr if r<0.97]))
PY
python3 - $R/auto.txt <<'PY'
import sys,re
d={}
for l in open(sys.argv[1]):
    m=re.match(r'\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
    if m: d[(m[1],m[2])]=float(m[6])
for g in sorted(set(k[0] for k in d)):
    print('f32 h8 d64',g,'fused %.4f unfused %.4f unfused/fused %.2f'%(d[(g,'fused-csr')],d[(g,'unfused-csr')],d[(g,'unfused-csr')]/d[(g,'fused-csr')]))
PY
