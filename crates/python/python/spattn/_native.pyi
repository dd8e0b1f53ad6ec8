"""Type stubs of ``spattn._native``, the compiled half of spattn (PyO3; crates/python/src).

Conventions of the calls: a tensor argument is an address (``data_ptr()``, an ``int``; 0 for
none) that the Python package has validated; ``device < 0`` selects the CPU path; ``stream`` is
the caller's current CUDA stream handle; ``dtype`` is ``"f32"``, ``"f16"`` or ``"bf16"`` (and
``"f64"`` on the CPU); ``dropout`` is ``(rate, seed, offset)``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, final

__version__: str
__all__ = [
    "__version__",
    "SpattnError",
    "GraphCore",
    "cuda_device_count",
    "device_info",
    "memory_pool_stats",
    "reset_memory_pool_peak",
    "empty_memory_pool",
    "head_dot",
    "head_dot_backward",
    "gat_supports",
    "gat_auto_kernels",
    "edge_rows",
    "GAT_FUSED_MAX_EDGES",
    "GAT_ROWS_MIN_HEADS",
    "GAT_ROWS_SMALL_MAX_EDGES",
]

GAT_FUSED_MAX_EDGES: int
"""Edges up to which the package's GAT backward takes the fused kernels (``kernels="auto"``)."""

GAT_ROWS_MIN_HEADS: int
"""Heads from which the package's GAT takes the row-statistics kernels (``kernels="auto"``)."""

GAT_ROWS_SMALL_MAX_EDGES: int
"""Edges up to which the package's GAT takes the row-statistics kernels at any head count
(``kernels="auto"``)."""

class SpattnError(RuntimeError):
    """A CUDA driver or runtime failure inside spattn (no driver, no device, a failed launch)."""

def cuda_device_count() -> int:
    """CUDA devices the driver reports; 0 where there is no driver. Never raises."""

def device_info(device: int) -> dict[str, Any]:
    """``name``, ``compute_capability`` ((major, minor)), ``sm_count``, ``driver_version``."""

def memory_pool_stats(device: int) -> dict[str, int]:
    """Bytes in spattn's pool: ``used``, ``used_peak``, ``reserved``, ``reserved_peak``."""

def reset_memory_pool_peak(device: int) -> None: ...
def empty_memory_pool(device: int) -> None: ...
def head_dot(device: int, dtype: str, rows: int, heads: int, dim: int, x: int, att: int,
             out: int, stream: int, n_att: int = 1) -> None:
    """``out[t, i, h] = <x[i, h, :], att[t, h, :]>`` in f32 on CUDA tensors (att and out f32;
    ``n_att`` vectors from one read of x)."""

def head_dot_backward(device: int, dtype: str, rows: int, heads: int, dim: int, x: int,
                      att: int, d_out: int, dx: int, d_att: int, stream: int,
                      n_att: int = 1) -> None:
    """Adds ``Σ_t d_out[t] ⊗ att[t]`` into ``dx`` and ``Σ_i d_out[t, i, h] x[i, h, :]`` into
    ``d_att[t]``."""

def gat_auto_kernels(dtype: str, heads: int, dim: int, nnz: int, backward: bool, rows: bool) -> str:
    """The GAT kernels ``kernels="auto"`` stands for on CUDA: ``"rows"``, ``"fused"`` (a backward
    only) or ``"composed"``, for ``heads × dim`` features of ``dtype`` on a graph of ``nnz``
    edges (a backward takes ``"rows"`` only where ``rows``)."""

def edge_rows(graph: GraphCore, device: int, dtype: str, out_dtype: str, width: int, x: int,
              rows: int, positions: int, loops: int, fill: str, value: float, out: int,
              stream: int) -> None:
    """Writes ``rows × width`` edge attributes into ``out`` (``nnz × width``, f32 or ``dtype``) in
    the graph's CSR order (row ``e`` at edge ``positions[e]``), then with ``loops`` (non-zero:
    each row's self-loop position) the loops' rows: ``"mean"`` or ``"sum"`` of the row's other
    edges, or ``"value"``."""

def gat_supports(kernels: str, dtype: str, dim: int) -> bool:
    """Whether GAT's ``kernels`` (``"fused"``, ``"rows"``, ``"composed"``) take heads of ``dim``
    features of ``dtype`` on CUDA."""

@final
class GraphCore:
    """One graph (row i lists the nodes node i attends to) and its cached plans; immutable.

    Not constructible (``GraphCore()`` raises ``TypeError``) nor subclassable: build one with
    the static methods.
    """

    @staticmethod
    def from_csr(crow: bytes, col: bytes, n_rows: int, n_cols: int) -> GraphCore:
        """From native-endian int64 CSR offsets (``n_rows + 1``) and column indices."""

    @staticmethod
    def from_edges(
        src: bytes,
        dst: bytes,
        num_nodes: int,
        symmetrize: bool = False,
        self_loops: bool = False,
    ) -> GraphCore:
        """From PyG-style edges ``src[k] -> dst[k]`` (native-endian int64); repeats merged."""

    @staticmethod
    def from_device_edges(
        device: int,
        dtype: str,
        src: int,
        src_stride: int,
        dst: int,
        dst_stride: int,
        n_edges: int,
        num_nodes: int,
        symmetrize: bool,
        self_loops: bool,
        transpose: bool,
        positions: int,
        stream: int,
    ) -> GraphCore:
        """Built on CUDA ``device`` from edge ids in its memory (``"int32"`` or ``"int64"``)."""

    @staticmethod
    def read_matrix_market(
        path: str | os.PathLike[str],
        symmetrize: bool = False,
        self_loops: bool = False,
    ) -> GraphCore: ...
    @property
    def built_on_device(self) -> bool: ...
    @property
    def policy(self) -> str:
        """``"once"`` or ``"reuse"``."""

    def set_policy(self, policy: str) -> None:
        """``"once"`` or ``"reuse"``; drops the plans built before."""

    @property
    def backward_calls(self) -> int:
        """Backward calls on CUDA so far."""

    def edge_index_into(self, device: int, src: int, dst: int, stream: int) -> None:
        """Writes the edges (columns, rows; ``nnz`` int64 each) into CUDA memory at src, dst."""

    def transformed(self, symmetrize: bool = False, self_loops: bool = False) -> GraphCore: ...
    @property
    def n_rows(self) -> int: ...
    @property
    def n_cols(self) -> int: ...
    @property
    def nnz(self) -> int: ...
    @property
    def duplicates(self) -> int: ...
    def crow(self) -> bytes:
        """Row offsets, native-endian int64 (``n_rows + 1``)."""

    def col(self) -> bytes:
        """Column indices, native-endian int64 (``nnz``)."""

    def row(self) -> bytes:
        """Row of every edge, native-endian int64 (``nnz``)."""

    def prepare(
        self,
        device: int,
        dtype: str,
        heads: int,
        head_dim: int,
        scale: float | None,
        algorithm: str,
        extras: bool = False,
        edge_features: bool = False,
    ) -> tuple[str, str]:
        """Builds (or finds) the plan; returns (algorithm, why it was chosen)."""

    def device_bytes(self, device: int) -> int: ...
    def attention(
        self,
        problem: tuple[int, str, int, int],
        scale: float | None,
        algorithm: str,
        backward: bool,
        ptrs: Sequence[int],
        stream: int,
        d_scale: bool = True,
        lse: int = 0,
        step: bool = True,
    ) -> float:
        """``problem``: (device, dtype, heads, head_dim); ``ptrs``: 4 (forward) or 8 addresses;
        ``lse``: the address of the row statistics kept (forward: returns 1.0 where kept);
        ``step``: whether a forward may begin a training step (not inside a backward pass)."""

    def attention_extras(
        self,
        problem: tuple[int, str, int, int],
        scale: float | None,
        algorithm: str,
        backward: bool,
        bias: str,
        dropout: tuple[float, int, int] | None,
        edge_features: bool,
        ptrs: Sequence[int],
        stream: int,
        d_scale: bool = True,
        step: bool = True,
    ) -> float:
        """``bias``: ``"none"``, ``"shared"`` or ``"per_head"``; ``ptrs``: 7 (forward) or 11;
        ``step`` as for :meth:`attention`."""

    def gat_forward(
        self,
        device: int,
        dtype: str,
        heads: int,
        dim: int,
        negative_slope: float,
        x: int,
        a_dst: int,
        a_src: int,
        out: int,
        workspace: int,
        stream: int,
        dropout: tuple[float, int, int] | None = None,
        bias: int = 0,
        kernels: str = "composed",
        step: bool = True,
    ) -> None:
        """``step`` as for :meth:`attention`."""
    def gat_backward(
        self,
        device: int,
        dtype: str,
        heads: int,
        dim: int,
        negative_slope: float,
        x: int,
        a_dst: int,
        a_src: int,
        d_out: int,
        dx: int,
        da_dst: int,
        da_src: int,
        workspaces: tuple[int, int, int],
        stream: int,
        dropout: tuple[float, int, int] | None = None,
        bias: int = 0,
        d_bias: int = 0,
        kernels: str = "composed",
        out: int = 0,
        lse_kept: bool = False,
    ) -> None: ...
    def gatv2_forward(
        self,
        device: int,
        dtype: str,
        heads: int,
        dim: int,
        negative_slope: float,
        x_l: int,
        x_r: int,
        att: int,
        edge_features: int,
        out: int,
        workspace: int,
        stream: int,
        dropout: tuple[float, int, int] | None = None,
    ) -> None: ...
    def gatv2_backward(
        self,
        device: int,
        dtype: str,
        heads: int,
        dim: int,
        negative_slope: float,
        x_l: int,
        x_r: int,
        att: int,
        edge_features: int,
        d_out: int,
        d_x_l: int,
        d_x_r: int,
        d_att_rows: int,
        d_edge_features: int,
        workspaces: tuple[int, int, int],
        stream: int,
        dropout: tuple[float, int, int] | None = None,
    ) -> None: ...
    def __repr__(self) -> str: ...
