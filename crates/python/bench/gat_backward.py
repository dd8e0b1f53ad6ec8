#!/usr/bin/env python3
"""GAT's attention on CUDA by kernels and graph size: the forward (composed CSR ops; row
statistics) and the backward (composed; fused, two passes over A and Aᵀ; row statistics and
two SpMM-shaped passes). Per graph, heads × channels and dtype: the GPU time of one call (CUDA
events around 20 back-to-back calls, median of 5 such runs), the host time of one call
(enqueue only: 200 calls back to back, then the drain) and each result's largest difference
from the composed one. What ``kernels="auto"`` rests on.

Graphs: a batch of 128 random molecules of 15–40 atoms and the subgraphs induced by a share of
ogbn-arxiv's nodes (``--fractions``, default 20%; minibatch.py's workloads, with GATConv's self
loops), pubmed and ogbn-arxiv (symmetrized, self loops).

    python crates/python/bench/gat_backward.py --graph data/ogbn-arxiv.mtx.gz \\
        --pubmed data/pubmed.mtx.gz [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_time  # noqa: E402  (its host-time probe)
import minibatch  # noqa: E402  (the workloads' generators)

import spattn  # noqa: E402
from spattn import functional as F  # noqa: E402

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def graphs(args, device):
    """(name, Graph with self loops) of each size."""
    arxiv = spattn.Graph.read_matrix_market(args.graph, symmetrize=True)
    ei, n = arxiv.edge_index().to(device), arxiv.num_nodes
    gen = torch.Generator(device=device).manual_seed(1)
    mol, mol_n = minibatch.molecules(128, 15, 40, torch.Generator().manual_seed(1), device)
    out = [("molecules", spattn.Graph.from_edge_index(mol, num_nodes=mol_n, self_loops=True))]
    for frac in args.fractions:
        sub, sub_n = minibatch.induced_subgraph(ei, n, frac, gen)
        out.append((f"arxiv-sub{round(100 * frac)}",
                    spattn.Graph.from_edge_index(sub, num_nodes=sub_n, self_loops=True)))
    if args.pubmed:
        pub = spattn.Graph.read_matrix_market(args.pubmed, symmetrize=True)
        out.append(("pubmed", pub.with_self_loops()))
    out.append(("ogbn-arxiv", arxiv.with_self_loops()))
    return out


def run(graph, x, a_dst, a_src, d_out, kernels, out):
    return F.gat_backward(graph, x, a_dst, a_src, d_out, None, 0.2, None, kernels=kernels, out=out)


KERNELS = ("composed", "fused", "rows")


def gpu_ms(fn, calls=20, runs=5):
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", required=True, help="ogbn-arxiv.mtx.gz")
    ap.add_argument("--pubmed", help="pubmed.mtx.gz (optional)")
    ap.add_argument("--shapes", default="8x32,1x40", help="heads x channels, comma-separated")
    ap.add_argument("--dtypes", default="f16,f32")
    ap.add_argument("--fractions", default="0.2",
                    help="the induced subgraphs' shares of ogbn-arxiv's nodes, comma-separated")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    args.fractions = [float(f) for f in args.fractions.split(",") if f]
    device = torch.device("cuda")
    print(f"# GAT backward, fused vs composed; {torch.cuda.get_device_name()}; spattn "
          f"{spattn.__version__}; torch {torch.__version__}")
    print("| graph | edges | heads x ch | dtype | pass | kernels | GPU ms | vs composed | host us "
          "| max diff |")
    print("|---|--:|---|---|---|---|--:|--:|--:|--:|")
    rows = []
    for name, g in graphs(args, device):
        for shape in args.shapes.split(","):
            h, c = (int(v) for v in shape.split("x"))
            for dt in args.dtypes.split(","):
                gen = torch.Generator(device=device).manual_seed(2)
                n = g.num_nodes
                x = torch.randn(n, h, c, device=device, generator=gen).to(DTYPES[dt])
                d_out = torch.randn(n, h, c, device=device, generator=gen).to(DTYPES[dt])
                a_dst = torch.randn(n, h, device=device, generator=gen)
                a_src = torch.randn(n, h, device=device, generator=gen)
                fwd = {k: (lambda k=k: F.gat_forward(g, x, a_dst, a_src, None, 0.2, None,
                                                     kernels=k)) for k in ("composed", "rows")}
                out = fwd["composed"]()
                bwd = {k: (lambda k=k: run(g, x, a_dst, a_src, d_out, k, out)) for k in KERNELS}
                for pass_, fns in (("forward", fwd), ("backward", bwd)):
                    ref = None
                    for k, fn in fns.items():
                        res = fn()
                        res = res if isinstance(res, tuple) else (res,)
                        ref = ref or res
                        diff = max((a.float() - b.float()).abs().max().item()
                                   for a, b in zip(ref[:3], res[:3]))
                        ms, host = gpu_ms(fn), host_time.host(fn)[0]
                        row = {"graph": name, "edges": g.num_edges, "heads": h, "channels": c,
                               "dtype": dt, "pass": pass_, "kernels": k, "ms": ms,
                               "host_us": host, "max_diff": diff}
                        base = next((r["ms"] for r in rows if r["graph"] == name and r["heads"] == h
                                     and r["channels"] == c and r["dtype"] == dt and r["pass"] == pass_
                                     and r["kernels"] == "composed"), ms)
                        rows.append(row)
                        print(f"| {name} | {g.num_edges:,} | {h} x {c} | {dt} | {pass_} | {k} | "
                              f"{ms:.3f} | {base / ms:.2f} | {host:.1f} | {diff:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
