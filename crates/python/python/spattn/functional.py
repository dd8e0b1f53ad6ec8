"""The functional API: sparse attention and GAT attention, with autograd.

On CUDA tensors the kernels read and write the tensors' memory in place (no copy, no host
round trip) and are ordered with PyTorch's current CUDA stream: spattn's stream waits for an
event recorded on the current stream before its first launch, and the current stream waits for
an event recorded after spattn's last, so the call behaves exactly like an op enqueued on the
current stream (and PyTorch's caching allocator may recycle the memory in that stream's order).
On CPU tensors (and numpy arrays) the CPU reference ops run in float32 or float64.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from .graph import Graph
from ._tensors import (
    address,
    check_algorithm,
    check_numpy,
    check_scale,
    check_torch,
    device_index,
    dtype_name,
    is_ndarray,
    is_tensor,
    np,
    require_torch,
    stream_of,
    torch,
)

_CUDA_DTYPES = ("f32", "f16", "bf16")


def _check_graph(graph: Any) -> Graph:
    if not isinstance(graph, Graph):
        raise TypeError(f"graph: expected a spattn.Graph, got {type(graph).__name__}")
    return graph


def _qkv_shapes(graph: Graph, q: Any) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    shape = tuple(q.shape)
    if len(shape) != 3:
        raise ValueError(f"q: expected shape (num_nodes, heads, head_dim), got {shape}")
    n, h, d = shape
    if n != graph.num_nodes:
        raise ValueError(
            f"q: has {n} rows, but the graph has {graph.num_nodes} nodes (shape (n, heads, head_dim))"
        )
    return (n, h, d), (graph.num_cols, h, d)


# ---- sparse attention --------------------------------------------------------------------


def sparse_attention(
    graph: Graph,
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Any = None,
    bias: Any = None,
    edge_features: Any = None,
    dropout: float = 0.0,
    dropout_seed: Optional[int] = None,
    return_attention_weights: bool = False,
    algorithm: str = "auto",
):
    """``out = softmax_row(scale · Q Kᵀ masked by A + bias) · V`` over ``graph``'s edges, with
    edge features added to keys and values and dropout on the probabilities where asked.

    Args:
        graph: a :class:`spattn.Graph` (row ``i``: the nodes node ``i`` attends to).
        q: ``num_nodes × heads × head_dim``; k, v: ``num_cols × heads × head_dim``, the same
            dtype and device, contiguous. torch tensors (CUDA: float32, float16, bfloat16;
            CPU: also float64) or numpy arrays (float32, float64; CPU).
        scale: the score scale; ``None`` means ``1/sqrt(head_dim)``. A 0-dim tensor (e.g. a
            learnable temperature) multiplies ``q`` instead, so its gradient flows through
            torch.
        bias: an additive score bias per edge (Graphormer's spatial / edge encodings, a
            graph transformer's edge bias): a tensor of ``num_edges`` values (shared by the
            heads) or ``num_edges × heads``, in the order of :meth:`Graph.edge_index` (the
            graph's CSR order), on ``q``'s device (cast to ``q``'s dtype). ``-inf`` masks an
            edge; a NaN is an error on the CPU and makes its row NaN on CUDA. Differentiable.
        edge_features: ``num_edges × heads × head_dim`` added to each edge's key and value
            (``k_j + e_ij``, ``v_j + e_ij``: PyG's ``TransformerConv(edge_dim=...)`` with the
            features already projected), in :meth:`Graph.edge_index` order, on ``q``'s device
            (cast to its dtype). Differentiable.
        dropout: the rate of dropout on the attention probabilities, in ``[0, 1)``: a kept
            weight is scaled by ``1 / (1 - dropout)``. Applied whenever it is non-zero (as
            ``torch.nn.functional.dropout(training=True)``; layers pass 0 in eval mode). The
            mask comes from Philox 4×32-10 keyed by ``dropout_seed`` (drawn from torch's
            default generator when ``None``, so ``torch.manual_seed`` reproduces it): the
            same seed gives the same mask on every algorithm, on CUDA and on the CPU, and the
            backward regenerates it instead of storing it. A seed without dropout is ignored.
        return_attention_weights: also return the weights ``num_edges × heads`` (after
            dropout, in :meth:`Graph.edge_index` order; float32 on CUDA, ``q``'s dtype on the
            CPU), as PyG's ``return_attention_weights=True``. Not differentiable.
        algorithm: ``"auto"`` or one of ``"unfused-csr"``, ``"unfused-tc"``, ``"fused-csr"``,
            ``"fused-tc"``, ``"hybrid"`` (CUDA; the CPU runs its reference whatever is asked).
            With a bias or dropout, ``auto`` picks ``fused-tc`` in float16 and bfloat16 and
            ``fused-csr`` in float32, with edge features or where fused-tc cannot run; every
            algorithm takes a bias and dropout, and edge features ``unfused-csr``,
            ``fused-csr`` and ``unfused-tc`` (``fused-tc`` and ``hybrid`` refuse them,
            saying which take them).

    Returns ``num_nodes × heads × head_dim`` like ``q`` (a numpy array for numpy inputs), and
    the weights with ``return_attention_weights``. Rows without edges get zeros. On torch
    tensors this is differentiable with respect to ``q``, ``k``, ``v`` and ``bias`` through
    spattn's exact backward (once: no double backward). ``bias``, ``edge_features``,
    ``dropout`` and the weights need torch tensors.

    Example (CPU)::

        g = spattn.Graph.from_edge_index(torch.tensor([[0, 1, 2, 0], [1, 2, 0, 0]]))
        q = torch.randn(3, 2, 8, requires_grad=True)
        bias = torch.zeros(g.num_edges, 2, requires_grad=True)
        out, w = spattn.sparse_attention(g, q, q, q, bias=bias, dropout=0.1,
                                         dropout_seed=7, return_attention_weights=True)
        out.sum().backward()  # q.grad and bias.grad
    """
    _check_graph(graph)
    check_algorithm(algorithm)
    extras = (bias is not None or edge_features is not None or dropout != 0.0
              or return_attention_weights)
    if extras:
        return _sparse_attention_extras(
            graph, q, k, v, scale, bias, edge_features, dropout, dropout_seed,
            return_attention_weights, algorithm,
        )
    if is_ndarray(q):
        scale = check_scale(scale)
        out, _ = _numpy_forward(graph, q, k, v, scale, algorithm)
        return out
    require_torch("sparse_attention on tensors")
    if not is_tensor(q):
        raise TypeError(f"q: expected a torch.Tensor or numpy.ndarray, got {type(q).__name__}")
    q, scale = _torch_operands(graph, q, k, v, scale)
    name = dtype_name(q.dtype)
    if q.device.type == "cuda":
        if name not in _CUDA_DTYPES:
            raise TypeError(f"q: dtype {q.dtype} is not supported on CUDA (float32, float16, bfloat16)")
        return _SparseAttention.apply(graph, q, k, v, scale, algorithm)
    if name in ("f32", "f64"):
        return _SparseAttention.apply(graph, q, k, v, scale, algorithm)
    if name in ("f16", "bf16"):
        # The CPU reference computes in float32: widen, and round the result back.
        out = _SparseAttention.apply(graph, q.float(), k.float(), v.float(), scale, algorithm)
        return out.to(q.dtype)
    raise TypeError(f"q: dtype {q.dtype} is not supported (float32, float16, bfloat16, float64)")


def sparse_attention_backward(
    graph: Graph,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    d_out: Any,
    *,
    scale: Optional[float] = None,
    algorithm: str = "auto",
):
    """The exact gradients of :func:`sparse_attention` without autograd: given the forward's
    inputs, its output ``out`` and the loss gradient ``d_out`` (shaped like ``out``), returns
    ``(dq, dk, dv, d_scale)`` with ``d_scale`` = ∂L/∂scale as a float. Same arguments as
    :func:`sparse_attention` (a float ``scale`` only); torch tensors (CUDA: float32, float16,
    bfloat16; CPU: float32, float64) or numpy arrays (float32, float64, float16).
    """
    _check_graph(graph)
    check_algorithm(algorithm)
    scale = check_scale(scale)
    sq, skv = _qkv_shapes(graph, q)
    if is_ndarray(q):
        return _numpy_backward(graph, q, k, v, out, d_out, scale, algorithm)
    require_torch("sparse_attention_backward on tensors")
    check_torch("q", q)
    check_torch("k", k, like=q, shape=skv)
    check_torch("v", v, like=q, shape=skv)
    check_torch("out", out, like=q, shape=sq)
    check_torch("d_out", d_out, like=q, shape=sq)
    name = dtype_name(q.dtype)
    allowed = _CUDA_DTYPES if q.device.type == "cuda" else ("f32", "f64")
    if name not in allowed:
        raise TypeError(f"q: dtype {q.dtype} is not supported here ({', '.join(allowed)})")
    with torch.no_grad():
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_scale = _native_backward(graph, q, k, v, out, d_out, dq, dk, dv, scale, algorithm)
    return dq, dk, dv, d_scale


def _torch_operands(graph: Graph, q: Any, k: Any, v: Any, scale: Any) -> Tuple[Any, float]:
    """Checks q, k, v (torch tensors); a 0-dim tensor scale is folded into q (so its gradient
    flows through torch). Returns q and the float scale the kernels take."""
    if is_tensor(scale):
        if scale.numel() != 1:
            raise ValueError(f"scale: a tensor scale must have one element, got shape {tuple(scale.shape)}")
        q = (q * scale.to(device=q.device, dtype=q.dtype).reshape(())).contiguous()
        scale = 1.0
    scale = check_scale(scale)
    _, skv = _qkv_shapes(graph, q)
    check_torch("q", q)
    check_torch("k", k, like=q, shape=skv, shape_hint="num_cols, heads, head_dim like q")
    check_torch("v", v, like=q, shape=skv, shape_hint="num_cols, heads, head_dim like q")
    return q, scale


def _check_dropout(dropout: Any, seed: Optional[int]) -> Optional[Tuple[float, int, int]]:
    """(rate, seed, offset) for the native call, or None without dropout."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout: expected a float in [0, 1), got {type(dropout).__name__}")
    rate = float(dropout)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout: the rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return None  # a seed without dropout draws nothing
    if seed is None:
        # torch's default generator: torch.manual_seed reproduces the mask.
        seed = int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(seed, bool) or not hasattr(seed, "__index__") or not 0 <= int(seed) < 2**64:
        raise ValueError(f"dropout_seed: expected an integer in [0, 2**64), got {seed!r}")
    return rate, int(seed), 0


def _check_bias(bias: Any, graph: Graph, q: Any) -> Tuple[Any, str]:
    """The bias as the kernels take it (contiguous, q's dtype and device) and its layout."""
    if bias is None:
        return None, "none"
    if not is_tensor(bias):
        raise TypeError(f"bias: expected a torch.Tensor, got {type(bias).__name__}")
    heads = q.shape[1]
    e = graph.num_edges
    if tuple(bias.shape) == (e,):
        kind = "shared"
    elif tuple(bias.shape) == (e, heads):
        kind = "per_head"
    else:
        raise ValueError(
            f"bias: has shape {tuple(bias.shape)}, expected ({e},) shared by the heads or "
            f"({e}, {heads}) per head (num_edges = {e}, in Graph.edge_index order)"
        )
    if bias.device != q.device:
        raise ValueError(f"bias: is on {bias.device}, expected {q.device} like q")
    if not bias.is_floating_point():
        raise TypeError(f"bias: expected a floating-point tensor, got {bias.dtype}")
    return bias.to(q.dtype).contiguous(), kind


def _check_edge_features(features: Any, graph: Graph, q: Any) -> Any:
    """The edge features as the kernels take them (contiguous, q's dtype and device)."""
    if features is None:
        return None
    want = (graph.num_edges, q.shape[1], q.shape[2])
    _check_per_edge("edge_features", features, want, "(num_edges, heads, head_dim)", q, "q")
    return features.to(q.dtype).contiguous()


def _check_per_edge(name: str, t: Any, shape: tuple, layout: str, like: Any, like_name: str) -> None:
    """A per-edge tensor: a floating-point torch tensor of `shape` on `like`'s device."""
    if not is_tensor(t):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"{name}: has shape {tuple(t.shape)}, expected {shape} {layout}, in Graph.edge_index order"
        )
    if t.device != like.device:
        raise ValueError(f"{name}: is on {t.device}, expected {like.device} like {like_name}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")


def _sparse_attention_extras(graph, q, k, v, scale, bias, features, dropout, seed, want_weights,
                             algorithm):
    if not is_tensor(q):
        raise TypeError(
            "bias, edge_features, dropout and return_attention_weights need torch tensors "
            f"(q is a {type(q).__name__})"
        )
    drop = _check_dropout(dropout, seed)
    q, scale = _torch_operands(graph, q, k, v, scale)
    bias, kind = _check_bias(bias, graph, q)
    features = _check_edge_features(features, graph, q)
    name = dtype_name(q.dtype)
    if q.device.type == "cuda":
        if name not in _CUDA_DTYPES:
            raise TypeError(f"q: dtype {q.dtype} is not supported on CUDA (float32, float16, bfloat16)")
        out, w = _SparseAttentionExtras.apply(
            graph, q, k, v, bias, features, scale, algorithm, kind, drop, want_weights
        )
    elif name in ("f32", "f64"):
        out, w = _SparseAttentionExtras.apply(
            graph, q, k, v, bias, features, scale, algorithm, kind, drop, want_weights
        )
    elif name in ("f16", "bf16"):
        # The CPU reference computes in float32: widen, and round the results back.
        widen = lambda t: None if t is None else t.float()  # noqa: E731
        out, w = _SparseAttentionExtras.apply(
            graph, q.float(), k.float(), v.float(), widen(bias), widen(features),
            scale, algorithm, kind, drop, want_weights,
        )
        out, w = out.to(q.dtype), w.to(q.dtype)
    else:
        raise TypeError(f"q: dtype {q.dtype} is not supported (float32, float16, bfloat16, float64)")
    return (out, w.view(graph.num_edges, q.shape[1])) if want_weights else out


def _native_extras(graph, q, scale, algorithm, backward, kind, drop, features, ptrs) -> float:
    """The extras' forward or backward; the autograd backward needs no ∂L/∂scale (its scale is
    a constant; a tensor scale is folded into q), so on CUDA it does not wait for the GPU."""
    n, h, d = q.shape
    return graph._core.attention_extras(
        (device_index(q), dtype_name(q.dtype), h, d), scale, algorithm, backward, kind, drop,
        features, ptrs, stream_of(q), d_scale=False,
    )


def _address_or_0(t) -> int:
    return address(t) if t is not None else 0


def _native_forward(graph, q, k, v, out, scale, algorithm) -> None:
    n, h, d = q.shape
    graph._core.attention(
        (device_index(q) if is_tensor(q) else -1, dtype_name(q.dtype), h, d), scale, algorithm,
        False, [address(q), address(k), address(v), address(out)],
        stream_of(q) if is_tensor(q) else 0,
    )


def _native_backward(graph, q, k, v, out, d_out, dq, dk, dv, scale, algorithm, d_scale=True) -> float:
    """The exact backward; ∂L/∂scale only where ``d_scale`` (on CUDA reading it waits for the
    GPU; the autograd backward does not need it)."""
    n, h, d = q.shape
    return graph._core.attention(
        (device_index(q) if is_tensor(q) else -1, dtype_name(q.dtype), h, d), scale, algorithm,
        True, [address(q), address(k), address(v), address(out), address(d_out),
         address(dq), address(dk), address(dv)],
        stream_of(q) if is_tensor(q) else 0, d_scale=d_scale,
    )


def _empty_problem(graph: Graph, q: Any) -> bool:
    return q.shape[0] == 0 or graph.num_cols == 0 or q.shape[1] == 0 or q.shape[2] == 0


if torch is not None:
    from torch.autograd.function import once_differentiable

    class _SparseAttention(torch.autograd.Function):
        """Autograd of sparse attention: forward and exact backward by spattn's kernels."""

        @staticmethod
        def forward(ctx, graph, q, k, v, scale, algorithm):
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            if _empty_problem(graph, q):
                out.zero_()
            else:
                _native_forward(graph, q, k, v, out, scale, algorithm)
            ctx.graph, ctx.scale, ctx.algorithm = graph, scale, algorithm
            ctx.save_for_backward(q, k, v, out)
            return out

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out):
            q, k, v, out = ctx.saved_tensors
            d_out = d_out.to(dtype=q.dtype).contiguous()
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            if _empty_problem(ctx.graph, q):
                dq.zero_(), dk.zero_(), dv.zero_()
            else:
                _native_backward(
                    ctx.graph, q, k, v, out, d_out, dq, dk, dv, ctx.scale, ctx.algorithm,
                    d_scale=False,
                )
            return None, dq, dk, dv, None, None

    class _SparseAttentionExtras(torch.autograd.Function):
        """Autograd of sparse attention with a bias, edge features and/or dropout: the forward
        returns the output and the attention weights (empty unless asked for; not
        differentiable); the backward regenerates the dropout mask from the seed."""

        @staticmethod
        def forward(ctx, graph, q, k, v, bias, features, scale, algorithm, kind, drop, want_weights):
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            w_dtype = torch.float32 if q.device.type == "cuda" else q.dtype
            w_len = graph.num_edges * q.shape[1] if want_weights else 0
            w = torch.empty(w_len, dtype=w_dtype, device=q.device)
            if _empty_problem(graph, q):
                out.zero_(), w.zero_()
            else:
                _native_extras(
                    graph, q, scale, algorithm, False, kind, drop, features is not None,
                    [address(q), address(k), address(v), address(out), _address_or_0(bias),
                     address(w) if want_weights else 0, _address_or_0(features)],
                )
            ctx.graph, ctx.scale, ctx.algorithm, ctx.kind, ctx.drop = graph, scale, algorithm, kind, drop
            ctx.save_for_backward(q, k, v, bias, features)
            ctx.mark_non_differentiable(w)
            return out, w

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out, _d_weights):
            q, k, v, bias, features = ctx.saved_tensors
            d_out = d_out.to(dtype=q.dtype).contiguous()
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            d_bias = torch.empty_like(bias) if bias is not None else None
            d_feat = torch.empty_like(features) if features is not None else None
            if _empty_problem(ctx.graph, q):
                for t in (dq, dk, dv, d_bias, d_feat):
                    if t is not None:
                        t.zero_()
            else:
                _native_extras(
                    ctx.graph, q, ctx.scale, ctx.algorithm, True, ctx.kind, ctx.drop,
                    features is not None,
                    [address(q), address(k), address(v), address(d_out), _address_or_0(bias),
                     address(dq), address(dk), address(dv), _address_or_0(d_bias),
                     _address_or_0(features), _address_or_0(d_feat)],
                )
            return None, dq, dk, dv, d_bias, d_feat, None, None, None, None, None

    class _GatAttention(torch.autograd.Function):
        """Autograd of GAT attention: forward and exact backward by spattn's kernels (the
        scores are recomputed in the backward, not stored)."""

        @staticmethod
        def forward(ctx, graph, x, a_dst, a_src, bias, slope, drop):
            n, h, c = graph.num_nodes, x.shape[1], x.shape[2]
            out = torch.empty((n, h, c), dtype=x.dtype, device=x.device)
            cuda = x.device.type == "cuda"
            if graph.num_edges == 0 or out.numel() == 0:
                out.zero_()
            else:
                ws = (
                    torch.empty(graph.num_edges * h, dtype=torch.float32, device=x.device)
                    if cuda
                    else None
                )
                graph._core.gat_forward(
                    device_index(x), dtype_name(x.dtype), h, c, slope,
                    address(x), address(a_dst), address(a_src), address(out),
                    _address_or_0(ws), stream_of(x), drop, _address_or_0(bias),
                )
            ctx.graph, ctx.slope, ctx.drop = graph, slope, drop
            ctx.save_for_backward(x, a_dst, a_src, bias)
            return out

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out):
            x, a_dst, a_src, bias = ctx.saved_tensors
            graph = ctx.graph
            h, c = x.shape[1], x.shape[2]
            d_out = d_out.to(dtype=x.dtype).contiguous()
            dx = torch.empty_like(x)
            da_dst, da_src = torch.empty_like(a_dst), torch.empty_like(a_src)
            d_bias = torch.empty_like(bias) if bias is not None else None
            if graph.num_edges == 0 or x.numel() == 0:
                for t in (dx, da_dst, da_src, d_bias):
                    if t is not None:
                        t.zero_()
                return None, dx, da_dst, da_src, d_bias, None, None
            cuda = x.device.type == "cuda"
            if cuda:
                ws = [
                    torch.empty(graph.num_edges * h, dtype=torch.float32, device=x.device)
                    for _ in range(3)
                ]
                wsp = tuple(address(w) for w in ws)
            else:
                wsp = (0, 0, 0)
            graph._core.gat_backward(
                device_index(x), dtype_name(x.dtype), h, c, ctx.slope,
                address(x), address(a_dst), address(a_src), address(d_out),
                address(dx), address(da_dst), address(da_src), wsp, stream_of(x), ctx.drop,
                _address_or_0(bias), _address_or_0(d_bias),
            )
            return None, dx, da_dst, da_src, d_bias, None, None


def gat_attention(
    graph: Graph,
    x: Any,
    alpha_dst: Any,
    alpha_src: Any,
    negative_slope: float = 0.2,
    *,
    bias: Any = None,
    dropout: float = 0.0,
    dropout_seed: Optional[int] = None,
):
    """GAT's attention: per edge ``j -> i`` and head ``h`` the score
    ``e = LeakyReLU(alpha_dst[i, h] + alpha_src[j, h] + bias[e, h], negative_slope)``, a softmax over each
    target's incoming edges, and ``out[i, h] = Σ_j softmax(e)[i, j, h] · x[j, h]``.

    Args:
        x: ``num_cols × heads × channels`` (the projected features ``W x``); CUDA: float32,
            float16, bfloat16; CPU: also float64.
        alpha_dst, alpha_src: ``num_nodes × heads`` and ``num_cols × heads`` (the per-node
            terms ``⟨W x_i, a_dst⟩``, ``⟨W x_j, a_src⟩``). On CUDA they are used in float32
            (cast if needed, differentiably) whatever ``x``'s dtype, so their gradients are
            not rounded to half precision; on the CPU everything runs in float32 (float64 for
            float64 inputs).

        bias: ``num_edges × heads`` added to the scores before the LeakyReLU (GAT's edge
            term ``⟨W_e e_ij, a_edge⟩``), in :meth:`Graph.edge_index` order; used in float32 on
            CUDA like the per-node terms. Differentiable.
        dropout, dropout_seed: dropout on the attention coefficients, as
            :func:`sparse_attention`'s (the GAT paper uses 0.6 in training).

    Returns ``num_nodes × heads × channels`` of ``x``'s dtype, differentiable with respect to
    ``x``, ``alpha_dst``, ``alpha_src`` and ``bias`` through spattn's exact backward.
    """
    _check_graph(graph)
    require_torch("gat_attention")
    if not is_tensor(x):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x: expected shape (num_nodes, heads, channels), got {tuple(x.shape)}")
    n, h, c = x.shape
    if n != graph.num_cols:
        raise ValueError(f"x: has {n} rows, but the graph has {graph.num_cols} nodes")
    check_torch("x", x)
    slope = float(negative_slope)
    drop = _check_dropout(dropout, dropout_seed)
    if bias is not None:
        _check_per_edge("bias", bias, (graph.num_edges, h), "(num_edges, heads)", x, "x")
    for name, a, rows in (("alpha_dst", alpha_dst, graph.num_nodes), ("alpha_src", alpha_src, n)):
        if not is_tensor(a):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(a).__name__}")
        if a.device != x.device:
            raise ValueError(f"{name}: is on {a.device}, expected {x.device} like x")
        if tuple(a.shape) != (rows, h):
            raise ValueError(f"{name}: has shape {tuple(a.shape)}, expected {(rows, h)}")
        if not a.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {a.dtype}")
    name = dtype_name(x.dtype)
    if x.device.type == "cuda":
        if name not in _CUDA_DTYPES:
            raise TypeError(f"x: dtype {x.dtype} is not supported on CUDA (float32, float16, bfloat16)")
        a_dst = check_torch("alpha_dst", alpha_dst.float().contiguous())
        a_src = check_torch("alpha_src", alpha_src.float().contiguous())
        b = None if bias is None else check_torch("bias", bias.float().contiguous())
        return _GatAttention.apply(graph, x, a_dst, a_src, b, slope, drop)
    if name is None:
        raise TypeError(f"x: dtype {x.dtype} is not supported (float32, float16, bfloat16, float64)")
    work = torch.float64 if name == "f64" else torch.float32
    out = _GatAttention.apply(
        graph,
        x.to(work).contiguous(),
        alpha_dst.to(work).contiguous(),
        alpha_src.to(work).contiguous(),
        None if bias is None else bias.to(work).contiguous(),
        slope,
        drop,
    )
    return out.to(x.dtype)


# ---- numpy (CPU, no autograd) ----------------------------------------------------------------


def _numpy_dtype(q):
    if q.dtype == np.float32 or q.dtype == np.float64:
        return q.dtype, q.dtype
    if q.dtype == np.float16:
        return q.dtype, np.dtype(np.float32)
    raise TypeError(f"q: dtype {q.dtype} is not supported (float32, float64, float16)")


def _numpy_forward(graph, q, k, v, scale, algorithm):
    sq, skv = _qkv_shapes(graph, q)
    check_numpy("q", q)
    dt, work = _numpy_dtype(q)
    check_numpy("k", k, shape=skv, dtype=dt, shape_hint="num_cols, heads, head_dim like q")
    check_numpy("v", v, shape=skv, dtype=dt, shape_hint="num_cols, heads, head_dim like q")
    if work != dt:
        q, k, v = (np.ascontiguousarray(a, dtype=work) for a in (q, k, v))
    out = np.empty(sq, dtype=work)
    if _empty_problem(graph, q):
        out[...] = 0
    else:
        _native_forward(graph, q, k, v, out, scale, algorithm)
    return out.astype(dt) if work != dt else out, (q, k, v, out)


def _numpy_backward(graph, q, k, v, out, d_out, scale, algorithm):
    sq, skv = _qkv_shapes(graph, q)
    check_numpy("q", q)
    dt, work = _numpy_dtype(q)
    check_numpy("k", k, shape=skv, dtype=dt)
    check_numpy("v", v, shape=skv, dtype=dt)
    check_numpy("out", out, shape=sq, dtype=dt)
    check_numpy("d_out", d_out, shape=sq, dtype=dt)
    if work != dt:
        q, k, v, out, d_out = (np.ascontiguousarray(a, dtype=work) for a in (q, k, v, out, d_out))
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    if _empty_problem(graph, q):
        dq[...] = 0
        dk[...] = 0
        dv[...] = 0
        d_scale = 0.0
    else:
        d_scale = _native_backward(graph, q, k, v, out, d_out, dq, dk, dv, scale, algorithm)
    if work != dt:
        dq, dk, dv = dq.astype(dt), dk.astype(dt), dv.astype(dt)
    return dq, dk, dv, d_scale


__all__ = ["sparse_attention", "sparse_attention_backward", "gat_attention"]
