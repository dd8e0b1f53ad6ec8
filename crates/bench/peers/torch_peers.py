#!/usr/bin/env python3
"""Peers of spattn, timed on the same GPU in the same run, with their accuracy and their limits.

For one graph (a MatrixMarket file, or the binary CSR that `spattn-bench --dump-csr` writes) and
each (heads, head_dim, dtype) asked for, each peer is timed with CUDA events (warm-up, median of
--reps runs) in the fastest form a user can find, and its output is compared with an f64
reference computed from the very same Q, K, V (see "Accuracy"). Peers (`--ops`):

  cusparse_sddmm      torch.sparse.sampled_addmm(A, Q_h, K_hᵀ) per head (cuSPARSE SDDMM). Tried with
                      K_hᵀ as the transposed view `k_h.t()` and as `k_h.t().contiguous()`, in the
                      asked dtype and in f32; the fastest form that works is kept (`variant`).
  cusparse_spmm       torch.sparse.mm(P_h, V_h) per head (cuSPARSE SpMM), P in CSR and in COO, in the
                      asked dtype and in f32; the fastest that works is kept.
  torch_sparse_attention  SDDMM -> row softmax (segment max/sum, f32) -> SpMM with the winning
                      SDDMM and SpMM forms: the unfused pipeline of DGL's sparse graph transformer.
                      With several heads, a loop over the heads and one call of each op on the
                      pattern repeated block-diagonally (heads-major Q, K, V); the faster is kept.
  pyg_attention       gathers, torch_geometric.utils.softmax, scatter-add (TransformerConv).
  dense_sdpa          scaled_dot_product_attention with a boolean n x n mask (n <= --dense-max-n).
  flex_attention      torch.nn.attention.flex_attention.flex_attention under torch.compile, with a
                      BlockMask built straight from the CSR (BlockMask.from_kv_blocks; fully dense
                      blocks as "full" blocks; mask_mod reads a bitmap of each non-empty block),
                      in the graph's order. Each block size of --flex-blocks (default 128 64 32
                      16; the kernel's BLOCK_M and BLOCK_N set to it) is timed and the fastest
                      within tolerance kept; the note lists the others.
  flex_attention_rcm  the same after reverse Cuthill-McKee (scipy's, else a numpy RCM); Q, K, V are
                      permuted and the output permuted back outside the timed region.
  flashinfer_bsr      flashinfer.BlockSparseAttentionWrapper with 1 x 1 blocks (when
                      `import flashinfer` works; otherwise no record, and it says why).
  torch_sparse_train  (opt-in) a training step of torch_sparse_attention through autograd.
  pyg_train           (opt-in) a training step of pyg_attention through autograd.

crates/bench/peers/fused_peers.py times Fused3S, FlashSparse and DF-GNN, built from their
sources, with the same inputs, reference, timing and records (it imports this file).

Accuracy: rel_err = ||out - ref||_2 / ||ref||_2 over the whole n x heads x head_dim output,
where ref is softmax_row(scale * Q Kᵀ masked by A) V computed in f64 from the same Q, K, V (the
inputs rounded to the asked dtype, then upcast; scale = 1/sqrt(head_dim); gather/scatter softmax
with max subtraction; a row with no edges gives 0), per head and in chunks of rows, on the GPU.
cusparse_sddmm is compared with the f64 scores scale * q_i.k_j of the edges, cusparse_spmm with
the f64 product P V. tolerance: f32 1e-5, bf16 2e-2, f16 5e-3 (by the asked dtype; a peer that
runs an f32 case in tf32 keeps 1e-5 and says dtype_used "tf32").

Writes a JSON list of records, one per (peer, heads, head_dim, dtype), also when the peer could
not run the case:

  graph, n, n_cols, nnz, symmetrized, heads, head_dim, dtype, peer
  status      "ok" | "unsupported" (the peer cannot run this case: dtype, shape, n, a missing
              module, or a memory estimate made before trying says it would not fit) | "oom" (it
              ran out of GPU memory) | "error" (an exception; in fused_peers.py also a crash)
  median_ms   median time in ms (null unless status is "ok")
  dtype_used  the element type it computed in (f16, bf16, f32, tf32; null when it did not run)
  variant     the form that was timed (layout, dtype, format, order, ...)
  rel_err     relative L2 error against the f64 reference (null when it did not run or the output
              has NaN/Inf)
  tolerance   the asked dtype's tolerance
  ok          rel_err <= tolerance (false on NaN/Inf; null when it did not run)
  reason      one line: why it did not run (null when status is "ok")
  note        remarks: per-head loop, the other forms tried and their times, ...
  timing      how median_ms was taken ("cuda-events around the call", ...)
  gpu, torch, cuda, warmup, reps, time_budget_ms (--time-budget-ms: a form whose --reps timed
              calls would take longer ran fewer, at least 5, after at least 2 warm-up calls;
              0: every form ran --warmup and --reps)
  optional:   median_ms_call (CUDA events around a call whose peer times itself), parts_ms (the
              stages' medians), stage_rel_err (a stage's own error, e.g. FlashSparse's SDDMM),
              prep_ms (one-off preprocessing: block mask, plan, format), source (repository@commit)

`spattn-bench --peers FILE` matches records to its own cases by graph name, heads, head_dim and
dtype (and refuses a record whose nnz differs from its graph's). A reader that predates the
status field needs every median_ms to be a number: pass --ok-only to leave out the records of
cases a peer could not run. Graph names are spattn-bench's: the file name without .mtx.gz /
.mtx / .csr (`rmat-16.csr` -> `rmat-16`), or --name. The surest way to time the same graph:
`spattn-bench --graph G --dump-csr G.csr --dump-only` (symmetrized with self loops as
benchmarked), then this script on G.csr without --symmetrize.

--device cpu runs every peer that can run on the CPU (no cuSPARSE, FlashInfer) as a smoke test of
this script: its times mean nothing.
"""
import argparse
import gc
import gzip
import json
import math
import os
import struct
import time

import numpy as np
import torch

# --------------------------------------------------------------------------------------------
# Graph input
# --------------------------------------------------------------------------------------------


def read_graph(path):
    """Returns (n_rows, n_cols, row_offsets int64 array, col_indices int64 array)."""
    if path.endswith(".csr"):
        with open(path, "rb") as f:
            magic = f.read(8)
            if magic != b"SPCSR001":
                raise SystemExit(f"{path}: not a spattn CSR file")
            n_rows, n_cols, nnz = struct.unpack("<QQQ", f.read(24))
            offs = np.fromfile(f, dtype="<u4", count=n_rows + 1).astype(np.int64)
            cols = np.fromfile(f, dtype="<u4", count=nnz).astype(np.int64)
        return n_rows, n_cols, offs, cols
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        header = f.readline()
        sym = "symmetric" in header
        line = f.readline()
        while line.startswith("%"):
            line = f.readline()
        n_rows, n_cols, nnz = (int(x) for x in line.split())
        data = np.loadtxt(f, dtype=np.int64, usecols=(0, 1), ndmin=2)
    r, c = data[:, 0] - 1, data[:, 1] - 1
    if sym:
        off = r != c
        r, c = np.concatenate([r, c[off]]), np.concatenate([c, r[off]])
    return coo_to_csr(n_rows, n_cols, r, c)


def coo_to_csr(n_rows, n_cols, r, c):
    key = np.unique(r * n_cols + c)
    r, c = key // n_cols, key % n_cols
    offs = np.zeros(n_rows + 1, dtype=np.int64)
    np.add.at(offs, r + 1, 1)
    return n_rows, n_cols, np.cumsum(offs), c


def sym_self_loops(n, offs, cols):
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(offs))
    r = np.concatenate([rows, cols, np.arange(n)])
    c = np.concatenate([cols, rows, np.arange(n)])
    return coo_to_csr(n, n, r, c)[2:]


def graph_name(path):
    """spattn-bench's name of a graph file: its file name without .gz, .mtx, .csr."""
    name = os.path.basename(path)
    for ext in (".gz", ".mtx", ".csr", ".txt"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name


def int_list(values):
    """`--heads 1 8` and `--heads 1,8` alike."""
    return [int(x) for v in values for x in str(v).split(",") if x]


class Graph:
    """A CSR graph on a device: crow/col/row as int64 (torch's sparse layouts want them so),
    and the host arrays for what runs on the CPU (RCM, FlashSparse's preprocessing)."""

    def __init__(self, name, n, n_cols, offs, cols, symmetrized, device):
        self.name, self.n, self.n_cols, self.symmetrized = name, int(n), int(n_cols), symmetrized
        self.offs, self.cols = offs, cols
        self.nnz = int(offs[-1])
        self.device = device
        self.crow = torch.from_numpy(offs).to(device)
        self.col = torch.from_numpy(cols).to(device)
        self.row = torch.repeat_interleave(torch.arange(self.n, device=device), self.crow[1:] - self.crow[:-1])
        self.max_degree = int(np.diff(offs).max()) if self.n else 0


def load_graph(path, name=None, symmetrize=False, device="cuda"):
    n, n_cols, offs, cols = read_graph(path)
    if symmetrize:
        offs, cols = sym_self_loops(n, offs, cols)
    return Graph(name or graph_name(path), n, n_cols, offs, cols, symmetrize, torch.device(device))


# --------------------------------------------------------------------------------------------
# Shared definitions: dtypes, tolerances, timing, errors, memory
# --------------------------------------------------------------------------------------------

TDT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
TOLERANCE = {"f32": 1e-5, "bf16": 2e-2, "f16": 5e-3}
DEFAULT_OPS = ["cusparse_sddmm", "cusparse_spmm", "torch_sparse_attention", "pyg_attention", "dense_sdpa",
               "flex_attention", "flex_attention_rcm", "flashinfer_bsr"]
ALL_OPS = DEFAULT_OPS + ["torch_sparse_train", "pyg_train"]


class Unsupported(Exception):
    """The peer cannot run this case (dtype, shape, size, missing module): a result, not a bug."""


class WouldNotFit(Unsupported):
    """An estimate says the case does not fit in the GPU's memory: recorded as "unsupported"
    (with the estimate as the reason) rather than tried; an actual out-of-memory is "oom"."""


def is_cuda(device):
    return torch.device(device).type == "cuda"


def synchronize(device):
    if is_cuda(device):
        torch.cuda.synchronize(device)


# --time-budget-ms: the timed calls of one form stop at about this many milliseconds, so a
# 700 ms peer costs seconds instead of minutes; 0 keeps --reps for every form.
TIMING = {"budget_ms": 0.0}
MIN_REPS = 5


def reps_within(budget_ms, per_call_ms, reps):
    """The timed calls a form gets: `reps`, or fewer (at least MIN_REPS) when `reps` calls of
    `per_call_ms` would pass `budget_ms`."""
    if budget_ms <= 0 or per_call_ms <= 0:
        return reps
    return max(min(reps, MIN_REPS), min(reps, int(budget_ms / per_call_ms)))


def warm_enough(budget_ms, calls, after_first_ms):
    """Whether a budgeted warm-up may stop after `calls` calls: at least two (the first may
    compile), and the calls after the first already took half the budget."""
    return budget_ms > 0 and calls >= 2 and after_first_ms >= budget_ms / 2


def time_ms(fn, warmup, reps):
    """Median of `reps` CUDA-event timings of fn() after `warmup` calls (the GPU's clock); with a
    time budget, a long form warms up with fewer calls (warm_enough) and the last warm-up call's
    duration sets how many of the `reps` run (reps_within)."""
    last_ms, after_first_ms = 0.0, 0.0
    for i in range(warmup):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        last_ms = (time.perf_counter() - start) * 1e3
        if i > 0:
            after_first_ms += last_ms
        if warm_enough(TIMING["budget_ms"], i + 1, after_first_ms):
            break
    if warmup > 0:
        reps = reps_within(TIMING["budget_ms"], last_ms, reps)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def time_on(device, fn, warmup, reps):
    """time_ms on a GPU; on the CPU (smoke tests) a wall-clock median that means little."""
    if is_cuda(device):
        return time_ms(fn, warmup, reps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def one_line(err, limit=300):
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    msg = f"{type(err).__name__}: {text[0] if text else ''}".strip()
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_fits(device, nbytes, what, fraction=0.8):
    """Raises WouldNotFit when `nbytes` exceeds `fraction` of the device's free memory."""
    if not is_cuda(device):
        return
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > fraction * free:
        raise WouldNotFit(f"memory: {what} needs ~{gib(nbytes)}, {gib(free)} free on the GPU")


# --------------------------------------------------------------------------------------------
# Inputs and the f64 reference
# --------------------------------------------------------------------------------------------


class Case:
    """One (heads, head_dim, dtype) configuration on a graph: Q, K, V rounded to the asked dtype
    (every peer gets these values; one that computes in f32 upcasts them), and the f64 reference."""

    def __init__(self, g, heads, d, dtype, seed):
        self.g, self.heads, self.d, self.dtype = g, heads, d, dtype
        self.dt = TDT[dtype]
        self.scale = 1.0 / math.sqrt(d)
        self.tolerance = TOLERANCE[dtype]
        gen = torch.Generator(device=g.device).manual_seed(seed)
        # Same draws as the script always made: f32 normals for Q, then K, then V.
        self.q = torch.randn(g.n, heads, d, device=g.device, generator=gen).to(self.dt)
        self.k = torch.randn(g.n_cols, heads, d, device=g.device, generator=gen).to(self.dt)
        self.v = torch.randn(g.n_cols, heads, d, device=g.device, generator=gen).to(self.dt)
        self.gen = gen
        self._ref = None

    @property
    def ref(self):
        if self._ref is None:
            self._ref = reference_attention(self.g, self.q, self.k, self.v, self.scale)
        return self._ref

    def drop(self):
        self.q = self.k = self.v = self._ref = None


def row_chunks(offs, budget_edges, budget_rows=None):
    """[r0, r1) row ranges holding about `budget_edges` edges each (a row is never split)."""
    n = len(offs) - 1
    r0 = 0
    while r0 < n:
        r1 = int(np.searchsorted(offs, offs[r0] + budget_edges, side="right")) - 1
        r1 = max(r1, r0 + 1)
        if budget_rows:
            r1 = min(r1, r0 + budget_rows)
        r1 = min(r1, n)
        yield r0, r1
        r0 = r1


def edge_budget(d, nbytes=2**30):
    """Edges per chunk so that three gathered f64 rows of d features stay under `nbytes`."""
    return max(1024, nbytes // (3 * 8 * d))


def reference_attention(g, q, k, v, scale):
    """softmax_row(scale * Q Kᵀ masked by A) V in f64, (n, heads, head_dim), on q's device when it
    fits in a quarter of the GPU's memory (else on the host). Computed head by head and in chunks
    of rows, so that R-MAT 20 at 8 heads x 128 needs ~2 GiB of scratch beside the output."""
    n, heads, d = q.shape
    dev = q.device
    out_bytes = n * heads * d * 8
    keep = dev
    if is_cuda(dev) and out_bytes > torch.cuda.get_device_properties(dev).total_memory // 4:
        keep = torch.device("cpu")
    ref = torch.zeros(n, heads, d, dtype=torch.float64, device=keep)
    for h in range(heads):
        qh, kh, vh = (x[:, h].double() for x in (q, k, v))
        for r0, r1 in row_chunks(g.offs, edge_budget(d)):
            e0, e1 = int(g.offs[r0]), int(g.offs[r1])
            if e1 == e0:
                continue
            rows = g.row[e0:e1]
            cols = g.col[e0:e1]
            s = (qh[rows] * kh[cols]).sum(-1) * scale
            local = rows - r0
            m = torch.full((r1 - r0,), -math.inf, dtype=torch.float64, device=dev)
            m = m.scatter_reduce(0, local, s, "amax")
            p = torch.exp(s - m[local])
            den = torch.zeros(r1 - r0, dtype=torch.float64, device=dev).index_add_(0, local, p)
            acc = torch.zeros(r1 - r0, d, dtype=torch.float64, device=dev).index_add_(0, local, vh[cols] * p[:, None])
            acc = torch.where(den[:, None] > 0, acc / den.clamp_min(1e-300)[:, None], torch.zeros_like(acc))
            ref[r0:r1, h] = acc.to(keep)
        del qh, kh, vh
    return ref


def rel_error(out, ref, rows_per_chunk=1 << 16):
    """||out - ref|| / ||ref|| in f64, chunk by chunk; NaN when out has NaN or Inf."""
    if tuple(out.shape) != tuple(ref.shape):
        raise RuntimeError(f"output shape {tuple(out.shape)} is not the reference's {tuple(ref.shape)}")
    num = den = 0.0
    n = out.shape[0]
    for r0 in range(0, n, rows_per_chunk):
        o = out[r0:r0 + rows_per_chunk].double()
        r = ref[r0:r0 + rows_per_chunk].to(o.device)
        if not torch.isfinite(o).all():
            return math.nan
        num += float(((o - r) ** 2).sum())
        den += float((r ** 2).sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def score_error(g, q, k, scale, values_per_head):
    """rel_err of per-edge scores (CSR order, one tensor per head) against f64 scale * q_i.k_j."""
    num = den = 0.0
    heads, d = q.shape[1], q.shape[2]
    for h in range(heads):
        qh, kh = q[:, h].double(), k[:, h].double()
        vals = values_per_head[h]
        for r0, r1 in row_chunks(g.offs, edge_budget(d)):
            e0, e1 = int(g.offs[r0]), int(g.offs[r1])
            s = (qh[g.row[e0:e1]] * kh[g.col[e0:e1]]).sum(-1) * scale
            x = vals[e0:e1].double()
            if not torch.isfinite(x).all():
                return math.nan
            num += float(((x - s) ** 2).sum())
            den += float((s ** 2).sum())
    return math.sqrt(num / den) if den else 0.0


def spmm_error(g, p_per_head, v, out_per_head):
    """rel_err of out_h = P_h V_h (one (n, d) tensor per head) against f64."""
    num = den = 0.0
    heads, d = v.shape[1], v.shape[2]
    for h in range(heads):
        vh = v[:, h].double()
        for r0, r1 in row_chunks(g.offs, edge_budget(d)):
            e0, e1 = int(g.offs[r0]), int(g.offs[r1])
            local = g.row[e0:e1] - r0
            ref = torch.zeros(r1 - r0, d, dtype=torch.float64, device=vh.device)
            ref.index_add_(0, local, vh[g.col[e0:e1]] * p_per_head[h][e0:e1].double()[:, None])
            o = out_per_head[h][r0:r1].double()
            if not torch.isfinite(o).all():
                return math.nan
            num += float(((o - ref) ** 2).sum())
            den += float((ref ** 2).sum())
    return math.sqrt(num / den) if den else 0.0


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


class Recorder:
    """Builds, prints and writes the records (after every configuration, so a crash keeps them)."""

    def __init__(self, g, args, device):
        self.g, self.args, self.device = g, args, torch.device(device)
        self.records = []
        self.sink = None  # called with each record as it is made (fused_peers.py's children)
        if is_cuda(self.device):
            self.gpu = torch.cuda.get_device_name(self.device)
        else:
            self.gpu = "cpu"

    def _base(self, peer, heads, d, dtype):
        g = self.g
        return dict(graph=g.name, n=g.n, n_cols=g.n_cols, nnz=g.nnz, symmetrized=g.symmetrized,
                    heads=heads, head_dim=d, dtype=dtype, peer=peer)

    def _tail(self):
        return dict(gpu=self.gpu, torch=torch.__version__, cuda=torch.version.cuda,
                    warmup=self.args.warmup, reps=self.args.reps,
                    time_budget_ms=self.args.time_budget_ms)

    def ok(self, peer, heads, d, dtype, median_ms, dtype_used, rel_err, variant="", note="",
           timing="cuda-events around the call", **extra):
        tol = TOLERANCE[dtype]
        finite = rel_err is not None and math.isfinite(rel_err)
        if not is_cuda(self.device):
            timing = "wall clock (--device cpu smoke test)"
        r = self._base(peer, heads, d, dtype)
        r.update(status="ok", median_ms=float(median_ms), dtype_used=dtype_used, variant=variant,
                 rel_err=float(rel_err) if finite else None, tolerance=tol,
                 ok=bool(finite and rel_err <= tol), reason=None,
                 note=(note + ("; " if note else "") + "output has NaN/Inf") if not finite else note,
                 timing=timing)
        r.update(self._tail())
        r.update({k: v for k, v in extra.items() if v is not None})
        self.records.append(r)
        if self.sink:
            self.sink(r)
        mark = "ok" if r["ok"] else "WRONG"
        err = f"{rel_err:.2e}" if finite else "nan"
        print(f"[peers] {peer:24s} H={heads} D={d} {dtype}->{dtype_used}: {median_ms:.4f} ms  "
              f"rel_err {err} ({mark})  {variant}", flush=True)
        return r

    def limit(self, peer, heads, d, dtype, status, reason, variant="", note="", **extra):
        r = self._base(peer, heads, d, dtype)
        r.update(status=status, median_ms=None, dtype_used=None, variant=variant, rel_err=None,
                 tolerance=TOLERANCE[dtype], ok=None, reason=reason, note=note, timing=None)
        r.update(self._tail())
        r.update({k: v for k, v in extra.items() if v is not None})
        self.records.append(r)
        if self.sink:
            self.sink(r)
        print(f"[peers] {peer:24s} H={heads} D={d} {dtype}: {status}: {reason}", flush=True)
        return r

    def write(self, path, ok_only=False):
        write_records(path, [r for r in self.records if not ok_only or r["median_ms"] is not None])


def write_records(path, records):
    """Writes the records so far (also after each configuration, so a crash keeps them)."""
    out_dir = os.path.dirname(path)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1, allow_nan=False)
    os.replace(tmp, path)


def attempt(rec, peer, case, fn):
    """Runs one peer on one case and records the result: fn() returns the fields of an "ok"
    record (median_ms, dtype_used, rel_err, variant, note, ...) or raises. Limits are results:
    Unsupported (and a memory estimate that does not fit) -> "unsupported", out of memory ->
    "oom" (memory freed before going on), anything else -> "error"."""
    h, d, dt = case.heads, case.d, case.dtype
    status = reason = None
    try:
        fields = fn()
    except Unsupported as err:  # WouldNotFit included
        status, reason = "unsupported", str(err)
    except torch.cuda.OutOfMemoryError as err:
        status, reason = "oom", one_line(err)
    except Exception as err:  # noqa: BLE001 - any failure of a peer is a result
        status, reason = "error", one_line(err)
        if os.environ.get("SPATTN_PEERS_TRACEBACK"):
            import traceback
            traceback.print_exc()
    if status is None:
        fields = dict(fields)
        extra = fields.pop("extra", {}) or {}
        r = rec.ok(peer, h, d, dt, **fields, **extra)
    else:
        r = rec.limit(peer, h, d, dt, status, reason)
    free_memory()
    if is_cuda(case.g.device):
        try:
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001
            print(f"[peers] the CUDA context is broken after {peer}: {one_line(err)}", flush=True)
            raise
    return r


# --------------------------------------------------------------------------------------------
# cuSPARSE through torch.sparse: the forms a user can write, timed, the fastest kept
# --------------------------------------------------------------------------------------------


def _dtype_tries(dtype):
    return [dtype, "f32"] if dtype != "f32" else ["f32"]


def sddmm_forms(case, args):
    """Times every form of torch.sparse.sampled_addmm(A, Q_h, K_hᵀ): K_hᵀ as `k_h.t()` (the
    view, no copy) or `k_h.t().contiguous()`, in the asked dtype or f32. Returns a list of dicts
    (label, dt, ms, err, fn or the exception's line), fastest first among those that ran."""
    g = case.g
    forms = []
    for dt_name in _dtype_tries(case.dtype):
        dt = TDT[dt_name]
        qh = [case.q[:, h].to(dt).contiguous() for h in range(case.heads)]
        kh = [case.k[:, h].to(dt).contiguous() for h in range(case.heads)]
        a = torch.sparse_csr_tensor(g.crow, g.col, torch.ones(g.nnz, device=g.device, dtype=dt), size=(g.n, g.n_cols))
        for layout in ("view", "contiguous"):
            label = ("k.t()" if layout == "view" else "k.t().contiguous()") + f", {dt_name}"
            kt = [x.t() if layout == "view" else x.t().contiguous() for x in kh]

            def fn(a=a, qh=qh, kt=kt):
                return [torch.sparse.sampled_addmm(a, qh[h], kt[h], beta=0.0, alpha=case.scale) for h in range(case.heads)]

            try:
                res = fn()
                synchronize(g.device)
                err = score_error(g, case.q, case.k, case.scale, [r.values() for r in res])
                del res
                ms = time_on(g.device, fn, args.warmup, args.reps)
                forms.append(dict(label=label, dt=dt_name, layout=layout, ms=ms, err=err, fn=fn, a=a, qh=qh, kt=kt))
            except torch.cuda.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError, TypeError) as err:
                forms.append(dict(label=label, dt=dt_name, layout=layout, failed=one_line(err, 120)))
                synchronize(g.device)
    return forms


def spmm_forms(case, args):
    """Times torch.sparse.mm(P_h, V_h) with P in CSR or COO, in the asked dtype or f32."""
    g = case.g
    forms = []
    p_vals = [torch.rand(g.nnz, device=g.device, generator=case.gen) for _ in range(case.heads)]
    for dt_name in _dtype_tries(case.dtype):
        dt = TDT[dt_name]
        vh = [case.v[:, h].to(dt).contiguous() for h in range(case.heads)]
        for fmt in ("csr", "coo"):
            label = f"{fmt.upper()}, {dt_name}"
            try:
                if fmt == "csr":
                    p = [torch.sparse_csr_tensor(g.crow, g.col, x.to(dt), size=(g.n, g.n_cols)) for x in p_vals]
                else:
                    idx = torch.stack([g.row, g.col])
                    p = [torch.sparse_coo_tensor(idx, x.to(dt), size=(g.n, g.n_cols), is_coalesced=True) for x in p_vals]

                def fn(p=p, vh=vh):
                    return [torch.sparse.mm(p[h], vh[h]) for h in range(case.heads)]

                res = fn()
                synchronize(g.device)
                # P as the peer saw it (rounded to dt), against f64.
                err = spmm_error(g, [x.to(dt) for x in p_vals], case.v.to(dt), res)
                del res
                ms = time_on(g.device, fn, args.warmup, args.reps)
                forms.append(dict(label=label, dt=dt_name, fmt=fmt, ms=ms, err=err, fn=fn, vh=vh))
            except torch.cuda.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError, TypeError) as err:
                forms.append(dict(label=label, dt=dt_name, fmt=fmt, failed=one_line(err, 120)))
                synchronize(g.device)
    return forms


def pick_fastest(forms, tolerance):
    """The fastest form within tolerance; if none is, the fastest that ran; None if none ran."""
    ran = [f for f in forms if "failed" not in f]
    good = [f for f in ran if math.isfinite(f["err"]) and f["err"] <= tolerance]
    pool = good or ran
    return min(pool, key=lambda f: f["ms"]) if pool else None


def forms_note(forms, winner):
    parts = []
    for f in forms:
        if f is winner:
            continue
        parts.append(f"{f['label']}: failed ({f['failed']})" if "failed" in f
                     else f"{f['label']}: {f['ms']:.4f} ms, rel_err {f['err']:.1e}")
    return ("also tried " + "; ".join(parts)) if parts else ""


def per_head_note(case):
    return "per-head loop" if case.heads > 1 else ""


def join_notes(*notes):
    return "; ".join(n for n in notes if n)


def run_cusparse(rec, case, args):
    """cusparse_sddmm, cusparse_spmm and torch_sparse_attention, sharing the search of forms."""
    g = case.g
    want = [op for op in ("cusparse_sddmm", "cusparse_spmm", "torch_sparse_attention") if op in args.ops]
    if not want:
        return
    state = {}

    def sddmm():
        forms = sddmm_forms(case, args)
        state["sddmm"] = best = pick_fastest(forms, case.tolerance)
        if best is None:
            raise RuntimeError("no form ran: " + forms_note(forms, None))
        return dict(median_ms=best["ms"], dtype_used=best["dt"], rel_err=best["err"], variant=best["label"],
                    note=join_notes(per_head_note(case), forms_note(forms, best)))

    def spmm():
        forms = spmm_forms(case, args)
        state["spmm"] = best = pick_fastest(forms, case.tolerance)
        if best is None:
            raise RuntimeError("no form ran: " + forms_note(forms, None))
        return dict(median_ms=best["ms"], dtype_used=best["dt"], rel_err=best["err"], variant=best["label"],
                    note=join_notes(per_head_note(case), forms_note(forms, best),
                                    "P: uniform random values on A's pattern"))

    def attention():
        sd, sp = state.get("sddmm"), state.get("spmm")
        if sd is None or sp is None:
            raise RuntimeError("no working cuSPARSE " + ("SDDMM" if sd is None else "SpMM") + " form")
        a, qh, kt = sd["a"], sd["qh"], sd["kt"]
        vh, sp_dt, fmt = sp["vh"], TDT[sp["dt"]], sp["fmt"]
        idx = torch.stack([g.row, g.col]) if fmt == "coo" else None

        def softmax(x, row, rows):
            m = torch.full((rows,), -math.inf, device=g.device).scatter_reduce(0, row, x, "amax")
            ex = torch.exp(x - m[row])
            den = torch.zeros(rows, device=g.device).index_add_(0, row, ex)
            return (ex / den[row]).to(sp_dt)

        def per_head():
            outs = []
            for h in range(case.heads):
                s = torch.sparse.sampled_addmm(a, qh[h], kt[h], beta=0.0, alpha=case.scale)
                pv = softmax(s.values().float(), g.row, g.n)
                if fmt == "csr":
                    ph = torch.sparse_csr_tensor(g.crow, g.col, pv, size=(g.n, g.n_cols))
                else:
                    ph = torch.sparse_coo_tensor(idx, pv, size=(g.n, g.n_cols), is_coalesced=True)
                outs.append(torch.sparse.mm(ph, vh[h]))
            return torch.stack(outs, 1)

        forms = [dict(label="per-head loop" if case.heads > 1 else "one head", fn=per_head)]
        if case.heads > 1:
            # All heads in one call of each op: the graph's pattern repeated block-diagonally
            # (head h's rows and columns offset by h·n and h·n_cols), Q, K, V heads-major.
            H, n, nc = case.heads, g.n, g.n_cols
            offs = torch.arange(H, device=g.device)
            crow = torch.cat([g.crow[:-1] + h * g.nnz for h in range(H)] + [g.crow[-1:] * H])
            col = (g.col.unsqueeze(0) + (offs * nc).unsqueeze(1)).reshape(-1)
            row = (g.row.unsqueeze(0) + (offs * n).unsqueeze(1)).reshape(-1)
            a_big = torch.sparse_csr_tensor(crow, col, torch.ones(H * g.nnz, device=g.device, dtype=qh[0].dtype),
                                            size=(H * n, H * nc))
            q_dt, v_dt = qh[0].dtype, vh[0].dtype
            view = sd["layout"] == "view"
            big_idx = torch.stack([row, col]) if fmt == "coo" else None

            # Heads-major copies made once, outside the timing, as the per-head loop's slices are.
            qb = case.q.to(q_dt).transpose(0, 1).reshape(H * n, case.d)
            kb = case.k.to(q_dt).transpose(0, 1).reshape(H * nc, case.d).t()
            kb = kb if view else kb.contiguous()
            vb = case.v.to(v_dt).transpose(0, 1).reshape(H * nc, case.d)

            def block_diagonal():
                s = torch.sparse.sampled_addmm(a_big, qb, kb, beta=0.0, alpha=case.scale)
                pv = softmax(s.values().float(), row, H * n)
                if fmt == "csr":
                    pb = torch.sparse_csr_tensor(crow, col, pv, size=(H * n, H * nc))
                else:
                    pb = torch.sparse_coo_tensor(big_idx, pv, size=(H * n, H * nc), is_coalesced=True)
                return torch.sparse.mm(pb, vb).view(H, n, case.d).transpose(0, 1)

            forms.append(dict(label="all heads block-diagonal", fn=block_diagonal))
        for f in forms:
            try:
                out = f["fn"]()
                f["err"] = rel_error(out, case.ref)
                del out
                f["ms"] = time_on(g.device, f["fn"], args.warmup, args.reps)
            except torch.cuda.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError, TypeError) as err:
                f["failed"] = one_line(err, 120)
                synchronize(g.device)
        best = pick_fastest(forms, case.tolerance)
        if best is None:
            raise RuntimeError("no form ran: " + forms_note(forms, None))
        used = case.dtype if sd["dt"] == sp["dt"] == case.dtype else "f32"
        return dict(median_ms=best["ms"], dtype_used=used, rel_err=best["err"],
                    variant=f"SDDMM {sd['label']}; softmax f32; SpMM {sp['label']}; {best['label']}",
                    note=forms_note(forms, best))

    # The attention pipeline needs both searches even when their own records are not asked for.
    for op, fn in (("cusparse_sddmm", sddmm), ("cusparse_spmm", spmm)):
        if op in want:
            attempt(rec, op, case, fn)
        elif "torch_sparse_attention" in want:
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - reported by the pipeline's record
                print(f"[peers] {op} search failed: {one_line(err)}", flush=True)
    if "torch_sparse_attention" in want:
        attempt(rec, "torch_sparse_attention", case, attention)
    state.clear()


# --------------------------------------------------------------------------------------------
# PyG, dense SDPA
# --------------------------------------------------------------------------------------------


def run_pyg(rec, case, args):
    g = case.g

    def fn_record():
        try:
            from torch_geometric.utils import softmax as pyg_softmax
        except ImportError as err:
            raise Unsupported(f"torch_geometric is not importable ({one_line(err)})")
        q, k, v = case.q, case.k, case.v

        def fn():
            alpha = (q[g.row] * k[g.col]).sum(dim=-1) * case.scale  # nnz x H
            alpha = pyg_softmax(alpha, g.row, num_nodes=g.n)
            out = torch.zeros(g.n, case.heads, case.d, device=g.device, dtype=case.dt)
            return out.index_add_(0, g.row, v[g.col] * alpha.unsqueeze(-1))

        check_fits(g.device, g.nnz * case.heads * case.d * q.element_size() * 3, "the per-edge gathers")
        out = fn()
        err = rel_error(out, case.ref)
        del out
        ms = time_on(g.device, fn, args.warmup, args.reps)
        return dict(median_ms=ms, dtype_used=case.dtype, rel_err=err,
                    variant=f"gather/scatter in {case.dtype}, torch_geometric.utils.softmax")

    attempt(rec, "pyg_attention", case, fn_record)


def run_dense_sdpa(rec, case, args):
    g = case.g

    def fn_record():
        if g.n > args.dense_max_n:
            raise Unsupported(f"n = {g.n} > --dense-max-n {args.dense_max_n} (the n x n mask alone is "
                              f"{gib(g.n * g.n_cols)})")
        check_fits(g.device, g.n * g.n_cols * (1 + case.heads * 4), "the n x n mask and scores")
        mask = torch.zeros(g.n, g.n_cols, dtype=torch.bool, device=g.device)
        mask[g.row, g.col] = True
        qq, kk, vv = (x.transpose(0, 1).unsqueeze(0) for x in (case.q, case.k, case.v))

        def fn():
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=case.scale)

        out = fn()[0].transpose(0, 1)
        err = rel_error(out, case.ref)
        del out
        ms = time_on(g.device, fn, args.warmup, args.reps)
        return dict(median_ms=ms, dtype_used=case.dtype, rel_err=err, variant="boolean n x n mask, (1, H, n, D) views")

    attempt(rec, "dense_sdpa", case, fn_record)


# --------------------------------------------------------------------------------------------
# FlexAttention with a BlockMask built from the CSR
# --------------------------------------------------------------------------------------------

FLEX_BLOCK = 128


def rcm_permutation(n, offs, cols):
    """Reverse Cuthill-McKee order of A + Aᵀ: scipy's when importable, else a numpy version
    (BFS from a minimum-degree node of each component, neighbours by increasing degree)."""
    try:
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import reverse_cuthill_mckee
        a = csr_matrix((np.ones(len(cols), dtype=np.int8), cols.astype(np.int32), offs.astype(np.int64)), shape=(n, n))
        return np.asarray(reverse_cuthill_mckee(a, symmetric_mode=False), dtype=np.int64), "scipy"
    except ImportError:
        pass
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(offs))
    _, _, s_offs, s_cols = coo_to_csr(n, n, np.concatenate([rows, cols]), np.concatenate([cols, rows]))
    deg = np.diff(s_offs)
    seen = np.zeros(n, dtype=bool)
    order = []
    for start in np.argsort(deg, kind="stable"):
        if seen[start]:
            continue
        seen[start] = True
        queue = [int(start)]
        head = 0
        while head < len(queue):
            u = queue[head]
            head += 1
            nb = s_cols[s_offs[u]:s_offs[u + 1]]
            nb = nb[~seen[nb]]
            if len(nb):
                nb = nb[np.argsort(deg[nb], kind="stable")]
                seen[nb] = True
                queue.extend(nb.tolist())
        order.extend(queue)
    return np.asarray(order[::-1], dtype=np.int64), "numpy"


def permute_graph(g, perm):
    """A' = P A Pᵀ: row i of A' is row perm[i] of A, columns renumbered by the inverse."""
    dev = g.device
    perm_t = torch.from_numpy(perm).to(dev)
    inv = torch.empty_like(perm_t)
    inv[perm_t] = torch.arange(g.n, device=dev)
    key = inv[g.row] * g.n + inv[g.col]
    key = torch.sort(key).values
    rows, cols = key // g.n, key % g.n
    offs = torch.zeros(g.n + 1, dtype=torch.int64, device=dev)
    offs[1:] = torch.cumsum(torch.bincount(rows, minlength=g.n), 0)
    return Graph(g.name, g.n, g.n, offs.cpu().numpy(), cols.cpu().numpy(), g.symmetrized, dev), perm_t, inv


def flex_block_structure(n, row, col, block=FLEX_BLOCK, check=None):
    """The block-sparse structure of A in the form BlockMask.from_kv_blocks wants, built in
    O(nnz) from the edges (create_block_mask would evaluate the mask over all n² pairs):

      kv_num_blocks (1,1,nb), kv_indices (1,1,nb,nb): the non-empty, not completely full blocks
        of each row block (the first kv_num_blocks of each row);
      full_kv_num_blocks/full_kv_indices: blocks whose 128 x 128 entries are all edges;
      slot (nb*nb int32): (row block, column block) -> the block's bitmap;
      bits (pairs*128*16 uint8): bit (r, c) of a block is edge (row block*128 + r, col block*128 + c).

    `check(nbytes, what)`, when given, is called with the memory the structure will take once
    the number of non-empty blocks is known, before the big allocations.
    Returns a dict with those and the counts."""
    dev = row.device
    nb = (n + block - 1) // block
    bpr = block // 8  # bitmap bytes per row of a block
    rb, cb = row // block, col // block
    key = rb * nb + cb
    ukey, inv, counts = torch.unique(key, sorted=True, return_inverse=True, return_counts=True)
    pairs = int(ukey.numel())
    if check:
        check(flex_structure_bytes(nb, pairs, block), f"the block mask ({pairs} non-empty {block} x {block} blocks)")
    # One byte of a bitmap collects the edges of one row and 8 consecutive columns: in CSR order
    # those edges are adjacent, so a consecutive unique gives each byte its edges' bits.
    byte = inv * (block * bpr) + (row % block) * bpr + (col % block) // 8
    ubyte, binv = torch.unique_consecutive(byte, return_inverse=True)
    val = torch.zeros(ubyte.numel(), dtype=torch.int32, device=dev).index_add_(
        0, binv, torch.ones_like(binv, dtype=torch.int32) << (col % 8).to(torch.int32))
    bits = torch.zeros(pairs * block * bpr, dtype=torch.uint8, device=dev)
    bits[ubyte] = val.to(torch.uint8)
    slot = torch.zeros(nb * nb, dtype=torch.int32, device=dev)
    slot[ukey] = torch.arange(pairs, dtype=torch.int32, device=dev)
    # A block is full when it holds block² edges (so it lies inside the n x n matrix).
    full = counts == block * block

    def packed(keys):
        qb, kb = keys // nb, keys % nb
        num = torch.bincount(qb, minlength=nb).to(torch.int32)
        start = torch.zeros(nb + 1, dtype=torch.int64, device=dev)
        start[1:] = torch.cumsum(num.to(torch.int64), 0)
        # nb wide, as create_block_mask makes it: the GPU kernel would read a narrower array by
        # its strides, but inductor's CPU lowering checks width * block >= n.
        width = int(num.max()) if keys.numel() else 0
        idx = torch.zeros(nb, nb, dtype=torch.int32, device=dev)
        pos = torch.arange(keys.numel(), device=dev) - start[qb]
        idx[qb, pos] = kb.to(torch.int32)
        return num.view(1, 1, nb), idx.view(1, 1, nb, nb), width

    kv_num, kv_idx, width = packed(ukey[~full])
    full_num, full_idx, full_width = packed(ukey[full])
    return dict(nb=nb, pairs=pairs, full_pairs=int(full.sum()), width=width, bits=bits, slot=slot,
                kv_num=kv_num, kv_idx=kv_idx, full_num=full_num, full_idx=full_idx, block=block)


def flex_structure_bytes(nb, pairs, block=FLEX_BLOCK):
    """flex_block_structure's memory: the slot table, the bitmaps, the two nb x nb index arrays."""
    return nb * nb * 4 + pairs * block * block // 8 + 2 * nb * nb * 4


def make_block_mask(n, st):
    from torch.nn.attention.flex_attention import BlockMask

    slot, bits, nb, block = st["slot"], st["bits"], st["nb"], st["block"]
    bpr = block // 8

    def mask_mod(b, h, q_idx, kv_idx):
        # int64 before the products: nb² and the bitmap offsets pass 2³¹ on large graphs.
        s = slot[(q_idx // block).to(torch.int64) * nb + kv_idx // block].to(torch.int64)
        byte = bits[s * (block * bpr) + (q_idx % block) * bpr + (kv_idx % block) // 8].to(torch.int32)
        return ((byte >> (kv_idx % 8)) & 1) == 1

    full = st["full_pairs"] > 0
    return BlockMask.from_kv_blocks(
        st["kv_num"], st["kv_idx"],
        st["full_num"] if full else None, st["full_idx"] if full else None,
        BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(n, n), compute_q_blocks=False)


_FLEX = {}


def compiled_flex():
    """flex_attention under torch.compile, as its documentation says users must run it (the
    eager version materialises the n x n scores). fullgraph=True and a high recompile limit, so
    that a failure to compile is an error rather than a silent fall back to the eager version."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        import torch._dynamo
        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 256))
        # dynamic=None (torch's default): the first shape compiles static, a second marks the
        # changing sizes dynamic, so graphs and shapes after it reuse one kernel instead of a
        # compile each (tens of seconds apiece).
        _FLEX["fn"] = torch.compile(flex_attention, fullgraph=True)
    return _FLEX["fn"]


def run_flex(rec, case, args, rcm):
    g = case.g
    peer = "flex_attention_rcm" if rcm else "flex_attention"

    def fn_record():
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as err:
            raise Unsupported(f"torch.nn.attention.flex_attention is not importable ({one_line(err)})")
        if g.n != g.n_cols:
            raise Unsupported("A is not square (K and V rows are not the graph's nodes)")
        if case.d < 16 or case.d & (case.d - 1):
            raise Unsupported(f"head_dim {case.d}: FlexAttention's kernels want a power of two >= 16")
        inputs = 4 * g.n * case.heads * case.d * case.q.element_size()  # q4, k4, v4, out
        # The O(nnz) scratch of the structure's construction (int64 keys, inverse, byte offsets).
        check_fits(g.device, inputs + 6 * 8 * g.nnz, "the inputs and the block mask's scratch")

        def check(nbytes, what):
            check_fits(g.device, nbytes + inputs, what)

        gg, perm_t, note = g, None, ""
        rcm_ms = 0.0
        if rcm:
            prep = time.perf_counter()
            perm, how = rcm_permutation(g.n, g.offs, g.cols)
            gg, perm_t, _ = permute_graph(g, perm)
            synchronize(g.device)
            rcm_ms = (time.perf_counter() - prep) * 1e3
            note = f"RCM by {how}; Q, K, V permuted and the output permuted back outside the timed region"
        q, k, v = case.q, case.k, case.v
        if perm_t is not None:
            q, k, v = q[perm_t], k[perm_t], v[perm_t]
        q4, k4, v4 = (x.permute(1, 0, 2).unsqueeze(0).contiguous() for x in (q, k, v))
        flex = compiled_flex()

        def one_block(block):
            """One block size: its form record (pick_fastest's fields), timed and checked."""
            prep = time.perf_counter()
            st = flex_block_structure(gg.n, gg.row, gg.col, block=block, check=check)
            bm = make_block_mask(gg.n, st)
            synchronize(g.device)
            prep_ms = rcm_ms + (time.perf_counter() - prep) * 1e3
            # The kernel's tiles must divide the mask's blocks: below 128 they are set to it.
            opts = None if block >= 128 else {"BLOCK_M": block, "BLOCK_N": block}

            def fn():
                return flex(q4, k4, v4, block_mask=bm, scale=case.scale, kernel_options=opts)

            compile_t = time.perf_counter()
            out = fn()
            synchronize(g.device)
            compile_s = time.perf_counter() - compile_t
            out = out[0].permute(1, 0, 2)
            if perm_t is not None:
                back = torch.empty_like(out)
                back[perm_t] = out
                out = back
            err = rel_error(out, case.ref)
            del out
            ms = time_on(g.device, fn, args.warmup, args.reps)
            variant = (f"{'RCM order' if rcm else 'graph order'}, BlockMask.from_kv_blocks {block}x{block}: "
                       f"{st['pairs'] - st['full_pairs']} partial + {st['full_pairs']} full blocks "
                       f"(<= {st['width']} a row block), bitmap mask_mod, torch.compile")
            del bm, st
            return dict(label=f"{block}x{block} blocks", ms=ms, err=err, variant=variant,
                        compile_s=compile_s, prep_ms=prep_ms)

        forms, last_err = [], None
        for block in dict.fromkeys(args.flex_blocks):  # each size once, in the order given
            try:
                forms.append(one_block(block))
            except Exception as err:  # noqa: BLE001 - a block size that fails is a form that failed
                why = f"out of memory: {one_line(err, 120)}" if isinstance(err, torch.cuda.OutOfMemoryError) \
                    else one_line(err, 120)
                forms.append(dict(label=f"{block}x{block} blocks", failed=why))
                last_err = err
            # Outside the handler, so that the failed size's frame (its block mask) is gone too:
            # the next size's memory estimate reads the driver's free memory.
            free_memory()
        best = pick_fastest(forms, TOLERANCE[case.dtype])
        if best is None:
            # Every size failed: recorded as attempt() records the last failure (out of memory
            # "oom", a size that would not fit "unsupported", anything else "error"), every
            # size's reason in the message.
            if isinstance(last_err, torch.cuda.OutOfMemoryError):
                raise last_err
            cls = Unsupported if isinstance(last_err, Unsupported) else RuntimeError
            raise cls("no block size ran: " + "; ".join(f"{f['label']}: {f['failed']}" for f in forms)) \
                from last_err
        return dict(median_ms=best["ms"], dtype_used=case.dtype, rel_err=best["err"], variant=best["variant"],
                    note=join_notes(note, f"first call (compile) {best['compile_s']:.1f} s",
                                    forms_note(forms, best)),
                    extra=dict(prep_ms=best["prep_ms"]))

    attempt(rec, peer, case, fn_record)


# --------------------------------------------------------------------------------------------
# FlashInfer
# --------------------------------------------------------------------------------------------


def flashinfer_module():
    """flashinfer, or None after printing why it is not importable."""
    if "flashinfer" not in _FLEX:
        try:
            import flashinfer
            _FLEX["flashinfer"] = flashinfer
        except Exception as err:  # noqa: BLE001 - any import failure means: no FlashInfer
            print(f"[peers] flashinfer_bsr: no record: `import flashinfer` failed: {one_line(err)}", flush=True)
            _FLEX["flashinfer"] = None
    return _FLEX["flashinfer"]


def run_flashinfer(rec, case, args):
    g = case.g
    fi = flashinfer_module()
    if fi is None:
        return

    def fn_record():
        if not is_cuda(g.device):
            raise Unsupported("FlashInfer needs a CUDA device")
        if case.dtype == "f32":
            raise Unsupported("FlashInfer's attention kernels take f16/bf16 (and fp8) only")
        if case.d not in (64, 128, 256):
            raise Unsupported(f"head_dim {case.d}: FlashInfer builds 64, 128, 256")
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=g.device)
        w = fi.BlockSparseAttentionWrapper(ws)
        # plan() keeps about ten (rows + 1)-long int32 arrays in the int workspace, which the
        # wrapper makes 8 MiB: R-MAT 20's million rows overflowed it ("Buffer overflow ...").
        int_bytes = max(8 << 20, 64 * (g.n + 1))
        w.reset_workspace_buffer(ws, torch.empty(int_bytes, dtype=torch.uint8, device=g.device))
        crow32, col32 = g.crow.to(torch.int32), g.col.to(torch.int32)
        prep = time.perf_counter()
        w.plan(crow32, col32, g.n, g.n_cols, 1, 1, case.heads, case.heads, case.d, sm_scale=case.scale,
               q_data_type=case.dt, kv_data_type=case.dt, o_data_type=case.dt)
        synchronize(g.device)
        prep_ms = (time.perf_counter() - prep) * 1e3

        def fn():
            return w.run(case.q, case.k, case.v)

        out = fn()
        err = rel_error(out, case.ref)
        del out
        ms = time_on(g.device, fn, args.warmup, args.reps)
        kind = "tensor cores (prefill)" if getattr(w, "_use_tensor_cores", False) else "CUDA cores (decode)"
        return dict(median_ms=ms, dtype_used=case.dtype, rel_err=err,
                    variant=f"BlockSparseAttentionWrapper R=C=1, {kind} kernel, flashinfer {fi.__version__}",
                    note="plan() (first call JIT-compiles) outside the timed region",
                    extra=dict(prep_ms=prep_ms))

    attempt(rec, "flashinfer_bsr", case, fn_record)


# --------------------------------------------------------------------------------------------
# Training steps (opt-in)
# --------------------------------------------------------------------------------------------


def segment_softmax(x, row, n):
    """Row softmax of per-edge values x (nnz, or nnz x H) grouped by `row`, in f32."""
    x = x.float()
    shape = (n,) + tuple(x.shape[1:])
    m = torch.full(shape, -math.inf, device=x.device).scatter_reduce(
        0, row.view(-1, *([1] * (x.dim() - 1))).expand_as(x), x.detach(), "amax")
    ex = torch.exp(x - m[row])
    den = torch.zeros(shape, device=x.device).index_add(0, row, ex)
    return ex / den[row]


def run_train_torch_sparse(rec, case, args):
    """Forward + backward of sampled_addmm -> segment softmax -> sparse.mm through autograd."""
    g = case.g

    def fn_record():
        fails = []
        for dt_try in _dtype_tries(case.dtype):
            try:
                dt = TDT[dt_try]
                # Fresh leaves: a plain .to() would hand back case.q itself when the dtypes match.
                qg, kg, vg = (x.detach().to(dt, copy=True).requires_grad_() for x in (case.q, case.k, case.v))
                dout = torch.randn(g.n, case.heads, case.d, device=g.device, generator=case.gen).to(dt)
                a = torch.sparse_csr_tensor(g.crow, g.col, torch.ones(g.nnz, device=g.device, dtype=dt), size=(g.n, g.n_cols))

                def step():
                    outs = []
                    for h in range(case.heads):
                        s = torch.sparse.sampled_addmm(a, qg[:, h].contiguous(), kg[:, h].t().contiguous(),
                                                       beta=0.0, alpha=case.scale)
                        pv = segment_softmax(s.values(), g.row, g.n).to(dt)
                        ph = torch.sparse_csr_tensor(g.crow, g.col, pv, size=(g.n, g.n_cols))
                        outs.append(torch.sparse.mm(ph, vg[:, h].contiguous()))
                    out = torch.stack(outs, 1)
                    qg.grad = kg.grad = vg.grad = None
                    out.backward(dout)
                    return out

                out = step()
                if qg.grad is None or kg.grad is None or vg.grad is None:
                    raise RuntimeError("autograd gave no gradient for Q, K or V")
                err = rel_error(out.detach(), case.ref)
                del out
                ms = time_on(g.device, step, args.warmup, args.reps)
                return dict(median_ms=ms, dtype_used=dt_try, rel_err=err, variant=f"autograd, {dt_try}",
                            note=join_notes(per_head_note(case), "rel_err of the forward output only"))
            except (RuntimeError, NotImplementedError) as err:
                if isinstance(err, torch.cuda.OutOfMemoryError):
                    raise
                fails.append(f"{dt_try}: {one_line(err, 120)}")
                synchronize(g.device)
        raise RuntimeError("; ".join(fails))

    attempt(rec, "torch_sparse_train", case, fn_record)


def run_train_pyg(rec, case, args):
    """Forward + backward of the PyG-style composition (TransformerConv's attention) through autograd."""
    g = case.g

    def fn_record():
        dt = case.dt
        qg, kg, vg = (x.clone().requires_grad_() for x in (case.q, case.k, case.v))
        dout = torch.randn(g.n, case.heads, case.d, device=g.device, generator=case.gen).to(dt)
        try:
            from torch_geometric.utils import softmax as pyg_softmax
            note = "torch_geometric.utils.softmax"
        except ImportError:
            pyg_softmax = None
            note = "scatter softmax (torch_geometric missing)"

        def step():
            alpha = (qg[g.row] * kg[g.col]).sum(dim=-1) * case.scale
            alpha = pyg_softmax(alpha, g.row, num_nodes=g.n) if pyg_softmax else segment_softmax(alpha, g.row, g.n).to(dt)
            out = torch.zeros(g.n, case.heads, case.d, device=g.device, dtype=dt).index_add(0, g.row, vg[g.col] * alpha.unsqueeze(-1))
            qg.grad = kg.grad = vg.grad = None
            out.backward(dout)
            return out

        out = step()
        err = rel_error(out.detach(), case.ref)
        del out
        ms = time_on(g.device, step, args.warmup, args.reps)
        return dict(median_ms=ms, dtype_used=case.dtype, rel_err=err, variant=note,
                    note="rel_err of the forward output only")

    attempt(rec, "pyg_train", case, fn_record)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def common_args(ap):
    """The options torch_peers.py and fused_peers.py share."""
    ap.add_argument("graph")
    ap.add_argument("--name", help="graph name in the records (default: file stem)")
    ap.add_argument("--symmetrize", action="store_true", help="A + Aᵀ + I before timing")
    ap.add_argument("--heads", nargs="+", default=["1"], help="e.g. 1 8, or 1,8")
    ap.add_argument("--head-dim", nargs="+", default=["64"], help="e.g. 64 128, or 64,128")
    ap.add_argument("--dtype", nargs="+", default=["f16"], help="f16, bf16, f32 (or a comma list)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--time-budget-ms", type=float, default=0.0,
                    help="a form whose --reps timed calls would take longer runs fewer of them "
                         f"(at least {MIN_REPS}; the last warm-up call sets the count) and warms up with "
                         "fewer calls (at least 2) once they take half of it; 0: always --warmup, --reps")
    ap.add_argument("--json", required=True)
    ap.add_argument("--ok-only", action="store_true",
                    help="leave out the records of cases a peer could not run (median_ms null), for "
                         "readers that predate the status field")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test; times mean nothing)")


def parse_common(ap, args):
    args.heads = int_list(args.heads)
    args.head_dim = int_list(args.head_dim)
    args.dtype = [x for v in args.dtype for x in v.split(",") if x]
    for dt in args.dtype:
        if dt not in TDT:
            ap.error(f"--dtype: {dt!r} is not one of f16, bf16, f32")
    if args.time_budget_ms < 0:
        ap.error("--time-budget-ms: must be >= 0")
    TIMING["budget_ms"] = args.time_budget_ms
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device (pass --device cpu for a smoke test)")
    return args


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap)
    # The training peers are opt-in (--ops torch_sparse_train pyg_train): torch's autograd
    # through sparse.mm materialises a dense n x n gradient and, on R-MAT 16, died with SIGFPE,
    # taking the forward peers' records of that graph with it.
    ap.add_argument("--ops", nargs="+", default=DEFAULT_OPS, help=f"any of {' '.join(ALL_OPS)}")
    ap.add_argument("--dense-max-n", type=int, default=20000)
    ap.add_argument("--flex-blocks", nargs="+", type=int, default=[128, 64, 32, 16],
                    help="FlexAttention's BlockMask block sizes to try (powers of two >= 16); the fastest is kept")
    args = parse_common(ap, ap.parse_args())
    args.ops = [x for v in args.ops for x in v.split(",") if x]
    for op in args.ops:
        if op not in ALL_OPS:
            ap.error(f"--ops: unknown peer {op!r} (known: {' '.join(ALL_OPS)})")
    for b in args.flex_blocks:
        if b < 16 or b & (b - 1):
            ap.error(f"--flex-blocks: {b} is not a power of two >= 16")

    g = load_graph(args.graph, args.name, args.symmetrize, args.device)
    where = torch.cuda.get_device_name() if is_cuda(g.device) else "the CPU"
    print(f"[peers] {g.name}: n={g.n} nnz={g.nnz} on {where}", flush=True)
    rec = Recorder(g, args, g.device)

    for dtype in args.dtype:
        for heads in args.heads:
            for d in args.head_dim:
                case = Case(g, heads, d, dtype, args.seed)
                run_cusparse(rec, case, args)
                if "pyg_attention" in args.ops:
                    run_pyg(rec, case, args)
                if "dense_sdpa" in args.ops:
                    run_dense_sdpa(rec, case, args)
                if "flex_attention" in args.ops:
                    run_flex(rec, case, args, rcm=False)
                if "flex_attention_rcm" in args.ops:
                    run_flex(rec, case, args, rcm=True)
                if "flashinfer_bsr" in args.ops:
                    run_flashinfer(rec, case, args)
                if "torch_sparse_train" in args.ops:
                    run_train_torch_sparse(rec, case, args)
                if "pyg_train" in args.ops:
                    run_train_pyg(rec, case, args)
                rec.write(args.json, args.ok_only)
                case.drop()
                free_memory()

    rec.write(args.json, args.ok_only)
    print(f"[peers] wrote {len(rec.records)} records to {args.json}")


if __name__ == "__main__":
    main()
