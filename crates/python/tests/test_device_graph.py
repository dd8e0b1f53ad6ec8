"""GPU tests (skipped without CUDA) of graphs built on the GPU from CUDA tensors
(``Graph.from_edge_index`` and ``Graph(crow, col)`` of CUDA tensors): the same graph, repeats,
edge positions and outputs as the host-built graph's; bad ids named; the plan policy.

    SPATTN_DATA_DIR=data python -m pytest -v -s tests/test_device_graph.py
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import spattn  # noqa: E402
from conftest import data_file  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or spattn.cuda_device_count() == 0,
    reason="needs an NVIDIA GPU (torch.cuda and spattn both see one)",
)


def random_edges(n: int, e: int, seed: int, repeats: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=gen)
    if repeats:
        ei = torch.cat([ei, ei[:, :repeats]], dim=1)
    return ei


def same_graph(a: spattn.Graph, b: spattn.Graph) -> None:
    assert (a.num_nodes, a.num_cols, a.num_edges) == (b.num_nodes, b.num_cols, b.num_edges)
    np.testing.assert_array_equal(a.crow(), b.crow())
    np.testing.assert_array_equal(a.col(), b.col())


@pytest.mark.parametrize("sym,loops", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_device_graph_equals_the_host_graph(sym, loops, dtype):
    for n, e in [(1, 3), (17, 40), (300, 2000), (5000, 60000)]:
        ei = random_edges(n, e, seed=n, repeats=e // 10)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            host = spattn.Graph.from_edge_index(ei, num_nodes=n, symmetrize=sym, self_loops=loops)
            dev_ei = ei.to("cuda", dtype)
            dev = spattn.Graph.from_edge_index(dev_ei, num_nodes=n, symmetrize=sym, self_loops=loops)
        assert dev.built_on_device and not host.built_on_device
        assert dev.num_duplicates == host.num_duplicates
        same_graph(dev, host)
        # The input edges' positions (computed by the build) and the graph's edge_index on the
        # device (written by a kernel) agree with the host's.
        pos = dev.edge_positions(dev_ei)
        assert pos.device.type == "cuda"
        torch.testing.assert_close(pos.cpu(), host.edge_positions(ei))
        torch.testing.assert_close(dev.edge_index(device="cuda").cpu(), host.edge_index())


def test_strided_sorted_and_empty_edge_lists():
    n = 500
    ei = random_edges(n, 4000, seed=3)
    host = spattn.Graph.from_edge_index(ei, num_nodes=n)
    # A (2, E) view with strides (1, 2): rows interleaved.
    strided = ei.t().contiguous().cuda().t()
    assert not strided.is_contiguous()
    same_graph(spattn.Graph.from_edge_index(strided, num_nodes=n), host)
    # Sorted by (target, source), as a sampler's CSC gives it: the sort is skipped.
    ours = host.edge_index()
    same_graph(spattn.Graph.from_edge_index(ours.cuda(), num_nodes=n), host)
    # num_nodes from the ids; no edges.
    same_graph(spattn.Graph.from_edge_index(ei.cuda()), spattn.Graph.from_edge_index(ei))
    empty = spattn.Graph.from_edge_index(torch.zeros(2, 0, dtype=torch.long, device="cuda"), num_nodes=7)
    assert (empty.num_nodes, empty.num_edges) == (7, 0)
    np.testing.assert_array_equal(empty.crow(), np.zeros(8, dtype=np.int64))


def test_cuda_csr_arrays_build_on_the_device():
    host = spattn.Graph.from_edge_index(random_edges(300, 3000, seed=5), num_nodes=300)
    crow, col = torch.from_numpy(host.crow()), torch.from_numpy(host.col())
    dev = spattn.Graph(crow.cuda(), col.cuda())
    assert dev.built_on_device
    same_graph(dev, host)
    # Rows listing their columns out of order are sorted on the device too.
    shuffled = col.clone()
    for i in range(300):
        a, b = int(crow[i]), int(crow[i + 1])
        shuffled[a:b] = col[a:b].flip(0)
    same_graph(spattn.Graph(crow.cuda(), shuffled.cuda()), host)
    with pytest.raises(ValueError, match="crow"):
        spattn.Graph(torch.tensor([0, 2, 1], device="cuda"), torch.tensor([0, 1], device="cuda"))
    with pytest.raises(ValueError, match="repeat"):
        spattn.Graph(torch.tensor([0, 2], device="cuda"), torch.tensor([0, 0], device="cuda"))


def test_bad_ids_are_errors_naming_the_edge():
    for src, dst, first in [([0, 1, -3, 2], [1, 2, 0, 9], 2), ([0, 1, 2], [1, 4, 0], 1)]:
        ei = torch.tensor([src, dst], device="cuda")
        with pytest.raises(ValueError, match=rf"edge_index.*edge {first} "):
            spattn.Graph.from_edge_index(ei, num_nodes=4)
        with pytest.raises(ValueError, match=rf"edge {first} "):
            spattn.Graph.from_edge_index(ei.int(), num_nodes=4, symmetrize=True, self_loops=True)
    with pytest.raises(TypeError, match="edge_index"):
        spattn.Graph.from_edge_index(torch.zeros(2, 3, device="cuda"), num_nodes=4)
    with pytest.raises(ValueError, match="shape"):
        spattn.Graph.from_edge_index(torch.zeros(3, 3, dtype=torch.long, device="cuda"))
    # The device is still usable after the errors.
    g = spattn.Graph.from_edge_index(torch.tensor([[0], [1]], device="cuda"), num_nodes=2)
    assert g.num_edges == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_on_device_graphs_equals_host_graphs(dtype):
    path = data_file("cora.mtx.gz")
    if path is None:
        pytest.skip("cora.mtx.gz not found")
    g_host = spattn.Graph.read_matrix_market(path, symmetrize=True, self_loops=True)
    g_host.policy = "once"  # the same row order as the device graph's
    g_dev = spattn.Graph.from_edge_index(g_host.edge_index(device="cuda"), num_nodes=g_host.num_nodes)
    g_dev.policy = "once"  # kept when seen again
    same_graph(g_dev, g_host)
    torch.manual_seed(0)
    n = g_host.num_nodes
    for heads, dim in [(8, 64), (1, 128), (2, 24)]:
        q, k, v = (torch.randn(n, heads, dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        for algorithm in ["auto", "fused-csr", "fused-tc", "unfused-csr"]:
            outs, grads = [], []
            for g in (g_dev, g_host):
                out = spattn.sparse_attention(g, q, k, v, algorithm=algorithm)
                dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
                outs.append(out)
                grads.append((dq, dk, dv))
            if algorithm in ("fused-csr", "fused-tc", "auto"):
                assert torch.equal(outs[0], outs[1]), (algorithm, heads, dim)
            else:
                torch.testing.assert_close(outs[0], outs[1])
            for a, b in zip(grads[0], grads[1]):
                torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)


def test_policy_and_the_layers_graph_cache():
    g = spattn.Graph.from_edge_index(random_edges(200, 1000, seed=9).cuda(), num_nodes=200)
    assert g.policy == "once"
    assert spattn.Graph.from_edge_index(random_edges(200, 1000, seed=9), num_nodes=200).policy == "reuse"
    with pytest.raises(ValueError, match="policy"):
        g.policy = "often"
    g.policy = "reuse"
    assert g.policy == "reuse"
    # A layer's graph of a CUDA edge_index: built on the device, "once"; the same tensor seen
    # after a backward (full-graph training) becomes "reuse" at its next attention forward.
    ei = random_edges(300, 3000, seed=11).cuda()
    conv = spattn.nn.TransformerConv(16, 8, heads=2).cuda()
    x = torch.randn(300, 16, device="cuda")
    first = conv(x, ei)
    first.sum().backward()
    graph = spattn.nn.graph_for(ei, 300)
    assert graph.built_on_device and graph.policy == "once"
    second = conv(x, ei)
    assert graph.policy == "reuse"
    torch.testing.assert_close(second, first, rtol=1e-4, atol=1e-5)
    other = random_edges(300, 3000, seed=12).cuda()
    conv(x, other).sum().backward()
    assert spattn.nn.graph_for(other, 300).policy == "once"


def test_gat_switches_a_graph_seen_again_and_walks_its_row_order_in_the_same_bits():
    # A grid with scrambled ids: its locality order (RCM) brings neighbours together again, so
    # the "reuse" plan walks GAT's units in an order other than the ids'.
    side = 60
    node = torch.randperm(side * side, generator=torch.Generator().manual_seed(5))
    pairs = [(r * side + c, r * side + c + 1) for r in range(side) for c in range(side - 1)]
    pairs += [(r * side + c, (r + 1) * side + c) for r in range(side - 1) for c in range(side)]
    ei = node[torch.tensor(pairs).t()]
    ei = torch.cat([ei, ei.flip(0)], dim=1).cuda()
    torch.manual_seed(3)
    conv = spattn.nn.GATConv(16, 8, heads=8).cuda()  # the row-statistics kernels
    x = torch.randn(side * side, 16, device="cuda", requires_grad=True)
    outs, grads = [], []
    for _ in range(2):
        out = conv(x, ei)
        (gx,) = torch.autograd.grad(out.square().sum(), (x,))
        outs.append(out.detach())
        grads.append(gx)
        if len(outs) == 1:
            assert spattn.nn.graph_for(ei, side * side, self_loops=True).policy == "once"
    assert spattn.nn.graph_for(ei, side * side, self_loops=True).policy == "reuse"
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0], grads[1])


def test_a_graph_seen_again_switches_to_reuse_unless_its_policy_is_fixed():
    ei = random_edges(500, 6000, seed=13).cuda()
    q = torch.randn(500, 2, 16, device="cuda", dtype=torch.float16, requires_grad=True)
    kept = spattn.Graph.from_edge_index(ei, num_nodes=500)
    kept.policy = "once"  # set by the caller: kept
    seen = spattn.Graph.from_edge_index(ei, num_nodes=500)
    outs = {}
    for name, g in (("kept", kept), ("seen", seen)):
        out = spattn.sparse_attention(g, q, q, q)
        out.float().sum().backward()
        assert g.policy == "once"  # no forward since its backward yet
        with torch.no_grad():
            again = spattn.sparse_attention(g, q, q, q)
        outs[name] = (out.detach(), again)
    assert kept.policy == "once"
    assert seen.policy == "reuse"
    for out, again in outs.values():
        torch.testing.assert_close(again, out, rtol=5e-3, atol=5e-3)
    # A forward under CUDA-graph capture fixes the policy: the captured work keeps its plans.
    captured = spattn.Graph.from_edge_index(ei, num_nodes=500)
    with torch.no_grad():
        spattn.sparse_attention(captured, q, q, q)  # plans built outside the capture
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            replayed = spattn.sparse_attention(captured, q, q, q)
    spattn.sparse_attention(captured, q, q, q).float().sum().backward()
    with torch.no_grad():
        eager = spattn.sparse_attention(captured, q, q, q)
    assert captured.policy == "once"
    cuda_graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
    # A backward captured alone fixes it too: its replays read the plans.
    from spattn import functional as F
    bw = spattn.Graph.from_edge_index(ei, num_nodes=500)
    x = q.detach()
    out = F.attention_forward(bw, x, x, x, None, "auto")
    d_out = torch.randn_like(out)
    want = F.attention_backward(bw, x, x, x, out, d_out, None, "auto")  # plans built outside
    grads = tuple(torch.empty_like(x) for _ in range(3))
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        F.attention_backward(bw, x, x, x, out, d_out, None, "auto", outs=grads)
    F.attention_forward(bw, x, x, x, None, "auto")  # after a backward: would switch
    assert bw.policy == "once"
    cuda_graph.replay()
    torch.cuda.synchronize()
    for got, expected in zip(grads, want):
        assert torch.equal(got, expected)


def test_a_backward_from_kept_statistics_reads_them_through_the_rebuilt_plans():
    # A forward under "once" keeps its row statistics (fused-tc past 2²⁰ edges, 64 features:
    # the tensor-core backward reads them); the graph is then seen again and its plans rebuilt
    # under "reuse" (which may reorder the rows: clusters of 64 nodes scattered over the ids);
    # the first forward's backward still reads its statistics, kept per caller row, through the
    # new plans (which keep statistics too, so the backward takes them).
    from spattn import functional as F

    gen = torch.Generator().manual_seed(15)
    n, size = 20480, 64
    dst = torch.arange(n).repeat_interleave(size)
    src = (dst // size) * size + torch.arange(size).repeat(n)
    perm = torch.randperm(n, generator=gen)
    ei = torch.stack([perm[src], perm[dst]]).cuda()
    g = spattn.Graph.from_edge_index(ei, num_nodes=n)
    assert g.num_edges == n * size > 2**20 and g.policy == "once"
    q, k, v, d_out = (torch.randn(n, 2, 64, generator=gen).half().cuda() for _ in range(4))
    out, lse = F.attention_forward_keeping(g, q, k, v, None, "auto")
    assert lse is not None  # the statistics were kept
    F.attention_backward(g, q, k, v, out, d_out, None, "auto", lse=lse)
    F.attention_forward(g, q, k, v, None, "auto")  # seen again: the plans are rebuilt
    assert g.policy == "reuse"
    assert F.attention_forward_keeping(g, q, k, v, None, "auto")[1] is not None
    got = F.attention_backward(g, q, k, v, out, d_out, None, "auto", lse=lse)
    ref = spattn.Graph.from_edge_index(ei, num_nodes=n)
    ref.policy = "reuse"
    want = F.attention_backward(ref, q, k, v, out, d_out, None, "auto")  # its statistics pass
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, (name, err)


def test_a_forward_recomputed_in_a_backward_pass_is_not_a_new_step():
    from torch.utils.checkpoint import checkpoint

    g = spattn.Graph.from_edge_index(random_edges(500, 6000, seed=14).cuda(), num_nodes=500)
    q = torch.randn(500, 2, 16, device="cuda", dtype=torch.float16, requires_grad=True)

    def layer(x):
        return spattn.sparse_attention(g, x, x, x)

    # The first layer's forward runs again after the second's backward (checkpointing).
    layer(checkpoint(layer, q, use_reentrant=False)).float().sum().backward()
    assert g._core.backward_calls == 2
    assert g.policy == "once"
    layer(q)
    assert g.policy == "reuse"
