#!/usr/bin/env python3
"""The fused sparse-attention kernels this field compares itself with, built from their public
sources on the GPU machine by build_peers.sh beside this script (their code is not part of this
repository: it exports them at pinned commits and builds them into --build-dir), timed on the same graph
with the same inputs, f64 reference, CUDA-event timing and records as torch_peers.py (whose
helpers this imports; see its docstring for every record field, status and the tolerances).

  fused3s_preprocess   Fused3S (HPCForge/Fused3S) F3S.preprocess_gpu: the graph into its BSB
                       format (16 x 16 tensor-core blocks, bitmaps, row windows sorted by work),
                       once per graph; the same time is written beside every case.
  fused3s              F3S.f3s_1tb1rw_scheduled_permuteV, the paper's kernel (8 warps per block):
                       f16 only, head_dim a multiple of 32, one head per call (heads in a loop).
                       It has no scale, so Q is scaled (and rounded to f16) before the call.
  fused3s_scaleqk      F3S.f3s_1tb1rw_scheduled_permuteV_scaleQK with scalingFactor = sqrt(d):
                       the kernel divides the scores by it, in f32.
  flashsparse_preprocess  FlashSparse (ParCIS/FlashSparse) FS_Block.blockProcess_sddmm_balance_gnn
                       (CPU: 8-row windows, 16-column vectors, parts of 32 blocks) and the copies
                       to the GPU, once per graph.
  flashsparse          FS_SDDMM.forward_gen_fp16_gnn -> softmax -> FS_SpMM.forward_fp16_gnn for f16
                       (forward_gen_tf32_gnn / forward_tf32_gnn for f32: dtype_used "tf32"); bf16
                       unsupported. FlashSparse ships no softmax for this pipeline (its AGNN layer
                       takes exp without the max and counts padded slots), so the softmax is ours
                       in torch, f32, with max subtraction, over the real edges of its value array,
                       inside the timed region (parts_ms gives the three stages apart). One head a
                       call (heads in a loop).
  dfgnn_tiling         DF-GNN (paoxiaode/DF-GNN) GTConvFuse_inference_tiling: f32, any number of
                       heads in one call, head_dim in {32, 64, 128, 256, 512, 1024}. The scale goes
                       in as the per-edge value `val` (the kernel multiplies each score by it).
  dfgnn_hyper          GTConvFuse_inference_hyper (CSR + COO rows, 8 rows a block, the scores of a
                       block's edges in shared memory): f32; unsupported where a block of 8 rows
                       has more than 12288 edges (48 KiB: the kernel does not opt in to more).
  dfgnn_hyper_train    DF-GNN's training path, GTConvFuse_hyper through autograd: forward
                       (gt_hyper_forward, which also stores each edge's probability, heads x nnz
                       f32) + backward (gt_backward: a row kernel for dQ and the edge gradients,
                       a column kernel over its CSC for dK and dV), timed as one step on leaves
                       requiring grad. f32; the hyper kernel's shared-memory limit. Its backward
                       ignores the edge values, so the scale is folded into Q inside the step
                       (autograd carries it to dQ). Its rel_err is the largest of the output's and
                       the three gradients' errors against f64 autograd of the same step (note:
                       each); where the reference would not fit, the output's alone. Its backward
                       indexes the probabilities and edge gradients without the head (head 0's
                       for every head, the heads' blocks racing on one row of edge gradients):
                       right at one head only, its other records WRONG and their times those of
                       that racing kernel.

Timing: Fused3S synchronises inside each call and times its kernel with its own CUDA events:
median_ms is the median of those (kernel only), median_ms_call the median of our CUDA events
around the call (with its output allocation and host round trip). FlashSparse and DF-GNN launch
asynchronously: CUDA events around the call.

Each family (fused3s, flashsparse, dfgnn) runs in a child process: these kernels call exit() on
a CUDA error and can leave a broken CUDA context. When a child dies, the case it was running gets
"error" records with the exit status and its last line of output, and a new child goes on with
the next case. A module that does not import gives "unsupported" records with the reason.

  python3 fused_peers.py G.csr --name G --build-dir OUT --heads 1 8 --head-dim 64 128 \\
      --dtype f16 f32 --json peers-fused-G.json
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import deque

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peers as tp  # noqa: E402

FAMILIES = {
    "fused3s": ["fused3s_preprocess", "fused3s", "fused3s_scaleqk"],
    "flashsparse": ["flashsparse_preprocess", "flashsparse"],
    "dfgnn": ["dfgnn_tiling", "dfgnn_hyper", "dfgnn_hyper_train"],
}
REPO = {"fused3s": "Fused3S", "flashsparse": "FlashSparse", "dfgnn": "DF-GNN"}
N_WARP_PER_BLOCK = 8  # Fused3S's own scripts run its 1tb1rw kernels with 8 warps per block.


def need_cuda(g):
    if not tp.is_cuda(g.device):
        raise tp.Unsupported("needs a CUDA device")


def sources(build_dir):
    """{repository folder name: "github.com/owner/name@commit"} from the build's SOURCES.txt."""
    out = {}
    for path in (os.path.join(build_dir, "lib", "SOURCES.txt"), os.path.join(build_dir, "SOURCES.txt")):
        if os.path.exists(path):
            for line in open(path):
                parts = line.split()
                if len(parts) >= 3 and not line.startswith("#"):
                    out[parts[0]] = f"{parts[1]}@{parts[2][:12]}"
            break
    return out


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def time_self_reported(fn, warmup, reps):
    """For a call that synchronises and returns its own kernel time (ms): (median of those, median
    of CUDA events around the call, the last result)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    own, call = [], []
    res = None
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        ms, res = fn()
        e.record()
        e.synchronize()
        own.append(ms)
        call.append(s.elapsed_time(e))
    return median(own), median(call), res


def wall_ms(fn, reps=1):
    """Median wall-clock ms of fn() (synchronised), for one-off preprocessing; and its result."""
    times, res = [], None
    for _ in range(max(1, reps)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return median(times), res


def prep_record(rec, peer, case, ms, variant, note, source):
    """A preprocessing time: status ok, no output (rel_err and ok null)."""
    r = rec._base(peer, case.heads, case.d, case.dtype)
    r.update(status="ok", median_ms=float(ms), dtype_used=None, variant=variant, rel_err=None,
             tolerance=tp.TOLERANCE[case.dtype], ok=None, reason=None, note=note,
             timing="wall clock around the call, synchronised (host + GPU)")
    r.update(rec._tail())
    if source:
        r["source"] = source
    rec.records.append(r)
    if rec.sink:
        rec.sink(r)
    print(f"[fused] {peer:24s} H={case.heads} D={case.d} {case.dtype}: {ms:.3f} ms (preprocessing)", flush=True)


def bsb_edges(rwo, atox, bitmap, chunk=1 << 15):
    """(rows, cols) of every set bit of Fused3S's block format: 16 x 16 blocks, 4 uint64 a block,
    sub-block (col // 8) * 2 + row // 8, bit 63 - ((row % 8) * 8 + col % 8) (its utils.cu
    update_bitmap, read back the same way by its kernels); row = window * 16 + local row, column
    from sparseAToXidx."""
    dev = atox.device
    rwo = rwo.long()
    ntcb = int(rwo[-1])
    win = torch.repeat_interleave(torch.arange(len(rwo) - 1, device=dev), rwo[1:] - rwo[:-1])
    bm = bitmap.view(torch.int64).reshape(ntcb, 4)
    atox = atox.long()
    shifts = torch.arange(64, device=dev, dtype=torch.int64)
    rows, cols = [], []
    for t0 in range(0, ntcb, chunk):
        t, sub, bit = (((bm[t0:t0 + chunk, :, None] >> shifts) & 1).bool()).nonzero(as_tuple=True)
        t = t + t0
        lid = 63 - bit
        rows.append(win[t] * 16 + (sub % 2) * 8 + lid // 8)
        cols.append(atox[t * 16 + (sub // 2) * 8 + lid % 8])
    if not rows:
        e = torch.zeros(0, dtype=torch.int64, device=dev)
        return e, e
    return torch.cat(rows), torch.cat(cols)


def bsb_mismatch(g, rwo, atox, bitmap):
    """(edges of g missing from Fused3S's bitmap, bits that are not edges of g)."""
    r, c = bsb_edges(rwo, atox, bitmap)
    have = r * g.n_cols + c
    want = g.row * g.n_cols + g.col
    both = torch.isin(want, have)
    return int((~both).sum()), int(have.numel() - int(both.sum()))


# --------------------------------------------------------------------------------------------
# Fused3S
# --------------------------------------------------------------------------------------------


class Fused3S:
    family = "fused3s"

    def __init__(self, g, args, src):
        need_cuda(g)
        import F3S  # noqa: F401 - an import failure is reported by the caller
        self.F3S, self.g, self.args, self.src = F3S, g, args, src
        self.prep = None
        self.prep_error = None
        self.prep_status = "unsupported"
        n = g.n
        self.n16 = (n + 15) // 16 * 16
        # preprocess_gpu exit()s when a row window has more tensor-core blocks than its shared
        # memory holds ((2 * blocks + 1) * 4 bytes > 200 KiB): check first.
        w = g.row // 16
        key = torch.unique(w * g.n_cols + g.col)
        cols_per_window = torch.bincount(key // g.n_cols, minlength=self.n16 // 16)
        max_tcb = int(((cols_per_window + 15) // 16).max()) if g.nnz else 0
        if (2 * max_tcb + 1) * 4 > 204800:
            self.prep_error = (f"a row window has {max_tcb} 16 x 16 blocks: preprocess_gpu needs "
                               f"{(2 * max_tcb + 1) * 4} B of shared memory > 204800 and exits")
            return
        crow32, col32 = g.crow.to(torch.int32), g.col.to(torch.int32)
        row32 = g.row.to(torch.int32)
        nrw = self.n16 // 16

        def pre():
            # edgeToRow must already hold each edge's row: preprocess_gpu's fill_edgeToRow
            # (Fused3S src/utils.cu:348) steps through a row's edges by gridDim.x = ceil(n/32)
            # instead of blockDim.x = 32, so for n > 1024 it never writes the in-row positions
            # p with p % ceil(n/32) >= 32 and leaves them as passed in. Zeros put those edges in
            # the first row of their 16-row window (rows of degree > 32 lose edges, rows
            # 16k gain them). It only ever writes the right value, so the rows make it exact.
            return self.F3S.preprocess_gpu(
                col32, crow32, n, 16, 16,
                torch.zeros(nrw, dtype=torch.int32, device=g.device),
                torch.zeros(g.nnz, dtype=torch.int32, device=g.device),
                row32.clone())

        self.prep_ms, res = wall_ms(pre, reps=args.prep_reps)
        rwo, srw, _, _, _, atox, bitmap, ntcb = res
        self.ntcb = int(ntcb)
        missing, extra = bsb_mismatch(g, rwo, atox, bitmap)
        if missing or extra:
            self.prep_status = "error"  # a wrong preprocessing, not a shape it cannot take
            self.prep_error = (f"preprocess_gpu's block bitmap is not the graph: {missing} edges "
                               f"missing, {extra} extra")
            return
        self.prep = (rwo, srw, atox, bitmap)

    def run_case(self, rec, case):
        g, args = self.g, self.args
        extra_src = dict(source=self.src)
        if self.prep is None and self.prep_error is None:
            raise RuntimeError("no preprocessing")
        if self.prep_error:
            for peer in FAMILIES[self.family]:
                rec.limit(peer, case.heads, case.d, case.dtype, self.prep_status, self.prep_error, **extra_src)
            return
        prep_record(rec, "fused3s_preprocess", case, self.prep_ms,
                    f"preprocess_gpu, 16 x 16 blocks: {self.ntcb} blocks",
                    "measured once per graph (median of --prep-reps runs); independent of heads, head_dim, dtype",
                    self.src)
        rwo, srw, atox, bitmap = self.prep

        def limits():
            if case.dtype != "f16":
                raise tp.Unsupported("f16 only (the kernels read Q, K, V as half)")
            if case.d % 32:
                raise tp.Unsupported(f"head_dim {case.d}: the kernel steps through Q.K in 32 columns")
            if 96 * case.d + 3072 > 48 * 1024:
                raise tp.Unsupported(f"head_dim {case.d}: its shared memory passes 48 KiB (no opt-in)")

        def per_head(x, scale=None):
            # (n16, d) contiguous f16 per head, rows padded with zeros to a multiple of 16: the
            # kernel loads Q by 16-row windows (and would read past a shorter array).
            out = []
            for h in range(case.heads):
                xh = x[:, h].float() if scale is not None else x[:, h]
                if scale is not None:
                    xh = (xh * scale).to(torch.float16)
                pad = torch.zeros(self.n16, case.d, dtype=torch.float16, device=g.device)
                pad[: g.n] = xh
                out.append(pad)
            return out

        for peer in ("fused3s", "fused3s_scaleqk"):
            def fn_record(peer=peer):
                limits()
                scaleqk = peer == "fused3s_scaleqk"
                qh = per_head(case.q, None if scaleqk else case.scale)
                kh, vh = per_head(case.k), per_head(case.v)
                if scaleqk:
                    kern = self.F3S.f3s_1tb1rw_scheduled_permuteV_scaleQK
                    sf = math.sqrt(case.d)

                    def one(h):
                        return kern(rwo, srw, atox, bitmap, g.n, qh[h], kh[h], vh[h], sf, N_WARP_PER_BLOCK)
                else:
                    kern = self.F3S.f3s_1tb1rw_scheduled_permuteV

                    def one(h):
                        return kern(rwo, srw, atox, bitmap, g.n, qh[h], kh[h], vh[h], N_WARP_PER_BLOCK)

                def call():
                    tot, outs = 0.0, []
                    for h in range(case.heads):
                        t, o, _ = one(h)
                        tot += float(t)
                        outs.append(o)
                    return tot, outs

                _, outs = call()
                out = torch.stack(outs, 1)
                err = tp.rel_error(out, case.ref)
                del out, outs
                own, around, _ = time_self_reported(call, args.warmup, args.reps)
                note = ["output f32", f"{N_WARP_PER_BLOCK} warps per block"]
                if not scaleqk:
                    note.append("no scale in the kernel: Q scaled by 1/sqrt(d) and rounded to f16 before the call")
                else:
                    note.append(f"scalingFactor sqrt(d) = {sf:.4f}: scores divided by it in f32")
                note.append("Q, K, V rows padded with zeros to a multiple of 16 outside the timed region")
                note.append("zero scores are dropped by the kernel (it tests S == 0 for masked slots)")
                if case.heads > 1:
                    note.append("one head per call, heads in a loop (times summed)")
                return dict(median_ms=own, dtype_used="f16", rel_err=err,
                            variant=("f3s_1tb1rw_scheduled_permuteV_scaleQK" if scaleqk
                                     else "f3s_1tb1rw_scheduled_permuteV (Q pre-scaled)")
                            + (", per-head loop" if case.heads > 1 else ""),
                            note="; ".join(note), timing="the peer's own CUDA events around its kernel",
                            extra=dict(median_ms_call=around, prep_ms=self.prep_ms, source=self.src))

            tp.attempt(rec, peer, case, fn_record)


# --------------------------------------------------------------------------------------------
# FlashSparse
# --------------------------------------------------------------------------------------------


def _fs_window_ranks(row, col, n_cols, n_pad, window):
    """Per edge: its window and its column's rank in the window's ascending column union (as
    blockProcess_sddmm_balance_gnn builds it); per window: the union's size and first index."""
    dev = row.device
    nwin = n_pad // window
    w = row // window
    ukey, inv = torch.unique(w * n_cols + col, sorted=True, return_inverse=True)
    vsize = torch.bincount(ukey // n_cols, minlength=nwin)
    wstart = torch.zeros(nwin + 1, dtype=torch.int64, device=dev)
    wstart[1:] = torch.cumsum(vsize, 0)
    return w, inv - wstart[w], vsize, wstart


def flashsparse_positions(row, col, n_cols, n_pad, chunk, window=8, part_cols=32 * 16):
    """Where each edge's value sits in FlashSparse's gnn value array (one array for the whole
    graph, windows one after the other, 8 values per column of a window), as its SpMM reads it
    and its SDDMM means to write it:

      windows of `window` rows; a window's columns are the sorted union of its rows' columns;
      they are cut into parts of `part_cols` (32 blocks of 16: the load balancing of
      blockProcess_sddmm_balance_gnn); within a part, chunks of `chunk` columns (8 for fp16 =
      m16n8k16 tiles, 4 for tf32 = m16n8k8), each chunk row-major window-row x chunk column,
      the last chunk of a part as wide as what is left. `chunk` 16 with an unbounded part is
      blockProcess's value mask.

    Returns (pos int64 per edge, total length, columns per window)."""
    w, rank, vsize, wstart = _fs_window_ranks(row, col, n_cols, n_pad, window)
    p0 = (rank // part_cols) * part_cols
    pw = torch.clamp(vsize[w] - p0, max=part_cols)  # columns of the edge's part
    kk = rank - p0
    c = kk // chunk
    wc = torch.clamp(pw - c * chunk, max=chunk)  # width of the edge's chunk
    pos = window * (wstart[w] + p0) + window * chunk * c + (row % window) * wc + kk % chunk
    return pos, int(window * wstart[-1]), vsize


def flashsparse_store_positions(row, col, n_cols, n_pad, tf32, window=8, part_cols=32 * 16):
    """Where FS_SDDMM.forward_gen_{fp16,tf32}_gnn actually stores each score: the intended slot,
    except in a part's last 16-column block when it has 9 to 15 columns, columns 8 and up. There
    its output tile (SDDMM/sddmm_utils/output_tile.h) advances the store pointer a second time,
    so row n's score lands 16·⌊n/2⌋ (fp16) or 8·⌊n/2⌋ + (j − 8), 32 + 8·⌊n/2⌋ + (j − 12) (tf32)
    slots further: on another edge's slot, or past the array."""
    pos, total, vsize = flashsparse_positions(row, col, n_cols, n_pad, 4 if tf32 else 8, window, part_cols)
    w, rank, _, _ = _fs_window_ranks(row, col, n_cols, n_pad, window)
    p0 = (rank // part_cols) * part_cols
    kk = rank - p0
    left = torch.clamp(vsize[w] - p0, max=part_cols) - 16 * (kk // 16)  # columns from this block on
    j = kk % 16
    half = (row % window) // 2
    bad = (left < 16) & (j >= 8)
    shift = torch.where(j < 12, 8 * half + (j - 8), 32 + 8 * half + (j - 12)) if tf32 else 16 * half
    return torch.where(bad, pos + shift, pos)


def flashsparse_pad_windows(offs, cols, n_cols, n_pad, window=8, wide=16, min_residue=9):
    """The harness's way around that store: every window whose column union leaves 9 to 15
    columns in its last 16-column block gets dummy columns n_cols, n_cols + 1, … on its first
    row up to the next multiple of 16. They sort after the real columns (whose ranks, blocks,
    parts and the SDDMM's work stay the same); K and V get 16 zero rows for them; their scores
    are never read and their probabilities are 0. Returns (offs, cols) of the padded CSR as
    int32, the index of each real edge in it, and the number of dummies."""
    offs = np.asarray(offs, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    n_rows = len(offs) - 1
    nwin = n_pad // window
    row = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(offs))
    vsize = np.bincount(np.unique((row // window) * n_cols + cols) // n_cols, minlength=nwin)[:nwin]
    r = vsize % wide
    extra = np.zeros(n_rows, dtype=np.int64)
    extra[np.arange(nwin) * window] = np.where(r >= min_residue, wide - r, 0)
    offs2 = np.zeros(n_rows + 1, dtype=np.int64)
    offs2[1:] = np.cumsum(np.diff(offs) + extra)
    real = offs2[row] + (np.arange(len(cols), dtype=np.int64) - offs[row])
    cols2 = np.empty(int(offs2[-1]), dtype=np.int64)
    cols2[real] = cols
    dummy = np.ones(len(cols2), dtype=bool)
    dummy[real] = False
    dpos = np.flatnonzero(dummy)
    first = np.repeat(offs2[:-1] + np.diff(offs), extra)  # where each row's dummies begin
    cols2[dpos] = n_cols + (dpos - first)
    return offs2.astype(np.int32), cols2.astype(np.int32), real, int(extra.sum())


class FlashSparse:
    family = "flashsparse"
    WINDOW, WIDE, PART = 8, 16, 32

    def __init__(self, g, args, src):
        need_cuda(g)
        import FS_Block  # noqa: F401
        import FS_SDDMM  # noqa: F401
        import FS_SpMM  # noqa: F401
        self.FS_Block, self.FS_SDDMM, self.FS_SpMM = FS_Block, FS_SDDMM, FS_SpMM
        self.g, self.args, self.src = g, args, src
        n = g.n
        # Its loaders pad the rows to a multiple of 16 (blockProcess drops a last partial window).
        self.n_pad = (n + 15) // 16 * 16
        offs = np.concatenate([g.offs, np.full(self.n_pad - n, g.offs[-1])])
        dev = g.device
        self.prep_ms, self.maps = {}, {}
        # "published": the graph as it is; "padded": around the SDDMM's store (see
        # flashsparse_pad_windows), the form timed.
        for form in ("published", "padded"):
            if form == "padded":
                offs2, cols2, real, n_dummy = flashsparse_pad_windows(offs, g.cols, g.n_cols, self.n_pad)
            else:
                offs2, cols2 = offs.astype(np.int32), g.cols.astype(np.int32)
                real, n_dummy = np.arange(g.nnz), 0

            def pre(offs2=offs2, cols2=cols2):
                out = self.FS_Block.blockProcess_sddmm_balance_gnn(
                    torch.from_numpy(offs2), torch.from_numpy(cols2), self.WINDOW, self.WIDE, self.PART)
                return [x.to(dev) for x in out]

            self.prep_ms[form], (rp, ci, deg, twin, tatom) = wall_ms(pre)
            vec = rp[1:] - rp[:-1]
            max_vectors = int(vec.max()) if vec.numel() else 0
            max_vectors = (max_vectors + self.WIDE - 1) // self.WIDE
            max_part = (max_vectors + 3) // 4 * 4  # as its loaders compute `inputInfo.max`
            row2 = torch.repeat_interleave(torch.arange(self.n_pad, device=dev),
                                           torch.from_numpy(np.diff(offs2).astype(np.int64)).to(dev))
            col2 = torch.from_numpy(cols2.astype(np.int64)).to(dev)
            realt = torch.from_numpy(real).to(dev)
            nc = g.n_cols + (self.WIDE if n_dummy else 0)
            pos, stored = {}, {}
            for chunk in (8, 4):
                p, total, _ = flashsparse_positions(row2, col2, nc, self.n_pad, chunk)
                st = flashsparse_store_positions(row2, col2, nc, self.n_pad, chunk == 4)
                pos[chunk], stored[chunk] = p[realt], st[realt]
            # Our map must agree with blockProcess's: its value mask (1 on edges, in 16-column
            # blocks) has as many entries as our total and ones exactly on our edges.
            mask_pos, _, _ = flashsparse_positions(row2, col2, nc, self.n_pad, self.WIDE, part_cols=1 << 62)
            layout_ok = (int(deg.numel()) == total and int(rp[-1]) * self.WINDOW == total
                         and bool((deg[mask_pos] == 1).all())
                         and int((deg != 0).sum()) == g.nnz + n_dummy)
            misplaced = {c: int((stored[c] != pos[c]).sum()) for c in (8, 4)}
            if form == "padded" and any(misplaced.values()):
                layout_ok = False  # the padding did not keep the SDDMM off its store bug
            self.maps[form] = dict(rp=rp, ci=ci, deg=deg, twin=twin, tatom=tatom, max_part=max_part,
                                   pos=pos, total=total, layout_ok=layout_ok, n_dummy=n_dummy,
                                   k_extra=self.WIDE if n_dummy else 0,
                                   misplaced=misplaced)
        torch.cuda.synchronize()

    def run_case(self, rec, case):
        g, args = self.g, self.args
        pad = self.maps["padded"]
        prep_record(rec, "flashsparse_preprocess", case, self.prep_ms["padded"],
                    "FS_Block.blockProcess_sddmm_balance_gnn(window 8, wide 16, partSize 32) + copies to the GPU",
                    f"measured once per graph; CPU (OpenMP); on the graph with {pad['n_dummy']} dummy columns "
                    f"(see the flashsparse record); {self.prep_ms['published']:.1f} ms on the graph as it is",
                    self.src)

        def pipeline(form, dt, tf32):
            """The SDDMM -> softmax -> SpMM of one form of the graph, and its SDDMM stage."""
            m = self.maps[form]
            if not m["layout_ok"]:
                raise RuntimeError("FS_Block's value layout is not the one this script maps the edges into")
            pos = m["pos"][4 if tf32 else 8]
            if tf32:
                sddmm, spmm = self.FS_SDDMM.forward_gen_tf32_gnn, self.FS_SpMM.forward_tf32_gnn
            else:
                sddmm, spmm = self.FS_SDDMM.forward_gen_fp16_gnn, self.FS_SpMM.forward_fp16_gnn

            def rows(x):  # K and V with zero rows for the dummy columns
                x = x.to(dt).contiguous()
                return torch.cat([x, x.new_zeros(m["k_extra"], x.shape[1])]) if m["k_extra"] else x

            qh = [case.q[:, h].to(dt).contiguous() for h in range(case.heads)]
            kh = [rows(case.k[:, h]) for h in range(case.heads)]
            vh = [rows(case.v[:, h]) for h in range(case.heads)]
            row, scale = g.row, case.scale

            def s_stage(h):
                return sddmm(case.d, m["rp"], m["ci"], m["deg"], m["twin"], qh[h], kh[h], m["max_part"])[0]

            def softmax_stage(att):
                # Softmax over each row's real edges, scale applied here in f32 (the SDDMM has no
                # scale), written back into the value array (other slots stay 0).
                x = att[pos].float() * scale
                mx = torch.full((g.n,), -math.inf, device=g.device).scatter_reduce(0, row, x, "amax")
                ex = torch.exp(x - mx[row])
                den = torch.zeros(g.n, device=g.device).index_add_(0, row, ex)
                p = torch.zeros_like(att)
                p[pos] = (ex / den[row]).to(att.dtype)
                return p

            def m_stage(p, h):
                return spmm(m["rp"], m["ci"], p, m["twin"], m["tatom"], vh[h], self.n_pad, case.d, g.n)[0]

            def call():
                return torch.stack([m_stage(softmax_stage(s_stage(h)), h) for h in range(case.heads)], 1)

            def sddmm_err():  # the scores' own error on the real edges, scaled as the softmax does
                e = tp.score_error(g, case.q, case.k, scale,
                                   [s_stage(h)[pos].float() * scale for h in range(case.heads)])
                return e if math.isfinite(e) else None

            return call, s_stage, softmax_stage, m_stage, sddmm_err

        def fn_record():
            if case.dtype == "bf16":
                raise tp.Unsupported("no bf16 kernels (fp16 and tf32 only)")
            if case.d % 16:
                raise tp.Unsupported(f"head_dim {case.d}: its SDDMM steps 16 columns at a time (no remainder)")
            tf32 = case.dtype == "f32"
            dt = torch.float32 if tf32 else torch.float16
            # As published: its scores are misplaced where a part ends in 9..15 columns.
            pub_call, _, _, _, pub_sddmm_err = pipeline("published", dt, tf32)
            out = pub_call()
            pub_err = tp.rel_error(out, case.ref)
            del out
            pub_sddmm = pub_sddmm_err()
            call, s_stage, softmax_stage, m_stage, sddmm_err = pipeline("padded", dt, tf32)
            out = call()
            err = tp.rel_error(out, case.ref)
            del out
            ms = tp.time_ms(call, args.warmup, args.reps)
            att0 = s_stage(0)
            p0 = softmax_stage(att0)
            parts = dict(
                sddmm=tp.time_ms(lambda: [s_stage(h) for h in range(case.heads)], args.warmup, args.reps),
                softmax=tp.time_ms(lambda: [softmax_stage(att0) for _ in range(case.heads)], args.warmup, args.reps),
                spmm=tp.time_ms(lambda: [m_stage(p0, h) for h in range(case.heads)], args.warmup, args.reps))
            kind = "tf32" if tf32 else "fp16"
            pub = self.maps["published"]
            note = [f"{pad['n_dummy']} dummy columns pad the windows whose last 16-column block has 9-15 "
                    f"columns: FlashSparse's gnn SDDMM misplaces {pub['misplaced'][4 if tf32 else 8]} of the "
                    f"{g.nnz} scores there (output_tile.h stores them 16 slots per row pair too far); "
                    f"as published its output error is {pub_err:.2e}",
                    f"softmax in torch (f32, max-subtracted, over the {g.nnz} real slots of {pad['total']}), "
                    "timed inside",
                    ("SDDMM and SpMM accumulate in f16 (mma .f16.f16.f16.f16)" if not tf32
                     else "SDDMM and SpMM on tf32 tensor cores (f32 bits truncated), f32 accumulation"),
                    "scale applied in the softmax"]
            if case.heads > 1:
                note.append("one head per call, heads in a loop")
            return dict(median_ms=ms, dtype_used="tf32" if tf32 else "f16", rel_err=err,
                        variant=f"forward_gen_{kind}_gnn -> torch softmax -> forward_{kind}_gnn, windows padded"
                                + (", per-head loop" if case.heads > 1 else ""),
                        note="; ".join(note),
                        extra=dict(parts_ms={k: round(v, 5) for k, v in parts.items()},
                                   stage_rel_err=dict(sddmm=sddmm_err()),
                                   published=dict(rel_err=pub_err, sddmm_rel_err=pub_sddmm,
                                                  misplaced=pub["misplaced"][4 if tf32 else 8]),
                                   dummy_columns=pad["n_dummy"],
                                   prep_ms=self.prep_ms, source=self.src))

        tp.attempt(rec, "flashsparse", case, fn_record)


# --------------------------------------------------------------------------------------------
# DF-GNN
# --------------------------------------------------------------------------------------------


class DFGNN:
    family = "dfgnn"
    HYPER_ROWS = 8           # its hyper kernel: 8 warps a block, one row each
    SMEM_FLOATS = 48 * 1024 // 4

    def __init__(self, g, args, src):
        need_cuda(g)
        import dfgnn_fused_gtconv as ops  # the published DFGNN/operators/fused_gtconv.py
        self.ops, self.g, self.args, self.src = ops, g, args, src
        t = time.perf_counter()
        self.crow32 = g.crow.to(torch.int32)
        self.col32 = g.col.to(torch.int32)
        self.rows32 = g.row.to(torch.int32)
        # The edges of each 8-row block, which the hyper kernel keeps in dynamic shared memory.
        starts = np.arange(0, g.n, self.HYPER_ROWS)
        ends = np.minimum(starts + self.HYPER_ROWS, g.n)
        self.hyper_smem = int((g.offs[ends] - g.offs[starts]).max()) if g.n else 0
        torch.cuda.synchronize()
        self.prep_ms = (time.perf_counter() - t) * 1e3
        self.csc = None  # the training path's CSC, made by its first case

    def csc_arrays(self):
        """(col_ptr, row_ind, val_idx) int32: the graph by column, each entry's row and CSR edge
        id, as gt_backward's column kernel reads them (wall clock of the build in prep)."""
        if self.csc is None:
            g = self.g
            t = time.perf_counter()
            order = torch.argsort(g.col * max(g.n, 1) + g.row, stable=True)
            counts = torch.bincount(g.col, minlength=g.n_cols)
            col_ptr = torch.zeros(g.n_cols + 1, dtype=torch.int64, device=g.device)
            col_ptr[1:] = torch.cumsum(counts, 0)
            self.csc = (col_ptr.to(torch.int32), g.row[order].to(torch.int32), order.to(torch.int32))
            torch.cuda.synchronize()
            self.csc_ms = (time.perf_counter() - t) * 1e3
        return self.csc

    def run_case(self, rec, case):
        self.run_inference(rec, case)
        tp.attempt(rec, "dfgnn_hyper_train", case, lambda: self.train_record(case))

    def train_record(self, case):
        g, args = self.g, self.args
        if case.dtype != "f32":
            raise tp.Unsupported("f32 only (the kernels take float Q, K, V)")
        if g.n * case.heads * case.d >= 2**31 or g.nnz * case.heads >= 2**31:
            raise tp.Unsupported("n * heads * head_dim or nnz * heads >= 2^31: its int offsets overflow")
        if g.n != g.n_cols:
            raise tp.Unsupported("a square graph only (its gradients of K and V have n rows)")
        smem = self.hyper_smem
        if smem > self.SMEM_FLOATS:
            raise tp.Unsupported(f"a block of 8 rows has {smem} edges: {smem * 4} B of dynamic shared "
                                 "memory > 48 KiB, and the kernels do not opt in to more")
        col_ptr, row_ind, val_idx = self.csc_arrays()
        qg, kg, vg = (x.detach().to(torch.float32, copy=True).contiguous().requires_grad_()
                      for x in (case.q, case.k, case.v))
        dout = torch.randn(g.n, case.heads, case.d, device=g.device, generator=case.gen)
        ones = torch.ones(g.nnz, dtype=torch.float32, device=g.device)

        def step():
            qs = qg * case.scale
            out = self.ops.GTConvFuse_hyper(self.rows32, self.crow32, self.col32, ones, col_ptr, row_ind,
                                            val_idx, smem, qs, kg, vg)
            qg.grad = kg.grad = vg.grad = None
            out.backward(dout)
            return out

        out = step()
        torch.cuda.synchronize()
        errs = {"out": tp.rel_error(out.detach(), case.ref)}
        del out
        grads = (qg.grad, kg.grad, vg.grad)
        if any(x is None for x in grads):
            raise RuntimeError("autograd gave no gradient for Q, K or V")
        try:
            ref = reference_grads(g, case.q, case.k, case.v, dout, case.scale)
            errs.update(zip(("dQ", "dK", "dV"), (tp.rel_error(x, r) for x, r in zip(grads, ref))))
            del ref
            checked = "rel_err: the largest of the output's and the gradients' errors"
        except torch.cuda.OutOfMemoryError:
            tp.free_memory()
            checked = "gradients not checked (their f64 reference did not fit): rel_err of the output"
        worst = max(errs.values(), key=lambda e: math.inf if not math.isfinite(e) else e)
        ms = tp.time_ms(step, args.warmup, args.reps)
        note = (", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + f"; {checked}; Q pre-scaled "
                "(its backward ignores the edge values); all heads in one call")
        return dict(median_ms=ms, dtype_used="f32", rel_err=worst,
                    variant=f"GTConvFuse_hyper, autograd (gt_hyper_forward + gt_backward, smem {smem} floats)",
                    note=note, extra=dict(prep_ms=self.prep_ms + self.csc_ms, source=self.src))

    def run_inference(self, rec, case):
        g, args = self.g, self.args
        for peer in ("dfgnn_tiling", "dfgnn_hyper"):
            def fn_record(peer=peer):
                if case.dtype != "f32":
                    raise tp.Unsupported("f32 only (the kernels take float Q, K, V)")
                if g.n * case.heads * case.d >= 2**31:
                    raise tp.Unsupported("n * heads * head_dim >= 2^31: its int offsets overflow")
                q, k, v = (x.contiguous() for x in (case.q, case.k, case.v))
                # The kernel multiplies each score by its edge's value: the scale, exactly.
                val = torch.full((g.nnz,), case.scale, dtype=torch.float32, device=g.device)
                if peer == "dfgnn_tiling":
                    if case.d % 32 or 32 % (case.d // 32) or case.d > 1024:
                        raise tp.Unsupported(f"head_dim {case.d}: one warp per 32 features, and the warps must "
                                             "divide its 32-edge tile (32, 64, 128, 256, 512, 1024)")
                    smem = 128  # as Fused3S's comparison script passes it (max_neigh 128, unused by the kernel)

                    def call():
                        return self.ops.GTConvFuse_inference_tiling(self.crow32, self.col32, val, smem, q, k, v)

                    variant = "GTConvFuse_inference_tiling (32-edge tiles, online softmax)"
                else:
                    smem = self.hyper_smem
                    if smem > self.SMEM_FLOATS:
                        raise tp.Unsupported(f"a block of 8 rows has {smem} edges: {smem * 4} B of dynamic shared "
                                             "memory > 48 KiB, and the kernel does not opt in to more")

                    def call():
                        return self.ops.GTConvFuse_inference_hyper(self.crow32, self.col32, self.rows32, val, smem, q, k, v)

                    variant = ("GTConvFuse_inference_hyper (" + ("vec4" if case.d % 128 == 0 else
                               "small_f" if case.d <= 32 else "scalar") + f" kernel, smem {smem} floats)")
                out = call()
                torch.cuda.synchronize()
                err = tp.rel_error(out, case.ref)
                del out
                ms = tp.time_ms(call, args.warmup, args.reps)
                return dict(median_ms=ms, dtype_used="f32", rel_err=err, variant=variant,
                            note="all heads in one call; scale passed as the edge values",
                            extra=dict(prep_ms=self.prep_ms, source=self.src))

            tp.attempt(rec, peer, case, fn_record)


def reference_grads(g, q, k, v, dout, scale):
    """dQ, dK, dV of sum(attention(q, k, v) * dout) in f64 by autograd, head by head and in
    chunks of rows (as tp.reference_attention), on q's device."""
    n, heads, d = q.shape
    dev = q.device
    dq = torch.zeros(n, heads, d, dtype=torch.float64, device=dev)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=dev)
    dv = torch.zeros(v.shape, dtype=torch.float64, device=dev)
    for h in range(heads):
        qh, kh, vh = (x[:, h].double().requires_grad_() for x in (q, k, v))
        for r0, r1 in tp.row_chunks(g.offs, tp.edge_budget(d)):
            e0, e1 = int(g.offs[r0]), int(g.offs[r1])
            if e1 == e0:
                continue
            rows, cols = g.row[e0:e1], g.col[e0:e1]
            local = rows - r0
            s = (qh[rows] * kh[cols]).sum(-1) * scale
            m = torch.full((r1 - r0,), -math.inf, dtype=torch.float64, device=dev)
            m = m.scatter_reduce(0, local, s.detach(), "amax")
            p = torch.exp(s - m[local])
            den = torch.zeros(r1 - r0, dtype=torch.float64, device=dev).index_add(0, local, p)
            w = p / den[local]
            out = torch.zeros(r1 - r0, d, dtype=torch.float64, device=dev).index_add(0, local, vh[cols] * w[:, None])
            (out * dout[r0:r1, h].double()).sum().backward()
        for out, x in ((dq, qh), (dk, kh), (dv, vh)):
            if x.grad is not None:  # None on a graph without edges: the zeros stay
                out[:, h] = x.grad
        del qh, kh, vh
    return dq, dk, dv


CLASSES = {"fused3s": Fused3S, "flashsparse": FlashSparse, "dfgnn": DFGNN}


# --------------------------------------------------------------------------------------------
# Driver: one child process per family, restarted past a case that killed it
# --------------------------------------------------------------------------------------------


def cases_of(args):
    return [(dt, h, d) for dt in args.dtype for h in args.heads for d in args.head_dim]


def child(args):
    """Runs one family over the cases from --skip on, appending JSON lines to --child-out:
    {"begin": i} before case i, {"record": ...} for each record."""
    out = open(args.child_out, "a")

    def emit(obj):
        out.write(json.dumps(obj, allow_nan=False) + "\n")
        out.flush()

    family = args.child
    g = tp.load_graph(args.graph, args.name, args.symmetrize, args.device)
    src = sources(args.build_dir).get(REPO[family]) if args.build_dir else None
    rec = tp.Recorder(g, args, g.device)
    rec.sink = lambda r: emit({"record": r})
    all_cases = cases_of(args)
    try:
        impl = CLASSES[family](g, args, src)
        why = None
    except Exception as err:  # noqa: BLE001 - an import or preprocessing failure is a result
        impl, why = None, err
    for i, (dtype, heads, d) in enumerate(all_cases):
        if i < args.skip:
            continue
        emit({"begin": i})
        case = tp.Case(g, heads, d, dtype, args.seed)
        if impl is None:
            if isinstance(why, tp.Unsupported):
                status, reason = "unsupported", str(why)
            elif isinstance(why, ImportError):
                status, reason = "unsupported", f"import failed: {tp.one_line(why)}"
            elif isinstance(why, torch.cuda.OutOfMemoryError):
                status, reason = "oom", f"preprocessing: {tp.one_line(why)}"
            else:
                status, reason = "error", f"preprocessing failed: {tp.one_line(why)}"
            for peer in FAMILIES[family]:
                rec.limit(peer, heads, d, dtype, status, reason, source=src)
        else:
            impl.run_case(rec, case)
        case.drop()
        tp.free_memory()
    out.close()


def run_family(args, family, script):
    """Runs `family` in child processes until every case has its records."""
    all_cases = cases_of(args)
    records = []
    skip = 0
    with tempfile.TemporaryDirectory() as tmp:
        while skip < len(all_cases):
            path = os.path.join(tmp, f"{family}-{skip}.jsonl")
            cmd = [sys.executable, script, "--child", family, "--child-out", path, "--skip", str(skip)] + args.passthrough
            print(f"[fused] {family}: child process from case {skip}", flush=True)
            proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
            tail = deque(maxlen=20)
            for line in proc.stderr:
                sys.stderr.write(line)
                if line.strip():
                    tail.append(line.rstrip())
            rc = proc.wait()
            begun, got = [], {}
            if os.path.exists(path):
                for line in open(path):
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by the crash
                    if "begin" in obj:
                        begun.append(obj["begin"])
                    else:
                        r = obj["record"]
                        records.append(r)
                        got.setdefault(begun[-1] if begun else -1, set()).add(r["peer"])
            if rc == 0 and (not begun or begun[-1] == len(all_cases) - 1):
                break
            # The child died: the case it was in gets error records for its missing peers.
            last = next((t for t in reversed(tail) if "Warning" not in t), "") if tail else ""
            how = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
            reason = f"the process died ({how}) during this case" + (f": {last[:200]}" if last else "")
            dead = begun[-1] if begun else skip
            dtype, heads, d = all_cases[dead]
            g_stub = dict(graph=args.name_resolved, n=args.n, n_cols=args.n_cols, nnz=args.nnz,
                          symmetrized=args.symmetrize)
            for peer in FAMILIES[family]:
                if peer in got.get(dead, set()):
                    continue
                r = dict(g_stub, heads=heads, head_dim=d, dtype=dtype, peer=peer, status="error",
                         median_ms=None, dtype_used=None, variant="", rel_err=None,
                         tolerance=tp.TOLERANCE[dtype], ok=None, reason=reason, note="", timing=None,
                         gpu=args.gpu, torch=torch.__version__, cuda=torch.version.cuda,
                         warmup=args.warmup, reps=args.reps)
                records.append(r)
                print(f"[fused] {peer:24s} H={heads} D={d} {dtype}: error: {reason}", flush=True)
            if not begun:
                # It died before its first case (while importing or preprocessing): every case
                # would die the same way.
                for j in range(skip + 1, len(all_cases)):
                    dtype, heads, d = all_cases[j]
                    for peer in FAMILIES[family]:
                        records.append(dict(g_stub, heads=heads, head_dim=d, dtype=dtype, peer=peer, status="error",
                                            median_ms=None, dtype_used=None, variant="", rel_err=None,
                                            tolerance=tp.TOLERANCE[dtype], ok=None,
                                            reason=f"the process died ({how}) before its first case" +
                                                   (f": {last[:200]}" if last else ""),
                                            note="", timing=None, gpu=args.gpu, torch=torch.__version__,
                                            cuda=torch.version.cuda, warmup=args.warmup, reps=args.reps))
                break
            skip = dead + 1
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.common_args(ap)
    ap.add_argument("--build-dir", default=None,
                    help="the folder the peers were built into (its lib/ is put on sys.path)")
    ap.add_argument("--peers", nargs="+", default=list(FAMILIES), help=f"families: {' '.join(FAMILIES)}")
    ap.add_argument("--prep-reps", type=int, default=3, help="runs of Fused3S's GPU preprocessing (median)")
    ap.add_argument("--no-isolate", action="store_true", help="run the families in this process (debugging)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    raw = sys.argv[1:]
    args = tp.parse_common(ap, ap.parse_args())
    args.peers = [x for v in args.peers for x in v.split(",") if x]
    for p in args.peers:
        if p not in FAMILIES:
            ap.error(f"--peers: unknown family {p!r} (known: {' '.join(FAMILIES)})")
    if args.build_dir:
        bd = os.path.abspath(args.build_dir)
        for p in (os.path.join(bd, "lib"), bd):
            if os.path.isdir(p):
                sys.path.insert(0, p)
    if args.child:
        child(args)
        return

    g = tp.load_graph(args.graph, args.name, args.symmetrize, args.device)
    args.gpu = torch.cuda.get_device_name(g.device) if tp.is_cuda(g.device) else "cpu"
    print(f"[fused] {g.name}: n={g.n} nnz={g.nnz} on {args.gpu}", flush=True)
    args.name_resolved, args.n, args.n_cols, args.nnz = g.name, g.n, g.n_cols, g.nnz
    # The children get the same command line (they answer through --child-out; --peers and
    # --json are ignored there).
    args.passthrough = list(raw)
    records = []
    for family in args.peers:
        if args.no_isolate:
            args.child, args.skip = family, 0
            with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
                args.child_out = f.name
                child(args)
                records += [json.loads(line)["record"] for line in open(f.name) if '"record"' in line]
            args.child = None
        else:
            records += run_family(args, family, os.path.abspath(__file__))
        tp.write_records(args.json, [r for r in records if not args.ok_only or r["median_ms"] is not None])
    tp.write_records(args.json, [r for r in records if not args.ok_only or r["median_ms"] is not None])
    print(f"[fused] wrote {len(records)} records to {args.json}")


if __name__ == "__main__":
    main()
