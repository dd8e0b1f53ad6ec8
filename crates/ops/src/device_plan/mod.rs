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
//!    the distinct columns of each window, their blocks and bitmaps; and where a bias or
//!    dropout comes, its extras edge map (each block's first edge, each edge's caller edge);
//! 7. **ME-BCRS** (the tensor-core ops): the same ranking in 8-row windows, the distinct columns
//!    as vectors with their row masks, and each edge's slot.
//!
//! Buffers are sized from upper bounds (entries ≤ keys, units ≤ rows + entries / 64, blocks ≤
//! entries / 8 + windows), so the host reads back once per build: the status block (entry count,
//! schedule totals, statistics, the first bad edge) for the CSR and its transpose together, the
//! window offsets for the BSB, the window pointers for the ME-BCRS. Nothing else synchronizes.
//!
//! The entry points are [`crate::graph::DeviceGraph::from_device_edges`] and the graph's BSB
//! (`DeviceGraph::bsb_in`: a graph built here gets its BSB from here). The passes
//! live in `sort` (scans, the radix sort), `csr` (the CSR of sorted keys, its schedules
//! and the status block) and `blocked` (BSB, its edge maps, ME-BCRS); this module holds the
//! API, the workspace and the builds of the CSR and its transpose.

mod blocked;
mod csr;
mod sort;
#[cfg(test)]
mod tests;

use cudarc::driver::{CudaView, PushKernelArg};
use spattn_formats::{MAX_DIM, MAX_NNZ};
use spattn_kernels_sys::PLAN;

use crate::backward::DeviceTranspose;
use crate::buffer::{DeviceElement, DeviceVec};
use crate::csr_ops::UNIT_CHUNK;
use crate::device_csr::DeviceCsr;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{check_same_gpu, launch, stride_grid, PushOptionalArg};
use crate::schedule::SoftmaxSchedule;
#[cfg(test)]
use blocked::build_bsb;
pub(crate) use blocked::{bsb_edge_map, build_mebcrs, ordered_bsb};
use csr::{csr_from_sorted, status_block, PendingCsr, Status};
use sort::{radix_sort, scan, sort_buffers, Lanes, ScanScratch, SortScratch};

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

    /// Elements that `len` ids at `stride` span (the last one's index plus one), naming
    /// `what` when that overflows: the length a buffer of them needs.
    pub fn span(what: &'static str, len: usize, stride: usize) -> Result<usize> {
        let stride = stride.max(1);
        match len {
            0 => Ok(0),
            _ => (len - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(1))
                .ok_or(Error::TooLarge {
                    what,
                    value: len as u64,
                    limit: (usize::MAX / stride) as u64,
                }),
        }
    }

    /// Checks that `len` ids fit the buffer, naming `what`.
    fn check(&self, what: &'static str, len: usize) -> Result<()> {
        let needed = Self::span(what, len, self.stride)?;
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

/// The kernel making sort keys from edge lists of `index` (a [`DeviceIndex::NAME`]); the
/// launch-name test forms it too.
pub(crate) fn edge_keys_kernel(index: &str) -> String {
    format!("plan_edge_keys_{index}")
}

/// The function `name` of the plan module.
fn kernel(gpu: &Gpu, name: &'static str) -> Result<cudarc::driver::CudaFunction> {
    gpu.load_function(PLAN.name, PLAN.ptx, name)
}

/// The temporaries of builds on the GPU — the sort's keys and values (two of each, for the
/// passes' ping-pong), its digit counts and look-back words, entry numbers, scan tile sums,
/// per-row counts, the blocked formats' window keys and (ME-BCRS) their edges — kept between
/// builds so that a training loop that builds a graph every step allocates them once (grown
/// when a larger graph comes). Pass one to
/// [`crate::DeviceGraph::from_device_edges_in`]; buffers of another GPU handle than the build's
/// are dropped first.
#[derive(Debug, Default)]
pub struct PlanWorkspace {
    keys: [Option<DeviceVec<u64>>; 2],
    vals: [Option<DeviceVec<u32>>; 2],
    counts: Option<DeviceVec<u32>>,
    lookback: Option<DeviceVec<u64>>,
    tag: u32,
    flags: Option<DeviceVec<u32>>,
    sums: ScanScratch,
    rows: Option<DeviceVec<u32>>,
    wkeys: Option<DeviceVec<u64>>,
    places: Option<DeviceVec<u32>>,
}

impl PlanWorkspace {
    /// An empty workspace (nothing allocated until a build needs it).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of device memory it holds.
    pub fn device_bytes(&self) -> usize {
        self.held().map(|(_, bytes)| bytes).sum()
    }

    /// The handle and size of each buffer held.
    fn held(&self) -> impl Iterator<Item = (&Gpu, usize)> {
        fn held<T: DeviceElement>(b: &DeviceVec<T>) -> (&Gpu, usize) {
            (b.gpu(), b.num_bytes())
        }
        let (scan32, scan64) = self.sums.buffers();
        let b64 = self.keys.iter().chain([&self.wkeys, &self.lookback]);
        let b64 = b64.flatten().chain(scan64).map(held);
        let b32 = self.vals.iter();
        let b32 = b32.chain([&self.counts, &self.flags, &self.rows, &self.places]);
        b64.chain(b32.flatten().chain(scan32).map(held))
    }

    /// Drops the buffers of another handle than `gpu` (their stream does not order with its).
    fn bind(&mut self, gpu: &Gpu) {
        if self.held().any(|(g, _)| !g.same_as(gpu)) {
            *self = Self::default();
        }
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
        lookback,
        tag,
        flags,
        sums,
        rows,
        ..
    } = ws;
    let bufs = sort_buffers(gpu, keys, vals, m)?;
    if m > 0 {
        let name = crate::launch::kernel_named(&PLAN, edge_keys_kernel(I::NAME))?;
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
    let sort = SortScratch {
        counts: &mut *counts,
        lookback: &mut *lookback,
        tag: &mut *tag,
    };
    let r = radix_sort(
        gpu,
        bufs,
        sort,
        m,
        (0, row_bits + col_bits),
        Some(&unsorted),
    )?;
    let flags = crate::buffer::grown(gpu, flags, "plan entry numbers", m + 1)?;
    if m > 0 {
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_unique_flags");
        let f = kernel(gpu, name)?;
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
        unsafe { launch(name, &mut args, stride_grid(m)?) }?;
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
            lookback,
            tag,
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
    lookback: &'w mut Option<DeviceVec<u64>>,
    tag: &'w mut u32,
    sums: &'w mut ScanScratch,
    rows: &'w mut Option<DeviceVec<u32>>,
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
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_transpose_keys");
        let f = kernel(gpu, name)?;
        let n64 = n as u64;
        let mut args = gpu.launch_builder(&f);
        args.arg(row_indices.slice())
            .arg(col_indices.slice())
            .arg(&n64)
            .view_or_null(count)
            .arg(&row_bits)
            .arg(bufs.0[0].slice())
            .arg(bufs.1[0].slice());
        // SAFETY: reads row/col indices below the count (≤ n, allocated) and writes keys/vals
        // [0, n).
        unsafe { launch(name, &mut args, stride_grid(n)?) }?;
    }
    // Entries past the count have the largest keys and come last in input order: stable passes
    // over the column bits leave them after every real entry.
    let sort = SortScratch {
        counts: s.counts,
        lookback: s.lookback,
        tag: s.tag,
    };
    let r = radix_sort(gpu, bufs, sort, n, (row_bits, row_bits + col_bits), None)?;
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
        lookback,
        tag,
        sums,
        rows,
        ..
    } = ws;
    let scratch = Scratch {
        keys,
        vals,
        counts,
        lookback,
        tag,
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

/// The edge CSR of `a` (its rows, edge `e` at column `e`: per-edge operands of the CSR ops)
/// made on the device: the row offsets, rows and schedules copied, the columns counted. No
/// read back.
pub(crate) fn build_edge_csr(gpu: &Gpu, a: &DeviceCsr) -> Result<DeviceCsr> {
    let nnz = a.nnz();
    let cols = DeviceVec::<u32>::alloc(gpu, "edge CSR columns", nnz, false)?;
    let n64 = nnz as u64;
    let name = spattn_kernels_sys::kernel!(PLAN, "plan_iota_u32");
    let f = kernel(gpu, name)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(cols.slice()).arg(&n64);
    // SAFETY: writes cols[0, nnz) (nnz allocated).
    unsafe { launch(name, &mut args, stride_grid(nnz)?) }?;
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
    let name = spattn_kernels_sys::kernel!(PLAN, "plan_widen_u32_i64");
    let f = kernel(gpu, name)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(from.slice()).arg(&n64).arg(to.slice_mut());
    // SAFETY: reads from[0, n) and writes to[0, n); both hold n (checked).
    unsafe { launch(name, &mut args, stride_grid(n)?) }
}
