"""PyG's graph types in every layer (CPU here, and a GPU where there is one): ``EdgeIndex``
(sorted or not), ``torch.sparse`` CSR / CSC / COO adjacencies and ``torch_sparse.SparseTensor``
in PyG's ``adj_t`` convention, a ``Batch`` from PyG's ``DataLoader`` and a ``NeighborLoader``
batch (where PyG's sampler has its packages): the same outputs and gradients as the ``(2, E)``
``edge_index``, and for the loaders as PyG's own layers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pyg = pytest.importorskip("torch_geometric")

import spattn  # noqa: E402
import spattn.nn as snn  # noqa: E402

DEVICES = ["cpu"] + (
    ["cuda"] if torch.cuda.is_available() and spattn.cuda_device_count() > 0 else []
)
LAYERS = {
    "gat": lambda m: m.GATConv(8, 4, heads=2),
    "transformer": lambda m: m.TransformerConv(8, 4, heads=2),
    "agnn": lambda m: m.AGNNConv(),
}


def edges(n, e, seed, device):
    g = torch.Generator().manual_seed(seed)
    ei = torch.unique(torch.randint(0, n, (2, e), generator=g), dim=1)
    return ei[:, torch.randperm(ei.shape[1], generator=g)].to(device)


def run(layer, x, graph):
    xa = x.clone().requires_grad_()
    out = layer(xa, graph)
    out.square().sum().backward()
    return out.detach(), xa.grad


def adjacencies(ei, n):
    """The same graph in PyG's other forms (adj_t: row i lists the sources of edges into i)."""
    from torch_geometric import EdgeIndex

    forms = {
        "EdgeIndex": EdgeIndex(ei, sparse_size=(n, n)),
        "EdgeIndex-sorted": EdgeIndex(ei, sparse_size=(n, n)).sort_by("col").values,
    }
    adj_t = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.shape[1], device=ei.device), (n, n))
    forms["sparse-coo"] = adj_t
    forms["sparse-csr"] = adj_t.to_sparse_csr()
    forms["sparse-csc"] = adj_t.to_sparse_csc()
    try:
        from torch_sparse import SparseTensor

        forms["SparseTensor"] = SparseTensor(row=ei[1], col=ei[0], sparse_sizes=(n, n))
    except ImportError:
        pass
    return forms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_graph_types_match_edge_index(kind, device):
    torch.manual_seed(0)
    n = 50
    ei = edges(n, 300, 1, device)
    layer = LAYERS[kind](snn).to(device)
    x = torch.randn(n, 8, device=device)
    want = run(layer, x, ei)
    for name, form in adjacencies(ei, n).items():
        layer.zero_grad()
        got = run(layer, x, form)
        torch.testing.assert_close(got[0], want[0], msg=f"{name}: out")
        torch.testing.assert_close(got[1], want[1], msg=f"{name}: dx")
        assert snn.graph_for(form, n) is snn.graph_for(form, n), f"{name}: not cached"


def test_edge_attr_with_an_adjacency_is_refused():
    ei = edges(20, 60, 2, "cpu")
    adj_t = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.shape[1]), (20, 20))
    for layer in (snn.TransformerConv(8, 4, edge_dim=3), snn.GATConv(8, 4, edge_dim=3),
                  snn.GATv2Conv(8, 4, edge_dim=3)):
        for attr in (torch.randn(ei.shape[1], 3), torch.randn(ei.shape[1], 3, requires_grad=True)):
            with pytest.raises(NotImplementedError, match="edge_attr with a sparse adjacency"):
                layer(torch.randn(20, 8), adj_t, attr)


def molecule_dataset(count, seed):
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(6, 15, (1,), generator=g))
        chain = torch.arange(n - 1)
        ei = torch.stack([chain, chain + 1])
        ei = torch.cat([ei, ei.flip(0)], dim=1)
        out.append(Data(x=torch.randn(n, 8, generator=g), edge_index=ei,
                        edge_attr=torch.randn(ei.shape[1], 3, generator=g)))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_dataloader_batches_match_pyg(device):
    import torch_geometric.nn as pyg_nn
    from torch_geometric.loader import DataLoader

    torch.manual_seed(3)
    theirs = pyg_nn.GATConv(8, 4, heads=2, edge_dim=3).to(device)
    ours = snn.GATConv(8, 4, heads=2, edge_dim=3).to(device)
    ours.load_state_dict(theirs.state_dict())
    for batch in DataLoader(molecule_dataset(12, 4), batch_size=5):
        batch = batch.to(device)
        want = theirs(batch.x, batch.edge_index, batch.edge_attr)
        got = ours(batch.x, batch.edge_index, batch.edge_attr)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_neighbor_loader_batches_match_pyg(device):
    import torch_geometric.nn as pyg_nn
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    n = 200
    ei = edges(n, 1200, 5, "cpu")
    data = Data(x=torch.randn(n, 8), edge_index=ei)
    try:
        loader = NeighborLoader(data, num_neighbors=[5, 3], batch_size=16)
        batches = [b for _, b in zip(range(3), loader)]
    except ImportError as e:  # PyG's sampler needs pyg-lib or torch-sparse
        pytest.skip(f"NeighborLoader needs a sampler package here: {e}")
    torch.manual_seed(6)
    theirs = pyg_nn.TransformerConv(8, 4, heads=2).to(device)
    ours = snn.TransformerConv(8, 4, heads=2).to(device)
    ours.load_state_dict(theirs.state_dict())
    for b in batches:
        b = b.to(device)
        torch.testing.assert_close(ours(b.x, b.edge_index), theirs(b.x, b.edge_index),
                                   rtol=1e-4, atol=1e-5)
