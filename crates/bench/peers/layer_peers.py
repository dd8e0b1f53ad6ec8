#!/usr/bin/env python3
"""Layer peers of spattn's `layer_bench`, timed on the same GPU in the same run.

For each graph (the binary CSR files `layer_bench --dump-dir` writes: symmetrized, with self
loops) and dtype, times with CUDA events (warm-up, median of --reps) one forward and one
forward + backward (loss = sum(y * r), parameter and input gradients) of:

  pyg_gat          torch_geometric.nn.GATConv(64, 8, heads=8)          (add_self_loops=False)
  pyg_agnn         torch_geometric.nn.AGNNConv(requires_grad=True)      (add_self_loops=False)
  pyg_transformer  torch_geometric.nn.TransformerConv(64, 8, heads=8)
  sparse_gat, sparse_agnn, sparse_transformer
                   the same layer composed with torch.sparse (cuSPARSE): per-edge scores by
                   gathers, then per head torch.sparse.softmax on a COO matrix and
                   torch.sparse.mm(P_h, V_h) — DGL-style; falls back to f32 where a kernel has
                   no half version (the record says "dtype_used").

Shapes match layer_bench: 64 input features, 8 heads x 8. PyG's TransformerConv has a skip
projection (root_weight) and no output projection; spattn's layer has Q/K/V/O — the same number
of 64x64 GEMMs. Writes a JSON list of {layer, graph, n, nnz, dtype, peer, forward_ms, train_ms,
dtype_used, note}.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_peers import graph_name, read_graph, time_ms  # noqa: E402

TDT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
F, H, D = 64, 8, 8


def sparse_attention(row, col, n, scores, v):
    """out[:, h] = softmax_row(scores[:, h]) @ v[:, h] with torch.sparse (COO softmax, sparse.mm)."""
    idx = torch.stack([row, col])
    outs = []
    for h in range(scores.shape[1]):
        s = torch.sparse_coo_tensor(idx, scores[:, h], (n, n)).coalesce()
        p = torch.sparse.softmax(s, dim=1)
        outs.append(torch.sparse.mm(p, v[:, h]))
    return torch.stack(outs, 1)


class SparseGat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(F, H * D, bias=False)
        self.att_src = torch.nn.Parameter(torch.randn(H, D) * 0.3)
        self.att_dst = torch.nn.Parameter(torch.randn(H, D) * 0.3)
        self.bias = torch.nn.Parameter(torch.zeros(H * D))

    def forward(self, x, row, col, n):
        wh = self.lin(x).view(n, H, D)
        e = (wh * self.att_dst).sum(-1)[row] + (wh * self.att_src).sum(-1)[col]
        e = torch.nn.functional.leaky_relu(e, 0.2)
        return sparse_attention(row, col, n, e, wh).reshape(n, H * D) + self.bias


class SparseAgnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.beta = torch.nn.Parameter(torch.ones(1))

    def forward(self, x, row, col, n):
        xn = torch.nn.functional.normalize(x, p=2.0, dim=-1)
        s = self.beta * (xn[row] * xn[col]).sum(-1, keepdim=True)
        return sparse_attention(row, col, n, s, x.view(n, 1, F)).view(n, F)


class SparseTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(F, H * D) for _ in range(4))

    def forward(self, x, row, col, n):
        q, k, v = (m(x).view(n, H, D) for m in (self.q, self.k, self.v))
        s = (q[row] * k[col]).sum(-1) / D ** 0.5
        return self.o(sparse_attention(row, col, n, s, v).reshape(n, H * D))


def pyg_layer(kind):
    from torch_geometric.nn import AGNNConv, GATConv, TransformerConv
    if kind == "gat":
        return GATConv(F, D, heads=H, add_self_loops=False)
    if kind == "agnn":
        return AGNNConv(requires_grad=True, add_self_loops=False)
    return TransformerConv(F, D, heads=H)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="+", help="NAME.csr files from layer_bench --dump-dir")
    ap.add_argument("--dtype", nargs="+", default=["f32", "f16"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    records = []
    for path in args.graphs:
        n, _, offs, cols = read_graph(path)
        offs_t = torch.from_numpy(offs)
        row = torch.repeat_interleave(torch.arange(n), offs_t[1:] - offs_t[:-1]).to(dev)
        col = torch.from_numpy(cols).to(dev)
        # PyG: messages flow source -> target; A's row i lists the nodes i attends to.
        edge_index = torch.stack([col, row])
        name = graph_name(path)
        for dt in args.dtype:
            for layer in ("gat", "agnn", "transformer"):
                for peer in ("pyg", "sparse"):
                    note, used = "", dt
                    tries = [dt, "f32"] if dt != "f32" else ["f32"]
                    fwd_ms = train_ms = None
                    for d in tries:
                        try:
                            if peer == "pyg":
                                m = pyg_layer(layer).to(dev, TDT[d])
                                call = lambda x, m=m: m(x, edge_index)
                            else:
                                m = {"gat": SparseGat, "agnn": SparseAgnn, "transformer": SparseTransformer}[layer]()
                                m = m.to(dev, TDT[d])
                                call = lambda x, m=m: m(x, row, col, n)
                            x = torch.randn(n, F, device=dev, dtype=TDT[d], requires_grad=True)
                            r = torch.randn(n, H * D if layer != "agnn" else F, device=dev, dtype=TDT[d])

                            def fwd():
                                with torch.no_grad():
                                    call(x)

                            def step():
                                (call(x) * r).sum().backward()

                            fwd_ms = time_ms(fwd, args.warmup, args.reps)
                            train_ms = time_ms(step, args.warmup, args.reps)
                            used = d
                            break
                        except Exception as e:  # a missing half kernel: retry in f32
                            note = f"{d}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                            torch.cuda.synchronize()
                    rec = dict(layer=layer, graph=name, n=n, nnz=int(len(cols)), dtype=dt,
                               peer=f"{peer}_{layer}", forward_ms=fwd_ms, train_ms=train_ms,
                               dtype_used=used, note=note, gpu=torch.cuda.get_device_name(),
                               torch=torch.__version__)
                    print(f"{rec['peer']:<20} {name:<12} {dt:<4} (used {used:<4}) forward {fwd_ms} ms, "
                          f"forward+backward {train_ms} ms {note}", flush=True)
                    records.append(rec)
                    torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
