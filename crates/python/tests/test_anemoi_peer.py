"""CPU checks of the Anemoi peer benchmark (crates/bench/peers/anemoi_peer.py): its f64
reference against an independent dense computation with autograd, spattn's CPU path through the
script against that reference (which checks the script's edge-order mapping and inputs), and the
mapping when spattn's edge order differs from the CSR's. Anemoi's own kernels need Triton and a
GPU; the GPU run checks them (docs/results/anemoi.md)."""

from __future__ import annotations

import gzip
import importlib
import math
import sys
import types
import zipfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "crates" / "bench" / "peers"))
import anemoi_peer as apr  # noqa: E402
import torch_peers as tp  # noqa: E402

H, D = 2, 8


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """23 nodes, random edges, rows 3 and 7 empty, a hub row (5) of 15 more edges."""
    rng = np.random.default_rng(1)
    n = 23
    r, c = rng.integers(0, n, 120), rng.integers(0, n, 120)
    keep = (r != 3) & (r != 7)
    r = np.concatenate([r[keep], np.full(15, 5)])
    c = np.concatenate([c[keep], np.arange(15)])
    path = tmp_path_factory.mktemp("anemoi") / "tiny.mtx.gz"
    with gzip.open(path, "wt") as f:
        f.write("%%MatrixMarket matrix coordinate pattern general\n")
        f.write(f"{n} {n} {len(r)}\n")
        for a, b in zip(r, c):
            f.write(f"{a + 1} {b + 1}\n")
    g = tp.load_graph(str(path), device="cpu")
    assert int((np.diff(g.offs) == 0).sum()) == 2
    return g


@pytest.fixture(scope="module")
def inputs(graph):
    gen = torch.Generator().manual_seed(0)
    n = graph.n

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    return dict(q=draw(n, H, D), k=draw(n, H, D), v=draw(n, H, D), e=draw(graph.nnz, H, D),
                dout=draw(n, H, D), scale=1 / math.sqrt(D))


def dense(g, q, k, v, e, scale):
    """softmax over each row's edges of q_i . (k_j + e_ij) * scale, times v_j + e_ij, densely."""
    n = g.n
    big_e = torch.zeros(n, n, H, D, dtype=torch.float64).index_put((g.row, g.col), e)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[g.row, g.col] = True
    s = (q[:, None] * (k[None] + big_e)).sum(-1) * scale
    p = torch.softmax(s.masked_fill(~mask[:, :, None], -math.inf), dim=1)
    p = torch.nan_to_num(p, nan=0.0)  # rows without edges give zeros
    return (p[..., None] * (v[None] + big_e)).sum(1)


@pytest.mark.parametrize("with_e", [True, False])
def test_reference_matches_dense_autograd(graph, inputs, with_e):
    x = inputs
    leaves = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"], x["e"])]
    e_used = leaves[3] if with_e else torch.zeros_like(x["e"])
    out = dense(graph, *leaves[:3], e_used, x["scale"])
    grads = torch.autograd.grad(out, leaves if with_e else leaves[:3], x["dout"])
    want = dict(out=out.detach(), dq=grads[0], dk=grads[1], dv=grads[2])
    if with_e:
        want["de"] = grads[3]
    errs = apr.reference_errors(graph, x["q"], x["k"], x["v"], x["e"] if with_e else None,
                                x["dout"], x["scale"], {"dense": want})
    assert set(errs["dense"]) == set(want)
    assert all(err < 1e-13 for err in errs["dense"].values()), errs


def spattn_setup(graph, inputs):
    args = types.SimpleNamespace(spattn_graph="host", spattn_algorithm="auto",
                                 anemoi_rebuild=False, prep_reps=1, anemoi_path=None,
                                 device="cpu")
    sp = apr.Spattn(args)
    assert sp.error is None, sp.error
    sg = apr.SpattnGraph(sp, graph, args)
    case = types.SimpleNamespace(g=graph, heads=H, d=D, dt=torch.float64, q=inputs["q"],
                                 k=inputs["k"], v=inputs["v"], scale=inputs["scale"])
    return args, sp, sg, case


@pytest.mark.parametrize("with_e", [True, False])
def test_spattn_through_the_script_matches_the_reference(graph, inputs, with_e):
    args, sp, sg, case = spattn_setup(graph, inputs)
    e = inputs["e"] if with_e else None
    fwd, fwd_bwd, unpack, _variant, _note, _plan_ms = apr.spattn_fns(sp, sg, case, e,
                                                                    inputs["dout"], args)
    out_f = fwd()
    out, grads = unpack(fwd_bwd())
    errs = apr.reference_errors(graph, inputs["q"], inputs["k"], inputs["v"], e, inputs["dout"],
                                inputs["scale"], {"fwd": dict(out=out_f),
                                                  "fb": dict(out=out, **grads)})
    assert ("de" in errs["fb"]) == with_e
    assert all(err < 1e-12 for v in errs.values() for err in v.values()), errs


def test_edge_order_mapping_when_spattn_orders_edges_otherwise(graph, inputs):
    args, sp, sg, case = spattn_setup(graph, inputs)
    perm = torch.randperm(graph.nnz, generator=torch.Generator().manual_seed(3))
    permuted = apr.SpattnGraph.__new__(apr.SpattnGraph)
    permuted.graph, permuted.pos, permuted.how, permuted.order = sg.graph, perm, sg.how, "permuted"
    e_spattn = inputs["e"]
    e_ours = e_spattn[perm]  # ours[m] = spattn's[pos[m]]
    _, fwd_bwd, unpack, *_ = apr.spattn_fns(sp, sg, case, e_spattn, inputs["dout"], args)
    out_i, grads_i = unpack(fwd_bwd())
    _, fwd_bwd, unpack, *_ = apr.spattn_fns(sp, permuted, case, e_ours, inputs["dout"], args)
    out_p, grads_p = unpack(fwd_bwd())
    assert torch.equal(out_i, out_p)
    assert torch.equal(grads_p["de"], grads_i["de"][perm])


def test_anemoi_path_unpacks_a_wheel_of_a_namespace_package(tmp_path, monkeypatch):
    # `anemoi` has no __init__.py: from a .whl on sys.path, zip import would not find it.
    whl = tmp_path / "nspkg_demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("nsdemo_ns/inner/__init__.py", "VALUE = 42\n")
    folder = apr.import_folder(str(whl))
    assert folder != str(whl)
    monkeypatch.syspath_prepend(folder)
    inner = importlib.import_module("nsdemo_ns.inner")
    assert inner.VALUE == 42
    # A folder is used as it is.
    assert apr.import_folder(str(tmp_path)) == str(tmp_path)
