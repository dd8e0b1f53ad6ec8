#!/usr/bin/env python3
"""ECMWF Anemoi's Triton graph-transformer attention against spattn, on the same graph and the
same inputs: forward and forward + backward, with and without edge features, timed on the same
GPU in the same run and both checked against one f64 reference (helpers, tolerances and timing
from torch_peers.py, which this imports; see its docstring).

What Anemoi computes (anemoi-models 0.19.0, anemoi/models/triton/gt.py,
graph_transformer_attention_conv(q, k, v, e, (row, colptr), (rowptr, edge_ids, edge_dst))):
messages flow src -> dst; the query is the destination's (the GraphTransformer blocks take
q = lin_query(x_dst), k = lin_key(x_src), v = lin_value(x_src), e = lin_edge(edge_attr), all
[nodes or edges, heads, head_dim]); per destination i and head h, over its incoming edges
(j -> i, edge id m)

    s_m   = (q_i . (k_j + e_m)) / sqrt(head_dim)
    out_i = sum_m softmax_i(s)_m (v_j + e_m)            (0 for a node without incoming edges)

one Triton program per destination (online softmax, f32 accumulation; the output is written in
f32 and cast to q's dtype), and a backward of two passes (per destination: dq; per source: dk,
dv and de = the edge's dk + dv contributions), in the dtype of the incoming gradient. The graph
is CSC by destination: row = the edges' sources in destination order, colptr the destinations'
offsets; for the backward rowptr (offsets of the sources), edge_ids (the CSC edge ids grouped by
source) and edge_dst (the destination of each CSC edge). e is indexed by CSC edge id and is not
optional. The arguments come from anemoi.models.triton.utils.edge_index_to_csc(edge_index,
num_nodes=(n_src, n_dst), reverse=True, edges_are_dst_sorted=True), as the layer builds them
(GraphTransformerBaseBlock.apply_gt; where that module does not import, torch_geometric or
anemoi's distributed helpers missing, a transcription of it in torch ops: see `variant`).

Same function in spattn: spattn.sparse_attention(graph, q, k, v, scale=1/sqrt(head_dim),
edge_features=e): row i of a spattn.Graph lists the nodes i attends to (the sources of the
edges j -> i), edge features are added to each edge's key and value, the softmax runs over a
row. One graph file, read once (torch_peers.read_graph; --symmetrize gives A + A^T + I to
both), gives both libraries their graph: spattn.Graph(crow, col) of the CSR, and Anemoi the
edge_index (src = col, dst = row) in CSR order, which is already sorted by destination, so
Anemoi's CSC order is the CSR order and its edge ids are the CSR positions (checked: its row
and colptr must equal the CSR's col and crow). spattn's edge order (Graph.edge_index, that of
edge_features) is mapped to the CSR order by Graph.edge_positions, outside the timed region
(the identity for a CSR with sorted columns: the variant says which). So both get the very same
e, in the same order, and every de is compared in that order.

Inputs: Q, K, V as torch_peers.Case draws them (f32 normals rounded to the asked dtype, the
same values as torch_peers.py's for a seed), then dout and, with edge features, e (num_edges x
heads x head_dim), from the same generator. Without edge features spattn gets no
edge_features and Anemoi, whose op needs an e, a zero e (so it still reads e and computes a de
that is thrown away: that is what its API costs).

Timed (CUDA events, median of --repeat calls after --warmup, torch_peers.time_ms), each library
in its fastest user-facing form for a fixed graph, the graph built once outside the timing:
  fwd       the forward under torch.no_grad() (inference), q, k, v, e not requiring grad;
  fwd_bwd   out = attention(q, k, v, e) on leaves requiring grad, then
            torch.autograd.grad(out, [q, k, v] (+ [e]), dout): the backward of sum(out * dout).
spattn's graph: spattn.Graph(crow, col) from the host CSR (--spattn-graph host, its default
"reuse" row-order policy) or from CUDA tensors (device), then Graph.plan(heads, head_dim,
dtype, scale, extras/edge_features as the call) for this configuration; --spattn-algorithm
(auto). Anemoi's: edge_index_to_csc once per graph. Apart from the medians, every record holds
graph_build_ms (spattn: the Graph's construction; Anemoi: edge_index_to_csc, wall clock,
synchronised, median of --prep-reps), plan_ms (spattn's Graph.plan; none for Anemoi) and
first_call_ms (the first call of that mode in that configuration, wall clock, synchronised:
Triton compiles Anemoi's kernels once a process for each heads, head_dim and dtype, so in the
first graph's cases only; spattn's uploads and lazy plans). Note: Anemoi's GraphTransformer block runs
edge_index_to_csc inside every forward; --anemoi-rebuild times that form (the build inside the
timed call) instead of the cached one.

Accuracy: rel_err_X = ||X - X_ref||_2 / ||X_ref||_2 for X in out, dq, dk, dv, de (de only with
edge features), X_ref in f64 from the same rounded inputs on the GPU: per head and in chunks of
destination rows, gathers and scatters (segment max, exp, segment sums; the backward by its
closed form: dp = dout_i . (v_j + e_m), ds = p (dp - dout_i . out_i), dq_i = sum ds (k_j +
e_m) scale, dk_j = sum ds q_i scale, dv_j = sum p dout_i, de_m = ds q_i scale + p dout_i).
rel_err is the largest of the mode's (fwd: out; fwd_bwd: out and the gradients). tolerance:
torch_peers.TOLERANCE (f32 1e-5, bf16 2e-2, f16 5e-3, by the asked dtype).

Records (a JSON list, rewritten after every configuration), one per (graph, heads, head_dim,
dtype, edge_features, impl, mode):
  graph, n, n_cols, nnz, symmetrized, heads, head_dim, dtype, edge_features ("on" | "off"),
  impl ("anemoi" | "spattn"), mode ("fwd" | "fwd_bwd")
  status      "ok" | "wrong" (ran, but an error is over the tolerance or not finite) |
              "unsupported" (cannot run this case: a module missing, no CUDA, a rectangular graph
              for spattn, a memory estimate made before trying) | "oom" | "error" (an exception)
  median_ms   median time in ms (null unless it ran)
  rel_err, rel_err_out, rel_err_dq, rel_err_dk, rel_err_dv, rel_err_de (null where not
              computed or not finite), tolerance, ok (rel_err <= tolerance; null if it did not run)
  reason      one line: why it did not run or is wrong (null when "ok")
  variant, note, graph_build_ms, plan_ms, first_call_ms, timing
  gpu, torch, cuda, triton, anemoi (anemoi-models' version), spattn (its version), warmup,
  reps, time_budget_ms (see torch_peers.py), seed

A compact table (both libraries' medians, anemoi/spattn ratios, errors) is printed at the end.

  pip install --no-deps anemoi_models-0.19.0-py3-none-any.whl   # it pins torch<2.11
  python3 crates/bench/peers/anemoi_peer.py .gpu3/data/cora.mtx.gz .gpu3/data/pubmed.mtx.gz \\
      .gpu3/data/ogbn-arxiv.mtx.gz --symmetrize --heads 1 8 --head-dim 32 64 \\
      --dtype f16 bf16 f32 --edge-features on off --warmup 3 --repeat 20 --json anemoi.json

Importing anemoi.models.triton.gt runs only anemoi/models/__init__.py (which reads its
_version.py) besides torch and triton; --anemoi-path puts a folder (the unpacked wheel) first on
sys.path instead of installing it, or unpacks a .whl into a temporary folder and puts that
(`anemoi` is a namespace package, which Python's zip import does not find inside a .whl).
--device cpu is a smoke test of this script (times mean nothing): spattn runs its CPU reference, and Anemoi's Triton kernels run
only under TRITON_INTERPRET=1 (Triton's interpreter; the ops are then registered for the CPU
with their own bodies), else its records say "unsupported".
"""
import argparse
import math
import os
import sys
import tempfile
import time
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peers as tp  # noqa: E402

IMPLS = ("anemoi", "spattn")
MODES = ("fwd", "fwd_bwd")
FIELDS = ("out", "dq", "dk", "dv", "de")


def import_folder(path):
    """The folder to put on sys.path for --anemoi-path: the folder itself, or a .whl unpacked
    into a new temporary folder (zip import finds no namespace package such as `anemoi`)."""
    path = os.path.abspath(path)
    if os.path.isfile(path) and zipfile.is_zipfile(path):
        folder = tempfile.mkdtemp(prefix="anemoi-wheel-")
        with zipfile.ZipFile(path) as whl:
            whl.extractall(folder)
        return folder
    return path


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def wall_ms(device, fn, reps=1):
    """Median wall-clock ms of fn() (synchronised before and after), and its last result."""
    times, res = [], None
    for _ in range(max(1, reps)):
        tp.synchronize(device)
        t = time.perf_counter()
        res = fn()
        tp.synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    return median(times), res


def status_of(err):
    """(status, reason) of an exception, as torch_peers.attempt classifies them."""
    if isinstance(err, tp.Unsupported):
        return "unsupported", str(err)
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return "oom", tp.one_line(err)
    if os.environ.get("SPATTN_PEERS_TRACEBACK"):
        import traceback
        traceback.print_exception(type(err), err, err.__traceback__)
    return "error", tp.one_line(err)


# --------------------------------------------------------------------------------------------
# Anemoi
# --------------------------------------------------------------------------------------------


def index2ptr(index, size):
    """torch_geometric.utils.sparse.index2ptr: offsets of a sorted index."""
    try:
        return torch._convert_indices_from_coo_to_csr(index, size, out_int32=index.dtype == torch.int32)
    except (AttributeError, RuntimeError, NotImplementedError):
        counts = torch.bincount(index, minlength=size)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(index.dtype)


def edge_index_to_csc_transcribed(edge_index, num_nodes=None, reverse=True, edges_are_dst_sorted=False):
    """anemoi.models.triton.utils.edge_index_to_csc (0.19.0) in torch ops, for where that module
    does not import (it needs torch_geometric and anemoi's distributed helpers): the same steps
    (sort_edge_index_by_dst is torch_geometric's stable index_sort of the destinations)."""
    perm = None
    if not edges_are_dst_sorted:
        _, perm = torch.sort(edge_index[1], stable=True)
        edge_index = edge_index[:, perm]
    row, col = edge_index
    if num_nodes is None:
        num_nodes = (int(row.max()) + 1, int(col.max()) + 1)
    colptr = index2ptr(col, num_nodes[1])
    if reverse:
        row_sorted, _ = torch.sort(row)
        rowptr = index2ptr(row_sorted, num_nodes[0])
        edge_id_per_src = torch.argsort(row, stable=True)
        edge_dst = col
        return (row, colptr), perm, (rowptr, edge_id_per_src, edge_dst)
    return (row, colptr), perm


class Anemoi:
    """anemoi.models.triton.gt and the layer's graph arguments; `error` holds why it cannot run."""

    def __init__(self, args):
        self.error, self.version, self.triton = None, None, None
        self.csc_source = None
        if args.anemoi_path:
            sys.path.insert(0, import_folder(args.anemoi_path))
        try:
            import triton
            self.triton = triton.__version__
        except ImportError as err:
            self.error = tp.Unsupported(f"triton does not import: {tp.one_line(err)}")
            return
        try:
            import anemoi.models
            from anemoi.models.triton import gt
        except Exception as err:  # noqa: BLE001 - ImportError, or gt.py's ValueError without triton
            self.error = tp.Unsupported(f"anemoi.models.triton.gt does not import: {tp.one_line(err)}")
            return
        self.gt = gt
        self.version = getattr(anemoi.models, "__version__", None)
        try:
            from anemoi.models.triton.utils import edge_index_to_csc
            self.edge_index_to_csc = edge_index_to_csc
            self.csc_source = "anemoi.models.triton.utils.edge_index_to_csc"
        except Exception as err:  # noqa: BLE001 - torch_geometric or anemoi's helpers missing
            self.edge_index_to_csc = edge_index_to_csc_transcribed
            self.csc_source = f"edge_index_to_csc transcribed (anemoi's: {tp.one_line(err, 80)})"
        if not tp.is_cuda(args.device):
            if os.environ.get("TRITON_INTERPRET") != "1":
                self.error = tp.Unsupported("Triton needs CUDA (on the CPU only under TRITON_INTERPRET=1)")
                return
            # Triton's interpreter runs the kernels on CPU tensors; the ops are registered for
            # CUDA only, so register their own bodies for the CPU too.
            for op in (gt.graph_transformer_attention, gt.graph_transformer_attention_backward):
                if "cpu" not in getattr(op, "_backend_fns", {}):
                    op.register_kernel("cpu")(op._init_fn)

    def build(self, g, edge_index):
        """The layer's graph arguments: ((row, colptr), perm, (rowptr, edge_ids, edge_dst))."""
        return self.edge_index_to_csc(edge_index, num_nodes=(g.n_cols, g.n), reverse=True,
                                      edges_are_dst_sorted=True)


class AnemoiGraph:
    """Anemoi's arguments for one graph, built once (timed), and the map of its edge ids (CSC
    order) to the CSR order of the reference."""

    def __init__(self, an, g, args):
        self.edge_index = torch.stack([g.col, g.row])  # (src, dst), CSR order: sorted by dst
        self.build_ms, (csc, perm, rev) = wall_ms(g.device, lambda: an.build(g, self.edge_index), args.prep_reps)
        self.csc, self.rev = csc, rev
        row, colptr = csc
        # The CSC edge m is the CSR edge perm[m] (perm None: the same order).
        if perm is not None and not torch.equal(perm, torch.arange(g.nnz, device=perm.device)):
            self.perm = perm
        else:
            self.perm = None
        src = g.col if self.perm is None else g.col[self.perm]
        if not (torch.equal(colptr.long(), g.crow) and torch.equal(row.long(), src)):
            raise RuntimeError("edge_index_to_csc's (row, colptr) is not the graph's CSR transposed")
        self.order = "CSC = CSR order" if self.perm is None else "CSC order permuted to CSR"

    def to_csc(self, x):
        return x if self.perm is None else x.index_select(0, self.perm)

    def to_csr(self, x):
        return x if self.perm is None else torch.empty_like(x).index_copy_(0, self.perm, x)


# --------------------------------------------------------------------------------------------
# spattn
# --------------------------------------------------------------------------------------------


class Spattn:
    def __init__(self, args):
        self.error, self.version = None, None
        try:
            import spattn
        except Exception as err:  # noqa: BLE001
            self.error = tp.Unsupported(f"spattn does not import: {tp.one_line(err)}")
            return
        self.mod = spattn
        self.version = getattr(spattn, "__version__", None)


class SpattnGraph:
    """spattn.Graph of the CSR, built once (timed), and the map of its edge order (that of
    edge_features) to the CSR order of the reference."""

    def __init__(self, sp, g, args):
        if g.n != g.n_cols:
            raise tp.Unsupported(f"rectangular graph ({g.n} x {g.n_cols}): spattn.Graph(crow, col) is square")
        Graph = sp.mod.Graph
        if args.spattn_graph == "device" and tp.is_cuda(g.device):
            build = lambda: Graph(g.crow, g.col)  # noqa: E731 - built on the GPU
            self.how = "Graph(crow, col) from CUDA tensors"
        else:
            build = lambda: Graph(g.offs, g.cols)  # noqa: E731 - the host CSR
            self.how = "Graph(crow, col) from the host CSR"
        # One build (a second would only be faster for caches spattn keeps per graph object).
        self.build_ms, self.graph = wall_ms(g.device, build, 1)
        sg = self.graph
        if sg.num_edges != g.nnz or sg.num_nodes != g.n:
            raise RuntimeError(f"spattn.Graph has {sg.num_nodes} nodes, {sg.num_edges} edges; "
                               f"the CSR {g.n}, {g.nnz}")
        # pos[m]: where the CSR edge m (col[m] -> row) sits in spattn's edge order.
        pos = sg.edge_positions(torch.stack([g.col, g.row]))
        self.pos = None if torch.equal(pos, torch.arange(g.nnz, device=pos.device)) else pos
        self.order = "edge order = CSR order" if self.pos is None else "edge order permuted (Graph.edge_positions)"

    def to_spattn(self, x):
        return x if self.pos is None else torch.empty_like(x).index_copy_(0, self.pos, x)

    def to_csr(self, x):
        return x if self.pos is None else x.index_select(0, self.pos)


# --------------------------------------------------------------------------------------------
# The runs of one case
# --------------------------------------------------------------------------------------------


def leaves(*ts):
    """Fresh leaves requiring grad (a plain .requires_grad_() would mark the case's tensors)."""
    return [t.detach().clone().requires_grad_() for t in ts]


def anemoi_fns(an, ag, case, e, dout, args):
    """(fwd, fwd_bwd, variant, note) for Anemoi: fwd() -> out; fwd_bwd() -> (out, grads in CSR
    order: dq, dk, dv, de or None)."""
    gt = an.gt
    on = e is not None
    ee = ag.to_csc(e) if on else torch.zeros(case.g.nnz, case.heads, case.d, dtype=case.dt, device=case.g.device)
    q, k, v = case.q, case.k, case.v
    if args.anemoi_rebuild:
        def graph_args():
            csc, _, rev = an.build(case.g, ag.edge_index)
            return csc, rev
    else:
        def graph_args():
            return ag.csc, ag.rev

    def fwd():
        with torch.no_grad():
            csc, rev = graph_args()
            return gt.graph_transformer_attention_conv(q, k, v, ee, csc, rev)

    lq, lk, lv = leaves(q, k, v)
    le = leaves(ee)[0] if on else ee
    inputs = [lq, lk, lv] + ([le] if on else [])

    def fwd_bwd():
        csc, rev = graph_args()
        out = gt.graph_transformer_attention_conv(lq, lk, lv, le, csc, rev)
        grads = torch.autograd.grad(out, inputs, dout)
        return out, grads

    unpack = unpacker(ag.to_csr, on)
    variant = ("graph_transformer_attention_conv, graph args "
               + ("rebuilt in every call (as the layer)" if args.anemoi_rebuild else "built once"))
    note = tp.join_notes(an.csc_source, ag.order,
                         "" if on else "zero e (its op needs one; dE is computed and dropped)")
    return fwd, fwd_bwd, unpack, variant, note


def unpacker(to_csr, on):
    """The (out, gradients) of a forward + backward call as the checks take them: de (with edge
    features) mapped to the CSR order by `to_csr`."""
    def unpack(res):
        out, grads = res
        de = to_csr(grads[3]) if on else None
        return out.detach(), dict(dq=grads[0], dk=grads[1], dv=grads[2], de=de)
    return unpack


def spattn_fns(sp, sg, case, e, dout, args):
    """(fwd, fwd_bwd, unpack, variant, note) for spattn, the plan built first (timed)."""
    spattn = sp.mod
    g = sg.graph
    on = e is not None
    es = sg.to_spattn(e) if on else None
    q, k, v = case.q, case.k, case.v
    alg = args.spattn_algorithm
    dev = case.g.device
    if tp.is_cuda(dev):
        plan_ms, plan = wall_ms(dev, lambda: g.plan(case.heads, case.d, dtype=case.dt, device=str(dev), algorithm=alg,
                                                    scale=case.scale, extras=on, edge_features=on))
    else:  # the CPU reference has no plan (and Graph.plan refuses f16 / bf16 there)
        plan_ms, plan = None, dict(algorithm="cpu", choice="CPU reference")

    def fwd():
        with torch.no_grad():
            return spattn.sparse_attention(g, q, k, v, scale=case.scale, edge_features=es, algorithm=alg)

    lq, lk, lv = leaves(q, k, v)
    le = leaves(es)[0] if on else None
    inputs = [lq, lk, lv] + ([le] if on else [])

    def fwd_bwd():
        out = spattn.sparse_attention(g, lq, lk, lv, scale=case.scale, edge_features=le, algorithm=alg)
        grads = torch.autograd.grad(out, inputs, dout)
        return out, grads

    unpack = unpacker(sg.to_csr, on)
    variant = f"sparse_attention(algorithm={alg}), {sg.how}, plan: {plan.get('algorithm')} ({plan.get('choice')})"
    return fwd, fwd_bwd, unpack, variant, sg.order, plan_ms


# --------------------------------------------------------------------------------------------
# The f64 reference, forward and backward, with the errors of every result
# --------------------------------------------------------------------------------------------


def reference_errors(g, q, k, v, e, dout, scale, targets, edge_bytes=2**29):
    """Relative L2 errors against f64 of the tensors in `targets` ({key: {field: tensor}} with
    fields out, dq (n x heads x d), dk, dv (n_cols x heads x d), de (nnz x heads x d, CSR order);
    a field absent or None is skipped). e may be None (no edge features). Computed per head and
    in chunks of destination rows on q's device; returns {key: {field: rel_err}} (NaN where
    a tensor has NaN/Inf)."""
    heads, d = q.shape[1], q.shape[2]
    dev = q.device
    acc = {key: {f: [0.0, 0.0] for f, t in fs.items() if t is not None} for key, fs in targets.items()}
    bad = {key: set() for key in targets}

    def add(key, field, got, ref):
        if field not in acc[key] or field in bad[key]:
            return
        x = got.to(dev).double()
        if not torch.isfinite(x).all():
            bad[key].add(field)
            return
        acc[key][field][0] += float(((x - ref) ** 2).sum())
        acc[key][field][1] += float((ref ** 2).sum())

    for h in range(heads):
        qh, kh, vh, doh = (x[:, h].double() for x in (q, k, v, dout))
        eh = e[:, h].double() if e is not None else None
        dk = torch.zeros_like(kh)
        dv = torch.zeros_like(vh)
        for r0, r1 in tp.row_chunks(g.offs, max(1024, edge_bytes // (8 * 8 * d))):
            e0, e1 = int(g.offs[r0]), int(g.offs[r1])
            rows, cols = g.row[e0:e1], g.col[e0:e1]
            local = rows - r0
            m_rows = r1 - r0
            ke, ve = kh[cols], vh[cols]
            if eh is not None:
                ke = ke + eh[e0:e1]
                ve = ve + eh[e0:e1]
            qi, doi = qh[rows], doh[rows]
            s = (qi * ke).sum(-1) * scale
            mx = torch.full((m_rows,), -math.inf, dtype=torch.float64, device=dev).scatter_reduce(0, local, s, "amax")
            p = torch.exp(s - mx[local])
            den = torch.zeros(m_rows, dtype=torch.float64, device=dev).index_add_(0, local, p)
            p = p / den[local]
            out = torch.zeros(m_rows, d, dtype=torch.float64, device=dev).index_add_(0, local, ve * p[:, None])
            dp = (doi * ve).sum(-1)
            dd = torch.zeros(m_rows, dtype=torch.float64, device=dev).index_add_(0, local, p * dp)
            ds = p * (dp - dd[local])
            dq = torch.zeros(m_rows, d, dtype=torch.float64, device=dev).index_add_(0, local, ke * (ds * scale)[:, None])
            dke = qi * (ds * scale)[:, None]
            dve = doi * p[:, None]
            dk.index_add_(0, cols, dke)
            dv.index_add_(0, cols, dve)
            de = dke + dve
            del ke, ve, qi, doi, s, dp, dke, dve
            for key, fs in targets.items():
                if fs.get("out") is not None:
                    add(key, "out", fs["out"][r0:r1, h], out)
                if fs.get("dq") is not None:
                    add(key, "dq", fs["dq"][r0:r1, h], dq)
                if fs.get("de") is not None:
                    add(key, "de", fs["de"][e0:e1, h], de)
            del out, dq, de
        for key, fs in targets.items():
            if fs.get("dk") is not None:
                add(key, "dk", fs["dk"][:, h], dk)
            if fs.get("dv") is not None:
                add(key, "dv", fs["dv"][:, h], dv)
        del qh, kh, vh, doh, eh, dk, dv
    res = {}
    for key, fields in acc.items():
        res[key] = {}
        for f, (num, den) in fields.items():
            if f in bad[key]:
                res[key][f] = math.nan
            elif den == 0.0:
                res[key][f] = 0.0 if num == 0.0 else math.inf
            else:
                res[key][f] = math.sqrt(num / den)
    return res


# --------------------------------------------------------------------------------------------
# Records and the table
# --------------------------------------------------------------------------------------------


class Records:
    def __init__(self, args, an, sp):
        self.args, self.an, self.sp = args, an, sp
        self.records = []
        self.gpu = torch.cuda.get_device_name(args.device) if tp.is_cuda(args.device) else "cpu"

    def base(self, g, case, ef, impl, mode):
        return dict(graph=g.name, n=g.n, n_cols=g.n_cols, nnz=g.nnz, symmetrized=g.symmetrized,
                    heads=case.heads, head_dim=case.d, dtype=case.dtype, edge_features=ef, impl=impl, mode=mode)

    def tail(self):
        a = self.args
        return dict(gpu=self.gpu, torch=torch.__version__, cuda=torch.version.cuda, triton=self.an.triton,
                    anemoi=self.an.version, spattn=self.sp.version, warmup=a.warmup, reps=a.reps,
                    time_budget_ms=a.time_budget_ms, seed=a.seed)

    def add(self, g, case, ef, impl, mode, status, median_ms=None, errs=None, reason=None, variant="",
            note="", **extra):
        errs = errs or {}
        tol = tp.TOLERANCE[case.dtype]
        r = self.base(g, case, ef, impl, mode)
        finite = {f: x for f, x in errs.items() if x is not None and math.isfinite(x)}
        worst = max(errs.values()) if errs and len(finite) == len(errs) else (math.nan if errs else None)
        ok = None
        if status == "ok":
            ok = worst is not None and math.isfinite(worst) and worst <= tol
            if not ok:
                status = "wrong"
                nonfinite = [f for f in errs if f not in finite]
                if nonfinite:
                    reason = "not finite: " + ", ".join(nonfinite)
                else:
                    over = [f"{f} {x:.2e}" for f, x in errs.items() if x > tol]
                    reason = f"over the tolerance {tol:g}: " + ", ".join(over)
        r.update(status=status, median_ms=None if median_ms is None else float(median_ms),
                 rel_err=worst if worst is not None and math.isfinite(worst) else None)
        for f in FIELDS:
            x = errs.get(f)
            r[f"rel_err_{f}"] = float(x) if x is not None and math.isfinite(x) else None
        r.update(tolerance=tol, ok=ok, reason=reason, variant=variant, note=note,
                 timing=("cuda-events around the call" if tp.is_cuda(self.args.device)
                         else "wall clock (--device cpu smoke test)") if median_ms is not None else None)
        r.update({k: (float(v) if isinstance(v, float) else v) for k, v in extra.items()})
        r.update(self.tail())
        self.records.append(r)
        if median_ms is not None:
            err = "nan" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
            print(f"[anemoi] {impl:6s} {mode:7s} {g.name} H={case.heads} D={case.d} {case.dtype} e={ef}: "
                  f"{median_ms:.4f} ms  rel_err {err} ({status})", flush=True)
        else:
            print(f"[anemoi] {impl:6s} {mode:7s} {g.name} H={case.heads} D={case.d} {case.dtype} e={ef}: "
                  f"{status}: {reason}", flush=True)
        return r

    def write(self):
        tp.write_records(self.args.json, self.records)


def fmt_ms(r):
    return f"{r['median_ms']:.3f}" if r and r.get("median_ms") is not None else (r["status"] if r else "-")


def fmt_err(r, grads):
    if not r or r.get("median_ms") is None:
        return "-"
    if grads:
        fields = ("dq", "dk", "dv") + (("de",) if r["edge_features"] == "on" else ())
        xs = [r.get(f"rel_err_{f}") for f in fields]
        g = "nan" if None in xs else f"{max(xs):.1e}"
        o = r.get("rel_err_out")
        return f"{'nan' if o is None else f'{o:.1e}'}/{g}" + ("!" if r["status"] == "wrong" else "")
    o = r.get("rel_err_out")
    return ("nan" if o is None else f"{o:.1e}") + ("!" if r["status"] == "wrong" else "")


def ratio(a, b):
    if a and b and a.get("median_ms") and b.get("median_ms"):
        return f"{a['median_ms'] / b['median_ms']:.2f}"
    return "-"


def print_table(records):
    """One line per configuration: both libraries' medians (ms), anemoi/spattn, and the errors
    (fwd: out; fwd+bwd: out/max of the gradients; '!' marks "wrong")."""
    keys, by = [], {}
    for r in records:
        key = (r["graph"], r["heads"], r["head_dim"], r["dtype"], r["edge_features"])
        if key not in by:
            keys.append(key)
            by[key] = {}
        by[key][(r["impl"], r["mode"])] = r
    head = ["graph", "H", "D", "dtype", "e", "an fwd", "sp fwd", "an/sp", "an f+b", "sp f+b", "an/sp",
            "err an fwd", "err sp fwd", "err an f+b", "err sp f+b"]
    rows = []
    for key in keys:
        x = by[key]
        af, sf = x.get(("anemoi", "fwd")), x.get(("spattn", "fwd"))
        ab, sb = x.get(("anemoi", "fwd_bwd")), x.get(("spattn", "fwd_bwd"))
        rows.append([key[0], str(key[1]), str(key[2]), key[3], key[4], fmt_ms(af), fmt_ms(sf), ratio(af, sf),
                     fmt_ms(ab), fmt_ms(sb), ratio(ab, sb), fmt_err(af, False), fmt_err(sf, False),
                     fmt_err(ab, True), fmt_err(sb, True)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    print()
    print(line(head))
    for r in rows:
        print(line(r))
    print("(ms; ratios anemoi/spattn; errors: relative L2 vs f64, fwd+bwd as out/max(dq, dk, dv, de); ! = over tolerance)")


# --------------------------------------------------------------------------------------------
# One configuration
# --------------------------------------------------------------------------------------------


def estimate_bytes(g, heads, d, dt):
    """A rough peak of one case: inputs, leaves, both libraries' outputs and gradients, Anemoi's
    f32 saved output, the reference's per-head f64 buffers and chunk scratch."""
    elt = torch.empty(0, dtype=dt).element_size()
    node = max(g.n, g.n_cols) * heads * d
    edge = g.nnz * heads * d
    return elt * (17 * node + 6 * edge) + 4 * 2 * node + 8 * 4 * max(g.n, g.n_cols) * d + 2**31


def run_case(rec, g, case, ef, an, ag, sp, sg, args):
    """Both libraries on one (heads, head_dim, dtype, edge features): first calls (their
    outputs kept), one f64 reference for all, then the timings; records for every impl x mode."""
    dev = g.device
    gen = case.gen
    dout = torch.randn(g.n, case.heads, case.d, device=dev, generator=gen).to(case.dt)
    e = torch.randn(g.nnz, case.heads, case.d, device=dev, generator=gen).to(case.dt) if ef == "on" else None
    impls = {}  # impl -> dict(fwd, fwd_bwd, unpack, variant, note, extra, results, status)
    for impl in args.impls:
        st = dict(variant="", note="", extra={}, results={}, failed={})
        impls[impl] = st
        try:
            if impl == "anemoi":
                if an.error:
                    raise an.error
                if isinstance(ag, Exception):
                    raise ag
                fwd, fwd_bwd, unpack, variant, note = anemoi_fns(an, ag, case, e, dout, args)
                st["extra"] = dict(graph_build_ms=ag.build_ms, plan_ms=None)
            else:
                if sp.error:
                    raise sp.error
                if isinstance(sg, Exception):
                    raise sg
                fwd, fwd_bwd, unpack, variant, note, plan_ms = spattn_fns(sp, sg, case, e, dout, args)
                st["extra"] = dict(graph_build_ms=sg.build_ms, plan_ms=plan_ms)
        except Exception as err:  # noqa: BLE001 - a failure is this impl's result for the case
            st["failed"] = {m: status_of(err) for m in MODES}
            tp.free_memory()
            continue
        st.update(fwd=fwd, fwd_bwd=fwd_bwd, unpack=unpack, variant=variant, note=note)
        for mode in MODES:
            try:
                if mode == "fwd":
                    ms, out = wall_ms(dev, fwd)
                    st["results"]["fwd"] = dict(out=out)
                else:
                    ms, res = wall_ms(dev, fwd_bwd)
                    out, grads = unpack(res)
                    st["results"]["fwd_bwd"] = dict(out=out, **grads)
                    del res
                st["extra"][f"first_call_ms_{mode}"] = ms
            except Exception as err:  # noqa: BLE001
                st["failed"][mode] = status_of(err)
                tp.free_memory()
        if tp.is_cuda(dev):
            torch.cuda.synchronize()

    targets = {(impl, mode): res for impl, st in impls.items() for mode, res in st["results"].items()}
    errs = {}
    if targets:
        try:
            errs = reference_errors(g, case.q, case.k, case.v, e, dout, case.scale, targets)
        except Exception as err:  # noqa: BLE001 - without a reference no case can be judged
            status, reason = status_of(err)
            for impl, st in impls.items():
                for mode in st["results"]:
                    st["failed"][mode] = (status, "the f64 reference failed: " + reason)
    for st in impls.values():
        st["results"] = {}
    tp.free_memory()

    for impl, st in impls.items():
        for mode in MODES:
            extra = dict(st["extra"])
            first = extra.pop("first_call_ms_fwd", None), extra.pop("first_call_ms_fwd_bwd", None)
            extra["first_call_ms"] = first[0] if mode == "fwd" else first[1]
            if mode in st["failed"]:
                status, reason = st["failed"][mode]
                rec.add(g, case, ef, impl, mode, status, reason=reason, variant=st["variant"], note=st["note"],
                        **extra)
                continue
            try:
                ms = tp.time_on(dev, st[mode], args.warmup, args.reps)
            except Exception as err:  # noqa: BLE001
                status, reason = status_of(err)
                rec.add(g, case, ef, impl, mode, status, reason=reason, variant=st["variant"], note=st["note"],
                        **extra)
                tp.free_memory()
                continue
            e_fields = ("out",) if mode == "fwd" else ("out", "dq", "dk", "dv") + (("de",) if ef == "on" else ())
            got = errs.get((impl, mode), {})
            rec.add(g, case, ef, impl, mode, "ok", median_ms=ms,
                    errs={f: got.get(f, math.nan) for f in e_fields},
                    variant=st["variant"], note=st["note"], **extra)
            tp.free_memory()
    impls.clear()
    tp.free_memory()


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="+", metavar="GRAPH",
                    help="MatrixMarket (.mtx, .mtx.gz) or spattn-bench --dump-csr files (.csr: R-MAT too)")
    ap.add_argument("--name", help="graph name in the records (one graph only; default: file stem)")
    ap.add_argument("--symmetrize", action="store_true", help="A + Aᵀ + I before timing (both libraries)")
    ap.add_argument("--heads", nargs="+", default=["1", "8"], help="e.g. 1 8, or 1,8")
    ap.add_argument("--head-dim", nargs="+", default=["32", "64"], help="e.g. 32 64, or 32,64")
    ap.add_argument("--dtype", nargs="+", default=["f16", "bf16", "f32"], help="f16, bf16, f32 (or a comma list)")
    ap.add_argument("--edge-features", nargs="+", default=["on", "off"], help="on, off (or a comma list)")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), help="anemoi, spattn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", "--reps", dest="reps", type=int, default=20, help="timed calls (median)")
    ap.add_argument("--time-budget-ms", type=float, default=0.0,
                    help="as torch_peers.py's: a form whose --repeat calls would take longer runs fewer "
                         f"(at least {tp.MIN_REPS}); 0: always --warmup and --repeat")
    ap.add_argument("--prep-reps", type=int, default=3, help="runs of Anemoi's edge_index_to_csc (median)")
    ap.add_argument("--anemoi-path", help="put this folder (an unpacked wheel) or .whl first on sys.path")
    ap.add_argument("--anemoi-rebuild", action="store_true",
                    help="build Anemoi's graph arguments inside every timed call, as its layer does")
    ap.add_argument("--spattn-graph", choices=("host", "device"), default="host",
                    help="spattn.Graph from the host CSR (default) or from CUDA tensors")
    ap.add_argument("--spattn-algorithm", default="auto", help="spattn's algorithm= (default auto)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test; times mean nothing)")
    args = ap.parse_args()
    args.heads = tp.int_list(args.heads)
    args.head_dim = tp.int_list(args.head_dim)
    split = lambda vs: [x for v in vs for x in str(v).split(",") if x]  # noqa: E731
    args.dtype, args.edge_features, args.impls = split(args.dtype), split(args.edge_features), split(args.impls)
    for dt in args.dtype:
        if dt not in tp.TDT:
            ap.error(f"--dtype: {dt!r} is not one of f16, bf16, f32")
    for ef in args.edge_features:
        if ef not in ("on", "off"):
            ap.error(f"--edge-features: {ef!r} is not on or off")
    for impl in args.impls:
        if impl not in IMPLS:
            ap.error(f"--impls: {impl!r} is not one of {', '.join(IMPLS)}")
    if args.name and len(args.graphs) > 1:
        ap.error("--name: only with one graph")
    if args.time_budget_ms < 0:
        ap.error("--time-budget-ms: must be >= 0")
    tp.TIMING["budget_ms"] = args.time_budget_ms
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device (pass --device cpu for a smoke test)")
    device = torch.device(args.device)

    an, sp = Anemoi(args), Spattn(args)
    rec = Records(args, an, sp)
    print(f"[anemoi] anemoi-models {an.version or '-'} (triton {an.triton or '-'})"
          + (f": {an.error}" if an.error else "")
          + f"; spattn {sp.version or '-'}" + (f": {sp.error}" if sp.error else ""), flush=True)
    for path in args.graphs:
        g = tp.load_graph(path, args.name, args.symmetrize, device)
        where = torch.cuda.get_device_name(device) if tp.is_cuda(device) else "the CPU"
        print(f"[anemoi] {g.name}: n={g.n} nnz={g.nnz} on {where}", flush=True)
        ag = sg = None
        if "anemoi" in args.impls and not an.error:
            try:
                ag = AnemoiGraph(an, g, args)
                print(f"[anemoi] {g.name}: anemoi edge_index_to_csc {ag.build_ms:.3f} ms ({ag.order})", flush=True)
            except Exception as err:  # noqa: BLE001 - recorded with every case of the graph
                ag = err
        if "spattn" in args.impls and not sp.error:
            try:
                sg = SpattnGraph(sp, g, args)
                print(f"[anemoi] {g.name}: spattn {sg.how} {sg.build_ms:.3f} ms ({sg.order})", flush=True)
            except Exception as err:  # noqa: BLE001
                sg = err
        for dtype in args.dtype:
            for heads in args.heads:
                for d in args.head_dim:
                    for ef in args.edge_features:
                        case = tp.Case(g, heads, d, dtype, args.seed)
                        try:
                            tp.check_fits(device, estimate_bytes(g, heads, d, case.dt), "this case")
                        except tp.WouldNotFit as err:
                            for impl in args.impls:
                                for mode in MODES:
                                    rec.add(g, case, ef, impl, mode, "unsupported", reason=str(err))
                            case.drop()
                            continue
                        run_case(rec, g, case, ef, an, ag, sp, sg, args)
                        rec.write()
                        case.drop()
                        tp.free_memory()
        del ag, sg
        tp.free_memory()
    rec.write()
    print_table(rec.records)
    print(f"[anemoi] wrote {len(rec.records)} records to {args.json}")


if __name__ == "__main__":
    main()
