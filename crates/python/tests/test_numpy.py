"""CPU tests of the binding that need numpy only (no torch): graphs, attention forward and
backward against a dense f64 reference, and errors naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

import spattn
from conftest import (
    BUNDLED_CORA,
    dense_mask,
    ref_attention,
    ref_attention_backward,
    rel_l2,
)


def ring(n: int) -> spattn.Graph:
    src = np.arange(n)
    dst = (src + 1) % n
    return spattn.Graph.from_edge_index(np.stack([src, dst]), symmetrize=True, self_loops=True)


def random_graph(rng, n=40, e=200, empty_rows=(3, 17)) -> spattn.Graph:
    src = rng.integers(0, n, size=e)
    dst = rng.integers(0, n, size=e)
    keep = ~np.isin(dst, empty_rows)
    ei = np.stack([src[keep], dst[keep]])
    pairs = np.unique(ei.T, axis=0).T  # no repeats: no warning
    return spattn.Graph.from_edge_index(pairs, num_nodes=n)


def test_version_and_devices():
    assert spattn.__version__
    assert spattn.cuda_device_count() >= 0  # never raises, 0 without a driver


def test_graph_from_csr_and_edge_index_agree():
    crow = np.array([0, 2, 2, 3])
    col = np.array([2, 0, 1])  # row 0 unsorted: sorted on the way in
    g = spattn.Graph(crow, col, 3)
    assert (g.num_nodes, g.num_edges) == (3, 3)
    np.testing.assert_array_equal(g.crow(), [0, 2, 2, 3])
    np.testing.assert_array_equal(g.col(), [0, 2, 1])
    # The same graph from PyG edges j -> i: row i lists the sources.
    h = spattn.Graph.from_edge_index(np.array([[0, 2, 1], [0, 0, 2]]), num_nodes=3)
    np.testing.assert_array_equal(h.crow(), g.crow())
    np.testing.assert_array_equal(h.col(), g.col())
    assert "num_nodes=3" in repr(g)


def test_symmetrize_self_loops_and_duplicates():
    g = ring(5)
    assert g.num_edges == 15
    mask = dense_mask(g)
    assert (mask == mask.T).all() and mask.diagonal().all()
    with pytest.warns(spattn.SpattnWarning, match="more than once"):
        d = spattn.Graph.from_edge_index(np.array([[0, 0, 1], [1, 1, 0]]))
    assert d.num_duplicates == 1 and d.num_edges == 2
    loops = d.with_self_loops()
    assert loops.num_edges == 4 and d.with_self_loops() is loops


def test_read_matrix_market_bundled_cora():
    g = spattn.Graph.read_matrix_market(BUNDLED_CORA, symmetrize=True, self_loops=True)
    assert g.num_nodes == 2708
    assert g.num_edges > 2708
    mask_diag = g.crow()[1:] - g.crow()[:-1]
    assert (mask_diag >= 1).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_attention_forward_matches_dense_reference(rng, dtype):
    g = random_graph(rng)
    n, h, d = g.num_nodes, 3, 5
    q, k, v = (rng.standard_normal((n, h, d)).astype(dtype) for _ in range(3))
    out = spattn.sparse_attention(g, q, k, v)
    assert out.dtype == dtype and out.shape == (n, h, d)
    ref, _ = ref_attention(dense_mask(g), q, k, v, 1 / np.sqrt(d))
    tol = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}[dtype]
    assert rel_l2(out, ref) <= tol
    # Rows without edges are zeros.
    assert not out[3].any() and not out[17].any()


def test_attention_scale_and_backward(rng):
    g = random_graph(rng, n=30, e=150)
    n, h, d = g.num_nodes, 2, 4
    q, k, v, d_out = (rng.standard_normal((n, h, d)) for _ in range(4))
    scale = 0.7
    out = spattn.sparse_attention(g, q, k, v, scale=scale)
    dq, dk, dv, d_scale = spattn.sparse_attention_backward(g, q, k, v, out, d_out, scale=scale)
    rq, rk, rv, rs = ref_attention_backward(dense_mask(g), q, k, v, d_out, scale)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        assert rel_l2(got, want) <= 1e-12
    assert abs(d_scale - rs) <= 1e-10 * max(1.0, abs(rs))
    # f32 too.
    f = [a.astype(np.float32) for a in (q, k, v, out, d_out)]
    dq32, _, _, ds32 = spattn.sparse_attention_backward(g, *f, scale=scale)
    assert dq32.dtype == np.float32 and rel_l2(dq32, rq) <= 1e-5
    assert abs(ds32 - rs) <= 1e-4 * max(1.0, abs(rs))


def test_empty_graph_and_no_edges():
    g = spattn.Graph(np.array([0]), np.array([], dtype=np.int64), 0)
    assert g.num_nodes == 0
    z = np.zeros((0, 2, 3))
    assert spattn.sparse_attention(g, z, z, z).shape == (0, 2, 3)
    g2 = spattn.Graph(np.zeros(4, dtype=np.int64), np.array([], dtype=np.int64))
    x = np.ones((3, 1, 2))
    assert not spattn.sparse_attention(g2, x, x, x).any()


def test_graph_errors_name_the_argument():
    with pytest.raises(ValueError, match="edge_index"):
        spattn.Graph.from_edge_index(np.array([[0, 5], [1, 0]]), num_nodes=3)
    with pytest.raises(ValueError, match="edge_index"):
        spattn.Graph.from_edge_index(np.array([[0, -1], [1, 0]]), num_nodes=3)
    with pytest.raises(ValueError, match="edge_index"):
        spattn.Graph.from_edge_index(np.zeros((3, 4), dtype=np.int64))
    with pytest.raises(TypeError, match="edge_index"):
        spattn.Graph.from_edge_index(np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="col"):
        spattn.Graph(np.array([0, 1, 2]), np.array([0, 7]), 2)
    with pytest.raises(ValueError, match="col"):
        spattn.Graph(np.array([0, 2, 2]), np.array([1, 1]), 2)  # a column twice in a row
    with pytest.raises(ValueError, match="crow"):
        spattn.Graph(np.array([0, 2, 1]), np.array([0, 1]), 2)
    with pytest.raises(ValueError, match="crow"):
        spattn.Graph(np.array([0, 1]), np.array([0]), 5)
    with pytest.raises(OSError, match="path"):
        spattn.Graph.read_matrix_market("/nonexistent/graph.mtx.gz")


def test_attention_errors_name_the_argument(rng):
    g = ring(6)
    q = rng.standard_normal((6, 2, 4))
    with pytest.raises(ValueError, match="k"):
        spattn.sparse_attention(g, q, q[:5], q)
    with pytest.raises(TypeError, match="v"):
        spattn.sparse_attention(g, q, q, q.astype(np.float32))
    with pytest.raises(ValueError, match="q"):
        spattn.sparse_attention(g, q[:5], q, q)
    with pytest.raises(ValueError, match="not C-contiguous"):
        spattn.sparse_attention(g, q, q[:, :, ::-1], q)
    with pytest.raises(ValueError, match="algorithm"):
        spattn.sparse_attention(g, q, q, q, algorithm="magic")
    with pytest.raises(ValueError, match="scale"):
        spattn.sparse_attention(g, q, q, q, scale=float("nan"))
    with pytest.raises(TypeError, match="graph"):
        spattn.sparse_attention("not a graph", q, q, q)
    with pytest.raises(TypeError, match="q"):
        spattn.sparse_attention(g, q.astype(np.int32), q, q)
    with pytest.raises(ValueError, match="device"):
        g.plan(2, 4, device="tpu")
    # On the CPU the plan is the reference, whatever extras it is asked for.
    for extras, features in ((False, False), (True, False), (True, True)):
        plan = g.plan(2, 4, device="cpu", extras=extras, edge_features=features)
        assert plan["algorithm"] == "cpu" and "CPU" in plan["choice"]
