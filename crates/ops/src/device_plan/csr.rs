//! The CSR of sorted keys on the device: repeats merged, row offsets, the input edges'
//! positions, the CUDA-core kernels' schedules and degree statistics, and the status block
//! the host reads back to cut the buffers to their sizes.

use cudarc::driver::{CudaView, PushKernelArg};
use spattn_formats::DegreeStats;

use super::sort::{scan, Lanes, ScanScratch};
use super::{kernel, BUCKETS, STATUS_WORDS, ST_HISTOGRAM, ST_MAX_DEGREE, ST_MIN_DEGREE_INV};
use super::{ST_BAD, ST_NNZ, ST_TOTALS};
use crate::buffer::DeviceVec;
use crate::csr_ops::{CsrSchedule, UNIT_CHUNK};
use crate::device_csr::DeviceCsr;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{launch, stride_grid, PushOptionalArg};
use crate::schedule::{group_for, SoftmaxSchedule};

/// The device buffers of a CSR built from sorted keys, before the read back of its sizes:
/// sized from upper bounds (entries ≤ keys).
pub(super) struct PendingCsr {
    pub(super) n_rows: usize,
    pub(super) n_cols: usize,
    row_offsets: DeviceVec<u32>,
    pub(super) col_indices: DeviceVec<u32>,
    pub(super) row_indices: DeviceVec<u32>,
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
pub(super) fn csr_from_sorted(
    gpu: &Gpu,
    (keys, vals): (&DeviceVec<u64>, &DeviceVec<u32>),
    (n, count): (usize, Option<&CudaView<'_, u64>>),
    ex: Option<&DeviceVec<u32>>,
    (n_rows, n_cols, col_bits): (usize, usize, u32),
    (n_input, loop_base): (usize, u64),
    (positions, map): (Option<&DeviceVec<i64>>, Option<&DeviceVec<u32>>),
    status: &CudaView<'_, u64>,
    (rows, sums): (&mut Option<DeviceVec<u32>>, &mut ScanScratch),
) -> Result<PendingCsr> {
    // The kernel reads ex[n] (the distinct keys) for the rows past the last key.
    if let Some(ex) = ex.filter(|ex| ex.len() <= n) {
        return Err(Error::InvalidArgument {
            what: "entry numbers",
            why: format!("{} u32 for {n} keys and their total", ex.len()),
        });
    }
    let mut row_offsets = DeviceVec::<u32>::alloc(gpu, "CSR row offsets", n_rows + 1, n == 0)?;
    let col_indices = DeviceVec::<u32>::alloc(gpu, "CSR column indices", n, false)?;
    let row_indices = DeviceVec::<u32>::alloc(gpu, "CSR row indices", n, false)?;
    let (n64, n_input64) = (n as u64, n_input as u64);
    let n_rows32 = crate::launch::to_u32("rows", n_rows)?;
    if n > 0 {
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_csr_build");
        let f = kernel(gpu, name)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(keys.slice())
            .arg(vals.slice())
            .arg(&n64)
            .view_or_null(count)
            .arg_or_null(ex)
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
        // SAFETY: the count word (given) is read once; thread t ≤ n_rows binary-searches keys
        // [0, n) and reads ex at the result (≤ n; ex holds n + 1, checked above) to write
        // row_offsets[t] (n_rows + 1 allocated); thread i < n
        // (or < *count ≤ n) reads keys[i], keys[i-1], vals[i] (n each) and ex[i]; entry
        // numbers are < the distinct keys ≤ n, so it writes col/row indices below n,
        // positions[v] / map[v] for v < n_input (both hold n_input, checked by the callers),
        // positions[n_input + v - loop_base] for the loops' keys v ≥ loop_base (given only
        // where positions also hold one per loop) and one status word.
        unsafe { launch(name, &mut args, stride_grid(n.max(n_rows + 1))?) }?;
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
    (rows, sums): (&mut Option<DeviceVec<u32>>, &mut ScanScratch),
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
    let name = spattn_kernels_sys::kernel!(PLAN, "plan_row_counts");
    let f = kernel(gpu, name)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(row_offsets.slice())
        .arg(&n_rows32)
        .arg(counts.slice())
        .arg(status);
    // SAFETY: thread r < n_rows reads row_offsets[r], [r + 1] (n_rows + 1) and writes the 4
    // words of counts[r] (4 (n_rows + 1) u32) and status words.
    unsafe { launch(name, &mut args, stride_grid(n_rows)?) }?;
    scan(gpu, counts, n_rows, Lanes::Four, sums)?;
    let name = spattn_kernels_sys::kernel!(PLAN, "plan_row_units");
    let f = kernel(gpu, name)?;
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
    unsafe { launch(name, &mut args, stride_grid(n_rows)?) }?;
    Ok(s)
}

/// One status block, read back.
#[derive(Clone, Copy, Debug)]
pub(super) struct Status(pub(super) [u64; STATUS_WORDS]);

impl Status {
    pub(super) fn nnz(&self) -> usize {
        self.0[ST_NNZ] as usize
    }

    /// The first input edge whose id was out of range, if any.
    pub(super) fn first_bad(&self) -> Option<usize> {
        match self.0[ST_BAD] {
            0 => None,
            w => Some((!w) as usize),
        }
    }

    /// Degree statistics of a CSR of `n_rows` rows and `nnz` entries.
    pub(super) fn degree_stats(&self, n_rows: usize, nnz: usize) -> DegreeStats {
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
    pub(super) fn finish(self, status: &Status) -> Result<DeviceCsr> {
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

/// The status block in `words` (its first [`STATUS_WORDS`]).
pub(super) fn status_block(words: &[u64]) -> Status {
    let mut s = [0u64; STATUS_WORDS];
    s.copy_from_slice(&words[..STATUS_WORDS]);
    Status(s)
}
