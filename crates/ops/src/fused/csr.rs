//! `FusedCsr`: one CUDA-core kernel per forward over CSR with an online softmax
//! (kernel: `crates/kernels-sys/cuda/fused_csr.cu`).
//!
//! Rows are cut into the same units as the CSR SpMM's ([`RowUnits`] of [`UNIT_CHUNK`] edges):
//! each unit of a hub row leaves an exact (max, sum, f32 accumulator) partial per head, and a
//! merge kernel combines them. There is no per-row buffer, so no degree limit.
//!
//! The units run in a row order of the plan's choosing ([`csr_order`]): they are cut from the
//! mask with its rows renumbered (columns untouched) and name the caller's rows, so the rows in
//! flight at one time are graph neighbours whose K/V gathers hit L2, and the kernel reads Q and
//! writes the output in the caller's order. Invisible to the caller.
//!
//! [`FusedCsr::forward_with_extras`] also takes attention's extras ([`CsrExtras`]: a score bias,
//! edge features on K and V, dropout; see `spattn::extras`) in the same kernel: each unit maps
//! its edges to the caller's CSR order by one shift, since renumbering rows keeps a row's edges
//! together.

use crate::csr_ops::UNIT_CHUNK;
use crate::dropout::Dropout;
use crate::edge_extras::DeviceBias;
use crate::launch::{
    blocks_for, kernel_named, launch, to_u32, LaunchConfig, PushKernelArg, PushOptionalArg,
};
use crate::schedule::{group_for, vector_width, RowUnits};
use crate::{DType, DeviceGraph, DeviceMatrix, DeviceVec, Gpu};
use spattn_formats::{Csr, Reorder, RowOrder};
use spattn_kernels_sys::FUSED_CSR;
use std::sync::Arc;

use crate::error::{Error, Result};

/// The name in errors and reports.
const KERNEL: &str = "fused-csr";

const THREADS: u32 = 256;
/// Accumulator vectors per lane compiled for (`fused_csr_*_n{1,2,4}`).
const MAX_NV: usize = 4;

/// Lane layout of the fused kernel for one head shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Features per vector access.
    pub vec: u32,
    /// Lanes per (unit, head).
    pub group: u32,
    /// Vectors per lane (1, 2 or 4).
    pub nv: u32,
    /// Subgroups the group's lanes form, each walking its share of a unit's edges (1: the
    /// whole group walks every edge).
    pub split: u32,
    /// Tiles of 2 edges and one vector a lane (the `_t2` kernels, which also run split groups);
    /// false: tiles of 4 (the plain kernels).
    pub short_tiles: bool,
}

/// The widest of `head_dim`'s vector width for `elem_bytes` and its half and quarter that
/// divides `head_dim` into a number of vectors `ok` accepts.
fn widest_vec_where(head_dim: usize, elem_bytes: usize, ok: impl Fn(usize) -> bool) -> Option<u32> {
    let widest = vector_width(head_dim, elem_bytes);
    [widest, widest / 2, widest / 4]
        .into_iter()
        .filter(|&v| v >= 1 && head_dim % v as usize == 0)
        .find(|&v| ok(head_dim / v as usize))
}

/// The lane layout for `head_dim` features of `elem_bytes`, or why the kernel cannot hold the
/// head in registers.
pub(crate) fn layout(head_dim: usize, elem_bytes: usize) -> Result<Layout> {
    // The plain layout (tiles of 4 edges): narrower vectors when that gives the group more
    // lanes, up to 32 (f16 at head_dim 128: 32 lanes of 4 features). Where a subgroup of fewer
    // lanes holds the head in one vector a lane, the plan runs a short_layout instead.
    let vec = widest_vec_where(head_dim, elem_bytes, |vectors| vectors >= 32)
        .unwrap_or_else(|| vector_width(head_dim, elem_bytes));
    let vectors = head_dim.div_ceil(vec as usize);
    let group = group_for(vectors as u64, 1);
    let per_lane = vectors.div_ceil(group as usize);
    let nv = per_lane.next_power_of_two();
    if nv > MAX_NV {
        return Err(Error::Unsupported {
            kernel: KERNEL,
            why: format!(
                "head_dim {head_dim} needs {per_lane} accumulator vectors of {vec} per lane \
                 (at most {MAX_NV} are compiled: head_dim ≤ {}); use unfused-csr",
                MAX_NV * 32 * vec as usize
            ),
        });
    }
    Ok(Layout {
        vec,
        group,
        nv: nv as u32,
        split: 1,
        short_tiles: false,
    })
}

/// The kernel for `dtype` (a [`DType::NAME`]) and `layout`; `extras`: `None` without them,
/// else whether they hold edge features (`_xf`, which keeps them in its tile at a cost in
/// registers the bias / dropout twin `_x` spares). The launch-name test forms it too.
pub(crate) fn kernel_name(dtype: &str, layout: &Layout, extras: Option<bool>) -> String {
    let Layout {
        vec,
        nv,
        short_tiles,
        ..
    } = *layout;
    let suffix = if short_tiles { "_t2" } else { "" };
    let x = match extras {
        Some(true) => "_xf",
        Some(false) => "_x",
        None => "",
    };
    format!("fused_csr_{dtype}_v{vec}_n{nv}{suffix}{x}")
}

/// The kernel merging split rows' partials into `dtype` rows.
pub(crate) fn merge_kernel(dtype: &str) -> String {
    format!("fused_csr_merge_{dtype}")
}

/// Most subgroups a group is split into ([`short_layout`]).
const MAX_SPLIT: u32 = 4;

/// The short-tile lane layouts for `head_dim` features of `elem_bytes`, where there are: only
/// where the plain [`layout`] gives each (unit, head) a whole warp (f16 head_dim 64 to 128,
/// f32 32 to 64; measured at f16 64 and 128 and f32 64). A subgroup of `sub` lanes (at least
/// 32 / [`MAX_SPLIT`], fewer than 32) holds the head in the widest vectors, one a lane, and
/// walks edges in tiles of 2:
/// - `split`: the warp's 32 lanes as 32 / sub subgroups sharing one unit, each walking its
///   share of the unit's edges, the partials merged at the unit's end (a hub unit's chain of
///   steps is that many times shorter);
/// - narrow: each subgroup a group of its own, 32 / sub units a warp (fewer instructions
///   per edge than the plain layout's 32 lanes of narrow vectors: wider loads, a shuffle
///   level or two fewer, no merge).
///
/// `None` where a subgroup would need all 32 lanes (f32 from head_dim 96, f16 from 256) or the
/// plain group (`plain`, the [`layout`] of the same head) is smaller.
pub(crate) fn short_layout(
    plain: &Layout,
    head_dim: usize,
    elem_bytes: usize,
    split: bool,
) -> Option<Layout> {
    if plain.group != 32 {
        return None;
    }
    let vec = widest_vec_where(head_dim, elem_bytes, |vectors| {
        group_for(vectors as u64, 1) >= 32 / MAX_SPLIT
    })?;
    let vectors = head_dim.div_ceil(vec as usize);
    let sub = group_for(vectors as u64, 1);
    // vectors <= sub < 32: each lane of a subgroup holds one vector.
    (sub < 32 && vectors <= sub as usize).then_some(Layout {
        vec,
        group: if split { 32 } else { sub },
        nv: 1,
        split: if split { 32 / sub } else { 1 },
        short_tiles: true,
    })
}

/// (unit, head) groups per SM up to which a plan splits its groups: a launch of a few waves
/// whose longest units set its time.
const SPLIT_MAX_GROUPS_PER_SM: usize = 256;

/// Groups per SM up to which a plan splits its groups even without a split row: about one wave
/// of split groups (a warp each), so the subgroups cost no extra wave.
const SPLIT_ONE_WAVE_GROUPS_PER_SM: usize = 32;

/// The lane layout a plan of `groups` (unit, head) pairs runs, `head_dim` features of
/// `elem_bytes` whose plain [`layout`] is `plain`: split groups for launches of at most
/// [`SPLIT_MAX_GROUPS_PER_SM`] groups per SM, narrow groups above, the plain layout where
/// neither exists: in a launch of a few waves the longest units' chains set the time, which
/// split groups shorten; in a larger one, resident groups hide the chains and narrow groups'
/// fewer instructions per edge win (docs/kernels/fused-csr.md, "Tried and kept"). Without
/// `split_rows` (no row longer than a unit) every chain is short, so groups split only where
/// they fit in about one wave ([`SPLIT_ONE_WAVE_GROUPS_PER_SM`]): beyond it a short row's
/// subgroups get an edge or none each and the extra warps cost waves.
pub(crate) fn choose_layout(
    plain: Layout,
    head_dim: usize,
    elem_bytes: usize,
    groups: usize,
    sm_count: u32,
    split_rows: bool,
) -> Layout {
    let per_sm = |n: usize| n.saturating_mul(sm_count as usize);
    let split = groups <= per_sm(SPLIT_MAX_GROUPS_PER_SM)
        && (split_rows || groups <= per_sm(SPLIT_ONE_WAVE_GROUPS_PER_SM));
    short_layout(&plain, head_dim, elem_bytes, split).unwrap_or(plain)
}

/// Rows in flight at one time, roughly: 132 SMs × 32 resident groups of one (row, head). The
/// order's worth is counted over spans of this many rows: the distinct columns (K/V rows) a
/// span touches are what L2 must hold while its units run.
const FLIGHT_ROWS: usize = 4096;

/// [`Reorder::Auto`] runs the units in the locality order only when its spans of
/// [`FLIGHT_ROWS`] rows touch at least this many times fewer distinct columns than the graph's
/// order: below it the order gains little and can cost more than it saves
/// (docs/kernels/fused-csr.md, "Tried and kept").
const AUTO_MIN_FLIGHT_SAVING: f64 = 1.3;

/// Rows per window for the orders asked for by name (the window packing's height; the others
/// only report their count with it).
const NAMED_WINDOW_ROWS: usize = 16;

/// The row order the fused CSR kernel runs `a`'s units in, for the plan's `reorder`: `Auto`
/// takes the locality order (reverse Cuthill–McKee after peeling hubs; a rectangular graph's
/// over its rows and columns together)
/// when it saves [`AUTO_MIN_FLIGHT_SAVING`]× the distinct columns per [`FLIGHT_ROWS`] rows, else
/// keeps the graph's order; the others as [`RowOrder::choose`] applies them.
pub(crate) fn csr_order(a: &Csr, reorder: Reorder) -> Result<RowOrder> {
    if reorder != Reorder::Auto {
        return Ok(RowOrder::choose(a, reorder, NAMED_WINDOW_ROWS)?);
    }
    let locality = RowOrder::choose(a, Reorder::Locality, FLIGHT_ROWS)?;
    if locality.permutation.is_some() && saving(&locality) >= AUTO_MIN_FLIGHT_SAVING {
        return Ok(locality);
    }
    // The graph's own order, with the count the locality order was measured against.
    Ok(RowOrder {
        permutation: None,
        used: Reorder::None,
        gathers: locality.gathers_natural,
        ..locality
    })
}

/// The report line of a lane layout.
fn layout_info(l: &Layout) -> String {
    if l.split > 1 {
        format!(
            "{}-lane groups split into {} subgroups of {} lanes ({} features a load) walking \
             shares of each unit's edges",
            l.group,
            l.split,
            l.group / l.split,
            l.vec
        )
    } else if l.short_tiles {
        format!(
            "narrow {}-lane groups ({} features a load, {} units a warp)",
            l.group,
            l.vec,
            32 / l.group
        )
    } else {
        format!("{}-lane groups ({} features a load)", l.group, l.vec)
    }
}

/// How many times fewer distinct columns per window `order` touches than the graph's order.
fn saving(order: &RowOrder) -> f64 {
    order.gathers_natural as f64 / order.gathers.max(1) as f64
}

/// The report line of `order`: the order and its distinct columns per window against the
/// graph's own order.
fn order_info(order: &RowOrder) -> String {
    format!(
        "units in {} row order ({} distinct columns per {}-row span, {:.2}x fewer than the \
         graph's order)",
        order.used,
        order.gathers,
        order.window_rows,
        saving(order)
    )
}

/// Attention's extras in the caller's CSR order (all optional; see `spattn::extras`, which
/// names this type `Extras`), as every fused kernel and the unfused composition take them.
#[derive(Clone, Copy, Debug)]
pub struct CsrExtras<'a, T: DType> {
    /// Added to each edge's score.
    pub bias: Option<DeviceBias<'a, T>>,
    /// `nnz × heads × head_dim`, added to each edge's key and value.
    pub edge_features: Option<&'a DeviceMatrix<T>>,
    /// Dropout on the probabilities (the weights of V).
    pub dropout: Option<Dropout>,
}

impl<T: DType> Default for CsrExtras<'_, T> {
    fn default() -> Self {
        Self {
            bias: None,
            edge_features: None,
            dropout: None,
        }
    }
}

/// The work units of the fused kernel on device, in the plan's row order: the column indices of
/// the row-renumbered mask, and [`RowUnits`] over it whose rows (and split rows) name the
/// caller's rows, so that the kernel reads Q and writes the output in the caller's order with
/// no lookup of its own.
#[derive(Debug)]
struct Units {
    col_indices: DeviceVec<u32>,
    rows: DeviceVec<u32>,
    starts: DeviceVec<u32>,
    parts: DeviceVec<u32>,
    split_rows: DeviceVec<u32>,
    part_first: DeviceVec<u32>,
    n_parts: usize,
    /// Per unit, caller edge − mask edge (mod 2³²): the extras' per-edge data is in the
    /// caller's order. None where the rows are in the caller's order (a shift of 0).
    shift: Option<DeviceVec<u32>>,
}

impl Units {
    /// Cuts the rows of `graph`, taken in `order`, into units of at most [`UNIT_CHUNK`] edges.
    fn upload(gpu: &Gpu, graph: &Csr, order: &RowOrder) -> Result<Self> {
        let (mask, units, shift) = match &order.permutation {
            Some(p) => {
                let mask = p.permute_csr_rows(graph)?;
                let mut units = RowUnits::new(&mask, UNIT_CHUNK);
                // Mask row r is the caller's row old_of_new[r] (a permutation of the rows, so
                // every index is in range); its edges start at mask offset r and at the caller's
                // offset of that row, so one shift maps each of a unit's edges.
                let old = p.old_of_new();
                let (mask_offsets, offsets) = (mask.row_offsets(), graph.row_offsets());
                let shift: Vec<u32> = units
                    .rows
                    .iter()
                    .map(|&r| {
                        let r = r as usize;
                        offsets[old[r] as usize].wrapping_sub(mask_offsets[r])
                    })
                    .collect();
                for r in units.rows.iter_mut().chain(units.split_rows.iter_mut()) {
                    *r = old[*r as usize];
                }
                (Some(mask), units, Some(shift))
            }
            None => (None, RowUnits::new(graph, UNIT_CHUNK), None),
        };
        let cols = mask.as_ref().unwrap_or(graph).col_indices();
        let n_parts = units.part_first.last().copied().unwrap_or(0) as usize;
        Ok(Self {
            col_indices: DeviceVec::from_host(gpu, cols)?,
            rows: DeviceVec::from_host(gpu, &units.rows)?,
            starts: DeviceVec::from_host(gpu, &units.starts)?,
            parts: DeviceVec::from_host(gpu, &units.parts)?,
            split_rows: DeviceVec::from_host(gpu, &units.split_rows)?,
            part_first: DeviceVec::from_host(gpu, &units.part_first)?,
            n_parts,
            shift: shift.map(|s| DeviceVec::from_host(gpu, &s)).transpose()?,
        })
    }
}

/// Where a plan's work units live: its own upload (a row order of its own), or the graph's
/// CSR schedule (the graph's row order, a graph built on the device: the SpMM's units are the
/// same units).
#[derive(Debug)]
enum UnitSource {
    Own(Box<Units>),
    Graph(Arc<DeviceGraph>),
}

/// The unit arrays one launch reads.
struct UnitView<'a> {
    col_indices: &'a DeviceVec<u32>,
    rows: &'a DeviceVec<u32>,
    starts: &'a DeviceVec<u32>,
    parts: &'a DeviceVec<u32>,
    split_rows: &'a DeviceVec<u32>,
    part_first: &'a DeviceVec<u32>,
    shift: Option<&'a DeviceVec<u32>>,
}

impl UnitSource {
    fn view(&self) -> Result<UnitView<'_>> {
        Ok(match self {
            UnitSource::Own(u) => UnitView {
                col_indices: &u.col_indices,
                rows: &u.rows,
                starts: &u.starts,
                parts: &u.parts,
                split_rows: &u.split_rows,
                part_first: &u.part_first,
                shift: u.shift.as_ref(),
            },
            UnitSource::Graph(g) => {
                let csr = g.csr()?;
                let ([rows, starts, parts, split_rows, part_first], _) = csr.schedule().units();
                UnitView {
                    col_indices: csr.col_indices(),
                    rows,
                    starts,
                    parts,
                    split_rows,
                    part_first,
                    shift: None,
                }
            }
        })
    }
}

/// The fused kernel's state for one plan: its work units (in the plan's row order) and the
/// workspace for the partials of split rows.
#[derive(Debug)]
pub struct FusedCsr {
    layout: Layout,
    units: UnitSource,
    /// The report line: the row order the units run in and the lane layout.
    order_info: String,
    /// (max, sum) per partial and head.
    part_ml: DeviceVec<f32>,
    /// Accumulator per partial, head and feature.
    part_acc: DeviceVec<f32>,
}

impl FusedCsr {
    /// Whether the fused CSR kernel can hold heads of `head_dim` features of `elem_bytes` in
    /// registers; the error says why not and what to use instead.
    pub fn supports(head_dim: usize, elem_bytes: usize) -> Result<()> {
        layout(head_dim, elem_bytes).map(|_| ())
    }

    /// Uploads `graph`'s units in `order` (its rows renumbered, [`csr_order`]) and sizes the
    /// workspace for `heads × head_dim` of `T`.
    fn in_order<T: DType>(
        gpu: &Gpu,
        graph: &Csr,
        order: &RowOrder,
        heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let bytes = std::mem::size_of::<T>();
        let plain = layout(head_dim, bytes)?;
        let units = Units::upload(gpu, graph, order)?;
        let parts = units.n_parts * heads;
        let groups = units.rows.len() * heads;
        let split_rows = units.n_parts > 0;
        let layout = choose_layout(plain, head_dim, bytes, groups, gpu.sm_count(), split_rows);
        Ok(Self {
            layout,
            units: UnitSource::Own(Box::new(units)),
            order_info: format!("{}; {}", order_info(order), layout_info(&layout)),
            part_ml: DeviceVec::zeros(gpu, parts * 2)?,
            part_acc: DeviceVec::zeros(gpu, parts * head_dim)?,
        })
    }

    /// Plans over a shared graph: in the row order `reorder` asks for
    /// ([`DeviceGraph::effective_reorder`]). A graph built on the device kept in its order
    /// runs the units of its CSR schedule (no upload, no host work); any other plan uploads
    /// units over the graph's host CSR in the order `csr_order` chooses, kept with the graph
    /// (the fused backward walks its units in it too).
    pub fn on_graph<T: DType>(
        graph: &Arc<DeviceGraph>,
        heads: usize,
        head_dim: usize,
        reorder: Reorder,
    ) -> Result<Self> {
        let reorder = graph.effective_reorder(reorder);
        if !(graph.built_on_device() && reorder == Reorder::None) {
            // The head's error before any host work.
            layout(head_dim, std::mem::size_of::<T>())?;
            let order = graph.csr_order(reorder)?;
            return Self::in_order::<T>(graph.gpu(), graph.host()?, &order, heads, head_dim);
        }
        let bytes = std::mem::size_of::<T>();
        let plain = layout(head_dim, bytes)?;
        let gpu = graph.gpu();
        let (n_units, n_parts) = {
            let (units, n_parts) = graph.csr()?.schedule().units();
            (units[0].len(), n_parts)
        };
        let groups = n_units * heads;
        let layout = choose_layout(plain, head_dim, bytes, groups, gpu.sm_count(), n_parts > 0);
        let parts = n_parts * heads;
        Ok(Self {
            layout,
            units: UnitSource::Graph(graph.clone()),
            order_info: format!(
                "units in the graph's row order (a graph built on the GPU is not reordered); {}",
                layout_info(&layout)
            ),
            part_ml: DeviceVec::zeros(gpu, parts * 2)?,
            part_acc: DeviceVec::zeros(gpu, parts * head_dim)?,
        })
    }

    /// One line for the plan's report: the row order the units run in and the lane layout.
    pub fn info(&self) -> &str {
        &self.order_info
    }

    /// `out = softmax(scale · Q Kᵀ ⊙ A) · V` in one kernel (plus a merge for split rows).
    /// Shapes are checked by the plan.
    pub fn forward<T: DType>(
        &mut self,
        gpu: &Gpu,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        scale: f32,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        self.run(gpu, q, k, v, scale, None, out)
    }

    /// [`forward`](Self::forward) with attention's extras, in the same kernel: per row `i`,
    /// edge `e = (i, j)` of the caller's CSR, `s_e = scale·⟨q_i, k_j + f_e⟩ + b_e`,
    /// `out_i = Σ softmax(s)_e · m_e/(1 − rate) · (v_j + f_e)` (see `spattn::extras`). Q, K, V
    /// shapes are checked by the plan; the extras' lengths here.
    ///
    /// # Errors
    /// A bias that is not `nnz × heads` (or `nnz`, shared), edge features that are not
    /// `nnz × heads × head_dim`, buffers of another GPU; launch errors.
    pub fn forward_with_extras<T: DType>(
        &mut self,
        gpu: &Gpu,
        (q, k, v): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        scale: f32,
        extras: &CsrExtras<'_, T>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        extras.check(
            gpu,
            KERNEL,
            self.units.view()?.col_indices.len(),
            q.shape(),
            true,
        )?;
        self.run(gpu, q, k, v, scale, Some(extras), out)
    }

    #[allow(clippy::too_many_arguments)] // the operands of one launch
    fn run<T: DType>(
        &mut self,
        gpu: &Gpu,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        scale: f32,
        extras: Option<&CsrExtras<'_, T>>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        let shape = q.shape();
        let u = self.units.view()?;
        let Layout { group, split, .. } = self.layout;
        let features = extras.map(|e| e.edge_features.is_some());
        let name = kernel_named(&FUSED_CSR, kernel_name(T::NAME, &self.layout, features))?;
        let f = gpu.load_function(FUSED_CSR.name, FUSED_CSR.ptx, name)?;
        let n_units = to_u32("units", u.rows.len())?;
        let heads = to_u32("heads", shape.heads)?;
        let head_dim = to_u32("head_dim", shape.head_dim)?;
        let groups = u.rows.len() * shape.heads;
        let cfg = LaunchConfig {
            grid_dim: (blocks_for(groups, THREADS / group)?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = gpu.launch_builder(&f);
        args.arg(u.rows.slice())
            .arg(u.starts.slice())
            .arg(u.parts.slice())
            .arg(&n_units)
            .arg(u.col_indices.slice())
            .arg(q.slice())
            .arg(k.slice())
            .arg(v.slice())
            .arg(&heads)
            .arg(&head_dim)
            .arg(&scale)
            .arg(&group)
            .arg(&split)
            .arg(out.slice_mut())
            .arg(self.part_ml.slice_mut())
            .arg(self.part_acc.slice_mut());
        // The extras' arguments (null pointers: absent), alive until the launch below.
        let ex = extras.map(|e| super::KernelExtras::new(e, heads));
        if let (Some(ex), Some(e)) = (&ex, extras) {
            args.arg_or_null(e.bias.as_ref().map(DeviceBias::values))
                .arg(&ex.bias_heads)
                .arg_or_null(e.edge_features.map(DeviceMatrix::as_vec))
                .arg_or_null(u.shift);
            ex.push_dropout(&mut args);
        }
        // SAFETY: unit arrays hold n_units (+1) entries and their edge ranges lie in [0, nnz)
        // of col_indices (RowUnits of the row-renumbered mask, nnz entries); unit rows are
        // caller rows < n_rows (mapped through a permutation of the rows), K/V rows are column
        // indices < n_cols, each heads*head_dim long (shapes checked by the plan); lanes touch
        // features < head_dim only (vec divides head_dim); partial slots < n_parts, and
        // part_ml / part_acc hold n_parts*heads*2 / n_parts*heads*head_dim f32. Extras: a
        // unit's edges shifted by unit_shift[u] (n_units entries) are the same row's edges in
        // the caller's CSR, so < nnz; the bias holds nnz*bias_heads and the features
        // nnz*heads*head_dim (checked by forward_with_extras).
        unsafe { launch(name, &mut args, cfg) }?;

        let n_split = u.split_rows.len();
        if n_split > 0 {
            let merge = kernel_named(&FUSED_CSR, merge_kernel(T::NAME))?;
            let f = gpu.load_function(FUSED_CSR.name, FUSED_CSR.ptx, merge)?;
            let n_split_u = to_u32("split rows", n_split)?;
            let cfg = LaunchConfig {
                grid_dim: (blocks_for(n_split * shape.row_len(), THREADS)?, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = gpu.launch_builder(&f);
            args.arg(u.split_rows.slice())
                .arg(u.part_first.slice())
                .arg(&n_split_u)
                .arg(&heads)
                .arg(&head_dim)
                .arg(self.part_ml.slice())
                .arg(self.part_acc.slice())
                .arg(out.slice_mut());
            // SAFETY: reads split_rows[0..n_split), part_first[0..=n_split] (partials
            // < n_parts, within part_ml / part_acc as above), writes caller rows
            // split_rows[s] < n_rows of out.
            unsafe { launch(merge, &mut args, cfg) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spattn_formats::Permutation;

    /// A ring of `n` nodes where each links to its `k` nearest on both sides (with self loops):
    /// a graph whose own order is already a locality order.
    fn banded(n: usize, k: usize) -> Csr {
        let mut edges = Vec::new();
        for r in 0..n {
            for d in 0..=2 * k {
                edges.push((r as u32, ((r + n + d - k) % n) as u32));
            }
        }
        Csr::from_edges(n, n, &edges).unwrap()
    }

    #[test]
    fn auto_order_renumbers_only_a_scrambled_graph() {
        let n = 4 * FLIGHT_ROWS;
        let band = banded(n, 3);
        let kept = csr_order(&band, Reorder::Auto).unwrap();
        assert_eq!(kept.used, Reorder::None);
        assert!(kept.permutation.is_none());
        // The same graph with its nodes scrambled: each span of rows touches columns all over.
        let scramble: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % n as u32).collect();
        let p = Permutation::try_new(scramble).unwrap();
        let scrambled = p.permute_csr(&band).unwrap();
        let o = csr_order(&scrambled, Reorder::Auto).unwrap();
        assert_eq!(o.used, Reorder::Locality);
        assert!(o.gathers_natural as f64 >= AUTO_MIN_FLIGHT_SAVING * o.gathers as f64);
        assert!(order_info(&o).starts_with("units in locality row order"));
        // Named orders are applied as asked; a tiny rectangular graph keeps its order (Auto).
        let d = csr_order(&scrambled, Reorder::Degree).unwrap();
        assert_eq!(
            (d.used, d.window_rows),
            (Reorder::Degree, NAMED_WINDOW_ROWS)
        );
        let rect = Csr::from_edges(3, 5, &[(0, 4), (2, 1)]).unwrap();
        assert_eq!(csr_order(&rect, Reorder::Auto).unwrap().used, Reorder::None);
    }

    #[test]
    fn layouts_cover_the_head() {
        for (d, bytes) in [
            (1, 2),
            (3, 4),
            (24, 2),
            (64, 2),
            (96, 4),
            (128, 2),
            (256, 4),
            (512, 4),
        ] {
            let l = layout(d, bytes).unwrap();
            assert!(
                l.vec as usize * l.group as usize * l.nv as usize >= d,
                "d={d}"
            );
            assert_eq!(d % l.vec as usize, 0);
            assert!([1, 2, 4].contains(&l.nv));
        }
        let l = |vec, group, nv| Layout {
            vec,
            group,
            nv,
            split: 1,
            short_tiles: false,
        };
        assert_eq!(layout(128, 2).unwrap(), l(4, 32, 1));
        assert_eq!(layout(64, 2).unwrap(), l(2, 32, 1));
        assert_eq!(layout(256, 2).unwrap(), l(8, 32, 1));
        assert_eq!(layout(24, 2).unwrap(), l(8, 4, 1));
        // Odd head_dim beyond 4 vectors of 1 per lane cannot be held in registers.
        assert!(matches!(layout(129, 2), Err(Error::Unsupported { .. })));
    }

    #[test]
    fn short_layouts_cover_the_head_once_per_subgroup() {
        for d in [1usize, 3, 8, 24, 32, 48, 64, 96, 128, 256, 512, 1024] {
            for bytes in [2usize, 4] {
                let Ok(plain) = layout(d, bytes) else {
                    continue;
                };
                for split in [true, false] {
                    let Some(l) = short_layout(&plain, d, bytes, split) else {
                        continue;
                    };
                    // Only where the plain layout gives a (unit, head) the whole warp.
                    assert_eq!(plain.group, 32, "d={d}");
                    let sub = (l.group / l.split) as usize;
                    assert!(l.short_tiles && l.nv == 1 && l.group <= 32, "d={d}");
                    assert_eq!(l.split > 1, split);
                    assert!(l.split <= MAX_SPLIT && (sub as u32) >= 32 / MAX_SPLIT);
                    assert_eq!(d % l.vec as usize, 0);
                    assert!(l.vec as usize * bytes <= 16);
                    // Each subgroup's lanes hold every feature once.
                    assert!(sub * l.vec as usize >= d && (sub / 2) * (l.vec as usize) < d);
                }
            }
        }
        let l = |vec, group, split| Layout {
            vec,
            group,
            nv: 1,
            split,
            short_tiles: true,
        };
        let short = |d, bytes, split| short_layout(&layout(d, bytes).unwrap(), d, bytes, split);
        // f16 64: 4 subgroups of 8 lanes of 8; f16 128 and f32 64: 2 of 16 lanes of 8 / 4.
        assert_eq!(short(64, 2, true), Some(l(8, 32, 4)));
        assert_eq!(short(64, 2, false), Some(l(8, 8, 1)));
        assert_eq!(short(128, 2, true), Some(l(8, 32, 2)));
        assert_eq!(short(128, 2, false), Some(l(8, 16, 1)));
        assert_eq!(short(64, 4, true), Some(l(4, 32, 2)));
        assert_eq!(short(32, 4, false), Some(l(4, 8, 1)));
        for (d, bytes) in [(128, 4), (96, 4), (256, 2), (32, 2), (16, 4), (24, 2)] {
            assert_eq!(short(d, bytes, true), None, "d={d} bytes={bytes}");
        }
    }

    #[test]
    fn layout_choice() {
        // Split groups up to 256 (unit, head) groups per SM with a split row, narrow groups
        // above, the plain layout where neither exists (f32 at head_dim 128).
        let choose = |d, bytes, groups| {
            choose_layout(layout(d, bytes).unwrap(), d, bytes, groups, 132, true)
        };
        let split = choose(64, 2, 256 * 132);
        assert_eq!((split.group, split.split), (32, 4));
        let narrow = choose(64, 2, 256 * 132 + 1);
        assert_eq!(
            (narrow.group, narrow.split, narrow.short_tiles),
            (8, 1, true)
        );
        assert_eq!(choose(128, 4, 10), layout(128, 4).unwrap());
        // Without a split row, split groups only up to about one wave of them.
        let short_rows =
            |groups| choose_layout(layout(64, 2).unwrap(), 64, 2, groups, 132, false).split;
        assert_eq!(short_rows(32 * 132), 4);
        assert_eq!(short_rows(32 * 132 + 1), 1);
        assert_eq!(short_rows(256 * 132), 1);
        assert!(matches!(layout(129, 2), Err(Error::Unsupported { .. })));
        assert!(layout_info(&split).contains("4 subgroups of 8 lanes"));
        assert_eq!(
            layout_info(&narrow),
            "narrow 8-lane groups (8 features a load, 4 units a warp)"
        );
        assert_eq!(
            layout_info(&layout(128, 2).unwrap()),
            "32-lane groups (4 features a load)"
        );
    }
}
