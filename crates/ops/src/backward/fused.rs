//! The fused backward of sparse attention: every gradient in two kernels, without per-edge
//! buffers (but the edge terms' score pairs, below) and without floating-point atomics (kernels: `attention_backward_rows_*` and
//! `attention_backward_cols_*` in `crates/kernels-sys/cuda/backward.cu`).
//!
//! With `s = scale · ⟨q_i, k_j⟩`, `P` the row softmax of `s`, `dP = ⟨dOut_i, v_j⟩`,
//! `D_i = Σ_j P dP` and `dS = P ⊙ (dP − D_i)`:
//!
//! | pass | over | gathers per edge | computes |
//! |---|---|---|---|
//! | rows | A's units | `k_j`, `v_j` | an online softmax carrying `Σ x dP k_j`, `Σ x k_j`: dQ, `D_i`, `lse_i`, ∂scale |
//! | columns | Aᵀ's units | `q_i`, `dOut_i` | P from `lse_i`, dS from `D_i`: dK, dV |
//!
//! The row pass needs nothing from the forward (it recomputes the row statistics it hands to the
//! column pass), so every forward algorithm feeds it. Device memory beyond the graph:
//! `n × heads` row statistics and ∂scale shares, the partials of split rows and columns,
//! O(n · heads · head_dim) at most; with edge terms also `nnz × heads` (score, dP) pairs.
//!
//! **Deterministic**: a hub row (or column) split into units leaves one partial per unit; the
//! last unit to finish merges them in the schedule's order (an integer counter decides who is
//! last, never the order of the sum), and ∂scale is the rows' shares (one per row and head,
//! written by the row pass) summed in a fixed order by one more kernel. Two calls on the same
//! inputs give bitwise-equal gradients.
//!
//! **No host synchronization**: ∂scale stays on the device ([`FusedBackward::d_scale`]).
//!
//! **Edge features** ([`FusedBackward::run_with_edge_terms`]): the row pass adds each edge's
//! feature row to its key and value and leaves the edge's score and dP (two f32 per edge and
//! head, `nnz × heads` pairs: a sixteenth of the features' bytes at 64 f16 features); the column
//! pass reads those instead of the feature row and writes ∂L/∂E per edge. With attention
//! dropout as well, the kept elements are drawn once per call into a bit mask in A's order (the
//! forward's draws), which the row pass reads in sequence (`dP = f ⟨dOut_i, v'⟩`) and the column
//! pass per entry through Aᵀ's edge map (`f P` in dV and ∂L/∂E). A score bias is added to each
//! edge's scaled score in the row pass (the pair holds the biased score), and one more kernel
//! writes ∂L/∂bias from each edge's pair and its row's statistics (dS per head, or summed over
//! the heads in order for a shared bias). A bias or dropout without features takes twins of
//! both passes (`attention_backward_{rows,cols}_drop_*`) that read no feature row and write no
//! ∂L/∂E: a runtime-null feature pointer in the `_ef` row pass put each feature load behind a
//! branch of its own, after the previous edge's use, where the twin lets the `_ef` kernel issue
//! a tile's feature loads with its K and V loads.
//!
//! Shapes ([`FusedBackward::supports`]): a group of up to 32 lanes holds a head, one vector of
//! up to 16 bytes a lane, or up to 16 features a lane in 16-byte vectors: head_dim up to 512 in
//! multiples of 4 (f32) or 8 (f16, bf16), and otherwise up to 32 vectors (odd: 32; even: 64;
//! f16 / bf16 multiples of 4: 128). Other heads take the per-edge backward.
//!
//! ```no_run
//! use spattn_formats::Csr;
//! use spattn_ops::backward::{DeviceTranspose, FusedBackward};
//! use spattn_ops::{DeviceCsr, DeviceMatrix, Gpu, Shape};
//!
//! let gpu = Gpu::new(0)?;
//! let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (1, 0), (2, 2)])?;
//! let (a_dev, t) = (DeviceCsr::upload(&gpu, &a)?, DeviceTranspose::upload(&gpu, &a)?);
//! let shape = Shape::new(3, 2, 16)?;
//! let x: Vec<f32> = (0..shape.len()).map(|i| (i % 5) as f32 / 5.0).collect();
//! let q = DeviceMatrix::from_host(&gpu, shape, &x)?;
//! let (mut dq, mut dk, mut dv) = (
//!     DeviceMatrix::<f32>::zeros(&gpu, shape)?,
//!     DeviceMatrix::<f32>::zeros(&gpu, shape)?,
//!     DeviceMatrix::<f32>::zeros(&gpu, shape)?,
//! );
//! let mut bwd = FusedBackward::new(&gpu, &a_dev, &t, 2, 16)?;
//! // Q = K = V = dOut = x here.
//! bwd.run(&gpu, &a_dev, &t, 0.25, [&q, &q, &q, &q], [&mut dq, &mut dk, &mut dv])?;
//! let d_scale = bwd.d_scale().to_host()?[0];
//! assert!(d_scale.is_finite());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use spattn_formats::{Csr, Permutation, Reorder};
use spattn_kernels_sys::BACKWARD;

use crate::buffer::{grown, DeviceMatrix, DeviceVec};
use crate::csr_ops::{UnitWalk, UNIT_CHUNK};
use crate::device_csr::DeviceCsr;
use crate::dropout::{Dropout, DropoutWords};
use crate::dtype::DType;
use crate::edge_extras::{self, DeviceBias};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::graph::DeviceGraph;
use crate::launch::{
    blocks_for, check_same_gpu, kernel_named, launch, product, to_u32, LaunchArgs, LaunchConfig,
    PushKernelArg, PushOptionalArg,
};
use crate::schedule::{group_for, row_and_column_lens, split_units, vector_width};
use crate::shape::Shape;

use super::keep_bits::{draw_keep_bits, dropout_mask_words};
use super::{DeviceSum, DeviceTranspose};

/// Threads per block of both attention passes. A block's registers are freed when its last
/// group is done, so smaller blocks idle less behind their slowest group (at 8 heads of 64 f16
/// features a block of 64 holds one unit's heads); with no block-wide step left in either
/// pass, 64 was 1–5% faster than 128 with edge features in f16 and within 1% in f32
/// (docs/kernels/backward.md).
const THREADS: u32 = 64;
/// Threads per block of GAT's passes (not timed in smaller blocks).
pub(super) const GAT_THREADS: u32 = 256;
/// At most this many threads in a grid (grid-stride loops beyond): enough to fill any current
/// GPU many times over.
const MAX_GRID_THREADS: u32 = 1 << 21;
/// Features one lane holds at most (registers: q, dOut and two accumulators of this many, plus
/// two edges' k and v in flight).
const MAX_LANE_FEATURES: u32 = 16;
/// f32 words of a split row's partial statistics (m, l, w, a1, a2; see the kernel).
pub(super) const ROW_PARTIAL: usize = 5;

/// The lane layout for `head_dim` features of `elem_bytes` bytes: `(vec, g, nv)`, `vec`
/// features per access, groups of `g` lanes, `nv` vectors per lane; `None` where a lane would
/// need several vectors narrower than 16 bytes or more than [`MAX_LANE_FEATURES`] features (the
/// kernels instantiated in backward.cu).
pub(crate) fn layout(head_dim: usize, elem_bytes: usize) -> Option<(u32, u32, u32)> {
    if head_dim == 0 {
        return None;
    }
    let vec = vector_width(head_dim, elem_bytes);
    let vectors = (head_dim / vec as usize) as u64;
    let g = group_for(vectors, 1);
    let nv = vectors.div_ceil(u64::from(g)).next_power_of_two();
    let wide = vec as usize * elem_bytes == 16;
    (nv == 1 || (wide && nv * u64::from(vec) <= u64::from(MAX_LANE_FEATURES)))
        .then_some((vec, g, nv as u32))
}

/// The row pass's kernel for `dtype` (a [`DType::NAME`]) and the [`layout`]'s `vec` and `nv`,
/// with edge terms (features, a bias, dropout) where `ef`: reading each edge's feature row where
/// `feat` (else for a bias or dropout without them, `_drop`); the launch-name test forms it too.
pub(crate) fn rows_pass_kernel(dtype: &str, vec: u32, nv: u32, ef: bool, feat: bool) -> String {
    let terms = terms_infix(ef, feat);
    format!("attention_backward_rows_{terms}{dtype}_v{vec}_n{nv}")
}

/// The column pass's kernel for `dtype`, `vec` and `nv`, with edge terms where `ef`: writing
/// ∂L/∂E where `de` (edge features), else for a bias or dropout without them (`_drop`).
pub(crate) fn cols_pass_kernel(dtype: &str, vec: u32, nv: u32, ef: bool, de: bool) -> String {
    let terms = terms_infix(ef, de);
    format!("attention_backward_cols_{terms}{dtype}_v{vec}_n{nv}")
}

/// The passes' name infix: none without edge terms, `ef_` with features, `drop_` for a bias or
/// dropout without them.
fn terms_infix(ef: bool, features: bool) -> &'static str {
    match (ef, features) {
        (false, _) => "",
        (true, true) => "ef_",
        (true, false) => "drop_",
    }
}

/// The edge terms of a [`FusedBackward::run_with_edge_terms`] call, each optional (none: the
/// plain [`run`](FusedBackward::run)).
#[derive(Debug)]
pub struct EdgeTerms<'a, T: DType> {
    /// Edge features (`nnz × heads × head_dim`, row `e` for A's edge `e` in CSR order) added to
    /// each edge's key and value, with the buffer (same shape) that receives ∂L/∂E.
    pub features: Option<(&'a DeviceMatrix<T>, &'a mut DeviceMatrix<T>)>,
    /// A score bias in A's CSR order (−∞ masks an edge), with the buffer that receives
    /// ∂L/∂bias (shaped like the bias).
    pub bias: Option<(DeviceBias<'a, T>, &'a mut DeviceVec<T>)>,
    /// The forward's dropout (the same seed and offset).
    pub dropout: Option<&'a Dropout>,
}

impl<T: DType> Default for EdgeTerms<'_, T> {
    fn default() -> Self {
        Self {
            features: None,
            bias: None,
            dropout: None,
        }
    }
}

/// The fused backward's device workspace for one graph and one `heads × head_dim`, and its
/// launches (see the module documentation).
#[derive(Debug)]
pub struct FusedBackward {
    heads: usize,
    head_dim: usize,
    /// What the buffers were sized for: A's rows, partials and split rows, Aᵀ's partials and
    /// split rows.
    sized_for: [usize; 5],
    /// `(lse, D)` per (row of A, head).
    stats: DeviceVec<f32>,
    /// Split rows of A: statistics and the two accumulators of each unit's partial.
    row_part_stats: DeviceVec<f32>,
    row_part_acc: DeviceVec<f32>,
    /// Per (split row, head): units finished (reset to 0 by the merging unit).
    row_counters: DeviceVec<u32>,
    /// Per (row of A, head): the row's share of ∂scale, written by the row pass.
    dscale_rows: DeviceVec<f32>,
    /// Split rows of Aᵀ (columns of A): dK and dV partials, and their counters.
    col_part_acc: DeviceVec<f32>,
    col_counters: DeviceVec<u32>,
    /// ∂scale: the rows' shares summed in a fixed order after the row pass.
    d_scale: DeviceSum,
    /// Whether a run sums the rows' shares into `d_scale` ([`set_d_scale`](Self::set_d_scale)).
    take_d_scale: bool,
    /// With edge terms: each edge's score and dP per head (at least `nnz × heads × 2`), left by
    /// the row pass for the column pass; grown by the runs with edge terms.
    edge_sd: Option<DeviceVec<f32>>,
    /// With dropout: the kept bits of A's elements (`edge · heads + head`), drawn by each
    /// run with dropout; grown by them.
    keep: Option<DeviceVec<u32>>,
    /// The order the passes walk their units in ([`set_row_order`](Self::set_row_order));
    /// by default the schedule's own (the graph's row order).
    walk: Arc<UnitWalk>,
}

impl FusedBackward {
    /// Whether the fused backward runs `head_dim` features of `T` (see the module
    /// documentation); the callers fall back to the per-edge backward otherwise.
    pub fn supports<T: DType>(head_dim: usize) -> bool {
        layout(head_dim, std::mem::size_of::<T>()).is_some()
    }

    /// The workspace for `a` (with its transpose `t`) at `heads × head_dim`: zeroed counters,
    /// the row statistics and the split rows' partials.
    ///
    /// Errors: [`Error::InvalidArgument`] when `t` is not `a`'s transpose or a size overflows,
    /// [`Error::OutOfMemory`].
    pub fn new(
        gpu: &Gpu,
        a: &DeviceCsr,
        t: &DeviceTranspose,
        heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        check_transpose(a, t)?;
        let [_, a_parts, a_split, t_parts, t_split] = graph_sizes(a, t);
        let zeros = |what, factors: &[usize]| -> Result<DeviceVec<f32>> {
            DeviceVec::zeros(gpu, product(what, factors)?)
        };
        Ok(Self {
            heads,
            head_dim,
            sized_for: graph_sizes(a, t),
            stats: zeros("row statistics", &[a.n_rows(), heads, 2])?,
            row_part_stats: zeros("row partials", &[a_parts, heads, ROW_PARTIAL])?,
            row_part_acc: zeros("row partials", &[a_parts, heads, 2, head_dim])?,
            row_counters: DeviceVec::zeros(gpu, product("row counters", &[a_split, heads])?)?,
            dscale_rows: zeros("row dscale", &[a.n_rows(), heads])?,
            col_part_acc: zeros("column partials", &[t_parts, heads, 2, head_dim])?,
            col_counters: DeviceVec::zeros(gpu, product("column counters", &[t_split, heads])?)?,
            d_scale: DeviceSum::new(gpu)?,
            take_d_scale: true,
            edge_sd: None,
            keep: None,
            walk: Arc::default(),
        })
    }

    /// Walks the row pass's units in `order`'s row order (position `p` of the walk holds row
    /// `order.old_of_new()[p]`) and, on a square graph, the column pass's units in the same
    /// order of A's columns; `None` restores the graph's order. With a locality order (the
    /// one fused-csr's forward runs in) the rows in flight at one time are graph neighbours,
    /// whose K/V rows (Q/dOut rows in the column pass) the gathers then find in L2. The
    /// results are the same in any order, bit for bit, for finite inputs (every sum's order is
    /// the unit's and the schedule's, not the walk's; only the padding steps a warp's shorter
    /// units run depend on which units share the warp, and they add 0 · a finite value).
    ///
    /// `a` is the host CSR of the graph the workspace was made for.
    ///
    /// Errors: [`Error::InvalidArgument`] when `a`'s rows, split rows or split columns are not
    /// that graph's, [`Error::LengthMismatch`] when `order` is not over its rows, out of memory.
    pub fn set_row_order(&mut self, gpu: &Gpu, a: &Csr, order: Option<&Permutation>) -> Result<()> {
        let Some(order) = order else {
            self.walk = Arc::default();
            return Ok(());
        };
        let (lens, col_lens) = row_and_column_lens(a)?;
        let ([a_parts, a_split], [t_parts, t_split]) = (
            split_units(&lens, UNIT_CHUNK),
            split_units(&col_lens, UNIT_CHUNK),
        );
        let sizes = [a.n_rows(), a_parts, a_split, t_parts, t_split];
        if sizes != self.sized_for {
            return Err(Error::InvalidArgument {
                what: "row order's graph",
                why: format!(
                    "has [rows, partials, split rows, transpose's partials, split rows] {sizes:?}; \
                     the workspace was made for {:?}",
                    self.sized_for
                ),
            });
        }
        self.walk = Arc::new(UnitWalk::in_row_order(gpu, &lens, &col_lens, order)?);
        Ok(())
    }

    /// [`new`](Self::new) for `graph` (its CSR and transpose), walking the passes' units in
    /// the row order fused-csr's units run in for `reorder`
    /// ([`set_row_order`](Self::set_row_order); [`DeviceGraph::effective_reorder`] applied: a
    /// graph seen once keeps its order under [`Reorder::Auto`], with no host work), chosen once
    /// per graph and order.
    ///
    /// Errors: as [`new`](Self::new) and [`set_row_order`](Self::set_row_order), and those of
    /// the graph's uploads.
    pub fn on_graph(
        graph: &DeviceGraph,
        heads: usize,
        head_dim: usize,
        reorder: Reorder,
    ) -> Result<Self> {
        let gpu = graph.gpu();
        let mut ws = Self::new(gpu, graph.csr()?, graph.transpose()?, heads, head_dim)?;
        // The graph's own walk: made for these units, shared with its other workspaces.
        ws.walk = graph.unit_walk(reorder)?;
        Ok(ws)
    }

    /// `(heads, head_dim)` the workspace was made for.
    pub fn dims(&self) -> (usize, usize) {
        (self.heads, self.head_dim)
    }

    /// ∂L/∂scale of the last [`run`](Self::run) that took it, on the device (one f64).
    pub fn d_scale(&self) -> &DeviceVec<f64> {
        self.d_scale.total()
    }

    /// Whether the runs take ∂L/∂scale (true for a new workspace). False skips its sum, one
    /// launch a run, for callers that never read it (a scale that is a constant);
    /// [`d_scale`](Self::d_scale) then keeps the last run's that took it. The gradients are the
    /// same bits either way.
    pub fn set_d_scale(&mut self, take: bool) {
        self.take_d_scale = take;
    }

    /// Device memory the workspace holds, in bytes.
    pub fn device_bytes(&self) -> usize {
        [
            &self.stats,
            &self.row_part_stats,
            &self.row_part_acc,
            &self.dscale_rows,
            &self.col_part_acc,
        ]
        .iter()
        .map(|v| v.allocated_bytes())
        .sum::<usize>()
            + self.row_counters.allocated_bytes()
            + self.col_counters.allocated_bytes()
            + self.d_scale.allocated_bytes()
            + self.edge_sd.as_ref().map_or(0, DeviceVec::allocated_bytes)
            + self.keep.as_ref().map_or(0, DeviceVec::allocated_bytes)
            // The walk where only this workspace holds it (a graph's shared one is the graph's).
            + match Arc::strong_count(&self.walk) {
                1 => self.walk.device_bytes(),
                _ => 0,
            }
    }

    /// The gradients of `out = softmax_row(scale · Q Kᵀ masked by A) · V`: from `[Q, K, V,
    /// dOut]` writes every element of `[dQ, dK, dV]`, and ∂L/∂scale into
    /// [`d_scale`](Self::d_scale) (unless [`set_d_scale`](Self::set_d_scale) turned it off).
    /// Enqueued on `gpu`'s stream; nothing waits for the GPU.
    ///
    /// Shapes: Q, dOut, dQ are `a.n_rows() × heads × head_dim`; K, V, dK, dV are
    /// `a.n_cols() × heads × head_dim`, with the workspace's heads and head_dim.
    ///
    /// Errors: [`Error::ShapeMismatch`] naming the operand, [`Error::InvalidArgument`] when `t`
    /// is not `a`'s transpose, the workspace was made for a graph of other sizes, or the head is
    /// too wide ([`supports`](Self::supports)),
    /// [`Error::ForeignGpu`], driver errors.
    #[allow(clippy::too_many_arguments)]
    pub fn run<T: DType>(
        &mut self,
        gpu: &Gpu,
        a: &DeviceCsr,
        t: &DeviceTranspose,
        scale: f32,
        operands: [&DeviceMatrix<T>; 4],
        grads: [&mut DeviceMatrix<T>; 3],
    ) -> Result<()> {
        self.run_inner(gpu, a, t, scale, operands, grads, EdgeTerms::default())
    }

    /// [`run`](Self::run) with edge terms, any of them ([`EdgeTerms::default`] is
    /// [`run`](Self::run)):
    ///
    /// - `features`: edge features added to each edge's key and value, `k_j + e_ij` and
    ///   `v_j + e_ij`; the row pass reads each edge's feature row, and each edge's ∂L/∂E is
    ///   written by the one unit of Aᵀ that holds it, so the result is still deterministic.
    /// - `bias`: added to each edge's scaled score, `s = scale · ⟨q_i, k'⟩ + b_e`; after the
    ///   passes one more kernel writes each edge's dS from its pair and its row's statistics,
    ///   per head or summed over the heads in head order (shared), into the gradient's buffer.
    /// - `dropout` (the forward's: the same seed and offset): the gradients of the forward that
    ///   aggregated `P · f · v'`, `f` each element's dropout factor. The kept bits are drawn into
    ///   the workspace (`nnz × heads` bits, grown on the first such call); a rate of 0 adds
    ///   nothing.
    ///
    /// Any of them leaves each edge's score and dP from the row pass for the column pass (the
    /// workspace grows by `nnz × heads × 2` f32 on the first such call). Without features the
    /// row pass reads no feature row and the column pass writes no ∂L/∂E.
    ///
    /// Errors: as [`run`](Self::run), [`Error::ShapeMismatch`] for the edge features or their
    /// gradient, [`Error::LengthMismatch`] for the bias or its gradient, and
    /// [`Error::OutOfMemory`] for the pairs and the bits.
    #[allow(clippy::too_many_arguments)]
    pub fn run_with_edge_terms<T: DType>(
        &mut self,
        gpu: &Gpu,
        a: &DeviceCsr,
        t: &DeviceTranspose,
        scale: f32,
        operands: [&DeviceMatrix<T>; 4],
        grads: [&mut DeviceMatrix<T>; 3],
        terms: EdgeTerms<'_, T>,
    ) -> Result<()> {
        self.run_inner(gpu, a, t, scale, operands, grads, terms)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_inner<T: DType>(
        &mut self,
        gpu: &Gpu,
        a: &DeviceCsr,
        t: &DeviceTranspose,
        scale: f32,
        operands: [&DeviceMatrix<T>; 4],
        [dq, dk, dv]: [&mut DeviceMatrix<T>; 3],
        EdgeTerms {
            features,
            bias,
            dropout,
        }: EdgeTerms<'_, T>,
    ) -> Result<()> {
        let [q, k, v, d_out] = operands;
        check_transpose(a, t)?;
        if graph_sizes(a, t) != self.sized_for {
            return Err(Error::InvalidArgument {
                what: "workspace",
                why: format!(
                    "was made for a graph of [rows, partials, split rows, transpose's partials, \
                     split rows] {:?}, not {:?}",
                    self.sized_for,
                    graph_sizes(a, t)
                ),
            });
        }
        let sq = Shape::new(a.n_rows(), self.heads, self.head_dim)?;
        let skv = Shape::new(a.n_cols(), self.heads, self.head_dim)?;
        for (what, actual, expected) in [
            ("Q", q.shape(), sq),
            ("K", k.shape(), skv),
            ("V", v.shape(), skv),
            ("dOut", d_out.shape(), sq),
            ("dQ", dq.shape(), sq),
            ("dK", dk.shape(), skv),
            ("dV", dv.shape(), skv),
        ] {
            expected.expect_eq(what, actual)?;
        }
        check_same_gpu(gpu, "A", a)?;
        check_same_gpu(gpu, "transpose", &t.csr)?;
        for (what, m) in [("Q", q), ("K", k), ("V", v), ("dOut", d_out)] {
            check_same_gpu(gpu, what, m)?;
        }
        for (what, m) in [("dQ", &*dq), ("dK", &*dk), ("dV", &*dv)] {
            check_same_gpu(gpu, what, m)?;
        }
        check_same_gpu(gpu, "workspace", &self.stats)?;
        let (ef, d_ef) = match features {
            Some((ef, d_ef)) => {
                let se = Shape::new(a.nnz(), self.heads, self.head_dim)?;
                se.expect_eq("edge_features", ef.shape())?;
                se.expect_eq("d_edge_features", d_ef.shape())?;
                check_same_gpu(gpu, "edge_features", ef)?;
                check_same_gpu(gpu, "d_edge_features", &*d_ef)?;
                (Some(ef), Some(d_ef))
            }
            None => (None, None),
        };
        let (bias, d_bias) = match bias {
            Some((b, db)) => {
                b.check_len(a.nnz(), self.heads)?;
                edge_extras::check_bias_grad_len(a.nnz(), self.heads, b.is_shared(), db.len())?;
                check_same_gpu(gpu, "bias", b.values())?;
                check_same_gpu(gpu, "d_bias", &*db)?;
                (Some(b), Some(db))
            }
            None => (None, None),
        };
        // The kept bits in A's order (none without dropout, or without an element to keep).
        let drop = DropoutWords::of(dropout);
        let words = dropout_mask_words(a.nnz(), self.heads)?;
        let keep = if drop.threshold != 0 && words > 0 {
            let bits = grown(gpu, &mut self.keep, "dropout mask", words)?;
            draw_keep_bits(
                gpu,
                a,
                self.heads,
                None,
                &drop,
                &mut bits.slice_mut().slice_mut(..words),
            )?;
            self.keep.as_ref()
        } else {
            None
        };
        // The `_ef` passes where an edge term acts: features, a bias, or elements dropped.
        let has_ef = ef.is_some() || bias.is_some() || keep.is_some();
        let bias_heads = to_u32(
            "bias heads",
            if bias.is_some_and(|b| b.is_shared()) {
                1
            } else {
                self.heads
            },
        )?;
        // Aᵀ's entries' edges of A (made once per transpose), for the edge features' rows, and
        // the edges' (score, dP) pairs from the row pass to the column pass.
        let (t_to_a, edge_sd) = if has_ef {
            let len = product("edge scores", &[a.nnz(), self.heads, 2])?;
            let sd = grown(gpu, &mut self.edge_sd, "edge scores", len)?;
            (Some(t.inverse_map(gpu)?), Some(sd))
        } else {
            (None, None)
        };
        let (vec, g, nv) =
            layout(self.head_dim, std::mem::size_of::<T>()).ok_or(Error::InvalidArgument {
                what: "head_dim",
                why: format!(
                    "{} features of {} need more than {MAX_LANE_FEATURES} per lane; use the \
                     per-edge backward",
                    self.head_dim,
                    T::NAME
                ),
            })?;
        let heads = to_u32("heads", self.heads)?;
        let head_dim = to_u32("head_dim", self.head_dim)?;

        // The walk checked against both passes' units before anything is written.
        let walk = Arc::clone(&self.walk);
        let (row_order, col_order) = (walk.rows(a)?, walk.cols(&t.csr)?);

        // Row pass over A.
        let ([rows, starts, slots, parts, first], _, _) = a.schedule().merge_units();
        let n_units = to_u32("units", rows.len())?;
        let name = kernel_named(
            &BACKWARD,
            rows_pass_kernel(T::NAME, vec, nv, has_ef, ef.is_some()),
        )?;
        let f = gpu.load_function(BACKWARD.name, BACKWARD.ptx, name)?;
        let cfg = row_grid(rows.len(), self.heads, g, THREADS)?;
        let mut args = gpu.launch_builder(&f);
        let units = [rows, starts, slots, parts, first];
        let dims = [heads, head_dim];
        push_pass_args(
            &mut args,
            (&units, &n_units, row_order),
            a.col_indices(),
            operands,
            &dims,
            &scale,
            &g,
        );
        args.arg(dq.slice_mut())
            .arg(self.stats.slice_mut())
            .arg(self.row_part_stats.slice_mut())
            .arg(self.row_part_acc.slice_mut())
            .arg(self.row_counters.slice_mut())
            .arg(self.dscale_rows.slice_mut())
            .arg_or_null(ef.map(DeviceMatrix::as_vec))
            .arg_or_null_mut(edge_sd)
            .arg_or_null(keep)
            .arg(&drop.scale)
            .arg_or_null(bias.map(|b| b.values()))
            .arg(&bias_heads);
        // SAFETY: the kernel reads A's schedule (n_units units, starts n_units + 1, slots and
        // partials per unit, first partials per split row + 1; built with the CSR), the walk
        // order where set (n_units entries, checked by UnitWalk::rows; a permutation of
        // 0..n_units from units_in_row_order, so each names a unit) and
        // col_indices[starts[u]..starts[u+1]) ⊂ [0, nnz); Q and dOut rows < n_rows, K and V
        // rows col_indices[e] < n_cols, each heads*head_dim (shapes checked), in vectors of `vec`
        // inside a head (vec divides head_dim). It writes dQ's rows (< n_rows), stats at
        // (row, head) < n_rows*heads (x2 floats), partials at part < n_parts (stats 5 and
        // accumulators 2*head_dim floats per (part, head)), counters at (split row, head) <
        // (A's split rows)*heads and dscale_rows at (row, head) < n_rows*heads — all sized by
        // `new` for a graph of these sizes (`sized_for`, checked above). The `_ef` kernel
        // (features, a bias, dropout, or a mix) writes edge_sd at (e, head) < nnz*heads for each edge e
        // it walks (x2 floats; grown to at least that above); with edge features (non-null)
        // it reads their row e < nnz (nnz × heads × head_dim, checked); with dropout, bit
        // e*heads + head of keep (at least dropout_mask_words(nnz, heads) words, grown and
        // drawn above); with a bias, element e*bias_heads + (head, or 0 when shared) of it
        // (nnz × bias_heads, checked).
        unsafe { launch(name, &mut args, cfg) }?;
        if self.take_d_scale {
            self.d_scale.take(gpu, &self.dscale_rows, None)?;
        }

        // Column pass over Aᵀ.
        let ([rows, starts, slots, parts, first], _, _) = t.csr.schedule().merge_units();
        let n_units = to_u32("units", rows.len())?;
        let cols = cols_pass_kernel(T::NAME, vec, nv, has_ef, d_ef.is_some());
        let name = kernel_named(&BACKWARD, cols)?;
        let f = gpu.load_function(BACKWARD.name, BACKWARD.ptx, name)?;
        let cfg = row_grid(rows.len(), self.heads, g, THREADS)?;
        let mut args = gpu.launch_builder(&f);
        let units = [rows, starts, slots, parts, first];
        let ends = t.csr.col_indices();
        push_pass_args(
            &mut args,
            (&units, &n_units, col_order),
            ends,
            operands,
            &dims,
            &scale,
            &g,
        );
        args.arg(self.stats.slice())
            .arg(dk.slice_mut())
            .arg(dv.slice_mut())
            .arg(self.col_part_acc.slice_mut())
            .arg(self.col_counters.slice_mut())
            .arg_or_null(t_to_a)
            .arg_or_null_mut(d_ef.map(DeviceMatrix::as_vec_mut))
            .arg_or_null(self.edge_sd.as_ref().filter(|_| has_ef))
            .arg_or_null(keep)
            .arg(&drop.scale);
        // SAFETY: as the row pass, on Aᵀ's schedule, walk order and columns: Aᵀ's entries are
        // rows of A (< n_rows: Q, dOut and stats rows), its units' rows are columns of A
        // (< n_cols: K, V, dK, dV rows); partials and counters sized by `new` from Aᵀ's
        // schedule. In the `_ef` kernel entry e's edge t_to_a[e] < nnz (the inverse of the edge
        // map, a permutation of 0..nnz, nnz entries) selects the pair read from edge_sd (at
        // least nnz × heads pairs, grown above and written by the row pass), the row written in
        // the features' gradient where given (nnz × heads × head_dim, checked), and with
        // dropout the bit t_to_a[e]*heads + head of keep (as the row pass).
        unsafe { launch(name, &mut args, cfg) }?;
        let (Some(b), Some(db)) = (bias, d_bias) else {
            return Ok(());
        };
        // A bias makes the run an edge-term one (`has_ef`), which made both.
        let (Some(t_to_a), Some(pairs)) = (t_to_a, &self.edge_sd) else {
            return Err(Error::InvalidArgument {
                what: "d_bias",
                why: "the bias's gradient needs the edge-term passes' score pairs, not made".into(),
            });
        };
        edge_extras::bias_grad_from_pairs(
            gpu,
            (ends, t_to_a),
            (pairs, &self.stats, a.n_rows()),
            self.heads,
            b.is_shared(),
            db,
        )
    }
}

/// The arguments both passes begin with: the units `[rows, starts, slots, partials, first
/// partials]` and their count, each edge's other end, `[Q, K, V, dOut]`, `[heads, head_dim]`, the
/// scale and the lanes a group.
#[allow(clippy::too_many_arguments)]
fn push_pass_args<'a, T: DType>(
    args: &mut LaunchArgs<'a>,
    units: PassUnits<'a>,
    ends: &'a DeviceVec<u32>,
    operands: [&'a DeviceMatrix<T>; 4],
    dims: &'a [u32; 2],
    scale: &'a f32,
    g: &'a u32,
) {
    push_units(args, units, ends);
    for m in operands {
        args.arg(m.slice());
    }
    args.arg(&dims[0]).arg(&dims[1]).arg(scale).arg(g);
}

/// A pass's units `[rows, starts, slots, partials, first partials]`, their count and the
/// order the pass walks them in (`None`: as numbered).
pub(super) type PassUnits<'a> = (
    &'a [&'a DeviceVec<u32>; 5],
    &'a u32,
    Option<&'a DeviceVec<u32>>,
);

/// The arguments every fused pass (attention's and GAT's) begins with: the units, their count,
/// their walk order (null: as numbered) and each edge's other end.
pub(super) fn push_units<'a>(
    args: &mut LaunchArgs<'a>,
    (units, n_units, order): PassUnits<'a>,
    ends: &'a DeviceVec<u32>,
) {
    for u in units {
        args.arg(u.slice());
    }
    args.arg(n_units).arg_or_null(order).arg(ends.slice());
}

/// The grid of a pass in blocks of `threads` (a multiple of `g`): a group of `g` lanes per
/// (unit, head), at most [`MAX_GRID_THREADS`] threads.
pub(super) fn row_grid(units: usize, heads: usize, g: u32, threads: u32) -> Result<LaunchConfig> {
    debug_assert!(
        g > 0 && threads % g == 0,
        "{threads} threads in groups of {g}"
    );
    let groups = product("units x heads", &[units, heads])?;
    let blocks = blocks_for(groups, threads / g)?.min(MAX_GRID_THREADS / threads);
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The sizes a workspace depends on: A's rows, partials and split rows, Aᵀ's partials and split
/// rows.
fn graph_sizes(a: &DeviceCsr, t: &DeviceTranspose) -> [usize; 5] {
    let (_, a_parts, a_split) = a.schedule().merge_units();
    let (_, t_parts, t_split) = t.csr.schedule().merge_units();
    [a.n_rows(), a_parts, a_split, t_parts, t_split]
}

/// `t` must be Aᵀ: `a.n_cols() × a.n_rows()` with `a`'s edges.
pub(super) fn check_transpose(a: &DeviceCsr, t: &DeviceTranspose) -> Result<()> {
    let nnz = a.nnz();
    if t.csr.nnz() != nnz || t.csr.n_rows() != a.n_cols() || t.csr.n_cols() != a.n_rows() {
        return Err(Error::InvalidArgument {
            what: "transpose",
            why: format!(
                "is {} x {} with {} edges; A is {} x {} with {nnz}",
                t.csr.n_rows(),
                t.csr.n_cols(),
                t.csr.nnz(),
                a.n_rows(),
                a.n_cols()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{layout, row_grid, GAT_THREADS, THREADS};

    #[test]
    fn layouts_cover_heads_up_to_sixteen_features_a_lane() {
        // f16 64: vectors of 8, 8 lanes, one vector each.
        assert_eq!(layout(64, 2), Some((8, 8, 1)));
        // f32 256: vectors of 4, 32 lanes, two each.
        assert_eq!(layout(256, 4), Some((4, 32, 2)));
        // f32 512: four vectors of 4 a lane.
        assert_eq!(layout(512, 4), Some((4, 32, 4)));
        // Odd widths: one vector of 1 a lane, up to 32 lanes.
        assert_eq!(layout(1, 4), Some((1, 1, 1)));
        assert_eq!(layout(31, 2), Some((1, 32, 1)));
        assert_eq!(layout(33, 4), None);
        // Vectors narrower than 16 bytes: one a lane (f32 even, f16 multiples of 4).
        assert_eq!(layout(66, 4), None);
        assert_eq!(layout(124, 2), Some((4, 32, 1)));
        assert_eq!(layout(132, 2), None);
        // 3 vectors a lane round up to 4.
        assert_eq!(layout(96 * 2, 4), Some((4, 32, 2)));
        assert_eq!(layout(1024, 2), None);
        assert_eq!(layout(0, 4), None);
    }

    #[test]
    fn grids_hold_a_group_per_unit_and_head_up_to_the_thread_cap() {
        // 10 units × 3 heads in groups of 8 lanes: 8 groups a block of 64, 4 blocks; 16 a
        // block of 128, 2 blocks; one block of 256.
        let cfg = row_grid(10, 3, 8, 64).unwrap();
        assert_eq!((cfg.grid_dim, cfg.block_dim), ((4, 1, 1), (64, 1, 1)));
        assert_eq!(row_grid(10, 3, 8, 128).unwrap().grid_dim.0, 2);
        assert_eq!(row_grid(10, 3, 8, GAT_THREADS).unwrap().grid_dim.0, 1);
        // Past the cap the kernels' grid-stride loops cover the rest: 2²¹ threads, in blocks
        // of the attention passes' and of GAT's.
        for threads in [THREADS, GAT_THREADS] {
            let cfg = row_grid(1 << 24, 8, 32, threads).unwrap();
            assert_eq!(cfg.grid_dim.0 * threads, 1 << 21);
        }
        // Narrower groups, fewer blocks: 1000 units × 3 heads in groups of 2 lanes fill 47
        // blocks of 128.
        assert_eq!(row_grid(1000, 3, 2, 128).unwrap().grid_dim.0, 47);
        // No units, no blocks (the launch is skipped).
        assert_eq!(row_grid(0, 8, 8, THREADS).unwrap().grid_dim.0, 0);
    }
}
