"""Argument checks and conversions shared by the package.

Everything handed to the native module goes through here: tensors are checked for type,
device, dtype, shape and contiguity, and named in every error, before their addresses are
passed on (see ``crates/python/src/graph.rs`` for the native side's contract).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Optional, Tuple

try:  # numpy is a dependency, but keep torch-only use working without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without numpy
    np = None

try:
    import torch
except ImportError:  # numpy-only installs: the torch paths raise when used.
    torch = None

ALGORITHMS = ("auto", "unfused-csr", "unfused-tc", "fused-csr", "fused-tc", "hybrid")

#: torch / numpy dtype names -> the native module's names.
_DTYPE_NAMES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
}


#: torch dtypes -> the native module's names (the per-call lookup, without formatting).
_TORCH_DTYPE_NAMES = (
    {} if torch is None
    else {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
)


def dtype_name(dtype: Any) -> Optional[str]:
    """The native name of a torch or numpy dtype (``"f32"``, ...), or None if unsupported."""
    if torch is not None and isinstance(dtype, torch.dtype):
        return _TORCH_DTYPE_NAMES.get(dtype)
    text = str(dtype)
    text = text[len("torch."):] if text.startswith("torch.") else text
    return _DTYPE_NAMES.get(text)


def is_tensor(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def is_ndarray(x: Any) -> bool:
    return np is not None and isinstance(x, np.ndarray)


def require_torch(what: str):
    if torch is None:
        raise ImportError(f"{what} needs PyTorch: pip install torch")
    return torch


def check_algorithm(algorithm: Any) -> str:
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(
            f"algorithm: {algorithm!r} is not one of {', '.join(ALGORITHMS)}"
        )
    return algorithm


def check_scale(scale: Any) -> Optional[float]:
    """A float scale (None = 1/sqrt(head_dim)); tensors are handled by the callers."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float, None or a 0-dim tensor, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: {scale} is not finite")
    return scale


def check_torch(
    name: str,
    t: Any,
    *,
    like: Optional["torch.Tensor"] = None,
    shape: Optional[Tuple[int, ...]] = None,
    dtype: Any = None,
    shape_hint: str = "",
) -> "torch.Tensor":
    """Checks a tensor argument: a strided torch.Tensor on ``like``'s device (and of its
    dtype unless ``dtype`` is given), of ``shape``, contiguous. Errors name the argument."""
    if not is_tensor(t):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: tensors on {t.device.type} are not supported (cpu or cuda)")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name}: is on {t.device}, expected {like.device} like the other inputs")
    want = dtype if dtype is not None else (like.dtype if like is not None else None)
    if want is not None and t.dtype != want:
        raise TypeError(f"{name}: has dtype {t.dtype}, expected {want}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        hint = f" ({shape_hint})" if shape_hint else ""
        raise ValueError(f"{name}: has shape {tuple(t.shape)}, expected {tuple(shape)}{hint}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            f"pass {name}.contiguous()"
        )
    return t


def check_numpy(
    name: str,
    a: Any,
    *,
    shape: Optional[Tuple[int, ...]] = None,
    dtype: Any = None,
    shape_hint: str = "",
):
    """Checks a numpy argument: an ndarray of ``dtype``, ``shape``, C-contiguous."""
    if not is_ndarray(a):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(a).__name__}")
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"{name}: has dtype {a.dtype}, expected {dtype}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        hint = f" ({shape_hint})" if shape_hint else ""
        raise ValueError(f"{name}: has shape {tuple(a.shape)}, expected {tuple(shape)}{hint}")
    if not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name}: is not C-contiguous; pass numpy.ascontiguousarray({name})")
    return a


def address(x: Any) -> int:
    """The data address of a checked tensor or array (0 for an empty one)."""
    if is_tensor(x):
        return x.data_ptr() if x.numel() else 0
    return x.ctypes.data if x.size else 0


def device_index(t: "torch.Tensor") -> int:
    """The native module's device argument: the CUDA index, or -1 for the CPU."""
    # get_device() is the CUDA index (tensors always carry one) and -1 on the CPU, without
    # building a torch.device.
    return t.get_device() if t.is_cuda else -1


def stream_of(t: "torch.Tensor") -> int:
    """The handle of PyTorch's current stream on ``t``'s CUDA device (0 for the CPU)."""
    if not t.is_cuda:
        return 0
    if _RAW_STREAM is not None:
        return _RAW_STREAM(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


# The current stream's handle without building a torch.cuda.Stream (what torch's own Triton
# launchers call); the public route where a build lacks it.
_RAW_STREAM = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)


def index_bytes(name: str, a: Any, ndim: int = 1) -> Tuple[bytes, Tuple[int, ...]]:
    """An integer index array (torch tensor on any device, numpy array, or sequence) as
    native-endian int64 bytes, with its shape. Errors name the argument."""
    if is_tensor(a):
        if a.is_floating_point() or a.is_complex() or a.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {a.dtype}")
        if a.dim() != ndim:
            raise ValueError(f"{name}: expected {ndim} dimension(s), got shape {tuple(a.shape)}")
        t = a.detach().to(device="cpu", dtype=torch.int64).contiguous()
        shape = tuple(t.shape)
        if t.numel() == 0:
            return b"", shape
        if np is not None:
            return t.numpy().tobytes(), shape
        return ctypes.string_at(t.data_ptr(), t.numel() * 8), shape
    if np is None:
        raise TypeError(f"{name}: expected a torch.Tensor (numpy is not installed)")
    arr = np.asarray(a)
    if arr.size == 0 and arr.dtype.kind == "f" and not is_ndarray(a):
        arr = arr.astype(np.int64)  # an empty list
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension(s), got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: index {int(arr.max())} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int64).tobytes(), tuple(arr.shape)


def int64_array(raw: bytes):
    """Native-endian int64 bytes from the native module as a numpy array (a list without
    numpy)."""
    if np is not None:
        return np.frombuffer(raw, dtype=np.int64).copy()
    import array

    out = array.array("q")
    out.frombytes(raw)
    return list(out)
