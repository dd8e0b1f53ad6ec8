"""Attention with a per-edge bias, dropout and the attention weights out
(``sparse_attention(bias=, dropout=, return_attention_weights=)``): against a dense float64
reference whose dropout mask is an independent numpy Philox 4×32-10 (the documented mask),
gradients by gradcheck, the layers' dropout, and errors naming the argument. The CUDA tests
(skipped without a GPU) check every dtype against the same reference and the CPU's mask.
Skipped where torch is not installed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import spattn  # noqa: E402
import spattn.nn  # noqa: E402
from conftest import BUNDLED_CORA  # noqa: E402

CUDA = torch.cuda.is_available() and spattn.cuda_device_count() > 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")


# ---- the documented dropout mask, independently ------------------------------------------------


def philox_words(counter_lo, counter_hi, offset, seed):
    """The four output words of Philox 4×32-10 for counters [lo, hi, offset lo, offset hi] under
    key [seed lo, seed hi] (numpy, vectorised over the counters)."""
    m = np.uint64(0xFFFFFFFF)
    c0 = counter_lo.astype(np.uint64)
    c1 = counter_hi.astype(np.uint64)
    c2 = np.full_like(c0, offset & 0xFFFFFFFF)
    c3 = np.full_like(c0, offset >> 32)
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0),
            p1 & m,
            (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1),
            p0 & m,
        )
    return c0, c1, c2, c3


def dropout_factor(num_edges, heads, rate, seed, offset=0):
    """``num_edges × heads`` factors: 0 dropped, 1/(1 - rate) kept (rate as float32)."""
    rate = float(np.float32(rate))
    i = np.arange(num_edges * heads, dtype=np.uint64)
    c = i >> np.uint64(2)  # one draw, four consecutive elements: word i mod 4
    words = philox_words(c & np.uint64(0xFFFFFFFF), c >> np.uint64(32), offset, seed)
    word = np.choose((i & np.uint64(3)).astype(np.int64), words)
    keep = word >= np.uint64(int(np.floor(rate * 2.0**32)))
    return np.where(keep, 1.0 / (1.0 - rate), 0.0).reshape(num_edges, heads)


def reference(graph, q, k, v, scale, bias=None, factor=None, features=None):
    """Dense float64: out and the weights (num_edges × heads, CSR order); `features`
    (num_edges × heads × head_dim) are added to each edge's key and value."""
    q, k, v = (np.asarray(t.detach().double().cpu()) for t in (q, k, v))
    n, h, _ = q.shape
    crow, col = graph.crow(), graph.col()
    rows = np.repeat(np.arange(n), np.diff(crow))
    ke, ve = k[col], v[col]
    if features is not None:
        f = np.asarray(features.detach().double().cpu())
        ke, ve = ke + f, ve + f
    s = np.einsum("ehd,ehd->eh", q[rows], ke) * scale
    if bias is not None:
        b = np.asarray(bias.detach().double().cpu())
        s = s + (b[:, None] if b.ndim == 1 else b)
    p = np.zeros_like(s)
    for i in range(n):
        lo, hi = crow[i], crow[i + 1]
        if hi > lo:
            m = s[lo:hi].max(axis=0)
            m = np.where(np.isfinite(m), m, 0.0)
            e = np.exp(s[lo:hi] - m)
            z = e.sum(axis=0)
            p[lo:hi] = np.divide(e, z, out=np.zeros_like(e), where=z != 0)  # NaN z: NaN
    w = p if factor is None else p * factor
    out = np.zeros_like(q)
    np.add.at(out, rows, w[:, :, None] * ve)
    return out, w


def rel(a, b) -> float:
    a = np.asarray(a.detach().double().cpu()) if torch.is_tensor(a) else np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    n = np.linalg.norm(b.ravel())
    d = np.linalg.norm((a - b).ravel())
    return float(d / n) if n > 0 else float(d)


def random_graph(gen, n=30, e=140):
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n, (e,), generator=gen)
    ei = torch.unique(torch.stack([src, dst]), dim=1)
    return spattn.Graph.from_edge_index(ei[:, ei[1] != 4], num_nodes=n)  # row 4 has no edges


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(5)


# ---- CPU -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["shared", "per_head"])
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_cpu_matches_reference(gen, layout, rate):
    g = random_graph(gen)
    h, d = 3, 5
    q, k, v = (torch.randn(g.num_nodes, h, d, dtype=torch.float64, generator=gen) for _ in range(3))
    shape = (g.num_edges,) if layout == "shared" else (g.num_edges, h)
    bias = torch.randn(*shape, dtype=torch.float64, generator=gen)
    out, w = spattn.sparse_attention(
        g, q, k, v, scale=0.7, bias=bias, dropout=rate, dropout_seed=11,
        return_attention_weights=True,
    )
    factor = dropout_factor(g.num_edges, h, rate, 11) if rate else None
    want, want_w = reference(g, q, k, v, 0.7, bias, factor)
    assert rel(out, want) < 1e-12
    assert rel(w, want_w) < 1e-12
    assert w.shape == (g.num_edges, h)


def test_cpu_edge_features_match_reference_and_gradcheck(gen):
    g = random_graph(gen, n=12, e=40)
    h, d = 2, 3
    q, k, v = (torch.randn(12, h, d, dtype=torch.float64, generator=gen, requires_grad=True)
               for _ in range(3))
    f = torch.randn(g.num_edges, h, d, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(g.num_edges, dtype=torch.float64, generator=gen, requires_grad=True)
    out = spattn.sparse_attention(g, q, k, v, scale=0.8, bias=b, edge_features=f,
                                  dropout=0.2, dropout_seed=5)
    want, _ = reference(g, q, k, v, 0.8, b, dropout_factor(g.num_edges, h, 0.2, 5), f)
    assert rel(out, want) < 1e-12

    def fn(q, k, v, f, b):
        return spattn.sparse_attention(g, q, k, v, scale=0.8, bias=b, edge_features=f,
                                       dropout=0.2, dropout_seed=5)

    assert torch.autograd.gradcheck(fn, (q, k, v, f, b))
    with pytest.raises(ValueError, match=r"edge_features: has shape"):
        spattn.sparse_attention(g, q, k, v, edge_features=f[:-1])


def test_graph_edge_positions_map_input_order_to_csr_order(gen):
    ei = torch.unique(torch.randint(0, 30, (2, 120), generator=gen), dim=1)
    ei = ei[:, torch.randperm(ei.shape[1], generator=gen)]
    g = spattn.Graph.from_edge_index(ei, num_nodes=30)
    pos = g.edge_positions(ei)
    assert torch.equal(g.edge_index()[:, pos], ei)
    have = set(zip(ei[0].tolist(), ei[1].tolist()))
    src, dst = next((s, d) for s in range(30) for d in range(30) if (s, d) not in have)
    with pytest.raises(ValueError, match=rf"edge 1 \({src} -> {dst}\) is not in the graph"):
        g.edge_positions(torch.tensor([[int(ei[0, 0]), src], [int(ei[1, 0]), dst]]))
    with pytest.raises(ValueError, match="not in the graph"):
        g.edge_positions(torch.tensor([[0], [30]]))  # a node past the graph


def test_cpu_dropout_mask_is_the_documented_one(gen):
    g = random_graph(gen, n=60, e=900)
    h = 4
    q = torch.randn(g.num_nodes, h, 8, generator=gen)
    _, w = spattn.sparse_attention(g, q, q, q, dropout=0.5, dropout_seed=2**40 + 3,
                                   return_attention_weights=True)
    dropped = (w == 0).numpy()
    want = dropout_factor(g.num_edges, h, 0.5, 2**40 + 3) == 0
    assert (dropped == want).all()
    assert 0.4 < dropped.mean() < 0.6
    # A seed from torch's generator: torch.manual_seed reproduces the mask.
    torch.manual_seed(3)
    _, w1 = spattn.sparse_attention(g, q, q, q, dropout=0.5, return_attention_weights=True)
    torch.manual_seed(3)
    _, w2 = spattn.sparse_attention(g, q, q, q, dropout=0.5, return_attention_weights=True)
    _, w3 = spattn.sparse_attention(g, q, q, q, dropout=0.5, return_attention_weights=True)
    assert torch.equal(w1, w2)
    assert not torch.equal(w1, w3)


@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_cpu_gradcheck_with_bias_and_dropout(gen, layout):
    g = random_graph(gen, n=12, e=40)
    h = 2
    q, k, v = (torch.randn(12, h, 3, dtype=torch.float64, generator=gen, requires_grad=True)
               for _ in range(3))
    shape = (g.num_edges,) if layout == "shared" else (g.num_edges, h)
    bias = torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)

    def f(q, k, v, bias):
        return spattn.sparse_attention(g, q, k, v, scale=0.9, bias=bias, dropout=0.25,
                                       dropout_seed=99)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


def test_cpu_minus_infinity_masks_an_edge(gen):
    g = random_graph(gen)
    q = torch.randn(g.num_nodes, 1, 4, generator=gen)
    bias = torch.zeros(g.num_edges)
    bias[0] = float("-inf")
    out, w = spattn.sparse_attention(g, q, q, q, bias=bias, return_attention_weights=True)
    assert w[0, 0] == 0
    want, _ = reference(g, q, q, q, 0.5, bias)
    assert rel(out, want) < 1e-6


def test_cpu_half_precision_widens(gen):
    g = random_graph(gen)
    q = torch.randn(g.num_nodes, 2, 8, generator=gen).to(torch.bfloat16)
    bias = torch.randn(g.num_edges, 2, generator=gen).to(torch.bfloat16)
    out, w = spattn.sparse_attention(g, q, q, q, bias=bias, return_attention_weights=True)
    assert out.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
    want, _ = reference(g, q, q, q, 8**-0.5, bias)
    assert rel(out, want) < 2e-2


def test_errors_name_the_argument(gen):
    g = random_graph(gen)
    q = torch.randn(g.num_nodes, 2, 4, generator=gen)
    with pytest.raises(ValueError, match=r"bias: has shape \(3,\)"):
        spattn.sparse_attention(g, q, q, q, bias=torch.zeros(3))
    with pytest.raises(TypeError, match="bias: expected a torch.Tensor"):
        spattn.sparse_attention(g, q, q, q, bias=np.zeros(g.num_edges))
    with pytest.raises(TypeError, match="bias: expected a floating-point"):
        spattn.sparse_attention(g, q, q, q, bias=torch.zeros(g.num_edges, dtype=torch.int64))
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="dropout: the rate must be in"):
            spattn.sparse_attention(g, q, q, q, dropout=bad)
    with pytest.raises(TypeError, match="dropout: expected a float"):
        spattn.sparse_attention(g, q, q, q, dropout="0.1")
    with pytest.raises(ValueError, match="dropout_seed: expected an integer"):
        spattn.sparse_attention(g, q, q, q, dropout=0.1, dropout_seed=-1)
    with pytest.raises(TypeError, match="need torch tensors"):
        spattn.sparse_attention(g, q.numpy(), q.numpy(), q.numpy(), dropout=0.1)
    nan_bias = torch.zeros(g.num_edges)
    nan_bias[3] = float("nan")
    with pytest.raises(Exception, match="bias"):
        spattn.sparse_attention(g, q, q, q, bias=nan_bias)


def test_transformer_conv_dropout_and_weights(gen):
    torch.manual_seed(0)
    ei = torch.unique(torch.randint(0, 20, (2, 80), generator=gen), dim=1)
    x = torch.randn(20, 8, generator=gen)
    layer = spattn.nn.TransformerConv(8, 4, heads=2, dropout=0.5)
    layer.eval()
    out_eval, (ei_out, alpha) = layer(x, ei, return_attention_weights=True)
    assert alpha.shape == (ei_out.shape[1], 2)
    g = spattn.nn.graph_for(ei, 20)
    row_sums = torch.zeros(20, 2).index_add_(0, ei_out[1], alpha)
    has_edges = torch.from_numpy(np.diff(g.crow()) > 0)
    assert torch.allclose(row_sums[has_edges], torch.ones(2), atol=1e-5)  # eval: no dropout
    assert torch.allclose(out_eval, layer(x, ei), atol=1e-6)
    layer.train()
    out_train, (_, alpha_train) = layer(x, ei, return_attention_weights=True)
    assert (alpha_train == 0).any()
    assert not torch.allclose(out_train, out_eval)
    out_train.sum().backward()
    assert layer.lin_query.weight.grad is not None
    with pytest.raises(ValueError, match="dropout"):
        spattn.nn.TransformerConv(8, 4, dropout=1.5)


def test_transformer_conv_edge_features_follow_the_edge_index(gen):
    ei = torch.unique(torch.randint(0, 20, (2, 80), generator=gen), dim=1)
    x = torch.randn(20, 8, generator=gen)
    ea = torch.randn(ei.shape[1], 3, generator=gen)
    layer = spattn.nn.TransformerConv(8, 4, heads=2, edge_dim=3).eval()
    first = layer(x, ei, ea)
    g = spattn.nn.graph_for(ei, 20)
    pos = spattn.nn._edge_positions_cached(g, ei)
    assert spattn.nn._edge_positions_cached(g, ei) is pos  # kept for the same tensor
    assert torch.equal(pos, g.edge_positions(ei))
    assert torch.equal(layer(x, ei, ea), first)
    # The same edges in another order, in place: the positions follow the tensor.
    perm = torch.randperm(ei.shape[1], generator=gen)
    ei.copy_(ei[:, perm].clone())
    assert torch.allclose(layer(x, ei, ea[perm]), first, atol=1e-6)
    assert not torch.allclose(layer(x, ei, ea), first, atol=1e-3)


def gat_reference(graph, x, a_dst, a_src, slope, factor):
    """Dense float64 GAT attention with the dropout factors (num_edges × heads) applied."""
    x, a_dst, a_src = (np.asarray(t.detach().double().cpu()) for t in (x, a_dst, a_src))
    n, h = graph.num_nodes, x.shape[1]
    crow, col = graph.crow(), graph.col()
    rows = np.repeat(np.arange(n), np.diff(crow))
    e = a_dst[rows] + a_src[col]
    e = np.where(e >= 0, e, slope * e)
    p = np.zeros_like(e)
    for i in range(n):
        lo, hi = crow[i], crow[i + 1]
        if hi > lo:
            z = np.exp(e[lo:hi] - e[lo:hi].max(axis=0))
            p[lo:hi] = z / z.sum(axis=0)
    out = np.zeros((n, h, x.shape[2]))
    np.add.at(out, rows, (p * factor)[:, :, None] * x[col])
    return out


def test_cpu_gat_dropout_matches_reference_and_gradcheck(gen):
    g = random_graph(gen, n=14, e=50)
    h = 2
    x = torch.randn(14, h, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    a_dst, a_src = (torch.randn(14, h, dtype=torch.float64, generator=gen, requires_grad=True)
                    for _ in range(2))
    out = spattn.gat_attention(g, x, a_dst, a_src, 0.2, dropout=0.4, dropout_seed=21)
    want = gat_reference(g, x, a_dst, a_src, 0.2, dropout_factor(g.num_edges, h, 0.4, 21))
    assert rel(out, want) < 1e-12

    def f(x, a_dst, a_src):
        return spattn.gat_attention(g, x, a_dst, a_src, 0.2, dropout=0.4, dropout_seed=21)

    assert torch.autograd.gradcheck(f, (x, a_dst, a_src))


def test_gat_conv_dropout_in_training_only(gen):
    ei = torch.unique(torch.randint(0, 20, (2, 80), generator=gen), dim=1)
    x = torch.randn(20, 8, generator=gen)
    layer = spattn.nn.GATConv(8, 4, heads=2, dropout=0.6)
    layer.eval()
    out_eval = layer(x, ei)
    assert torch.equal(out_eval, layer(x, ei))
    layer.train()
    torch.manual_seed(1)
    out_a = layer(x, ei)
    torch.manual_seed(1)
    out_b = layer(x, ei)
    assert torch.equal(out_a, out_b)  # torch.manual_seed reproduces the mask
    assert not torch.allclose(out_a, out_eval)
    out_a.sum().backward()
    assert layer.att_src.grad is not None and layer.att_src.grad.abs().sum() > 0


# ---- CUDA ----------------------------------------------------------------------------------

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def cora():
    g = spattn.Graph.read_matrix_market(BUNDLED_CORA, symmetrize=True).with_self_loops()
    return g


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_cuda_matches_reference_and_cpu_mask(dtype, layout):
    g = cora()
    h, d = 4, 32
    gen = torch.Generator().manual_seed(9)
    q, k, v, dy = (torch.randn(g.num_nodes, h, d, generator=gen).to(dtype) for _ in range(4))
    shape = (g.num_edges,) if layout == "shared" else (g.num_edges, h)
    bias = torch.randn(*shape, generator=gen).to(dtype)
    rate, seed = 0.2, 1234
    qc, kc, vc, bc = (t.cuda().requires_grad_() for t in (q, k, v, bias))
    out, w = spattn.sparse_attention(g, qc, kc, vc, bias=bc, dropout=rate, dropout_seed=seed,
                                     return_attention_weights=True)
    assert out.dtype == dtype and w.dtype == torch.float32
    factor = dropout_factor(g.num_edges, h, rate, seed)
    want, want_w = reference(g, q, k, v, d**-0.5, bias, factor)
    assert rel(out, want) < TOL[dtype]
    assert rel(w, want_w) < max(TOL[dtype], 1e-6)
    assert ((w.cpu() == 0).numpy() == (factor == 0)).all()  # the CPU's mask, exactly
    # Gradients against the CPU path in float64 on the same rounded inputs.
    out.backward(dy.cuda())
    q64, k64, v64, b64 = (t.double().requires_grad_() for t in (q, k, v, bias))
    o64 = spattn.sparse_attention(g, q64, k64, v64, bias=b64, dropout=rate, dropout_seed=seed)
    o64.backward(dy.double())
    for name, got, want_g in (("dq", qc.grad, q64.grad), ("dk", kc.grad, k64.grad),
                              ("dv", vc.grad, v64.grad), ("dbias", bc.grad, b64.grad)):
        err = rel(got, want_g.numpy())
        print(f"  {layout} {str(dtype)[6:]} {name}: {err:.2e}")
        assert err < 4 * TOL[dtype], name


@needs_cuda
@pytest.mark.parametrize("features", [False, True], ids=["bias", "bias+features"])
@pytest.mark.parametrize("algorithm", spattn.ALGORITHMS)
def test_cuda_rows_of_masked_edges_give_zeros(algorithm, features):
    # A row whose every edge a -inf bias masks gets zeros and zero weights, as on the CPU, on
    # every algorithm (the composed ones' edge softmax once gave NaN there).
    g = cora()
    h, d = 2, 16
    gen = torch.Generator().manual_seed(12)
    q, k, v, dy = (torch.randn(g.num_nodes, h, d, generator=gen).half() for _ in range(4))
    bias = torch.randn(g.num_edges, h, generator=gen)
    rows = torch.repeat_interleave(torch.arange(g.num_nodes), torch.as_tensor(g.crow()).diff())
    bias[rows % 3 == 0] = float("-inf")  # whole rows, both heads
    bias[(rows % 3 == 1) & (torch.arange(g.num_edges) % 2 == 0), 1] = float("-inf")
    bias = bias.to(torch.float16)
    f = torch.randn(g.num_edges, h, d, generator=gen).half() if features else None
    qc, kc, vc, bc = (t.cuda().requires_grad_() for t in (q, k, v, bias))
    try:
        out, w = spattn.sparse_attention(g, qc, kc, vc, bias=bc, return_attention_weights=True,
                                         edge_features=None if f is None else f.cuda(),
                                         algorithm=algorithm)
    except Exception as e:  # hybrid refuses edge features, naming who takes them
        assert algorithm == "hybrid" and features and "fused-csr" in str(e)
        return
    masked, edges = (torch.arange(g.num_nodes) % 3 == 0).cuda(), (rows % 3 == 0).cuda()
    assert (out[masked] == 0).all() and (w[edges] == 0).all()
    want, want_w = reference(g, q, k, v, d**-0.5, bias, features=f)
    assert rel(out, want) < TOL[torch.float16] and rel(w, want_w) < TOL[torch.float16]
    out.backward(dy.cuda())
    # The gradients against the CPU's float64 autograd of the same (f16-rounded) inputs.
    cpu = [t.double().requires_grad_() for t in (q, k, v, bias)]
    o64 = spattn.sparse_attention(g, *cpu[:3], bias=cpu[3],
                                  edge_features=None if f is None else f.double())
    o64.backward(dy.double())
    for name, t, t64 in zip(("dq", "dk", "dv", "dbias"), (qc, kc, vc, bc), cpu):
        assert torch.isfinite(t.grad).all(), name
        assert rel(t.grad, t64.grad.numpy()) < 4 * TOL[torch.float16], name
    assert (bc.grad[edges] == 0).all()


def _nan_column(seed):
    """Cora with rows % 3 == 0 masked by a -inf bias (both heads), and a column j of the
    busiest masked row (79 edges: split into units) whose own row is live: a NaN in node j's
    key (or GAT's a_src) makes one score NaN in each row with an edge to j, masked or not.
    Returns the graph, a generator, j, the rows reaching j, the masked rows and the bias."""
    g = cora()
    gen = torch.Generator().manual_seed(seed)
    crow, col = torch.as_tensor(g.crow()), torch.as_tensor(g.col()).long()
    rows = torch.repeat_interleave(torch.arange(g.num_nodes), crow.diff())
    bias = torch.randn(g.num_edges, 2, generator=gen)
    bias[rows % 3 == 0] = float("-inf")
    masked = torch.arange(g.num_nodes) % 3 == 0
    hub = int(torch.argmax(torch.where(masked, crow.diff(), 0)))
    j = next(int(c) for c in col[crow[hub]:crow[hub + 1]] if c % 3 != 0)
    reach = torch.zeros(g.num_nodes, dtype=torch.bool)
    reach[rows[col == j]] = True
    assert reach[hub] and reach[j] and crow[hub + 1] - crow[hub] > 64
    return g, gen, j, reach, masked, bias


def _assert_nan_rows(out, reach, masked):
    # Head 0: NaN on the rows reaching the NaN score, zeros on the other masked rows, finite
    # elsewhere; head 1 saw no NaN.
    dev = out.device
    reach, masked = reach.to(dev), masked.to(dev)
    assert torch.isnan(out[reach, 0]).all()
    assert (out[masked & ~reach, 0] == 0).all() and torch.isfinite(out[~masked & ~reach, 0]).all()
    assert (out[masked, 1] == 0).all() and torch.isfinite(out[:, 1]).all()


@pytest.mark.parametrize("dim", [16, 64])  # 64: hybrid's pipelined kernel and its merge
@pytest.mark.parametrize("algorithm", ["cpu", *spattn.ALGORITHMS])
def test_a_nan_score_makes_its_row_nan_masked_rows_included(algorithm, dim):
    # One NaN score in a row makes that row's head NaN, forward and backward (dQ), on every
    # path, also where every other score of the row is -inf (a masked row is no way to hide a
    # NaN: the CPU, the fused CUDA-core backward, hybrid's merges and fused-csr's split rows
    # once gave zeros there), and reaches no other row's output.
    if algorithm != "cpu" and not CUDA:
        pytest.skip("needs an NVIDIA GPU")
    g, gen, j, reach, masked, bias = _nan_column(16)
    q, k, v, dy = (torch.randn(g.num_nodes, 2, dim, generator=gen) for _ in range(4))
    k[j, 0, 0] = float("nan")
    dev, dtype = ("cpu", torch.float64) if algorithm == "cpu" else ("cuda", torch.float16)
    kw = {} if algorithm == "cpu" else {"algorithm": algorithm}
    qc, kc, vc, bc = (t.to(dev, dtype).requires_grad_() for t in (q, k, v, bias))
    out = spattn.sparse_attention(g, qc, kc, vc, bias=bc, **kw)
    _assert_nan_rows(out, reach, masked)
    out.backward(dy.to(dev, dtype))
    assert torch.isnan(qc.grad[reach.to(dev), 0]).all()


@pytest.mark.parametrize("kernels", ["cpu", "rows", "fused", "composed"])
def test_a_nan_score_makes_its_gat_row_nan_masked_rows_included(kernels):
    # GAT's kernel sets, as above: a NaN a_src of node j makes one score NaN in each row with
    # an edge to j, so those rows' output and d_dst (the fused row pass once weighed it 0).
    import spattn.functional as Fn
    if kernels != "cpu" and not CUDA:
        pytest.skip("needs an NVIDIA GPU")
    g, gen, j, reach, masked, bias = _nan_column(17)
    x, dy = (torch.randn(g.num_nodes, 2, 8, generator=gen) for _ in range(2))
    a_dst, a_src = (torch.randn(g.num_nodes, 2, generator=gen) for _ in range(2))
    a_src[j, 0] = float("nan")
    if kernels == "cpu":
        t64 = [t.double().requires_grad_() for t in (x, a_dst, a_src, bias)]
        out = spattn.gat_attention(g, *t64[:3], 0.2, bias=t64[3])
        out.backward(dy.double())
        d_dst = t64[1].grad
    else:
        xc, dc, sc, bc, dyc = (t.cuda() for t in (x, a_dst, a_src, bias, dy))
        out, _ = Fn.gat_forward_keeping(g, xc, dc, sc, bc, 0.2, None, "rows")
        if kernels == "composed":
            out = Fn.gat_forward(g, xc, dc, sc, bc, 0.2, None, "composed")
        d_dst = Fn.gat_backward(g, xc, dc, sc, dyc, bc, 0.2, None, kernels=kernels, out=out)[1]
    _assert_nan_rows(out, reach, masked)
    dev = out.device
    assert torch.isnan(d_dst[reach.to(dev), 0]).all()
    assert torch.isfinite(d_dst[(~reach).to(dev), 0]).all() and torch.isfinite(d_dst[:, 1]).all()


@needs_cuda
def test_cuda_hybrid_refuses_edge_features_and_says_which_take_them():
    g = cora()
    q = torch.randn(g.num_nodes, 1, 16, device="cuda", dtype=torch.float16)
    f = torch.randn(g.num_edges, 1, 16, device="cuda", dtype=torch.float16)
    with pytest.raises(Exception, match="fused-csr"):
        spattn.sparse_attention(g, q, q, q, edge_features=f, algorithm="hybrid")
    # A bias or dropout without edge features: fused-tc's kernel in f16, fused-csr's in f32.
    assert g.plan(1, 16, dtype="float16", extras=True)["algorithm"] == "fused-tc"
    assert g.plan(1, 16, dtype="float32", extras=True)["algorithm"] == "fused-csr"
    with_features = g.plan(1, 16, dtype="float16", extras=True, edge_features=True)
    assert with_features["algorithm"] == "fused-csr"
    # Auto with edge features runs them (on fused-csr's kernel), and fused-tc (through the
    # composition at 16 features), both against the CPU in float64.
    q64, f64 = q.double().cpu(), f.double().cpu()
    want = spattn.sparse_attention(g, q64, q64, q64, edge_features=f64)
    for algorithm in ("auto", "fused-tc"):
        out = spattn.sparse_attention(g, q, q, q, edge_features=f, algorithm=algorithm)
        assert rel(out, want.numpy()) < TOL[torch.float16], algorithm


def _dropout_graph(case):
    """cora with 4 heads of 16; or 5 heads of 8 on 1,001 random nodes, whose row statistics
    (n × heads floats) end off a 16-byte boundary, with the rows kernels' dropout mask right
    after them in the forward's workspace."""
    if case == "cora":
        return cora(), 4, 16
    gen = torch.Generator().manual_seed(9)
    ei = torch.unique(torch.randint(0, 1001, (2, 6000), generator=gen), dim=1)
    return spattn.Graph.from_edge_index(ei, num_nodes=1001, self_loops=True), 5, 8


@needs_cuda
@pytest.mark.parametrize("case", ["cora", "unaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
def test_cuda_gat_dropout_matches_the_cpu(dtype, case):
    g, h, c = _dropout_graph(case)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(g.num_nodes, h, c, generator=gen).to(dtype)
    a_dst, a_src = (torch.randn(g.num_nodes, h, generator=gen) for _ in range(2))
    dy = torch.randn(g.num_nodes, h, c, generator=gen).to(dtype)
    xc, dc, sc = (t.cuda().requires_grad_() for t in (x, a_dst, a_src))
    out = spattn.gat_attention(g, xc, dc, sc, 0.2, dropout=0.6, dropout_seed=77)
    out.backward(dy.cuda())
    x64, d64, s64 = (t.double().requires_grad_() for t in (x, a_dst, a_src))
    o64 = spattn.gat_attention(g, x64, d64, s64, 0.2, dropout=0.6, dropout_seed=77)
    o64.backward(dy.double())
    assert rel(out, o64.detach().numpy()) < TOL[dtype]
    # The mask and where the backward applies it are the same in every dtype: the gradients
    # are checked in float32 (da_dst, da_src are row sums that cancel, ill-conditioned in half
    # precision; test_gpu.py bounds those by their condition number).
    grads = [("dx", xc.grad, x64.grad)]
    if dtype == torch.float32:
        grads += [("da_dst", dc.grad, d64.grad), ("da_src", sc.grad, s64.grad)]
    for name, got, want in grads:
        err = rel(got, want.numpy())
        print(f"  gat dropout {case} {str(dtype)[6:]} {name}: {err:.2e}")
        assert err < (1e-4 if dtype == torch.float32 else 4 * TOL[dtype]), name
    # The rows backward reads the forward's kept mask (autograd, above) or draws it again
    # (no lse): the same bits. A workspace of another length is refused by name.
    import spattn.functional as Fn
    drop = Fn._check_dropout(0.6, 77)
    xd, dd, sd = (t.detach() for t in (xc, dc, sc))
    out2, lse = Fn.gat_forward_keeping(g, xd, dd, sd, None, 0.2, drop)
    assert torch.equal(out2, out.detach()) and lse is not None
    dyc = dy.cuda()
    kept = Fn.gat_backward(g, xd, dd, sd, dyc, None, 0.2, drop, out=out2, lse=lse)
    drawn = Fn.gat_backward(g, xd, dd, sd, dyc, None, 0.2, drop, out=out2)
    for a, b in zip(kept[:3], drawn[:3]):
        assert torch.equal(a, b)
    assert torch.equal(kept[0], xc.grad)
    with pytest.raises(ValueError, match="lse: expected"):
        Fn.gat_backward(g, xd, dd, sd, dyc, None, 0.2, drop, out=out2, lse=lse[:-1])


@needs_cuda
@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
def test_cuda_edge_features_match_the_cpu(dtype, rate):
    # With dropout too: the fused backward draws the forward's mask again (a seed given).
    g = cora()
    h, d = 2, 16
    gen = torch.Generator().manual_seed(6)
    q, k, v, dy = (torch.randn(g.num_nodes, h, d, generator=gen).to(dtype) for _ in range(4))
    f = (0.5 * torch.randn(g.num_edges, h, d, generator=gen)).to(dtype)
    qc, kc, vc, fc = (t.cuda().requires_grad_() for t in (q, k, v, f))
    drop = {"dropout": rate, "dropout_seed": 321}
    out = spattn.sparse_attention(g, qc, kc, vc, edge_features=fc, **drop)
    out.backward(dy.cuda())
    q64, k64, v64, f64 = (t.double().requires_grad_() for t in (q, k, v, f))
    o64 = spattn.sparse_attention(g, q64, k64, v64, edge_features=f64, **drop)
    o64.backward(dy.double())
    assert rel(out, o64.detach().numpy()) < TOL[dtype]
    for name, got, want in (("dq", qc.grad, q64.grad), ("dk", kc.grad, k64.grad),
                            ("dv", vc.grad, v64.grad), ("dfeatures", fc.grad, f64.grad)):
        err = rel(got, want.numpy())
        print(f"  edge features rate {rate} {str(dtype)[6:]} {name}: {err:.2e}")
        assert err < 4 * TOL[dtype], name


@needs_cuda
def test_cuda_gat_bias_matches_the_cpu():
    g = cora()
    h, c = 4, 8
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(g.num_nodes, h, c, generator=gen)
    a_dst, a_src = (torch.randn(g.num_nodes, h, generator=gen) for _ in range(2))
    bias = torch.randn(g.num_edges, h, generator=gen)
    dy = torch.randn(g.num_nodes, h, c, generator=gen)
    cuda = [t.cuda().requires_grad_() for t in (x, a_dst, a_src, bias)]
    out = spattn.gat_attention(g, *cuda[:3], 0.2, bias=cuda[3], dropout=0.3, dropout_seed=4)
    out.backward(dy.cuda())
    cpu = [t.double().requires_grad_() for t in (x, a_dst, a_src, bias)]
    o64 = spattn.gat_attention(g, *cpu[:3], 0.2, bias=cpu[3], dropout=0.3, dropout_seed=4)
    o64.backward(dy.double())
    assert rel(out, o64.detach().numpy()) < 1e-5
    for name, got, want in zip(("dx", "da_dst", "da_src", "dbias"), cuda, cpu):
        err = rel(got.grad, want.grad.numpy())
        print(f"  gat bias {name}: {err:.2e}")
        assert err < 1e-4, name


@needs_cuda
@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("kernels", ["rows", "fused", "composed"])
def test_cuda_gat_masked_edges_on_every_kernel_set(kernels, rate):
    # A -inf bias masks an edge; rows of masked edges only (and rows whose first edges are
    # masked: the fused row pass once took exp(-inf - -inf) there) get zeros and finite
    # gradients, as on the CPU, from each kernel set.
    import spattn.functional as Fn
    g = cora()
    h, c = 2, 8
    gen = torch.Generator().manual_seed(13)
    x, dy = (torch.randn(g.num_nodes, h, c, generator=gen) for _ in range(2))
    a_dst, a_src = (torch.randn(g.num_nodes, h, generator=gen) for _ in range(2))
    bias = torch.randn(g.num_edges, h, generator=gen)
    crow = torch.as_tensor(g.crow())
    rows = torch.repeat_interleave(torch.arange(g.num_nodes), crow.diff())
    first = torch.arange(g.num_edges) - crow[rows] < 3
    bias[(rows % 3 == 0) | ((rows % 3 == 1) & first)] = float("-inf")
    drop = Fn._check_dropout(rate, 5) if rate else None
    xc, dc, sc, bc, dyc = (t.cuda() for t in (x, a_dst, a_src, bias, dy))
    out, _ = Fn.gat_forward_keeping(g, xc, dc, sc, bc, 0.2, drop, "rows")
    if kernels == "composed":
        out = Fn.gat_forward(g, xc, dc, sc, bc, 0.2, drop, "composed")
    grads = Fn.gat_backward(g, xc, dc, sc, dyc, bc, 0.2, drop, kernels=kernels, out=out)
    cpu = [t.double().requires_grad_() for t in (x, a_dst, a_src, bias)]
    o64 = spattn.gat_attention(g, *cpu[:3], 0.2, bias=cpu[3], dropout=rate, dropout_seed=5)
    o64.backward(dy.double())
    assert (out[(torch.arange(g.num_nodes) % 3 == 0).cuda()] == 0).all()
    assert rel(out, o64.detach().numpy()) < 1e-5
    for name, got, want in zip(("dx", "da_dst", "da_src", "dbias"), grads, cpu):
        assert torch.isfinite(got).all(), name
        err = rel(got, want.grad.numpy())
        print(f"  gat masked {kernels} {name}: {err:.2e}")
        assert err < 1e-4, name


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,rate,with_bias,graph", [(4, 0.0, False, "cora"), (4, 0.3, True, "cora"),
                                                        (1, 0.3, False, "cora"), (8, 0.0, True, "cora"),
                                                        (1, 0.0, True, "random"), (3, 0.3, False, "random")])
def test_cuda_gat_layer_node_matches_the_two_steps(dtype, heads, rate, with_bias, graph):
    """GATConv's one autograd node (score terms and attention together) against the two steps
    it replaces (head_dot of both vectors, then gat_attention), with the same dropout seed: the
    output and the vectors' and bias's gradients bitwise; dx within a rounding (the node adds
    the terms' share into the attention's dx in float32, the two steps add two rounded
    gradients). The random graph's 1,001 nodes put the second score term, and its gradient,
    off a 16-byte boundary."""
    from spattn.functional import _gat_layer_attention, head_dot

    gen = torch.Generator().manual_seed(heads)
    g = cora() if graph == "cora" else random_graph(gen, n=1001, e=9000).with_self_loops()
    c = 8
    x = torch.randn(g.num_nodes, heads, c, generator=gen).to(dtype).cuda()
    atts = [torch.randn(1, heads, c, generator=gen).to(dtype).cuda() for _ in range(2)]
    bias = torch.randn(g.num_edges, heads, generator=gen).cuda() if with_bias else None
    dy = torch.randn(g.num_nodes, heads, c, generator=gen).to(dtype).cuda()

    def leaves():
        return [t.clone().requires_grad_() if t is not None else None for t in (x, *atts, bias)]

    one = leaves()
    torch.manual_seed(5)
    out1 = _gat_layer_attention(g, one[0], one[1], one[2], 0.2, one[3], rate)
    assert type(out1.grad_fn).__name__ == "_GatLayerBackward"
    out1.backward(dy)
    two = leaves()
    torch.manual_seed(5)
    a_src, a_dst = head_dot(two[0], torch.stack((two[1], two[2]))).unbind(0)
    out2 = spattn.gat_attention(g, two[0], a_dst, a_src, 0.2, bias=two[3], dropout=rate)
    out2.backward(dy)
    assert torch.equal(out1, out2)
    for name, a, b in zip(("att_src", "att_dst", "bias"), one[1:], two[1:]):
        if a is not None:
            assert a.grad.dtype == b.grad.dtype and torch.equal(a.grad, b.grad), name
    err = rel(one[0].grad, two[0].grad.double().cpu().numpy())
    print(f"  gat layer node {str(dtype)[6:]} {heads} heads rate {rate}: dx {err:.2e}")
    assert err < 4 * TOL[dtype]


@needs_cuda
@pytest.mark.parametrize("dtype,out", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                       (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                       (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("fill", ["mean", "add", 0.5, None])
def test_cuda_edge_rows_kernels_match_the_torch_composition(dtype, out, fill):
    """The layers' edge attribute rows in CSR order by spattn's kernels (placed by the build's
    positions, the added loops' rows reduced in edge order) against the torch composition they
    replace: the input's rows bitwise; the loops' within what two f32 sums of the same terms in
    different orders may differ by (the composition sums with atomics, in any order), then a
    rounding to the attributes' type. Input self loops (replaced), nodes with no incoming edge,
    and a hub row of every node; without loops (fill None) every row placed. (The kernels'
    sums are checked bitwise against the same sums on the host in spattn-ops' csr_ops GPU tests.)"""
    from spattn import nn as snn

    gen = torch.Generator().manual_seed(3)
    n = 500
    src = torch.randint(0, n, (6000,), generator=gen)
    dst = torch.randint(0, n - 50, (6000,), generator=gen)  # the last 50 receive nothing
    hub = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)])
    ei = torch.unique(torch.cat([torch.stack([src, dst]), hub], 1), dim=1)
    ei = ei[:, torch.randperm(ei.shape[1], generator=gen)].cuda()
    loops = fill is not None
    snn.clear_graph_cache()
    g = snn.graph_for(ei, n, self_loops=loops)
    attr = torch.randn(ei.shape[1], 5, generator=gen).to(dtype).cuda()
    got = snn._native_edge_rows("GATConv", g, ei, attr, loops, fill, out)
    assert got is not None and got.dtype == out and got.shape == (g.num_edges, 5)
    rows = snn._edge_attr_with_loops("GATConv", ei, attr, n, loops, fill)
    want = snn._edges_in_csr_order(g, ei, rows, loops).to(out)
    is_loop = torch.zeros(g.num_edges, dtype=torch.bool, device="cuda")
    if loops:
        is_loop[g._built_positions(ei)[1]] = True
    assert torch.equal(got[~is_loop], want[~is_loop])
    if loops:
        # Per loop row: its row's other edges (deg of them) and the sum of their |values|.
        row = g.edge_index(device="cuda")[1]
        terms = got.double().abs() * (~is_loop).double()[:, None]
        abs_sum = torch.zeros(n, 5, dtype=torch.float64, device="cuda").index_add_(0, row, terms)
        deg = torch.zeros(n, dtype=torch.float64, device="cuda").index_add_(
            0, row, (~is_loop).double())[:, None]
        if fill == "mean":
            abs_sum = abs_sum / deg.clamp(min=1)
        u = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
        loop_rows = g._built_positions(ei)[1]
        a, b = got[loop_rows].double(), want[loop_rows].double()
        tol = 2 * (deg + 1) * 2.0**-24 * abs_sum + 2 * u * b.abs()
        assert bool(((a - b).abs() <= tol).all()), float(((a - b).abs() - tol).max())
    # The same bits again (no atomics).
    again = snn._native_edge_rows("GATConv", g, ei, attr, loops, fill, out)
    assert torch.equal(got, again)


@needs_cuda
def test_cuda_edge_rows_kernels_step_aside_where_they_do_not_apply():
    from spattn import nn as snn

    ei = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]], device="cuda")
    attr = torch.randn(4, 3, device="cuda")
    g = snn.graph_for(ei, 3, self_loops=True)
    # Attributes with a gradient, a fill the kernels do not take, float64, another tensor, the
    # graph's loops not asked for.
    assert snn._native_edge_rows("GATConv", g, ei, attr.requires_grad_(), True, "mean", None) is None
    attr = attr.detach()
    assert snn._native_edge_rows("GATConv", g, ei, attr, True, "max", None) is None
    assert snn._native_edge_rows("GATConv", g, ei, attr.double(), True, "mean", None) is None
    assert snn._native_edge_rows("GATConv", g, ei.clone(), attr, True, "mean", None) is None
    assert snn._native_edge_rows("GATConv", g, ei, attr, False, None, None) is None
    # 1-D attributes (each layer's composition shapes them), a fill the type cannot hold.
    assert snn._native_edge_rows("GATConv", g, ei, attr[:, 0].contiguous(), True, "mean", None) is None
    assert snn._native_edge_rows("GATConv", g, ei, attr.half(), True, 1e10, None) is None
    with pytest.raises(ValueError, match="edge_attr has 3 rows"):
        snn._native_edge_rows("GATConv", g, ei, attr[:3], True, "mean", None)
