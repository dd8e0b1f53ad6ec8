#!/usr/bin/env bash
# Device call 53: grid_group / split_index (shifts, 32-bit division) in the CSR ops, backward and
# mebcrs slot kernels. Tests (gpu_csr_ops, both gpu_backward, gpu_tc_ops, fused-csr subset),
# memcheck, then the CSR ops + fused-csr: main (6ce96f8's ops) vs new, two rounds.
set -u
X=/tmp/x; mkdir -p $X/new $X/old
tar -C $X/new -xJf .gpu/h/bin26.tar.xz
xz -dc .gpu/o/bench23.xz > $X/old/spattn-bench; chmod +x $X/old/spattn-bench
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
R=$OUT
run() { local n=$1 t=$2; shift 2; timeout $t "$@" > $R/t_$n.txt 2>&1; echo "$n rc=$? $(grep -E '^test result' $R/t_$n.txt)"; grep -hE "panicked" -A3 $R/t_$n.txt | head -6; }
run csr_ops 150 $X/new/ops-gpu_csr_ops --include-ignored --test-threads=2
run ops_bwd 100 $X/new/ops-gpu_backward --include-ignored --test-threads=2
run att_bwd 150 $X/new/attention-gpu_backward --include-ignored --test-threads=2
run tc_ops 120 $X/new/ops-gpu_tc_ops --include-ignored --test-threads=2
run att 100 $X/new/attention-gpu_attention --include-ignored --test-threads=2 fused_csr_row_orders hub_row
S="compute-sanitizer --error-exitcode 1 --require-cuda-init no --report-api-errors no"
timeout 80 $S --tool memcheck --kernel-name kns=csr $X/new/ops-gpu_csr_ops --include-ignored --test-threads=1 tiny_graphs_and_empty_rows unfused_attention > $R/mc.txt 2>&1
echo "memcheck csr ops rc=$? $(grep SUMMARY $R/mc.txt)"
G="--graph cora --graph pubmed --graph ppi-graphsaint --graph deezer-RO --graph flickr --graph PROTEINS_full --graph ogbn-arxiv --rmat 16"
B="--data-dir data $G --algorithms sddmm-csr,softmax-csr,spmm-csr,unfused-csr,fused-csr --dtype f16,f32 --head-dim 64,128 --heads 1,8 --no-check --reps 15 --warmup 3"
for i in 1 2; do for b in old new; do
  s=$(date +%s); timeout 100 $X/$b/spattn-bench $B > $R/b_${b}_$i.txt 2>&1; echo "bench $b $i rc=$? $(( $(date +%s)-s ))s"
done; done
python3 - $R <<'PY'
import sys,re,math
R=sys.argv[1]
def rd(f):
    d={}
    for l in open(f):
        m=re.match(r'\s+(\S+)\s+(\S+-csr)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
        if m: d[(m[1],m[2],m[3],m[4],m[5])]=float(m[6])
    return d
T={(b,i):rd(f'{R}/b_{b}_{i}.txt') for b in ('old','new') for i in (1,2)}
ks=[k for k in T[('old',1)] if all(k in T[x] for x in T)]
best=lambda b,k: min(T[(b,1)][k],T[(b,2)][k])
for alg in ('sddmm-csr','softmax-csr','spmm-csr','unfused-csr','fused-csr'):
  for dt in ('f16','f32'):
    rs=sorted((best('old',k)/best('new',k),k[0]+' h'+k[2]+' d'+k[3]) for k in ks if k[1]==alg and k[4]==dt)
    if rs: print(alg,dt,len(rs),"old/new geo %.3f min %.2f (%s) max %.2f (%s)"%(math.exp(sum(math.log(r) for r,_ in rs)/len(rs)),rs[0][0],rs[0][1],rs[-1][0],rs[-1][1]))
print("f32 H8 new: fused-csr / unfused-csr ms (>1 = unfused faster)")
for k in sorted(ks):
    if k[1]=='fused-csr' and k[4]=='f32' and k[2]=='8':
        u=(k[0],'unfused-csr')+k[2:]
        if u in ks: print(' ',k[0],'d'+k[3],"%.4f %.4f %.2f"%(best('new',k),best('new',u),best('new',k)/best('new',u)))
PY
