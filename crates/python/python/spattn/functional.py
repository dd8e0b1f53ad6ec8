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

from . import _native
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
_graph_task_id = getattr(getattr(torch, "_C", None), "_current_graph_task_id", None)


def _outside_backward() -> bool:
    """Whether no autograd backward pass is running: a forward inside one (activation
    checkpointing's recomputation) begins no training step, so it leaves :attr:`Graph.policy`
    as it is."""
    return _graph_task_id is None or _graph_task_id() == -1


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
            edge (a row whose edges are all masked gets zeros); a NaN is an error on the CPU
            and makes its row NaN on CUDA. Differentiable.
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
            With a bias or dropout, ``auto`` picks ``fused-tc`` in float16 and bfloat16 (on a
            graph seen once, :attr:`Graph.policy` ``"once"``, ``fused-csr`` as without them) and
            ``fused-csr`` in float32, with edge features or where fused-tc cannot run; every
            algorithm takes a bias and dropout, and edge features all but ``hybrid`` (which
            refuses them, saying which take them; ``fused-tc`` runs them in its kernel on
            float16 / bfloat16 heads of 64 or 128 features, through the composition else).

    Returns ``num_nodes × heads × head_dim`` like ``q`` (a numpy array for numpy inputs), and
    the weights with ``return_attention_weights``. Rows without edges get zeros. On torch
    tensors this is differentiable with respect to ``q``, ``k``, ``v`` and ``bias`` through
    spattn's exact backward (once: no double backward). Where a gradient is wanted and the
    plan is ``fused-tc`` (float16 / bfloat16 on CUDA, without extras) and its backward runs
    on tensor cores, the forward also saves each row's softmax statistic (``num_nodes × heads``
    float32) so that the backward skips recomputing it. ``bias``, ``edge_features``,
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
    if is_ndarray(q):
        check_algorithm(algorithm)
        if (bias is not None or edge_features is not None or dropout != 0.0
                or return_attention_weights):
            raise TypeError(
                "bias, edge_features, dropout and return_attention_weights need torch tensors "
                f"(q is a {type(q).__name__})"
            )
        scale = check_scale(scale)
        out, _ = _numpy_forward(graph, q, k, v, scale, algorithm)
        return out
    return _sparse_attention(
        _ref(graph), q, k, v, scale, bias, edge_features, dropout, dropout_seed,
        return_attention_weights, algorithm,
    )


def _ref(graph: Graph) -> Any:
    """What the torch paths take for a graph: the :class:`Graph` itself, or under
    ``torch.compile`` its token (a tensor: the custom operators' graph argument)."""
    return graph._token if _compiling() else graph


def _compiling() -> bool:
    """Whether ``torch.compile`` (dynamo) is tracing: the calls then go through the custom
    operators of :mod:`spattn._ops` (eager calls skip their dispatch, ~20 µs of host time)."""
    return torch is not None and torch.compiler.is_compiling()


def _sparse_attention(ref, q, k, v, scale, bias, features, dropout, seed, want_weights, algorithm):
    """:func:`sparse_attention` on torch tensors, ``ref`` from :func:`_ref` (also the layers'
    entry, whose graph comes from :func:`spattn.nn.graph_for`)."""
    check_algorithm(algorithm)
    require_torch("sparse_attention on tensors")
    if not is_tensor(q):
        raise TypeError(f"q: expected a torch.Tensor or numpy.ndarray, got {type(q).__name__}")
    extras = bias is not None or features is not None or dropout != 0.0 or want_weights
    drop = _check_dropout(dropout, seed) if extras else None
    q, k, v = _autocast(q, k, v)
    q, scale = _torch_operands(q, k, v, scale)
    if extras:
        bias = _check_bias(bias, q)
        features = _check_edge_features(features, q)
    name = dtype_name(q.dtype)
    if q.device.type == "cuda":
        if name not in _CUDA_DTYPES:
            raise TypeError(f"q: dtype {q.dtype} is not supported on CUDA (float32, float16, bfloat16)")
        widen = False
    elif name in ("f32", "f64"):
        widen = False
    elif name in ("f16", "bf16"):
        widen = True  # the CPU reference computes in float32: widen, round the result back
    else:
        raise TypeError(f"q: dtype {q.dtype} is not supported (float32, float16, bfloat16, float64)")
    if widen:
        wide = lambda t: None if t is None else t.float()  # noqa: E731
        q2, k2, v2, bias, features = (wide(t) for t in (q, k, v, bias, features))
    else:
        q2, k2, v2 = q, k, v
    if not extras:
        out = _attention_call(ref, q2, k2, v2, scale, algorithm)
        return out.to(q.dtype) if widen else out
    out, w = _extras_call(ref, q2, k2, v2, bias, features, scale, algorithm, drop, want_weights)
    if widen:
        out, w = out.to(q.dtype), w.to(q.dtype)
    return (out, w.view(-1, q.shape[1])) if want_weights else out


def _autocast_dtype(device_type: str) -> Optional[Any]:
    """The dtype of ``torch.autocast`` on `device_type` where it is on (CUDA or the CPU), else
    None."""
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast(*ts):
    """Inside ``torch.autocast`` on the tensors' device: the floating-point operands in the
    autocast dtype (attention then accumulates in float32 and returns that dtype), as
    autocast's lower-precision ops do; unchanged otherwise."""
    t0 = ts[0]
    if not is_tensor(t0) or not t0.is_floating_point():
        return ts
    dt = _autocast_dtype(t0.device.type)
    if dt is None:
        return ts
    return tuple(t.to(dt) if is_tensor(t) and t.is_floating_point() else t for t in ts)


def _attention_call(ref, q, k, v, scale, algorithm):
    if is_tensor(ref):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            # Training: the operator that also hands the row statistics to the backward.
            return torch.ops.spattn.attention_keeping(ref, q, k, v, scale, algorithm)[0]
        return torch.ops.spattn.attention(ref, q, k, v, scale, algorithm)
    keep = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _SparseAttention.apply(ref, q, k, v, scale, algorithm, keep)


def _extras_call(ref, q, k, v, bias, features, scale, algorithm, drop, want_weights):
    if is_tensor(ref):
        rate, seed = (0.0, None) if drop is None else (drop[0], _seed_tensor(drop[1]))
        if want_weights:
            return torch.ops.spattn.attention_extras_weights(
                ref, q, k, v, bias, features, scale, algorithm, rate, seed
            )
        out = torch.ops.spattn.attention_extras(ref, q, k, v, bias, features, scale, algorithm,
                                                rate, seed)
        return out, out.new_empty(0)
    return _SparseAttentionExtras.apply(
        ref, q, k, v, bias, features, scale, algorithm, drop, want_weights
    )


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


def _torch_operands(q: Any, k: Any, v: Any, scale: Any) -> Tuple[Any, Optional[float]]:
    """Checks q, k, v (torch tensors) as far as they can be without the graph (its sizes are
    checked where the call runs, :func:`_check_rows`); a 0-dim tensor scale is folded into q
    (so its gradient flows through torch). Returns q and the float scale the kernels take."""
    if is_tensor(scale):
        if scale.numel() != 1:
            raise ValueError(f"scale: a tensor scale must have one element, got shape {tuple(scale.shape)}")
        q = (q * scale.to(device=q.device, dtype=q.dtype).reshape(())).contiguous()
        scale = 1.0
    scale = check_scale(scale)
    if q.dim() != 3:
        raise ValueError(f"q: expected shape (num_nodes, heads, head_dim), got {tuple(q.shape)}")
    check_torch("q", q)
    _, h, d = q.shape
    for name, t in (("k", k), ("v", v)):
        if is_tensor(t) and (t.dim() != 3 or t.shape[1] != h or t.shape[2] != d
                             or t.shape[0] != k.shape[0]):
            raise ValueError(
                f"{name}: has shape {tuple(t.shape)}, expected (num_cols, {h}, {d}) "
                "(num_cols, heads, head_dim like q)"
            )
        check_torch(name, t, like=q)
    return q, scale


def _check_rows(graph: Graph, q: Any, k: Any) -> None:
    """q's and k's (v's) rows against the graph's nodes and columns."""
    n, h, d = q.shape
    if n != graph.num_nodes:
        raise ValueError(
            f"q: has {n} rows, but the graph has {graph.num_nodes} nodes (shape (n, heads, head_dim))"
        )
    if k.shape[0] != graph.num_cols:
        raise ValueError(
            f"k: has shape {tuple(k.shape)}, expected {(graph.num_cols, h, d)} "
            "(num_cols, heads, head_dim like q)"
        )


def _check_dropout(dropout: Any, seed: Optional[int]) -> Optional[Tuple[float, Any, int]]:
    """(rate, seed, offset) for the native call, or None without dropout. Under
    ``torch.compile`` a seed drawn here is a CPU tensor (reading it would break the graph)."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout: expected a float in [0, 1), got {type(dropout).__name__}")
    rate = float(dropout)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout: the rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return None  # a seed without dropout draws nothing
    if seed is None:
        if not _compiling() and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "dropout: a CUDA graph captured with attention dropout would replay one mask "
                "at every replay (the seed is drawn on the host when the graph is captured); "
                "capture without dropout, or pass dropout_seed to accept a fixed mask"
            )
        # torch's default generator: torch.manual_seed reproduces the mask.
        drawn = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        return rate, (drawn if _compiling() else int(drawn.item())), 0
    if isinstance(seed, bool) or not hasattr(seed, "__index__") or not 0 <= int(seed) < 2**64:
        raise ValueError(f"dropout_seed: expected an integer in [0, 2**64), got {seed!r}")
    return rate, int(seed), 0


def _seed_tensor(seed: Any) -> Any:
    """A dropout seed as the custom operators take it: a CPU int64 tensor of one element
    holding the seed's 64 bits (:func:`_seed_int` reads it back)."""
    if is_tensor(seed):
        return seed
    return torch.tensor([seed - 2**64 if seed >= 2**63 else seed], dtype=torch.int64)


def _seed_int(seed: Any) -> int:
    return int(seed.reshape(-1)[0]) & (2**64 - 1)


def _check_bias(bias: Any, q: Any) -> Any:
    """The bias as the kernels take it (contiguous, q's dtype and device); its length is
    checked against the graph's edges where the call runs (:func:`_bias_kind`)."""
    if bias is None:
        return None
    if not is_tensor(bias):
        raise TypeError(f"bias: expected a torch.Tensor, got {type(bias).__name__}")
    if bias.device != q.device:
        raise ValueError(f"bias: is on {bias.device}, expected {q.device} like q")
    if not bias.is_floating_point():
        raise TypeError(f"bias: expected a floating-point tensor, got {bias.dtype}")
    return bias.to(q.dtype).contiguous()


def _bias_kind(bias: Any, graph: Graph, heads: int) -> str:
    """The bias's layout (``"none"``, ``"shared"``, ``"per_head"``), checking its shape."""
    if bias is None:
        return "none"
    e = graph.num_edges
    if tuple(bias.shape) == (e,):
        return "shared"
    if tuple(bias.shape) == (e, heads):
        return "per_head"
    raise ValueError(
        f"bias: has shape {tuple(bias.shape)}, expected ({e},) shared by the heads or "
        f"({e}, {heads}) per head (num_edges = {e}, in Graph.edge_index order)"
    )


def _check_edge_features(features: Any, q: Any) -> Any:
    """The edge features as the kernels take them (contiguous, q's dtype and device); their
    rows are checked against the graph's edges where the call runs."""
    if features is None:
        return None
    _check_per_edge("edge_features", features, None, "(num_edges, heads, head_dim)", q, "q")
    return features.to(q.dtype).contiguous()


def _check_per_edge(name: str, t: Any, shape: Optional[tuple], layout: str, like: Any,
                    like_name: str) -> None:
    """A per-edge tensor: a floating-point torch tensor of `shape` (where given) on `like`'s
    device."""
    if not is_tensor(t):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(
            f"{name}: has shape {tuple(t.shape)}, expected {shape} {layout}, in Graph.edge_index order"
        )
    if t.device != like.device:
        raise ValueError(f"{name}: is on {t.device}, expected {like.device} like {like_name}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")


def _native_extras(graph, q, scale, algorithm, backward, kind, drop, features, ptrs) -> float:
    """The extras' forward or backward; the autograd backward needs no ∂L/∂scale (its scale is
    a constant; a tensor scale is folded into q), so on CUDA it does not wait for the GPU."""
    n, h, d = q.shape
    return graph._core.attention_extras(
        (device_index(q), dtype_name(q.dtype), h, d), scale, algorithm, backward, kind, drop,
        features, ptrs, stream_of(q), d_scale=False, step=not backward and _outside_backward(),
    )


def _address_or_0(t) -> int:
    return address(t) if t is not None else 0


def _native_forward(graph, q, k, v, out, scale, algorithm, lse=None) -> bool:
    """The forward; with ``lse`` (CUDA, ``n × heads`` float32) it keeps the row statistics
    there where the plan can, and says whether it did."""
    n, h, d = q.shape
    kept = graph._core.attention(
        (device_index(q) if is_tensor(q) else -1, dtype_name(q.dtype), h, d), scale, algorithm,
        False, [address(q), address(k), address(v), address(out)],
        stream_of(q) if is_tensor(q) else 0, lse=0 if lse is None else address(lse),
        step=_outside_backward(),
    )
    return kept == 1.0


def _native_backward(graph, q, k, v, out, d_out, dq, dk, dv, scale, algorithm, d_scale=True,
                     lse=None) -> float:
    """The exact backward; ∂L/∂scale only where ``d_scale`` (on CUDA reading it waits for the
    GPU; the autograd backward does not need it); from the row statistics a forward kept in
    ``lse`` where given."""
    n, h, d = q.shape
    return graph._core.attention(
        (device_index(q) if is_tensor(q) else -1, dtype_name(q.dtype), h, d), scale, algorithm,
        True, [address(q), address(k), address(v), address(out), address(d_out),
         address(dq), address(dk), address(dv)],
        stream_of(q) if is_tensor(q) else 0, d_scale=d_scale,
        lse=0 if lse is None else address(lse),
    )


def _empty_problem(graph: Graph, q: Any) -> bool:
    return q.shape[0] == 0 or graph.num_cols == 0 or q.shape[1] == 0 or q.shape[2] == 0


# ---- the calls on torch tensors, shared by the eager autograd functions and the custom
# operators of spattn._ops (which torch.compile traces) -------------------------------------


def attention_forward(graph: Graph, q, k, v, scale, algorithm):
    """Sparse attention's output (checked tensors; the graph's sizes checked here)."""
    _check_rows(graph, q, k)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if _empty_problem(graph, q):
        out.zero_()
    else:
        _native_forward(graph, q, k, v, out, scale, algorithm)
    return out


def attention_forward_keeping(graph: Graph, q, k, v, scale, algorithm):
    """``(out, lse)``: :func:`attention_forward` that keeps each row's softmax statistic in
    ``lse`` (``n × heads`` float32) for the backward where the plan can (CUDA, float16 /
    bfloat16, a fused-tc plan: the backward then skips its statistics pass); ``lse`` is None
    where it did not."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return attention_forward(graph, q, k, v, scale, algorithm), None
    _check_rows(graph, q, k)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if _empty_problem(graph, q):
        return out.zero_(), None
    lse = torch.empty(q.shape[0] * q.shape[1], dtype=torch.float32, device=q.device)
    kept = _native_forward(graph, q, k, v, out, scale, algorithm, lse)
    return out, (lse if kept else None)


def _outputs(outs, *likes):
    """The gradients' tensors: ``outs`` where given (the custom operators write into tensors
    their callers allocated), else new ones like ``likes`` (None stays None)."""
    if outs is not None:
        return tuple(o if like is not None else None for o, like in zip(outs, likes))
    return tuple(torch.empty_like(t) if t is not None else None for t in likes)


def attention_backward(graph: Graph, q, k, v, out, d_out, scale, algorithm, outs=None,
                       lse=None):
    """``(dq, dk, dv)`` of :func:`attention_forward` (written into ``outs`` where given), from
    the row statistics :func:`attention_forward_keeping` kept in ``lse`` where given."""
    d_out = d_out.to(dtype=q.dtype).contiguous()
    dq, dk, dv = _outputs(outs, q, k, v)
    if lse is not None:
        want = q.shape[0] * q.shape[1]
        if (lse.dtype != torch.float32 or lse.device != q.device or not lse.is_contiguous()
                or lse.numel() != want):
            raise ValueError(
                f"lse: expected {want} contiguous float32 values (num_nodes × heads) on "
                f"{q.device}, got {tuple(lse.shape)} {lse.dtype} on {lse.device}"
            )
    if _empty_problem(graph, q):
        dq.zero_(), dk.zero_(), dv.zero_()
    else:
        _native_backward(graph, q, k, v, out, d_out, dq, dk, dv, scale, algorithm, d_scale=False,
                         lse=lse)
    return dq, dk, dv


def _extras_setup(graph: Graph, q, k, bias, features):
    """The graph's sizes against q, k, the bias and the edge features; the bias's layout."""
    _check_rows(graph, q, k)
    kind = _bias_kind(bias, graph, q.shape[1])
    if features is not None:
        want = (graph.num_edges, q.shape[1], q.shape[2])
        if tuple(features.shape) != want:
            raise ValueError(
                f"edge_features: has shape {tuple(features.shape)}, expected {want} "
                "(num_edges, heads, head_dim), in Graph.edge_index order"
            )
    return kind


def extras_forward(graph: Graph, q, k, v, bias, features, scale, algorithm, drop, want_weights):
    """``(out, weights)`` of sparse attention with a bias, edge features and/or dropout (the
    weights empty unless asked for)."""
    kind = _extras_setup(graph, q, k, bias, features)
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
    return out, w


def extras_backward(graph: Graph, q, k, v, d_out, bias, features, scale, algorithm, drop,
                    outs=None):
    """``(dq, dk, dv, d_bias, d_features)`` of :func:`extras_forward` (None for an absent
    bias or features; written into ``outs`` where given); the dropout mask regenerated from
    the seed."""
    kind = _extras_setup(graph, q, k, bias, features)
    d_out = d_out.to(dtype=q.dtype).contiguous()
    dq, dk, dv, d_bias, d_feat = _outputs(outs, q, k, v, bias, features)
    if _empty_problem(graph, q):
        for t in (dq, dk, dv, d_bias, d_feat):
            if t is not None:
                t.zero_()
    else:
        _native_extras(
            graph, q, scale, algorithm, True, kind, drop, features is not None,
            [address(q), address(k), address(v), address(d_out), _address_or_0(bias),
             address(dq), address(dk), address(dv), _address_or_0(d_bias),
             _address_or_0(features), _address_or_0(d_feat)],
        )
    return dq, dk, dv, d_bias, d_feat


def _check_gat_rows(graph: Graph, x, a_dst, a_src, bias) -> None:
    n, h = x.shape[0], x.shape[1]
    if n != graph.num_cols:
        raise ValueError(f"x: has {n} rows, but the graph has {graph.num_cols} nodes")
    if tuple(a_dst.shape) != (graph.num_nodes, h):
        raise ValueError(f"alpha_dst: has shape {tuple(a_dst.shape)}, expected {(graph.num_nodes, h)}")
    if bias is not None and tuple(bias.shape) != (graph.num_edges, h):
        raise ValueError(
            f"bias: has shape {tuple(bias.shape)}, expected {(graph.num_edges, h)} "
            "(num_edges, heads), in Graph.edge_index order"
        )


def _gat_kernels(graph: Graph, x, kernels: str, backward: bool, rows: bool = True) -> str:
    """The GAT kernels ``"auto"`` stands for on CUDA (the native rule, which the Rust layer
    follows too): the row-statistics kernels (no per-edge buffer) from
    ``_native.GAT_ROWS_MIN_HEADS`` heads, or up to ``_native.GAT_ROWS_SMALL_MAX_EDGES`` edges
    at any head count (and, for a backward, ``rows``: the forward's output is at hand);
    otherwise, for the backward, the fused passes up to
    ``_native.GAT_FUSED_MAX_EDGES`` edges and the composed CSR ops beyond (and the composed ops
    for the forward)."""
    if kernels != "auto":
        return kernels
    return _native.gat_auto_kernels(dtype_name(x.dtype), x.shape[1], x.shape[2],
                                    graph.num_edges, backward, rows)


def gat_forward(graph: Graph, x, a_dst, a_src, bias, slope, drop, kernels="auto"):
    """GAT attention's output (checked tensors; the graph's sizes checked here). ``kernels``
    (CUDA): ``"rows"`` (row statistics, then an SpMM that recomputes each probability: no
    per-edge buffer), ``"composed"`` (scores, softmax and SpMM through an ``nnz × heads``
    buffer) or ``"auto"`` (rows for several heads)."""
    return gat_forward_keeping(graph, x, a_dst, a_src, bias, slope, drop, kernels)[0]


def gat_forward_keeping(graph: Graph, x, a_dst, a_src, bias, slope, drop, kernels="auto"):
    """:func:`gat_forward`'s ``(out, lse)``: ``lse`` the rows kernels' workspace where they
    ran (float32: the row statistics, ``n × heads``, then with dropout the kept bits, which the
    backward then neither recomputes nor draws again), else None."""
    _check_gat_rows(graph, x, a_dst, a_src, bias)
    n, h, c = graph.num_nodes, x.shape[1], x.shape[2]
    out = torch.empty((n, h, c), dtype=x.dtype, device=x.device)
    if graph.num_edges == 0 or out.numel() == 0:
        return out.zero_(), None
    cuda = x.device.type == "cuda"
    kernels = _gat_kernels(graph, x, kernels, False) if cuda else "composed"
    ws = None
    if cuda:
        # Rows: the statistics, then (with dropout) the mask's words; composed: the probabilities.
        size = n * h + _mask_words(graph, h, drop) if kernels == "rows" else graph.num_edges * h
        ws = torch.empty(size, dtype=torch.float32, device=x.device)
    graph._core.gat_forward(
        device_index(x), dtype_name(x.dtype), h, c, slope,
        address(x), address(a_dst), address(a_src), address(out),
        _address_or_0(ws), stream_of(x), drop, _address_or_0(bias), kernels,
        step=_outside_backward(),
    )
    return out, (ws if kernels == "rows" else None)


def _mask_words(graph: Graph, heads: int, drop) -> int:
    """The u32 words of the rows kernels' dropout mask (a bit per edge and head; 0 without
    dropout)."""
    return 0 if drop is None else -(-graph.num_edges * heads // 32)


def gat_backward(graph: Graph, x, a_dst, a_src, d_out, bias, slope, drop, outs=None, kernels="auto",
                 out=None, lse=None):
    """``(dx, da_dst, da_src, d_bias)`` of :func:`gat_forward` (None for an absent bias); the
    probabilities are recomputed, not kept from the forward. ``kernels`` (CUDA): ``"rows"``
    (row statistics and two SpMM-shaped passes; needs ``out``, the forward's output),
    ``"fused"`` (two passes), ``"composed"`` (the CSR ops) or ``"auto"`` (rows where ``out``
    is given and they take the head, else fused on small graphs, else composed); ``lse``: what
    :func:`gat_forward_keeping` left for the same graph, inputs and dropout (the rows kernels
    then reuse its statistics and dropout mask)."""
    h, c = x.shape[1], x.shape[2]
    d_out = d_out.to(dtype=x.dtype).contiguous()
    dx, da_dst, da_src, d_bias = _outputs(outs, x, a_dst, a_src, bias)
    if graph.num_edges == 0 or x.numel() == 0:
        for t in (dx, da_dst, da_src, d_bias):
            if t is not None:
                t.zero_()
        return dx, da_dst, da_src, d_bias
    cuda = x.device.type == "cuda"
    if not cuda:
        kernels = "composed"  # the CPU has one path
    else:
        kernels = _gat_kernels(graph, x, kernels, True, rows=out is not None)
        if kernels == "rows" and out is None:
            raise ValueError('kernels="rows" needs out, the forward\'s output')
    if out is not None:
        out = out.to(dtype=x.dtype).contiguous()
        if tuple(out.shape) != (graph.num_nodes, h, c) or out.device != x.device:
            raise ValueError(f"out: expected shape {(graph.num_nodes, h, c)} on {x.device}, got "
                             f"{tuple(out.shape)} on {out.device}")
    n = graph.num_nodes
    # Workspaces: rows, dS (nnz × heads), the row statistics (n × heads; or the forward's
    # statistics and A's dropout mask, kept) and with dropout the masks to draw (A's and Aᵀ's,
    # or Aᵀ's alone); composed, three nnz × heads buffers; fused, none.
    ws = []
    kept = cuda and kernels == "rows" and lse is not None
    kept_len = n * h + _mask_words(graph, h, drop)
    if kept and (tuple(lse.shape) != (kept_len,) or lse.dtype != torch.float32
                 or lse.device != x.device or not lse.is_contiguous()):
        raise ValueError(f"lse: expected {kept_len} contiguous float32 values on {x.device} (what "
                         f"gat_forward_keeping returned with this dropout), got "
                         f"{tuple(lse.shape)} {lse.dtype} on {lse.device}")
    if cuda and kernels == "rows":
        ws = [torch.empty(graph.num_edges * h, dtype=torch.float32, device=x.device),
              lse if kept else torch.empty(n * h, dtype=torch.float32, device=x.device)]
        if drop is not None:
            ws.append(torch.empty((1 if kept else 2) * _mask_words(graph, h, drop),
                                  dtype=torch.int32, device=x.device))
    elif cuda and kernels == "composed":
        ws = [torch.empty(graph.num_edges * h, dtype=torch.float32, device=x.device)
              for _ in range(3)]
    wsp = tuple(address(w) for w in ws) + (0,) * (3 - len(ws))
    graph._core.gat_backward(
        device_index(x), dtype_name(x.dtype), h, c, slope,
        address(x), address(a_dst), address(a_src), address(d_out),
        address(dx), address(da_dst), address(da_src), wsp, stream_of(x), drop,
        _address_or_0(bias), _address_or_0(d_bias), kernels,
        address(out) if out is not None and cuda else 0, kept,
    )
    return dx, da_dst, da_src, d_bias


def _check_gatv2_rows(graph: Graph, xl, xr, features) -> None:
    n, h, c = xl.shape
    if n != graph.num_cols:
        raise ValueError(f"x_l: has {n} rows, but the graph has {graph.num_cols} nodes")
    if xr.shape[0] != graph.num_nodes:
        raise ValueError(f"x_r: has {xr.shape[0]} rows, but the graph has {graph.num_nodes} nodes")
    if features is not None and tuple(features.shape) != (graph.num_edges, h, c):
        raise ValueError(
            f"edge_features: has shape {tuple(features.shape)}, expected "
            f"{(graph.num_edges, h, c)} (num_edges, heads, channels), in Graph.edge_index order"
        )


def gatv2_forward(graph: Graph, xl, xr, att, features, slope, drop):
    """GATv2 attention's output on CUDA (checked tensors; ``att`` ``heads · channels`` f32)."""
    _check_gatv2_rows(graph, xl, xr, features)
    n, h, c = graph.num_nodes, xl.shape[1], xl.shape[2]
    out = torch.empty((n, h, c), dtype=xl.dtype, device=xl.device)
    if graph.num_edges == 0 or out.numel() == 0:
        return out.zero_()
    ws = torch.empty(graph.num_edges * h, dtype=torch.float32, device=xl.device)
    graph._core.gatv2_forward(
        device_index(xl), dtype_name(xl.dtype), h, c, slope, address(xl), address(xr),
        address(att), _address_or_0(features), address(out), address(ws), stream_of(xl), drop,
    )
    return out


def gatv2_backward(graph: Graph, xl, xr, att, features, d_out, slope, drop, outs=None):
    """``(d_xl, d_xr, d_att, d_features)`` of :func:`gatv2_forward` (``d_att`` f32 like ``att``;
    None for absent features): scores recomputed, ∂att summed over rows by torch (no atomics)."""
    _check_gatv2_rows(graph, xl, xr, features)
    n, h, c = graph.num_nodes, xl.shape[1], xl.shape[2]
    if tuple(d_out.shape) != (n, h, c):
        raise ValueError(f"d_out: has shape {tuple(d_out.shape)}, expected {(n, h, c)}")
    d_out = d_out.to(dtype=xl.dtype).contiguous()
    dxl, dxr, d_att, d_feat = _outputs(outs, xl, xr, att, features)
    for name, o, like in (("d_x_l", dxl, xl), ("d_x_r", dxr, xr), ("d_att", d_att, att),
                          ("d_edge_features", d_feat, features)):
        if like is not None and (tuple(o.shape) != tuple(like.shape) or o.dtype != like.dtype
                                 or not o.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous {like.dtype} tensor of shape "
                             f"{tuple(like.shape)}, got {o.dtype} {tuple(o.shape)}")
    if graph.num_edges == 0 or xl.numel() == 0 or n == 0:
        for t in (dxl, dxr, d_att, d_feat):
            if t is not None:
                t.zero_()
        return dxl, dxr, d_att, d_feat
    rows = torch.empty((n, h, c), dtype=torch.float32, device=xl.device)
    ws = [torch.empty(graph.num_edges * h, dtype=torch.float32, device=xl.device) for _ in range(3)]
    graph._core.gatv2_backward(
        device_index(xl), dtype_name(xl.dtype), h, c, slope, address(xl), address(xr),
        address(att), _address_or_0(features), address(d_out), address(dxl), address(dxr),
        address(rows), _address_or_0(d_feat), tuple(address(w) for w in ws), stream_of(xl), drop,
    )
    d_att.copy_(rows.sum(0).reshape(d_att.shape))
    return dxl, dxr, d_att, d_feat


def _gatv2_edges(graph: Graph, xl, xr, att, features, slope, drop):
    """The CPU path's per-edge quantities: sources, targets, ``z = x_l[j] + x_r[i] (+ e)``,
    the probabilities and the dropout factor per edge and head (None without dropout)."""
    _check_gatv2_rows(graph, xl, xr, features)
    ei = graph.edge_index()
    src, dst = ei[0].to(xl.device), ei[1].to(xl.device)
    n, h, c = graph.num_nodes, xl.shape[1], xl.shape[2]
    z = xl[src] + xr[dst]
    if features is not None:
        z = z + features
    # LeakyReLU with derivative 1 at 0 under autograd, as the kernels and the closed form.
    s = (torch.where(z >= 0, z, z * slope) * att.reshape(1, h, c)).sum(-1)
    m = torch.full((n, h), float("-inf"), dtype=s.dtype, device=s.device)
    m = m.scatter_reduce(0, dst[:, None].expand(-1, h), s.detach(), reduce="amax", include_self=True)
    e = (s - m[dst]).exp()
    p = e / torch.zeros((n, h), dtype=s.dtype, device=s.device).index_add(0, dst, e)[dst]
    factor = None
    if drop is not None:
        rate, seed, _ = drop
        gen = torch.Generator(device=p.device).manual_seed(seed & (2**63 - 1))
        keep = torch.rand(p.shape, generator=gen, device=p.device) >= rate
        factor = keep.to(p.dtype) / (1.0 - rate)
    return src, dst, z, p, factor


def gatv2_reference(graph: Graph, xl, xr, att, features, slope, drop):
    """GATv2 attention by torch ops over the graph's edges (the CPU path, differentiable by
    torch): the per-edge sums are materialised here. Dropout draws torch's mask from a
    generator seeded with spattn's seed (the same mask for the same seed, not CUDA's)."""
    src, dst, _, p, factor = _gatv2_edges(graph, xl, xr, att, features, slope, drop)
    if factor is not None:
        p = p * factor
    out = torch.zeros((graph.num_nodes,) + tuple(xl.shape[1:]), dtype=xl.dtype, device=xl.device)
    return out.index_add(0, dst, p.unsqueeze(-1) * xl[src])


def gatv2_reference_backward(graph: Graph, xl, xr, att, features, d_out, slope, drop):
    """``(d_xl, d_xr, d_att, d_features)`` of :func:`gatv2_reference` by the closed forms the
    CUDA backward computes (no autograd: the custom operator's CPU path, and a check of those
    forms against torch's autograd in the tests). LeakyReLU' at 0 is 1, as the kernels'."""
    h, c = xl.shape[1], xl.shape[2]
    with torch.no_grad():
        src, dst, z, p, factor = _gatv2_edges(graph, xl, xr, att, features, slope, drop)
        d_out = d_out.to(xl.dtype)
        dp = (d_out[dst] * xl[src]).sum(-1)
        pw = p if factor is None else p * factor
        if factor is not None:
            dp = dp * factor
        ds = p * (dp - p.new_zeros((graph.num_nodes, h)).index_add(0, dst, p * dp)[dst])
        lz = torch.nn.functional.leaky_relu(z, slope)
        dz = ds.unsqueeze(-1) * att.reshape(1, h, c) * torch.where(z >= 0, 1.0, slope).to(z.dtype)
        d_att = (ds.unsqueeze(-1) * lz).sum(0).reshape(att.shape)
        dxr = torch.zeros_like(xr).index_add(0, dst, dz)
        dxl = torch.zeros_like(xl).index_add(0, src, dz + pw.unsqueeze(-1) * d_out[dst])
    return dxl, dxr, d_att, (dz if features is not None else None)


# Attention vectors head_dot takes at once (the kernels' limit).
HEAD_MAX_ATT = 4


def _head_count(x, att) -> int:
    """How many attention vectors ``att`` holds for ``x``'s heads × dim (0 if not a whole
    number of them from 1 to HEAD_MAX_ATT)."""
    per = x.shape[1] * x.shape[2]
    if per == 0:
        return 1
    k = att.numel() // per
    return k if 1 <= k <= HEAD_MAX_ATT and k * per == att.numel() else 0


def _check_head_dot(x, att) -> None:
    """The native head dot's contract: ``x`` contiguous (rows, heads, dim) of float32, float16 or
    bfloat16 (float32 or float64 on the CPU); ``att`` contiguous float32 of k · heads · dim
    values (1 ≤ k ≤ HEAD_MAX_ATT) on x's device."""
    if x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous (rows, heads, dim) tensor, got shape "
                         f"{tuple(x.shape)}")
    if x.device.type == "cuda" and dtype_name(x.dtype) not in _CUDA_DTYPES:
        raise TypeError(f"x: dtype {x.dtype} is not supported on CUDA (float32, float16, bfloat16)")
    if att.dtype != torch.float32 or not att.is_contiguous() or att.device != x.device \
            or _head_count(x, att) == 0:
        raise ValueError(f"att: expected a contiguous float32 tensor of k × {x.shape[1] * x.shape[2]} "
                         f"values (k from 1 to {HEAD_MAX_ATT}) on {x.device}, got {att.dtype} of "
                         f"{att.numel()} on {att.device}")


def _head_shape(x, k):
    """The scores' shape: (rows, heads) for one vector, (k, rows, heads) for k."""
    return (x.shape[0], x.shape[1]) if k == 1 else (k, x.shape[0], x.shape[1])


def head_dot_forward(x, att):
    """``(x * att).sum(-1)`` in float32 for a contiguous ``x`` of shape (rows, heads, dim)
    (float32, float16 or bfloat16) and ``att`` (heads · dim contiguous float32 on x's device,
    or k · heads · dim for k ≤ HEAD_MAX_ATT vectors at once: scores (k, rows, heads)): on CUDA
    spattn's kernel, one read of ``x`` in its own dtype for every vector (GAT's per-node and
    per-edge score terms); on the CPU torch ops."""
    _check_head_dot(x, att)
    rows, h, c = x.shape
    k = _head_count(x, att)
    if x.device.type != "cuda":
        out = (x.to(torch.float32).unsqueeze(0) * att.reshape(k, 1, h, c)).sum(dim=-1)
        return out.reshape(_head_shape(x, k))
    out = torch.empty(_head_shape(x, k), dtype=torch.float32, device=x.device)
    if out.numel() == 0 or c == 0:
        return out.zero_()
    _native.head_dot(device_index(x), dtype_name(x.dtype), rows, h, c, address(x), address(att),
                     address(out), stream_of(x), k)
    return out


def head_dot_backward(x, att, d_out, outs=None):
    """``(dx, d_att)`` of :func:`head_dot_forward` given ``d_out`` (the scores' shape): ``Σ_t
    d_out[t] ⊗ att[t]`` in x's dtype and ``Σ_rows d_out[t] · x`` in float32, summed in a fixed
    order (the same bits every run). ``outs``: zeroed tensors to write into (the custom
    operator's)."""
    _check_head_dot(x, att)
    rows, h, c = x.shape
    k = _head_count(x, att)
    if tuple(d_out.shape) != _head_shape(x, k):
        raise ValueError(f"d_out: has shape {tuple(d_out.shape)}, expected {_head_shape(x, k)}")
    d_out = d_out.to(device=x.device, dtype=torch.float32).contiguous()
    if outs is None:
        outs = (torch.zeros_like(x), torch.zeros(att.numel(), dtype=torch.float32, device=x.device))
    dx, d_att = outs
    for name, t, like in (("dx", dx, x), ("d_att", d_att, att)):
        if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device \
                or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {like.dtype} tensor of shape "
                             f"{tuple(like.shape)} on {like.device}")
    if x.device.type != "cuda":
        de = d_out.reshape(k, rows, h, 1)
        dx += (de * att.reshape(k, 1, h, c)).sum(dim=0).to(x.dtype)
        d_att += (de * x.to(torch.float32).unsqueeze(0)).sum(dim=1).reshape(d_att.shape)
        return dx, d_att
    if x.numel() == 0:
        return dx, d_att
    _native.head_dot_backward(device_index(x), dtype_name(x.dtype), rows, h, c, address(x),
                              address(att), address(d_out), address(dx), address(d_att),
                              stream_of(x), k)
    return dx, d_att


def head_dot(x, att):
    """GAT's score terms ``(x * att).sum(-1)`` in float32 with autograd (``x``: (rows, heads,
    dim); ``att``: heads · dim values, any float dtype, or k · heads · dim for k ≤ 4 vectors at
    once, whose scores come back as (k, rows, heads) from one read of ``x``): spattn's kernels
    for CUDA ``x`` of float32, float16 or bfloat16, torch ops otherwise (float64 stays
    float64)."""
    per = x.shape[1] * x.shape[2]
    k = att.numel() // per if per else 1
    if per and (k * per != att.numel() or not 1 <= k <= HEAD_MAX_ATT):
        raise ValueError(f"att: has {att.numel()} values, expected k × heads × dim = k × {per} "
                         f"with k from 1 to {HEAD_MAX_ATT}")
    if x.device.type != "cuda" or dtype_name(x.dtype) not in _CUDA_DTYPES:
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = (x.to(work).unsqueeze(0) * att.to(work).reshape(k, 1, x.shape[1], x.shape[2])).sum(-1)
        return out.reshape(_head_shape(x, k))
    if att.device != x.device:
        raise ValueError(f"att: is on {att.device}, expected {x.device} like x")
    x, att = x.contiguous(), att.to(torch.float32).reshape(-1).contiguous()
    if _compiling():
        return torch.ops.spattn.head_dot(x, att)
    return _HeadDot.apply(x, att)


if torch is not None:
    from torch.autograd.function import once_differentiable

    class _SparseAttention(torch.autograd.Function):
        """Autograd of sparse attention: forward and exact backward by spattn's kernels."""

        @staticmethod
        def forward(ctx, graph, q, k, v, scale, algorithm, keep):
            # The row statistics only where a backward will take them (`keep`: grad mode on
            # and an operand that wants a gradient, decided outside, where grad mode shows).
            if keep:
                out, lse = attention_forward_keeping(graph, q, k, v, scale, algorithm)
            else:
                out, lse = attention_forward(graph, q, k, v, scale, algorithm), None
            ctx.graph, ctx.scale, ctx.algorithm = graph, scale, algorithm
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = attention_backward(ctx.graph, q, k, v, out, d_out, ctx.scale, ctx.algorithm,
                                            lse=lse)
            return None, dq, dk, dv, None, None, None

    class _SparseAttentionExtras(torch.autograd.Function):
        """Autograd of sparse attention with a bias, edge features and/or dropout: the forward
        returns the output and the attention weights (empty unless asked for; not
        differentiable); the backward regenerates the dropout mask from the seed."""

        @staticmethod
        def forward(ctx, graph, q, k, v, bias, features, scale, algorithm, drop, want_weights):
            out, w = extras_forward(graph, q, k, v, bias, features, scale, algorithm, drop, want_weights)
            ctx.graph, ctx.scale, ctx.algorithm, ctx.drop = graph, scale, algorithm, drop
            ctx.save_for_backward(q, k, v, bias, features)
            ctx.mark_non_differentiable(w)
            return out, w

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out, _d_weights):
            q, k, v, bias, features = ctx.saved_tensors
            grads = extras_backward(
                ctx.graph, q, k, v, d_out, bias, features, ctx.scale, ctx.algorithm, ctx.drop
            )
            return (None,) + grads + (None, None, None, None)

    class _GatAttention(torch.autograd.Function):
        """Autograd of GAT attention: forward and exact backward by spattn's kernels (the
        probabilities are recomputed in the backward, not stored; the output is kept)."""

        @staticmethod
        def forward(ctx, graph, x, a_dst, a_src, bias, slope, drop):
            out, lse = gat_forward_keeping(graph, x, a_dst, a_src, bias, slope, drop)
            ctx.graph, ctx.slope, ctx.drop = graph, slope, drop
            # The output only where the rows kernels ran (their backward reads it): saving it
            # otherwise would hold it and refuse in-place changes to it for nothing.
            ctx.save_for_backward(x, a_dst, a_src, bias, out if lse is not None else None, lse)
            return out

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out):
            x, a_dst, a_src, bias, out, lse = ctx.saved_tensors
            grads = gat_backward(ctx.graph, x, a_dst, a_src, d_out, bias, ctx.slope, ctx.drop,
                                 out=out, lse=lse)
            return (None,) + grads + (None, None)

    class _GatLayer(torch.autograd.Function):
        """Autograd of :func:`_gat_layer_attention` on CUDA: GATConv's two score terms (one
        :func:`head_dot_forward` of both vectors) and its attention, one node; the backward
        writes the attention's ``dx`` and adds the terms' share into it."""

        @staticmethod
        def forward(ctx, graph, x, att_src, att_dst, bias, slope, drop):
            att = torch.cat((att_src.reshape(-1), att_dst.reshape(-1))).to(torch.float32)
            terms = head_dot_forward(x, att)  # (2, n, heads): a_src, then a_dst
            out, lse = gat_forward_keeping(graph, x, terms[1], terms[0], bias, slope, drop)
            ctx.graph, ctx.slope, ctx.drop = graph, slope, drop
            ctx.att_like = ((att_src.shape, att_src.dtype), (att_dst.shape, att_dst.dtype))
            ctx.save_for_backward(x, att, terms, bias, out if lse is not None else None, lse)
            return out

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out):
            x, att, terms, bias, out, lse = ctx.saved_tensors
            d_terms = torch.empty_like(terms)
            outs = (torch.empty_like(x), d_terms[1], d_terms[0],
                    None if bias is None else torch.empty_like(bias))
            dx, _, _, d_bias = gat_backward(ctx.graph, x, terms[1], terms[0], d_out, bias,
                                            ctx.slope, ctx.drop, outs=outs, out=out, lse=lse)
            d_att = torch.zeros_like(att)
            head_dot_backward(x, att, d_terms, outs=(dx, d_att))
            (s_shape, s_dtype), (d_shape, d_dtype) = ctx.att_like
            half = att.numel() // 2
            d_src = d_att[:half].view(s_shape).to(s_dtype)
            d_dst = d_att[half:].view(d_shape).to(d_dtype)
            return None, dx, d_src, d_dst, d_bias, None, None

    class _HeadDot(torch.autograd.Function):
        """Autograd of :func:`head_dot` on CUDA: both directions by spattn's kernels."""

        @staticmethod
        def forward(ctx, x, att):
            ctx.save_for_backward(x, att)
            return head_dot_forward(x, att)

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out):
            x, att = ctx.saved_tensors
            return head_dot_backward(x, att, d_out)

    class _GatV2Attention(torch.autograd.Function):
        """Autograd of GATv2 attention on CUDA: forward and exact backward by spattn's kernels
        (the scores recomputed in the backward, not stored)."""

        @staticmethod
        def forward(ctx, graph, xl, xr, att, features, slope, drop):
            out = gatv2_forward(graph, xl, xr, att, features, slope, drop)
            ctx.graph, ctx.slope, ctx.drop = graph, slope, drop
            ctx.save_for_backward(xl, xr, att, features)
            return out

        @staticmethod
        @once_differentiable
        def backward(ctx, d_out):
            xl, xr, att, features = ctx.saved_tensors
            grads = gatv2_backward(ctx.graph, xl, xr, att, features, d_out, ctx.slope, ctx.drop)
            return (None,) + grads + (None, None)


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
            CUDA like the per-node terms; with a positive ``negative_slope``, ``-inf`` masks an
            edge (a row whose edges are all masked gets zeros). Differentiable.
        dropout, dropout_seed: dropout on the attention coefficients, as
            :func:`sparse_attention`'s (the GAT paper uses 0.6 in training).

    Returns ``num_nodes × heads × channels`` of ``x``'s dtype, differentiable with respect to
    ``x``, ``alpha_dst``, ``alpha_src`` and ``bias`` through spattn's exact backward.
    """
    _check_graph(graph)
    return _gat_attention(_ref(graph), x, alpha_dst, alpha_src, negative_slope, bias, dropout,
                          dropout_seed)


def _check_gat_bias(bias, x) -> None:
    """GAT's score bias, where given: a floating-point ``num_edges × heads`` tensor on ``x``'s
    device (its rows are checked against the graph later)."""
    if bias is None:
        return
    h = x.shape[1]
    _check_per_edge("bias", bias, None, "(num_edges, heads)", x, "x")
    if bias.dim() != 2 or bias.shape[1] != h:
        raise ValueError(
            f"bias: has shape {tuple(bias.shape)}, expected (num_edges, {h}) "
            "(num_edges, heads), in Graph.edge_index order"
        )


def _gat_layer_attention(ref, x, att_src, att_dst, negative_slope, bias, dropout):
    """GATConv's score terms ``⟨x, att_src⟩``, ``⟨x, att_dst⟩`` and its attention over them,
    for features ``x`` (``num_nodes × heads × channels``) that are both the sources' and the
    targets'. On CUDA in eager mode one autograd node: the terms from one read of ``x``, one
    backward whose terms' gradient adds into ``x``'s in place (no stack of the vectors, no sum
    of ``x``'s two gradients; a few torch ops and an autograd node fewer a layer). Elsewhere
    (the CPU, ``torch.compile``, autocast recasting ``x``) :func:`head_dot`, then
    :func:`_gat_attention`: the same values."""
    if (not isinstance(ref, Graph) or not is_tensor(x) or x.device.type != "cuda" or x.dim() != 3
            or dtype_name(x.dtype) not in _CUDA_DTYPES or not x.is_contiguous()
            or _autocast(x)[0] is not x):
        alpha_src, alpha_dst = head_dot(x, torch.stack((att_src, att_dst))).unbind(0)
        return _gat_attention(ref, x, alpha_dst, alpha_src, negative_slope, bias, dropout, None)
    _check_gat_bias(bias, x)
    b = None if bias is None else check_torch("bias", bias.to(torch.float32).contiguous())
    for name, a in (("att_src", att_src), ("att_dst", att_dst)):
        if a.device != x.device or a.numel() != x.shape[1] * x.shape[2]:
            raise ValueError(f"{name}: expected heads × channels = {x.shape[1] * x.shape[2]} values "
                             f"on {x.device}, got {a.numel()} on {a.device}")
    # The seed last: a call refused above draws none.
    drop = _check_dropout(dropout, None)
    return _GatLayer.apply(ref, x, att_src, att_dst, b, float(negative_slope), drop)


def _gat_attention(ref, x, alpha_dst, alpha_src, negative_slope, bias, dropout, seed):
    """:func:`gat_attention` with ``ref`` from :func:`_ref` (also GATConv's entry)."""
    require_torch("gat_attention")
    if not is_tensor(x):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    (x,) = _autocast(x)
    if x.dim() != 3:
        raise ValueError(f"x: expected shape (num_nodes, heads, channels), got {tuple(x.shape)}")
    n, h, c = x.shape
    check_torch("x", x)
    slope = float(negative_slope)
    drop = _check_dropout(dropout, seed)
    _check_gat_bias(bias, x)
    for name, a in (("alpha_dst", alpha_dst), ("alpha_src", alpha_src)):
        if not is_tensor(a):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(a).__name__}")
        if a.device != x.device:
            raise ValueError(f"{name}: is on {a.device}, expected {x.device} like x")
        if a.dim() != 2 or a.shape[1] != h:
            raise ValueError(f"{name}: has shape {tuple(a.shape)}, expected (rows, {h})")
        if not a.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {a.dtype}")
    if tuple(alpha_src.shape) != (n, h):
        raise ValueError(f"alpha_src: has shape {tuple(alpha_src.shape)}, expected {(n, h)}")
    name = dtype_name(x.dtype)
    if x.device.type == "cuda":
        if name not in _CUDA_DTYPES:
            raise TypeError(f"x: dtype {x.dtype} is not supported on CUDA (float32, float16, bfloat16)")
        work = torch.float32  # the per-node terms and the bias, whatever x's dtype
        xw = x
    elif name is None:
        raise TypeError(f"x: dtype {x.dtype} is not supported (float32, float16, bfloat16, float64)")
    else:
        work = torch.float64 if name == "f64" else torch.float32
        xw = x.to(work).contiguous()
    a_dst = check_torch("alpha_dst", alpha_dst.to(work).contiguous())
    a_src = check_torch("alpha_src", alpha_src.to(work).contiguous())
    b = None if bias is None else check_torch("bias", bias.to(work).contiguous())
    if is_tensor(ref):
        rate, seed_t = (0.0, None) if drop is None else (drop[0], _seed_tensor(drop[1]))
        out = torch.ops.spattn.gat(ref, xw, a_dst, a_src, b, slope, rate, seed_t)
    else:
        out = _GatAttention.apply(ref, xw, a_dst, a_src, b, slope, drop)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def gatv2_attention(
    graph: Graph,
    x_l: Any,
    x_r: Any,
    att: Any,
    negative_slope: float = 0.2,
    *,
    edge_features: Any = None,
    dropout: float = 0.0,
    dropout_seed: Optional[int] = None,
):
    """GATv2's attention (Brody et al., PyG's ``GATv2Conv``): per edge ``j -> i`` and head ``h``
    the score ``e = Σ_c att[h, c] · LeakyReLU(x_l[j, h, c] + x_r[i, h, c] (+ edge_features[e,
    h, c]))``, a softmax over each target's incoming edges, and ``out[i, h] = Σ_j α · x_l[j,
    h]``.

    Args:
        x_l: ``num_cols × heads × channels``, the sources' projection ``W_s x`` (also the
            messages); CUDA: float32, float16, bfloat16; CPU: also float64.
        x_r: ``num_nodes × heads × channels``, the targets' projection ``W_t x``, like ``x_l``.
        att: the attention vector, ``heads × channels`` (or ``1 × heads × channels``), used in
            float32 on CUDA whatever ``x_l``'s dtype.
        edge_features: ``num_edges × heads × channels`` added inside the LeakyReLU (``W_e
            e_ij``), in :meth:`Graph.edge_index` order.
        dropout, dropout_seed: dropout on the attention coefficients, as
            :func:`sparse_attention`'s (on the CPU the mask is torch's, drawn from the seed).

    Returns ``num_nodes × heads × channels`` of ``x_l``'s dtype, differentiable with respect to
    ``x_l``, ``x_r``, ``att`` and ``edge_features``. On CUDA spattn's kernels compute it without
    storing the per-edge sums (scores, softmax, aggregation; the backward recomputes the scores
    and walks A and Aᵀ, with no atomics); on the CPU, torch ops.

    Example (CPU)::

        g = spattn.Graph.from_edge_index(torch.tensor([[0, 1, 2], [1, 2, 0]]), self_loops=True)
        x_l, x_r = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
        out = spattn.gatv2_attention(g, x_l, x_r, torch.randn(2, 4))
    """
    _check_graph(graph)
    return _gatv2_attention(_ref(graph), x_l, x_r, att, negative_slope, edge_features, dropout,
                            dropout_seed)


def _gatv2_attention(ref, x_l, x_r, att, negative_slope, features, dropout, seed):
    """:func:`gatv2_attention` with ``ref`` from :func:`_ref` (also GATv2Conv's entry)."""
    require_torch("gatv2_attention")
    if not is_tensor(x_l):
        raise TypeError(f"x_l: expected a torch.Tensor, got {type(x_l).__name__}")
    x_l, x_r, features = _autocast(x_l, x_r, features)
    if x_l.dim() != 3:
        raise ValueError(f"x_l: expected shape (num_cols, heads, channels), got {tuple(x_l.shape)}")
    _, h, c = x_l.shape
    check_torch("x_l", x_l)
    if is_tensor(x_r) and (x_r.dim() != 3 or x_r.shape[1] != h or x_r.shape[2] != c):
        raise ValueError(f"x_r: has shape {tuple(x_r.shape)}, expected (num_nodes, {h}, {c}) like x_l")
    check_torch("x_r", x_r, like=x_l)
    if not is_tensor(att):
        raise TypeError(f"att: expected a torch.Tensor, got {type(att).__name__}")
    if not att.is_floating_point():
        raise TypeError(f"att: expected a floating-point tensor, got {att.dtype}")
    if att.numel() != h * c or att.device != x_l.device:
        raise ValueError(
            f"att: expected {h} x {c} values on {x_l.device}, got shape {tuple(att.shape)} "
            f"on {att.device}"
        )
    if features is not None:
        _check_per_edge("edge_features", features, None, "(num_edges, heads, channels)", x_l, "x_l")
        if features.dim() != 3 or features.shape[1] != h or features.shape[2] != c:
            raise ValueError(
                f"edge_features: has shape {tuple(features.shape)}, expected (num_edges, {h}, {c})"
            )
    slope = float(negative_slope)
    drop = _check_dropout(dropout, seed)
    name = dtype_name(x_l.dtype)
    if x_l.device.type == "cuda":
        if name not in _CUDA_DTYPES:
            raise TypeError(f"x_l: dtype {x_l.dtype} is not supported on CUDA (float32, float16, bfloat16)")
        xl, xr = x_l, x_r
        a = att.reshape(h * c).float().contiguous()
        f = None if features is None else features.to(x_l.dtype).contiguous()
    elif name is None:
        raise TypeError(f"x_l: dtype {x_l.dtype} is not supported (float32, float16, bfloat16, float64)")
    else:
        work = torch.float64 if name == "f64" else torch.float32
        xl, xr = x_l.to(work).contiguous(), x_r.to(work).contiguous()
        a = att.reshape(h * c).to(work).contiguous()
        f = None if features is None else features.to(work).contiguous()
    if is_tensor(ref):
        rate, seed_t = (0.0, None) if drop is None else (drop[0], _seed_tensor(drop[1]))
        out = torch.ops.spattn.gatv2(ref, xl, xr, a, f, slope, rate, seed_t)
    elif xl.device.type == "cuda":
        out = _GatV2Attention.apply(ref, xl, xr, a, f, slope, drop)
    else:
        out = gatv2_reference(ref, xl, xr, a, f, slope, drop)
    return out if out.dtype == x_l.dtype else out.to(x_l.dtype)


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


__all__ = ["sparse_attention", "sparse_attention_backward", "gat_attention", "gatv2_attention"]

if torch is not None:
    from . import _ops  # noqa: E402,F401  (registers the custom operators torch.compile traces)
