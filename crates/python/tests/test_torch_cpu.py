"""CPU tests with torch: autograd (gradcheck in float64), the spattn.nn layers against PyG's
formulas (plain torch, tests/pyg_reference.py; against torch_geometric itself where it is
installed), and errors naming the argument. Skipped where torch is not installed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import spattn  # noqa: E402
import spattn.nn  # noqa: E402
import pyg_reference as ref  # noqa: E402
from conftest import BUNDLED_CORA, dense_mask, ref_attention, rel_l2  # noqa: E402

try:
    import torch_geometric.nn as pyg_nn  # noqa: E402
except ImportError:
    pyg_nn = None


def random_edge_index(gen, n=24, e=90):
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n, (e,), generator=gen)
    ei = torch.unique(torch.stack([src, dst]), dim=1)  # no repeated edges
    keep = ei[1] != 5  # node 5 has no incoming edge
    return ei[:, keep]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def test_sparse_attention_gradcheck_f64(gen):
    ei = random_edge_index(gen)
    g = spattn.Graph.from_edge_index(ei, num_nodes=24)
    q, k, v = (torch.randn(24, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: spattn.sparse_attention(g, q, k, v, scale=0.8), (q, k, v))
    # A learnable scale (0-dim tensor) gets its gradient through torch.
    s = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, s: spattn.sparse_attention(g, q, k, v, scale=s), (q, s))


def test_sparse_attention_matches_dense_reference_and_dtypes(gen):
    g = spattn.Graph.read_matrix_market(BUNDLED_CORA, symmetrize=True, self_loops=True)
    n = g.num_nodes
    q, k, v = (torch.randn(n, 4, 8, generator=gen) for _ in range(3))
    want, _ = ref_attention(dense_mask(g), q.numpy(), k.numpy(), v.numpy(), 1 / np.sqrt(8))
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)):
        out = spattn.sparse_attention(g, q.to(dtype), k.to(dtype), v.to(dtype))
        assert out.dtype == dtype
        assert rel_l2(out.double().numpy(), want) <= tol, dtype


def test_gat_attention_gradcheck_f64(gen):
    ei = random_edge_index(gen)
    g = spattn.Graph.from_edge_index(ei, num_nodes=24)
    x = torch.randn(24, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    a_dst = torch.randn(24, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    a_src = torch.randn(24, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, d, s: spattn.gat_attention(g, x, d, s, negative_slope=0.2), (x, a_dst, a_src)
    )


def compare_layer(make, reference, x, edge_index, tol):
    """Output and every gradient (input and parameters) of a spattn.nn layer against the
    reference on the same parameters, in float64."""
    torch.manual_seed(0)
    layer = make().double()
    w = torch.randn(1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    xa = x.clone().requires_grad_()
    out = layer(xa, edge_index)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (out * weights * w).sum().backward()
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in layer.named_parameters()}
    gx = xa.grad.clone()
    layer.zero_grad()
    xb = x.clone().requires_grad_()
    want = reference(layer, xb, edge_index)
    (want * weights * w).sum().backward()
    assert rel_l2(out.detach().numpy(), want.detach().numpy()) <= tol
    assert rel_l2(gx.numpy(), xb.grad.numpy()) <= tol
    for name, p in layer.named_parameters():
        if p.grad is None:  # unused, as in PyG (lin_skip without root_weight)
            assert grads[name] is None, name
            continue
        # (a gradient that is zero in exact arithmetic, like lin_key.bias's, is noise)
        diff = (grads[name] - p.grad).norm().item()
        assert diff <= tol * p.grad.norm().item() + 1e-13, name
    return out.detach()


@pytest.mark.parametrize("concat,residual,heads", [(True, False, 3), (False, True, 2)])
def test_gatconv_matches_pyg_formula(gen, concat, residual, heads):
    ei = random_edge_index(gen)
    x = torch.randn(24, 5, dtype=torch.float64, generator=gen)
    compare_layer(
        lambda: spattn.nn.GATConv(5, 4, heads=heads, concat=concat, residual=residual),
        ref.gat, x, ei, 1e-10,
    )


@pytest.mark.parametrize("concat,beta,root_weight", [(True, False, True), (False, True, True), (True, False, False)])
def test_transformerconv_matches_pyg_formula(gen, concat, beta, root_weight):
    ei = random_edge_index(gen)
    x = torch.randn(24, 5, dtype=torch.float64, generator=gen)
    compare_layer(
        lambda: spattn.nn.TransformerConv(5, 4, heads=2, concat=concat, beta=beta, root_weight=root_weight),
        ref.transformer, x, ei, 1e-10,
    )


def test_bucket_rows_pads_at_most_a_sixteenth():
    prev = 0
    for n in list(range(0, 5000)) + [2**20 + 1, 10**7 + 3]:
        b = spattn.nn._bucket_rows(n)
        assert b >= n and b >= prev, n
        assert b == n if n <= 64 else (b - n) * 16 <= n, n
        prev = b
    assert len({spattn.nn._bucket_rows(n) for n in range(2049, 4097)}) == 16  # an octave


def test_row_counts_run_padded_then_exact(monkeypatch):
    monkeypatch.setattr(spattn.nn, "_ROW_COUNTS", {})
    k = spattn.nn._EXACT_AFTER
    assert [spattn.nn._rows_for(101) for _ in range(k + 2)] == [104] * k + [None, None]
    assert spattn.nn._rows_for(103) == 104  # another count keeps its own tally
    big = spattn.nn._PAD_MAX_ROWS + 1  # GPU-bound maps are never padded nor tallied
    assert spattn.nn._rows_for(big) is None and big not in spattn.nn._ROW_COUNTS
    assert spattn.nn._rows_for(big - 1) == spattn.nn._bucket_rows(big - 1)
    # A mini-batch's edge maps of ~10^5 rows (20% subgraphs of ogbn-arxiv) are host-bound: padded.
    assert spattn.nn._rows_for(125_001) == spattn.nn._bucket_rows(125_001) > 125_001
    # An input of more than _PAD_MAX_BYTES is not copied: the copy would outlive the map.
    limit = spattn.nn._PAD_MAX_BYTES
    assert spattn.nn._rows_for(2001, limit) == spattn.nn._bucket_rows(2001)
    assert spattn.nn._rows_for(2003, limit + 1) is None and 2003 not in spattn.nn._ROW_COUNTS


def test_maps_past_the_tally_are_the_plain_maps(gen, batched_maps, monkeypatch):
    # Past _EXACT_AFTER maps of a row count (or past _PAD_MAX_ROWS rows) every map is `lin(x)`
    # itself: no stacked GEMM, whose expanded input's backward costs more on a count seen often.
    lins = [torch.nn.Linear(5, 6).double() for _ in range(3)]
    x = torch.randn(101, 5, dtype=torch.float64, generator=gen)
    calls = []
    monkeypatch.setattr(torch, "baddbmm", lambda *a, **k: calls.append(1) or torch.Tensor.baddbmm(*a, **k))
    for i in range(spattn.nn._EXACT_AFTER + 2):
        outs = spattn.nn._stacked_linear(x, lins)
        assert len(calls) == min(i + 1, spattn.nn._EXACT_AFTER)
        for lin, out in zip(lins, outs):
            torch.testing.assert_close(out, lin(x), rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(spattn.nn, "_PAD_MAX_ROWS", 100)
    monkeypatch.setattr(spattn.nn, "_ROW_COUNTS", {})
    spattn.nn._stacked_linear(x, lins)
    assert len(calls) == spattn.nn._EXACT_AFTER and spattn.nn._padding(x) is None
    # Within the rows but past _PAD_MAX_BYTES (x's bytes in its GEMM dtype): a plain map too.
    monkeypatch.setattr(spattn.nn, "_PAD_MAX_ROWS", 1 << 18)
    monkeypatch.setattr(spattn.nn, "_PAD_MAX_BYTES", x.numel() * x.element_size())
    assert spattn.nn._padding(x) == (x.dtype, 104)
    monkeypatch.setattr(spattn.nn, "_PAD_MAX_BYTES", x.numel() * x.element_size() - 1)
    spattn.nn._stacked_linear(x, lins)
    assert len(calls) == spattn.nn._EXACT_AFTER and spattn.nn._padding(x) is None
    # The bytes are those of the padded copy, in the GEMM's dtype (a wider input under autocast
    # counts at half precision's 2 bytes an element).
    monkeypatch.setattr(spattn.nn, "_gemm_dtype", lambda x: torch.float16)
    monkeypatch.setattr(spattn.nn, "_PAD_MAX_BYTES", x.numel() * 2)
    assert spattn.nn._padding(x) == (torch.float16, 104)
    monkeypatch.setattr(spattn.nn, "_PAD_MAX_BYTES", x.numel() * 2 - 1)
    assert spattn.nn._padding(x) is None


@pytest.fixture
def batched_maps(monkeypatch):
    """The half-precision dense maps' path (rows padded to a bucket, TransformerConv's batched
    GEMM) taken on the CPU in float64, where it is otherwise CUDA-only."""
    monkeypatch.setattr(spattn.nn, "_gemm_dtype", lambda x: x.dtype)
    monkeypatch.setattr(spattn.nn, "_ROW_COUNTS", {})


@pytest.mark.parametrize("concat,beta,root_weight", [
    (True, False, True), (False, True, True), (True, False, False), (False, False, True)])
def test_transformerconv_batched_maps_match_pyg_formula(gen, batched_maps, concat, beta, root_weight):
    # 101 nodes: padded to 104 rows; concat=False makes the skip narrower than the query.
    ei = random_edge_index(gen, n=101, e=500)
    x = torch.randn(101, 5, dtype=torch.float64, generator=gen)
    compare_layer(
        lambda: spattn.nn.TransformerConv(5, 4, heads=2, concat=concat, beta=beta, root_weight=root_weight),
        ref.transformer, x, ei, 1e-10,
    )


def test_gatconv_batched_maps_match_pyg_formula(gen, batched_maps):
    ei = random_edge_index(gen, n=101, e=500)
    x = torch.randn(101, 5, dtype=torch.float64, generator=gen)
    compare_layer(lambda: spattn.nn.GATConv(5, 4, heads=3, residual=True), ref.gat, x, ei, 1e-10)


def test_stacked_maps_are_aligned_and_match_separate_maps(gen, batched_maps):
    # Outputs past the first start `rows × width` elements in: 16-byte aligned for spattn's
    # kernels at any row count and width, padded or exact (past _EXACT_AFTER maps).
    for n, width in ((33, 7), (101, 12), (2708, 7)):
        lins = [torch.nn.Linear(5, width).to(torch.bfloat16) for _ in range(4)]
        x = torch.randn(n, 5, generator=gen).to(torch.bfloat16)
        for _ in range(spattn.nn._EXACT_AFTER + 2):
            outs = spattn.nn._stacked_linear(x, lins)
            for lin, out in zip(lins, outs):
                assert out.is_contiguous() and out.data_ptr() % 16 == 0, (n, width)
                torch.testing.assert_close(out, lin(x), rtol=2e-2, atol=2e-2)


def test_stacked_maps_fall_back_for_hooked_or_pruned_linears(gen, batched_maps):
    x = torch.randn(101, 5, dtype=torch.float64, generator=gen)
    lins = [torch.nn.Linear(5, 6).double() for _ in range(3)]
    assert spattn.nn._plain_linears(lins)
    from torch.nn.utils import prune

    prune.random_unstructured(lins[1], "weight", amount=0.5)  # a forward pre-hook
    assert not spattn.nn._plain_linears(lins)
    for lin, out in zip(lins, spattn.nn._stacked_linear(x, lins)):
        torch.testing.assert_close(out, lin(x), rtol=1e-12, atol=1e-12)
    assert not spattn.nn._plain_linears([torch.nn.Linear(5, 6), torch.nn.Linear(4, 6)])


def _layer_outputs_and_grads(layer, x, ei, edge_attr=None):
    xs = tuple(t.clone().requires_grad_() for t in x) if isinstance(x, tuple) else x.clone().requires_grad_()
    out = layer(xs, ei) if edge_attr is None else layer(xs, ei, edge_attr)
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    params = [p for p in layer.parameters() if p.requires_grad]
    inputs = list(xs) if isinstance(xs, tuple) else [xs]
    grads = torch.autograd.grad((out * w).sum(), inputs + params, allow_unused=True)
    return [out.detach()] + [g for g in grads if g is not None]


@pytest.mark.parametrize("case", ["transformer-pair", "transformer-edge", "gat-pair", "gatv2", "gatv2-edge"])
def test_padded_maps_match_plain_maps(gen, monkeypatch, case):
    # The half-precision maps' path (padded rows, stacked maps) against the plain one, float64,
    # on layer forms the PyG-formula tests above do not take through it.
    n = 101
    ei = random_edge_index(gen, n=n, e=500)
    x = torch.randn(n, 5, dtype=torch.float64, generator=gen)
    x2 = torch.randn(n, 5, dtype=torch.float64, generator=gen)
    ea = torch.randn(ei.shape[1], 3, dtype=torch.float64, generator=gen)
    assert spattn.nn._bucket_rows(ei.shape[1]) != ei.shape[1]  # the edge rows are padded too
    make, inputs = {
        "transformer-pair": (lambda: spattn.nn.TransformerConv(5, 4, heads=2), ((x, x2),)),
        "transformer-edge": (lambda: spattn.nn.TransformerConv(5, 4, heads=2, edge_dim=3), (x, ea)),
        "gat-pair": (lambda: spattn.nn.GATConv((5, 5), 4, heads=2, residual=True), ((x, x2),)),
        "gatv2": (lambda: spattn.nn.GATv2Conv(5, 4, heads=2, residual=True), (x,)),
        "gatv2-edge": (lambda: spattn.nn.GATv2Conv(5, 4, heads=2, edge_dim=3), (x, ea)),
    }[case]
    torch.manual_seed(0)
    layer = make().double()
    plain = _layer_outputs_and_grads(layer, inputs[0], ei, *inputs[1:])
    monkeypatch.setattr(spattn.nn, "_gemm_dtype", lambda t: t.dtype)
    monkeypatch.setattr(spattn.nn, "_ROW_COUNTS", {})
    padded = _layer_outputs_and_grads(layer, inputs[0], ei, *inputs[1:])
    assert len(plain) == len(padded)
    for a, b in zip(plain, padded):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_agnnconv_matches_pyg_formula(gen):
    ei = random_edge_index(gen)
    x = torch.randn(24, 6, dtype=torch.float64, generator=gen)

    def make():
        layer = spattn.nn.AGNNConv()
        with torch.no_grad():
            layer.beta.fill_(1.7)
        return layer
    compare_layer(make, ref.agnn, x, ei, 1e-10)
    layer = spattn.nn.AGNNConv(requires_grad=False)
    assert "beta" in dict(layer.named_buffers())


def test_layers_float32_and_half_inputs_on_cpu(gen):
    ei = random_edge_index(gen)
    x = torch.randn(24, 5, generator=gen)
    gat = spattn.nn.GATConv(5, 4, heads=2)
    out = gat(x, ei)
    assert out.dtype == torch.float32 and out.shape == (24, 8)
    out.sum().backward()
    assert gat.att_src.grad is not None
    # Half precision runs through the float32 reference on the CPU.
    tf = spattn.nn.TransformerConv(5, 4, heads=2).to(torch.bfloat16)
    y = tf(x.to(torch.bfloat16), ei)
    assert y.dtype == torch.bfloat16


def test_graph_cache_and_graph_input(gen):
    ei = random_edge_index(gen)
    g1 = spattn.nn.graph_for(ei, 24, self_loops=True)
    assert spattn.nn.graph_for(ei, 24, self_loops=True) is g1
    ei2 = ei.clone()
    assert spattn.nn.graph_for(ei2, 24, self_loops=True) is not g1
    ei2[0, 0] = (ei2[0, 0] + 1) % 24  # an in-place change is a new version: a new graph
    assert spattn.nn.graph_for(ei2, 24) is not spattn.nn.graph_for(ei, 24)
    # A spattn.Graph is taken as is (with self loops added where the layer adds them).
    g = spattn.Graph.from_edge_index(ei, num_nodes=24)
    x = torch.randn(24, 5, generator=gen)
    layer = spattn.nn.GATConv(5, 3)
    torch.testing.assert_close(layer(x, g), layer(x, ei))


def test_graph_cache_drops_a_graph_with_its_tensor(gen):
    import gc
    import weakref

    spattn.nn.clear_graph_cache()
    ei = random_edge_index(gen)
    kept = random_edge_index(gen)
    graph = weakref.ref(spattn.nn.graph_for(ei, 24, self_loops=True))
    spattn.nn.graph_for(kept, 24)
    assert graph() is not None and len(spattn.nn._cache) == 2
    del ei
    gc.collect()
    # The freed tensor's entry is gone (and its graph with it); the live one's stays.
    assert graph() is None and len(spattn.nn._cache) == 1
    assert spattn.nn.graph_for(kept, 24) is spattn.nn.graph_for(kept, 24)


def test_state_dict_names_match_pyg():
    gat = spattn.nn.GATConv(5, 4, heads=2, residual=True)
    assert set(gat.state_dict()) == {"lin.weight", "att_src", "att_dst", "res.weight", "bias"}
    tf = spattn.nn.TransformerConv(5, 4, heads=2, beta=True)
    assert set(tf.state_dict()) == {
        f"{m}.{p}" for m in ("lin_key", "lin_query", "lin_value", "lin_skip") for p in ("weight", "bias")
    } | {"lin_beta.weight"}
    assert set(spattn.nn.AGNNConv().state_dict()) == {"beta"}


@pytest.mark.skipif(pyg_nn is None, reason="torch_geometric is not installed")
def test_against_torch_geometric_on_cpu(gen):
    ei = random_edge_index(gen)
    x = torch.randn(24, 5, dtype=torch.float64, generator=gen)
    for ours, theirs in (
        (spattn.nn.GATConv(5, 4, heads=3), pyg_nn.GATConv(5, 4, heads=3)),
        (spattn.nn.TransformerConv(5, 4, heads=2, beta=True), pyg_nn.TransformerConv(5, 4, heads=2, beta=True)),
        (spattn.nn.AGNNConv(), pyg_nn.AGNNConv()),
    ):
        ours, theirs = ours.double(), theirs.double()
        ours.load_state_dict(theirs.state_dict())
        torch.testing.assert_close(ours(x, ei), theirs(x, ei), rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(pyg_nn is None, reason="torch_geometric is not installed")
@pytest.mark.parametrize("fill_value", ["mean", "add", "max", "min", "mul", 0.5])
def test_gat_conv_edge_dim_matches_torch_geometric(gen, fill_value):
    ei = random_edge_index(gen)
    # Node 23 has only a self loop (its fill comes from no edge: 0, or 1 for "mul").
    ei = ei[:, ei[1] != 23]
    ei = torch.cat([ei, torch.tensor([[3, 7, 23], [3, 7, 23]])], dim=1)  # self loops to replace
    ei = torch.unique(ei, dim=1)
    ei = ei[:, torch.randperm(ei.shape[1], generator=gen)]
    x = torch.randn(24, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    edge_attr = torch.randn(ei.shape[1], 3, dtype=torch.float64, generator=gen, requires_grad=True)
    theirs = pyg_nn.GATConv(5, 4, heads=2, edge_dim=3, fill_value=fill_value).double()
    ours = spattn.nn.GATConv(5, 4, heads=2, edge_dim=3, fill_value=fill_value).double()
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    w = torch.randn(24, 8, dtype=torch.float64, generator=gen)
    grads = []
    for layer in (ours, theirs):
        out = layer(x, ei, edge_attr)
        gx, ge, gl, ga = torch.autograd.grad(
            (out * w).sum(), (x, edge_attr, layer.lin_edge.weight, layer.att_edge))
        grads.append((out.detach(), gx, ge, gl, ga))
    for name, a, b in zip(("out", "dx", "dedge_attr", "dlin_edge", "datt_edge"), grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.skipif(pyg_nn is None, reason="torch_geometric is not installed")
@pytest.mark.parametrize("concat,batched", [(True, False), (False, False), (True, True)])
def test_transformer_conv_edge_dim_matches_torch_geometric(gen, request, concat, batched):
    if batched:  # the half-precision maps' path (24 nodes and 80 edges: stacked, not padded)
        request.getfixturevalue("batched_maps")
    ei = random_edge_index(gen)
    ei = ei[:, torch.randperm(ei.shape[1], generator=gen)]  # edge_attr in no particular order
    x = torch.randn(24, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    edge_attr = torch.randn(ei.shape[1], 3, dtype=torch.float64, generator=gen, requires_grad=True)
    theirs = pyg_nn.TransformerConv(5, 4, heads=2, concat=concat, edge_dim=3).double()
    ours = spattn.nn.TransformerConv(5, 4, heads=2, concat=concat, edge_dim=3).double()
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    w = torch.randn(24, 8 if concat else 4, dtype=torch.float64, generator=gen)
    grads = []
    for layer in (ours, theirs):
        out = layer(x, ei, edge_attr)
        gx, ge, gw = torch.autograd.grad((out * w).sum(), (x, edge_attr, layer.lin_edge.weight))
        grads.append((out.detach(), gx, ge, gw))
    for name, a, b in zip(("out", "dx", "dedge_attr", "dlin_edge"), grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="edge_attr is required"):
        ours(x, ei)


def test_unsupported_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="dropout"):
        spattn.nn.GATConv(4, 4, dropout=1.0)
    with pytest.raises(NotImplementedError, match="fill_value"):
        spattn.nn.GATConv(4, 4, edge_dim=3, fill_value="median")
    with pytest.raises(NotImplementedError, match="aggr"):
        spattn.nn.GATConv(4, 4, aggr="mean")
    with pytest.raises(NotImplementedError, match="in_channels"):
        spattn.nn.GATConv(-1, 4)
    layer = spattn.nn.GATConv(4, 4)
    x = torch.randn(3, 4)
    ei = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(NotImplementedError, match="return_attention_weights"):
        layer(x, ei, return_attention_weights=True)
    with pytest.warns(spattn.SpattnWarning, match="edge_attr is ignored"):
        torch.testing.assert_close(layer(x, ei, edge_attr=torch.randn(2, 3)), layer(x, ei))
    with pytest.raises(NotImplementedError, match="bipartite"):
        layer((x, torch.randn(2, 4)), ei)
    with pytest.raises(ValueError, match="adjacency is 2 x 2, x has 3 nodes"):
        layer(x, ei.to_sparse())


def test_bad_tensors_raise_naming_the_argument():
    g = spattn.Graph.from_edge_index(torch.tensor([[0, 1, 2], [1, 2, 0]]))
    q = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="k: has shape"):
        spattn.sparse_attention(g, q, q[:, :1], q)
    with pytest.raises(TypeError, match="v: has dtype"):
        spattn.sparse_attention(g, q, q, q.double())
    with pytest.raises(ValueError, match="k: is not contiguous"):
        spattn.sparse_attention(g, q, q.transpose(1, 2).contiguous().transpose(1, 2), q)
    with pytest.raises(ValueError, match="q: has 2 rows"):
        spattn.sparse_attention(g, q[:2], q[:2], q[:2])
    with pytest.raises(TypeError, match="v: expected a torch.Tensor"):
        spattn.sparse_attention(g, q, q, q.numpy())
    with pytest.raises(ValueError, match="edge_index"):
        spattn.Graph.from_edge_index(torch.tensor([[0, 9], [1, 2]]), num_nodes=3)
    with pytest.raises(TypeError, match="q: dtype"):
        spattn.sparse_attention(g, q.int(), q.int(), q.int())
    with pytest.raises(ValueError, match="x has 2 features"):
        spattn.nn.GATConv(4, 4)(torch.randn(3, 2), torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="alpha_dst"):
        spattn.gat_attention(g, q, torch.randn(3, 3), torch.randn(3, 2))


def test_double_backward_is_refused(gen):
    g = spattn.Graph.from_edge_index(torch.tensor([[0, 1, 2], [1, 2, 0]]))
    q = torch.randn(3, 1, 2, dtype=torch.float64, requires_grad=True)
    out = spattn.sparse_attention(g, q, q, q)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        gq.sum().backward()


def test_backward_refuses_row_statistics_of_another_shape():
    from spattn import functional as F

    g = spattn.Graph.from_edge_index(torch.tensor([[0, 1, 2], [1, 2, 0]]))
    q = torch.randn(3, 2, 4)
    out = spattn.sparse_attention(g, q, q, q)
    for bad in (torch.zeros(5), torch.zeros(6, dtype=torch.float64), torch.zeros(12)[::2]):
        with pytest.raises(ValueError, match="lse: expected 6 contiguous float32"):
            F.attention_backward(g, q, q, q, out, out, None, "auto", lse=bad)
    dq, _, _ = F.attention_backward(g, q, q, q, out, out, None, "auto", lse=torch.zeros(6))
    assert torch.isfinite(dq).all()


def test_inference_mode_and_no_grad(gen):
    ei = random_edge_index(gen)
    x = torch.randn(24, 5, generator=gen)
    layer = spattn.nn.GATConv(5, 4, heads=2)
    want = layer(x, ei).detach()
    with torch.inference_mode():
        got = layer(x, ei.clone())  # an inference tensor: no version counter, not cached
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, ei), want)


def test_edge_features_train_after_inference_mode_on_the_same_edge_index(gen):
    # The layers keep the edge order per edge_index tensor: an inference-mode call must not
    # leave inference tensors there for a later training call to save for its backward.
    ei = random_edge_index(gen)
    x = torch.randn(24, 5, generator=gen)
    attr = torch.randn(ei.shape[1], 3, generator=gen)
    layer = spattn.nn.GATConv(5, 4, heads=2, edge_dim=3)
    with torch.inference_mode():
        want = layer(x, ei, attr)
    out = layer(x, ei, attr)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), want)
    assert layer.lin_edge.weight.grad is not None and layer.att_edge.grad is not None


@pytest.mark.skipif(pyg_nn is None, reason="torch_geometric is not installed")
@pytest.mark.parametrize("name", ["GATConv", "GATv2Conv", "TransformerConv"])
def test_edge_rows_kept_for_attributes_without_gradient(gen, name, monkeypatch):
    # Attributes that take no gradient: their filled, ordered rows are kept on the graph, so
    # a second layer (or call) on the same tensors builds nothing; changed attributes are seen.
    import spattn.nn as snn

    ei = random_edge_index(gen)
    ei = torch.cat([ei, torch.tensor([[3, 7], [3, 7]])], dim=1)  # loops a GAT layer replaces
    ei = torch.unique(ei, dim=1)
    ei = ei[:, torch.randperm(ei.shape[1], generator=gen)]
    x = torch.randn(24, 5, dtype=torch.float64, generator=gen)
    attr = torch.randn(ei.shape[1], 3, dtype=torch.float64, generator=gen)
    kw = {"heads": 2, "edge_dim": 3}
    theirs = getattr(pyg_nn, name)(5, 4, **kw).double()
    ours = getattr(snn, name)(5, 4, **kw).double()
    ours.load_state_dict(theirs.state_dict())
    built = []
    order = snn._edges_in_csr_order
    monkeypatch.setattr(snn, "_edges_in_csr_order", lambda *a: built.append(1) or order(*a))
    for _ in range(2):
        outs = [layer(x, ei, attr) for layer in (ours, theirs)]
        grads = [torch.autograd.grad(o.sum(), layer.lin_edge.weight)[0]
                 for o, layer in zip(outs, (ours, theirs))]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    assert len(built) == 1  # ordered once for both calls
    attr.mul_(-2.0)  # in place: a new version, rows built again
    torch.testing.assert_close(ours(x, ei, attr), theirs(x, ei, attr), rtol=1e-10, atol=1e-12)
    assert len(built) == 2
    grad = attr.clone().requires_grad_()  # takes a gradient: never kept
    ours(x, ei, grad).sum().backward()
    ours(x, ei, grad).sum().backward()
    assert len(built) == 4 and grad.grad is not None
    # Another kind of layer on the same graph keeps its own rows (no eviction either way).
    other = snn.TransformerConv(5, 4, **kw) if name != "TransformerConv" else None
    graph = snn.graph_for(ei, 24, name != "TransformerConv")
    ours(x, ei, attr)  # still kept from before the gradient calls
    assert len(built) == 4
    if other is not None:
        other.double()(x, ei, attr)
        ours(x, ei, attr)
        assert len(built) == 5  # the transformer's rows built once; ours not again
    assert (snn._ROWS, name) in graph._derived
    del attr
    assert (snn._ROWS, name) not in graph._derived  # forgotten with the attributes


def test_gat_auto_kernels_follow_the_native_rule(gen):
    # The package's "auto" is the native GatKernels::auto (which the Rust layer follows too).
    from spattn import _native
    from spattn import functional as Fn

    g = spattn.Graph.from_edge_index(random_edge_index(gen), num_nodes=24)
    many, one = (torch.zeros(24, h, 32, dtype=torch.float16) for h in (_native.GAT_ROWS_MIN_HEADS, 1))
    assert Fn._gat_kernels(g, many, "auto", False) == "rows"
    assert Fn._gat_kernels(g, many, "auto", True) == "rows"
    assert Fn._gat_kernels(g, many, "auto", True, rows=False) == "fused"
    # One head on a small graph: rows too; the fused backward where the forward's output is not
    # at hand.
    assert Fn._gat_kernels(g, one, "auto", False) == "rows"
    assert Fn._gat_kernels(g, one, "auto", True) == "rows"
    assert Fn._gat_kernels(g, one, "auto", True, rows=False) == "fused"
    assert Fn._gat_kernels(g, one, "composed", True) == "composed"  # asked for by name
    small, past = _native.GAT_ROWS_SMALL_MAX_EDGES, _native.GAT_ROWS_SMALL_MAX_EDGES + 1
    assert _native.GAT_FUSED_MAX_EDGES < small
    assert _native.gat_auto_kernels("f16", 1, 32, small, False, True) == "rows"
    assert _native.gat_auto_kernels("f16", 1, 32, past, False, True) == "composed"
    assert _native.gat_auto_kernels("f16", 1, 32, past, True, True) == "composed"
    assert _native.gat_auto_kernels("f16", 1, 32, _native.GAT_FUSED_MAX_EDGES, True, False) == "fused"
    assert _native.gat_auto_kernels("f16", _native.GAT_ROWS_MIN_HEADS, 32, past, True, True) == "rows"
    with pytest.raises(TypeError, match="dtype"):
        _native.gat_auto_kernels("int8", 1, 32, 10, True, True)


def test_gat_edge_scores_stay_float32_under_autocast(gen):
    from spattn.nn import _folded_edge_scores

    attr = torch.randn(10, 3, generator=gen)
    weight, att = torch.randn(8, 3, generator=gen), torch.randn(1, 2, 4, generator=gen)
    want = (attr @ weight.t()).view(10, 2, 4).mul(att).sum(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _folded_edge_scores(attr, weight, att, 2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_call_arguments_from_tensors():
    from spattn import _tensors as T

    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
    for dt, name in names.items():
        assert T.dtype_name(dt) == name  # torch dtypes: the per-call lookup
        assert T.dtype_name(str(dt)) == name  # the same names from text
    assert T.dtype_name(np.dtype("float32")) == "f32"
    assert T.dtype_name(torch.int32) is None and T.dtype_name(np.dtype("int64")) is None
    x = torch.zeros(2, 3)
    assert T.device_index(x) == -1 and T.stream_of(x) == 0  # the CPU: no device, no stream


def test_head_dot_on_the_cpu_and_its_contract():
    """GAT's score terms on the CPU (torch ops, float32 results, float64 kept) with autograd, and
    the native entry points' checks: a non-contiguous x, an attention vector of the wrong dtype
    or length, and a d_out of the wrong shape are named before anything runs."""
    from spattn.functional import head_dot, head_dot_backward, head_dot_forward

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    att = torch.randn(1, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    out = head_dot(x, att)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, (x * att).sum(-1))
    out.sum().backward()
    torch.testing.assert_close(att.grad, x.detach().sum(0, keepdim=True))
    x32 = torch.randn(7, 3, 5, generator=gen)
    att32 = torch.randn(15, generator=gen)
    got = head_dot_forward(x32, att32)
    torch.testing.assert_close(got, (x32 * att32.view(3, 5)).sum(-1))
    d = torch.randn(7, 3, generator=gen)
    dx, d_att = head_dot_backward(x32, att32, d)
    torch.testing.assert_close(dx, d[..., None] * att32.view(3, 5))
    torch.testing.assert_close(d_att, (d[..., None] * x32).sum(0).reshape(-1))
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        head_dot_forward(x32.transpose(0, 1), att32)
    with pytest.raises(ValueError, match="att: expected a contiguous float32"):
        head_dot_forward(x32, att32.double())
    with pytest.raises(ValueError, match="att: expected a contiguous float32"):
        head_dot_forward(x32, att32[:14])
    with pytest.raises(ValueError, match="d_out: has shape"):
        head_dot_backward(x32, att32, d[:6])
    # Two vectors at once (GAT's source and target): scores (2, rows, heads), the outer
    # products summed into one dx, each vector's gradient apart; five are refused.
    att2 = torch.randn(2, 15, generator=gen)
    got = head_dot_forward(x32, att2.reshape(-1))
    torch.testing.assert_close(got, torch.stack([(x32 * a.view(3, 5)).sum(-1) for a in att2]))
    d2 = torch.randn(2, 7, 3, generator=gen)
    dx, d_att = head_dot_backward(x32, att2.reshape(-1), d2)
    torch.testing.assert_close(dx, sum(d2[t][..., None] * att2[t].view(3, 5) for t in range(2)))
    torch.testing.assert_close(d_att.view(2, 15), (d2[..., None] * x32).sum(1).reshape(2, 15))
    out2 = head_dot(x, torch.stack((att, 2 * att)))
    assert out2.shape == (2, 7, 3)
    torch.testing.assert_close(out2[1], 2 * out2[0])
    with pytest.raises(ValueError, match="att: expected a contiguous float32"):
        head_dot_forward(x32, torch.randn(75, generator=gen))
