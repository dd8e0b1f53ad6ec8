#!/usr/bin/env python3
"""Training steps on one fixed molecule batch: eager, CUDA-graph replay and torch.compile, spattn.nn
against PyG in the same run.

Small batches are launch- and host-bound: a step of a 2-layer model on 3.5k nodes runs a few
dozen kernels of microseconds each, and the host time to issue them sets the step. A CUDA
graph replays a whole step (forward, backward, Adam) with one launch. spattn's calls capture
on the current stream for a fixed graph (torch.cuda.graph after a warm-up that plans it);
``--impls`` picks among:

- ``pyg``, ``spattn``: eager steps;
- ``pyg-compile``, ``spattn-compile``: the model under ``torch.compile`` (default mode; spattn's
  ``fullgraph=True``), Adam eager;
- ``spattn-reduce``: ``torch.compile(mode="reduce-overhead", fullgraph=True)``: inductor's
  CUDA graphs of the parts between spattn's calls (which run between them: a graph changes
  from step to step there, which a recorded CUDA graph would not see);
- ``pyg-graph``, ``spattn-graph``: the whole step (forward, backward, ``Adam(capturable=True)``)
  captured once in a CUDA graph and replayed (PyG's where it captures).

A step is timed by wall clock around a synchronized step, median of --repeat after --warmup.
The batch: 128 random molecules of 15–40 atoms (minibatch.py's generator), seeded; models as
epoch.py's (128 features → 8 heads × 32 → 40 classes).

    python crates/python/bench/graphed.py --json graphed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from epoch import DTYPES, build  # noqa: E402
from minibatch import molecules  # noqa: E402

IMPLS = ("pyg", "pyg-compile", "pyg-graph", "spattn", "spattn-compile", "spattn-reduce",
         "spattn-graph")


def wall_ms(fn, warmup, repeat):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def make_step(impl, model, dtype, batch, state, args, spattn):
    """The step function of one case (captured first for the ``-graph`` forms)."""
    base, _, mode = impl.partition("-")
    if base == "pyg":
        import torch_geometric.nn as lib
    else:
        lib = spattn.nn
        spattn.nn.clear_graph_cache()
    ei, n, x, y = batch
    net = build(lib, model, args).cuda()
    net.load_state_dict(state)
    net = net.to(dtype)
    xs = x.to(dtype)
    opt = torch.optim.Adam(net.parameters(), lr=0.01, capturable=mode == "graph")
    if mode == "compile":
        call = torch.compile(net, fullgraph=base == "spattn")
    elif mode == "reduce":
        call = torch.compile(net, mode="reduce-overhead", fullgraph=base == "spattn")
    else:
        call = net

    def step():
        if mode == "reduce":  # a new step for inductor's CUDA-graph trees
            torch.compiler.cudagraph_mark_step_begin()
        # A captured step keeps its gradients' tensors; elsewhere they are dropped, as
        # inductor's CUDA-graph trees need (a kept .grad would be a graph's output, overwritten
        # by the next replay).
        opt.zero_grad(set_to_none=mode != "graph")
        loss = F.cross_entropy(call(xs, ei).float(), y)
        loss.backward()
        opt.step()

    if mode != "graph":
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: plans, Adam's state, allocator pools
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gat,transformer")
    ap.add_argument("--dtypes", default="f32,f16,bf16")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS))
    ap.add_argument("--molecules", type=int, default=128)
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--classes", type=int, default=40)
    ap.add_argument("--edge-dim", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()

    import spattn
    import torch_geometric
    import torch_geometric.nn as pyg_nn

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(1)
    ei, n = molecules(args.molecules, 15, 40, gen, "cuda")
    x = torch.randn(n, args.features, generator=gen).cuda()
    y = torch.randint(0, args.classes, (n,), generator=gen).cuda()
    batch = (ei.contiguous(), n, x, y)
    gpu = torch.cuda.get_device_properties(0).name
    header = {"gpu": gpu, "torch": torch.__version__, "torch_geometric": torch_geometric.__version__,
              "spattn": spattn.__version__, "nodes": n, "edges": ei.shape[1], "config": vars(args)}
    print(f"# Fixed molecule batch: {n} nodes, {ei.shape[1]} edges; GPU {gpu}; torch "
          f"{torch.__version__}; PyG {torch_geometric.__version__}")
    rows = []
    for model in args.models.split(","):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            torch.manual_seed(0)
            state = build(pyg_nn, model, args).state_dict()
            for impl in args.impls.split(","):
                try:
                    step = make_step(impl, model, dtype, batch, state, args, spattn)
                    t = wall_ms(step, args.warmup, args.repeat)
                    torch.cuda.synchronize()  # a fault is this case's, not the next one's
                    r = {"impl": impl, "model": model, "dtype": dname, "status": "ok",
                         "median_ms": statistics.median(t), "min_ms": min(t), "times_ms": t}
                except Exception as e:  # noqa: BLE001 - record and go on
                    r = {"impl": impl, "model": model, "dtype": dname, "status": "error",
                         "reason": f"{type(e).__name__}: {e}"[:300]}
                    print(f"{model} {dname} {impl}: {r['reason']}", flush=True)
                rows.append(r)
                torch._dynamo.reset()
                torch.cuda.synchronize()
    print_table(rows, args.impls.split(","))
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": rows}, indent=2))


def print_table(rows, impls):
    print("\n| model | dtype | " + " | ".join(impls) + " | spattn-graph ÷ pyg |")
    print("|---|---|" + "--:|" * (len(impls) + 1))
    keys = sorted({(r["model"], r["dtype"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for model, dname in keys:
        got = {r["impl"]: r for r in rows if r["model"] == model and r["dtype"] == dname}
        cells = []
        for impl in impls:
            r = got.get(impl)
            cells.append(f"{r['median_ms']:.3f}" if r and r["status"] == "ok" else (r or {}).get("status", "–"))
        a, b = got.get("pyg"), got.get("spattn-graph")
        ratio = (f"{a['median_ms'] / b['median_ms']:.2f}×" if a and b and a["status"] == b["status"] == "ok"
                 else "–")
        print(f"| {model} | {dname} | " + " | ".join(cells) + f" | {ratio} |")
    for r in rows:
        if r["status"] != "ok":
            print(f"- {r['model']} {r['dtype']} {r['impl']}: {r['reason']}")


if __name__ == "__main__":
    main()
