#!/usr/bin/env bash
# ncu of fused-tc (pipelined kernel) on pubmed, cora, ogbn-arxiv f16 h1 d128, warm L2, with stall sampling.
set -u
X=/tmp/x; mkdir -p $X
xz -dc .gpu/s/sb_base.xz > $X/sb; chmod +x $X/sb
cd .gpu/h
R=$OUT
for g in pubmed cora ogbn-arxiv; do
  s=$(date +%s)
  timeout 200 ncu --set full --import-source no --cache-control none --clock-control none -k regex:fused_bsb --launch-skip 10 -c 1 -o $X/$g \
    $X/sb --data-dir data --graph $g --algorithms fused-tc --dtype f16 --head-dim 128 --heads 1 --no-check --reps 20 --warmup 5 > $X/$g.log 2>&1
  echo "$g rc=$? $(( $(date +%s)-s ))s"; tail -3 $X/$g.log
  ncu --import $X/$g.ncu-rep --page details > $R/${g}_details.txt 2>&1
  ncu --import $X/$g.ncu-rep --page source --csv --print-source sass > $X/${g}_src.csv 2>&1
  xz -c $X/${g}_src.csv > $R/${g}_src.csv.xz
  python3 - $X/${g}_src.csv <<'PY'
import csv,sys
rows=list(csv.reader(open(sys.argv[1])))
h=rows[0]
print(len(rows), 'cols:', [c for c in h][:40])
def col(name):
    for i,c in enumerate(h):
        if c.startswith(name): return i
    return None
si=col('Warp Stall Sampling (All'); src=col('Source'); ex=col('Instructions Executed')
if si is None: sys.exit()
data=[]
for r in rows[1:]:
    try: data.append((float(r[si] or 0), r[src], r[ex] if ex is not None else ''))
    except: pass
tot=sum(d[0] for d in data)
print('total samples', tot)
for s,t,e in sorted(data,reverse=True)[:25]: print('%6.0f %5.1f%% %-70s %s'%(s,100*s/tot,t[:70],e))
PY
done
for g in pubmed cora ogbn-arxiv; do echo "== $g"; grep -E "^ +(Duration|Elapsed Cycles|SM Active Cycles|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|L2 Hit Rate|Issued Ipc Active|Warp Cycles Per Issued Instruction|Executed Instructions |Block Limit Registers|Block Limit Shared Mem|Grid Size|One or More Eligible|Avg. Active Threads Per Warp|L2 Cache Throughput|DRAM Throughput) " $R/${g}_details.txt; done
