"""PyG 2.8's GATConv, TransformerConv and AGNNConv written out in plain torch over an
edge list (message j -> i for every column j of edge_index[0], target i of edge_index[1]):
the references of the CPU tests where torch_geometric is not installed. They read the
parameters of a spattn.nn layer (which has PyG's names and shapes)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def remove_then_add_self_loops(edge_index, n):
    keep = edge_index[0] != edge_index[1]
    loops = torch.arange(n, device=edge_index.device)
    return torch.cat([edge_index[:, keep], torch.stack([loops, loops])], dim=1)


def edge_softmax(scores, dst, n):
    """Softmax of per-edge scores (E × H) over each target's incoming edges; a target whose
    scores are all -inf (masked) gets zeros, one with a NaN score NaN (the kernels' rule)."""
    h = scores.shape[1]
    m = torch.full((n, h), float("-inf"), dtype=scores.dtype, device=scores.device)
    m = m.scatter_reduce(0, dst[:, None].expand(-1, h), scores, reduce="amax", include_self=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = (scores - m[dst]).exp()
    z = torch.zeros((n, h), dtype=scores.dtype, device=scores.device).index_add(0, dst, e)[dst]
    return torch.where(z != 0, e / torch.where(z != 0, z, torch.ones_like(z)), torch.zeros_like(e))


def aggregate(alpha, x_src, src, dst, n):
    """out[i] = Σ_{edges j -> i} alpha · x[j] (alpha E × H, x N × H × C)."""
    msg = alpha.unsqueeze(-1) * x_src[src]
    out = torch.zeros((n,) + tuple(x_src.shape[1:]), dtype=x_src.dtype, device=x_src.device)
    return out.index_add(0, dst, msg)


def gat(layer, x, edge_index):
    n = x.shape[0]
    H, C = layer.heads, layer.out_channels
    if layer.add_self_loops:
        edge_index = remove_then_add_self_loops(edge_index, n)
    src, dst = edge_index[0], edge_index[1]
    h = F.linear(x, layer.lin.weight).view(-1, H, C)
    a_src = (h * layer.att_src).sum(-1)
    a_dst = (h * layer.att_dst).sum(-1)
    alpha = F.leaky_relu(a_src[src] + a_dst[dst], layer.negative_slope)
    alpha = edge_softmax(alpha, dst, n)
    out = aggregate(alpha, h, src, dst, n)
    out = out.reshape(-1, H * C) if layer.concat else out.mean(dim=1)
    if layer.res is not None:
        out = out + F.linear(x, layer.res.weight)
    if layer.bias is not None:
        out = out + layer.bias
    return out


def transformer(layer, x, edge_index):
    n = x.shape[0]
    H, C = layer.heads, layer.out_channels
    src, dst = edge_index[0], edge_index[1]
    q = layer.lin_query(x).view(-1, H, C)
    k = layer.lin_key(x).view(-1, H, C)
    v = layer.lin_value(x).view(-1, H, C)
    alpha = (q[dst] * k[src]).sum(-1) / math.sqrt(C)
    alpha = edge_softmax(alpha, dst, n)
    out = aggregate(alpha, v, src, dst, n)
    out = out.reshape(-1, H * C) if layer.concat else out.mean(dim=1)
    if layer.root_weight:
        x_r = layer.lin_skip(x)
        if layer.lin_beta is not None:
            b = layer.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
            out = b * x_r + (1 - b) * out
        else:
            out = out + x_r
    return out


def agnn(layer, x, edge_index):
    n = x.shape[0]
    if layer.add_self_loops:
        edge_index = remove_then_add_self_loops(edge_index, n)
    src, dst = edge_index[0], edge_index[1]
    xn = F.normalize(x, p=2.0, dim=-1)
    alpha = (layer.beta * (xn[dst] * xn[src]).sum(-1)).unsqueeze(-1)
    alpha = edge_softmax(alpha, dst, n)
    return aggregate(alpha, x.unsqueeze(1), src, dst, n).squeeze(1)
