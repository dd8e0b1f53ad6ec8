"""GPU tests (skipped without CUDA): spattn's CUDA path against the float64 references, the
ordering with PyTorch's current stream, device-side argument errors, and the spattn.nn layers
against PyG (torch_geometric 2.8) on cora, pubmed and ogbn-arxiv: outputs and every gradient
within the dtype's tolerance.

Graphs come from SPATTN_DATA_DIR (or ../shared/data/mtx beside the repository):
cora.mtx.gz, pubmed.mtx.gz, ogbn-arxiv.mtx.gz; a missing one skips its tests.

    SPATTN_DATA_DIR=data python -m pytest -v -s tests/test_gpu.py

The tolerance of a quantity is the dtype's (relative L2 against PyG in float64 on the same
rounded inputs and parameters: float32 1e-5, float16 5e-3, bfloat16 2e-2), or twice PyG's own
error in that dtype where PyG itself is further off; every comparison prints both errors.
GAT's attention-vector gradients cancel (see `gat_attention_vector_conditions`): they may also
be off by a few unit roundoffs times their condition number, which the test prints.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import spattn  # noqa: E402
from conftest import data_file, dense_mask, ref_attention, ref_attention_backward, rel_l2  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or spattn.cuda_device_count() == 0,
    reason="needs an NVIDIA GPU (torch.cuda and spattn both see one)",
)

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GRAPHS = ["cora", "pubmed", "ogbn-arxiv"]


@functools.lru_cache(maxsize=None)
def load(name: str):
    path = data_file(f"{name}.mtx.gz")
    if path is None:
        return None
    g = spattn.Graph.read_matrix_market(path, symmetrize=True)
    return g, g.edge_index().cuda()


def graph_or_skip(name):
    loaded = load(name)
    if loaded is None:
        pytest.skip(f"{name}.mtx.gz not found (set SPATTN_DATA_DIR)")
    return loaded


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    d = (a - b).norm().item()
    n = b.norm().item()
    return d / n if n > 0 else d


# ---- the functional API on CUDA ------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def cora_case(dtype):
    """Inputs rounded to `dtype` and the f64 dense references of out, dQ, dK, dV on cora
    (with self loops), computed once per dtype."""
    g, _ = load("cora")
    g = g.with_self_loops()
    n, h, d = g.num_nodes, 4, 32
    gen = torch.Generator().manual_seed(3)
    q, k, v, d_out = (torch.randn(n, h, d, generator=gen).to(dtype) for _ in range(4))
    mask = dense_mask(g)
    args = [t.double().numpy() for t in (q, k, v)]
    want, _ = ref_attention(mask, *args, 1 / np.sqrt(d))
    grads = ref_attention_backward(mask, *args, d_out.double().numpy(), 1 / np.sqrt(d))[:3]
    return g, (q, k, v, d_out), want, grads


@pytest.mark.parametrize("algorithm", spattn.ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_sparse_attention_forward_backward_on_cora(algorithm, dtype):
    graph_or_skip("cora")
    g, (q, k, v, d_out), want, (dq, dk, dv) = cora_case(dtype)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    try:
        out = spattn.sparse_attention(g, qc, kc, vc, algorithm=algorithm)
    except NotImplementedError as e:
        pytest.skip(f"{algorithm} cannot run {dtype}: {e}")
    out.backward(d_out.cuda())
    tol = TOL[dtype]
    if dtype == torch.float32 and algorithm in ("unfused-tc", "fused-tc", "hybrid"):
        tol = 5e-3  # tensor cores take f32 operands as tf32 (ask for them by name only)
    assert rel_l2(out.detach().double().cpu().numpy(), want) <= tol
    # The backward is the exact CUDA-core one whatever the forward's algorithm.
    for got, ref in ((qc.grad, dq), (kc.grad, dk), (vc.grad, dv)):
        assert rel_l2(got.double().cpu().numpy(), ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_fused_tc_forward_keeps_row_statistics_for_the_backward(dtype, monkeypatch, lse_seen):
    """Autograd through a fused-tc plan keeps each row's log-sum-exp from the forward and the
    backward takes it (skipping its statistics pass): the kept values are the rows' log2-sum-exp
    of the scaled scores, and the gradients match the f64 reference and the backward that
    recomputes them. Another algorithm keeps nothing."""
    graph_or_skip("cora")
    from spattn import functional as F

    g, (q, k, v, d_out), _, refs = cora_case(dtype)
    qc, kc, vc, dc = (t.cuda() for t in (q, k, v, d_out))
    scale = 1 / np.sqrt(q.shape[2])
    out, lse = F.attention_forward_keeping(g, qc, kc, vc, scale, "fused-tc")
    assert lse is not None and lse.shape == (q.shape[0] * q.shape[1],)
    # The rows' log2-sum-exp of the scaled scores, from the dense mask in f64.
    mask = torch.from_numpy(dense_mask(g))
    s = torch.einsum("ihd,jhd->hij", q.double(), k.double()) * scale
    s = s.masked_fill(~mask.bool().unsqueeze(0), float("-inf"))
    want_lse = (torch.logsumexp(s, dim=2) / np.log(2.0)).T.reshape(-1)
    assert (lse.double().cpu() - want_lse).abs().max().item() <= 1e-3 * (1 + want_lse.abs().max())
    kept = F.attention_backward(g, qc, kc, vc, out, dc, scale, "fused-tc", lse=lse)
    recomputed = F.attention_backward(g, qc, kc, vc, out, dc, scale, "fused-tc")
    for a, b, ref in zip(kept, recomputed, refs):
        assert rel_l2(a.double().cpu().numpy(), ref) <= TOL[dtype]
        assert rel(a, b) <= TOL[dtype]
    # Autograd takes the same path: its backward is handed the kept statistics.
    lse_seen.clear()
    qg, kg, vg = (t.clone().requires_grad_() for t in (qc, kc, vc))
    spattn.sparse_attention(g, qg, kg, vg, algorithm="fused-tc").backward(dc)
    assert len(lse_seen) == 1 and lse_seen[0] is not None
    for got, ref in zip((qg.grad, kg.grad, vg.grad), refs):
        assert rel_l2(got.double().cpu().numpy(), ref) <= TOL[dtype]
    # Without grad mode nothing is kept (inference pays no statistics); with it, the same spy
    # sees the keeping forward (its positive control).
    seen_fwd = []
    keeping = F.attention_forward_keeping
    monkeypatch.setattr(F, "attention_forward_keeping",
                        lambda *a: seen_fwd.append(1) or keeping(*a))
    with torch.no_grad():
        spattn.sparse_attention(g, qg, kg, vg, algorithm="fused-tc")
    assert not seen_fwd
    spattn.sparse_attention(g, qg, kg, vg, algorithm="fused-tc")
    assert seen_fwd == [1]
    with pytest.raises(ValueError, match="lse"):
        F.attention_backward(g, qc, kc, vc, out, dc, scale, "fused-tc", lse=lse[:-1])
    _, none = F.attention_forward_keeping(g, qc, kc, vc, scale, "fused-csr")
    assert none is None


def test_plan_reports_algorithm_and_memory_stats():
    g, _ = graph_or_skip("cora")
    info = g.plan(8, 64, dtype=torch.float16, device="cuda")
    assert info["algorithm"] in spattn.ALGORITHMS and info["choice"]
    assert g.device_bytes("cuda") > 0
    stats = spattn.memory_stats()
    assert stats["used"] >= 0 and stats["used_peak"] >= stats["used"]
    spattn.reset_peak_memory_stats()
    assert spattn.device_info()["compute_capability"][0] >= 7


def test_ordered_with_the_current_stream():
    g, _ = graph_or_skip("pubmed")
    n, h, d = g.num_nodes, 8, 64
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(n, h, d, generator=gen).cuda()
    k = torch.randn(n, h, d, generator=gen).cuda()
    want = spattn.sparse_attention(g, src, k, k)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        from spattn._tensors import device_index, stream_of

        # the handle and device index the native calls get: the side stream's
        assert stream_of(src) == side.cuda_stream and device_index(src) == src.device.index
        q = torch.zeros_like(src)
        torch.cuda._sleep(200_000_000)  # keep the side stream busy, then write q
        q.copy_(src)
        out = spattn.sparse_attention(g, q, k, k)  # must wait for the copy
        seen = out.clone()  # must wait for spattn
    torch.cuda.synchronize()
    assert torch.equal(seen, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dot_matches_float64_and_reruns_bitwise(dtype):
    """GAT's score terms (x * att).sum(-1) by spattn's kernels, one to three attention vectors
    at once: float32 results and attention gradients whatever x's dtype (within float32's
    rounding of the float64 sums), x's gradient within x's dtype's, and the attention gradient's
    fixed-order sum the same bits every run."""
    from spattn.functional import head_dot

    torch.manual_seed(3)
    cases = [(1, 1, 1, 1), (37, 3, 5, 1), (5000, 8, 32, 1), (300, 2, 130, 1), (37, 3, 5, 2),
             (5000, 8, 32, 2), (300, 2, 130, 3)]
    for rows, h, c, k in cases:
        x = torch.randn(rows, h, c, device="cuda").to(dtype).requires_grad_()
        att = torch.randn(k, h, c, device="cuda", requires_grad=True)
        out = head_dot(x, att)
        assert out.dtype == torch.float32 and out.shape == ((rows, h) if k == 1 else (k, rows, h))
        x64 = x.detach().double().requires_grad_()
        a64 = att.detach().double().requires_grad_()
        want = (x64.unsqueeze(0) * a64.unsqueeze(1)).sum(-1).reshape(out.shape)
        assert rel(out, want) <= 1e-6, (rows, h, c)
        d = torch.randn_like(out)
        (out * d).sum().backward()
        (want * d.double()).sum().backward()
        assert rel(x.grad, x64.grad) <= TOL[dtype], (rows, h, c)
        assert rel(att.grad, a64.grad) <= 1e-5, (rows, h, c)
        first = att.grad.clone()
        att.grad = None
        (head_dot(x, att) * d).sum().backward()
        assert torch.equal(att.grad, first), (rows, h, c)



def test_device_errors_name_the_argument():
    g = spattn.Graph.from_edge_index(torch.tensor([[0, 1, 2], [1, 2, 0]]))
    q = torch.randn(3, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="k: is on cpu"):
        spattn.sparse_attention(g, q, q.cpu(), q)
    with pytest.raises(TypeError, match="float64"):
        spattn.sparse_attention(g, q.double(), q.double(), q.double())
    flat = torch.randn(3 * 2 * 8 + 1, device="cuda")
    misaligned = flat[1:].view(3, 2, 8)  # contiguous, 4 bytes past an allocation's start
    with pytest.raises(ValueError, match="q.*aligned"):
        spattn.sparse_attention(g, misaligned, q, q)
    with pytest.raises(ValueError, match="algorithm"):
        spattn.sparse_attention(g, q, q, q, algorithm="fast")


# ---- the layers against PyG ------------------------------------------------------------------

pyg_nn = None


def pyg():
    global pyg_nn
    if pyg_nn is None:
        pyg_nn = pytest.importorskip("torch_geometric.nn")
    return pyg_nn


LAYERS = {
    "gat": (lambda m, f: m.GATConv(f, 16, heads=4), 32),
    "gat-mean-residual": (lambda m, f: m.GATConv(f, 16, heads=2, concat=False, residual=True), 32),
    "transformer": (lambda m, f: m.TransformerConv(f, 16, heads=4), 32),
    "transformer-beta": (lambda m, f: m.TransformerConv(f, 32, heads=2, concat=False, beta=True), 32),
    "agnn": (lambda m, f: m.AGNNConv(), 32),
    "gatv2": (lambda m, f: m.GATv2Conv(f, 16, heads=4), 32),
}


# Unit roundoff of each dtype: a rounding to it moves a value by at most this, relatively.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Roundings behind each term of a cancelling gradient: the scores' inputs rounded in the forward
# (which moves the probabilities), then the backward's intermediates (dα or dQ, the products,
# the sum). Measured on an H100 in bfloat16: spattn 0.3–5 of them, PyG 0.5–2.5.
ROUNDINGS = 8


def gat_attention_vector_conditions(ref, x, edge_index, w, ref_grads):
    """GAT's ∂L/∂att_src and ∂L/∂att_dst are sums over edges of dE_e · Wh, where
    dE_e = LeakyReLU'(·) α_e (dα_e − Σ_k α_k dα_k) cancels to almost nothing per row (exactly
    nothing but for the negative slope). A correct implementation in a low-precision dtype is
    then off by about u · √(Σ_e terms²) / |Σ_e terms| (independent roundings of the terms),
    which no fixed tolerance bounds. This returns that condition number per parameter, from
    the float64 layer `ref` and its gradients `ref_grads` on the same inputs."""
    xa = x.clone().requires_grad_()
    out, (ei, alpha) = ref(xa, edge_index, return_attention_weights=True)
    alpha.retain_grad()
    (out * w.to(out.dtype)).sum().backward()
    ref.zero_grad()
    lin = getattr(ref, "lin", None) or ref.lin_src
    heads, dim = ref.heads, ref.out_channels
    wh = lin(x).view(-1, heads, dim).detach().abs()
    a, da = alpha.detach(), alpha.grad.detach()
    src, dst = ei[0], ei[1]
    row_sum = torch.zeros(x.shape[0], heads, dtype=a.dtype, device=a.device)
    row_sum.index_add_(0, dst, a * da)
    size = a * (da.abs() + row_sum[dst].abs())  # |dE_e| before cancellation, per head
    cond = {}
    for name, node in (("att_dst", dst), ("att_src", src)):
        shape = getattr(ref, name).shape  # 1 × heads × dim
        # Independent roundings add up like a random walk: the root of the summed squares.
        spread = (size.unsqueeze(-1) * wh[node]).square().sum(0).sqrt().view(shape)
        cond[name] = spread.norm().item() / ref_grads[name].norm().item()
    return cond


def agnn_beta_condition(ref, x, edge_index, w, ref_grads):
    """AGNN's ∂L/∂β = Σ_e dS_e · cos_e cancels like GAT's attention vectors (Σ_j dS_ij = 0 per
    row): its condition number √(Σ_e (|dS_e| before cancellation · cos_e)²) / |∂L/∂β|, from
    float64 on the same inputs (PyG's AGNNConv: self loops replaced, softmax per target)."""
    from torch_geometric.utils import add_self_loops, remove_self_loops

    ei, _ = remove_self_loops(edge_index)
    ei, _ = add_self_loops(ei, num_nodes=x.shape[0])
    src, dst = ei[0], ei[1]
    xn = torch.nn.functional.normalize(x, p=2.0, dim=-1)
    cos = (xn[src] * xn[dst]).sum(-1)
    s = ref.beta.detach() * cos
    m = torch.full((x.shape[0],), -torch.inf, dtype=s.dtype, device=s.device)
    m = m.scatter_reduce(0, dst, s, reduce="amax")
    e = (s - m[dst]).exp()
    z = torch.zeros_like(m).index_add_(0, dst, e)
    p = e / z[dst]
    dp = (w.reshape(-1)[dst].unsqueeze(-1) * x[src]).sum(-1)  # loss Σ w_i · out_i
    row = torch.zeros_like(m).index_add_(0, dst, p * dp)
    size = p * (dp.abs() + row[dst].abs()) * cos.abs()
    # spattn.nn computes it as Σ_i ⟨dQ_i, x̂_i⟩ with dQ_i = Σ_j dS_ij x̂_j rounded to the dtype:
    # each rounding of dQ_i adds about u · |dQ_i|.
    ds = p * (dp - row[dst])
    dq = torch.zeros_like(xn).index_add_(0, dst, ds.unsqueeze(-1) * xn[src])
    spread = max(size.square().sum().sqrt().item(), dq.norm().item())
    return {"beta": spread / ref_grads["beta"].norm().item()}


def gatv2_att_condition(ref, x, edge_index, w, ref_grads):
    """GATv2's ∂L/∂att = Σ_e dS_e · LeakyReLU(z_e) cancels like GAT's attention vectors (Σ_j
    dS_ij = 0 per row): its condition number √(Σ_e (|dS_e| before cancellation · |LeakyReLU(z_e)|)²)
    / |∂L/∂att|, from the float64 layer `ref` on the same inputs."""
    xa = x.clone().requires_grad_()
    out, (ei, alpha) = ref(xa, edge_index, return_attention_weights=True)
    alpha.retain_grad()
    (out * w.to(out.dtype)).sum().backward()
    ref.zero_grad()
    heads, dim = ref.heads, ref.out_channels
    a, da = alpha.detach(), alpha.grad.detach()
    src, dst = ei[0], ei[1]
    row_sum = torch.zeros(x.shape[0], heads, dtype=a.dtype, device=a.device)
    row_sum.index_add_(0, dst, a * da)
    size = a * (da.abs() + row_sum[dst].abs())
    with torch.no_grad():
        z = ref.lin_l(x).view(-1, heads, dim)[src] + ref.lin_r(x).view(-1, heads, dim)[dst]
        lz = torch.nn.functional.leaky_relu(z, ref.negative_slope).abs()
        spread = (size.unsqueeze(-1) * lz).square().sum(0).sqrt()
    return {"att": spread.norm().item() / ref_grads["att"].norm().item()}


def run_layer(layer, x, edge_index, w, call=None):
    """Output, ∂/∂x and the parameters' gradients of Σ out · w; ``call`` runs the layer (a
    compiled or graphed form of it) where given."""
    xa = x.clone().requires_grad_()
    out = (layer if call is None else call)(xa, edge_index)
    (out * w.to(out.dtype)).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), xa.grad, grads


def in_mode(layer, x, edge_index, mode):
    """How ``mode`` runs ``layer``: eagerly, compiled whole by torch.compile (inductor, dynamic
    shapes), or replayed from a CUDA graph captured by ``torch.cuda.make_graphed_callables``
    (forward and backward; its warm-up plans the graph before the capture)."""
    if mode == "eager":
        return None
    if mode == "compile":
        torch._dynamo.reset()
        return torch.compile(layer, fullgraph=True, dynamic=True)
    assert mode == "cudagraph"
    return torch.cuda.make_graphed_callables(layer, (x.clone().requires_grad_(), edge_index))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("graph", GRAPHS)
def test_layer_matches_pyg(graph, kind, dtype):
    layer_matches_pyg(graph, kind, dtype, "eager")


# Compiled (inductor) and CUDA-graph replays against PyG: every layer and dtype on cora, and
# pubmed in float16 (compilations take seconds each: not every graph).
MODE_CASES = [("cora", d) for d in DTYPES] + [("pubmed", torch.float16)]


@pytest.mark.parametrize("mode", ["compile", "cudagraph"])
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("graph,dtype", MODE_CASES, ids=[f"{g}-{str(d)[6:]}" for g, d in MODE_CASES])
def test_layer_matches_pyg_compiled_and_graphed(graph, dtype, kind, mode):
    layer_matches_pyg(graph, kind, dtype, mode)


def layer_matches_pyg(graph, kind, dtype, mode):
    m = pyg()
    g, edge_index = graph_or_skip(graph)
    make, fin = LAYERS[kind]
    torch.manual_seed(11)
    theirs = make(m, fin).cuda()
    if kind == "agnn":
        with torch.no_grad():
            theirs.beta.fill_(1.5)
    # Parameters and inputs rounded to `dtype` once; everyone computes from those values.
    state = {k: v.to(dtype) for k, v in theirs.state_dict().items()}
    x = torch.randn(g.num_nodes, fin, device="cuda").to(dtype)

    ref = make(m, fin).cuda().double()
    ref.load_state_dict({k: v.double() for k, v in state.items()})
    w = torch.randn(g.num_nodes, 1, device="cuda").to(dtype)
    out_ref, gx_ref, g_ref = run_layer(ref, x.double(), edge_index, w.double())

    ours = make(spattn.nn, fin).cuda().to(dtype)
    ours.load_state_dict(state)
    out, gx, grads = run_layer(ours, x, edge_index, w, in_mode(ours, x, edge_index, mode))
    assert out.dtype == dtype

    try:  # PyG in the same dtype: how far the dtype itself takes a correct implementation
        same = make(m, fin).cuda().to(dtype)
        same.load_state_dict(state)
        p_out, p_gx, p_grads = run_layer(same, x, edge_index, w)
    except Exception as e:  # noqa: BLE001 - PyG may not run a dtype; then the dtype's tolerance
        print(f"  PyG in {dtype} failed: {e}")
        p_out, p_gx, p_grads = None, None, {}

    # Ill-conditioned gradients (GAT's attention vectors, AGNN's β): also allow the rounding error a
    # correct implementation can have, ROUNDINGS · u · √(Σ terms²) / |Σ terms|.
    conditioned = {}
    kappas = {}
    if kind == "gatv2":
        ref.zero_grad()
        kappas = gatv2_att_condition(ref, x.double(), edge_index, w.double(), g_ref)
    elif kind.startswith("gat"):
        ref.zero_grad()
        kappas = gat_attention_vector_conditions(ref, x.double(), edge_index, w.double(), g_ref)
    elif kind == "agnn":
        kappas = agnn_beta_condition(ref, x.double(), edge_index, w.double(), g_ref)
    if kappas:
        for param, kappa in kappas.items():
            conditioned[f"d{param}"] = ROUNDINGS * UNIT_ROUNDOFF[dtype] * kappa
            print(f"  {graph} {kind} d{param}: condition number {kappa:.1f}")

    checks = [("out", out, out_ref, p_out), ("dx", gx, gx_ref, p_gx)]
    checks += [(f"d{k}", grads.get(k), v, p_grads.get(k)) for k, v in g_ref.items()]
    failures = []
    for name, got, want, pyg_same in checks:
        assert got is not None, f"{name}: no gradient"
        err = rel(got, want)
        pyg_err = rel(pyg_same, want) if pyg_same is not None else float("nan")
        allowed = max(TOL[dtype], 2 * pyg_err) if pyg_err == pyg_err else TOL[dtype]
        allowed = max(allowed, conditioned.get(name, 0.0))
        print(f"  {graph} {kind} {str(dtype)[6:]} {mode} {name}: spattn {err:.2e}  PyG-same-dtype {pyg_err:.2e}  allowed {allowed:.1e}")
        if not err <= allowed:
            failures.append(f"{name}: {err:.3e} > {allowed:.1e}")
    assert not failures, "; ".join(failures)
