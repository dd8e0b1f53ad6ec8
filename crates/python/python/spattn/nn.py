"""PyG-compatible layers over spattn's kernels: ``TransformerConv``, ``GATConv``, ``GATv2Conv``,
``AGNNConv``.

Each takes PyG 2.8's constructor arguments and ``forward(x, edge_index, ...)``, has PyG's
parameter names and shapes (so ``layer.load_state_dict(pyg_layer.state_dict())`` works both
ways) and computes the same function. The dense parts (projections, the per-node GAT terms,
normalisation, bias, skip connections) are torch ops, differentiated by torch's autograd; the
sparse part (scores over the edges, softmax, aggregation) is one spattn call with an exact
backward (:func:`spattn.sparse_attention`, :func:`spattn.gat_attention`).

``edge_index`` may also be a :class:`spattn.Graph` (row ``i``: the sources of the edges into
``i``), which skips the conversion. An ``edge_index`` tensor is converted once and cached (keyed
by the tensor object and its version counter, so an in-place change is seen), and the graph
keeps its plans: the first forward on a graph pays for planning, later ones only launch.

Differences from PyG (each is also in the class's documentation):

- Bipartite inputs of two node sets of different sizes, lazy ``in_channels=-1``, GATConv's
  ``return_attention_weights`` and
  ``MessagePassing`` options other than the defaults (``aggr="add"``,
  ``flow="source_to_target"``, ``decomposed_layers=1``) raise ``NotImplementedError`` naming
  the argument.
- Attention dropout draws spattn's mask (Philox, seeded from torch's default generator:
  ``torch.manual_seed`` reproduces it; PyG's masks differ). Edge features (``edge_dim``,
  ``edge_attr``) and GATConv's ``fill_value`` work as PyG's, with ``edge_index`` free of
  repeated edges. TransformerConv's ``return_attention_weights`` gives the edges in the graph's
  CSR order and ``alpha`` after dropout.
- Repeated edges in ``edge_index`` are merged (PyG counts each copy); a
  :class:`spattn.SpattnWarning` says when that happens.
- Parameters are initialised from the same distributions as PyG's, not with the same random
  draws: load a state dict to get identical layers.
- Double backward (gradients of gradients) is not supported.
- The layers are ``torch.nn.Module`` subclasses, not ``MessagePassing`` subclasses: PyG tools that
  introspect ``MessagePassing`` (explainers, ``to_hetero``, propagate hooks, TorchScript via
  ``jittable``) do not apply.
- ``torch.compile(model, fullgraph=True, dynamic=True)`` traces the layers whole (spattn's
  calls are the custom operators ``torch.ops.spattn.*``; a new graph every step reuses one
  compilation). Under ``mode="reduce-overhead"`` spattn's calls run between inductor's
  CUDA-graph partitions (they read the graph on the host); a training step of the layers
  matches eager there (tests/test_compile.py; zero the gradients with ``set_to_none=True``,
  as inductor's CUDA-graph trees need). To capture whole steps, use
  ``torch.cuda.graph`` or ``torch.cuda.make_graphed_callables`` instead, for a fixed graph:
  a captured step replays the graph it was captured with, and attention dropout without a
  ``dropout_seed`` is refused under capture (one mask would be replayed every step).
- Under ``torch.autocast`` the attention runs in the autocast dtype (float32 accumulation) and
  returns it.
- ``edge_index`` may be a ``(2, E)`` tensor (a ``Batch``'s, a loader's), PyG's ``EdgeIndex``, a
  ``torch.sparse`` CSR / CSC / COO adjacency or a ``torch_sparse.SparseTensor`` in PyG's
  ``adj_t`` convention (row ``i``: the sources of the edges into ``i``), or a
  :class:`spattn.Graph` (:func:`graph_for`); edge features need the ``(2, E)`` forms.
- Numerics: on CUDA, f16 / bf16 attention sums in f32 and rounds once; GATConv computes its
  per-node terms ``a^T W x`` in f32 for half-precision inputs (PyG: in the input dtype); on the
  CPU, f16 / bf16 inputs are computed in f32 and rounded back. LeakyReLU's derivative at
  exactly 0 is 1 (PyG: the slope).
- ``edge_index`` may be on any device: a CUDA one is made into spattn's graph on its GPU (no
  copy through the host; a new ``edge_index`` every step, as mini-batch training brings, costs
  one short plan on the device), a CPU one on the host.
- ``algorithm=`` (keyword only) picks spattn's algorithm (``"auto"`` by default).
- Half-precision dense maps on CUDA (float16 / bfloat16 inputs, or a half-precision autocast;
  not under ``torch.compile``) run over rows padded to a bucketed count (at most 1/16 more) and
  are cut back: a new graph's row count would otherwise cost cuBLAS a fresh kernel choice per
  GEMM (~0.1–0.25 ms of host time each, up to ~1 ms under load), where a bucket seen before
  costs none. A row count's first 16 maps run padded, later ones unpadded; maps of more than
  2^18 rows or 128 MiB of input never (the padded copy lives until the backward). TransformerConv's
  plain, hook-free ``torch.nn.Linear`` maps of one input run as one batched GEMM there.
  Results differ from separate GEMMs by rounding only; hooks on the ``lin*`` modules see the
  padded rows.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter

from .functional import (_autocast_dtype, _compiling, _gat_attention, _gat_layer_attention,
                         _gatv2_attention, _sparse_attention)
from .functional import head_dot as _head_dot_terms
from . import _native
from .graph import Graph, SpattnWarning
from ._tensors import address, check_algorithm, device_index, dtype_name, stream_of

__all__ = ["TransformerConv", "GATConv", "GATv2Conv", "AGNNConv", "graph_for", "clear_graph_cache"]

# ---- edge_index -> Graph, cached --------------------------------------------------------------

_CACHE_SIZE = 16
_cache: "OrderedDict[Any, Tuple[weakref.ref, Graph]]" = OrderedDict()


def _tensor_key(t: Tensor) -> Optional[tuple]:
    """What identifies a tensor's current contents for the caches here (its object, in-place
    version, storage, shape, strides and device), or None for an inference-mode tensor, which
    tracks no version."""
    try:
        version = t._version
    except RuntimeError:
        return None
    return (id(t), version, t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.device))


def graph_for(edge_index: Any, num_nodes: int, self_loops: bool = False) -> Graph:
    """The :class:`spattn.Graph` of a PyG ``edge_index`` over ``num_nodes`` nodes (with self
    loops added if asked), built once per tensor and cached (up to 16 graphs, each dropped as
    soon as its tensor is freed; a tensor modified in place, or another tensor, gets a new
    graph). A ``Graph`` is returned as is
    (or its :meth:`~spattn.Graph.with_self_loops`).

    A CUDA ``edge_index`` is built on its GPU (:meth:`spattn.Graph.from_edge_index`) with the
    policy ``"once"``: a mini-batch's graph, new every step, keeps its row order. The same
    tensor seen again after a backward (full-graph training) finds the same graph, which its
    next attention forward switches to ``"reuse"`` (:attr:`spattn.Graph.policy`).

    Besides a ``(2, E)`` tensor (and a ``Batch``'s or a loader's ``edge_index``, which are
    such tensors), ``edge_index`` may be PyG's ``EdgeIndex`` (its tensor is used, cached by
    the same object; a CUDA one is built on its GPU, whose sort finds a target-sorted input
    in order), or a sparse adjacency in PyG's ``adj_t`` convention (row ``i``: the sources of
    the edges into ``i``): a ``torch.sparse`` CSR, CSC or COO tensor of ``N × N``, or
    ``torch_sparse.SparseTensor``, built from its CSR (no sort of a CSR whose rows list their
    columns in order). Edge features need the ``(2, E)`` form (their order is its order)."""
    if isinstance(edge_index, Graph):
        if edge_index.num_nodes != num_nodes or edge_index.num_cols != num_nodes:
            raise ValueError(
                f"edge_index: the graph has {edge_index.num_nodes} nodes, x has {num_nodes}"
            )
        return edge_index.with_self_loops() if self_loops else edge_index
    edge_index = plain_edge_index(edge_index)
    if _is_adjacency(edge_index):
        return _adjacency_graph(edge_index, num_nodes, self_loops)
    if not isinstance(edge_index, Tensor):
        raise TypeError(
            f"edge_index: expected a torch.Tensor of shape (2, E), a sparse adjacency or a "
            f"spattn.Graph, got {type(edge_index).__name__}"
        )
    tensor = _tensor_key(edge_index)
    if tensor is None:  # an inference-mode tensor tracks no version: build, do not cache
        return Graph.from_edge_index(edge_index, num_nodes=num_nodes, self_loops=self_loops)
    key = tensor + (int(num_nodes), bool(self_loops))
    hit = _cache.get(key)
    if hit is not None and hit[0]() is edge_index:
        _cache.move_to_end(key)
        return hit[1]
    graph = Graph.from_edge_index(edge_index, num_nodes=num_nodes, self_loops=self_loops)
    _cache_put(key, weakref.ref(edge_index, _forget(key)), graph)
    return graph


def _forget(key: tuple) -> Any:
    """The weak reference callback that drops ``key``'s entry once its tensor is gone (no call
    can hit it again): a mini-batch's graph, and what it keeps, go with its ``edge_index``
    instead of staying among the last 16."""

    # The cache bound here: at interpreter exit the module's globals may be gone first.
    def forget(ref: weakref.ref, cache: "OrderedDict[Any, Tuple[weakref.ref, Graph]]" = _cache) -> None:
        hit = cache.get(key)
        if hit is not None and hit[0] is ref:
            del cache[key]

    return forget


def _cache_put(key: tuple, ref: weakref.ref, graph: Graph) -> None:
    """Caches ``graph`` under ``key`` (its tensor weakly held by ``ref``), the oldest entries
    dropped past ``_CACHE_SIZE``."""
    _cache[key] = (ref, graph)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)


def plain_edge_index(edge_index: Any) -> Any:
    """PyG's ``EdgeIndex`` as its plain ``(2, E)`` tensor (the same object every time, so the
    caches keyed by it hit); anything else unchanged."""
    if type(edge_index).__name__ == "EdgeIndex" and hasattr(edge_index, "as_tensor"):
        return edge_index.as_tensor()
    return edge_index


def _is_adjacency(a: Any) -> bool:
    """A ``torch.sparse`` tensor or a ``torch_sparse.SparseTensor``."""
    if isinstance(a, Tensor):
        return a.layout != torch.strided
    return type(a).__name__ == "SparseTensor" and hasattr(a, "csr")


def _adjacency_graph(adj: Any, num_nodes: int, self_loops: bool) -> Graph:
    """:func:`graph_for` of a sparse adjacency (``adj_t``: rows the targets), cached per object
    and version like an ``edge_index``."""
    if isinstance(adj, Tensor):
        if adj.layout not in (torch.sparse_csr, torch.sparse_csc, torch.sparse_coo):
            raise NotImplementedError(
                f"edge_index: sparse layout {adj.layout} is not supported (CSR, CSC, COO)"
            )
        shape = tuple(adj.shape)
    else:
        shape = tuple(adj.sparse_sizes())
    if shape != (num_nodes, num_nodes):
        raise ValueError(
            f"edge_index: the adjacency is {shape[0]} x {shape[1]}, x has {num_nodes} nodes "
            "(an adj_t of N x N: row i lists the sources of the edges into i)"
        )
    try:
        version = adj._version if isinstance(adj, Tensor) else None
    except RuntimeError:
        version = None
    key = ("adjacency", id(adj), version, shape, int(num_nodes), bool(self_loops))
    hit = _cache.get(key)
    if hit is not None and hit[0]() is adj:
        _cache.move_to_end(key)
        return hit[1]
    if isinstance(adj, Tensor):
        csr = adj if adj.layout == torch.sparse_csr else adj.to_sparse_csr()
        crow, col = csr.crow_indices(), csr.col_indices()
    else:
        crow, col, _ = adj.csr()
    graph = Graph(crow, col, num_nodes)
    if self_loops:
        graph = graph.with_self_loops()
    try:
        ref = weakref.ref(adj, _forget(key))
    except TypeError:  # an object without weak references: build every call, do not cache
        return graph
    _cache_put(key, ref, graph)
    return graph


def clear_graph_cache() -> None:
    """Forgets the graphs :func:`graph_for` cached (and so their device memory, once nothing
    else holds them): the next call of a layer builds its graph again."""
    _cache.clear()


def _graph_ref(edge_index: Any, num_nodes: Any, self_loops: bool) -> Any:
    """:func:`graph_for`'s graph, or under ``torch.compile`` its token, made by the custom
    operators ``spattn::graph_for`` / ``spattn::with_self_loops`` (the cache and the build run
    when the compiled model runs, not when it is traced)."""
    if not _compiling():
        return graph_for(edge_index, num_nodes, self_loops)
    edge_index = plain_edge_index(edge_index)
    if _is_adjacency(edge_index):
        raise NotImplementedError(
            "edge_index: sparse adjacencies are not supported under torch.compile; pass a "
            "(2, E) edge_index (e.g. torch.stack([adj.col_indices(), row]) ) or a spattn.Graph"
        )
    if isinstance(edge_index, Graph):
        token = edge_index._token
        return torch.ops.spattn.with_self_loops(token, num_nodes) if self_loops else token
    if not isinstance(edge_index, Tensor):
        raise TypeError(
            f"edge_index: expected a torch.Tensor of shape (2, E) or a spattn.Graph, "
            f"got {type(edge_index).__name__}"
        )
    return torch.ops.spattn.graph_for(edge_index, num_nodes, bool(self_loops))


def _edge_index_of(ref: Any, like: Tensor) -> Tensor:
    """The graph's edges in its CSR order (:meth:`spattn.Graph.edge_index`) on ``like``'s device."""
    if isinstance(ref, Graph):
        return ref.edge_index(device=like.device)
    return torch.ops.spattn.edge_index(ref, like)


def _unsupported_kwargs(layer: str, kwargs: dict, node_dim: int = 0) -> None:
    """MessagePassing options: only PyG's defaults for these layers are implemented."""
    defaults = {
        "aggr": "add",
        "flow": "source_to_target",
        "decomposed_layers": 1,
        "node_dim": node_dim,
    }
    for name, value in kwargs.items():
        if name not in defaults or value != defaults[name]:
            raise NotImplementedError(
                f"{layer}: argument {name}={value!r} is not supported by spattn.nn "
                f"(supported MessagePassing options: {', '.join(f'{k}={v!r}' for k, v in defaults.items())})"
            )


def _check_channels(layer: str, name: str, value: Any) -> None:
    if isinstance(value, int) and value < 0:
        raise NotImplementedError(
            f"{layer}: {name}={value} (lazy initialisation) is not supported; give the size"
        )


def _glorot(t: Tensor) -> None:
    """PyG's ``glorot``: uniform in ±sqrt(6 / (size(-2) + size(-1)))."""
    a = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        t.uniform_(-a, a)


def _split_x(layer: str, x: Any) -> Tuple[Tensor, Tensor]:
    """``x`` or ``(x_src, x_dst)`` as two tensors over one node set."""
    if isinstance(x, Tensor):
        return x, x
    if isinstance(x, (tuple, list)) and len(x) == 2:
        x_src, x_dst = x
        if x_dst is None:
            raise NotImplementedError(f"{layer}: x = (x_src, None) is not supported")
        if x_src.size(0) != x_dst.size(0):
            raise NotImplementedError(
                f"{layer}: bipartite inputs with {x_src.size(0)} source and {x_dst.size(0)} "
                "target nodes are not supported (one node set only)"
            )
        return x_src, x_dst
    raise TypeError(f"{layer}: x must be a tensor or a pair of tensors, got {type(x).__name__}")


def _check_x(layer: str, x: Tensor, channels: int, name: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{layer}: {name} must be (num_nodes, {channels}), got {tuple(x.shape)}")
    if x.size(1) != channels:
        raise ValueError(
            f"{layer}: {name} has {x.size(1)} features, the layer was built for {channels}"
        )


def _edges_in_csr_order(ref: Any, edge_index: Any, data: Tensor, self_loops: bool = False) -> Tensor:
    """Per-edge `data` in `edge_index`'s order (with `self_loops`: followed by one row per node,
    the added loops' data, which replaces any loop of the input, as PyG's remove-then-add)
    moved to the graph's CSR order, differentiably (a :class:`spattn.Graph` passed as
    `edge_index` takes data in its own order already)."""
    if isinstance(edge_index, Graph):
        return data
    if isinstance(ref, Graph):
        sources, slots = _edge_order_cached(ref, edge_index, data, self_loops)
        return _EdgeOrder.apply(data, sources, slots)
    positions = torch.ops.spattn.edge_positions(ref, edge_index, data, self_loops)
    return torch.ops.spattn.edge_scatter(ref, data, positions)


def _edge_rows(layer: str, graph: Any, edge_index: Any, edge_attr: Tensor, self_loops: bool,
               fill_value: Any, build: Any, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``edge_attr``'s rows in the graph's CSR order (as ``dtype`` if given): ``build()`` gives
    them in ``edge_index``'s order (with ``self_loops``, followed by the loops' rows), moved by
    :func:`_edges_in_csr_order`. The layers order the attributes, then project them (a row-wise
    map, which commutes with the order): ``edge_dim``-wide rows move, not the projections.
    Attributes that take no gradient give constant rows, kept on the graph per ``layer`` kind
    for the pair of tensors (as long as ``edge_attr`` lives): a model's layers, and full-graph
    training's epochs, fill the loops and order the rows once."""
    keep = (isinstance(graph, Graph) and isinstance(edge_index, Tensor)
            and not _is_adjacency(edge_index) and not edge_attr.requires_grad
            and not torch.is_inference_mode_enabled() and not isinstance(fill_value, Tensor))
    if keep:
        tag = (_tensor_key(edge_attr), _tensor_key(edge_index), bool(self_loops),
               fill_value if self_loops else None, dtype)
        keep = tag[0] is not None and tag[1] is not None  # inference tensors track no version
    slot = (_ROWS, layer)
    if keep:
        hit = graph._derived.get(slot)
        if hit is not None and hit[0] == tag and hit[1]() is edge_attr and hit[2]() is edge_index:
            return hit[3]
    rows = _native_edge_rows(layer, graph, edge_index, edge_attr, self_loops, fill_value, dtype)
    if rows is None:
        rows = _edges_in_csr_order(graph, edge_index, build(), self_loops)
        if dtype is not None:
            rows = rows.to(dtype)
    if keep:
        graph_ref = weakref.ref(graph)

        # edge_attr is gone: so are the rows kept for it (the callback holds no entry, so no
        # reference cycle keeps a replaced entry's rows alive).
        def forget(ref: Any) -> None:
            g = graph_ref()
            hit = None if g is None else g._derived.get(slot)
            if hit is not None and hit[1] is ref:
                del g._derived[slot]

        graph._derived[slot] = (tag, weakref.ref(edge_attr, forget), weakref.ref(edge_index), rows)
    return rows


# The key of the kept edge rows (_edge_rows) in a graph's derived data.
_ROWS = "nn.edge_rows"

# fill_value strings the kernels take, by the name they take them under.
_NATIVE_FILL = {"mean": "mean", "add": "sum", "sum": "sum"}


def _native_edge_rows(layer: str, graph: Any, edge_index: Any, edge_attr: Tensor, self_loops: bool,
                      fill_value: Any, dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    """:func:`_edge_rows`' rows by spattn's kernels, two launches in place of about thirty torch
    ops (the rows placed by the graph build's own positions of ``edge_index``, then each added
    loop's row reduced from its row's other edges in edge order), where they apply: CUDA
    attributes of float32, float16 or bfloat16 that take no gradient (as ``dtype``, float32 or
    their own), a graph built on the GPU from exactly ``edge_index`` (:func:`graph_for`'s),
    loops filled with ``"mean"``, ``"add"`` / ``"sum"`` or a number. None elsewhere: the torch
    composition then."""
    if (not isinstance(graph, Graph) or not isinstance(edge_index, Tensor)
            or _is_adjacency(edge_index) or not edge_attr.is_cuda or edge_attr.requires_grad
            or _compiling()):
        return None
    # 2-D rows only: a 1-D edge_attr keeps the shape each layer's composition gives it.
    ea = edge_attr
    out_dtype = ea.dtype if dtype is None else dtype
    name, out_name = dtype_name(ea.dtype), dtype_name(out_dtype)
    if ea.dim() != 2 or name not in ("f32", "f16", "bf16") or out_name not in ("f32", name):
        return None
    fill, value = "mean", 0.0
    if self_loops:
        if isinstance(fill_value, str):
            fill = _NATIVE_FILL.get(fill_value)
        elif isinstance(fill_value, (int, float)) and not isinstance(fill_value, bool):
            # Rounded once to the attributes' type, as the composition's new_full; a value it
            # would refuse (out of the type's range) goes there to be refused.
            fill, value = "value", float(torch.tensor(float(fill_value), dtype=ea.dtype))
            if math.isinf(value) and not math.isinf(float(fill_value)):
                return None
        else:
            fill = None
        if fill is None:
            return None
    cover = graph._built_cover(edge_index, self_loops)
    if cover is None or cover[0].device != ea.device:
        return None
    _check_edge_rows(layer, edge_index, ea)
    pos_in, pos_loop = cover
    ea = ea.contiguous()
    out = torch.empty((graph.num_edges, ea.shape[1]), dtype=out_dtype, device=ea.device)
    if out.numel():
        _native.edge_rows(graph._core, device_index(ea), name, out_name, ea.shape[1], address(ea),
                          ea.shape[0], address(pos_in), address(pos_loop) if self_loops else 0,
                          fill, value, address(out), stream_of(ea))
    return out


def edge_positions_impl(graph: Graph, edge_index: Tensor, data: Tensor, self_loops: bool) -> Tensor:
    """Where each row of per-edge ``data`` goes in the graph's CSR order, on ``data``'s device:
    the input's edges (-1 for an input self loop that an added one replaces) and, with
    ``self_loops``, one loop per node after them."""
    rows = data.shape[0]
    if graph.num_duplicates:
        raise ValueError(
            f"edge_index: repeats {graph.num_duplicates} edge(s); spattn merges repeated "
            "edges, so their edge_attr rows cannot be told apart (remove the repeats, e.g. "
            "torch_geometric.utils.coalesce)"
        )
    e = edge_index.shape[1]
    n = graph.num_nodes
    if rows != e + (n if self_loops else 0):
        raise ValueError(f"edge_attr: has {rows - (n if self_loops else 0)} rows, "
                         f"edge_index has {e} edges")
    pos_in = _edge_positions_cached(graph, edge_index).to(data.device)
    if not self_loops:
        return pos_in
    built = graph._built_positions(edge_index)
    if built is not None and built[1].numel() == n:
        pos_loop = built[1]
    else:
        loops = torch.arange(n, device=edge_index.device)
        pos_loop = graph.edge_positions(torch.stack([loops, loops]))
    pos_loop = pos_loop.to(data.device)
    replaced = (edge_index[0] == edge_index[1]).to(data.device)  # PyG drops the input's loops
    return torch.cat([torch.where(replaced, torch.full_like(pos_in, -1), pos_in), pos_loop])


def edge_scatter_impl(num_edges: int, data: Tensor, positions: Tensor) -> Tensor:
    """``data``'s rows at their ``positions`` of ``num_edges`` rows (0 elsewhere); rows at -1
    are dropped (written to a spare row past the end)."""
    spare = data.new_zeros((num_edges + 1,) + tuple(data.shape[1:]))
    return spare.index_copy_(0, _slots(positions, num_edges), data)[:num_edges]


def edge_order_grad(d_out: Tensor, positions: Tensor) -> Tensor:
    """The gradient of :func:`edge_scatter_impl` for its input rows: ``d_out`` at each row's
    position, 0 for a replaced row (position -1)."""
    return _gather_slots(d_out, _slots(positions, d_out.shape[0]))


def _slots(positions: Tensor, num_edges: int) -> Tensor:
    """Each row's CSR edge from its position, the spare slot ``num_edges`` (past the end) for a
    replaced row (position -1)."""
    return torch.where(positions < 0, torch.full_like(positions, num_edges), positions)


def _gather_slots(d_out: Tensor, slots: Tensor) -> Tensor:
    """``d_out``'s rows at ``slots``, 0 at the spare slot: the adjoint of placing rows there."""
    padded = torch.cat([d_out, d_out.new_zeros((1,) + tuple(d_out.shape[1:]))])
    return _gather_rows(padded, slots)


def _gather_rows(data: Tensor, index: Tensor) -> Tensor:
    """``data.index_select(0, index)``; rows under 128 bytes element by element (``take``):
    torch's row gather (``index_select``, and ``gather`` with the index broadcast along a row)
    took 1.5 ms for ogbn-arxiv's 1.3M rows of 8 floats (H200)."""
    width = math.prod(data.shape[1:])
    if width * data.element_size() >= 128:
        return data.index_select(0, index)
    flat = (index.view(-1, 1) * width + torch.arange(width, device=index.device)).view(-1)
    out = data.reshape(-1).take(flat)
    return out.view((index.shape[0],) + tuple(data.shape[1:]))


def _edge_order_cached(graph: Graph, edge_index: Tensor, data: Tensor, self_loops: bool):
    """``(sources, slots)`` of per-edge ``data`` in ``edge_index``'s order (with ``self_loops``,
    then a row per node): ``sources[p]``, the row that goes to the graph's CSR edge ``p``, and
    ``slots[r]``, row ``r``'s CSR edge (``num_edges`` for an input loop an added one replaces),
    both gathers (deterministic, no atomics). Kept on the graph for the ``edge_index`` tensor
    (the key of :func:`graph_for`'s cache), so a model's layers share them. Every CSR edge has
    exactly one row: the graph was built from ``edge_index``, which repeats no edge."""
    # Not kept from inference mode: its tensors cannot be saved for a later backward.
    key = None if torch.is_inference_mode_enabled() else _tensor_key(edge_index)
    tag = (key, bool(self_loops), data.shape[0], data.device)
    hit = graph._derived.get(_ORDER)
    if key is not None and hit is not None and hit[0] == tag and hit[1]() is edge_index:
        return hit[2]
    positions = edge_positions_impl(graph, edge_index, data, self_loops)
    nnz = graph.num_edges
    slots = _slots(positions, nnz)
    rows = torch.arange(positions.numel(), device=positions.device)
    # Replaced rows land on the spare entry past the end, which is cut off.
    sources = positions.new_zeros(nnz + 1).index_copy_(0, slots, rows)[:nnz]
    if key is not None:
        graph._derived[_ORDER] = (tag, weakref.ref(edge_index), (sources, slots))
    return sources, slots


# The key of the cached edge order (_edge_order_cached) in a graph's derived data.
_ORDER = "nn.edge_order"


class _EdgeOrder(torch.autograd.Function):
    """:func:`_edges_in_csr_order` in eager mode: a gather by ``sources`` forward, by ``slots``
    (a zero row appended for the replaced rows) backward (``torch.compile`` traces the custom
    operators ``spattn::edge_positions`` and ``spattn::edge_scatter`` instead)."""

    @staticmethod
    def forward(ctx, data, sources, slots):
        ctx.save_for_backward(slots)
        return _gather_rows(data, sources)

    @staticmethod
    def backward(ctx, d_out):
        (slots,) = ctx.saved_tensors
        return _gather_slots(d_out, slots), None, None


def _check_edge_rows(layer: str, edge_index: Any, edge_attr: Tensor) -> None:
    """``edge_attr`` has a row per edge of an ``edge_index`` tensor (not a sparse adjacency,
    whose order is not the attributes')."""
    if _is_adjacency(edge_index):
        raise NotImplementedError(
            f"{layer}: edge_attr with a sparse adjacency (pass the (2, E) edge_index, in whose "
            "order edge_attr is)"
        )
    if isinstance(edge_index, Tensor) and edge_attr.shape[0] != edge_index.shape[1]:
        raise ValueError(
            f"{layer}: edge_attr has {edge_attr.shape[0]} rows, edge_index has {edge_index.shape[1]} edges"
        )


def _edge_positions_cached(graph: Graph, edge_index: Tensor) -> Tensor:
    """``graph.edge_positions(edge_index)``, kept on the graph for the last tensor asked about:
    a layer's every call would otherwise rebuild the graph's edge list on the host and search
    it (tens of milliseconds on 10^6 edges). A tensor modified in place, or another tensor,
    gets new positions (the key of :func:`graph_for`'s cache)."""
    key = _tensor_key(edge_index)
    if key is None:  # an inference-mode tensor tracks no version: do not cache
        return graph.edge_positions(edge_index)
    hit = graph._derived.get(_POSITIONS)
    if hit is not None and hit[0] == key and hit[1]() is edge_index:
        return hit[2]
    pos = graph.edge_positions(edge_index)
    graph._derived[_POSITIONS] = (key, weakref.ref(edge_index), pos)
    return pos


# The key of the cached edge positions in a graph's derived data.
_POSITIONS = "nn.edge_positions"


def _check_attention_args(layer: str, kwargs: dict, dropout: Any, edge_dim: Optional[int]) -> None:
    """The constructor arguments TransformerConv and GATConv share: PyG's MessagePassing
    options, the dropout rate, the edge features' width."""
    _unsupported_kwargs(layer, kwargs)
    _check_rate(layer, dropout)
    if edge_dim is not None:
        _check_channels(layer, "edge_dim", edge_dim)


def _check_rate(layer: str, dropout: Any) -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{layer}: dropout={dropout!r}: expected a rate in [0, 1)")


def _no_attention_weights(layer: str, value: Any) -> None:
    if value is not None:
        raise NotImplementedError(f"{layer}: return_attention_weights is not supported")


# ---- TransformerConv -----------------------------------------------------------------------


class TransformerConv(torch.nn.Module):
    r"""PyG's ``TransformerConv`` (Shi et al., graph transformer) on spattn's kernels:

    .. math::
        x'_i = W_1 x_i + \sum_{j \in N(i)} \alpha_{ij} W_2 x_j,\quad
        \alpha_{ij} = \mathrm{softmax}_j\left(\frac{(W_3 x_i)^\top (W_4 x_j)}{\sqrt{C}}\right)

    per head, heads concatenated (``concat=True``) or averaged, with the optional gated skip
    connection (``beta=True``). Same arguments, parameters (``lin_key``, ``lin_query``,
    ``lin_value``, ``lin_skip``, ``lin_beta``) and defaults as PyG 2.8; ``forward(x,
    edge_index)``. Like PyG, no self loops are added.

    ``dropout`` drops attention weights in training mode as PyG's does, with spattn's mask
    (Philox, seeded from torch's default generator: ``torch.manual_seed`` reproduces it, PyG's
    masks differ); it makes ``auto`` run the ``fused-csr`` kernel.
    ``return_attention_weights=True`` returns ``(out, (edge_index, alpha))`` as PyG does, but
    with the edges in the graph's CSR order (sorted by target, then source; repeated edges
    merged) rather than the input's, and ``alpha`` after dropout (PyG's is before).

    ``edge_dim`` adds ``lin_edge(edge_attr)`` to each edge's key and value, as PyG does
    (``edge_attr`` in ``edge_index``'s order; ``edge_index`` must not repeat an edge).

    In float16 / bfloat16 on CUDA (or a half-precision autocast) the maps run over rows padded
    to a bucketed count, so that batches of different sizes reuse cuBLAS's kernel choices, and
    the maps of one input (query, key, value, and the skip when its width is theirs) as one
    batched GEMM when they are plain ``torch.nn.Linear`` modules without hooks (see the module
    notes).

    Not supported (``NotImplementedError``): two node sets of different sizes, lazy
    ``in_channels=-1``. Extra keyword: ``algorithm`` (spattn's algorithm, ``"auto"``).

    Args:
        in_channels: input features per node (or a pair, of equal node sets).
        out_channels: channels per head.
        heads: attention heads.
        concat: concatenate the heads (else average them).
        beta: the gated skip connection of the paper's equation 5.
        dropout: attention dropout rate in training mode.
        edge_dim: edge feature width (``None``: no edge features).
        bias: biases of the linear maps.
        root_weight: add the skip connection ``lin_skip(x_i)``.
        algorithm: spattn's algorithm (keyword only).

    Shapes:
        - input: ``x`` ``(N, in_channels)``, ``edge_index`` ``(2, E)`` (or the forms
          :func:`graph_for` takes), ``edge_attr`` ``(E, edge_dim)`` with ``edge_dim``
        - output: ``(N, heads * out_channels)`` with ``concat``, else ``(N, out_channels)``;
          with ``return_attention_weights``, also ``((2, E'), (E', heads))``, the graph's
          edges in its CSR order

    Example::

        conv = spattn.nn.TransformerConv(128, 32, heads=8).cuda()
        out = conv(x, edge_index)          # x: N x 128, edge_index: 2 x E, both on CUDA
    """

    def __init__(
        self,
        in_channels: Any,
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        beta: bool = False,
        dropout: float = 0.0,
        edge_dim: Optional[int] = None,
        bias: bool = True,
        root_weight: bool = True,
        *,
        algorithm: str = "auto",
        **kwargs: Any,
    ):
        super().__init__()
        name = "TransformerConv"
        _check_attention_args(name, kwargs, dropout, edge_dim)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.beta = beta and root_weight
        self.root_weight = root_weight
        self.concat = concat
        self.dropout = dropout
        self.edge_dim = edge_dim
        self.algorithm = check_algorithm(algorithm)
        if isinstance(in_channels, int):
            in_channels = (in_channels, in_channels)
        for c in in_channels:
            _check_channels(name, "in_channels", c)
        self.lin_key = torch.nn.Linear(in_channels[0], heads * out_channels, bias=bias)
        self.lin_query = torch.nn.Linear(in_channels[1], heads * out_channels, bias=bias)
        self.lin_value = torch.nn.Linear(in_channels[0], heads * out_channels, bias=bias)
        if edge_dim is not None:
            self.lin_edge = torch.nn.Linear(edge_dim, heads * out_channels, bias=False)
        else:
            self.register_parameter("lin_edge", None)
        skip = heads * out_channels if concat else out_channels
        self.lin_skip = torch.nn.Linear(in_channels[1], skip, bias=bias)
        if self.beta:
            self.lin_beta = torch.nn.Linear(3 * skip, 1, bias=False)
        else:
            self.register_parameter("lin_beta", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's Linear initialisation, PyG's Linear default."""
        self.lin_key.reset_parameters()
        self.lin_query.reset_parameters()
        self.lin_value.reset_parameters()
        if self.lin_edge is not None:
            self.lin_edge.reset_parameters()
        self.lin_skip.reset_parameters()
        if self.lin_beta is not None:
            self.lin_beta.reset_parameters()

    def forward(
        self,
        x: Any,
        edge_index: Any,
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: Optional[bool] = None,
    ) -> Tensor:
        name = "TransformerConv"
        edge_index = plain_edge_index(edge_index)
        if (edge_attr is None) != (self.lin_edge is None):
            raise ValueError(
                f"{name}: edge_attr is required with edge_dim and taken only with it "
                f"(edge_dim={self.edge_dim}, edge_attr {'missing' if edge_attr is None else 'given'})"
            )
        x_src, x_dst = _split_x(name, x)
        cin = self.in_channels if isinstance(self.in_channels, tuple) else (self.in_channels,) * 2
        _check_x(name, x_src, cin[0], "x" if x_src is x_dst else "x_src")
        if x_dst is not x_src:
            _check_x(name, x_dst, cin[1], "x_dst")
        H, C = self.heads, self.out_channels
        graph = _graph_ref(edge_index, x_dst.size(0), False)
        query, key, value, x_r = self._projections(x_src, x_dst)
        query, key, value = (t.view(-1, H, C) for t in (query, key, value))
        rate = self.dropout if self.training else 0.0
        want = bool(return_attention_weights)
        features = None
        if self.lin_edge is not None:
            _check_edge_rows(name, edge_index, edge_attr)
            ea = _edge_rows(name, graph, edge_index, edge_attr, False, None, lambda: edge_attr)
            features = _linear(self.lin_edge, ea).view(-1, H, C)
        res = _sparse_attention(
            graph, query, key, value, 1.0 / math.sqrt(C), None, features, rate, None, want,
            self.algorithm,
        )
        out, alpha = res if want else (res, None)
        out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
        if self.root_weight:
            if self.lin_beta is not None:
                b = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
                out = b * x_r + (1 - b) * out
            else:
                out = out + x_r
        if want:
            return out, (_edge_index_of(graph, out), alpha)
        return out

    def _projections(self, x_src: Tensor, x_dst: Tensor):
        """query, key, value and (with ``root_weight``, else None) the skip, the maps of one
        input together (:func:`_stacked_linear`)."""
        skip = self.lin_skip if self.root_weight else None
        if x_src is x_dst:
            lins = [self.lin_query, self.lin_key, self.lin_value]
            if skip is not None and skip.out_features == self.lin_query.out_features:
                lins.append(skip)
                skip = None
            outs = _stacked_linear(x_src, lins)
            q, k, v = outs[:3]
            r = outs[3] if len(outs) == 4 else None
        else:
            k, v = _stacked_linear(x_src, [self.lin_key, self.lin_value])
            q = _linear(self.lin_query, x_dst)
            r = None
        if skip is not None:
            r = _linear(skip, x_dst)
        return q, k, v, r

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"


# Half-precision dense maps over a new graph's rows: bucketed row counts, and the transformer's
# four maps of one input in one GEMM, for a row count's first maps (docs/kernels/layers.md,
# "Dense maps").
_BUCKETED = True
_HALF = (torch.float16, torch.bfloat16)
# A row count's first maps run padded, later ones exact: over a run cuBLAS's one-off choice for
# the exact shapes (~0.2 ms a GEMM) then costs less than the pad (~0.07 ms a map) every time.
_EXACT_AFTER = 16
# Past this many rows a map is GPU-bound and the pad's and the stacking's copies grow with it;
# below, a new row count's GEMM choices cost more (0.3-1 ms of host time a map, with its backward).
_PAD_MAX_ROWS = 1 << 18
# Nor is an input of more bytes: the padded copy lives until the backward (the weight's gradient).
_PAD_MAX_BYTES = 1 << 27
_ROW_COUNTS: dict = {}


def _bucket_rows(n: int) -> int:
    """`n` rounded up to one of 16 steps an octave (at most 1/16 more; `n` itself up to 64)."""
    if n <= 64:
        return n
    step = 1 << (n.bit_length() - 5)
    return -(-n // step) * step


def _rows_for(n: int, nbytes: int = 0) -> Optional[int]:
    """The rows a half-precision map of `n` rows (an input of `nbytes`) runs over:
    :func:`_bucket_rows` for the first :data:`_EXACT_AFTER` maps of `n` rows in this process,
    None (a plain map) from then on and past :data:`_PAD_MAX_ROWS` rows or
    :data:`_PAD_MAX_BYTES`."""
    if n > _PAD_MAX_ROWS or nbytes > _PAD_MAX_BYTES:
        return None
    seen = _ROW_COUNTS.get(n, 0)
    if seen >= _EXACT_AFTER:
        return None
    if len(_ROW_COUNTS) >= 1 << 16:  # bounded: forget and start counting again
        _ROW_COUNTS.clear()
    _ROW_COUNTS[n] = seen + 1
    return _bucket_rows(n)


def _gemm_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The half-precision dtype a map of `x` runs its cuBLAS GEMM in (`x`'s own float16 /
    bfloat16 on CUDA, or a half-precision autocast's for float32), or None: other dtypes and
    devices, and under ``torch.compile`` (whose graphs would guard on the padded count)."""
    if not (_BUCKETED and x.is_cuda) or _compiling():
        return None
    dt = x.dtype if x.dtype != torch.float32 else _autocast_dtype("cuda")
    return dt if dt in _HALF else None


def _padding(x: Tensor) -> Optional[Tuple[torch.dtype, int]]:
    """The dtype and row count a map of `x` runs over padded (:func:`_gemm_dtype`,
    :func:`_rows_for`), or None for a plain ``lin(x)``."""
    dt = _gemm_dtype(x)
    if dt is None:
        return None
    m = _rows_for(x.size(0), x.numel() * dt.itemsize)
    return None if m is None else (dt, m)


def _padded(x: Tensor, dtype: torch.dtype, rows: int, multiple: int = 1) -> Tensor:
    """`x` in `dtype` (autocast's cast made once, before the pad) with zero rows appended up to
    `rows` rounded up to `multiple`: a map of a new graph's rows then repeats a GEMM shape
    cuBLAS has chosen a kernel for (its heuristic cache), where each new row count costs
    ~0.1–0.25 ms of host time per half-precision GEMM (up to ~1 ms under load) to choose one."""
    n = x.size(0)
    m = -(-rows // multiple) * multiple
    x = x.to(dtype)
    return x if m == n else F.pad(x, (0, 0, 0, m - n))


def _linear(lin: Any, x: Tensor) -> Tensor:
    """``lin(x)``; for a new row count in half precision over :func:`_padded` rows, cut back to
    `x`'s (a contiguous view)."""
    pad = _padding(x)
    if pad is None:
        return lin(x)
    xp = _padded(x, *pad)
    return lin(xp) if xp.size(0) == x.size(0) else lin(xp)[: x.size(0)]


def _plain_linears(lins) -> bool:
    """Whether `lins` are hook-free ``torch.nn.Linear`` maps of one shape and dtype, whose
    weights can be stacked (a subclass, a parametrization, pruning or weight norm computes the
    weight in its forward or a hook)."""
    mod = torch.nn.modules.module
    if getattr(mod, "_global_forward_hooks", None) or getattr(mod, "_global_forward_pre_hooks", None):
        return False
    w0, b0 = lins[0].weight, lins[0].bias
    return all(
        type(lin) is torch.nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks
        and lin.weight.shape == w0.shape and lin.weight.dtype == w0.dtype
        and (lin.bias is None) == (b0 is None)
        for lin in lins
    )


def _stacked_linear(x: Tensor, lins) -> Tuple[Tensor, ...]:
    """``lin(x)`` for each of `lins`, each output contiguous: for a new row count in half
    precision (:func:`_padding`) and plain maps (:func:`_plain_linears`), one batched GEMM over
    :func:`_padded` rows (one kernel choice, launch and autograd node for all; in float32
    cuBLAS's batched kernel for these shapes is slower than separate maps, and on a row count
    seen often the expanded input's backward costs more than the launches saved); maps that are
    not plain each over the same padded rows; else each map alone."""
    pad = _padding(x)
    if pad is None:
        return tuple(lin(x) for lin in lins)
    dt, rows = pad
    n = x.size(0)
    plain = _plain_linears(lins)
    # Output i starts i·rows·width elements into `y`: rows a multiple of 8 keep every output
    # 16-byte aligned, as spattn's kernels take them.
    xp = _padded(x, dt, rows, 8 if plain else 1)
    if not plain:  # one pad for every map
        return tuple(lin(xp) if xp.size(0) == n else lin(xp)[:n] for lin in lins)
    w = torch.stack([lin.weight for lin in lins]).to(dt).transpose(1, 2)
    xs = xp.unsqueeze(0).expand(len(lins), -1, -1)
    if lins[0].bias is None:
        y = torch.bmm(xs, w)
    else:
        b = torch.stack([lin.bias for lin in lins]).to(dt).unsqueeze(1)
        y = torch.baddbmm(b, xs, w)
    return (y if xp.size(0) == n else y[:, :n]).unbind(0)


# ---- GATConv ---------------------------------------------------------------------------------


class GATConv(torch.nn.Module):
    r"""PyG's ``GATConv`` (Veličković et al.) on spattn's kernels:

    .. math::
        x'_i = \sum_{j \in N(i) \cup \{i\}} \alpha_{ij} W x_j,\quad
        \alpha_{ij} = \mathrm{softmax}_j\,\mathrm{LeakyReLU}(a_{dst}^\top W x_i +
        a_{src}^\top W x_j)

    per head, heads concatenated or averaged, then the optional residual and bias. Same
    arguments, parameters (``lin`` or ``lin_src``/``lin_dst``, ``att_src``, ``att_dst``,
    ``res``, ``bias``) and defaults as PyG 2.8; ``forward(x, edge_index)``. With
    ``add_self_loops=True`` (the default) every node gets exactly one self loop, as PyG's
    remove-then-add does.

    The per-node terms ``a^T W x`` are computed by torch in float32 (also for half-precision
    ``x``), so their gradients (those of ``att_src``, ``att_dst``) are not rounded to half
    precision.

    ``dropout`` drops attention coefficients in training mode as PyG's does, with spattn's
    mask (Philox, seeded from torch's default generator; PyG's masks differ).

    ``edge_dim`` adds ``⟨lin_edge(e_ij), att_edge⟩`` to each edge's score, with the self
    loops' attributes from ``fill_value`` as PyG's ``add_self_loops`` (``edge_attr`` in
    ``edge_index``'s order; ``edge_index`` must not repeat an edge). It is computed as
    ``e_ij · (lin_edgeᵀ att_edge)``, in float32: ``lin_edge.weight`` folded with ``att_edge``
    into a ``heads × edge_dim`` matrix, so the ``E × heads·out_channels`` projection PyG
    stores is never made (``lin_edge``'s forward hooks are not called). In half precision on
    CUDA, ``lin`` (or ``lin_src``, ``lin_dst``) and ``res`` map rows padded to a bucketed count
    (see the module notes).

    Not supported (``NotImplementedError``): ``return_attention_weights``, ``size`` other than ``None`` or ``(N, N)``, two node sets of
    different sizes, lazy ``in_channels=-1``. Extra keyword: ``algorithm`` (only ``"auto"``:
    GAT runs the CUDA-core CSR kernels).

    Args:
        in_channels: input features per node (or a pair for ``lin_src`` / ``lin_dst``, of
            equal node sets).
        out_channels: channels per head.
        heads: attention heads.
        concat: concatenate the heads (else average them).
        negative_slope: LeakyReLU's slope for negative scores.
        dropout: dropout rate of the attention coefficients in training mode.
        add_self_loops: give every node one self loop (PyG's remove-then-add).
        edge_dim: edge feature width (``None``: no edge term).
        fill_value: the self loops' edge attributes: a number, a tensor, or a reduction of
            the node's incoming attributes (``"mean"``, ``"add"``, ``"sum"``, ``"max"``,
            ``"min"``, ``"mul"``).
        bias: a learnable output bias.
        residual: add ``res(x_i)``.
        algorithm: spattn's algorithm (keyword only; ``"auto"``).

    Shapes:
        - input: ``x`` ``(N, in_channels)``, ``edge_index`` ``(2, E)`` (or the forms
          :func:`graph_for` takes), ``edge_attr`` ``(E, edge_dim)`` or ``(E,)`` with
          ``edge_dim``
        - output: ``(N, heads * out_channels)`` with ``concat``, else ``(N, out_channels)``

    Example::

        conv = spattn.nn.GATConv(128, 32, heads=8, dropout=0.6).cuda()
        out = conv(x, edge_index)          # x: N x 128, edge_index: 2 x E, both on CUDA
    """

    def __init__(
        self,
        in_channels: Any,
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        edge_dim: Optional[int] = None,
        fill_value: Any = "mean",
        bias: bool = True,
        residual: bool = False,
        *,
        algorithm: str = "auto",
        **kwargs: Any,
    ):
        super().__init__()
        name = "GATConv"
        _check_attention_args(name, kwargs, dropout, edge_dim)
        _fill_reduce(name, fill_value)
        if check_algorithm(algorithm) != "auto":
            raise NotImplementedError(
                f"{name}: algorithm={algorithm!r}: GAT attention runs the CSR kernels only (use 'auto')"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.concat = concat
        self.negative_slope = negative_slope
        self.dropout = dropout
        self.add_self_loops = add_self_loops
        self.edge_dim = edge_dim
        self.fill_value = fill_value
        self.residual = residual
        self.algorithm = algorithm
        self.lin = self.lin_src = self.lin_dst = None
        if isinstance(in_channels, int):
            _check_channels(name, "in_channels", in_channels)
            self.lin = torch.nn.Linear(in_channels, heads * out_channels, bias=False)
        else:
            for c in in_channels:
                _check_channels(name, "in_channels", c)
            self.lin_src = torch.nn.Linear(in_channels[0], heads * out_channels, bias=False)
            self.lin_dst = torch.nn.Linear(in_channels[1], heads * out_channels, bias=False)
        self.att_src = Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = Parameter(torch.empty(1, heads, out_channels))
        if edge_dim is not None:
            self.lin_edge = torch.nn.Linear(edge_dim, heads * out_channels, bias=False)
            self.att_edge = Parameter(torch.empty(1, heads, out_channels))
        else:
            self.lin_edge = None
            self.register_parameter("att_edge", None)
        total = out_channels * (heads if concat else 1)
        if residual:
            res_in = in_channels if isinstance(in_channels, int) else in_channels[1]
            self.res = torch.nn.Linear(res_in, total, bias=False)
        else:
            self.register_parameter("res", None)
        if bias:
            self.bias = Parameter(torch.empty(total))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyG's initialisation: glorot weights and attention vectors, zero bias."""
        for lin in (self.lin, self.lin_src, self.lin_dst, self.res):
            if lin is not None:
                _glorot(lin.weight)
        _glorot(self.att_src)
        _glorot(self.att_dst)
        if self.lin_edge is not None:
            _glorot(self.lin_edge.weight)
            _glorot(self.att_edge)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(
        self,
        x: Any,
        edge_index: Any,
        edge_attr: Optional[Tensor] = None,
        size: Optional[Tuple[int, int]] = None,
        return_attention_weights: Optional[bool] = None,
    ) -> Tensor:
        name = "GATConv"
        edge_index = plain_edge_index(edge_index)
        edge_attr = _edge_attr_used(name, edge_attr, self.lin_edge)
        _no_attention_weights(name, return_attention_weights)
        x_src, x_dst = _split_x(name, x)
        n = x_dst.size(0)
        if size is not None and tuple(size) != (n, n):
            raise NotImplementedError(f"{name}: size={tuple(size)} (only (N, N) with N = {n})")
        H, C = self.heads, self.out_channels
        if self.lin is not None:
            _check_x(name, x_src, self.in_channels, "x")
            h_src = _linear(self.lin, x_src).view(-1, H, C)
            h_dst = h_src if x_dst is x_src else _linear(self.lin, x_dst).view(-1, H, C)
        else:
            _check_x(name, x_src, self.in_channels[0], "x_src" if x_dst is not x_src else "x")
            _check_x(name, x_dst, self.in_channels[1], "x_dst" if x_dst is not x_src else "x")
            h_src = _linear(self.lin_src, x_src).view(-1, H, C)
            h_dst = _linear(self.lin_dst, x_dst).view(-1, H, C)
        res = _linear(self.res, x_dst) if self.res is not None else None
        graph = _graph_ref(edge_index, n, self.add_self_loops)
        rate = self.dropout if self.training else 0.0
        bias = None
        if edge_attr is not None:
            bias = self._edge_scores(name, graph, edge_index, edge_attr, n)
        if h_dst is h_src:
            # Both score terms from one read of the features, with the attention in one step.
            out = _gat_layer_attention(graph, h_src, self.att_src, self.att_dst,
                                       self.negative_slope, bias, rate)
        else:
            alpha_src = _head_dot(h_src, self.att_src)
            alpha_dst = _head_dot(h_dst, self.att_dst)
            out = _gat_attention(graph, h_src, alpha_dst, alpha_src, self.negative_slope, bias,
                                 rate, None)
        return _combine_heads(out, self.concat, res, self.bias)

    def _edge_scores(self, name: str, graph: Any, edge_index: Any, edge_attr: Tensor, n: int) -> Tensor:
        """⟨lin_edge(e_ij), att_edge⟩ per edge and head in the graph's CSR order; with self
        loops, PyG's: the input's self loops dropped, one per node added with ``fill_value``
        (the attributes filled and placed first, :func:`_edge_rows`, then the folded product:
        no host synchronisation)."""
        # Kept in float32, the precision of the folded product.
        acc = torch.promote_types(edge_attr.dtype, torch.float32)
        ea = _edge_rows(name, graph, edge_index, edge_attr, self.add_self_loops, self.fill_value,
                        lambda: _edge_attr_with_loops(name, edge_index, edge_attr, n,
                                                      self.add_self_loops, self.fill_value), acc)
        return _folded_edge_scores(ea, self.lin_edge.weight, self.att_edge, self.heads)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"


def _folded_edge_scores(ea: Tensor, weight: Tensor, att: Tensor, heads: int) -> Tensor:
    """``⟨W_e e, a⟩`` per edge and head (``E × heads``, float32 at least) as ``e · (W_eᵀ a)``:
    ``W_e`` (``heads·C × F``) folded with ``a`` (``heads × C``) into a ``heads × F`` matrix first,
    so that the ``E × heads·C`` projection PyG stores (and its gradient) never exists. The same
    sums, reassociated; the gradients of ``W_e`` and ``a`` flow through the fold."""
    acc = torch.promote_types(ea.dtype, torch.float32)
    w = weight.to(acc).reshape(heads, -1, weight.shape[1])
    folded = (w * att.to(acc).reshape(heads, -1, 1)).sum(1)
    with torch.autocast(device_type=ea.device.type, enabled=False):  # float32, also in autocast
        return ea.to(acc) @ folded.t()


def _edge_attr_used(layer: str, edge_attr: Optional[Tensor], lin_edge: Any) -> Optional[Tensor]:
    """PyG's GAT layers ignore ``edge_attr`` without ``edge_dim``: say so, and do the same."""
    if edge_attr is not None and lin_edge is None:
        warnings.warn(f"{layer}: edge_attr is ignored (the layer has no edge_dim), as PyG does",
                      SpattnWarning, stacklevel=3)
        return None
    return edge_attr


def _combine_heads(out: Tensor, concat: bool, res: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """The heads concatenated or averaged, then the residual and the bias (PyG's GAT layers)."""
    out = out.reshape(out.shape[0], -1) if concat else out.mean(dim=1)
    if res is not None:
        out = out + res
    if bias is not None:
        out = out + bias
    return out


def _edge_attr_with_loops(layer: str, edge_index: Any, edge_attr: Tensor, n: int,
                          self_loops: bool, fill_value: Any) -> Tensor:
    """``edge_attr`` (``E × F`` or ``E``) as ``E × F`` rows, followed with ``self_loops`` by one
    row per node from ``fill_value`` (PyG's ``add_self_loops``; the input's own loops are
    replaced when the rows are placed, :func:`_edges_in_csr_order`)."""
    if isinstance(edge_index, Graph):
        raise NotImplementedError(
            f"{layer}: edge_attr with a spattn.Graph (pass the edge_index tensor, in whose "
            "order edge_attr is)"
        )
    ea = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
    _check_edge_rows(layer, edge_index, ea)
    if self_loops:
        real = edge_index[0] != edge_index[1]
        loop_attr = _fill_loops(fill_value, ea, edge_index[1], n, real)
        # One projection of the input's and the loops' attributes, as PyG's (a GEMM of a new
        # shape costs host time every step in half precision).
        ea = torch.cat([ea, loop_attr.to(ea.dtype)], dim=0)
    return ea


def _fill_loops(fill_value: Any, edge_attr: Tensor, target: Tensor, n: int, real: Tensor) -> Tensor:
    """The self loops' edge attributes, as PyG's ``add_self_loops(fill_value=...)``: a
    reduction of each node's incoming edges' attributes over the edges where ``real`` holds
    (the input's self loops left out, by masking instead of indexing: no host
    synchronisation), without any 0, or 1 for ``"mul"`` (as PyG's ``scatter``); or a
    constant."""
    if not isinstance(fill_value, str):
        return _constant_loops(fill_value, edge_attr, n)
    shape = (n,) + tuple(edge_attr.shape[1:])
    keep = real.view(-1, *([1] * (edge_attr.dim() - 1)))
    idx = target.view(-1, *([1] * (edge_attr.dim() - 1))).expand_as(edge_attr)
    reduce = _FILL_REDUCE[fill_value]
    if reduce in ("sum", "mean"):
        # where, not a product: an inf or NaN on a dropped self loop must not reach the sum.
        # Summed in float32 at least (the caller casts back): half-precision atomics are slow
        # (0.4 ms for ogbn-arxiv's 1.2M × 16 on an H200) and round the sums, and counts past
        # 2048.
        acc = torch.promote_types(edge_attr.dtype, torch.float32)
        kept = torch.where(keep, edge_attr, torch.zeros_like(edge_attr)).to(acc)
        total = kept.new_zeros(shape).index_add_(0, target, kept)
        if reduce == "sum":
            return total
        count = kept.new_zeros(n).index_add_(0, target, real.to(acc))
        return total / count.clamp(min=1).view(-1, *([1] * (edge_attr.dim() - 1)))
    if reduce == "prod":  # PyG starts the product from ones: the dropped edges multiply by 1
        vals = torch.where(keep, edge_attr, torch.ones_like(edge_attr))
        return edge_attr.new_ones(shape).scatter_reduce(0, idx, vals, reduce="prod", include_self=True)
    identity = float("-inf") if reduce == "amax" else float("inf")
    vals = torch.where(keep, edge_attr, torch.full_like(edge_attr, identity))
    out = edge_attr.new_zeros(shape).scatter_reduce(0, idx, vals, reduce=reduce, include_self=False)
    count = edge_attr.new_zeros(n).index_add_(0, target, real.to(edge_attr.dtype))
    has = (count > 0).view(-1, *([1] * (edge_attr.dim() - 1)))
    return torch.where(has, out, torch.zeros_like(out))


_FILL_REDUCE = {"add": "sum", "sum": "sum", "mean": "mean", "max": "amax", "min": "amin", "mul": "prod"}


def _fill_reduce(layer: str, fill_value: Any) -> None:
    if isinstance(fill_value, str) and fill_value not in _FILL_REDUCE:
        raise NotImplementedError(
            f"{layer}: fill_value={fill_value!r} (supported: a number, a tensor, "
            f"{', '.join(repr(k) for k in _FILL_REDUCE)})"
        )


def _constant_loops(fill_value: Any, edge_attr: Tensor, n: int) -> Tensor:
    """``n`` rows of a constant ``fill_value`` (a number, or a tensor broadcast to a row), made
    on the device without a copy from the host for a number."""
    shape = (n,) + tuple(edge_attr.shape[1:])
    if isinstance(fill_value, (int, float)):
        return edge_attr.new_full(shape, float(fill_value))
    value = torch.as_tensor(fill_value, dtype=edge_attr.dtype, device=edge_attr.device)
    return value.expand(shape).clone()


def _head_dot(h: Tensor, att: Tensor) -> Tensor:
    """``(h * att).sum(-1)`` per row and head, in float32 at least (float64 stays float64):
    spattn's kernels on CUDA (one read of ``h``), torch ops on the CPU."""
    return _head_dot_terms(h, att)


# ---- GATv2Conv -------------------------------------------------------------------------------


class GATv2Conv(torch.nn.Module):
    r"""PyG's ``GATv2Conv`` (Brody et al., "How attentive are graph attention networks?") on
    spattn's kernels:

    .. math::
        x'_i = \sum_{j \in N(i) \cup \{i\}} \alpha_{ij} W_s x_j,\quad
        \alpha_{ij} = \mathrm{softmax}_j\, a^\top \mathrm{LeakyReLU}(W_s x_j + W_t x_i
        [+ W_e e_{ij}])

    per head, heads concatenated or averaged, then the optional residual and bias. Same
    arguments, parameters (``lin_l``, ``lin_r`` — the same module with ``share_weights`` —,
    ``att``, ``lin_edge``, ``res``, ``bias``) and defaults as PyG 2.8; ``forward(x,
    edge_index, edge_attr=None)``. The score is computed inside the attention kernel on CUDA
    (:func:`spattn.gatv2_attention`): the per-edge sums ``W_s x_j + W_t x_i``, which PyG
    materialises (``E × heads × out_channels``), are never stored, and the exact backward
    recomputes them. On the CPU torch ops compute it. In half precision on CUDA the maps
    (``lin_l``, ``lin_r``, ``lin_edge``, ``res``) run over rows padded to a bucketed count (see
    the module notes).

    Not supported (``NotImplementedError``): ``return_attention_weights``, two node sets of
    different sizes, lazy ``in_channels=-1``.

    Args:
        in_channels: input features per node (or a pair for ``lin_l`` / ``lin_r``, of equal
            node sets).
        out_channels: channels per head.
        heads: attention heads.
        concat: concatenate the heads (else average them).
        negative_slope: LeakyReLU's slope for negative inputs.
        dropout: dropout rate of the attention coefficients in training mode.
        add_self_loops: give every node one self loop (PyG's remove-then-add).
        edge_dim: edge feature width (``None``: no edge term).
        fill_value: the self loops' edge attributes, as :class:`GATConv`'s.
        bias: biases of ``lin_l`` / ``lin_r`` and the output bias.
        share_weights: one projection for sources and targets (``lin_r`` is ``lin_l``).
        residual: add ``res(x_i)``.

    Shapes:
        - input: ``x`` ``(N, in_channels)``, ``edge_index`` ``(2, E)`` (or the forms
          :func:`graph_for` takes), ``edge_attr`` ``(E, edge_dim)`` or ``(E,)`` with
          ``edge_dim``
        - output: ``(N, heads * out_channels)`` with ``concat``, else ``(N, out_channels)``

    Example::

        conv = spattn.nn.GATv2Conv(128, 32, heads=8).cuda()
        out = conv(x, edge_index)
    """

    def __init__(
        self,
        in_channels: Any,
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        edge_dim: Optional[int] = None,
        fill_value: Any = "mean",
        bias: bool = True,
        share_weights: bool = False,
        residual: bool = False,
        **kwargs: Any,
    ):
        super().__init__()
        name = "GATv2Conv"
        _check_attention_args(name, kwargs, dropout, edge_dim)
        _fill_reduce(name, fill_value)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.concat = concat
        self.negative_slope = negative_slope
        self.dropout = dropout
        self.add_self_loops = add_self_loops
        self.edge_dim = edge_dim
        self.fill_value = fill_value
        self.residual = residual
        self.share_weights = share_weights
        cin = (in_channels, in_channels) if isinstance(in_channels, int) else tuple(in_channels)
        for c in cin:
            _check_channels(name, "in_channels", c)
        self.lin_l = torch.nn.Linear(cin[0], heads * out_channels, bias=bias)
        if share_weights:
            self.lin_r = self.lin_l
        else:
            self.lin_r = torch.nn.Linear(cin[1], heads * out_channels, bias=bias)
        self.att = Parameter(torch.empty(1, heads, out_channels))
        if edge_dim is not None:
            self.lin_edge = torch.nn.Linear(edge_dim, heads * out_channels, bias=False)
        else:
            self.lin_edge = None
        total = out_channels * (heads if concat else 1)
        if residual:
            self.res = torch.nn.Linear(cin[1], total, bias=False)
        else:
            self.register_parameter("res", None)
        if bias:
            self.bias = Parameter(torch.empty(total))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyG's initialisation: glorot weights and attention vector, the linear maps' biases
        uniform in ±1/√fan_in (PyG's ``Linear`` default), a zero output bias."""
        for lin in (self.lin_l, self.lin_r, self.lin_edge, self.res):
            if lin is not None:
                _glorot(lin.weight)
                if lin.bias is not None:
                    bound = 1.0 / math.sqrt(lin.in_features)
                    with torch.no_grad():
                        lin.bias.uniform_(-bound, bound)
        _glorot(self.att)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(
        self,
        x: Any,
        edge_index: Any,
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: Optional[bool] = None,
    ) -> Tensor:
        name = "GATv2Conv"
        edge_index = plain_edge_index(edge_index)
        edge_attr = _edge_attr_used(name, edge_attr, self.lin_edge)
        _no_attention_weights(name, return_attention_weights)
        x_src, x_dst = _split_x(name, x)
        cin = (self.in_channels,) * 2 if isinstance(self.in_channels, int) else self.in_channels
        _check_x(name, x_src, cin[0], "x" if x_src is x_dst else "x_src")
        if x_dst is not x_src:
            _check_x(name, x_dst, cin[1], "x_dst")
        n = x_dst.size(0)
        H, C = self.heads, self.out_channels
        x_l = _linear(self.lin_l, x_src).view(-1, H, C)
        x_r = (x_l if self.share_weights and x_dst is x_src
               else _linear(self.lin_r, x_dst).view(-1, H, C))
        res = _linear(self.res, x_dst) if self.res is not None else None
        graph = _graph_ref(edge_index, n, self.add_self_loops)
        features = None
        if edge_attr is not None:
            ea = _edge_rows(name, graph, edge_index, edge_attr, self.add_self_loops,
                            self.fill_value,
                            lambda: _edge_attr_with_loops(name, edge_index, edge_attr, n,
                                                          self.add_self_loops, self.fill_value))
            features = _linear(self.lin_edge, ea).view(-1, H, C)
        rate = self.dropout if self.training else 0.0
        out = _gatv2_attention(graph, x_l, x_r, self.att, self.negative_slope, features, rate,
                               None)
        return _combine_heads(out, self.concat, res, self.bias)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"


# ---- AGNNConv --------------------------------------------------------------------------------


class AGNNConv(torch.nn.Module):
    r"""PyG's ``AGNNConv`` (Thekumparampil et al.) on spattn's kernels:

    .. math::
        x'_i = \sum_{j \in N(i) \cup \{i\}} \alpha_{ij} x_j,\quad
        \alpha_{ij} = \mathrm{softmax}_j\left(\beta \cos(x_i, x_j)\right)

    computed as sparse attention with ``q = β · x̂``, ``k = x̂``, ``v = x`` and scale 1 (``x̂``
    the L2-normalised rows, by torch), so β may change every step without re-planning and its
    gradient flows through torch. Same arguments (``requires_grad``, ``add_self_loops``) and
    parameter (``beta``) as PyG 2.8; ``forward(x, edge_index)``.

    Extra keyword: ``algorithm`` (spattn's algorithm, ``"auto"``).

    Args:
        requires_grad: learn β (else β = 1, a buffer).
        add_self_loops: give every node one self loop (PyG's remove-then-add).
        algorithm: spattn's algorithm (keyword only).

    Shapes:
        - input: ``x`` ``(N, F)``, ``edge_index`` ``(2, E)`` (or the forms :func:`graph_for`
          takes)
        - output: ``(N, F)``

    Example::

        conv = spattn.nn.AGNNConv().cuda()
        out = conv(x, edge_index)
    """

    def __init__(
        self,
        requires_grad: bool = True,
        add_self_loops: bool = True,
        *,
        algorithm: str = "auto",
        **kwargs: Any,
    ):
        super().__init__()
        _unsupported_kwargs("AGNNConv", kwargs, node_dim=-2)
        self.requires_grad = requires_grad
        self.add_self_loops = add_self_loops
        self.algorithm = check_algorithm(algorithm)
        if requires_grad:
            self.beta = Parameter(torch.empty(1))
        else:
            self.register_buffer("beta", torch.ones(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """β = 1, as PyG."""
        if self.requires_grad:
            with torch.no_grad():
                self.beta.fill_(1)

    def forward(self, x: Tensor, edge_index: Any) -> Tensor:
        name = "AGNNConv"
        edge_index = plain_edge_index(edge_index)
        if not isinstance(x, Tensor) or x.dim() != 2:
            raise ValueError(f"{name}: x must be a (num_nodes, channels) tensor")
        n, c = x.shape
        graph = _graph_ref(edge_index, n, self.add_self_loops)
        x_norm = F.normalize(x, p=2.0, dim=-1)
        q = (self.beta.to(x_norm.dtype) * x_norm).contiguous()
        out = _sparse_attention(
            graph, q.view(n, 1, c), x_norm.contiguous().view(n, 1, c), x.contiguous().view(n, 1, c),
            1.0, None, None, 0.0, None, False, self.algorithm,
        )
        return out.view(n, c)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"
