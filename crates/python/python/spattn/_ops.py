"""spattn's calls as PyTorch custom operators (``torch.ops.spattn.*``), which ``torch.compile``
traces without a graph break, also with dynamic shapes.

A graph crosses the operator boundary as its *token* (``Graph._token``: a one-element CPU
tensor that holds the native graph), so a new graph every step is a new input, not a recompilation.
Every operator has a fake implementation (its outputs' shapes and dtypes from its inputs'; the
per-edge outputs, whose length is the graph's edge count, get a dynamic size) and the
attention operators their exact backward (``register_autograd``: the backward is another
operator, so ``torch.compile`` traces training steps whole).

Eager calls do not go through here: :mod:`spattn.functional` runs the same bodies through
``torch.autograd.Function``, sparing the operators' dispatch (about 20 µs of host time a call);
under ``torch.compile`` it calls these operators. The bodies are shared
(:func:`spattn.functional.attention_forward` and its siblings), so both paths compute the same.
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import functional as F
from .graph import graph_of_token

_lib = "spattn"

# The calls read the graph behind their token on the host, which a CUDA graph recorded by
# torch.compile's "reduce-overhead" mode would not see change from one step's graph to the
# next: inductor runs them between its graphed partitions (torch >= 2.8 knows the tag; older
# versions do not graph a model with them). Whole-step capture of a fixed graph is
# torch.cuda.graph / make_graphed_callables on the eager calls.
_UNSAFE = getattr(torch._C.Tag, "cudagraph_unsafe", None)
_TAGS = {"tags": (_UNSAFE,)} if _UNSAFE is not None and "tags" in inspect.signature(
    torch.library.custom_op).parameters else {}


def _op(name: str, mutates: Tuple[str, ...] = ()):
    """``torch.library.custom_op`` of ``spattn::name``, tagged as above. Operators with several
    results (the backwards) write them into tensors their callers allocate (``mutates``) and
    return nothing: inductor then hands each tensor on by itself."""
    return torch.library.custom_op(f"{_lib}::{name}", mutates_args=mutates, **_TAGS)


def _drop(rate: float, seed: Optional[Tensor]):
    """The native dropout argument from the operators' (rate, seed tensor)."""
    if rate == 0.0 or seed is None:
        return None
    return rate, F._seed_int(seed), 0


def _token_like(t: Tensor) -> Tensor:
    """A fake graph token (the real one is a CPU int64 tensor of one element)."""
    return t.new_empty(1, dtype=torch.int64, device="cpu")


# ---- graphs ------------------------------------------------------------------------------------


@_op("graph_for")
def graph_for(edge_index: Tensor, num_nodes: int, self_loops: bool) -> Tensor:
    """The token of :func:`spattn.nn.graph_for`'s graph of ``edge_index`` (built on its device,
    cached per tensor)."""
    from . import nn

    return nn.graph_for(edge_index, num_nodes, self_loops)._token


@graph_for.register_fake
def _(edge_index, num_nodes, self_loops):
    return _token_like(edge_index)


@_op("with_self_loops")
def with_self_loops(graph: Tensor, num_nodes: int) -> Tensor:
    """The token of :meth:`spattn.Graph.with_self_loops` of a graph passed to a layer as its
    ``edge_index``, checked against the layer's ``num_nodes``."""
    from . import nn

    return nn.graph_for(graph_of_token(graph), num_nodes, True)._token


@with_self_loops.register_fake
def _(graph, num_nodes):
    return _token_like(graph)


@_op("edge_index")
def edge_index(graph: Tensor, like: Tensor) -> Tensor:
    """:meth:`spattn.Graph.edge_index` on ``like``'s device (``2 × num_edges`` int64)."""
    return graph_of_token(graph).edge_index(device=like.device)


@edge_index.register_fake
def _(graph, like):
    e = torch.library.get_ctx().new_dynamic_size()
    return like.new_empty((2, e), dtype=torch.int64)


@_op("edge_positions")
def edge_positions(graph: Tensor, edge_index: Tensor, data: Tensor, self_loops: bool) -> Tensor:
    """Where each row of per-edge ``data`` (in ``edge_index``'s order, then with
    ``self_loops`` one row per node: the added loops) goes in the graph's CSR order (-1: an
    input self loop an added one replaces). ``data`` gives only its row count and device."""
    from . import nn

    return nn.edge_positions_impl(graph_of_token(graph), edge_index, data, self_loops)


@edge_positions.register_fake
def _(graph, edge_index, data, self_loops):
    return data.new_empty(data.shape[0], dtype=torch.int64)


@_op("edge_scatter")
def edge_scatter(graph: Tensor, data: Tensor, positions: Tensor) -> Tensor:
    """``data``'s rows at their :func:`edge_positions` in the graph's CSR order (0 elsewhere)."""
    from . import nn

    return nn.edge_scatter_impl(graph_of_token(graph).num_edges, data, positions)


@edge_scatter.register_fake
def _(graph, data, positions):
    e = torch.library.get_ctx().new_dynamic_size()
    return data.new_empty((e,) + tuple(data.shape[1:]))


def _edge_scatter_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _edge_scatter_grad(ctx, d_out):
    (positions,) = ctx.saved_tensors
    from . import nn

    return None, nn.edge_order_grad(d_out, positions), None


edge_scatter.register_autograd(_edge_scatter_grad, setup_context=_edge_scatter_setup)


# ---- sparse attention ----------------------------------------------------------------------


@_op("attention")
def attention(graph: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: Optional[float],
              algorithm: str) -> Tensor:
    """:func:`spattn.sparse_attention` without extras."""
    return F.attention_forward(graph_of_token(graph), q, k, v, scale, algorithm)


@attention.register_fake
def _(graph, q, k, v, scale, algorithm):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@_op("attention_keeping")
def attention_keeping(graph: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: Optional[float],
                      algorithm: str) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`attention` for training: also the row statistics its backward takes
    (``num_nodes × heads`` float32; zeros where the plan keeps none) and whether they were
    kept (a one-element uint8 tensor on the CPU, read by the backward without waiting for the
    GPU: the plan the backward finds may not be the forward's, e.g. after ``Graph.policy``
    changed)."""
    out, lse = F.attention_forward_keeping(graph_of_token(graph), q, k, v, scale, algorithm)
    kept = torch.tensor([lse is not None], dtype=torch.uint8)
    if lse is None:
        lse = torch.zeros(q.shape[0] * q.shape[1], dtype=torch.float32, device=q.device)
    return out, lse, kept


@attention_keeping.register_fake
def _(graph, q, k, v, scale, algorithm):
    lse = q.new_empty(q.shape[0] * q.shape[1], dtype=torch.float32)
    kept = torch.empty(1, dtype=torch.uint8, device="cpu")
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse, kept


@_op("attention_backward", ("dq", "dk", "dv"))
def attention_backward(graph: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       d_out: Tensor, scale: Optional[float], algorithm: str, dq: Tensor,
                       dk: Tensor, dv: Tensor, lse: Optional[Tensor],
                       kept: Optional[Tensor]) -> None:
    """:func:`attention`'s gradients, written into ``dq``, ``dk``, ``dv`` (from the row
    statistics of :func:`attention_keeping` where it kept them)."""
    use = lse if lse is not None and kept is not None and bool(kept.item()) else None
    F.attention_backward(graph_of_token(graph), q, k, v, out, d_out, scale, algorithm,
                         outs=(dq, dk, dv), lse=use)


@attention_backward.register_fake
def _(graph, q, k, v, out, d_out, scale, algorithm, dq, dk, dv, lse, kept):
    return None


def _attention_setup(ctx, inputs, output):
    graph, q, k, v, scale, algorithm = inputs
    out, lse, kept = output if isinstance(output, tuple) else (output, None, None)
    ctx.save_for_backward(graph, q, k, v, out, lse, kept)
    ctx.scale, ctx.algorithm = scale, algorithm


def _attention_grad(ctx, d_out, _d_lse=None, _d_kept=None):
    graph, q, k, v, out, lse, kept = ctx.saved_tensors
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    attention_backward(graph, q, k, v, out, d_out, ctx.scale, ctx.algorithm, dq, dk, dv, lse,
                       kept)
    return None, dq, dk, dv, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)
attention_keeping.register_autograd(_attention_grad, setup_context=_attention_setup)


@_op("attention_extras")
def attention_extras(graph: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                     features: Optional[Tensor], scale: Optional[float], algorithm: str,
                     rate: float, seed: Optional[Tensor]) -> Tensor:
    """:func:`spattn.sparse_attention` with a bias, edge features and/or dropout."""
    return F.extras_forward(graph_of_token(graph), q, k, v, bias, features, scale, algorithm,
                            _drop(rate, seed), False)[0]


@attention_extras.register_fake
def _(graph, q, k, v, bias, features, scale, algorithm, rate, seed):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@_op("attention_extras_weights")
def attention_extras_weights(graph: Tensor, q: Tensor, k: Tensor, v: Tensor,
                             bias: Optional[Tensor], features: Optional[Tensor],
                             scale: Optional[float], algorithm: str, rate: float,
                             seed: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """:func:`attention_extras` and the attention weights (``return_attention_weights``)."""
    return F.extras_forward(graph_of_token(graph), q, k, v, bias, features, scale, algorithm,
                            _drop(rate, seed), True)


@attention_extras_weights.register_fake
def _(graph, q, k, v, bias, features, scale, algorithm, rate, seed):
    w_len = torch.library.get_ctx().new_dynamic_size()
    w_dtype = torch.float32 if q.device.type == "cuda" else q.dtype
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        w_len, dtype=w_dtype
    )


@_op("attention_extras_backward", ("dq", "dk", "dv", "d_bias", "d_features"))
def attention_extras_backward(graph: Tensor, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor,
                              bias: Optional[Tensor], features: Optional[Tensor],
                              scale: Optional[float], algorithm: str, rate: float,
                              seed: Optional[Tensor], dq: Tensor, dk: Tensor, dv: Tensor,
                              d_bias: Tensor, d_features: Tensor) -> None:
    """The extras' gradients, written into ``dq`` ... ``d_features`` (an absent bias's or
    features' tensor is empty and left alone)."""
    F.extras_backward(graph_of_token(graph), q, k, v, d_out, bias, features, scale, algorithm,
                      _drop(rate, seed), outs=(dq, dk, dv, d_bias, d_features))


@attention_extras_backward.register_fake
def _(graph, q, k, v, d_out, bias, features, scale, algorithm, rate, seed, dq, dk, dv, d_bias,
      d_features):
    return None


def _extras_setup(ctx, inputs, output):
    graph, q, k, v, bias, features, scale, algorithm, rate, seed = inputs
    ctx.save_for_backward(graph, q, k, v, bias, features, seed)
    ctx.scale, ctx.algorithm, ctx.rate = scale, algorithm, rate
    if isinstance(output, tuple):
        ctx.mark_non_differentiable(output[1])


def _extras_grad(ctx, d_out, _d_weights=None):
    graph, q, k, v, bias, features, seed = ctx.saved_tensors
    like = lambda t: torch.empty_like(t) if t is not None else q.new_empty(0)  # noqa: E731
    dq, dk, dv, d_bias, d_feat = like(q), like(k), like(v), like(bias), like(features)
    attention_extras_backward(graph, q, k, v, d_out, bias, features, ctx.scale, ctx.algorithm,
                              ctx.rate, seed, dq, dk, dv, d_bias, d_feat)
    return (None, dq, dk, dv, d_bias if bias is not None else None,
            d_feat if features is not None else None, None, None, None, None)


attention_extras.register_autograd(_extras_grad, setup_context=_extras_setup)
attention_extras_weights.register_autograd(_extras_grad, setup_context=_extras_setup)


# ---- GAT attention ---------------------------------------------------------------------------


@_op("gat")
def gat(graph: Tensor, x: Tensor, a_dst: Tensor, a_src: Tensor, bias: Optional[Tensor],
        slope: float, rate: float, seed: Optional[Tensor]) -> Tensor:
    """:func:`spattn.gat_attention` (per-node terms and bias already in their working dtype)."""
    return F.gat_forward(graph_of_token(graph), x, a_dst, a_src, bias, slope, _drop(rate, seed))


@gat.register_fake
def _(graph, x, a_dst, a_src, bias, slope, rate, seed):
    return x.new_empty((a_dst.shape[0], x.shape[1], x.shape[2]))


@_op("gat_backward", ("dx", "da_dst", "da_src", "d_bias"))
def gat_backward(graph: Tensor, x: Tensor, a_dst: Tensor, a_src: Tensor, d_out: Tensor,
                 bias: Optional[Tensor], slope: float, rate: float, seed: Optional[Tensor],
                 dx: Tensor, da_dst: Tensor, da_src: Tensor, d_bias: Tensor,
                 out: Optional[Tensor] = None) -> None:
    """:func:`gat`'s gradients, written into ``dx`` ... ``d_bias`` (empty without a bias);
    ``out``: the forward's output (the row-statistics kernels read it)."""
    F.gat_backward(graph_of_token(graph), x, a_dst, a_src, d_out, bias, slope, _drop(rate, seed),
                   outs=(dx, da_dst, da_src, d_bias), out=out)


@gat_backward.register_fake
def _(graph, x, a_dst, a_src, d_out, bias, slope, rate, seed, dx, da_dst, da_src, d_bias,
      out=None):
    return None


def _gat_setup(ctx, inputs, output):
    graph, x, a_dst, a_src, bias, slope, rate, seed = inputs
    ctx.save_for_backward(graph, x, a_dst, a_src, bias, seed, output)
    ctx.slope, ctx.rate = slope, rate


def _gat_grad(ctx, d_out):
    graph, x, a_dst, a_src, bias, seed, out = ctx.saved_tensors
    dx, da_dst, da_src = torch.empty_like(x), torch.empty_like(a_dst), torch.empty_like(a_src)
    d_bias = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    gat_backward(graph, x, a_dst, a_src, d_out, bias, ctx.slope, ctx.rate, seed, dx, da_dst,
                 da_src, d_bias, out)
    return None, dx, da_dst, da_src, d_bias if bias is not None else None, None, None, None


gat.register_autograd(_gat_grad, setup_context=_gat_setup)


# ---- GAT's score terms -----------------------------------------------------------------------


@_op("head_dot")
def head_dot(x: Tensor, att: Tensor) -> Tensor:
    """:func:`spattn.functional.head_dot` (``x`` contiguous, ``att`` flat float32): spattn's
    kernel on CUDA, torch ops on the CPU."""
    return F.head_dot_forward(x, att)


@head_dot.register_fake
def _(x, att):
    return x.new_empty(F._head_shape(x, F._head_count(x, att)), dtype=torch.float32)


@_op("head_dot_backward", ("dx", "d_att"))
def head_dot_backward(x: Tensor, att: Tensor, d_out: Tensor, dx: Tensor, d_att: Tensor) -> None:
    """:func:`head_dot`'s gradients, added into the zeroed ``dx`` and ``d_att``."""
    F.head_dot_backward(x, att, d_out, outs=(dx, d_att))


@head_dot_backward.register_fake
def _(x, att, d_out, dx, d_att):
    return None


def _head_dot_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _head_dot_grad(ctx, d_out):
    x, att = ctx.saved_tensors
    dx, d_att = torch.zeros_like(x), torch.zeros_like(att)
    head_dot_backward(x, att, d_out, dx, d_att)
    return dx, d_att


head_dot.register_autograd(_head_dot_grad, setup_context=_head_dot_setup)


# ---- GATv2 attention -------------------------------------------------------------------------


@_op("gatv2")
def gatv2(graph: Tensor, xl: Tensor, xr: Tensor, att: Tensor, features: Optional[Tensor],
          slope: float, rate: float, seed: Optional[Tensor]) -> Tensor:
    """:func:`spattn.gatv2_attention` (``att`` flat, in its working dtype): spattn's kernels on
    CUDA, torch ops on the CPU."""
    g = graph_of_token(graph)
    if xl.device.type == "cuda":
        return F.gatv2_forward(g, xl, xr, att, features, slope, _drop(rate, seed))
    with torch.no_grad():
        return F.gatv2_reference(g, xl, xr, att, features, slope, _drop(rate, seed))


@gatv2.register_fake
def _(graph, xl, xr, att, features, slope, rate, seed):
    return xl.new_empty((xr.shape[0], xl.shape[1], xl.shape[2]))


@_op("gatv2_backward", ("dxl", "dxr", "d_att", "d_features"))
def gatv2_backward(graph: Tensor, xl: Tensor, xr: Tensor, att: Tensor, features: Optional[Tensor],
                   d_out: Tensor, slope: float, rate: float, seed: Optional[Tensor], dxl: Tensor,
                   dxr: Tensor, d_att: Tensor, d_features: Tensor) -> None:
    """:func:`gatv2`'s gradients, written into ``dxl`` ... ``d_features`` (empty without
    features); on the CPU by the reference's closed forms."""
    g = graph_of_token(graph)
    outs = (dxl, dxr, d_att, d_features)
    if xl.device.type == "cuda":
        F.gatv2_backward(g, xl, xr, att, features, d_out, slope, _drop(rate, seed), outs=outs)
        return
    grads = F.gatv2_reference_backward(g, xl, xr, att, features, d_out, slope, _drop(rate, seed))
    for o, gr in zip(outs, grads):
        if gr is not None:
            o.copy_(gr)


@gatv2_backward.register_fake
def _(graph, xl, xr, att, features, d_out, slope, rate, seed, dxl, dxr, d_att, d_features):
    return None


def _gatv2_setup(ctx, inputs, output):
    graph, xl, xr, att, features, slope, rate, seed = inputs
    ctx.save_for_backward(graph, xl, xr, att, features, seed)
    ctx.slope, ctx.rate = slope, rate


def _gatv2_grad(ctx, d_out):
    graph, xl, xr, att, features, seed = ctx.saved_tensors
    dxl, dxr, d_att = torch.empty_like(xl), torch.empty_like(xr), torch.empty_like(att)
    d_feat = torch.empty_like(features) if features is not None else xl.new_empty(0)
    gatv2_backward(graph, xl, xr, att, features, d_out, ctx.slope, ctx.rate, seed, dxl, dxr,
                   d_att, d_feat)
    return (None, dxl, dxr, d_att, d_feat if features is not None else None, None, None, None)


gatv2.register_autograd(_gatv2_grad, setup_context=_gatv2_setup)
