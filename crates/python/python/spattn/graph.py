"""``spattn.Graph``: a graph and its plan-once state."""

from __future__ import annotations

import itertools
import os
import warnings
import weakref
from typing import Any, Dict, Optional

from . import _native
from ._tensors import (
    ALGORITHMS,
    check_algorithm,
    check_scale,
    device_index,
    dtype_name,
    index_bytes,
    int64_array,
    is_tensor,
    require_torch,
    stream_of,
    torch,
)


class SpattnWarning(UserWarning):
    """A result that may differ from what PyG computes (e.g. repeated edges merged)."""


class Graph:
    """A graph for sparse attention: row ``i`` lists the nodes node ``i`` attends to.

    In PyG's terms (``flow="source_to_target"``) row ``i`` holds the *sources* ``j`` of the
    edges ``j -> i`` into target ``i``, and each target's softmax runs over its incoming edges;
    :meth:`from_edge_index` builds exactly that from an ``edge_index``.

    A graph is built once and reused: it holds, per CUDA device, the graph's upload and the
    attention plans over it (cached per heads, head_dim, dtype, algorithm and scale), so the
    first call of a configuration pays for planning and later calls only launch kernels.
    Plans may renumber rows internally; inputs and outputs always keep the graph's node order.

    A graph made from a CUDA ``edge_index`` (or CUDA ``crow`` / ``col``) is built on that GPU
    by spattn's kernels: the edges never go to the host, and the plans keep the rows in
    their order (a mini-batch's graph, seen once, does not repay a row order). Anything that
    needs the host copy downloads it once: :meth:`crow`, :meth:`col`, CPU tensors, a named
    row order, the ``unfused-tc`` and ``hybrid`` algorithms, and ``fused-tc`` with a bias or
    dropout (its edge map is built on the host).

    Args:
        crow: row offsets, ``n + 1`` integers (torch tensor on any device, numpy array or
            sequence).
        col: column indices, ``crow[-1]`` integers in ``[0, n)``; a row may list its columns in
            any order, but not one twice.
        n: number of nodes (default ``len(crow) - 1``).
    """

    __slots__ = ("_core", "_derived", "_token", "__weakref__")

    def __init__(self, crow: Any, col: Any, n: Optional[int] = None):
        if _is_cuda_tensor(crow) and _is_cuda_tensor(col):
            self._core = _csr_on_device(crow, col, n)
            self._derived = {}
            self._token = _make_token(self)
            return
        crow_b, crow_shape = index_bytes("crow", crow)
        col_b, _ = index_bytes("col", col)
        rows = crow_shape[0] - 1
        if rows < 0:
            raise ValueError("crow: needs at least one entry (n + 1 offsets)")
        if n is None:
            n = rows
        n = _check_count("n", n)
        if n != rows:
            raise ValueError(f"crow: has {crow_shape[0]} offsets, but n = {n} nodes need {n + 1}")
        self._core = _native.GraphCore.from_csr(crow_b, col_b, n, n)
        self._derived: Dict[Any, Any] = {}  # derived graphs, and nn's cached edge positions
        self._token = _make_token(self)

    @classmethod
    def _from_core(cls, core) -> "Graph":
        g = cls.__new__(cls)
        g._core = core
        g._derived = {}
        g._token = _make_token(g)
        return g

    @classmethod
    def from_edge_index(
        cls,
        edge_index: Any,
        num_nodes: Optional[int] = None,
        symmetrize: bool = False,
        self_loops: bool = False,
    ) -> "Graph":
        """A graph from a PyG ``edge_index`` (``2 × E`` integers: row 0 the sources, row 1
        the targets), a torch tensor on any device or a numpy array.

        Args:
            num_nodes: number of nodes (default ``edge_index.max() + 1``, 0 without edges).
            symmetrize: also add every reverse edge (an undirected graph).
            self_loops: add the missing self loops ``i -> i``.

        Repeated edges are merged (a graph is a set of edges; PyG would count each copy):
        :attr:`num_duplicates` says how many were dropped, and a :class:`SpattnWarning` is
        issued when any were.

        A CUDA ``edge_index`` (int32 or int64, any strides) is built on its GPU, with no copy
        through the host and one synchronisation for the sizes; ``num_nodes`` is then best
        given (else ``edge_index.max()`` is read, another synchronisation). An id out of range
        or negative raises ``ValueError`` naming the edge.
        """
        if _is_cuda_tensor(edge_index):
            return cls._from_cuda_edge_index(edge_index, num_nodes, symmetrize, self_loops)
        if not isinstance(edge_index, (list, tuple)) and hasattr(edge_index, "shape"):
            shape = tuple(edge_index.shape)
            if len(shape) != 2 or shape[0] != 2:
                raise ValueError(f"edge_index: expected shape (2, E), got {shape}")
            src, dst = edge_index[0], edge_index[1]
        else:
            try:
                src, dst = edge_index
            except (TypeError, ValueError):
                raise ValueError("edge_index: expected two rows (sources, targets)") from None
        src_b, src_shape = index_bytes("edge_index", src)
        dst_b, _ = index_bytes("edge_index", dst)
        if num_nodes is None:
            num_nodes = _max_plus_one(src_b, dst_b)
        num_nodes = _check_count("num_nodes", num_nodes)
        core = _native.GraphCore.from_edges(
            src_b, dst_b, num_nodes, bool(symmetrize), bool(self_loops)
        )
        if core.duplicates:
            warnings.warn(
                f"edge_index lists {core.duplicates} edge(s) more than once; spattn merges "
                "repeated edges (PyG would count each copy in the softmax and the sum)",
                SpattnWarning,
                stacklevel=2,
            )
        return cls._from_core(core)

    @classmethod
    def _from_cuda_edge_index(
        cls, edge_index: Any, num_nodes: Optional[int], symmetrize: bool, self_loops: bool
    ) -> "Graph":
        """:meth:`from_edge_index` of a CUDA tensor: built on its GPU. The input edges'
        positions in the graph's CSR order are kept for :meth:`edge_positions` of this
        tensor; the transpose (the backward's) is built now when autograd is on."""
        torch = require_torch("Graph.from_edge_index")
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index: expected shape (2, E), got {tuple(edge_index.shape)}")
        if edge_index.dtype not in (torch.int32, torch.int64):
            if edge_index.is_floating_point() or edge_index.is_complex() or edge_index.dtype == torch.bool:
                raise TypeError(f"edge_index: expected an integer tensor, got dtype {edge_index.dtype}")
            edge_index = edge_index.to(torch.int64)
        e = edge_index.shape[1]
        if num_nodes is None:
            num_nodes = int(edge_index.max()) + 1 if e else 0
        num_nodes = _check_count("num_nodes", num_nodes)
        # The input edges' positions, then (with self loops) each loop's: GAT's per-edge data.
        positions = torch.empty(
            e + (num_nodes if self_loops else 0), dtype=torch.int64, device=edge_index.device
        )
        stride = edge_index.stride(1)
        core = _native.GraphCore.from_device_edges(
            device_index(edge_index),
            "int64" if edge_index.dtype == torch.int64 else "int32",
            edge_index[0].data_ptr(),
            stride,
            edge_index[1].data_ptr(),
            stride,
            e,
            num_nodes,
            bool(symmetrize),
            bool(self_loops),
            torch.is_grad_enabled(),
            positions.data_ptr() if positions.numel() else 0,
            stream_of(edge_index),
        )
        if core.duplicates:
            warnings.warn(
                f"edge_index lists {core.duplicates} edge(s) more than once; spattn merges "
                "repeated edges (PyG would count each copy in the softmax and the sum)",
                SpattnWarning,
                stacklevel=3,
            )
        g = cls._from_core(core)
        g._derived[_INPUT_POSITIONS] = (
            weakref.ref(edge_index), _version(edge_index), positions[:e], positions[e:],
            bool(symmetrize), bool(self_loops),
        )
        return g

    @classmethod
    def read_matrix_market(
        cls, path: "os.PathLike[str] | str", symmetrize: bool = False, self_loops: bool = False
    ) -> "Graph":
        """A graph read from a MatrixMarket file (``.mtx`` or ``.mtx.gz``; values ignored):
        entry ``(i, j)`` is an edge of row ``i``."""
        return cls._from_core(
            _native.GraphCore.read_matrix_market(os.fspath(path), bool(symmetrize), bool(self_loops))
        )

    # -- derived graphs -------------------------------------------------------------------

    def with_self_loops(self) -> "Graph":
        """This graph with the missing self loops added (cached: the same object each time)."""
        return self._derive(False, True)

    def symmetrized(self, self_loops: bool = False) -> "Graph":
        """This graph with every reverse edge added (and the self loops, if asked)."""
        return self._derive(True, bool(self_loops))

    def _derive(self, symmetrize: bool, self_loops: bool) -> "Graph":
        key = (symmetrize, self_loops)
        g = self._derived.get(key)
        if g is None:
            g = Graph._from_core(self._core.transformed(symmetrize, self_loops))
            self._derived[key] = g
        return g

    # -- properties -----------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Number of nodes (rows)."""
        return self._core.n_rows

    @property
    def num_cols(self) -> int:
        """Number of columns (equal to :attr:`num_nodes` except for a rectangular file)."""
        return self._core.n_cols

    @property
    def num_edges(self) -> int:
        """Number of edges (after merging repeats and any symmetrization / self loops)."""
        return self._core.nnz

    @property
    def policy(self) -> str:
        """How the graph's ``auto`` plans treat row orders and plans: ``"once"`` (keep the rows
        in their order, and take ``fused-csr`` in float16 / bfloat16 up to 2²⁰ edges, whose
        plan is free: a graph seen once, the default of a graph built on a GPU) or ``"reuse"``
        (choose a row order on the host when a plan is built, which GAT's row-statistics
        kernels walk too, and ``fused-tc`` in float16 / bfloat16, which the kernels repay over
        many calls: the default of a graph built on the host). Changing it drops the plans
        built so far.

        A graph under ``"once"`` that has had a backward is seen again: its next attention
        forward on CUDA (:func:`spattn.sparse_attention`, :func:`spattn.gat_attention`, the
        attention layers) outside a backward pass switches it to ``"reuse"``, as full-graph
        training wants (a mini-batch's graph is new every step and keeps ``"once"``; a forward
        recomputed by activation checkpointing does not count, but evaluating a mini-batch's
        graph after its backward does: set the policy to keep ``"once"``). Setting the policy
        fixes it, and so does any call under CUDA-graph capture; changing the policy of a
        captured graph would drop the plans its replays read. The switch replans, so the
        second step's results may differ from the first's in the last bits."""
        return self._core.policy

    @policy.setter
    def policy(self, value: str) -> None:
        self._core.set_policy(value)

    @property
    def built_on_device(self) -> bool:
        """Whether the graph was built on a GPU from CUDA tensors."""
        return self._core.built_on_device

    @property
    def num_duplicates(self) -> int:
        """Repeated input edges that were merged when the graph was built."""
        return self._core.duplicates

    def crow(self):
        """Row offsets (``num_nodes + 1``), a numpy int64 array."""
        return int64_array(self._core.crow())

    def col(self):
        """Column indices, row by row and sorted, a numpy int64 array."""
        return int64_array(self._core.col())

    def edge_index(self, device: Any = None):
        """The edges as a PyG ``edge_index`` (a ``2 × E`` torch int64 tensor: sources, then
        targets), in the graph's CSR order. On a CUDA ``device`` it is written there by a
        kernel (no copy through the host)."""
        torch = require_torch("Graph.edge_index")
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type == "cuda":
            out = torch.empty((2, self.num_edges), dtype=torch.int64, device=dev)
            if self.num_edges:
                self._core.edge_index_into(
                    device_index(out), out[0].data_ptr(), out[1].data_ptr(), stream_of(out)
                )
            return out
        if not self.num_edges:  # torch.frombuffer refuses an empty buffer
            return torch.empty((2, 0), dtype=torch.int64, device=dev)
        src = torch.frombuffer(bytearray(self._core.col()), dtype=torch.int64)
        dst = torch.frombuffer(bytearray(self._core.row()), dtype=torch.int64)
        return torch.stack([src, dst]).to(device) if device is not None else torch.stack([src, dst])

    def edge_positions(self, edge_index: Any):
        """Where each edge of a PyG ``edge_index`` (``2 × E``: sources, then targets) sits in
        this graph's CSR order (the order of :meth:`edge_index`, of ``bias=``,
        ``edge_features=`` and the attention weights): an int64 tensor of ``E`` positions on
        ``edge_index``'s device. Per-edge data in the input's order goes to the graph's by
        ``data_csr = data.new_zeros(...).index_copy(0, positions, data)``.

        An edge given more than once maps to its one position every time (a graph merges
        repeated edges), so ``index_copy`` would keep one of their rows: remove the repeats
        first where the data differ. Raises ``ValueError`` naming the first edge that is not in
        the graph."""
        torch = require_torch("Graph.edge_positions")
        if not torch.is_tensor(edge_index) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError("edge_index: expected a (2, E) integer tensor")
        built = self._built_positions(edge_index)
        if built is not None:
            return built[0]
        dev = edge_index.device
        n_cols = max(self.num_cols, 1)
        ours = self.edge_index(device=dev)
        keys = ours[1] * n_cols + ours[0]  # ascending: rows sorted, columns sorted in a row
        src, dst = edge_index[0].long(), edge_index[1].long()
        want = dst * n_cols + src
        pos = torch.searchsorted(keys, want).clamp_(max=max(keys.numel() - 1, 0))
        bad = (keys.numel() == 0) | (src < 0) | (dst < 0) | (src >= self.num_cols) | (dst >= self.num_nodes)
        if keys.numel():
            bad = bad | (keys[pos] != want)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"edge_index: edge {i} ({int(src[i])} -> {int(dst[i])}) is not in the graph"
            )
        return pos

    def _built_positions(self, edge_index: Any):
        """``(input positions, self-loop positions)`` of this graph built on a GPU from exactly
        ``edge_index`` (unmodified since), else None. The loops' are empty without self loops."""
        built = self._derived.get(_INPUT_POSITIONS)
        if built is not None and built[0]() is edge_index and built[1] == _version(edge_index):
            return built[2], built[3]
        return None

    def _built_cover(self, edge_index: Any, self_loops: bool):
        """:meth:`_built_positions` where they place a row on every edge of this graph: built
        from exactly ``edge_index`` without symmetrizing, with self loops exactly when
        ``self_loops`` (each loop's position then given), and no edge repeated. Else None."""
        built = self._derived.get(_INPUT_POSITIONS)
        if built is None or built[4] or built[5] != bool(self_loops) or self.num_duplicates:
            return None
        return self._built_positions(edge_index)

    # -- planning -------------------------------------------------------------------------

    def plan(
        self,
        heads: int,
        head_dim: int,
        dtype: Any = "float32",
        device: Any = "cuda",
        algorithm: str = "auto",
        scale: Optional[float] = None,
        extras: bool = False,
        edge_features: bool = False,
    ) -> Dict[str, str]:
        """Builds (or finds) the plan of a configuration now, so the first call does not pay
        for it, and says what it chose: ``{"algorithm": ..., "choice": ...}``.

        ``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an int or a ``torch.device``.
        ``extras=True``: the plan of calls with a ``bias`` or ``dropout`` (which ``auto`` serves
        with an algorithm whose kernel takes them); ``edge_features=True`` as well: of calls
        that also pass ``edge_features`` (``auto``: ``fused-csr``, whose kernel takes them)."""
        name = dtype_name(dtype)
        if name is None:
            raise TypeError(f"dtype: unsupported {dtype} (float32, float16, bfloat16, float64)")
        check_algorithm(algorithm)
        alg, choice = self._core.prepare(
            _device_arg(device), name, _check_count("heads", heads),
            _check_count("head_dim", head_dim), check_scale(scale), algorithm, bool(extras),
            bool(edge_features),
        )
        return {"algorithm": alg, "choice": choice}

    def device_bytes(self, device: Any = "cuda") -> int:
        """Device memory of this graph's uploads on ``device`` (CSR, transpose, blocked
        formats), in bytes; plans' workspaces are not included
        (see :func:`spattn.memory_stats`)."""
        return self._core.device_bytes(_device_arg(device))

    def __repr__(self) -> str:
        return (
            f"spattn.Graph(num_nodes={self.num_nodes}, num_edges={self.num_edges}"
            + (f", num_cols={self.num_cols}" if self.num_cols != self.num_nodes else "")
            + ")"
        )


def _make_token(graph: Graph) -> Any:
    """The tensor that stands for ``graph`` where only tensors may go (the custom operators
    ``torch.compile`` traces, :mod:`spattn._ops`): a CPU int64 tensor of one element, a number
    of this process's, holding the graph's native core (strongly: a traced model may outlive
    the ``Graph``) and the graph itself (weakly: no reference cycle keeps a graph's device
    memory waiting for the collector). A copy of the tensor (torch's checks of operators copy
    their inputs) finds the original by its number while that lives. None without torch."""
    if torch is None:
        return None
    number = next(_TOKEN_NUMBERS)
    token = torch.tensor([number], dtype=torch.int64)
    token._spattn_core = graph._core
    token._spattn_graph = weakref.ref(graph)
    _TOKENS[number] = token
    return token


_TOKEN_NUMBERS = itertools.count(1)
_TOKENS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def graph_of_token(token: Any) -> Graph:
    """The :class:`Graph` a token stands for (a new wrapper of the same native graph, sharing
    its plans, where the first one is gone). Raises ``TypeError`` for any other tensor."""
    core = getattr(token, "_spattn_core", None)
    if core is None:
        original = None
        if (is_tensor(token) and token.dtype == torch.int64 and token.numel() == 1
                and token.device.type == "cpu"):
            original = _TOKENS.get(int(token))
        if original is None:
            raise TypeError("graph: expected a spattn.Graph (or its token), got another tensor")
        token = original
        core = token._spattn_core
    graph = token._spattn_graph()
    if graph is None:
        graph = Graph._from_core(core)
    return graph


# The key of the input edges' CSR positions of a graph built on a GPU, in its derived data.
_INPUT_POSITIONS = "graph.input_positions"


def _version(t: Any) -> Optional[int]:
    """A tensor's in-place version counter (None for an inference-mode tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _is_cuda_tensor(x: Any) -> bool:
    """Whether ``x`` is a dense torch tensor on a CUDA device."""
    return is_tensor(x) and x.device.type == "cuda" and x.layout == torch.strided


def _csr_on_device(crow: Any, col: Any, n: Optional[int]):
    """The native graph of CUDA CSR arrays, built on their GPU: the rows expanded on the device
    and the entries given to the edge-list build (which skips its sort when the rows list
    their columns in order)."""
    torch = require_torch("Graph")
    for name, t in (("crow", crow), ("col", col)):
        if t.dim() != 1:
            raise ValueError(f"{name}: expected 1 dimension, got shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {t.dtype}")
    if crow.device != col.device:
        raise ValueError(f"col: is on {col.device}, crow on {crow.device}")
    rows = crow.shape[0] - 1
    if rows < 0:
        raise ValueError("crow: needs at least one entry (n + 1 offsets)")
    n = rows if n is None else _check_count("n", n)
    if n != rows:
        raise ValueError(f"crow: has {crow.shape[0]} offsets, but n = {n} nodes need {n + 1}")
    nnz = col.shape[0]
    if rows == 0 and nnz:
        raise ValueError(f"crow: has no rows, but col has {nnz} entries")
    crow64 = crow.to(torch.int64)
    counts = crow64[1:] - crow64[:-1]
    # Offsets that do not start at 0, decrease, or do not end at nnz: one read back.
    bad = (counts < 0).any() | (crow64[0] != 0) | (crow64[-1] != nnz)
    if bool(bad):
        raise ValueError(f"crow: offsets must start at 0, never decrease and end at {nnz}")
    row = torch.repeat_interleave(
        torch.arange(rows, device=crow.device, dtype=torch.int64), counts, output_size=nnz
    )
    edges = torch.stack([col.to(torch.int64), row])
    core = _native.GraphCore.from_device_edges(
        device_index(edges), "int64", edges[0].data_ptr(), 1, edges[1].data_ptr(), 1, nnz, n,
        False, False, torch.is_grad_enabled(), 0, stream_of(edges),
    )
    if core.duplicates:
        raise ValueError(
            f"col: {core.duplicates} entries repeat a column of their row; a graph is a set of edges"
        )
    return core


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{name}: must be non-negative, got {value}")
    return value


def _max_plus_one(*raws: bytes) -> int:
    best = -1
    for raw in raws:
        if raw:
            values = int64_array(raw)
            lo, hi = (int(values.min()), int(values.max())) if hasattr(values, "max") else (
                min(values), max(values))
            if lo < 0:
                raise ValueError(f"edge_index: entry {lo} is negative")
            best = max(best, hi)
    return best + 1


def _device_arg(device: Any) -> int:
    """The native device argument (-1 for the CPU) of a device given as a string, int or
    torch.device."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    text = str(device)
    if text == "cpu":
        return -1
    if text == "cuda":
        try:
            import torch

            return torch.cuda.current_device() if torch.cuda.is_available() else 0
        except ImportError:
            return 0
    if text.startswith("cuda:"):
        return int(text[5:])
    raise ValueError(f"device: {device!r} is not 'cpu', 'cuda' or 'cuda:N'")


__all__ = ["Graph", "SpattnWarning", "ALGORITHMS"]
