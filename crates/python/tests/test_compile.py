"""torch.compile, autocast and the custom operators (``torch.ops.spattn.*``), on the CPU (CI) and,
where there is one, on a GPU: every layer traced whole (``fullgraph=True``) with dynamic shapes
gives eager's outputs and gradients, a new graph every step compiles once, the operators pass
``torch.library.opcheck``, and autocast runs attention in its dtype.

Most tests trace with the ``aot_eager`` backend (dynamo, the fake implementations and the
traced backward, without code generation: seconds on two cores); one compiles with inductor.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import spattn  # noqa: E402
import spattn.nn as snn  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

DEVICES = ["cpu"] + (
    ["cuda"] if torch.cuda.is_available() and spattn.cuda_device_count() > 0 else []
)

LAYERS = {
    "gat": lambda: snn.GATConv(12, 6, heads=2),
    "gat_edge": lambda: snn.GATConv(12, 6, heads=2, edge_dim=3, fill_value="mean"),
    "transformer": lambda: snn.TransformerConv(12, 6, heads=2, beta=True),
    "transformer_edge": lambda: snn.TransformerConv(12, 6, heads=2, edge_dim=3),
    "agnn": lambda: snn.AGNNConv(),
    "gatv2": lambda: snn.GATv2Conv(12, 6, heads=2),
    "gatv2_edge": lambda: snn.GATv2Conv(12, 6, heads=2, edge_dim=3, share_weights=True),
}

# Graphs of three sizes (some self loops, no repeated edge): one compilation serves all.
SIZES = [(40, 160), (57, 230), (33, 90)]


def edges(n: int, e: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    ei = torch.unique(ei, dim=1)  # no repeats (edge features need that)
    return ei[:, torch.randperm(ei.shape[1], generator=g)].to(device)


def run(layer, x, ei, edge_attr=None):
    """Output, ∂/∂x and the parameters' gradients of Σ out · w for fixed weights w."""
    layer.zero_grad()
    xa = x.clone().requires_grad_()
    args = (xa, ei) + ((edge_attr,) if edge_attr is not None else ())
    out = layer(*args)
    w = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype)
    (out * w).sum().backward()
    grads = {k.removeprefix("_orig_mod."): p.grad.clone()
             for k, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), xa.grad, grads


def assert_close(a, b, what, tol=1e-5, scale=0.0):
    """Relative L2 error within ``tol``; measured against ``scale`` where ``b`` is smaller (a
    gradient that cancels to roundoff, such as TransformerConv's key bias, whose exact value is
    0: the softmax does not see a shift of a row's scores)."""
    a, b = a.double(), b.double()
    err = (a - b).norm().item() / max(b.norm().item(), scale, 1e-30)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def grad_scale(model) -> float:
    """A floor for the gradients' comparisons: 1% of the largest parameter gradient's norm."""
    return 0.01 * max(p.grad.double().norm().item() for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_layer_traced_whole_matches_eager_on_new_graphs(kind, device):
    torch._dynamo.reset()  # compilations of other tests' layers are not this one's
    torch.manual_seed(0)
    layer = LAYERS[kind]().to(device)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    compilations = []
    for step, (n, e) in enumerate(SIZES):
        ei = edges(n, e, step, device)
        x = torch.randn(n, 12, device=device)
        attr = torch.randn(ei.shape[1], 3, device=device) if kind.endswith("_edge") else None
        want = run(layer, x, ei, attr)
        got = run(compiled, x, ei, attr)
        assert_close(got[0], want[0], f"{kind} step {step} out")
        assert_close(got[1], want[1], f"{kind} step {step} dx")
        assert got[2].keys() == want[2].keys()
        for name in want[2]:
            assert_close(got[2][name], want[2][name], f"{kind} step {step} d{name}")
        compilations.append(counter.frame_count)
    # The first graph compiles; the next ones, of other sizes, reuse it.
    assert compilations[0] > 0 and len(set(compilations)) == 1, compilations


def test_inductor_compiles_a_two_layer_model():
    torch.manual_seed(1)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = snn.GATConv(12, 6, heads=2)
            self.b = snn.TransformerConv(12, 4, heads=2)

        def forward(self, x, ei):
            return self.b(self.a(x, ei).relu(), ei)

    net = Net()
    compiled = torch.compile(net, fullgraph=True, dynamic=True)
    for step, (n, e) in enumerate(SIZES[:2]):
        ei = edges(n, e, 10 + step)
        x = torch.randn(n, 12)
        want, got = run(net, x, ei), run(compiled, x, ei)
        assert_close(got[0], want[0], "out")
        assert_close(got[1], want[1], "dx")


@pytest.mark.parametrize("device", DEVICES)
def test_functional_calls_traced_whole(device):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def step(g, q, k, v, bias, x, a_dst, a_src):
        out, w = spattn.sparse_attention(g, q, k, v, bias=bias, return_attention_weights=True)
        return out, w, spattn.gat_attention(g, x, a_dst, a_src, 0.2, dropout=0.3, dropout_seed=5)

    def eager(g, q, k, v, bias, x, a_dst, a_src):
        out, w = spattn.sparse_attention(g, q, k, v, bias=bias, return_attention_weights=True)
        return out, w, spattn.gat_attention(g, x, a_dst, a_src, 0.2, dropout=0.3, dropout_seed=5)

    compilations = []
    for i, (n, e) in enumerate(SIZES[:2]):
        g = spattn.Graph.from_edge_index(edges(n, e, 20 + i, device), num_nodes=n)
        q, k, v = (torch.randn(n, 2, 8, device=device, requires_grad=True) for _ in range(3))
        bias = torch.randn(g.num_edges, 2, device=device, requires_grad=True)
        x = torch.randn(n, 2, 8, device=device, requires_grad=True)
        a_dst, a_src = (torch.randn(n, 2, device=device, requires_grad=True) for _ in range(2))
        inputs = (g, q, k, v, bias, x, a_dst, a_src)
        got, want = step(*inputs), eager(*inputs)
        assert got[1].shape == (g.num_edges, 2)
        for a, b, what in zip(got, want, ("out", "weights", "gat")):
            assert_close(a.detach(), b.detach(), what)
        tensors = [t for t in inputs[1:] if t.requires_grad]
        g1 = torch.autograd.grad(got[0].sum() + got[2].square().sum(), tensors)
        g2 = torch.autograd.grad(want[0].sum() + want[2].square().sum(), tensors)
        for a, b in zip(g1, g2):
            assert_close(a, b, "gradient")
        compilations.append(counter.frame_count)
    assert compilations[0] > 0 and len(set(compilations)) == 1, compilations


def test_operators_pass_opcheck():
    g = spattn.Graph.from_edge_index(edges(30, 100, 3), num_nodes=30)
    tok = g._token
    q, k, v = (torch.randn(30, 2, 4, requires_grad=True) for _ in range(3))
    bias = torch.randn(g.num_edges, 2, requires_grad=True)
    seed = torch.tensor([7])
    x = torch.randn(30, 2, 4, requires_grad=True)
    a = torch.randn(30, 2, requires_grad=True)
    ops = torch.ops.spattn
    cases = [
        (ops.attention.default, (tok, q, k, v, None, "auto")),
        (ops.attention_keeping.default, (tok, q, k, v, None, "auto")),
        (ops.attention_extras.default, (tok, q, k, v, bias, None, 0.5, "auto", 0.2, seed)),
        (ops.attention_backward.default,
         (tok, q, k, v, q.detach(), q.detach(), None, "auto")
         + tuple(torch.empty(30, 2, 4) for _ in range(3)) + (None, None)),
        (ops.attention_backward.default,
         (tok, q, k, v, q.detach(), q.detach(), None, "auto")
         + tuple(torch.empty(30, 2, 4) for _ in range(3))
         + (torch.zeros(60), torch.zeros(1, dtype=torch.uint8))),
        (ops.gat.default, (tok, x, a, a.detach().clone().requires_grad_(), None, 0.2, 0.0, None)),
        (ops.head_dot.default, (x, torch.randn(8, requires_grad=True))),
        (ops.head_dot.default, (x, torch.randn(16, requires_grad=True))),  # two vectors
    ]
    # The fake and the real implementations agree on shapes and dtypes; the schemas, the
    # autograd registrations and the traced (AOT) forward and backward are consistent.
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_autocast_runs_attention_in_its_dtype():
    torch.manual_seed(2)
    layer = snn.TransformerConv(12, 6, heads=2)
    ei = edges(40, 160, 4)
    x = torch.randn(40, 12)
    want = layer(x, ei)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x, ei)
        q = torch.randn(40, 2, 6)
        g = snn.graph_for(ei, 40)
        assert spattn.sparse_attention(g, q, q, q).dtype == torch.bfloat16
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), want, "autocast output", tol=3e-2)


def test_dropout_draws_a_new_mask_every_call():
    g = spattn.Graph.from_edge_index(edges(30, 120, 5), num_nodes=30)
    q = torch.randn(30, 1, 4)
    a = spattn.sparse_attention(g, q, q, q, dropout=0.5)
    b = spattn.sparse_attention(g, q, q, q, dropout=0.5)
    assert not torch.equal(a, b)


# ---- CUDA graphs (GPU only) -------------------------------------------------------------------

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
needs_cuda = pytest.mark.skipif("cuda" not in DEVICES, reason="needs an NVIDIA GPU")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_training_takes_the_forward_row_statistics(dtype, lse_seen):
    """Traced training calls the keeping operator: on a fused-tc plan it returns the row
    statistics eager's forward keeps, both backwards are handed them (a spy on the native
    backward; a fused-csr plan hands none), and the compiled gradients equal eager's bit for
    bit."""
    from spattn import functional as F

    g = spattn.Graph.from_edge_index(edges(300, 3000, 9, "cuda"), num_nodes=300)
    g.policy = "once"  # kept when seen again: eager and compiled calls plan alike
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(300, 4, 32, device="cuda", generator=gen).to(dtype) for _ in range(3))
    out, lse, kept = torch.ops.spattn.attention_keeping(g._token, q, k, v, None, "fused-tc")
    want_out, want_lse = F.attention_forward_keeping(g, q, k, v, None, "fused-tc")
    assert want_lse is not None and kept.item() == 1
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    _, _, none = torch.ops.spattn.attention_keeping(g._token, q, k, v, None, "fused-csr")
    assert none.item() == 0

    def step(q, k, v, algorithm="fused-tc"):
        return spattn.sparse_attention(g, q, k, v, algorithm=algorithm)

    w = torch.linspace(-1, 1, q.numel(), device="cuda").view_as(q)
    grads = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        lse_seen.clear()
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        (fn(*xs).float() * w).sum().backward()
        grads.append([t.grad for t in xs])
        assert len(lse_seen) == 1 and lse_seen[0] is not None
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    # The negative control: a plan that keeps nothing hands its backward no statistics.
    lse_seen.clear()
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    (compiled(*xs, algorithm="fused-csr").float() * w).sum().backward()
    assert len(lse_seen) == 1 and lse_seen[0] is None


class Net(torch.nn.Module):
    """GATConv (edge features) → TransformerConv → AGNNConv: every attention call of the package."""

    def __init__(self):
        super().__init__()
        self.a = snn.GATConv(12, 8, heads=2, edge_dim=3)
        self.b = snn.TransformerConv(16, 6, heads=2, edge_dim=3)
        self.c = snn.AGNNConv()

    def forward(self, x, ei, attr):
        h = self.a(x, ei, attr).relu()
        return self.c(self.b(h, ei, attr), ei)


def step_grads(model, x, ei, attr):
    out = model(x, ei, attr)
    out.float().square().sum().backward()
    return out


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_training_step_captured_whole_in_a_cuda_graph(dtype):
    import copy

    torch.manual_seed(3)
    n = 700
    ei = edges(n, 6000, 7, "cuda")
    attr = torch.randn(ei.shape[1], 3, device="cuda", dtype=dtype)
    model = Net().cuda().to(dtype)
    ref = copy.deepcopy(model)
    x_static = torch.randn(n, 12, device="cuda", dtype=dtype)
    # Warm-up on a side stream, as torch prescribes: the graph and its plans are built here.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            step_grads(model, x_static, ei, attr)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = step_grads(model, x_static, ei, attr)
    for i in range(3):
        x = torch.randn(n, 12, device="cuda", dtype=dtype)
        x_static.copy_(x)
        graph.replay()
        ref.zero_grad(set_to_none=True)
        want = step_grads(ref, x, ei, attr)
        tol = TOL[dtype]
        assert_close(out_static, want, f"replay {i} out", tol=tol)
        scale = grad_scale(ref)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert_close(p.grad, q.grad, f"replay {i} d{name}", tol=tol, scale=scale)


@needs_cuda
def test_dropout_is_refused_under_capture():
    g = spattn.Graph.from_edge_index(edges(30, 120, 5, "cuda"), num_nodes=30)
    q = torch.randn(30, 1, 8, device="cuda")
    spattn.sparse_attention(g, q, q, q)  # plan before the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="replay one mask"):
        with torch.cuda.graph(graph):
            spattn.sparse_attention(g, q, q, q, dropout=0.5)


@needs_cuda
def test_reduce_overhead_matches_eager():
    torch.manual_seed(4)
    n = 500
    ei = edges(n, 4000, 8, "cuda")
    attr = torch.randn(ei.shape[1], 3, device="cuda")
    model = Net().cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for i in range(4):
        x = torch.randn(n, 12, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        got = step_grads(compiled, x, ei, attr).clone()
        got_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        want = step_grads(model, x, ei, attr)
        assert_close(got, want, f"step {i} out")
        scale = grad_scale(model)
        for a, (name, p) in zip(got_grads, model.named_parameters()):
            assert_close(a, p.grad, f"step {i} d{name}", tol=1e-4, scale=scale)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_on_cuda(dtype):
    torch.manual_seed(5)
    n = 400
    ei = edges(n, 3000, 9, "cuda")
    attr = torch.randn(ei.shape[1], 3, device="cuda")
    model = Net().cuda()
    x = torch.randn(n, 12, device="cuda")
    want = model(x, ei, attr)
    with torch.autocast("cuda", dtype=dtype):
        got = model(x, ei, attr)
    assert got.dtype == dtype
    assert_close(got.float(), want, "autocast output", tol=3e-2)
    got.float().square().sum().backward()  # gradients reach the f32 parameters
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_edge_index_type_traced_whole():
    from_pyg = pytest.importorskip("torch_geometric")
    torch._dynamo.reset()
    layer = snn.GATConv(12, 6, heads=2)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    ei = edges(40, 160, 30).contiguous()
    x = torch.randn(40, 12)
    got = compiled(x, from_pyg.EdgeIndex(ei, sparse_size=(40, 40)))
    assert_close(got.detach(), layer(x, ei).detach(), "EdgeIndex out")
