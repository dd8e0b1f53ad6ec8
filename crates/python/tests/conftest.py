"""Shared helpers of the spattn Python tests: graph files and dense numpy references."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

# torch.compile's on-disk caches do not key on a custom operator's schema: a compilation cached
# by another version of the package would call spattn's operators with the old arguments.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="spattn-inductor-"))

REPO = Path(__file__).resolve().parents[3]
BUNDLED_CORA = REPO / "crates" / "formats" / "tests" / "data" / "cora.mtx.gz"


def data_file(name: str):
    """``name`` (e.g. ``"pubmed.mtx.gz"``) from ``SPATTN_DATA_DIR``, ``../shared/data/mtx``
    beside the repository, or (cora) the bundled copy; None where absent."""
    candidates = []
    # Mirrors spattn_test_support::data_dirs: SPATTN_DATA_DIR if non-empty, ../shared/data/mtx.
    if os.environ.get("SPATTN_DATA_DIR"):
        candidates.append(Path(os.environ["SPATTN_DATA_DIR"]) / name)
    candidates.append(REPO.parent / "shared" / "data" / "mtx" / name)
    candidates.append(REPO / "data" / name)
    if name == "cora.mtx.gz":
        candidates.append(BUNDLED_CORA)
    for c in candidates:
        if c.is_file():
            return c
    return None


def dense_mask(graph) -> np.ndarray:
    """The graph as a dense boolean matrix (rows × cols)."""
    crow, col = graph.crow(), graph.col()
    m = np.zeros((graph.num_nodes, graph.num_cols), dtype=bool)
    for i in range(graph.num_nodes):
        m[i, col[crow[i] : crow[i + 1]]] = True
    return m


def ref_attention(mask, q, k, v, scale):
    """Dense f64 reference: per head, softmax over each row's edges; empty rows give 0.
    Returns out and the probabilities (heads × rows × cols)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    n, h, d = q.shape
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    s = np.where(mask[None], s, -np.inf)
    m = s.max(axis=2, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(mask[None], np.exp(s - m), 0.0)
    z = e.sum(axis=2, keepdims=True)
    p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    out = np.einsum("hij,jhd->ihd", p, v)
    return out, p


def ref_attention_backward(mask, q, k, v, d_out, scale):
    """Dense f64 reference of the gradients: dq, dk, dv, d_scale."""
    q, k, v, d_out = (np.asarray(a, dtype=np.float64) for a in (q, k, v, d_out))
    _, p = ref_attention(mask, q, k, v, scale)
    raw = np.einsum("ihd,jhd->hij", q, k)
    dp = np.einsum("ihd,jhd->hij", d_out, v)
    ds = p * (dp - (p * dp).sum(axis=2, keepdims=True))
    dq = scale * np.einsum("hij,jhd->ihd", ds, k)
    dk = scale * np.einsum("hij,ihd->jhd", ds, q)
    dv = np.einsum("hij,ihd->jhd", p, d_out)
    return dq, dk, dv, float((ds * raw).sum())


def rel_l2(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    denom = np.linalg.norm(b.ravel())
    diff = np.linalg.norm((a - b).ravel())
    return float(diff / denom) if denom > 0 else float(diff)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def lse_seen(monkeypatch):
    """The ``lse`` each call of the native attention backward was handed (None where none), in
    call order: a spy on ``spattn.functional._native_backward`` for the test's duration."""
    from spattn import functional as F

    seen = []
    native = F._native_backward

    def spy(*args, **kw):
        seen.append(kw.get("lse"))
        return native(*args, **kw)

    monkeypatch.setattr(F, "_native_backward", spy)
    return seen
