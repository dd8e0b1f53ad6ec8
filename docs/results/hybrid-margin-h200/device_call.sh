#!/usr/bin/env bash
# Device call 54: hybrid split kept only when it beats the faster pure run by 5%
# (MIXED_MARGIN). SpMM three-way timings and the attention hybrid/fused-tc bench.
set -u
X=/tmp/x; mkdir -p $X/e
for f in hs sb; do xz -dc .gpu/e/$f.xz > $X/e/$f; chmod +x $X/e/$f; done
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
R=$OUT
SPATTN_SPMM_GRAPHS=cora,citeseer,pubmed,PROTEINS_full,lastfm-asia,facebook-page-page,deezer-RO,ppi-graphsaint,flickr,ogbn-arxiv,rmat16 timeout 200 $X/e/hs --include-ignored --nocapture --exact timings > $R/spmm.txt 2>&1; echo "spmm rc=$?"
python3 - $R/spmm.txt <<'PY'
import sys,math
rs=[]
for l in open(sys.argv[1]):
    c=[x.strip() for x in l.split('|')]
    if len(c)>8 and c[7].endswith('x'):
        try: rs.append((float(c[7][:-1]),c[1]+' h'+c[2]+' d'+c[3]))
        except: pass
rs.sort()
print(len(rs),"SpMM cases; hybrid >= best pure:",sum(r>=1.0 for r,_ in rs),"min",rs[0],"geo %.3f"%math.exp(sum(math.log(r) for r,_ in rs)/len(rs)))
print([x for x in rs if x[0]<1.0])
PY
G="--graph cora --graph citeseer --graph pubmed --graph PROTEINS_full --graph lastfm-asia --graph facebook-page-page --graph deezer-RO --graph ppi-graphsaint --graph flickr --graph ogbn-arxiv --rmat 16 --rmat 18"
timeout 150 $X/e/sb --data-dir data $G --algorithms hybrid,fused-tc,fused-csr --dtype f16 --head-dim 64,128 --heads 1,8 --no-check --reps 20 --warmup 5 > $R/att.txt 2>&1; echo "att rc=$?"
python3 - $R/att.txt <<'PY'
import sys,re,math
d={}
for l in open(sys.argv[1]):
    m=re.match(r'\s+(\S+)\s+(fused-csr|hybrid|fused-tc)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)',l)
    if m: d[(m[1],m[3],m[4],m[2])]=float(m[6])
rs=[]
for (g,h,dd,a),t in d.items():
    if a!='hybrid': continue
    best=min(d[(g,h,dd,'fused-tc')],d[(g,h,dd,'fused-csr')]); rs.append((best/t,g+' h'+h+' d'+dd))
rs.sort()
print(len(rs),"attention cases; hybrid >= best pure:",sum(r>=1.0 for r,_ in rs),"min",rs[0],"geo %.3f"%math.exp(sum(math.log(r) for r,_ in rs)/len(rs)))
PY
