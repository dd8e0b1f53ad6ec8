#!/usr/bin/env python3
"""One full-graph training epoch (forward, backward, Adam step) of a 2-layer GAT and a 2-layer
graph transformer on ogbn-arxiv, with PyG's layers and with spattn.nn's: CUDA-event timed
(median of --repeat epochs after --warmup), and each one's peak memory. Prints a markdown
table (and writes JSON with --json).

    SPATTN_DATA_DIR=data python crates/python/bench/epoch.py
    python crates/python/bench/epoch.py --graph data/ogbn-arxiv.mtx.gz --dtypes f32,bf16

Setup (the same for both libraries): the graph is symmetrized (no self loops; GATConv adds
them itself, each forward in PyG, once and cached in spattn), node features are random
(N(0, 1), --features wide) and labels random (--classes); the loss is cross-entropy over
every node; Adam (lr 0.01). Both models start from the same parameters (spattn.nn layers
load PyG's state dict), and the first forward's outputs are compared to make sure both
compute the same function.

Peak memory: ``torch.cuda.max_memory_allocated()`` over one epoch (which includes the
parameters, optimizer state, features and edge_index resident before it), plus, for spattn,
the peak of its own device memory pool over the same epoch (graph uploads and plan
workspaces, which PyTorch's allocator does not see: ``spattn.memory_stats()``). The total is
an upper bound of what spattn held at once.

``--policy once`` fixes the graphs' plan policy (``spattn.Graph.policy``) so that a graph seen
again keeps its row order: against the default (``auto``: switched to ``reuse`` at the second
epoch) it measures what the row order buys.

Where an epoch's time goes: ``--profile N`` profiles N more epochs of each case with
torch.profiler and prints (and keeps in the JSON) the top kernels and host operators per epoch:

    python crates/python/bench/epoch.py --models gat_dropout --dtypes f16 --impls spattn --profile 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def find_graph(path_arg):
    if path_arg:
        return Path(path_arg)
    here = Path(__file__).resolve()
    candidates = []
    if os.environ.get("SPATTN_DATA_DIR"):
        candidates.append(Path(os.environ["SPATTN_DATA_DIR"]) / "ogbn-arxiv.mtx.gz")
    candidates += [
        Path("data/ogbn-arxiv.mtx.gz"),
        here.parents[3] / "data" / "ogbn-arxiv.mtx.gz",
        here.parents[4] / "shared" / "data" / "mtx" / "ogbn-arxiv.mtx.gz",
    ]
    for c in candidates:
        if c.is_file():
            return c
    sys.exit("ogbn-arxiv.mtx.gz not found: pass --graph or set SPATTN_DATA_DIR")


class TwoLayer(torch.nn.Module):
    """conv1 -> activation -> conv2, PyG's usual 2-layer node classifier (edge features, where
    given, go to both layers)."""

    def __init__(self, conv1, conv2, act):
        super().__init__()
        self.conv1, self.conv2, self.act = conv1, conv2, act

    def forward(self, x, edge_index, edge_attr=None):
        kw = {} if edge_attr is None else {"edge_attr": edge_attr}
        return self.conv2(self.act(self.conv1(x, edge_index, **kw)), edge_index, **kw)


# The models: gat and transformer as PyG's defaults; gat_dropout with the GAT paper's attention
# dropout (0.6, training mode); transformer_edge with edge features (--edge-dim per edge) and
# attention dropout 0.1, as graph transformers train; gat_edge with edge features in the scores;
# gatv2 as gat with PyG's GATv2Conv.
MODELS = ("gat", "transformer", "gat_dropout", "transformer_edge", "gat_edge", "gatv2")


def build(lib, model, args):
    """The model of `lib` (torch_geometric.nn or spattn.nn)."""
    H, C, Fin, K = args.heads, args.hidden, args.features, args.classes
    if model == "gat":
        return TwoLayer(lib.GATConv(Fin, C, heads=H), lib.GATConv(H * C, K, heads=1), F.elu)
    if model == "gat_dropout":
        return TwoLayer(
            lib.GATConv(Fin, C, heads=H, dropout=0.6),
            lib.GATConv(H * C, K, heads=1, dropout=0.6),
            F.elu,
        )
    if model == "gat_edge":
        E = args.edge_dim
        return TwoLayer(
            lib.GATConv(Fin, C, heads=H, edge_dim=E),
            lib.GATConv(H * C, K, heads=1, edge_dim=E),
            F.elu,
        )
    if model == "gatv2":
        return TwoLayer(lib.GATv2Conv(Fin, C, heads=H), lib.GATv2Conv(H * C, K, heads=1), F.elu)
    if model == "transformer":
        return TwoLayer(
            lib.TransformerConv(Fin, C, heads=H), lib.TransformerConv(H * C, K, heads=1), F.relu
        )
    if model == "transformer_edge":
        E = args.edge_dim
        return TwoLayer(
            lib.TransformerConv(Fin, C, heads=H, edge_dim=E, dropout=0.1),
            lib.TransformerConv(H * C, K, heads=1, edge_dim=E, dropout=0.1),
            F.relu,
        )
    raise ValueError(model)


def time_epochs(step, warmup, repeat, cuda):
    for _ in range(warmup):
        step()
    if not cuda:  # --device cpu: a smoke test of the script, wall-clock timed
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def profile_epochs(step, epochs, cuda, top=14):
    """Where `epochs` epochs' time goes, per epoch: the top device kernels (time, launches) and
    the top host operators (self time), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(epochs):
            step()
        if cuda:
            torch.cuda.synchronize()
    kernels, ops = {}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.device_time_total / epochs
            k[1] += 1 / epochs
        else:
            o = ops.setdefault(e.name, [0.0, 0])
            o[0] += e.self_cpu_time_total / epochs
            o[1] += 1 / epochs
    rank = lambda d: sorted(d.items(), key=lambda kv: -kv[1][0])  # noqa: E731
    return {
        "epochs": epochs,
        "kernel_us": sum(v[0] for v in kernels.values()),
        "kernels": [{"name": n, "us": v[0], "calls": v[1]} for n, v in rank(kernels)[:top]],
        "host_us": sum(v[0] for v in ops.values()),
        "host_ops": [{"name": n, "us": v[0], "calls": v[1]} for n, v in rank(ops)[:top]],
    }


def print_profile(r):
    p = r["profile"]
    print(f"\n## {r['model']} {r['dtype']} {r['impl']}: per epoch, {p['kernel_us'] / 1e3:.3f} ms of "
          f"kernels, {p['host_us'] / 1e3:.3f} ms of host operators' self time (profiled)")
    for title, rows in (("kernels", p["kernels"]), ("host operators", p["host_ops"])):
        print(f"  {title}:")
        for k in rows:
            print(f"    {k['us']:9.1f} us  x{k['calls']:5.1f}  {k['name'][:100]}")


def run_case(impl, model, dtype, edge_index, x, y, state, args, spattn, edge_attr=None):
    # "pyg" / "spattn", or either with "-compile": the model under torch.compile (spattn's
    # traced whole, fullgraph=True; PyG's with the graph breaks it needs).
    base, _, mode = impl.partition("-")
    if base == "pyg":
        import torch_geometric.nn as lib
    else:
        lib = spattn.nn
    cuda = x.device.type == "cuda"
    torch.manual_seed(0)
    net = build(lib, model, args).to(x.device)
    net.load_state_dict(state)
    net = net.to(dtype)
    xs = x.to(dtype)
    ei = edge_index
    if base == "spattn" and args.policy != "auto":
        # The layers' graphs (with and without self loops), their plan policy fixed.
        for loops in (False, True):
            spattn.nn.graph_for(ei, x.shape[0], self_loops=loops).policy = args.policy
    ea = edge_attr.to(dtype) if (edge_attr is not None and model.endswith("_edge")) else None
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    call = torch.compile(net, fullgraph=base == "spattn") if mode == "compile" else net

    def step():
        opt.zero_grad(set_to_none=True)
        out = call(xs, ei, ea)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        return loss

    # The first forward in eval mode (no dropout), so that both libraries compute one function.
    net.eval()
    with torch.no_grad():
        first = net(xs, ei, ea).float()
    net.train()
    times = time_epochs(step, args.warmup, args.repeat, cuda)
    # Peak memory of one more epoch, from the resident state between epochs.
    gc.collect()
    resident = peak_torch = pool = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        if base == "spattn":
            spattn.reset_peak_memory_stats(x.device)
    step()
    if cuda:
        torch.cuda.synchronize()
        peak_torch = torch.cuda.max_memory_allocated()
        pool = spattn.memory_stats(x.device)["used_peak"] if base == "spattn" else 0
    result = {
        "impl": impl,
        "model": model,
        "dtype": str(dtype).replace("torch.", ""),
        "status": "ok",
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "times_ms": times,
        "resident_bytes": resident,
        "peak_torch_bytes": peak_torch,
        "peak_spattn_pool_bytes": pool,
        "peak_bytes": peak_torch + pool,
    }
    if args.profile:
        result["profile"] = profile_epochs(step, args.profile, cuda)
    return result, first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", help="ogbn-arxiv.mtx.gz (default: SPATTN_DATA_DIR, data/, ../shared/data/mtx)")
    ap.add_argument("--models", default="gat,transformer", help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--edge-dim", type=int, default=16, help="edge features of transformer_edge")
    ap.add_argument("--dtypes", default="f32,f16,bf16", help="comma list of f32, f16, bf16")
    ap.add_argument("--impls", default="pyg,spattn",
                    help="comma list of pyg, spattn, pyg-compile, spattn-compile (torch.compile)")
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=32, help="channels per head of layer 1")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--classes", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--policy", choices=("auto", "once", "reuse"), default="auto",
                    help="spattn's graphs' plan policy: auto (as the layers find it: a graph seen "
                         "again after a backward switches to reuse) or fixed once / reuse")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test of the script)")
    ap.add_argument("--profile", type=int, default=0, metavar="EPOCHS",
                    help="also profile this many epochs of each case (torch.profiler, after the "
                         "timed ones): the top kernels and host operators per epoch, printed and "
                         "in the JSON")
    args = ap.parse_args()

    import spattn

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --device cpu for a smoke test)")
    path = find_graph(args.graph)
    t0 = time.perf_counter()
    graph = spattn.Graph.read_matrix_market(path, symmetrize=True)
    edge_index = graph.edge_index().to(device)
    load_s = time.perf_counter() - t0
    n = graph.num_nodes
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, args.features, generator=gen).to(device)
    y = torch.randint(0, args.classes, (n,), generator=gen).to(device)
    edge_attr = torch.randn(edge_index.shape[1], args.edge_dim, generator=gen).to(device)

    try:
        import torch_geometric

        pyg_version = torch_geometric.__version__
    except ImportError:
        pyg_version = None
        if "pyg" in args.impls:
            print("torch_geometric is not installed: PyG rows are skipped", file=sys.stderr)
            args.impls = ",".join(i for i in args.impls.split(",") if not i.startswith("pyg"))

    gpu = torch.cuda.get_device_properties(device).name if device.type == "cuda" else "cpu"
    header = {
        "gpu": gpu,
        "torch": torch.__version__,
        "torch_geometric": pyg_version,
        "spattn": spattn.__version__,
        "graph": str(path),
        "nodes": n,
        "edges_symmetrized": graph.num_edges,
        "config": vars(args),
    }
    print(f"# Epoch benchmark: {path.name}, {n} nodes, {graph.num_edges} edges (symmetrized), "
          f"read in {load_s:.1f} s")
    print(f"GPU {gpu}; torch {torch.__version__}; torch_geometric {pyg_version}; "
          f"spattn {spattn.__version__}")
    print(f"2 layers: {args.features} -> {args.heads} heads x {args.hidden} -> {args.classes}; "
          f"Adam; median of {args.repeat} epochs after {args.warmup} warm-up\n")

    results = []
    for model in args.models.split(","):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            torch.manual_seed(0)
            if pyg_version is not None:
                import torch_geometric.nn as pyg_nn

                state = build(pyg_nn, model, args).state_dict()
            else:
                state = build(spattn.nn, model, args).state_dict()
            firsts = {}
            for impl in args.impls.split(","):
                try:
                    r, first = run_case(impl, model, dtype, edge_index, x, y, state, args, spattn,
                                        edge_attr)
                    firsts[impl] = first
                except torch.cuda.OutOfMemoryError as e:
                    r = {"impl": impl, "model": model, "dtype": dname, "status": "oom", "reason": str(e)[:200]}
                except Exception as e:  # noqa: BLE001 - record and go on
                    r = {"impl": impl, "model": model, "dtype": dname, "status": "error",
                         "reason": f"{type(e).__name__}: {e}"[:300]}
                results.append(r)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if "pyg" in firsts and "spattn" in firsts:
                a, b = firsts["spattn"], firsts["pyg"]
                diff = ((a - b).norm() / b.norm()).item()
                for r in results[-2:]:
                    r["first_forward_rel_diff"] = diff
    print_table(results)
    for r in results:
        if "profile" in r:
            print_profile(r)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": results}, indent=2))
        print(f"\nwrote {args.json}")


def mib(b):
    return f"{b / 2**20:,.0f}"


def print_table(results):
    print("| model | dtype | library | epoch ms (median) | min–max | peak MiB | of which spattn pool | "
          "speed-up vs PyG | memory vs PyG | first forward vs PyG |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    base = {(r["model"], r["dtype"]): r for r in results if r["impl"] == "pyg" and r["status"] == "ok"}
    for r in results:
        if r["status"] != "ok":
            print(f"| {r['model']} | {r['dtype']} | {r['impl']} | {r['status']} | | | | | | {r.get('reason', '')} |")
            continue
        b = base.get((r["model"], r["dtype"]))
        speed = f"{b['median_ms'] / r['median_ms']:.2f}x" if b and r["impl"] != "pyg" else ""
        mem = (
            f"{b['peak_bytes'] / r['peak_bytes']:.2f}x lower"
            if b and r["impl"] != "pyg" and r["peak_bytes"] > 0
            else ""
        )
        diff = f"{r['first_forward_rel_diff']:.1e}" if "first_forward_rel_diff" in r and r["impl"] != "pyg" else ""
        print(
            f"| {r['model']} | {r['dtype']} | {r['impl']} | {r['median_ms']:.2f} | "
            f"{r['min_ms']:.2f}–{r['max_ms']:.2f} | {mib(r['peak_bytes'])} | "
            f"{mib(r['peak_spattn_pool_bytes']) if r['impl'] == 'spattn' else ''} | {speed} | {mem} | {diff} |"
        )


if __name__ == "__main__":
    main()
