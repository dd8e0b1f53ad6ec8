"""GATv2 (``spattn.gatv2_attention``, ``spattn.nn.GATv2Conv``): against PyG's GATv2Conv on the CPU
(and a GPU where there is one: spattn's kernels), the closed-form backward the kernels compute
against torch's autograd, dropout's seed, and bad arguments."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import spattn  # noqa: E402
import spattn.nn as snn  # noqa: E402
from spattn import functional as F  # noqa: E402

DEVICES = ["cpu"] + (
    ["cuda"] if torch.cuda.is_available() and spattn.cuda_device_count() > 0 else []
)
OPTIONS = [
    {},
    {"edge_dim": 3},
    {"share_weights": True, "concat": False, "residual": True},
    {"edge_dim": 2, "fill_value": 0.5, "negative_slope": 0.1},
    {"add_self_loops": False, "bias": False},
]


def edges(n, e, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ei = torch.unique(torch.randint(0, n, (2, e), generator=g), dim=1)
    return ei[:, torch.randperm(ei.shape[1], generator=g)].to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_layer_matches_pyg(options, device):
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    n = 60
    ei = edges(n, 400, 1, device)  # some self loops, which add_self_loops replaces
    theirs = pyg_nn.GATv2Conv(12, 5, heads=3, **options).to(device)
    ours = snn.GATv2Conv(12, 5, heads=3, **options).to(device)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(n, 12, device=device)
    attr = torch.randn(ei.shape[1], options["edge_dim"], device=device) if "edge_dim" in options else None
    args = (ei,) + ((attr,) if attr is not None else ())
    outs, grads = [], []
    for layer in (theirs, ours):
        xa = x.clone().requires_grad_()
        out = layer(xa, *args)
        params = list(layer.parameters())
        grads.append(torch.autograd.grad(out.square().sum(), [xa] + params))
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_closed_form_backward_matches_autograd():
    torch.manual_seed(1)
    g = spattn.Graph.from_edge_index(edges(30, 150, 2), num_nodes=30, self_loops=True)
    h, c = 2, 4
    xl = torch.randn(30, h, c, dtype=torch.float64, requires_grad=True)
    xr = torch.randn(30, h, c, dtype=torch.float64, requires_grad=True)
    att = torch.randn(h * c, dtype=torch.float64, requires_grad=True)
    ef = torch.randn(g.num_edges, h, c, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn(30, h, c, dtype=torch.float64)
    # x_r = -x_l puts z exactly at 0 on the self loops: LeakyReLU' there is 1 in both.
    at_zero = (-xl.detach()).requires_grad_()
    out = F.gatv2_reference(g, xl, at_zero, att, None, 0.2, None)
    want = torch.autograd.grad(out, (xl, at_zero, att), d_out)
    got = F.gatv2_reference_backward(g, xl, at_zero, att, None, d_out, 0.2, None)
    for name, a, b in zip(("xl", "xr", "att"), got, want):
        torch.testing.assert_close(a, b, msg=f"d{name} at z = 0")
    for drop in (None, (0.3, 11, 0)):
        out = F.gatv2_reference(g, xl, xr, att, ef, 0.2, drop)
        want = torch.autograd.grad(out, (xl, xr, att, ef), d_out)
        got = F.gatv2_reference_backward(g, xl, xr, att, ef, d_out, 0.2, drop)
        for name, a, b in zip(("xl", "xr", "att", "ef"), got, want):
            torch.testing.assert_close(a, b, msg=f"d{name} (dropout {drop})")


@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_without_edges_gives_zeros(device):
    # The CPU path lists the edges through Graph.edge_index, which once refused an empty graph.
    g = spattn.Graph.from_edge_index(torch.zeros(2, 0, dtype=torch.long, device=device),
                                     num_nodes=5)
    assert g.edge_index().shape == (2, 0) and g.edge_index(device).device.type == device
    xl = torch.randn(5, 2, 3, device=device, requires_grad=True)
    ef = torch.randn(0, 2, 3, device=device, requires_grad=True)
    out = spattn.gatv2_attention(g, xl, xl, torch.randn(2, 3, device=device), edge_features=ef)
    assert torch.equal(out, torch.zeros_like(out))
    out.backward(torch.ones_like(out))
    assert torch.equal(xl.grad, torch.zeros_like(xl))


@pytest.mark.parametrize("device", DEVICES)
def test_functional_dropout_and_errors(device):
    g = spattn.Graph.from_edge_index(edges(20, 80, 3, device), num_nodes=20, self_loops=True)
    xl, xr = torch.randn(20, 2, 8, device=device), torch.randn(20, 2, 8, device=device)
    att = torch.randn(2, 8, device=device)
    a = spattn.gatv2_attention(g, xl, xr, att, dropout=0.5, dropout_seed=3)
    b = spattn.gatv2_attention(g, xl, xr, att, dropout=0.5, dropout_seed=3)
    c = spattn.gatv2_attention(g, xl, xr, att, dropout=0.5, dropout_seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="x_r: has shape"):
        spattn.gatv2_attention(g, xl, xr[:, :1], att)
    with pytest.raises(ValueError, match="att: expected 2 x 8"):
        spattn.gatv2_attention(g, xl, xr, att[:1])
    with pytest.raises(ValueError, match="x_l: has 19 rows"):
        spattn.gatv2_attention(g, xl[:19], xr, att)
    with pytest.raises(ValueError, match="edge_features: has shape"):
        spattn.gatv2_attention(g, xl, xr, att, edge_features=torch.randn(3, 2, 8, device=device))
