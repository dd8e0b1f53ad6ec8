#!/usr/bin/env python3
"""Mini-batch training steps with a new graph every step, spattn.nn against PyG in the same run.

A step is forward + backward + Adam on one batch, timed by wall clock around a synchronized
step (planning is host and device work that CUDA events would not see): median of --repeat
steps after --warmup, every step on a graph never seen before (spattn plans each one; the
"reused" column runs every step on the first batch's graph, planned once). Prints markdown
tables (and writes JSON with --json).

    SPATTN_DATA_DIR=data python crates/python/bench/minibatch.py
    python crates/python/bench/minibatch.py --workloads molecules --dtypes f16 --models gat

Workloads (generated on the GPU with torch ops before timing; seeded):
- ``arxiv-sub20``: the subgraph induced by a random 20% of ogbn-arxiv's nodes (symmetrized),
  relabelled (~34k nodes, ~92k edges);
- ``arxiv-ns``: neighbour sampling from 1,024 random seeds of ogbn-arxiv, fan-out [15, 10],
  each hop drawing neighbours uniformly with replacement and merging repeats (PyG's
  NeighborLoader draws without replacement; pyg-lib is not on the GPU machine), edges from the
  sampled neighbour to the node that drew it, relabelled;
- ``molecules``: 128 random molecules of 15–40 atoms (a chain plus ~15% ring-closing bonds,
  both directions), batched block-diagonally as PyG's ``Batch``.

Models: 2-layer ``GATConv`` / ``TransformerConv`` node classifiers (--features → --heads ×
--hidden → --classes), and both with --edge-dim random edge features (``gat_edge``,
``transformer_edge``: the latter with attention dropout 0.1, as epoch.py's). spattn.nn layers
load PyG's state dict; the first step's outputs (eval mode) are compared.

Each implementation runs in a process of its own, for the tables and --phases (the parent
merges their JSON and compares their first forwards): run in one process after PyG's case,
spattn's TransformerConv step with edge features took 6.3–6.8 ms where alone it took 8.7–10.2
(NVIDIA H200, the 2¹⁶-row pad bound), so an earlier library's cases leave state that later ones
gain from and that emptying cuBLASLt's heuristic cache does not clear (the cache itself does
empty: a GEMM's shape seen before chooses its kernel again after it, ~0.17 ms). `--one-process`
runs them in one process; so must a wrapper that changes settings in its own process before
running this script (the children start this script afresh, without it).

cuBLAS's kernel choices (--gemm-cache): a half-precision GEMM of a row count cuBLAS has not
seen in the process costs ~0.1 ms of host time to choose its kernel (up to ~1 ms under load),
so a step's time depends on which batch sizes came before. `cold` (the default) empties that
cache before each case, as at the start of a training run: each new row count pays once, in
every implementation alike. `warm` runs each case's steps once untimed first: every batch size
has come once before, as later in a run where sizes recur. (spattn.nn pads its half-precision
maps' rows to a bucketed count for a row count's first 16 maps, so a new batch size mostly
finds its kernels chosen.)

Plan time (apart, per workload): the graph built on the GPU from the CUDA ``edge_index``
(``spattn.Graph.from_edge_index``, with self loops and the backward's transpose: what a GAT
step plans), wall clock and the GPU span by CUDA events on the current stream; fused-tc's
plan on it (BSB built on the GPU, f16, --heads × --hidden); and for reference the host path
(the same edges through the CPU, as before plans were built on the GPU).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from epoch import DTYPES, build, find_graph  # noqa: E402

WORKLOADS = ("arxiv-sub20", "arxiv-ns", "molecules")
# The results' dtype names, back to --dtypes's.
DTYPE_NAMES = {str(v).replace("torch.", ""): k for k, v in DTYPES.items()}
MODELS = ("gat", "transformer", "gat_edge", "transformer_edge")


# ---- workloads ---------------------------------------------------------------------------------


def induced_subgraph(edge_index, n, frac, gen):
    """The subgraph induced by a random `frac` of the `n` nodes, relabelled 0..k."""
    dev = edge_index.device
    k = max(1, int(n * frac))
    nodes = torch.randperm(n, device=dev, generator=gen)[:k]
    keep = torch.zeros(n, dtype=torch.bool, device=dev)
    keep[nodes] = True
    mask = keep[edge_index[0]] & keep[edge_index[1]]
    relabel = torch.full((n,), -1, dtype=torch.long, device=dev)
    relabel[nodes] = torch.arange(k, device=dev)
    return relabel[edge_index[:, mask]], k


def neighbour_sample(crow, col, n, seeds, fanouts, gen):
    """Nodes and edges reached from `seeds` random nodes by drawing `fanouts[h]` neighbours of
    each frontier node at hop h (with replacement, repeats merged), relabelled."""
    dev = crow.device
    frontier = torch.randperm(n, device=dev, generator=gen)[:seeds]
    reached = [frontier]
    pairs = []
    for k in fanouts:
        start = crow[frontier]
        deg = crow[frontier + 1] - start
        draw = torch.rand(frontier.numel(), k, device=dev, generator=gen)
        off = (draw * deg[:, None]).long()
        valid = (deg > 0)[:, None].expand(-1, k)
        nbr = col[(start[:, None] + off)[valid]]
        dst = frontier[:, None].expand(-1, k)[valid]
        pairs.append(torch.stack([nbr, dst]))
        frontier = torch.unique(nbr)
        reached.append(frontier)
    edges = torch.unique(torch.cat(pairs, dim=1), dim=1)
    nodes = torch.unique(torch.cat(reached))
    relabel = torch.full((n,), -1, dtype=torch.long, device=dev)
    relabel[nodes] = torch.arange(nodes.numel(), device=dev)
    return relabel[edges], nodes.numel()


def molecules(count, lo, hi, gen, device):
    """`count` random molecules of `lo`..`hi` atoms (a chain plus ring-closing bonds, both
    directions), batched block-diagonally."""
    sizes = torch.randint(lo, hi + 1, (count,), generator=gen)
    parts, base = [], 0
    for s in sizes.tolist():
        chain = torch.arange(s - 1)
        bonds = [torch.stack([chain, chain + 1])]
        rings = max(1, int(0.15 * s))
        a = torch.randint(0, s, (rings,), generator=gen)
        b = torch.randint(0, s, (rings,), generator=gen)
        ok = (a - b).abs() > 2
        bonds.append(torch.stack([a[ok], b[ok]]))
        e = torch.cat(bonds, dim=1)
        e = torch.cat([e, e.flip(0)], dim=1) + base
        parts.append(e)
        base += s
    ei = torch.unique(torch.cat(parts, dim=1), dim=1)
    return ei.to(device), base


def make_batches(workload, count, args, device, source):
    gen_cpu = torch.Generator().manual_seed(1)
    gen = torch.Generator(device=device).manual_seed(1)
    out = []
    for _ in range(count):
        if workload == "arxiv-sub20":
            ei, n = induced_subgraph(source["edge_index"], source["n"], 0.2, gen)
        elif workload == "arxiv-ns":
            ei, n = neighbour_sample(source["crow"], source["col"], source["n"], 1024, (15, 10), gen)
        else:
            ei, n = molecules(128, 15, 40, gen_cpu, device)
        x = torch.randn(n, args.features, device=device, generator=gen)
        y = torch.randint(0, args.classes, (n,), device=device, generator=gen)
        ea = torch.randn(ei.shape[1], args.edge_dim, device=device, generator=gen)
        out.append((ei.contiguous(), n, x, y, ea))
    return out


# ---- timing ------------------------------------------------------------------------------------


def wall_ms(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3, r


def fresh(batch):
    """The batch with a copy of its edge_index (made before the timed step), freed after it as a
    loader's is: what a layer caches for that tensor goes with it, as in a training loop (the
    pre-generated batches themselves stay alive for the next implementation)."""
    return (batch[0].clone(),) + tuple(batch[1:])


def trainer(net, dtype, edge):
    """The training step of `net` in `dtype` (with Adam): forward, cross-entropy, backward and
    Adam on a batch; where `stamps` is given, the host's clock is appended to it after the
    forward (and loss), the backward and Adam."""
    opt = torch.optim.Adam(net.parameters(), lr=0.01)

    def step(b, stamps=None):
        ei, _, x, y, ea = b
        opt.zero_grad(set_to_none=True)
        out = net(x.to(dtype), ei, ea.to(dtype) if edge else None)
        loss = F.cross_entropy(out.float(), y)
        if stamps is not None:
            stamps.append(time.perf_counter())
        loss.backward()
        if stamps is not None:
            stamps.append(time.perf_counter())
        opt.step()
        if stamps is not None:
            stamps.append(time.perf_counter())

    return step


_CUBLAS_LT = []


def reset_gemm_choices():
    """Empties cuBLASLt's heuristic cache, which cuBLAS's GEMMs share: the next GEMM of each
    shape chooses its kernel again (~0.1 ms of host time in half precision), as in a new
    process."""
    if not _CUBLAS_LT:
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # loads cuBLAS
        with open("/proc/self/maps") as maps:
            # Fields: address, perms, offset, device, inode, then the mapped file's path.
            paths = [f[5].strip() for f in (ln.split(None, 5) for ln in maps)
                     if len(f) == 6 and "libcublasLt.so" in f[5] and not f[5].strip().endswith("(deleted)")]
        if not paths:
            raise RuntimeError("--gemm-cache cold: libcublasLt is not loaded in this process")
        _CUBLAS_LT.append(ctypes.CDLL(paths[0]))
    lt, cap = _CUBLAS_LT[0], ctypes.c_size_t()
    calls = (lambda: lt.cublasLtHeuristicsCacheGetCapacity(ctypes.byref(cap)),
             lambda: lt.cublasLtHeuristicsCacheSetCapacity(ctypes.c_size_t(0)),
             lambda: lt.cublasLtHeuristicsCacheSetCapacity(cap))
    for call in calls:  # each checked before the next: a failed read must not set 0
        status = call()
        if status != 0:
            raise RuntimeError(f"cublasLt heuristics cache call failed (status {status})")


def prepare_gemms(step, batches, args):
    """What the case's GEMMs find in cuBLAS's heuristic cache (--gemm-cache): `cold` empties it,
    as at the start of a training run (each new row count then chooses its kernels once);
    `warm` runs every step once untimed, each batch size then seen once before; `shared` leaves
    what the previous cases left. `cold` and `warm` also start spattn.nn's count of row counts
    (which switches a count seen 16 times from padded to exact maps) afresh, as a new process."""
    if args.gemm_cache != "shared":
        import spattn.nn

        spattn.nn._ROW_COUNTS.clear()
    if args.gemm_cache == "cold":
        reset_gemm_choices()
    elif args.gemm_cache == "warm":
        for b in batches:
            step(fresh(b))
        torch.cuda.synchronize()


def with_algorithm(net, spattn, algorithm):
    """`net` with its attention layers on spattn's `algorithm` (--algorithm; GAT's layers have
    one, auto)."""
    for m in net.modules():
        if isinstance(m, spattn.nn.TransformerConv):
            m.algorithm = algorithm
    return net


def run_case(impl, model, dtype, batches, state, args, spattn, reuse, profiler=None):
    if impl == "pyg":
        import torch_geometric.nn as lib
    else:
        lib = spattn.nn
        spattn.nn.clear_graph_cache()  # every case plans its graphs itself
    device = batches[0][2].device
    net = build(lib, model, args).to(device)
    net.load_state_dict(state)
    net = net.to(dtype)
    if impl != "pyg":
        with_algorithm(net, spattn, args.algorithm)
    edge = model.endswith("_edge")
    step = trainer(net, dtype, edge)
    net.eval()
    with torch.no_grad():
        b = batches[0]
        first = net(b[2].to(dtype), b[0], b[4].to(dtype) if edge else None).float()
    net.train()
    prepare_gemms(step, [batches[0]] if reuse else batches, args)
    times = []
    for i in range(len(batches)):
        b = batches[0] if reuse else fresh(batches[i])
        if profiler is not None and i >= args.warmup:
            profiler.enable()
        ms, _ = wall_ms(lambda: step(b))
        if profiler is not None:
            profiler.disable()
        times.append(ms)
    timed = times[args.warmup:]
    return {
        "impl": impl + ("-reused" if reuse else ""),
        "model": model,
        "dtype": str(dtype).replace("torch.", ""),
        "status": "ok",
        "median_ms": statistics.median(timed),
        "min_ms": min(timed),
        "max_ms": max(timed),
        "times_ms": times,
    }, first


def plan_times(batches, args, spattn):
    """Per batch: the GPU build (wall, and the GPU span by events), fused-tc's plan on it, and
    the host build of the same edges."""
    rows = []
    for ei, n, *_ in batches:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        start.record()
        g = spattn.Graph.from_edge_index(ei, num_nodes=n, self_loops=True)
        end.record()
        torch.cuda.synchronize()
        build_ms = (time.perf_counter() - t) * 1e3
        gpu_ms = start.elapsed_time(end)
        tc_ms, _ = wall_ms(lambda: g.plan(args.heads, args.hidden, dtype="float16"))
        host_ms, _ = wall_ms(
            lambda: spattn.Graph.from_edge_index(ei.cpu(), num_nodes=n, self_loops=True).plan(
                args.heads, args.hidden, dtype="float16", device=ei.device
            )
        )
        rows.append({"nodes": n, "edges": g.num_edges, "build_ms": build_ms, "build_gpu_ms": gpu_ms,
                     "fused_tc_plan_ms": tc_ms, "host_build_and_plan_ms": host_ms})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", help="ogbn-arxiv.mtx.gz (default: SPATTN_DATA_DIR, data/, ../shared/data/mtx)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="f32,f16,bf16")
    ap.add_argument("--impls", help="pyg,spattn,spattn-reused (default); with --phases: pyg,spattn,floor (default)")
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--classes", type=int, default=40)
    ap.add_argument("--edge-dim", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=12)
    ap.add_argument("--algorithm", default="auto",
                    help="spattn's algorithm for the transformer layers (auto, fused-csr, fused-tc, ...)")
    ap.add_argument("--gemm-cache", choices=("cold", "warm", "shared"), default="cold",
                    help="cuBLAS's kernel choices at each case's start: cold (emptied: a new "
                         "training run), warm (every step run once first: each batch size seen "
                         "once before), shared (left from the same implementation's previous "
                         "cases)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--one-process", action="store_true",
                    help="run every implementation in this process (by default each runs in a "
                         "process of its own: an earlier library's cases leave state to later ones)")
    ap.add_argument("--firsts", help=argparse.SUPPRESS)  # where a child saves its first forwards
    ap.add_argument("--plan-probe", metavar="WORKLOAD",
                    help="instead of the tables: where a graph build's wall time goes (the native "
                         "call alone, without positions, without the transpose)")
    ap.add_argument("--call-probe", metavar="WORKLOAD",
                    help="instead of the tables: the host time of one call on a planned graph "
                         "(attention forward and backward; GAT forward and backward, natively and under "
                         "autograd), enqueue only")
    ap.add_argument("--profile", metavar="WORKLOAD:MODEL:DTYPE",
                    help="instead of the tables: cProfile of spattn's new-graph steps of one case "
                         "(where the host time of a step goes)")
    ap.add_argument("--phases", action="store_true",
                    help="instead of the tables: each new-graph step's host time by phase (forward, "
                         "backward, Adam), the wait for the GPU after it, and its GPU time and "
                         "kernel count, PyG and spattn (needs PyG)")
    args = ap.parse_args()
    if args.impls is None:
        args.impls = "pyg,spattn,floor" if args.phases else "pyg,spattn,spattn-reused"
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import spattn

    device = torch.device("cuda")
    try:
        import torch_geometric

        pyg_version = torch_geometric.__version__
    except ImportError:
        pyg_version = None
        args.impls = ",".join(i for i in args.impls.split(",") if i != "pyg")
    workloads = args.workloads.split(",")
    header = {"torch": torch.__version__, "torch_geometric": pyg_version,
              "spattn": spattn.__version__, "config": dict(vars(args))}

    def title(gpu):
        header["gpu"] = gpu
        print(f"# Mini-batch steps, a new graph every step; GPU {gpu}; torch {torch.__version__}; "
              f"torch_geometric {pyg_version}; spattn {spattn.__version__}")
        print(f"2 layers: {args.features} -> {args.heads} heads x {args.hidden} -> {args.classes}; "
              f"Adam; median of {args.repeat} steps after {args.warmup}, wall clock\n")

    impls = args.impls.split(",")
    probe = args.profile or args.plan_probe or args.call_probe
    if not probe and not args.one_process and len(impls) > 1:
        # The parent leaves the GPU to its children: the GPU's name comes from their headers.
        children = isolated(impls, args)
        title(children[0][1]["header"]["gpu"])
        header["config"]["isolated"] = impls
        if args.phases:
            rows = merge_phases(children, args)
            for rec in rows:
                print_phase(rec)
            out = {"header": header, "phases": rows}
        else:
            results, plans = merge_children(children, DTYPE_NAMES)
            if "arxiv-full" in plans:
                print_plan("arxiv-full", plans["arxiv-full"])
            for w in workloads:
                rows = [r for r in results if r["workload"] == w]
                print_tables(w, rows, plans[w], rows[0]["mean_nodes"], rows[0]["mean_edges"])
            out = {"header": header, "results": results, "plans": plans}
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
            print(f"\nwrote {args.json}")
        return
    title(torch.cuda.get_device_properties(device).name)
    if args.gemm_cache == "cold":
        reset_gemm_choices()  # fails here, not in every case, where it cannot
    source = {}
    if any(w.startswith("arxiv") for w in workloads):
        arxiv = spattn.Graph.read_matrix_market(find_graph(args.graph), symmetrize=True)
        source = {
            "n": arxiv.num_nodes,
            "edge_index": arxiv.edge_index().to(device),
            "crow": torch.from_numpy(arxiv.crow()).to(device),
            "col": torch.from_numpy(arxiv.col()).to(device),
        }
    if args.profile:
        profile(args, spattn, source, device)
        return
    if args.phases:
        rows = phases(args, spattn, source, device)
        if args.json:
            Path(args.json).write_text(json.dumps({"header": header, "phases": rows}, indent=1))
        return
    if args.plan_probe:
        plan_probe(args, spattn, source, device)
        return
    if args.call_probe:
        call_probe(args, spattn, source, device)
        return
    results, plans, saved = [], {}, {}
    if source:
        # The whole of ogbn-arxiv built on the GPU (symmetrized, with self loops and the
        # transpose), for the per-edge cost past mini-batch sizes.
        full = [(source["edge_index"], source["n"], None, None, None)] * 3
        plans["arxiv-full"] = plan_times(full, args, spattn)
        print_plan("arxiv-full", plans["arxiv-full"])
    for w in workloads:
        batches = make_batches(w, args.warmup + args.repeat, args, device, source)
        sizes = [(b[1], b[0].shape[1]) for b in batches]
        mean_n = statistics.mean(s[0] for s in sizes)
        mean_e = statistics.mean(s[1] for s in sizes)
        plans[w] = plan_times(batches[args.warmup:], args, spattn)
        for model in args.models.split(","):
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                torch.manual_seed(0)
                lib0 = spattn.nn if pyg_version is None else __import__("torch_geometric.nn").nn
                state = build(lib0, model, args).state_dict()
                firsts = {}
                for impl in args.impls.split(","):
                    base, reuse = impl.split("-")[0], impl.endswith("-reused")
                    try:
                        r, first = run_case(base, model, dtype, batches, state, args, spattn, reuse)
                        firsts[impl] = first
                    except Exception as e:  # noqa: BLE001 - record and go on
                        r = {"impl": impl, "model": model, "dtype": dname, "status": "error",
                             "reason": f"{type(e).__name__}: {e}"[:300]}
                    r.update({"workload": w, "mean_nodes": mean_n, "mean_edges": mean_e})
                    results.append(r)
                    gc.collect()
                if "pyg" in firsts and "spattn" in firsts:
                    diff = first_diff(firsts["spattn"], firsts["pyg"])
                    for r in results[-len(args.impls.split(",")):]:
                        r["first_forward_rel_diff_vs_pyg"] = diff
                if args.firsts:  # a child's one implementation, for the parent to compare
                    for impl in ("pyg", "spattn"):
                        if impl in firsts:
                            saved[case_key(w, model, dname)] = firsts[impl].cpu()
        print_tables(w, [r for r in results if r["workload"] == w], plans[w], mean_n, mean_e)
    if args.firsts:
        torch.save(saved, args.firsts)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": results, "plans": plans}, indent=1))
        print(f"\nwrote {args.json}")


def first_diff(a, b):
    """Relative difference of a first forward `a` from PyG's `b`."""
    return ((a - b).norm() / b.norm()).item()


def case_key(workload, model, dname):
    """A case's key in a child's saved first forwards."""
    return f"{workload}:{model}:{dname}"


def child_argv(argv, impl, json_path, firsts_path):
    """This run's arguments for a child that runs `impl` alone in its own process: --impls,
    --json and --one-process replaced (in both `--opt value` and `--opt=value` forms)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--impls", "--json", "--firsts"):
            skip = "=" not in a
            continue
        if name != "--one-process":
            out.append(a)
    return out + ["--impls", impl, "--json", str(json_path), "--firsts", str(firsts_path),
                  "--one-process"]


def merge_children(children, dtypes):
    """One run's results and plans from its children's `(impl, json, firsts)`, in order: their
    rows with the first forward's difference from PyG's where both saved theirs (the plans are
    the first child's: each child times the same builds). `dtypes` maps the runs' dtype names to
    the `--dtypes` names the children keyed their first forwards by."""
    results, plans = [], {}
    firsts = {impl: saved for impl, _, saved in children}
    for _, data, _ in children:
        results.extend(data["results"])
        for w, rows in data["plans"].items():
            plans.setdefault(w, rows)
    pyg, ours = firsts.get("pyg", {}), firsts.get("spattn", {})
    for r in results:
        key = case_key(r["workload"], r["model"], dtypes.get(r["dtype"], r["dtype"]))
        if key in pyg and key in ours:
            r["first_forward_rel_diff_vs_pyg"] = first_diff(ours[key].float(), pyg[key].float())
    return results, plans


def isolated(impls, args):
    """Runs each implementation of `impls` alone in a child process of this script, in order
    (each with the same batches: they are seeded); returns each child's `(impl, json, saved first
    forwards)`."""
    children = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, impl in enumerate(impls):
            out, saved = Path(tmp) / f"{i}.json", Path(tmp) / f"{i}.pt"
            cmd = [sys.executable, str(Path(__file__).resolve()),
                   *child_argv(sys.argv[1:], impl, out, saved)]
            print(f"{impl}: in a process of its own", file=sys.stderr, flush=True)
            run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if run.returncode != 0:
                sys.stdout.write(run.stdout)
                sys.exit(f"{impl}'s process failed (exit status {run.returncode})")
            children.append((impl, json.loads(out.read_text()),
                             torch.load(saved) if saved.exists() else {}))
    return children


def merge_phases(children, args):
    """The children's --phases records of one run, in the order one process would print them
    (workload, model, dtype, then --impls)."""
    order = [args.workloads.split(","), args.models.split(","), args.dtypes.split(","),
             args.impls.split(",")]
    rows = [rec for _, data, _ in children for rec in data["phases"]]
    return sorted(rows, key=lambda r: tuple(o.index(r[k]) for o, k in
                                            zip(order, ("workload", "model", "dtype", "impl"))))


def print_phase(rec):
    """One --phases record as a line."""
    med = rec["median_ms"]
    print(f"{rec['workload']} {rec['model']} {rec['dtype']} {rec['impl']}: wall {med['wall']:.2f} "
          f"ms = forward {med['forward']:.2f} + backward {med['backward']:.2f} + adam "
          f"{med['adam']:.2f} (host) + GPU tail {med['gpu_tail']:.2f}; GPU "
          f"{rec['gpu_ms']:.2f} ms in {rec['kernels']:.0f} kernels and "
          f"{rec['memops']:.0f} copies/sets; host: {rec['aten_ops']:.0f} aten ops, "
          f"{rec['launch_calls']:.0f} launch calls", flush=True)


def profile(args, spattn, source, device):
    """cProfile of --repeat new-graph steps of spattn (after --warmup), sorted by own time, then
    by cumulative time."""
    import cProfile
    import pstats

    w, model, dname = args.profile.split(":")
    batches = make_batches(w, args.warmup + args.repeat, args, device, source)
    torch.manual_seed(0)
    state = build(spattn.nn, model, args).state_dict()
    prof = cProfile.Profile()
    r, _ = run_case("spattn", model, DTYPES[dname], batches, state, args, spattn, False, prof)
    print(f"{args.profile}: median step {r['median_ms']:.2f} ms (wall, profiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


class _FloorLayer(torch.nn.Module):
    """A layer's dense work without attention, for the floor of a step's host time: GAT's
    projection (heads concatenated or averaged, bias), or TransformerConv's four (the query,
    key and value projections summed, plus the skip), no graph: plain maps over the exact rows,
    which an eager layer with such maps (PyG's) runs at least. spattn's half-precision maps are
    padded and TransformerConv's batched into one GEMM, which can cost less from an emptied
    cuBLAS cache."""

    def __init__(self, model, fin, c, heads, concat=True):
        super().__init__()
        self.transformer = model.startswith("transformer")
        self.heads, self.c, self.concat = heads, c, concat
        if self.transformer:
            self.q, self.k, self.v = (torch.nn.Linear(fin, heads * c) for _ in range(3))
            self.skip = torch.nn.Linear(fin, heads * c)
        else:
            self.lin = torch.nn.Linear(fin, heads * c, bias=False)
            self.bias = torch.nn.Parameter(torch.zeros(heads * c if concat else c))

    def forward(self, x, edge_index, edge_attr=None):
        if self.transformer:
            return self.q(x) + self.k(x) + self.v(x) + self.skip(x)
        h = self.lin(x).view(-1, self.heads, self.c)
        out = h.reshape(h.shape[0], -1) if self.concat else h.mean(dim=1)
        return out + self.bias


def floor_model(model, args):
    """The 2-layer model of `model` with its attention left out (see _FloorLayer)."""
    from epoch import TwoLayer

    act = F.relu if model.startswith("transformer") else F.elu
    return TwoLayer(_FloorLayer(model, args.features, args.hidden, args.heads),
                    _FloorLayer(model, args.heads * args.hidden, args.classes, 1), act)


def phases(args, spattn, source, device):
    """Where a new-graph step's wall time goes, PyG and spattn alike (and "floor": the same
    model's dense layers without attention, what layers with plain maps run at least): per step
    the host time to enqueue the forward (for spattn, the graph's build and its one read-back
    included), the backward and Adam, then the wait for the GPU after the last (no
    synchronisation between them: what a training loop does); then, in steps of their own under
    torch.profiler, the GPU time of the step's kernels and memory operations and how many there
    are. Medians over --repeat new-graph steps after --warmup."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = []
    for w in args.workloads.split(","):
        batches = make_batches(w, args.warmup + args.repeat, args, device, source)
        for model in args.models.split(","):
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                torch.manual_seed(0)
                lib0 = __import__("torch_geometric.nn").nn
                state = build(lib0, model, args).state_dict()
                for impl in args.impls.split(","):
                    if impl == "floor":
                        torch.manual_seed(0)
                        net = floor_model(model, args).to(device)
                    else:
                        lib = lib0 if impl == "pyg" else spattn.nn
                        spattn.nn.clear_graph_cache()
                        net = build(lib, model, args).to(device)
                        net.load_state_dict(state)
                        if impl != "pyg":
                            with_algorithm(net, spattn, args.algorithm)
                    step = trainer(net.to(dtype), dtype, model.endswith("_edge"))
                    prepare_gemms(step, batches, args)
                    rows = []
                    for i, b in enumerate(batches):
                        b = fresh(b)
                        torch.cuda.synchronize()
                        stamps = [time.perf_counter()]
                        step(b, stamps)
                        torch.cuda.synchronize()
                        stamps.append(time.perf_counter())
                        if i >= args.warmup:
                            d = [(b_ - a_) * 1e3 for a_, b_ in zip(stamps, stamps[1:])]
                            rows.append({"forward": d[0], "backward": d[1], "adam": d[2],
                                         "gpu_tail": d[3], "wall": sum(d)})
                    gpu, kernels, memops, aten, launches = [], [], [], [], []
                    cuda_dev = torch.autograd.DeviceType.CUDA
                    for b in batches[args.warmup:]:
                        b = fresh(b)
                        torch.cuda.synchronize()
                        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            step(b)
                            torch.cuda.synchronize()
                        events = prof.events()
                        ev = [e for e in events if e.device_type == cuda_dev]
                        gpu.append(sum(e.device_time_total for e in ev) / 1e3)
                        kernels.append(sum(1 for e in ev if not e.name.startswith("Memcpy")
                                           and not e.name.startswith("Memset")))
                        memops.append(len(ev) - kernels[-1])
                        host = [e for e in events if e.device_type != cuda_dev]
                        aten.append(sum(1 for e in host if e.name.startswith("aten::")))
                        launches.append(sum(1 for e in host if "LaunchKernel" in e.name))
                    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                    rec = {"workload": w, "model": model, "dtype": dname, "impl": impl,
                           "median_ms": med, "gpu_ms": statistics.median(gpu),
                           "kernels": statistics.median(kernels), "memops": statistics.median(memops),
                           "aten_ops": statistics.median(aten), "launch_calls": statistics.median(launches),
                           "steps": rows}
                    out.append(rec)
                    print_phase(rec)
                    del net, step
                    gc.collect()
    return out


def plan_probe(args, spattn, source, device):
    """Medians over --repeat graphs of the build through Graph.from_edge_index and through the
    native call alone in three variants."""
    from spattn import _native

    batches = make_batches(args.plan_probe, args.warmup + args.repeat, args, device, source)
    stream = torch.cuda.current_stream(device).cuda_stream
    idx = device.index if device.index is not None else torch.cuda.current_device()

    def native(ei, n, positions, transpose):
        return _native.GraphCore.from_device_edges(
            idx, "int64", ei[0].data_ptr(), ei.stride(1), ei[1].data_ptr(), ei.stride(1),
            ei.shape[1], n, False, True, transpose,
            positions.data_ptr() if positions is not None else 0, stream)

    cases = {
        "Graph.from_edge_index": lambda ei, n, pos: spattn.Graph.from_edge_index(ei, num_nodes=n, self_loops=True),
        "native, positions, transpose": lambda ei, n, pos: native(ei, n, pos, True),
        "native, transpose": lambda ei, n, pos: native(ei, n, None, True),
        "native": lambda ei, n, pos: native(ei, n, None, False),
    }
    for name, fn in cases.items():
        times = []
        for ei, n, *_ in batches:
            pos = torch.empty(ei.shape[1] + n, dtype=torch.int64, device=device)
            ms, g = wall_ms(lambda: fn(ei, n, pos))
            times.append(ms)
            del g
        print(f"{name}: median {statistics.median(times[args.warmup:]):.3f} ms")


def call_probe(args, spattn, source, device):
    """Host microseconds per native call on a planned graph (the first batch's), --heads ×
    --hidden in f16: 4 calls enqueued from an idle GPU, 40 times, the median (the GPU's time
    is not counted: the calls' launches are asynchronous)."""
    from spattn import functional as fn

    ei, n, *_ = make_batches(args.call_probe, 1, args, device, source)[0]
    g = spattn.Graph.from_edge_index(ei, num_nodes=n, self_loops=True)
    h, d = args.heads, args.hidden
    q, k, v = (torch.randn(n, h, d, device=device, dtype=torch.float16) for _ in range(3))
    out, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    a_dst, a_src, da_dst, da_src = (torch.randn(n, h, device=device) for _ in range(4))
    ws = [torch.empty(g.num_edges * h, device=device) for _ in range(3)]
    lse = torch.empty(n * h, device=device)
    x, dy = q.clone().requires_grad_(), torch.randn_like(q)
    ad, as_ = a_dst.clone().requires_grad_(), a_src.clone().requires_grad_()
    held = {}

    def layer_forward():
        held.setdefault("outs", []).append(spattn.gat_attention(g, x, ad, as_, 0.2))

    def layer_forward_setup():
        held["outs"] = []  # the previous calls' graphs are freed here, untimed

    def layer_backward():
        # Each call's own graph: the forward is enqueued untimed in `setup`.
        held["outs"][-1].backward(dy)

    def layer_setup():
        x.grad = ad.grad = as_.grad = None
        layer_forward_setup()
        layer_forward()
    stream = torch.cuda.current_stream(device).cuda_stream
    idx = device.index if device.index is not None else torch.cuda.current_device()
    calls = {
        "attention forward": lambda: fn._native_forward(g, q, k, v, out, None, "auto"),
        "attention backward (no d_scale)": lambda: fn._native_backward(
            g, q, k, v, out, q, dq, dk, dv, None, "auto", d_scale=False),
        "GAT forward": lambda: g._core.gat_forward(
            idx, "f16", h, d, 0.2, q.data_ptr(), a_dst.data_ptr(), a_src.data_ptr(),
            out.data_ptr(), ws[0].data_ptr(), stream),
        # No `kernels` argument: the native default, the composed CSR ops.
        "GAT backward (composed)": lambda: g._core.gat_backward(
            idx, "f16", h, d, 0.2, q.data_ptr(), a_dst.data_ptr(), a_src.data_ptr(),
            q.data_ptr(), dq.data_ptr(), da_dst.data_ptr(), da_src.data_ptr(),
            (ws[0].data_ptr(), ws[1].data_ptr(), ws[2].data_ptr()), stream),
        # The layers' path: the rows kernels, the forward's statistics kept for the backward.
        "GAT forward (rows, keeping)": lambda: g._core.gat_forward(
            idx, "f16", h, d, 0.2, q.data_ptr(), a_dst.data_ptr(), a_src.data_ptr(),
            out.data_ptr(), lse.data_ptr(), stream, None, 0, "rows"),
        "GAT backward (rows, kept)": lambda: g._core.gat_backward(
            idx, "f16", h, d, 0.2, q.data_ptr(), a_dst.data_ptr(), a_src.data_ptr(),
            q.data_ptr(), dq.data_ptr(), da_dst.data_ptr(), da_src.data_ptr(),
            (ws[0].data_ptr(), lse.data_ptr(), 0), stream, None, 0, 0, "rows", out.data_ptr(),
            True),
        "gat_attention forward (autograd)": (layer_forward_setup, layer_forward),
        "gat_attention backward (autograd)": (layer_setup, layer_backward),
    }
    print(f"{args.call_probe}: {n} nodes, {g.num_edges} edges, f16 {h} x {d}")
    for name, call in calls.items():
        setup, call = call if isinstance(call, tuple) else (None, call)
        for _ in range(20):
            if setup:
                setup()
            call()
        # A few calls at a time from an idle GPU: enough to time, too few to fill the launch
        # queue (a full queue would make the host wait for the GPU). A call with a setup (the
        # autograd calls: the backward needs its forward) is timed one at a time.
        times = []
        per = 1 if setup else 4
        for _ in range(40 * (4 // per)):
            if setup:
                setup()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(per):
                call()
            times.append((time.perf_counter() - t) / per * 1e6)
        torch.cuda.synchronize()
        print(f"{name}: {statistics.median(times):.1f} us of host time per call (median)")


def print_tables(w, rows, plan_rows, mean_n, mean_e):
    print(f"\n## {w}: mean {mean_n:,.0f} nodes, {mean_e:,.0f} edges\n")
    print("| model | dtype | PyG step (ms) | spattn, new graph (ms) | × PyG | spattn, reused (ms) | new / reused | first forward vs PyG |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["dtype"]), {})[r["impl"]] = r
    for (model, dtype), d in by.items():
        def ms(k):
            r = d.get(k)
            return r["median_ms"] if r and r["status"] == "ok" else None
        p, s, u = ms("pyg"), ms("spattn"), ms("spattn-reused")
        err = next((r.get("reason") for r in d.values() if r["status"] != "ok"), "")
        f = lambda v: f"{v:.2f}" if v is not None else "–"  # noqa: E731
        diff = next((r.get("first_forward_rel_diff_vs_pyg") for r in d.values() if "first_forward_rel_diff_vs_pyg" in r), None)
        print(f"| {model} | {dtype} | {f(p)} | {f(s)} | {f(p / s) + '×' if p and s else '–'} | {f(u)} | "
              f"{f(s / u) if s and u else '–'} | {f'{diff:.1e}' if diff is not None else err} |")
    print_plan(w, plan_rows)


def print_plan(w, plan_rows):
    med = lambda k: statistics.median(r[k] for r in plan_rows)  # noqa: E731
    print(f"\n{w} plan (median over {len(plan_rows)} graphs of {med('edges'):,.0f} edges): GPU build "
          f"{med('build_ms'):.3f} ms wall ({med('build_gpu_ms'):.3f} ms GPU span), fused-tc plan "
          f"{med('fused_tc_plan_ms'):.3f} ms; host build + plan {med('host_build_and_plan_ms'):.1f} ms")


if __name__ == "__main__":
    main()
