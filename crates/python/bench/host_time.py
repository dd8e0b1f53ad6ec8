#!/usr/bin/env python3
"""Host time of spattn's calls on a planned graph, beside torch's own fixed costs.

On a small graph a training step is host-bound: this measures where the host time goes.

1. torch alone, on random tensors of pubmed's size (19,717 × 1 × 64, f32): a Python
   ``autograd.Function`` that only allocates (forward, and ``autograd.grad`` of it), and the C++
   op ``q * k + v`` with its ``autograd.grad``. spattn's calls cannot cost less than these.
2. spattn on the graph (f32 1 × 64, f16 8 × 64 and f16 1 × 64, whose tensor-core backward runs
   its two passes at once): per call, the time until the call returns (the host's share; 200
   calls back to back, the GPU drained after them) and, after a slash,
   the time per call including the drain: ``sparse_attention`` under ``no_grad`` and with
   gradients, its ``autograd.grad``, a whole step (forward + grad), and the native forward and
   backward calls without the Python wrapper; then medians of synchronised calls (the step's
   wall clock), and a cProfile of 100 steps (``--profile``).

    python crates/python/bench/host_time.py crates/bench/peers pubmed.mtx.gz [--profile]

The first argument is the directory of ``torch_peers.py`` (its graph loader), the second a
Matrix Market graph (symmetrized, self loops added as the benchmarks do).
"""

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

import spattn

N = 200


def host(f):
    """(µs per call until the calls return, µs per call with the GPU drained after them)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / N * 1e6, (t2 - t0) / N * 1e6


def synced(f):
    """Median µs of f() between two synchronisations."""
    ts = []
    for _ in range(N):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[N // 2] * 1e6


class Nop(torch.autograd.Function):
    """A Python autograd function that only allocates its output and gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def baseline(n):
    q, k, v = (torch.randn(n, 1, 64, device="cuda", requires_grad=True) for _ in range(3))
    dout = torch.randn(n, 1, 64, device="cuda")

    def warm_host(f):
        for _ in range(20):
            f()
        return host(f)[0]

    fw = warm_host(lambda: Nop.apply(q, k, v))
    o = Nop.apply(q, k, v)
    bw = warm_host(lambda: torch.autograd.grad(o, [q, k, v], dout, retain_graph=True))
    st = warm_host(lambda: torch.autograd.grad(Nop.apply(q, k, v), [q, k, v], dout))
    cf = warm_host(lambda: q * k + v)
    o2 = q * k + v
    cb = warm_host(lambda: torch.autograd.grad(o2, [q, k, v], dout, retain_graph=True))
    print(f"baseline host us: Function fwd {fw:.1f}, autograd.grad of it {bw:.1f}, step {st:.1f}; "
          f"C++ q*k+v fwd {cf:.1f}, grad {cb:.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("peers_dir", help="directory of torch_peers.py (crates/bench/peers)")
    ap.add_argument("graph", help="a .mtx or .mtx.gz graph (pubmed in the recorded runs)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of 100 steps")
    args = ap.parse_args()
    sys.path.insert(0, args.peers_dir)
    import torch_peers as tp

    g = tp.load_graph(args.graph, "graph", True, torch.device("cuda"))
    baseline(g.n)
    G = spattn.Graph(g.crow, g.col)
    for dt, heads in ((torch.float32, 1), (torch.float16, 8), (torch.float16, 1)):
        q, k, v = (torch.randn(g.n, heads, 64, device="cuda", dtype=dt, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(g.n, heads, 64, device="cuda", dtype=dt)

        def fwd():
            return spattn.sparse_attention(G, q, k, v, scale=0.125)

        def step():
            torch.autograd.grad(fwd(), [q, k, v], dout)

        for _ in range(20):
            step()
        torch.cuda.synchronize()
        with torch.no_grad():
            fh = host(fwd)
        fg = host(fwd)
        sh = host(step)
        out = fwd()
        bh = host(lambda: torch.autograd.grad(out, [q, k, v], dout, retain_graph=True))
        o = torch.empty_like(q)
        oo = fwd().detach()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def nat_f():
            spattn.functional._native_forward(G, q, k, v, o, 0.125, "auto")

        def nat_b():
            spattn.functional._native_backward(G, q, k, v, oo, dout, dq, dk, dv, 0.125, "auto",
                                               d_scale=False)

        nf, nb = host(nat_f), host(nat_b)
        print(f"{dt} h{heads}: host us per call (returned / with the GPU drained): "
              f"fwd no_grad {fh[0]:.1f}/{fh[1]:.1f}, fwd grad {fg[0]:.1f}/{fg[1]:.1f}, "
              f"bwd {bh[0]:.1f}/{bh[1]:.1f}, step {sh[0]:.1f}/{sh[1]:.1f}, "
              f"native fwd {nf[0]:.1f}/{nf[1]:.1f}, native bwd {nb[0]:.1f}/{nb[1]:.1f}; "
              f"synced step {synced(step):.1f}, synced fwd {synced(fwd):.1f}, "
              f"synced native bwd {synced(nat_b):.1f}", flush=True)
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(100):
                step()
            torch.cuda.synchronize()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            print(s.getvalue())


if __name__ == "__main__":
    main()
