"""spattn: sparse graph attention on NVIDIA GPUs, for PyTorch users.

    out = softmax_row(scale · Q Kᵀ masked by A) · V

- :class:`Graph`: a graph (CSR or a PyG ``edge_index``) and its plan-once state.
- :func:`sparse_attention`: attention over a graph on torch tensors (zero-copy on CUDA, ordered
  with the current stream; autograd through spattn's exact backward) or numpy arrays (CPU).
- :func:`gat_attention`: GAT's LeakyReLU(a_dst·Wx_i + a_src·Wx_j) attention, likewise;
  :func:`gatv2_attention`: GATv2's aᵀ LeakyReLU(W_s x_j + W_t x_i) attention.
- :mod:`spattn.nn`: ``TransformerConv``, ``GATConv``, ``GATv2Conv``, ``AGNNConv``, drop-in for PyG's
  (imported on first use: it needs torch).
"""

from ._native import SpattnError, __version__
from ._native import cuda_device_count as _cuda_device_count
from ._native import device_info as _device_info
from ._native import memory_pool_stats as _memory_pool_stats
from ._native import reset_memory_pool_peak as _reset_memory_pool_peak
from ._native import empty_memory_pool as _empty_memory_pool
from .functional import gat_attention, gatv2_attention, sparse_attention, sparse_attention_backward
from .graph import ALGORITHMS, Graph, SpattnWarning, _device_arg


def cuda_device_count() -> int:
    """CUDA devices the driver reports (0 without a driver; never raises)."""
    return _cuda_device_count()


def device_info(device="cuda") -> dict:
    """What spattn sees of a CUDA device: name, compute capability, SM count, driver version."""
    return _device_info(_device_arg(device))


def memory_stats(device="cuda") -> dict:
    """Device memory held by spattn itself on ``device``, in bytes: ``used`` and ``used_peak``
    (graph uploads, plans' workspaces), ``reserved`` and ``reserved_peak`` (what its memory pool
    holds). ``torch.cuda.max_memory_allocated`` does not count these; tensors spattn writes
    into (outputs, gradients, the GAT workspaces) are PyTorch's and are counted there."""
    return _memory_pool_stats(_device_arg(device))


def reset_peak_memory_stats(device="cuda") -> None:
    """Resets the peaks of :func:`memory_stats`."""
    _reset_memory_pool_peak(_device_arg(device))


def empty_cache(device="cuda") -> None:
    """Hands the device memory spattn's pool keeps freed (``reserved`` minus ``used`` in
    :func:`memory_stats`) back to the driver, as ``torch.cuda.empty_cache`` does for PyTorch's.
    Freed memory is kept by default, so that a graph built every step reuses it."""
    _empty_memory_pool(_device_arg(device))


def __getattr__(name):
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module 'spattn' has no attribute {name!r}")


__all__ = [
    "ALGORITHMS",
    "Graph",
    "SpattnError",
    "SpattnWarning",
    "__version__",
    "cuda_device_count",
    "device_info",
    "empty_cache",
    "gat_attention",
    "gatv2_attention",
    "memory_stats",
    "reset_peak_memory_stats",
    "sparse_attention",
    "sparse_attention_backward",
]
