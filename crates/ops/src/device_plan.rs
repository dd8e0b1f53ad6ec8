//! Plans built on the GPU: a graph's CSR (with the CUDA-core kernels' schedules), its transpose
//! and edge map, and fused-tc's BSB, made by kernels from an edge list that is already in device
//! memory (kernels: `crates/kernels-sys/cuda/plan.cu`; docs/kernels/plan.md).
//!
//! A mini-batch brings a graph never seen before at every step; copying its edges to the host,
//! building the formats there and uploading them costs more than the kernels save. Here the
//! edges never leave the device:
//!
//! 1. **keys**: each edge becomes `target << col_bits | source` over only the bits the ids need
//!    (plus the reverse edges and self loops asked for); an id out of range is recorded in a
//!    status block on the device, never used as an index;
//! 2. **sort**: a stable LSD radix sort of 8-bit digits, skipped on the device when the keys are
//!    already in order (a sampler's CSR, PyG's sorted `EdgeIndex`);
//! 3. **CSR**: repeats merged (their first-of-run flags scanned into entry numbers), row offsets
//!    written by each row's first entry, and each input edge's entry (the edge positions, for
//!    per-edge data in the input's order);
//! 4. **schedules**: per-row counts scanned into the CUDA-core kernels' work units, split rows
//!    and long rows, and the degree statistics;
//! 5. **transpose** (the backward's Aᵀ): the CSR's entries re-keyed by column, stably sorted by
//!    the column bits alone (the CSR is already ordered by row), and the edge map;
//! 6. **BSB** (fused-tc): each edge's place among its 16-row window's edges ordered by column,
//!    the distinct columns of each window, their blocks and bitmaps.
//!
//! Buffers are sized from upper bounds (entries ≤ keys, units ≤ rows + entries / 64, blocks ≤
//! entries / 8 + windows), so the host reads back once per build: the status block (entry count,
//! schedule totals, statistics, the first bad edge) for the CSR and its transpose together, the
//! window offsets for the BSB. Nothing else synchronizes.
//!
//! The entry points are [`crate::DeviceGraph::from_device_edges`] and
//! [`crate::DeviceGraph::bsb_in`] (a graph built here gets its BSB from here).

use cudarc::driver::{CudaView, PushKernelArg};
use spattn_formats::{Bsb, DegreeStats, FillStats, MAX_DIM, MAX_NNZ};
use spattn_kernels_sys::PLAN;

use crate::backward::DeviceTranspose;
use crate::buffer::{DeviceElement, DeviceVec};
use crate::csr_ops::{CsrSchedule, UNIT_CHUNK};
use crate::device_bsb::{BsbLayout, DeviceBsb};
use crate::device_csr::DeviceCsr;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{
    blocks_for, check_same_gpu, launch, stride_grid, LaunchConfig, PushOptionalArg,
};
use crate::schedule::{group_for, SoftmaxSchedule};

/// Elements per tile of the plan's scans and radix passes (`PLAN_TILE` in plan.cu).
const TILE: usize = 2048;
/// Threads per block of the tiled kernels (`PLAN_THREADS`).
const THREADS: u32 = 256;
/// Bits per radix pass.
const RADIX_BITS: u32 = 8;
/// Words of one status block (u64; `ST_*` in plan.cu).
const STATUS_WORDS: usize = 48;
const ST_BAD: usize = 0;
const ST_UNSORTED: usize = 1;
const ST_DUPLICATES: usize = 2;
const ST_MIN_DEGREE_INV: usize = 3;
const ST_MAX_DEGREE: usize = 4;
const ST_NNZ: usize = 5;
const ST_HISTOGRAM: usize = 8;
const BUCKETS: usize = 33;
const ST_TOTALS: usize = 42;
/// The kernels cut rows into units of `PLAN_UNIT_CHUNK` edges and call rows of
/// `PLAN_LONG_ROW` edges long: the host schedules' constants.
const _: () = assert!(UNIT_CHUNK == 64 && SoftmaxSchedule::DEFAULT_LONG_THRESHOLD == 256);

/// An integer type edge ids may be given in on the device: `i32`, `i64` (torch's `long`) or
/// `u32`. Sealed.
pub trait DeviceIndex: DeviceElement + sealed::Sealed {
    /// The suffix of the key kernel that reads it.
    const NAME: &'static str;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for u32 {}
}

impl DeviceIndex for i32 {
    const NAME: &'static str = "i32";
}
impl DeviceIndex for i64 {
    const NAME: &'static str = "i64";
}
impl DeviceIndex for u32 {
    const NAME: &'static str = "u32";
}

/// A column of ids in device memory: id `i` is `ids[i · stride]` (a row of a `2 × E` tensor,
/// contiguous or not).
#[derive(Clone, Copy, Debug)]
pub struct DeviceIds<'a, I: DeviceIndex> {
    ids: &'a DeviceVec<I>,
    stride: usize,
}

impl<'a, I: DeviceIndex> DeviceIds<'a, I> {
    /// Ids `ids[0], ids[stride], ids[2 · stride], …` (`stride` ≥ 1).
    pub fn strided(ids: &'a DeviceVec<I>, stride: usize) -> Result<Self> {
        if stride == 0 {
            return Err(Error::InvalidArgument {
                what: "id stride",
                why: "must be at least 1".into(),
            });
        }
        Ok(Self { ids, stride })
    }

    /// Consecutive ids.
    pub fn contiguous(ids: &'a DeviceVec<I>) -> Self {
        Self { ids, stride: 1 }
    }

    /// Checks that `len` ids fit the buffer, naming `what`.
    fn check(&self, what: &'static str, len: usize) -> Result<()> {
        let needed = match len {
            0 => 0,
            _ => (len - 1)
                .checked_mul(self.stride)
                .and_then(|x| x.checked_add(1))
                .ok_or(Error::TooLarge {
                    what,
                    value: len as u64,
                    limit: (usize::MAX / self.stride) as u64,
                })?,
        };
        if needed > self.ids.len() {
            return Err(Error::InvalidArgument {
                what,
                why: format!(
                    "{len} ids at stride {} need {needed} elements, the buffer holds {}",
                    self.stride,
                    self.ids.len()
                ),
            });
        }
        Ok(())
    }

    /// Id `i`, downloaded (the error path's report of a bad edge).
    fn read(&self, i: usize) -> Result<I> {
        let at = i * self.stride;
        let mut one = [I::zeroed()];
        let view = self.ids.slice().slice(at..at + 1);
        self.ids
            .gpu()
            .stream()
            .memcpy_dtoh(&view, &mut one)
            .map_err(|e| crate::launch::map_driver_error("reading an edge id", e))?;
        Ok(one[0])
    }
}

/// An edge list in device memory: edge `i` runs from `sources` id `i` to `targets` id `i`
/// (PyG's `edge_index[0]` and `edge_index[1]`). Row `t` of the graph built from it lists the
/// sources of the edges into `t`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceEdges<'a, I: DeviceIndex> {
    /// The sources (the graph's columns: the K/V side).
    pub sources: DeviceIds<'a, I>,
    /// The targets (the graph's rows: the Q side).
    pub targets: DeviceIds<'a, I>,
    /// Number of edges.
    pub len: usize,
}

/// What a graph built on the GPU is: its size and the edges added to the list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphSpec {
    /// Rows (targets).
    pub n_rows: usize,
    /// Columns (sources).
    pub n_cols: usize,
    /// Also add every reverse edge (square graphs only).
    pub symmetrize: bool,
    /// Also add the self loops `(i, i)` that are missing (square graphs only).
    pub self_loops: bool,
    /// Build the transpose and edge map (the backward's) now, in the same pass, rather than at
    /// the first backward (which would read back once more).
    pub transpose: bool,
}

impl GraphSpec {
    /// A `n × n` graph of the edges as given.
    pub fn square(n: usize) -> Self {
        Self {
            n_rows: n,
            n_cols: n,
            symmetrize: false,
            self_loops: false,
            transpose: false,
        }
    }
}

/// What a build on the GPU learned beside the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BuildReport {
    /// Input edges that repeated an earlier input edge (merged: a graph is a set of edges).
    pub duplicates: usize,
    /// Whether the keys were already in order, so the sort did nothing.
    pub presorted: bool,
    /// Keys sorted: the input edges, their reverses and the self loops.
    pub keys: usize,
}

/// A CSR and schedules built on the GPU, and possibly its transpose.
#[derive(Debug)]
pub(crate) struct BuiltGraph {
    pub(crate) csr: DeviceCsr,
    pub(crate) transpose: Option<DeviceTranspose>,
    pub(crate) report: BuildReport,
}

/// Bits needed for ids below `n` (0 for `n ≤ 1`).
fn id_bits(n: usize) -> u32 {
    usize::BITS - n.saturating_sub(1).leading_zeros()
}

/// The function `name` of the plan module.
fn kernel(gpu: &Gpu, name: &'static str) -> Result<cudarc::driver::CudaFunction> {
    gpu.load_function(PLAN.name, PLAN.ptx, name)
}

/// A one-block launch of `THREADS` threads.
fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `THREADS` threads per tile of `n` elements (at least one).
fn tile_grid(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (blocks_for(n, TILE as u32)?.max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Elements of a scan: one u32 or four independent u32 (`uint4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lanes {
    One,
    Four,
}

/// Tiles a single block scans in one launch (looping over them): above this, the tiles are
/// scanned in parallel, then their sums, then added (three launches).
const ONE_BLOCK_TILES: usize = 4;

/// Exclusive prefix sums, in place, of the first `n` elements of `buf` (u32, or `uint4` as 4
/// u32 each), their total into element `n`: `buf` holds at least `n + 1` elements. `sums` is
/// the tile sums' scratch (grown when needed).
fn scan(
    gpu: &Gpu,
    buf: &mut DeviceVec<u32>,
    n: usize,
    lanes: Lanes,
    sums: &mut Option<DeviceVec<u32>>,
) -> Result<()> {
    let width = match lanes {
        Lanes::One => 1,
        Lanes::Four => 4,
    };
    if buf.len() < (n + 1) * width {
        return Err(Error::InvalidArgument {
            what: "scan buffer",
            why: format!("{} u32 for {n} elements of {width}", buf.len()),
        });
    }
    let (tiles_k, sums_k, add_k) = match lanes {
        Lanes::One => (
            spattn_kernels_sys::PLAN_SCAN_TILES_U32,
            spattn_kernels_sys::PLAN_SCAN_SUMS_U32,
            spattn_kernels_sys::PLAN_SCAN_ADD_U32,
        ),
        Lanes::Four => (
            spattn_kernels_sys::PLAN_SCAN_TILES_U32X4,
            spattn_kernels_sys::PLAN_SCAN_SUMS_U32X4,
            spattn_kernels_sys::PLAN_SCAN_ADD_U32X4,
        ),
    };
    let n64 = n as u64;
    let tiles = n.div_ceil(TILE);
    let data = buf.slice();
    let tail = data.slice(n * width..);
    if tiles <= ONE_BLOCK_TILES {
        let f = kernel(gpu, sums_k)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(data).arg(&n64).arg(&tail);
        // SAFETY: one block scans elements [0, n) of `buf` in place, a tile at a time, and
        // writes the total to element n (the first of `tail`): n + 1 elements of `width` u32,
        // checked above.
        return unsafe { launch(sums_k, &mut args, one_block()) };
    }
    let sums = crate::buffer::grown(gpu, sums, "scan tile sums", tiles * width)?;
    let tiles64 = tiles as u64;
    let f = kernel(gpu, tiles_k)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(data).arg(data).arg(&n64).arg(sums.slice());
    // SAFETY: block b reads and writes elements [b·TILE, (b+1)·TILE) ∩ [0, n) of `buf` and
    // writes sums[b] (at least `tiles` elements).
    unsafe { launch(tiles_k, &mut args, tile_grid(n)?) }?;
    let f = kernel(gpu, sums_k)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(sums.slice()).arg(&tiles64).arg(&tail);
    // SAFETY: one block scans sums[0, tiles) in place and writes the total to element n of
    // `buf` (the first of `tail`).
    unsafe { launch(sums_k, &mut args, one_block()) }?;
    let f = kernel(gpu, add_k)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(data).arg(&n64).arg(sums.slice());
    // SAFETY: block b reads sums[b] (b < tiles) and updates its tile's elements below n.
    unsafe { launch(add_k, &mut args, tile_grid(n)?) }
}

/// The temporaries of builds on the GPU — the sort's keys and values (two of each, for the
/// passes' ping-pong), its digit counts, entry numbers, scan tile sums, per-row counts, the
/// BSB's window keys — kept between builds so that a training loop that builds a graph every
/// step allocates them once (grown when a larger graph comes). Pass one to
/// [`crate::DeviceGraph::from_device_edges_in`]; buffers of another GPU handle than the build's
/// are dropped first.
#[derive(Debug, Default)]
pub struct PlanWorkspace {
    keys: [Option<DeviceVec<u64>>; 2],
    vals: [Option<DeviceVec<u32>>; 2],
    counts: Option<DeviceVec<u32>>,
    flags: Option<DeviceVec<u32>>,
    sums: Option<DeviceVec<u32>>,
    rows: Option<DeviceVec<u32>>,
    wkeys: Option<DeviceVec<u64>>,
}

impl PlanWorkspace {
    /// An empty workspace (nothing allocated until a build needs it).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of device memory it holds.
    pub fn device_bytes(&self) -> usize {
        let b32 = [
            &self.vals[0],
            &self.vals[1],
            &self.counts,
            &self.flags,
            &self.sums,
            &self.rows,
        ];
        b32.iter()
            .map(|b| b.as_ref().map_or(0, DeviceVec::num_bytes))
            .sum::<usize>()
            + [&self.keys[0], &self.keys[1], &self.wkeys]
                .iter()
                .map(|b| b.as_ref().map_or(0, DeviceVec::num_bytes))
                .sum::<usize>()
    }

    /// Drops the buffers of another handle than `gpu` (their stream does not order with its).
    fn bind(&mut self, gpu: &Gpu) {
        let foreign =
            |b: &Option<DeviceVec<u32>>| b.as_ref().is_some_and(|v| !v.gpu().same_as(gpu));
        let foreign64 =
            |b: &Option<DeviceVec<u64>>| b.as_ref().is_some_and(|v| !v.gpu().same_as(gpu));
        if foreign64(&self.keys[0])
            || foreign64(&self.keys[1])
            || foreign64(&self.wkeys)
            || [
                &self.vals[0],
                &self.vals[1],
                &self.counts,
                &self.flags,
                &self.sums,
                &self.rows,
            ]
            .into_iter()
            .any(foreign)
        {
            *self = Self::default();
        }
    }
}

/// The sort's buffers of a workspace, grown to `n` keys: (keys, values) twice.
#[allow(clippy::type_complexity)]
fn sort_buffers<'w>(
    gpu: &Gpu,
    keys: &'w mut [Option<DeviceVec<u64>>; 2],
    vals: &'w mut [Option<DeviceVec<u32>>; 2],
    n: usize,
) -> Result<([&'w DeviceVec<u64>; 2], [&'w DeviceVec<u32>; 2])> {
    let [k0, k1] = keys;
    let [v0, v1] = vals;
    let k0 = crate::buffer::grown(gpu, k0, "plan keys", n)?;
    let k1 = crate::buffer::grown(gpu, k1, "plan keys", n)?;
    let v0 = crate::buffer::grown(gpu, v0, "plan key values", n)?;
    let v1 = crate::buffer::grown(gpu, v1, "plan key values", n)?;
    Ok(([&*k0, &*k1], [&*v0, &*v1]))
}

/// Sorts the first `n` keys of buffer 0 (with their values) by bits `lo..hi`, stably, in
/// passes of [`RADIX_BITS`]; returns the buffer that holds the result. With `unsorted` (a
/// status word the key kernel wrote), the passes do nothing on the device when it is 0, but
/// leave the keys in the same buffer as a sort would. `counts` and `sums` are scratch.
fn radix_sort(
    gpu: &Gpu,
    (keys, vals): ([&DeviceVec<u64>; 2], [&DeviceVec<u32>; 2]),
    (counts, sums): (&mut Option<DeviceVec<u32>>, &mut Option<DeviceVec<u32>>),
    n: usize,
    (lo, hi): (u32, u32),
    unsorted: Option<&CudaView<'_, u64>>,
) -> Result<usize> {
    let passes: Vec<u32> = (lo..hi).step_by(RADIX_BITS as usize).collect();
    if n <= 1 || passes.is_empty() {
        return Ok(0);
    }
    let tiles = n.div_ceil(TILE);
    let tiles32 = crate::launch::to_u32("radix tiles", tiles)?;
    let bins = tiles * (1 << RADIX_BITS);
    let counts = crate::buffer::grown(gpu, counts, "radix counts", bins + 1)?;
    let n64 = n as u64;
    let grid = tile_grid(n)?;
    let null = 0u64;
    let mut cur = 0usize;
    for (p, &shift) in passes.iter().enumerate() {
        let f = kernel(gpu, spattn_kernels_sys::PLAN_RADIX_COUNT)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(keys[cur].slice())
            .arg(&n64)
            .arg(&shift)
            .arg(counts.slice())
            .arg(&tiles32);
        match unsorted {
            Some(u) => args.arg(u),
            None => args.arg(&null),
        };
        // SAFETY: block t reads keys [t·TILE, (t+1)·TILE) ∩ [0, n) of the current buffer (n
        // keys at least) and writes counts[d·tiles + t] for d < 256 (bins + 1 at least); the
        // status word is read only.
        unsafe { launch(spattn_kernels_sys::PLAN_RADIX_COUNT, &mut args, grid) }?;
        scan(gpu, counts, bins, Lanes::One, sums)?;
        let last_odd = u32::from(p + 1 == passes.len() && passes.len() % 2 == 1);
        let f = kernel(gpu, spattn_kernels_sys::PLAN_RADIX_SCATTER)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(keys[cur].slice())
            .arg(vals[cur].slice())
            .arg(keys[1 - cur].slice())
            .arg(vals[1 - cur].slice())
            .arg(&n64)
            .arg(&shift)
            .arg(counts.slice())
            .arg(&tiles32)
            .arg(&last_odd);
        match unsorted {
            Some(u) => args.arg(u),
            None => args.arg(&null),
        };
        // SAFETY: block t reads keys and values [t·TILE, (t+1)·TILE) ∩ [0, n) of the current
        // buffers and writes each to its scanned position, a permutation of [0, n) (the counts
        // of all tiles sum to n), in the other buffers (n elements each at least); it reads
        // counts [d·tiles + t].
        unsafe { launch(spattn_kernels_sys::PLAN_RADIX_SCATTER, &mut args, grid) }?;
        cur = 1 - cur;
    }
    Ok(cur)
}

/// The device buffers of a CSR built from sorted keys, before the read back of its sizes:
/// sized from upper bounds (entries ≤ keys).
struct PendingCsr {
    n_rows: usize,
    n_cols: usize,
    row_offsets: DeviceVec<u32>,
    col_indices: DeviceVec<u32>,
    row_indices: DeviceVec<u32>,
    schedule: PendingSchedule,
}

/// The CSR kernels' schedules before the read back of their sizes.
struct PendingSchedule {
    unit_rows: DeviceVec<u32>,
    unit_starts: DeviceVec<u32>,
    unit_slots: DeviceVec<u32>,
    unit_parts: DeviceVec<u32>,
    split_rows: DeviceVec<u32>,
    part_first: DeviceVec<u32>,
    long_rows: DeviceVec<u32>,
}

/// Writes the CSR of the first `n` sorted keys of `keys`/`vals` (or of the first `*count`,
/// a word on the device, where given) and its schedules, with the counts going to `status` (a
/// view of [`STATUS_WORDS`]). Keys are distinct where `ex` is `None`; else repeats merge
/// through `ex`, the exclusive scan of their first-of-run flags.
#[allow(clippy::too_many_arguments)] // one step's operands
fn csr_from_sorted(
    gpu: &Gpu,
    (keys, vals): (&DeviceVec<u64>, &DeviceVec<u32>),
    (n, count): (usize, Option<&CudaView<'_, u64>>),
    ex: Option<&DeviceVec<u32>>,
    (n_rows, n_cols, col_bits): (usize, usize, u32),
    (n_input, loop_base): (usize, u64),
    (positions, map): (Option<&DeviceVec<i64>>, Option<&DeviceVec<u32>>),
    status: &CudaView<'_, u64>,
    (rows, sums): (&mut Option<DeviceVec<u32>>, &mut Option<DeviceVec<u32>>),
) -> Result<PendingCsr> {
    let mut row_offsets = DeviceVec::<u32>::alloc(gpu, "CSR row offsets", n_rows + 1, n == 0)?;
    let col_indices = DeviceVec::<u32>::alloc(gpu, "CSR column indices", n, false)?;
    let row_indices = DeviceVec::<u32>::alloc(gpu, "CSR row indices", n, false)?;
    let (n64, n_input64) = (n as u64, n_input as u64);
    let n_rows32 = crate::launch::to_u32("rows", n_rows)?;
    if n > 0 {
        let f = kernel(gpu, spattn_kernels_sys::PLAN_CSR_BUILD)?;
        let null = 0u64;
        let mut args = gpu.launch_builder(&f);
        args.arg(keys.slice()).arg(vals.slice()).arg(&n64);
        match count {
            Some(c) => args.arg(c),
            None => args.arg(&null),
        };
        args.arg_or_null(ex)
            .arg(&col_bits)
            .arg(&n_rows32)
            .arg(&n_input64)
            .arg(&loop_base)
            .arg(row_offsets.slice_mut())
            .arg(col_indices.slice())
            .arg(row_indices.slice())
            .arg_or_null(positions)
            .arg_or_null(map)
            .arg(status);
        // SAFETY: thread i < n (or < *count ≤ n) reads keys[i], keys[i-1], vals[i] (n each)
        // and ex[i] (n + 1); entry
        // numbers are < the distinct keys ≤ n, rows of valid keys < n_rows (the keys were made
        // from checked ids), so it writes col/row indices below n, row offsets at most
        // [0, n_rows] (n_rows + 1 allocated), positions[v] / map[v] for v < n_input (both
        // hold n_input, checked by the callers), positions[n_input + v - loop_base] for the
        // loops' keys v ≥ loop_base (given only where positions also hold one per loop) and
        // one status word.
        unsafe {
            launch(
                spattn_kernels_sys::PLAN_CSR_BUILD,
                &mut args,
                stride_grid(n)?,
            )
        }?;
    }
    let schedule = row_schedules(gpu, &row_offsets, (n_rows, n), status, (rows, sums))?;
    // Columns fit in key bits below the rows: n_cols only sizes the matrix.
    Ok(PendingCsr {
        n_rows,
        n_cols,
        row_offsets,
        col_indices,
        row_indices,
        schedule,
    })
}

/// The CUDA-core kernels' schedules of the CSR at `row_offsets` (`n_rows` rows, at most
/// `max_nnz` entries), their totals and the degree statistics into `status`.
fn row_schedules(
    gpu: &Gpu,
    row_offsets: &DeviceVec<u32>,
    (n_rows, max_nnz): (usize, usize),
    status: &CudaView<'_, u64>,
    (rows, sums): (&mut Option<DeviceVec<u32>>, &mut Option<DeviceVec<u32>>),
) -> Result<PendingSchedule> {
    let chunk = UNIT_CHUNK as usize;
    // Every row has ⌈degree / 64⌉ units, at least one.
    let units = n_rows + max_nnz / chunk;
    let split = n_rows.min(max_nnz / (chunk + 1));
    let long = n_rows.min(max_nnz / SoftmaxSchedule::DEFAULT_LONG_THRESHOLD as usize);
    let s = PendingSchedule {
        unit_rows: DeviceVec::alloc(gpu, "SpMM unit rows", units, false)?,
        // With no rows nothing writes the one start (the edge count, 0).
        unit_starts: DeviceVec::alloc(gpu, "SpMM unit starts", units + 1, n_rows == 0)?,
        unit_slots: DeviceVec::alloc(gpu, "SpMM unit slots", units, false)?,
        unit_parts: DeviceVec::alloc(gpu, "unit partials", units, false)?,
        split_rows: DeviceVec::alloc(gpu, "SpMM split rows", split, false)?,
        part_first: DeviceVec::alloc(gpu, "split-row partials", split + 1, n_rows == 0)?,
        long_rows: DeviceVec::alloc(gpu, "softmax long rows", long, false)?,
    };
    if n_rows == 0 {
        return Ok(s);
    }
    let counts = crate::buffer::grown(gpu, rows, "row schedule counts", 4 * (n_rows + 1))?;
    let n_rows32 = crate::launch::to_u32("rows", n_rows)?;
    let f = kernel(gpu, spattn_kernels_sys::PLAN_ROW_COUNTS)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(row_offsets.slice())
        .arg(&n_rows32)
        .arg(counts.slice())
        .arg(status);
    // SAFETY: thread r < n_rows reads row_offsets[r], [r + 1] (n_rows + 1) and writes the 4
    // words of counts[r] (4 (n_rows + 1) u32) and status words.
    unsafe {
        launch(
            spattn_kernels_sys::PLAN_ROW_COUNTS,
            &mut args,
            stride_grid(n_rows)?,
        )
    }?;
    scan(gpu, counts, n_rows, Lanes::Four, sums)?;
    let f = kernel(gpu, spattn_kernels_sys::PLAN_ROW_UNITS)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(row_offsets.slice())
        .arg(&n_rows32)
        .arg(counts.slice())
        .arg(s.unit_rows.slice())
        .arg(s.unit_starts.slice())
        .arg(s.unit_slots.slice())
        .arg(s.unit_parts.slice())
        .arg(s.split_rows.slice())
        .arg(s.part_first.slice())
        .arg(s.long_rows.slice())
        .arg(status);
    // SAFETY: row r writes its ⌈degree / 64⌉ (≥ 1) units from its scanned first unit: below
    // the total, ≤ n_rows + entries / 64 = the units allocated (+1 for the starts' end); its
    // slot and partials below the split rows (each split row has more than 64 entries: at
    // most entries / 65 of them, allocated +1) and the partials' total; long rows (≥ 256
    // entries: at most entries / 256) below theirs. Reads row_offsets (n_rows + 1) and the
    // scanned counts (n_rows + 1 uint4).
    unsafe {
        launch(
            spattn_kernels_sys::PLAN_ROW_UNITS,
            &mut args,
            stride_grid(n_rows)?,
        )
    }?;
    Ok(s)
}

/// One status block, read back.
#[derive(Clone, Copy, Debug)]
struct Status([u64; STATUS_WORDS]);

impl Status {
    fn nnz(&self) -> usize {
        self.0[ST_NNZ] as usize
    }

    /// The first input edge whose id was out of range, if any.
    fn first_bad(&self) -> Option<usize> {
        match self.0[ST_BAD] {
            0 => None,
            w => Some((!w) as usize),
        }
    }

    /// Degree statistics of a CSR of `n_rows` rows and `nnz` entries.
    fn degree_stats(&self, n_rows: usize, nnz: usize) -> DegreeStats {
        let max = self.0[ST_MAX_DEGREE] as usize;
        let top = if max == 0 {
            0
        } else {
            (usize::BITS - max.leading_zeros()) as usize
        };
        let histogram: Vec<usize> = self.0[ST_HISTOGRAM..ST_HISTOGRAM + BUCKETS]
            [..=top.min(BUCKETS - 1)]
            .iter()
            .map(|&c| c as usize)
            .collect();
        DegreeStats {
            n_rows,
            nnz,
            min: match self.0[ST_MIN_DEGREE_INV] {
                0 => 0,
                w => (!w) as usize,
            },
            max,
            mean: if n_rows == 0 {
                0.0
            } else {
                nnz as f64 / n_rows as f64
            },
            empty_rows: histogram[0],
            histogram,
        }
    }
}

impl PendingCsr {
    /// The CSR with its schedules, its buffers cut to the sizes in `status`.
    fn finish(self, status: &Status) -> Result<DeviceCsr> {
        let nnz = status.nnz();
        let t = &status.0[ST_TOTALS..ST_TOTALS + 4];
        let (units, split, parts, long) = if self.n_rows == 0 {
            (0, 0, 0, 0)
        } else {
            (t[0] as usize, t[1] as usize, t[2] as usize, t[3] as usize)
        };
        let PendingCsr {
            n_rows,
            n_cols,
            row_offsets,
            mut col_indices,
            mut row_indices,
            schedule: mut s,
        } = self;
        col_indices.truncate(nnz)?;
        row_indices.truncate(nnz)?;
        s.unit_rows.truncate(units)?;
        s.unit_starts.truncate(units + 1)?;
        s.unit_slots.truncate(units)?;
        s.unit_parts.truncate(units)?;
        s.split_rows.truncate(split)?;
        s.part_first.truncate(split + 1)?;
        s.long_rows.truncate(long)?;
        let stats = status.degree_stats(n_rows, nnz);
        let mean = stats.mean;
        let schedule = CsrSchedule::from_parts(
            [
                s.unit_rows,
                s.unit_starts,
                s.unit_slots,
                s.unit_parts,
                s.split_rows,
                s.part_first,
                s.long_rows,
            ],
            parts,
            group_for(mean.ceil() as u64, 4),
        )?;
        Ok(DeviceCsr::from_parts(
            (n_rows, n_cols, nnz),
            row_offsets,
            col_indices,
            row_indices,
            stats,
            schedule,
        ))
    }
}

/// Checks the sizes a build on the GPU takes and returns the number of keys: the edges, their
/// reverses and the self loops.
fn check_spec(spec: &GraphSpec, edges: usize) -> Result<usize> {
    for (what, n) in [("rows", spec.n_rows), ("columns", spec.n_cols)] {
        if n as u64 > MAX_DIM {
            return Err(Error::TooLarge {
                what,
                value: n as u64,
                limit: MAX_DIM,
            });
        }
    }
    for (what, asked) in [
        ("symmetrize", spec.symmetrize),
        ("self_loops", spec.self_loops),
    ] {
        if asked && spec.n_rows != spec.n_cols {
            return Err(Error::InvalidArgument {
                what,
                why: format!(
                    "needs a square graph; this one is {} x {}",
                    spec.n_rows, spec.n_cols
                ),
            });
        }
    }
    let loops = if spec.self_loops { spec.n_rows } else { 0 };
    let keys = edges
        .checked_mul(if spec.symmetrize { 2 } else { 1 })
        .and_then(|k| k.checked_add(loops))
        .filter(|&k| k as u64 <= MAX_NNZ)
        .ok_or(Error::TooLarge {
            what: "edges (with reverses and self loops)",
            value: edges as u64,
            limit: MAX_NNZ,
        })?;
    Ok(keys)
}

/// Builds the CSR of `edges` as `spec` says (and its transpose where asked) on the GPU, with
/// one read back at the end. `positions`, where given (`edges.len` elements), receives each
/// input edge's entry in the CSR.
///
/// Errors: [`Error::EdgeOutOfRange`] naming the first edge with an id out of range (negative or
/// past the graph); [`Error::InvalidArgument`] for buffers too short, of another GPU, or
/// symmetrizing a rectangular graph; [`Error::TooLarge`] past the 32-bit formats; the driver's.
pub(crate) fn build_from_edges<I: DeviceIndex>(
    gpu: &Gpu,
    edges: &DeviceEdges<'_, I>,
    spec: &GraphSpec,
    positions: Option<&mut DeviceVec<i64>>,
    ws: &mut PlanWorkspace,
) -> Result<BuiltGraph> {
    let e = edges.len;
    edges.sources.check("edge sources", e)?;
    edges.targets.check("edge targets", e)?;
    check_same_gpu(gpu, "edge sources", edges.sources.ids)?;
    check_same_gpu(gpu, "edge targets", edges.targets.ids)?;
    let m = check_spec(spec, e)?;
    let loops = if spec.self_loops { spec.n_rows } else { 0 };
    // The loops' keys follow the edges (and their reverses): positions of the loops too where
    // the buffer holds one per loop.
    let mut loop_base = u64::MAX;
    if let Some(p) = &positions {
        check_same_gpu(gpu, "edge positions", &**p)?;
        if loops > 0 && p.len() == e + loops {
            loop_base = (m - loops) as u64;
        } else {
            crate::buffer::expect_len("edge positions", e, p.len())?;
        }
    }
    let (row_bits, col_bits) = (id_bits(spec.n_rows), id_bits(spec.n_cols));
    let status = DeviceVec::<u64>::alloc(gpu, "plan status", 2 * STATUS_WORDS, true)?;
    let (st_a, st_t) = (
        status.slice().slice(..STATUS_WORDS),
        status.slice().slice(STATUS_WORDS..),
    );
    ws.bind(gpu);
    let PlanWorkspace {
        keys,
        vals,
        counts,
        flags,
        sums,
        rows,
        ..
    } = ws;
    let bufs = sort_buffers(gpu, keys, vals, m)?;
    if m > 0 {
        let name = crate::launch::kernel_named(&PLAN, format!("plan_edge_keys_{}", I::NAME))?;
        let f = kernel(gpu, name)?;
        let (e64, ss, ts) = (
            e as u64,
            edges.sources.stride as u64,
            edges.targets.stride as u64,
        );
        let (nr, nc) = (
            crate::launch::to_u32("rows", spec.n_rows)?,
            crate::launch::to_u32("columns", spec.n_cols)?,
        );
        let sym = u32::from(spec.symmetrize);
        let loops = crate::launch::to_u32("self loops", m - e * (1 + sym as usize))?;
        let mut args = gpu.launch_builder(&f);
        args.arg(edges.sources.ids.slice())
            .arg(&ss)
            .arg(edges.targets.ids.slice())
            .arg(&ts)
            .arg(&e64)
            .arg(&nr)
            .arg(&nc)
            .arg(&col_bits)
            .arg(&sym)
            .arg(&loops)
            .arg(bufs.0[0].slice())
            .arg(bufs.1[0].slice())
            .arg(&st_a);
        // SAFETY: thread i < m reads sources/targets[(i mod e) · stride] and those of i - 1
        // (checked above to lie in their buffers) and writes keys/vals[i] (m each at least)
        // and status words.
        unsafe { launch(name, &mut args, stride_grid(m)?) }?;
    }
    let unsorted = st_a.slice(ST_UNSORTED..ST_UNSORTED + 1);
    let r = radix_sort(
        gpu,
        bufs,
        (&mut *counts, &mut *sums),
        m,
        (0, row_bits + col_bits),
        Some(&unsorted),
    )?;
    let flags = crate::buffer::grown(gpu, flags, "plan entry numbers", m + 1)?;
    if m > 0 {
        let f = kernel(gpu, spattn_kernels_sys::PLAN_UNIQUE_FLAGS)?;
        let (m64, e64) = (m as u64, e as u64);
        let mut args = gpu.launch_builder(&f);
        args.arg(bufs.0[r].slice())
            .arg(bufs.1[r].slice())
            .arg(&m64)
            .arg(&e64)
            .arg(flags.slice())
            .arg(&st_a);
        // SAFETY: reads keys/vals [0, m), writes flags[0, m) (m + 1 at least) and a status
        // word.
        unsafe {
            launch(
                spattn_kernels_sys::PLAN_UNIQUE_FLAGS,
                &mut args,
                stride_grid(m)?,
            )
        }?;
    }
    scan(gpu, flags, m, Lanes::One, sums)?;
    let a = csr_from_sorted(
        gpu,
        (bufs.0[r], bufs.1[r]),
        (m, None),
        Some(&*flags),
        (spec.n_rows, spec.n_cols, col_bits),
        (e, loop_base),
        (positions.as_deref(), None),
        &st_a,
        (&mut *rows, &mut *sums),
    )?;
    let pending_t = if spec.transpose {
        let count = st_a.slice(ST_NNZ..ST_NNZ + 1);
        let scratch = Scratch {
            keys,
            vals,
            counts,
            sums,
            rows,
        };
        Some(transpose_of(
            gpu,
            (&a.row_indices, &a.col_indices),
            (a.n_rows, a.n_cols),
            (m, Some(&count)),
            (row_bits, col_bits),
            &st_t,
            scratch,
        )?)
    } else {
        None
    };
    let words = status.to_host()?;
    let (sa, stt) = (
        status_block(&words[..STATUS_WORDS]),
        status_block(&words[STATUS_WORDS..]),
    );
    if let Some(bad) = sa.first_bad() {
        let (s, t) = (edges.sources.read(bad)?, edges.targets.read(bad)?);
        return Err(Error::EdgeOutOfRange {
            edge: bad,
            source_id: format!("{s:?}"),
            target_id: format!("{t:?}"),
            n_rows: spec.n_rows,
            n_cols: spec.n_cols,
        });
    }
    let report = BuildReport {
        duplicates: sa.0[ST_DUPLICATES] as usize,
        presorted: sa.0[ST_UNSORTED] == 0,
        keys: m,
    };
    let csr = a.finish(&sa)?;
    let transpose = match pending_t {
        Some((t, map)) => Some(finish_transpose(t, map, &stt, csr.nnz())?),
        None => None,
    };
    Ok(BuiltGraph {
        csr,
        transpose,
        report,
    })
}

/// The workspace buffers a transpose borrows.
struct Scratch<'w> {
    keys: &'w mut [Option<DeviceVec<u64>>; 2],
    vals: &'w mut [Option<DeviceVec<u32>>; 2],
    counts: &'w mut Option<DeviceVec<u32>>,
    sums: &'w mut Option<DeviceVec<u32>>,
    rows: &'w mut Option<DeviceVec<u32>>,
}

fn status_block(words: &[u64]) -> Status {
    let mut s = [0u64; STATUS_WORDS];
    s.copy_from_slice(&words[..STATUS_WORDS]);
    Status(s)
}

/// The transpose of a CSR's entries (`row_indices`, `col_indices`: the first `n`, or the first
/// `*count` where the count is on the device) and its edge map, into `status`.
fn transpose_of(
    gpu: &Gpu,
    (row_indices, col_indices): (&DeviceVec<u32>, &DeviceVec<u32>),
    (n_rows, n_cols): (usize, usize),
    (n, count): (usize, Option<&CudaView<'_, u64>>),
    (row_bits, col_bits): (u32, u32),
    status: &CudaView<'_, u64>,
    s: Scratch<'_>,
) -> Result<(PendingCsr, DeviceVec<u32>)> {
    let bufs = sort_buffers(gpu, s.keys, s.vals, n)?;
    if n > 0 {
        let f = kernel(gpu, spattn_kernels_sys::PLAN_TRANSPOSE_KEYS)?;
        let (n64, null) = (n as u64, 0u64);
        let mut args = gpu.launch_builder(&f);
        args.arg(row_indices.slice())
            .arg(col_indices.slice())
            .arg(&n64);
        match count {
            Some(c) => args.arg(c),
            None => args.arg(&null),
        };
        args.arg(&row_bits)
            .arg(bufs.0[0].slice())
            .arg(bufs.1[0].slice());
        // SAFETY: reads row/col indices below the count (≤ n, allocated) and writes keys/vals
        // [0, n).
        unsafe {
            launch(
                spattn_kernels_sys::PLAN_TRANSPOSE_KEYS,
                &mut args,
                stride_grid(n)?,
            )
        }?;
    }
    // Entries past the count have the largest keys and come last in input order: stable passes
    // over the column bits leave them after every real entry.
    let r = radix_sort(
        gpu,
        bufs,
        (&mut *s.counts, &mut *s.sums),
        n,
        (row_bits, row_bits + col_bits),
        None,
    )?;
    let map = DeviceVec::<u32>::alloc(gpu, "transpose edge map", n, false)?;
    let t = csr_from_sorted(
        gpu,
        (bufs.0[r], bufs.1[r]),
        (n, count),
        None,
        (n_cols, n_rows, row_bits),
        (n, u64::MAX),
        (None, Some(&map)),
        status,
        (s.rows, s.sums),
    )?;
    Ok((t, map))
}

fn finish_transpose(
    t: PendingCsr,
    mut map: DeviceVec<u32>,
    status: &Status,
    nnz: usize,
) -> Result<DeviceTranspose> {
    map.truncate(nnz)?;
    Ok(DeviceTranspose::from_parts(t.finish(status)?, map))
}

/// Aᵀ and the edge map of `a`, a CSR on the device, built on the device (one read back).
pub(crate) fn build_transpose(
    gpu: &Gpu,
    a: &DeviceCsr,
    ws: &mut PlanWorkspace,
) -> Result<DeviceTranspose> {
    let bits = (id_bits(a.n_rows()), id_bits(a.n_cols()));
    let nnz = a.nnz();
    let status = DeviceVec::<u64>::alloc(gpu, "plan status", STATUS_WORDS, true)?;
    let st = status.slice().slice(..);
    ws.bind(gpu);
    let PlanWorkspace {
        keys,
        vals,
        counts,
        sums,
        rows,
        ..
    } = ws;
    let scratch = Scratch {
        keys,
        vals,
        counts,
        sums,
        rows,
    };
    let (t, map) = transpose_of(
        gpu,
        (a.row_indices(), a.col_indices()),
        (a.n_rows(), a.n_cols()),
        (nnz, None),
        bits,
        &st,
        scratch,
    )?;
    let words = status.to_host()?;
    finish_transpose(t, map, &status_block(&words), nnz)
}

/// The BSB of `a` (a CSR on the device, rows in its order) built on the device, and what the
/// host keeps of it for scheduling: one read back (the window offsets).
pub(crate) fn build_bsb(
    gpu: &Gpu,
    a: &DeviceCsr,
    ws: &mut PlanWorkspace,
) -> Result<(DeviceBsb, BsbLayout)> {
    let (n_rows, nnz) = (a.n_rows(), a.nnz());
    let rows = Bsb::WINDOW_ROWS;
    let n_windows = n_rows.div_ceil(rows);
    // Each window's blocks: ⌈distinct / 8⌉ ≤ distinct / 8 + 1.
    let max_blocks = nnz / Bsb::BLOCK_COLS + n_windows;
    let slots = max_blocks * Bsb::BLOCK_COLS;
    crate::launch::to_u32("BSB block slots", slots)?;
    let mut block_columns = DeviceVec::<u32>::alloc(gpu, "BSB block columns", slots, false)?;
    block_columns.fill(Bsb::PADDING)?;
    let mut bitmap_words = DeviceVec::<u64>::alloc(gpu, "BSB bitmaps", 2 * max_blocks, true)?;
    let mut window_offsets =
        DeviceVec::<u32>::alloc(gpu, "BSB window offsets", n_windows + 1, false)?;
    ws.bind(gpu);
    let PlanWorkspace {
        flags, sums, wkeys, ..
    } = ws;
    let wkeys = crate::buffer::grown(gpu, wkeys, "BSB window keys", nnz)?;
    let dex = crate::buffer::grown(gpu, flags, "BSB distinct columns", nnz + 1)?;
    let (n_rows32, n_windows32, nnz64) = (
        crate::launch::to_u32("rows", n_rows)?,
        crate::launch::to_u32("BSB windows", n_windows)?,
        nnz as u64,
    );
    if nnz > 0 {
        let f = kernel(gpu, spattn_kernels_sys::PLAN_BSB_RANK)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_offsets().slice())
            .arg(a.col_indices().slice())
            .arg(a.row_indices().slice())
            .arg(&n_rows32)
            .arg(&nnz64)
            .arg(wkeys.slice())
            .arg_or_null::<u32>(None);
        // SAFETY: edge e < nnz reads its row and column, the row offsets of its window's rows
        // (< n_rows + 1) and column indices inside those rows (< nnz), and writes wkeys at its
        // window's first entry plus its place among the window's entries: a permutation of
        // [0, nnz).
        unsafe {
            launch(
                spattn_kernels_sys::PLAN_BSB_RANK,
                &mut args,
                stride_grid(nnz)?,
            )
        }?;
        let f = kernel(gpu, spattn_kernels_sys::PLAN_BSB_FLAGS)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(wkeys.slice()).arg(&nnz64).arg(dex.slice());
        // SAFETY: reads wkeys [0, nnz), writes dex [0, nnz) (nnz + 1 allocated).
        unsafe {
            launch(
                spattn_kernels_sys::PLAN_BSB_FLAGS,
                &mut args,
                stride_grid(nnz)?,
            )
        }?;
    }
    scan(gpu, dex, nnz, Lanes::One, sums)?;
    if n_windows > 0 {
        let f = kernel(gpu, spattn_kernels_sys::PLAN_BSB_WINDOW_BLOCKS)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_offsets().slice())
            .arg(&n_rows32)
            .arg(&n_windows32)
            .arg(dex.slice())
            .arg(window_offsets.slice());
        // SAFETY: window w < n_windows reads two row offsets (≤ n_rows), dex at two of them
        // (≤ nnz: nnz + 1 entries) and writes window_offsets[w] (n_windows + 1 allocated).
        unsafe {
            launch(
                spattn_kernels_sys::PLAN_BSB_WINDOW_BLOCKS,
                &mut args,
                stride_grid(n_windows)?,
            )
        }?;
    }
    scan(gpu, &mut window_offsets, n_windows, Lanes::One, sums)?;
    if nnz > 0 {
        let f = kernel(gpu, spattn_kernels_sys::PLAN_BSB_FILL)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(wkeys.slice())
            .arg(&nnz64)
            .arg(dex.slice())
            .arg(a.row_offsets().slice())
            .arg(window_offsets.slice())
            .arg(block_columns.slice())
            .arg(bitmap_words.slice_mut());
        // SAFETY: entry p < nnz reads wkeys[p], [p - 1], dex[p] and dex at its window's first
        // entry (≤ nnz), its window's offset (< n_windows + 1) and writes one slot of its block
        // (block < the window's end ≤ max_blocks: 8 · max_blocks slots) and ORs one bit into
        // its block's 4 bitmap words (2 · max_blocks u64 = 4 · max_blocks u32).
        unsafe {
            launch(
                spattn_kernels_sys::PLAN_BSB_FILL,
                &mut args,
                stride_grid(nnz)?,
            )
        }?;
    }
    let offsets = window_offsets.to_host()?;
    let n_blocks = offsets[n_windows] as usize;
    block_columns.truncate(n_blocks * Bsb::BLOCK_COLS)?;
    bitmap_words.truncate(2 * n_blocks)?;
    let layout = BsbLayout::new(a.n_rows(), nnz, offsets);
    let fill = FillStats {
        windows: n_windows,
        blocks: n_blocks,
        edges: nnz,
        slots: n_blocks * Bsb::SLOTS_PER_BLOCK,
        max_blocks_per_window: layout.max_blocks_per_window(),
    };
    let order = DeviceVec::from_host_named(gpu, "BSB window order", layout.window_order())?;
    let bsb = DeviceBsb::from_parts(
        (a.n_rows(), a.n_cols(), nnz),
        fill,
        window_offsets,
        block_columns,
        bitmap_words,
        order,
    );
    Ok((bsb, layout))
}

/// The edge CSR of `a` (its rows, edge `e` at column `e`: per-edge operands of the CSR ops)
/// made on the device: the row offsets, rows and schedules copied, the columns counted. No
/// read back.
pub(crate) fn build_edge_csr(gpu: &Gpu, a: &DeviceCsr) -> Result<DeviceCsr> {
    let nnz = a.nnz();
    let cols = DeviceVec::<u32>::alloc(gpu, "edge CSR columns", nnz, false)?;
    let n64 = nnz as u64;
    let f = kernel(gpu, spattn_kernels_sys::PLAN_IOTA_U32)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(cols.slice()).arg(&n64);
    // SAFETY: writes cols[0, nnz) (nnz allocated).
    unsafe {
        launch(
            spattn_kernels_sys::PLAN_IOTA_U32,
            &mut args,
            stride_grid(nnz)?,
        )
    }?;
    Ok(DeviceCsr::from_parts(
        (a.n_rows(), nnz, nnz),
        a.row_offsets().try_clone()?,
        cols,
        a.row_indices().try_clone()?,
        a.degree_stats().clone(),
        a.schedule().try_clone()?,
    ))
}

/// Widens `n` u32 at `from` into i64 at `to` (device index arrays as torch's int64).
pub fn widen_to_i64(gpu: &Gpu, from: &DeviceVec<u32>, to: &mut DeviceVec<i64>) -> Result<()> {
    crate::buffer::expect_len("widened indices", from.len(), to.len())?;
    check_same_gpu(gpu, "indices", from)?;
    check_same_gpu(gpu, "widened indices", &*to)?;
    let n = from.len();
    let n64 = n as u64;
    let f = kernel(gpu, spattn_kernels_sys::PLAN_WIDEN_U32_I64)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(from.slice()).arg(&n64).arg(to.slice_mut());
    // SAFETY: reads from[0, n) and writes to[0, n); both hold n (checked).
    unsafe {
        launch(
            spattn_kernels_sys::PLAN_WIDEN_U32_I64,
            &mut args,
            stride_grid(n)?,
        )
    }
}

/// A shared graph's BSB as fused-tc plans read it, built on the device.
pub(crate) fn ordered_bsb(
    gpu: &Gpu,
    a: &DeviceCsr,
    ws: &mut PlanWorkspace,
) -> Result<crate::device_bsb::OrderedBsb> {
    let t = std::time::Instant::now();
    let (device, layout) = build_bsb(gpu, a, ws)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(crate::device_bsb::OrderedBsb::built_on_device(
        device, layout, ms,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_bits_cover_the_largest_id() {
        assert_eq!(id_bits(0), 0);
        assert_eq!(id_bits(1), 0);
        assert_eq!(id_bits(2), 1);
        assert_eq!(id_bits(3), 2);
        assert_eq!(id_bits(256), 8);
        assert_eq!(id_bits(257), 9);
        assert_eq!(id_bits(MAX_DIM as usize), 32);
    }

    #[test]
    fn specs_are_checked_before_any_launch() {
        let mut spec = GraphSpec::square(10);
        assert_eq!(check_spec(&spec, 7).unwrap(), 7);
        spec.symmetrize = true;
        spec.self_loops = true;
        assert_eq!(check_spec(&spec, 7).unwrap(), 24);
        spec.n_cols = 11;
        let e = check_spec(&spec, 7).unwrap_err();
        assert!(e.to_string().contains("10 x 11"), "{e}");
        spec.symmetrize = false;
        let e = check_spec(&spec, 7).unwrap_err();
        assert!(e.to_string().contains("self_loops"), "{e}");
        spec.self_loops = false;
        assert_eq!(check_spec(&spec, 7).unwrap(), 7);
        let huge = GraphSpec::square(MAX_DIM as usize + 1);
        assert!(matches!(check_spec(&huge, 1), Err(Error::TooLarge { .. })));
        let e = check_spec(&GraphSpec::square(4), u32::MAX as usize + 1).unwrap_err();
        assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    }

    #[test]
    fn status_blocks_decode_the_statistics() {
        let mut w = [0u64; STATUS_WORDS];
        w[ST_NNZ] = 6;
        w[ST_MAX_DEGREE] = 3;
        w[ST_MIN_DEGREE_INV] = !0u64;
        w[ST_HISTOGRAM] = 2;
        w[ST_HISTOGRAM + 1] = 1;
        w[ST_HISTOGRAM + 2] = 1;
        let s = Status(w);
        assert_eq!(s.first_bad(), None);
        let d = s.degree_stats(4, 6);
        assert_eq!((d.min, d.max, d.empty_rows), (0, 3, 2));
        assert_eq!(d.histogram, vec![2, 1, 1]);
        w[ST_BAD] = !5u64;
        assert_eq!(Status(w).first_bad(), Some(5));
        let none = Status([0; STATUS_WORDS]).degree_stats(0, 0);
        assert_eq!((none.min, none.max, none.histogram), (0, 0, vec![0]));
    }

    use crate::backward::DeviceTranspose;
    use rand::seq::SliceRandom;
    use rand::Rng;
    use rand_pcg::Pcg64;
    use spattn_formats::Csr;
    use spattn_test_support::{fresh_rng, hub_graph, random_graph, shared_graph};

    /// This crate's handle (test-support's `gpu()` is the other build of the crate's).
    fn gpu() -> Gpu {
        Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)")
    }

    /// An edge list of `a`'s edges (as PyG's: sources = columns, targets = rows), shuffled
    /// unless `sorted`, with some edges repeated.
    fn edge_list(rng: &mut Pcg64, a: &Csr, sorted: bool, repeats: usize) -> (Vec<u32>, Vec<u32>) {
        let mut e: Vec<(u32, u32)> = a
            .row_indices()
            .into_iter()
            .zip(a.col_indices().iter().copied())
            .collect();
        for _ in 0..repeats.min(e.len()) {
            let x = e[rng.random_range(0..e.len())];
            e.push(x);
        }
        if sorted {
            e.sort_unstable();
        } else {
            e.shuffle(rng);
        }
        (
            e.iter().map(|x| x.1).collect(),
            e.iter().map(|x| x.0).collect(),
        )
    }

    /// The host's graph of the same list and spec (GraphCore's: merge, then the transforms).
    fn host_graph(spec: &GraphSpec, src: &[u32], dst: &[u32]) -> Csr {
        let a = Csr::from_unsorted(spec.n_rows, spec.n_cols, dst, src, None).unwrap();
        let a = if spec.symmetrize {
            a.symmetrize().unwrap()
        } else {
            a
        };
        if spec.self_loops {
            a.with_self_loops().unwrap()
        } else {
            a
        }
    }

    /// Equal slices, or a panic naming `what` and the first index where they differ.
    fn same<T: PartialEq + std::fmt::Debug>(got: &[T], want: &[T], what: &str) {
        if let Some(i) = (0..got.len().min(want.len())).find(|&i| got[i] != want[i]) {
            panic!(
                "{what}: element {i} is {:?}, expected {:?}",
                got[i], want[i]
            );
        }
        assert_eq!(got.len(), want.len(), "{what}: lengths");
    }

    fn assert_same_csr(gpu: &Gpu, got: &DeviceCsr, want: &Csr, what: &str) {
        same(
            &got.row_offsets().to_host().unwrap(),
            want.row_offsets(),
            &format!("{what}: row offsets"),
        );
        same(
            &got.col_indices().to_host().unwrap(),
            want.col_indices(),
            &format!("{what}: columns"),
        );
        same(
            &got.row_indices().to_host().unwrap(),
            &want.row_indices(),
            &format!("{what}: rows"),
        );
        assert_eq!(
            *got.degree_stats(),
            want.degree_stats(),
            "{what}: degree statistics"
        );
        let up = DeviceCsr::upload(gpu, want).unwrap();
        let (g, w) = (
            got.schedule().to_host().unwrap(),
            up.schedule().to_host().unwrap(),
        );
        for (k, (g, w)) in g.iter().zip(&w).enumerate() {
            same(g, w, &format!("{what}: schedule array {k}"));
        }
    }

    /// Builds `a`'s edges on the device with ids of type I at `stride` and checks every format
    /// against the host's: CSR, schedules, statistics, positions, duplicates, transpose and
    /// edge map, BSB (bit for bit, window order included).
    fn check_build<I: DeviceIndex + TryFrom<u32>>(
        gpu: &Gpu,
        rng: &mut Pcg64,
        a: &Csr,
        spec: GraphSpec,
        (sorted, repeats, stride): (bool, usize, usize),
    ) where
        <I as TryFrom<u32>>::Error: std::fmt::Debug,
    {
        let (src, dst) = edge_list(rng, a, sorted, repeats);
        let what = format!(
            "{} x {} with {} edges ({} ids, stride {stride}, sorted {sorted}, {spec:?})",
            spec.n_rows,
            spec.n_cols,
            src.len(),
            I::NAME
        );
        let e = src.len();
        // Both columns interleaved at `stride` (a 2 x E tensor's rows, or its transpose's).
        let mut ids = vec![I::zeroed(); (e.max(1) * stride).max(2)];
        for i in 0..e {
            ids[i * stride] = I::try_from(src[i]).unwrap();
        }
        let mut tids = vec![I::zeroed(); (e.max(1) * stride).max(2)];
        for i in 0..e {
            tids[i * stride] = I::try_from(dst[i]).unwrap();
        }
        let (ds, dt) = (
            DeviceVec::from_host(gpu, &ids).unwrap(),
            DeviceVec::from_host(gpu, &tids).unwrap(),
        );
        let edges = DeviceEdges {
            sources: DeviceIds::strided(&ds, stride).unwrap(),
            targets: DeviceIds::strided(&dt, stride).unwrap(),
            len: e,
        };
        // With self loops, one position per loop after the edges' (as the Python layers ask).
        let loops = if spec.self_loops { spec.n_rows } else { 0 };
        let mut positions = DeviceVec::<i64>::zeros(gpu, e + loops).unwrap();
        positions.fill(-7).unwrap();
        let mut ws = PlanWorkspace::new();
        let built = build_from_edges(gpu, &edges, &spec, Some(&mut positions), &mut ws).unwrap();
        let want = host_graph(&spec, &src, &dst);
        assert_same_csr(gpu, &built.csr, &want, &what);
        let distinct: std::collections::HashSet<(u32, u32)> =
            src.iter().copied().zip(dst.iter().copied()).collect();
        assert_eq!(
            built.report.duplicates,
            e - distinct.len(),
            "{what}: duplicates"
        );
        if sorted && !spec.symmetrize && !spec.self_loops {
            assert!(
                built.report.presorted,
                "{what}: a sorted list skips the sort"
            );
        }
        let pos = positions.to_host().unwrap();
        let (offsets, cols) = (want.row_offsets(), want.col_indices());
        for v in 0..loops {
            let p = usize::try_from(pos[e + v]).expect("every loop has a position");
            assert!(
                cols[p] == v as u32 && (offsets[v] as usize..offsets[v + 1] as usize).contains(&p),
                "{what}: loop {v} at entry {p}"
            );
        }
        for i in 0..e {
            let p = usize::try_from(pos[i]).expect("every input edge has a position");
            assert!(
                cols[p] == src[i]
                    && (offsets[dst[i] as usize] as usize..offsets[dst[i] as usize + 1] as usize)
                        .contains(&p),
                "{what}: edge {i} ({} -> {}) at entry {p}",
                src[i],
                dst[i]
            );
        }
        let t = match built.transpose {
            Some(t) => t,
            None => build_transpose(gpu, &built.csr, &mut ws).unwrap(),
        };
        let host_t = DeviceTranspose::upload(gpu, &want).unwrap();
        assert_same_csr(
            gpu,
            t.csr(),
            &host_t.csr().to_host().unwrap(),
            &format!("{what} transposed"),
        );
        same(
            &t.map().to_host().unwrap(),
            &host_t.map().to_host().unwrap(),
            &format!("{what}: edge map"),
        );
        let ec = build_edge_csr(gpu, &built.csr).unwrap();
        let nnz = want.nnz() as u32;
        let host_ec = Csr::try_new(
            want.n_rows(),
            want.nnz(),
            want.row_offsets().to_vec(),
            (0..nnz).collect(),
            None,
        )
        .unwrap();
        assert_same_csr(gpu, &ec, &host_ec, &format!("{what} edge CSR"));
        let (bsb, layout) = build_bsb(gpu, &built.csr, &mut ws).unwrap();
        let host_bsb = Bsb::from_csr(&want).unwrap();
        let got_bsb = bsb.to_host().unwrap();
        same(
            got_bsb.window_offsets(),
            host_bsb.window_offsets(),
            &format!("{what}: BSB window offsets"),
        );
        same(
            got_bsb.block_columns(),
            host_bsb.block_columns(),
            &format!("{what}: BSB block columns"),
        );
        same(
            got_bsb.bitmaps(),
            host_bsb.bitmaps(),
            &format!("{what}: BSB bitmaps"),
        );
        assert!(got_bsb == host_bsb, "{what}: BSB");
        assert_eq!(*bsb.fill_stats(), host_bsb.fill_stats(), "{what}: BSB fill");
        assert!(layout == BsbLayout::of(&host_bsb), "{what}: BSB layout");
        same(
            &bsb.window_order_host().unwrap(),
            host_bsb.window_order(),
            &format!("{what}: window order"),
        );
    }

    /// Random graphs (with empty rows and repeated edges), a 10^5-edge hub row, n of 1, 7, 17,
    /// 33, no edges, a rectangular graph, each with every transform and id type, shuffled and
    /// sorted.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_device_plan_equals_the_host_plan() {
        let gpu = gpu();
        let mut rng = fresh_rng("gpu_device_plan_equals_the_host_plan");
        let mut graphs = vec![
            random_graph(&mut rng, 300, 6, 7),
            random_graph(&mut rng, 5000, 20, 11),
            hub_graph(&mut rng, 100_000, 4321),
            Csr::from_edges(5, 5, &[]).unwrap(),
        ];
        for n in [1, 7, 17, 33] {
            graphs.push(random_graph(&mut rng, n, 3, 4));
        }
        for a in &graphs {
            let n = a.n_rows();
            for (sym, loops) in [(false, false), (true, false), (false, true), (true, true)] {
                let spec = GraphSpec {
                    symmetrize: sym,
                    self_loops: loops,
                    transpose: sym,
                    ..GraphSpec::square(n)
                };
                check_build::<i64>(&gpu, &mut rng, a, spec, (false, a.nnz() / 10, 1));
                check_build::<i32>(&gpu, &mut rng, a, spec, (true, 0, 2));
            }
            check_build::<u32>(&gpu, &mut rng, a, GraphSpec::square(n), (true, 3, 1));
        }
        // Rectangular: 40 targets of 1000 sources.
        let mut edges = Vec::new();
        for r in 0..40u32 {
            for _ in 0..rng.random_range(0..60) {
                edges.push((r, rng.random_range(0..1000u32)));
            }
        }
        let rect = Csr::from_edges(40, 1000, &edges).unwrap();
        let spec = GraphSpec {
            n_rows: 40,
            n_cols: 1000,
            transpose: true,
            ..GraphSpec::square(0)
        };
        check_build::<i64>(&gpu, &mut rng, &rect, spec, (false, 5, 1));
    }

    /// Every shared graph, symmetrized with self loops from its edge list (the convention of
    /// the benchmarks), against the host's.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_device_plan_equals_the_host_plan_on_the_shared_graphs() {
        let gpu = gpu();
        let mut rng = fresh_rng("gpu_device_plan_equals_the_host_plan_on_the_shared_graphs");
        for name in spattn_test_support::test_graphs(&["cora", "pubmed", "ogbn-arxiv"]) {
            let a = shared_graph(name);
            let spec = GraphSpec {
                symmetrize: true,
                self_loops: true,
                transpose: true,
                ..GraphSpec::square(a.n_rows())
            };
            check_build::<i64>(&gpu, &mut rng, &a, spec, (false, 0, 1));
        }
    }

    /// Ids out of range (negative, or past the graph) are reported naming the first such
    /// edge, whatever the others; nothing is indexed with them.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_device_plan_reports_the_first_bad_edge() {
        let gpu = gpu();
        for (src, dst, first) in [
            (vec![0i64, 1, -3, 2, 9], vec![1i64, 2, 0, 10, 0], 2usize),
            (vec![0, 1, 2], vec![1, 4, 0], 1),
            (vec![5, 0], vec![0, 0], 0),
        ] {
            let (ds, dt) = (
                DeviceVec::from_host(&gpu, &src).unwrap(),
                DeviceVec::from_host(&gpu, &dst).unwrap(),
            );
            let edges = DeviceEdges {
                sources: DeviceIds::contiguous(&ds),
                targets: DeviceIds::contiguous(&dt),
                len: src.len(),
            };
            for spec in [
                GraphSpec::square(4),
                GraphSpec {
                    symmetrize: true,
                    self_loops: true,
                    transpose: true,
                    ..GraphSpec::square(4)
                },
            ] {
                let e = build_from_edges(&gpu, &edges, &spec, None, &mut PlanWorkspace::new())
                    .unwrap_err();
                match &e {
                    Error::EdgeOutOfRange {
                        edge,
                        source_id,
                        target_id,
                        ..
                    } => {
                        assert_eq!(*edge, first, "{e}");
                        assert_eq!(source_id, &src[first].to_string());
                        assert_eq!(target_id, &dst[first].to_string());
                    }
                    other => panic!("expected EdgeOutOfRange, got {other}"),
                }
            }
        }
        // Ids past their buffers at the stride given are refused before any launch.
        let d = DeviceVec::from_host(&gpu, &[0i32, 1, 2]).unwrap();
        let edges = DeviceEdges {
            sources: DeviceIds::strided(&d, 2).unwrap(),
            targets: DeviceIds::contiguous(&d),
            len: 3,
        };
        let e = build_from_edges(
            &gpu,
            &edges,
            &GraphSpec::square(3),
            None,
            &mut PlanWorkspace::new(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("stride 2"), "{e}");
    }

    /// Host costs of the plan's pieces on this machine (printed, not asserted: speed lives in
    /// benchmarks): one launch, one allocation and free, and whole builds of mini-batch sizes.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_device_plan_costs() {
        let gpu = gpu();
        let reps = 2000;
        let mut one = DeviceVec::<u32>::zeros(&gpu, 1).unwrap();
        let f = kernel(&gpu, spattn_kernels_sys::PLAN_IOTA_U32).unwrap();
        let n1 = 1u64;
        gpu.synchronize().unwrap();
        let t = std::time::Instant::now();
        for _ in 0..reps {
            let mut args = gpu.launch_builder(&f);
            args.arg(one.slice_mut()).arg(&n1);
            // SAFETY: writes one[0] (1 element).
            unsafe {
                launch(
                    spattn_kernels_sys::PLAN_IOTA_U32,
                    &mut args,
                    stride_grid(1).unwrap(),
                )
            }
            .unwrap();
        }
        let enq = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
        gpu.synchronize().unwrap();
        let all = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
        eprintln!("launch: {enq:.2} us to enqueue, {all:.2} us each with the GPU");
        let t = std::time::Instant::now();
        for _ in 0..reps {
            drop(DeviceVec::<u32>::alloc(&gpu, "probe", 4096, false).unwrap());
        }
        gpu.synchronize().unwrap();
        eprintln!(
            "alloc + free: {:.2} us",
            t.elapsed().as_secs_f64() * 1e6 / reps as f64
        );
        let t = std::time::Instant::now();
        for _ in 0..reps {
            one.to_host().unwrap();
        }
        eprintln!(
            "read back 4 bytes: {:.2} us",
            t.elapsed().as_secs_f64() * 1e6 / reps as f64
        );
        let mut rng = fresh_rng("gpu_device_plan_costs");
        let mut ws = PlanWorkspace::new();
        for (n, avg) in [(3500usize, 2usize), (34_000, 3), (34_000, 30)] {
            let a = random_graph(&mut rng, n, avg, 0);
            let (src, dst) = edge_list(&mut rng, &a, false, 0);
            let (ds, dt) = (
                DeviceVec::from_host(&gpu, &src).unwrap(),
                DeviceVec::from_host(&gpu, &dst).unwrap(),
            );
            let edges = DeviceEdges {
                sources: DeviceIds::contiguous(&ds),
                targets: DeviceIds::contiguous(&dt),
                len: src.len(),
            };
            for transpose in [false, true] {
                let spec = GraphSpec {
                    self_loops: true,
                    transpose,
                    ..GraphSpec::square(n)
                };
                let mut times = Vec::new();
                for _ in 0..30 {
                    gpu.synchronize().unwrap();
                    let t = std::time::Instant::now();
                    let b = build_from_edges(&gpu, &edges, &spec, None, &mut ws).unwrap();
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                    drop(b);
                }
                times.sort_by(f64::total_cmp);
                eprintln!(
                    "build of {} edges ({n} nodes), transpose {transpose}: median {:.3} ms",
                    src.len(),
                    times[times.len() / 2]
                );
            }
        }
    }
}
