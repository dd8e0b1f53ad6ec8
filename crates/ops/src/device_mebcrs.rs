//! [`DeviceMeBcrs`]: an [`MeBcrs`] attention mask uploaded once, for the tensor-core kernels
//! ([`crate::tc_ops`]), with the load-balancing schedule they walk ([`WorkItems`]).
//!
//! # Device arrays
//!
//! The ME-BCRS arrays as the format defines them (see [`spattn_formats::mebcrs`]):
//! `row_pointers` (`u32`, windows + 1), `column_indices` (`u32`, one per vector), `row_masks`
//! (`u8`, one per vector: a kernel reads 16 masks of a k-step in one 16-byte transaction, so
//! widening them would only cost bandwidth), and `edge_to_slot` (`u32`, one per CSR edge), which
//! the layout conversions ([`crate::tc_ops::csr_to_slots`], [`crate::tc_ops::slots_to_csr`]) use.
//!
//! # Schedule
//!
//! Symmetrized power-law graphs have hub rows of 10^4–10^5 edges, so a few windows hold far more
//! vectors than the rest. The kernels take **work items** (window, first vector, end vector) of
//! at most a chunk of vectors, one warp each, so no window serializes the grid. SDDMM needs
//! nothing more (its outputs are per slot), so its items are short ([`sddmm_chunk`]: one or
//! two k-steps). SpMM items of a split window (chunk [`WORK_CHUNK`]) write f32 partial rows to a
//! scratch buffer, and a second pass sums each split window's partials in item order: no
//! atomics, no memset, and the same bits on every run. Edge softmax gives windows of more than
//! [`SOFTMAX_LONG_WINDOW`] vectors a whole thread block per head.

use spattn_formats::{Csr, FillStats, MeBcrs, Reorder, RowOrder};

use crate::buffer::{DeviceVec, Scratch};
use crate::error::Result;
use crate::gpu::Gpu;
use crate::launch::OnGpu;

/// Vectors per SpMM work item: a window with more is cut into items of this many (the last one
/// shorter). A multiple of 16, so every item but a window's last starts on a whole k-step.
pub(crate) const WORK_CHUNK: u32 = 256;

/// Fewest vectors per SDDMM work item ([`sddmm_chunk`]'s lower bound): one k-step.
pub(crate) const MIN_SDDMM_CHUNK: u32 = 16;

/// Most vectors per SDDMM work item ([`sddmm_chunk`]'s upper bound): two k-steps.
pub(crate) const MAX_SDDMM_CHUNK: u32 = 32;

/// Warps per SM the SDDMM chunk rule assumes resident.
const WARPS_PER_SM: usize = 16;

/// Vectors per SDDMM work item for a mask of `n_vectors` vectors on a GPU of `sm_count` SMs:
/// one k-step (16 vectors) when the mask is too small to give each resident warp 64 vectors,
/// else two. SDDMM items are independent (no partials to merge), so short items cost only a
/// re-read of the window's Q tile, and they bound the longest item — the kernel's critical
/// path on small masks, the load balance of hub windows on large ones (docs/kernels/tc-ops.md,
/// "Tried and kept").
pub(crate) fn sddmm_chunk(n_vectors: usize, sm_count: u32) -> u32 {
    let slots = (sm_count.max(1) as usize).saturating_mul(WARPS_PER_SM);
    if n_vectors / slots >= 2 * MAX_SDDMM_CHUNK as usize {
        MAX_SDDMM_CHUNK
    } else {
        MIN_SDDMM_CHUNK
    }
}

/// Edge softmax gives windows of more vectors than this a thread block per head (the others a
/// warp, which takes 32 vectors a step).
pub(crate) const SOFTMAX_LONG_WINDOW: u32 = 512;

/// Marks an item whose window is not split (it writes its output rows directly).
pub(crate) const NO_PARTIAL: u32 = u32::MAX;

/// The work items of the tensor-core kernels, on the host: item `i` covers vectors
/// `starts[i]..ends[i]` of window `windows[i]`.
///
/// Items are in window order and cover every vector once; every window, an empty one included,
/// has at least one item, so SpMM writes every output row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WorkItems {
    /// Window of each item.
    pub windows: Vec<u32>,
    /// First vector of each item.
    pub starts: Vec<u32>,
    /// One past the last vector of each item.
    pub ends: Vec<u32>,
    /// Partial index of each item of a split window (consecutive within the window), or
    /// [`NO_PARTIAL`].
    pub partials: Vec<u32>,
    /// The windows cut into several items.
    pub split_windows: Vec<u32>,
    /// Partials of split window `s`: `partial_first[s]..partial_first[s + 1]`
    /// (`split windows + 1` entries).
    pub partial_first: Vec<u32>,
}

impl WorkItems {
    /// Cuts the windows of `row_pointers` (an ME-BCRS window-pointer array) into items of at
    /// most `chunk` vectors (`chunk` ≥ 1).
    pub(crate) fn new(row_pointers: &[u32], chunk: u32) -> Self {
        let chunk = chunk.max(1);
        let n_windows = row_pointers.len().saturating_sub(1);
        let mut items = WorkItems {
            windows: Vec::with_capacity(n_windows),
            starts: Vec::with_capacity(n_windows),
            ends: Vec::with_capacity(n_windows),
            partials: Vec::with_capacity(n_windows),
            split_windows: Vec::new(),
            partial_first: vec![0],
        };
        let mut n_partials = 0u32;
        for w in 0..n_windows {
            let (s, e) = (row_pointers[w], row_pointers[w + 1]);
            let split = e - s > chunk;
            if split {
                items.split_windows.push(w as u32);
            }
            let mut p = s;
            loop {
                let end = p.saturating_add(chunk).min(e);
                items.windows.push(w as u32);
                items.starts.push(p);
                items.ends.push(end);
                if split {
                    items.partials.push(n_partials);
                    n_partials += 1;
                } else {
                    items.partials.push(NO_PARTIAL);
                }
                p = end;
                if p >= e {
                    break;
                }
            }
            if split {
                items.partial_first.push(n_partials);
            }
        }
        items
    }

    /// Number of partials (items of split windows).
    pub(crate) fn n_partials(&self) -> usize {
        self.partial_first.last().copied().unwrap_or(0) as usize
    }
}

/// The windows of more than `threshold` vectors: edge softmax gives each a thread block.
pub(crate) fn long_windows(row_pointers: &[u32], threshold: u32) -> Vec<u32> {
    row_pointers
        .windows(2)
        .enumerate()
        .filter(|(_, p)| p[1] - p[0] > threshold)
        .map(|(w, _)| w as u32)
        .collect()
}

/// Work items on the device: item `i` covers vectors `starts[i]..ends[i]` of window
/// `windows[i]`.
#[derive(Debug)]
pub(crate) struct DeviceItems {
    pub(crate) windows: DeviceVec<u32>,
    pub(crate) starts: DeviceVec<u32>,
    pub(crate) ends: DeviceVec<u32>,
}

impl DeviceItems {
    fn upload(gpu: &Gpu, items: &WorkItems) -> Result<Self> {
        Ok(Self {
            windows: DeviceVec::from_host_named(gpu, "ME-BCRS item windows", &items.windows)?,
            starts: DeviceVec::from_host_named(gpu, "ME-BCRS item starts", &items.starts)?,
            ends: DeviceVec::from_host_named(gpu, "ME-BCRS item ends", &items.ends)?,
        })
    }

    /// Number of items.
    pub(crate) fn len(&self) -> usize {
        self.windows.len()
    }

    fn num_bytes(&self) -> usize {
        self.windows.num_bytes() + self.starts.num_bytes() + self.ends.num_bytes()
    }
}

/// The device side of the tensor-core schedule (SDDMM and SpMM [`WorkItems`], long softmax
/// windows), built at upload.
#[derive(Debug)]
pub(crate) struct MeBcrsSchedule {
    /// SDDMM items, of [`sddmm_chunk`] vectors at most.
    pub(crate) sddmm_items: DeviceItems,
    /// SpMM items, of [`WORK_CHUNK`] vectors at most.
    pub(crate) spmm_items: DeviceItems,
    pub(crate) item_partials: DeviceVec<u32>,
    pub(crate) split_windows: DeviceVec<u32>,
    pub(crate) partial_first: DeviceVec<u32>,
    pub(crate) n_partials: usize,
    pub(crate) long_windows: DeviceVec<u32>,
    /// f32 partial rows of split SpMM windows (`n_partials × 8 × heads × head_dim`), grown on
    /// demand; never needs zeroing (every partial element is written before it is read).
    pub(crate) scratch: Scratch,
}

impl MeBcrsSchedule {
    fn upload(gpu: &Gpu, row_pointers: &[u32]) -> Result<Self> {
        let n_vectors = row_pointers.last().copied().unwrap_or(0) as usize;
        let sddmm = WorkItems::new(row_pointers, sddmm_chunk(n_vectors, gpu.sm_count()));
        let items = WorkItems::new(row_pointers, WORK_CHUNK);
        let long = long_windows(row_pointers, SOFTMAX_LONG_WINDOW);
        Ok(Self {
            sddmm_items: DeviceItems::upload(gpu, &sddmm)?,
            spmm_items: DeviceItems::upload(gpu, &items)?,
            item_partials: DeviceVec::from_host_named(
                gpu,
                "ME-BCRS item partials",
                &items.partials,
            )?,
            split_windows: DeviceVec::from_host_named(
                gpu,
                "ME-BCRS split windows",
                &items.split_windows,
            )?,
            partial_first: DeviceVec::from_host_named(
                gpu,
                "ME-BCRS partial offsets",
                &items.partial_first,
            )?,
            n_partials: items.n_partials(),
            long_windows: DeviceVec::from_host_named(gpu, "softmax long windows", &long)?,
            scratch: Scratch::default(),
        })
    }

    fn device_bytes(&self) -> usize {
        self.sddmm_items.num_bytes()
            + self.spmm_items.num_bytes()
            + self.item_partials.num_bytes()
            + self.split_windows.num_bytes()
            + self.partial_first.num_bytes()
            + self.long_windows.num_bytes()
            + self.scratch.num_bytes()
    }
}

/// An ME-BCRS mask in device memory, for the tensor-core ops of [`crate::tc_ops`].
///
/// The layout does not depend on the block width, so one upload serves the f16, bf16 and tf32
/// kernels. Per-slot values (scores, probabilities) that go with it are f32, **head-major**:
/// `heads × n_slots`, element `h · n_slots + slot` (see [`crate::tc_ops`]).
///
/// ```no_run
/// use spattn_formats::Csr;
/// use spattn_ops::{DeviceMeBcrs, Gpu};
/// let gpu = Gpu::new(0)?;
/// let a = Csr::from_edges(9, 6, &[(0, 1), (0, 4), (3, 4), (8, 2)])?;
/// let d = DeviceMeBcrs::from_csr(&gpu, &a)?;
/// assert_eq!((d.n_windows(), d.n_vectors(), d.n_slots(), d.nnz()), (2, 3, 24, 4));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct DeviceMeBcrs {
    n_rows: usize,
    n_cols: usize,
    nnz: usize,
    n_windows: usize,
    n_vectors: usize,
    row_pointers: DeviceVec<u32>,
    column_indices: DeviceVec<u32>,
    row_masks: DeviceVec<u8>,
    edge_to_slot: DeviceVec<u32>,
    /// Per window row, the caller's row (Q loads, output stores) when the rows were
    /// renumbered; `None` in the graph's own order.
    row_ids: Option<DeviceVec<u32>>,
    order: RowOrderReport,
    fill_stats: FillStats,
    schedule: MeBcrsSchedule,
}

/// Which row order a [`DeviceMeBcrs`] was built in, and the vectors (K/V row gathers per head)
/// it saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowOrderReport {
    /// The order used ([`Reorder::None`] for the graph's own).
    pub used: Reorder,
    /// Vectors of the graph's own order.
    pub vectors_natural: usize,
    /// Vectors of the order used.
    pub vectors: usize,
}

impl DeviceMeBcrs {
    /// Uploads `me` to `gpu`: its arrays, the edge → slot map and the work schedule (computed
    /// on the host). The rows are `me`'s own.
    ///
    /// Errors: [`Error::Format`] if a slot index does not fit in `u32` (more than 2^29
    /// vectors), [`Error::TooLarge`] if the number of work items does not, driver errors.
    ///
    /// [`Error::Format`]: crate::Error::Format
    /// [`Error::TooLarge`]: crate::Error::TooLarge
    pub(crate) fn upload(gpu: &Gpu, me: &MeBcrs) -> Result<Self> {
        let edge_to_slot = me.edge_to_slot()?;
        let order = RowOrderReport {
            used: Reorder::None,
            vectors_natural: me.n_vectors(),
            vectors: me.n_vectors(),
        };
        Self::upload_parts(gpu, me, &edge_to_slot, None, order)
    }

    fn upload_parts(
        gpu: &Gpu,
        me: &MeBcrs,
        edge_to_slot: &[u32],
        row_ids: Option<&[u32]>,
        order: RowOrderReport,
    ) -> Result<Self> {
        let schedule = MeBcrsSchedule::upload(gpu, me.row_pointers())?;
        crate::launch::to_u32("ME-BCRS work items", schedule.sddmm_items.len())?;
        crate::launch::to_u32("ME-BCRS work items", schedule.spmm_items.len())?;
        Ok(DeviceMeBcrs {
            n_rows: me.n_rows(),
            n_cols: me.n_cols(),
            nnz: me.nnz(),
            n_windows: me.n_windows(),
            n_vectors: me.n_vectors(),
            row_pointers: DeviceVec::from_host_named(
                gpu,
                "ME-BCRS row pointers",
                me.row_pointers(),
            )?,
            column_indices: DeviceVec::from_host_named(
                gpu,
                "ME-BCRS column indices",
                me.column_indices(),
            )?,
            row_masks: DeviceVec::from_host_named(gpu, "ME-BCRS row masks", me.row_masks())?,
            edge_to_slot: DeviceVec::from_host_named(gpu, "ME-BCRS edge to slot", edge_to_slot)?,
            row_ids: row_ids
                .map(|ids| DeviceVec::from_host_named(gpu, "ME-BCRS row ids", ids))
                .transpose()?,
            order,
            fill_stats: me.fill_stats(),
            schedule,
        })
    }

    /// An ME-BCRS built on the device (`crate::device_plan`) in the graph's own row order: its
    /// `(n_rows, n_cols, nnz)`, the window pointers read back and on the device, and the
    /// column indices, row masks and edge → slot map; the schedule is cut from the pointers
    /// and uploaded.
    pub(crate) fn built_on_device(
        gpu: &Gpu,
        (n_rows, n_cols, nnz): (usize, usize, usize),
        pointers: &[u32],
        row_pointers: DeviceVec<u32>,
        (column_indices, row_masks, edge_to_slot): (DeviceVec<u32>, DeviceVec<u8>, DeviceVec<u32>),
    ) -> Result<Self> {
        let schedule = MeBcrsSchedule::upload(gpu, pointers)?;
        crate::launch::to_u32("ME-BCRS work items", schedule.sddmm_items.len())?;
        crate::launch::to_u32("ME-BCRS work items", schedule.spmm_items.len())?;
        let n_windows = pointers.len().saturating_sub(1);
        let n_vectors = column_indices.len();
        let width = MeBcrs::BLOCK_WIDTH_F16;
        let (blocks, max_blocks) = MeBcrs::block_counts(pointers, width);
        Ok(DeviceMeBcrs {
            n_rows,
            n_cols,
            nnz,
            n_windows,
            n_vectors,
            row_pointers,
            column_indices,
            row_masks,
            edge_to_slot,
            row_ids: None,
            order: RowOrderReport {
                used: Reorder::None,
                vectors_natural: n_vectors,
                vectors: n_vectors,
            },
            fill_stats: FillStats {
                windows: n_windows,
                blocks,
                edges: nnz,
                slots: blocks * MeBcrs::WINDOW_ROWS * width,
                max_blocks_per_window: max_blocks,
            },
            schedule,
        })
    }

    /// Converts `csr` to ME-BCRS on the host (block width 8, the f16 one; the fill statistics
    /// use it) and uploads it, in the graph's own row order.
    pub fn from_csr(gpu: &Gpu, csr: &Csr) -> Result<Self> {
        Self::upload(gpu, &MeBcrs::from_csr(csr, MeBcrs::BLOCK_WIDTH_F16)?)
    }

    /// [`Self::from_csr`] with the rows renumbered as `reorder` says ([`RowOrder::choose`] for
    /// 8-row windows: [`Reorder::Auto`] keeps the order with the fewest vectors), so that a
    /// window's rows share more columns: fewer vectors, fewer V/K rows gathered. Zero-copy and
    /// invisible to the caller: the kernels load Q and store the output through a row-id
    /// array, columns keep the caller's ids, and [`Self::edge_to_slot`] stays in `csr`'s edge
    /// order, so every op takes and returns the same arrays as without reordering.
    ///
    /// ```no_run
    /// use spattn_formats::{Csr, Reorder};
    /// use spattn_ops::{DeviceMeBcrs, Gpu};
    /// let gpu = Gpu::new(0)?;
    /// let a = Csr::from_edges(9, 9, &[(0, 1), (0, 4), (3, 4), (8, 2)])?;
    /// let d = DeviceMeBcrs::from_csr_reordered(&gpu, &a, Reorder::Degree)?;
    /// assert_eq!(d.row_order().used, Reorder::Degree);
    /// assert_eq!(d.nnz(), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// Errors: as `Self::upload`.
    pub fn from_csr_reordered(gpu: &Gpu, csr: &Csr, reorder: Reorder) -> Result<Self> {
        let order = RowOrder::choose(csr, reorder, MeBcrs::WINDOW_ROWS)?;
        let Some(p) = &order.permutation else {
            return Self::from_csr(gpu, csr);
        };
        let permuted = p.permute_csr_rows(csr)?;
        let me = MeBcrs::from_csr(&permuted, MeBcrs::BLOCK_WIDTH_F16)?;
        let slots_of_permuted = me.edge_to_slot()?;
        let edge_to_slot = compose_edge_map(csr, &permuted, p.new_of_old(), &slots_of_permuted);
        let report = RowOrderReport {
            used: order.used,
            vectors_natural: order.gathers_natural,
            vectors: me.n_vectors(),
        };
        Self::upload_parts(gpu, &me, &edge_to_slot, Some(p.old_of_new()), report)
    }

    /// Number of rows (query nodes).
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }
    /// Number of columns (key nodes).
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }
    /// Number of edges.
    pub fn nnz(&self) -> usize {
        self.nnz
    }
    /// Number of 8-row windows.
    pub fn n_windows(&self) -> usize {
        self.n_windows
    }
    /// Number of vectors (8×1 column slices of a window).
    pub fn n_vectors(&self) -> usize {
        self.n_vectors
    }
    /// Number of slots (`8 · n_vectors`): per-slot arrays hold `heads × n_slots` values.
    pub fn n_slots(&self) -> usize {
        self.n_vectors * MeBcrs::WINDOW_ROWS
    }
    /// Window pointers (`n_windows + 1` entries).
    pub(crate) fn row_pointers(&self) -> &DeviceVec<u32> {
        &self.row_pointers
    }
    /// The column of every vector.
    pub(crate) fn column_indices(&self) -> &DeviceVec<u32> {
        &self.column_indices
    }
    /// The row mask of every vector (bit `r`: row `8w + r` has the column).
    pub fn row_masks(&self) -> &DeviceVec<u8> {
        &self.row_masks
    }
    /// The slot of every CSR edge, in CSR order (`nnz` entries).
    pub fn edge_to_slot(&self) -> &DeviceVec<u32> {
        &self.edge_to_slot
    }
    /// Per window row (`n_rows` entries), the caller's row, when the rows were renumbered
    /// ([`Self::from_csr_reordered`]); `None` in the graph's own order.
    pub fn row_ids(&self) -> Option<&DeviceVec<u32>> {
        self.row_ids.as_ref()
    }
    /// The row order the matrix was built in.
    pub fn row_order(&self) -> RowOrderReport {
        self.order
    }
    /// Fill of the tensor-core blocks (block width 8), computed at upload: how much of the
    /// tensor cores' work is on real edges.
    pub fn fill_stats(&self) -> &FillStats {
        &self.fill_stats
    }
    pub(crate) fn schedule(&self) -> &MeBcrsSchedule {
        &self.schedule
    }
    /// The handle the matrix was uploaded with.
    pub fn gpu(&self) -> &Gpu {
        self.row_pointers.gpu()
    }
    /// Device memory the matrix occupies, in bytes (schedule and scratch included).
    pub fn device_bytes(&self) -> usize {
        self.row_pointers.allocated_bytes()
            + self.column_indices.allocated_bytes()
            + self.row_masks.allocated_bytes()
            + self.edge_to_slot.allocated_bytes()
            + self.row_ids.as_ref().map_or(0, DeviceVec::allocated_bytes)
            + self.schedule.device_bytes()
    }
}

/// The slot of every edge of `a` in `a`'s edge order, given the slots of `permuted`'s edges
/// (`permuted` = `a` with row `old` moved to `new_of_old[old]`, each row's edges in the same
/// order).
fn compose_edge_map(
    a: &Csr,
    permuted: &Csr,
    new_of_old: &[u32],
    slots_of_permuted: &[u32],
) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.nnz());
    let (from, to) = (a.row_offsets(), permuted.row_offsets());
    for (old, &new) in new_of_old.iter().enumerate() {
        let len = (from[old + 1] - from[old]) as usize;
        let start = to[new as usize] as usize;
        out.extend_from_slice(&slots_of_permuted[start..start + len]);
    }
    out
}

impl OnGpu for DeviceMeBcrs {
    fn gpu(&self) -> &Gpu {
        self.row_pointers.gpu()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sddmm_chunk_example() -> std::result::Result<(), Box<dyn std::error::Error>> {
        use crate::device_mebcrs::{sddmm_chunk, MAX_SDDMM_CHUNK, MIN_SDDMM_CHUNK};
        assert_eq!(sddmm_chunk(10_000, 132), MIN_SDDMM_CHUNK); // cora
        assert_eq!(sddmm_chunk(2_000_000, 132), MAX_SDDMM_CHUNK); // ogbn-arxiv
        assert_eq!(sddmm_chunk(0, 0), MIN_SDDMM_CHUNK);
        Ok(())
    }

    #[test]
    fn work_items_example() -> std::result::Result<(), Box<dyn std::error::Error>> {
        use crate::device_mebcrs::{WorkItems, NO_PARTIAL};
        // Window 0: 5 vectors, window 1: none, window 2: 1 vector.
        let items = WorkItems::new(&[0, 5, 5, 6], 2);
        assert_eq!(items.windows, vec![0, 0, 0, 1, 2]);
        assert_eq!(items.starts, vec![0, 2, 4, 5, 5]);
        assert_eq!(items.ends, vec![2, 4, 5, 5, 6]);
        assert_eq!(items.partials, vec![0, 1, 2, NO_PARTIAL, NO_PARTIAL]);
        assert_eq!(items.split_windows, vec![0]);
        assert_eq!(items.partial_first, vec![0, 3]);
        Ok(())
    }

    #[test]
    fn long_windows_example() -> std::result::Result<(), Box<dyn std::error::Error>> {
        use crate::device_mebcrs::long_windows;
        assert_eq!(long_windows(&[0, 5, 5, 600, 610], 512), vec![2]);
        Ok(())
    }

    #[test]
    fn items_cover_every_vector_once_and_every_window() {
        let pointers = [0u32, 0, 3, 3, 700, 701, 1300];
        for chunk in [1, 16, 256, 10_000] {
            let it = WorkItems::new(&pointers, chunk);
            let n_windows = pointers.len() - 1;
            let mut next = vec![None; n_windows];
            for i in 0..it.windows.len() {
                let w = it.windows[i] as usize;
                let (s, e) = (it.starts[i], it.ends[i]);
                assert!(s <= e && e - s <= chunk);
                assert_eq!(s, next[w].unwrap_or(pointers[w]), "contiguous items");
                next[w] = Some(e);
                let split = pointers[w + 1] - pointers[w] > chunk;
                assert_eq!(it.partials[i] != NO_PARTIAL, split);
            }
            for w in 0..n_windows {
                assert_eq!(next[w], Some(pointers[w + 1]), "window {w} covered");
            }
            // Partials: consecutive per split window, in item order.
            let mut p = 0;
            for (s, &w) in it.split_windows.iter().enumerate() {
                assert_eq!(it.partial_first[s], p);
                let of_w: Vec<u32> = (0..it.windows.len())
                    .filter(|&i| it.windows[i] == w)
                    .map(|i| it.partials[i])
                    .collect();
                assert_eq!(of_w, (p..p + of_w.len() as u32).collect::<Vec<_>>());
                p += of_w.len() as u32;
            }
            assert_eq!(it.n_partials(), p as usize);
        }
    }

    #[test]
    fn composed_edge_map_follows_the_original_edge_order() {
        let a = Csr::from_edges(
            20,
            20,
            &[
                (0, 3),
                (0, 7),
                (2, 1),
                (5, 5),
                (5, 9),
                (5, 19),
                (11, 0),
                (19, 4),
                (19, 18),
            ],
        )
        .unwrap();
        let p = spattn_formats::Permutation::by_degree_descending(&a);
        let permuted = p.permute_csr_rows(&a).unwrap();
        let me = MeBcrs::from_csr(&permuted, MeBcrs::BLOCK_WIDTH_F16).unwrap();
        let map = compose_edge_map(&a, &permuted, p.new_of_old(), &me.edge_to_slot().unwrap());
        assert_eq!(map.len(), a.nnz());
        // Slot (vector v, row r) of edge (i, j): window row r of new row new_of_old[i], and
        // vector v holds column j.
        let cols = me.column_indices();
        for i in 0..a.n_rows() {
            let new = p.new_of_old()[i] as usize;
            let edges = a.row_offsets()[i] as usize..a.row_offsets()[i + 1] as usize;
            for (e, &slot) in edges.clone().zip(&map[edges]) {
                let slot = slot as usize;
                let (v, r) = (slot / MeBcrs::WINDOW_ROWS, slot % MeBcrs::WINDOW_ROWS);
                assert_eq!(r, new % MeBcrs::WINDOW_ROWS, "edge {e}");
                assert_eq!(cols[v], a.col_indices()[e], "edge {e}");
                let w = new / MeBcrs::WINDOW_ROWS;
                let ptr = me.row_pointers();
                assert!(
                    (ptr[w] as usize..ptr[w + 1] as usize).contains(&v),
                    "edge {e}"
                );
            }
        }
    }

    #[test]
    fn sddmm_chunk_is_one_or_two_k_steps_and_grows_with_the_mask() {
        let mut last = 0;
        for n in [
            0,
            1,
            1_000,
            50_000,
            135_168,
            300_000,
            10_000_000,
            usize::MAX,
        ] {
            for sms in [0, 1, 132, 1000, u32::MAX] {
                let c = sddmm_chunk(n, sms);
                assert!(
                    c == MIN_SDDMM_CHUNK || c == MAX_SDDMM_CHUNK,
                    "{n} vectors, {sms} SMs"
                );
            }
            let c = sddmm_chunk(n, 132);
            assert!(c >= last, "chunk shrank at {n} vectors");
            last = c;
        }
        // 64 vectors per resident warp (132 SMs x 16 warps) is where it doubles.
        assert_eq!(sddmm_chunk(132 * 16 * 64 - 1, 132), MIN_SDDMM_CHUNK);
        assert_eq!(sddmm_chunk(132 * 16 * 64, 132), MAX_SDDMM_CHUNK);
    }

    #[test]
    fn no_windows_no_items() {
        let it = WorkItems::new(&[0], 256);
        assert!(it.windows.is_empty());
        assert_eq!(it.n_partials(), 0);
        assert!(long_windows(&[0], 1).is_empty());
    }
}
