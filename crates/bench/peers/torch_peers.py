#!/usr/bin/env python3
"""Peers of spattn, timed on the same GPU in the same run: torch.sparse (cuSPARSE), PyG, dense SDPA.

For one graph (a MatrixMarket file, or the binary CSR that `spattn-bench --dump-csr` writes) and
each (heads, head_dim, dtype) asked for, times with CUDA events (warm-up, median of --reps runs):

  cusparse_sddmm      torch.sparse.sampled_addmm(A, Q_h, K_hᵀ) per head (cuSPARSE SDDMM)
  cusparse_spmm       torch.sparse.mm(P_h, V_h) per head on CSR (cuSPARSE SpMM)
  torch_sparse_attention  sampled_addmm -> row softmax (segment max/sum) -> sparse.mm: the unfused
                      pipeline of DGL's sparse graph transformer
  pyg_attention       gathers, torch_geometric.utils.softmax, scatter-add (TransformerConv)
  dense_sdpa          scaled_dot_product_attention with a boolean mask (n <= --dense-max-n)
  torch_sparse_train  a training step of torch_sparse_attention: forward, then out.backward(dOut)
                      through torch autograd (sampled_addmm, segment softmax, sparse.mm; grads of
                      Q, K, V), per-head loop; falls back to f32 where the dtype has no kernel
  pyg_train           a training step of pyg_attention (gathers, softmax, scatter-add) through
                      autograd: the fallback composition that differentiates in every dtype
                      (the two *_train peers run only when --ops names them)

cuSPARSE's SDDMM and SpMM take f32 only for CSR on many versions: when the asked dtype fails,
the op is timed in f32 and the record says so ("dtype_used"). Writes a JSON list of records:

  {graph, n, n_cols, nnz, symmetrized, heads, head_dim, dtype, peer, median_ms, dtype_used, note,
   gpu, torch, cuda, warmup, reps}

`spattn-bench --peers FILE` matches them to its own cases by graph name, heads, head_dim and
dtype (and refuses a record whose nnz differs from its graph's). Graph names are spattn-bench's:
the file name without .mtx.gz / .mtx / .csr (`rmat-16.csr` -> `rmat-16`), or --name. The surest
way to time the same graph: `spattn-bench --graph G --dump-csr G.csr --dump-only` (symmetrized
with self loops as benchmarked), then this script on G.csr without --symmetrize.
"""
import argparse
import gzip
import json
import math
import os
import struct

import numpy as np
import torch


def read_graph(path):
    """Returns (n_rows, n_cols, row_offsets int64 array, col_indices int64 array)."""
    if path.endswith(".csr"):
        with open(path, "rb") as f:
            magic = f.read(8)
            if magic != b"SPCSR001":
                raise SystemExit(f"{path}: not a spattn CSR file")
            n_rows, n_cols, nnz = struct.unpack("<QQQ", f.read(24))
            offs = np.fromfile(f, dtype="<u4", count=n_rows + 1).astype(np.int64)
            cols = np.fromfile(f, dtype="<u4", count=nnz).astype(np.int64)
        return n_rows, n_cols, offs, cols
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        header = f.readline()
        sym = "symmetric" in header
        line = f.readline()
        while line.startswith("%"):
            line = f.readline()
        n_rows, n_cols, nnz = (int(x) for x in line.split())
        data = np.loadtxt(f, dtype=np.int64, usecols=(0, 1), ndmin=2)
    r, c = data[:, 0] - 1, data[:, 1] - 1
    if sym:
        off = r != c
        r, c = np.concatenate([r, c[off]]), np.concatenate([c, r[off]])
    return coo_to_csr(n_rows, n_cols, r, c)


def coo_to_csr(n_rows, n_cols, r, c):
    key = np.unique(r * n_cols + c)
    r, c = key // n_cols, key % n_cols
    offs = np.zeros(n_rows + 1, dtype=np.int64)
    np.add.at(offs, r + 1, 1)
    return n_rows, n_cols, np.cumsum(offs), c


def sym_self_loops(n, offs, cols):
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(offs))
    r = np.concatenate([rows, cols, np.arange(n)])
    c = np.concatenate([cols, rows, np.arange(n)])
    return coo_to_csr(n, n, r, c)[2:]


def graph_name(path):
    """spattn-bench's name of a graph file: its file name without .gz, .mtx, .csr."""
    name = os.path.basename(path)
    for ext in (".gz", ".mtx", ".csr", ".txt"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name


def int_list(values):
    """`--heads 1 8` and `--heads 1,8` alike."""
    return [int(x) for v in values for x in str(v).split(",") if x]


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


TDT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def segment_softmax(x, row, n):
    """Row softmax of per-edge values x (nnz, or nnz x H) grouped by `row`, in f32."""
    x = x.float()
    shape = (n,) + tuple(x.shape[1:])
    m = torch.full(shape, -math.inf, device=x.device).scatter_reduce(
        0, row.view(-1, *([1] * (x.dim() - 1))).expand_as(x), x.detach(), "amax")
    ex = torch.exp(x - m[row])
    den = torch.zeros(shape, device=x.device).index_add(0, row, ex)
    return ex / den[row]


def train_torch_sparse(args, rec, dev, n, n_cols, nnz, crow, col, row, q, k, v, g, heads, d, dtype, scale):
    """Forward + backward of sampled_addmm -> segment softmax -> sparse.mm through autograd."""
    for dt_try in ([dtype, "f32"] if dtype != "f32" else ["f32"]):
        try:
            dt = TDT[dt_try]
            qg, kg, vg = (x.to(dt).requires_grad_() for x in (q, k, v))
            dout = torch.randn(n, heads, d, device=dev, generator=g).to(dt)
            a = torch.sparse_csr_tensor(crow, col, torch.ones(nnz, device=dev, dtype=dt), size=(n, n_cols))

            def step():
                outs = []
                for h in range(heads):
                    s = torch.sparse.sampled_addmm(a, qg[:, h].contiguous(), kg[:, h].t().contiguous(),
                                                   beta=0.0, alpha=scale)
                    pv = segment_softmax(s.values(), row, n).to(dt)
                    ph = torch.sparse_csr_tensor(crow, col, pv, size=(n, n_cols))
                    outs.append(torch.sparse.mm(ph, vg[:, h].contiguous()))
                out = torch.stack(outs, 1)
                qg.grad = kg.grad = vg.grad = None
                out.backward(dout)

            step()
            if qg.grad is None or kg.grad is None or vg.grad is None:
                raise RuntimeError("autograd gave no gradient for Q, K or V")
            rec("torch_sparse_train", heads, d, dtype, time_ms(step, args.warmup, args.reps), dt_try,
                "autograd, per-head loop")
            return
        except (RuntimeError, NotImplementedError) as err:
            print(f"[peers] torch_sparse_train in {dt_try} failed: {str(err).splitlines()[0]}", flush=True)
            torch.cuda.synchronize()


def train_pyg(args, rec, dev, n, row, col, q, k, v, g, heads, d, dtype, scale):
    """Forward + backward of the PyG-style composition (TransformerConv's attention) through autograd."""
    try:
        dt = TDT[dtype]
        qg, kg, vg = (x.to(dt).requires_grad_() for x in (q, k, v))
        dout = torch.randn(n, heads, d, device=dev, generator=g).to(dt)
        try:
            from torch_geometric.utils import softmax as pyg_softmax
            note = "torch_geometric.utils.softmax"
        except ImportError:
            pyg_softmax = None
            note = "scatter softmax (torch_geometric missing)"

        def step():
            alpha = (qg[row] * kg[col]).sum(dim=-1) * scale
            alpha = pyg_softmax(alpha, row, num_nodes=n) if pyg_softmax else segment_softmax(alpha, row, n).to(dt)
            out = torch.zeros(n, heads, d, device=dev, dtype=dt).index_add(0, row, vg[col] * alpha.unsqueeze(-1))
            qg.grad = kg.grad = vg.grad = None
            out.backward(dout)

        step()
        rec("pyg_train", heads, d, dtype, time_ms(step, args.warmup, args.reps), dtype, note)
    except Exception as err:  # noqa: BLE001 - report and go on
        print(f"[peers] pyg_train failed: {err}", flush=True)
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graph")
    ap.add_argument("--name", help="graph name in the records (default: file stem)")
    ap.add_argument("--symmetrize", action="store_true", help="A + Aᵀ + I before timing")
    ap.add_argument("--heads", nargs="+", default=["1"], help="e.g. 1 8, or 1,8")
    ap.add_argument("--head-dim", nargs="+", default=["64"], help="e.g. 64 128, or 64,128")
    ap.add_argument("--dtype", nargs="+", default=["f16"], help="f16, bf16, f32 (or a comma list)")
    ap.add_argument("--seed", type=int, default=0)
    # The training peers are opt-in (--ops torch_sparse_train pyg_train): torch's autograd
    # through sparse.mm materialises a dense n x n gradient and, on R-MAT 16, died with SIGFPE,
    # taking the forward peers' records of that graph with it.
    ap.add_argument("--ops", nargs="+",
                    default=["cusparse_sddmm", "cusparse_spmm", "torch_sparse_attention", "pyg_attention", "dense_sdpa"])
    ap.add_argument("--dense-max-n", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    args.heads = int_list(args.heads)
    args.head_dim = int_list(args.head_dim)
    args.dtype = [x for v in args.dtype for x in v.split(",") if x]
    for dt in args.dtype:
        if dt not in ("f16", "bf16", "f32"):
            ap.error(f"--dtype: {dt!r} is not one of f16, bf16, f32")

    name = args.name or graph_name(args.graph)
    n, n_cols, offs, cols = read_graph(args.graph)
    if args.symmetrize:
        offs, cols = sym_self_loops(n, offs, cols)
    nnz = int(offs[-1])
    dev = torch.device("cuda")
    crow = torch.from_numpy(offs).to(dev)
    col = torch.from_numpy(cols).to(dev)
    row = torch.repeat_interleave(torch.arange(n, device=dev), crow[1:] - crow[:-1])
    print(f"[peers] {name}: n={n} nnz={nnz} on {torch.cuda.get_device_name()}", flush=True)
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
    records = []

    def rec(op, heads, d, dtype, ms, dtype_used, note=""):
        records.append(dict(graph=name, n=n, n_cols=n_cols, nnz=nnz, symmetrized=args.symmetrize,
                            heads=heads, head_dim=d, dtype=dtype, peer=op,
                            median_ms=ms, dtype_used=dtype_used, note=note,
                            gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                            cuda=torch.version.cuda, warmup=args.warmup, reps=args.reps))
        print(f"[peers] {op:24s} H={heads} D={d} {dtype}->{dtype_used}: {ms:.4f} ms {note}", flush=True)

    for dtype in args.dtype:
        for heads in args.heads:
            for d in args.head_dim:
                g = torch.Generator(device=dev).manual_seed(args.seed)
                q = torch.randn(n, heads, d, device=dev, generator=g, dtype=torch.float32)
                k = torch.randn(n, heads, d, device=dev, generator=g, dtype=torch.float32)
                v = torch.randn(n, heads, d, device=dev, generator=g, dtype=torch.float32)
                scale = 1.0 / math.sqrt(d)

                def csr(vals, dt):
                    return torch.sparse_csr_tensor(crow, col, vals.to(dt), size=(n, n_cols))

                # cuSPARSE ops, in the asked dtype where they accept it, else f32.
                for dt_try in ([dtype, "f32"] if dtype != "f32" else ["f32"]):
                    try:
                        dt = tdt[dt_try]
                        qh = [q[:, h].contiguous().to(dt) for h in range(heads)]
                        kth = [k[:, h].t().contiguous().to(dt) for h in range(heads)]
                        vh = [v[:, h].contiguous().to(dt) for h in range(heads)]
                        a = csr(torch.ones(nnz, device=dev), dt)
                        p = [csr(torch.rand(nnz, device=dev, generator=g), dt) for _ in range(heads)]

                        def sddmm():
                            return [torch.sparse.sampled_addmm(a, qh[h], kth[h], beta=0.0, alpha=scale) for h in range(heads)]

                        def spmm():
                            return [torch.sparse.mm(p[h], vh[h]) for h in range(heads)]

                        def attention():
                            outs = []
                            for h in range(heads):
                                s = torch.sparse.sampled_addmm(a, qh[h], kth[h], beta=0.0, alpha=scale)
                                x = s.values().float()
                                m = torch.full((n,), -math.inf, device=dev).scatter_reduce(0, row, x, "amax")
                                ex = torch.exp(x - m[row])
                                den = torch.zeros(n, device=dev).index_add_(0, row, ex)
                                pv = (ex / den[row]).to(dt)
                                ph = torch.sparse_csr_tensor(crow, col, pv, size=(n, n_cols))
                                outs.append(torch.sparse.mm(ph, vh[h]))
                            return outs

                        todo = {"cusparse_sddmm": sddmm, "cusparse_spmm": spmm, "torch_sparse_attention": attention}
                        for op, fn in todo.items():
                            if op in args.ops and not any(r["peer"] == op and r["heads"] == heads and r["head_dim"] == d and r["dtype"] == dtype for r in records):
                                fn()
                                rec(op, heads, d, dtype, time_ms(fn, args.warmup, args.reps), dt_try,
                                    "per-head loop" if heads > 1 else "")
                        break
                    except (RuntimeError, NotImplementedError) as err:
                        print(f"[peers] cuSPARSE in {dt_try} failed: {str(err).splitlines()[0]}", flush=True)
                        torch.cuda.synchronize()

                dt = tdt[dtype]
                qd, kd, vd = q.to(dt), k.to(dt), v.to(dt)
                if "pyg_attention" in args.ops:
                    try:
                        from torch_geometric.utils import softmax as pyg_softmax

                        def pyg():
                            alpha = (qd[row] * kd[col]).sum(dim=-1) * scale  # nnz x H
                            alpha = pyg_softmax(alpha, row, num_nodes=n)
                            out = torch.zeros(n, heads, d, device=dev, dtype=dt)
                            return out.index_add_(0, row, vd[col] * alpha.unsqueeze(-1))

                        pyg()
                        rec("pyg_attention", heads, d, dtype, time_ms(pyg, args.warmup, args.reps), dtype)
                    except Exception as err:  # noqa: BLE001 - report and go on
                        print(f"[peers] pyg failed: {err}", flush=True)
                if "dense_sdpa" in args.ops and n <= args.dense_max_n:
                    try:
                        mask = torch.zeros(n, n_cols, dtype=torch.bool, device=dev)
                        mask[row, col] = True
                        qq, kk, vv = (x.transpose(0, 1).unsqueeze(0) for x in (qd, kd, vd))

                        def sdpa():
                            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)

                        sdpa()
                        rec("dense_sdpa", heads, d, dtype, time_ms(sdpa, args.warmup, args.reps), dtype)
                        del mask
                    except Exception as err:  # noqa: BLE001
                        print(f"[peers] sdpa failed: {err}", flush=True)
                if "torch_sparse_train" in args.ops:
                    train_torch_sparse(args, rec, dev, n, n_cols, nnz, crow, col, row, q, k, v, g, heads, d, dtype, scale)
                if "pyg_train" in args.ops:
                    train_pyg(args, rec, dev, n, row, col, q, k, v, g, heads, d, dtype, scale)
                write_records(args.json, records)
                torch.cuda.empty_cache()

    write_records(args.json, records)
    print(f"[peers] wrote {len(records)} records to {args.json}")


def write_records(path, records):
    """Writes the records so far (also after each configuration, so a crash keeps them)."""
    out_dir = os.path.dirname(path)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1, allow_nan=False)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
