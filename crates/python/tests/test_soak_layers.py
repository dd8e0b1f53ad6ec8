"""A randomised soak of :mod:`spattn.nn`'s layers against PyG 2.8's (skipped without
torch_geometric).

Each case draws a graph (as ``test_soak.py`` does, without repeated edges, which PyG counts
and spattn merges), a layer (GATConv, GATv2Conv, TransformerConv, AGNNConv) with random
constructor arguments (heads, concat, slopes, self loops, edge features and their fill
value, bias, residual, root weight, beta, shared weights), loads PyG's state dict into
spattn's and compares the output, ∂L/∂x and every parameter's gradient of ``Σ out · w``:

- on the CPU in float64 (spattn's CPU paths): the two compute one function, so any
  difference beyond rounding is a semantic one (relative error ≤ 1e-9 against the problem's
  scale);
- on a GPU in float32 against PyG in float64 on the same inputs: within 1e-4 (relative, or of
  1/100 of the problem's scale for a gradient smaller than that), or 4 times PyG's own error
  in float32 where that is larger, up to 1e-2 (gradients whose terms cancel: GAT's attention
  vectors, GATv2's, AGNN's β; test_gpu.py bounds those by their condition numbers on real
  graphs).

``SPATTN_SOAK_LAYER_CASES`` (default 24) cases; ``SPATTN_SOAK_SEED`` seeds them::

    SPATTN_SOAK_LAYER_CASES=500 python -m pytest -q -s tests/test_soak_layers.py
"""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")
pyg_nn = pytest.importorskip("torch_geometric.nn")

import spattn  # noqa: E402
import spattn.nn  # noqa: E402
from test_soak import DEV, KINDS, SEED, _edges, run_saying_failures  # noqa: E402

CASES = int(os.environ.get("SPATTN_SOAK_LAYER_CASES", "24"))
DTYPE = torch.float64 if DEV == "cpu" else torch.float32
TOL = 1e-9 if DEV == "cpu" else 1e-4
# Errors are relative to the quantity plus FLOOR times the problem's scale (|out| + |dx|): a
# gradient that is zero by construction (a key bias's; the query's
# where every row has one edge) is only ever its rounding noise, a few units of f32 there.
FLOOR = 1e-3 if DEV == "cpu" else 1e-2


def _layer_args(r: random.Random):
    """A layer kind, its constructor's keyword arguments, and whether it takes edge features."""
    kind = r.choice(["gat", "gatv2", "transformer", "agnn"])
    if kind == "agnn":
        return kind, {"requires_grad": r.random() < 0.8, "add_self_loops": r.random() < 0.7}
    args = {"heads": r.choice([1, 2, 3, 4, 8]), "concat": r.random() < 0.7,
            "bias": r.random() < 0.8}
    args["edge_dim"] = r.choice([None, None, 1, 4])
    if kind in ("gat", "gatv2"):
        args["negative_slope"] = r.choice([0.2, 0.01, 0.5])
        args["add_self_loops"] = r.random() < 0.7
        args["residual"] = r.random() < 0.3
        if args["edge_dim"] is not None and args["add_self_loops"]:
            args["fill_value"] = r.choice(["mean", "add", "max", "min", "mul", 0.5])
        if kind == "gatv2":
            args["share_weights"] = r.random() < 0.3
    else:
        args["root_weight"] = r.random() < 0.8
        args["beta"] = r.random() < 0.4
    return kind, args


def _make(module, kind, fin, fout, args):
    if kind == "agnn":
        return module.AGNNConv(**args)
    cls = {"gat": module.GATConv, "gatv2": module.GATv2Conv, "transformer": module.TransformerConv}
    return cls[kind](fin, fout, **args)


def _run(layer, x, edge_index, attr, w):
    xa = x.clone().requires_grad_()
    out = layer(xa, edge_index, attr) if attr is not None else layer(xa, edge_index)
    (out * w).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), xa.grad, grads


@pytest.mark.parametrize("index", range(CASES), ids=lambda i: f"layer{SEED}-{i}")
def test_soak_layer(index):
    run_saying_failures(_soak_layer, index)


def _soak_layer(index):
    r = random.Random(SEED * 1_000_003 + index + 500_000_009)
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + index + 500_000_009)
    kind, ei, n = _edges(r, gen, [k for k in KINDS if k != "large"])  # PyG runs in float64
    ei = torch.unique(ei, dim=1)  # PyG counts a repeated edge, spattn merges it
    ei = ei[:, torch.randperm(ei.shape[1], generator=gen)]
    layer, args = _layer_args(r)
    fin = r.choice([1, 3, 8, 16, 33])
    fout = fin if layer == "agnn" else r.choice([1, 2, 5, 8, 16, 32, 64])
    label = f"case {SEED}-{index}: {kind} n={n} E={ei.shape[1]} | {layer} {fin}->{fout} {args}"
    with torch.random.fork_rng(devices=[]):  # PyG's initialisation, without the global state
        torch.manual_seed(index)
        theirs = _make(pyg_nn, layer, fin, fout, args).double()
    state = {k: v.to(DTYPE) for k, v in theirs.state_dict().items()}
    x = torch.randn(n, fin, generator=gen, dtype=torch.float64).to(DTYPE)
    e = args.get("edge_dim")
    attr = torch.randn(ei.shape[1], e, generator=gen, dtype=torch.float64).to(DTYPE) if e else None
    theirs.load_state_dict({k: v.double() for k, v in state.items()})
    ours = _make(spattn.nn, layer, fin, fout, args).to(DEV).to(DTYPE)
    ours.load_state_dict(state)
    width = fin if layer == "agnn" else fout * (args["heads"] if args["concat"] else 1)
    w = torch.randn(n, width, generator=gen, dtype=torch.float64)
    ref = _run(theirs, x.double(), ei, None if attr is None else attr.double(), w)
    got = _run(ours, x.to(DEV), ei.to(DEV), None if attr is None else attr.to(DEV),
               w.to(DEV, DTYPE))
    same = [None] * (2 + len(ref[2]))
    if DTYPE != torch.float64:  # PyG in the same dtype: how far the dtype itself takes it
        pyg_same = _make(pyg_nn, layer, fin, fout, args).to(DEV).to(DTYPE)
        pyg_same.load_state_dict(state)
        p = _run(pyg_same, x.to(DEV), ei.to(DEV), None if attr is None else attr.to(DEV),
                 w.to(DEV, DTYPE))
        same = [p[0], p[1]] + [p[2].get(k) for k in sorted(ref[2])]
    scale = ref[0].norm().item() + ref[1].norm().item()
    names = ["out", "dx"] + sorted(ref[2])
    mine = [got[0], got[1]] + [got[2].get(k) for k in sorted(ref[2])]
    want = [ref[0], ref[1]] + [ref[2][k] for k in sorted(ref[2])]
    errors = []
    def rel(a, b):
        return (a.double().cpu() - b).norm().item() / (b.norm().item() + FLOOR * scale + 1e-300)

    for name, a, b, c in zip(names, mine, want, same):
        assert a is not None, f"{label}: {name}: no gradient"
        assert a.shape == b.shape, f"{label}: {name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        err = rel(a, b)
        # A gradient whose terms cancel (a key bias's is exactly 0: the softmax ignores a
        # row's shift) is as far off in PyG's float32: allow 4 times PyG's error.
        allowed = TOL if c is None else max(TOL, min(4 * rel(c, b), 1e-2))
        errors.append(f"{name} {err:.1e}")
        if not err <= allowed:
            raise AssertionError(f"{label}: {name} relative error {err:.3e} > {allowed:.1e} "
                                 f"({', '.join(errors)})")
    print(f"{label} | {' '.join(errors)}")
