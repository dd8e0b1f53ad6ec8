//! The plan's sort and scan passes: exclusive prefix sums over u32 or `uint4` in tiles, and a
//! stable LSD radix sort of u64 keys with u32 values (`plan.cu`'s scans and radix kernels).

use cudarc::driver::{CudaView, PushKernelArg};

use super::kernel;
use crate::buffer::DeviceVec;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{blocks_for, launch, LaunchConfig, PushOptionalArg};

/// Elements per tile of the plan's scans and radix passes (`PLAN_TILE` in plan.cu).
const TILE: usize = 2048;
/// Threads per block of the tiled kernels (`PLAN_THREADS`).
const THREADS: u32 = 256;
/// Bits per radix pass.
const RADIX_BITS: u32 = 8;

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
pub(super) enum Lanes {
    One,
    Four,
}

/// Tiles a single block scans in one launch (looping over them): above this, one block a tile
/// with decoupled look-back.
const ONE_BLOCK_TILES: usize = 4;

/// The scratch of [`scan`]'s one-pass launches: per tile an aggregate and an inclusive prefix
/// (4 u32 each, whatever the lanes, so that both stay 16-byte aligned) and a status word (2
/// u32), each in its own region of one buffer, and the ticket counter its blocks draw tile ids
/// from, with the tickets issued so far.
#[derive(Debug, Default)]
pub(super) struct ScanScratch {
    tiles: Option<DeviceVec<u32>>,
    tickets: Option<DeviceVec<u64>>,
    issued: u64,
}

impl ScanScratch {
    /// Its buffers, for the workspace's accounting.
    pub(super) fn buffers(&self) -> (Option<&DeviceVec<u32>>, Option<&DeviceVec<u64>>) {
        (self.tiles.as_ref(), self.tickets.as_ref())
    }
}

/// Exclusive prefix sums, in place, of the first `n` elements of `buf` (u32, or `uint4` as 4
/// u32 each), their total into element `n`: `buf` holds at least `n + 1` elements. `scratch`
/// is grown when needed.
pub(super) fn scan(
    gpu: &Gpu,
    buf: &mut DeviceVec<u32>,
    n: usize,
    lanes: Lanes,
    scratch: &mut ScanScratch,
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
    let (sums_k, pass_k) = match lanes {
        Lanes::One => (
            spattn_kernels_sys::kernel!(PLAN, "plan_scan_sums_u32"),
            spattn_kernels_sys::kernel!(PLAN, "plan_scan_pass_u32"),
        ),
        Lanes::Four => (
            spattn_kernels_sys::kernel!(PLAN, "plan_scan_sums_u32x4"),
            spattn_kernels_sys::kernel!(PLAN, "plan_scan_pass_u32x4"),
        ),
    };
    let n64 = n as u64;
    let tiles = n.div_ceil(TILE);
    let data = buf.slice();
    if tiles <= ONE_BLOCK_TILES {
        let tail = data.slice(n * width..);
        let f = kernel(gpu, sums_k)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(data).arg(&n64).arg(&tail);
        // SAFETY: one block scans elements [0, n) of `buf` in place, a tile at a time, and
        // writes the total to element n (the first of `tail`): n + 1 elements of `width` u32,
        // checked above.
        return unsafe { launch(sums_k, &mut args, one_block()) };
    }
    let words = crate::buffer::grown(gpu, &mut scratch.tiles, "scan look-back", 10 * tiles)?;
    if scratch.tickets.is_none() {
        scratch.issued = 0; // a new counter starts at 0
    }
    let tickets = match &mut scratch.tickets {
        Some(t) => &*t,
        slot => &*slot.insert(DeviceVec::alloc(gpu, "scan tickets", 1, true)?),
    };
    let first = scratch.issued;
    // Regions placed by the buffer's capacity, not this scan's tiles: a status word then only
    // ever lies over status words (never over an earlier scan's sums, which could read as one).
    let cap = words.len() / 10;
    let w = words.slice();
    let (aggregates, inclusives) = (w.slice(..4 * cap), w.slice(4 * cap..8 * cap));
    let status = w.slice(8 * cap..10 * cap);
    let f = kernel(gpu, pass_k)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(data)
        .arg(&n64)
        .arg(tickets.slice())
        .arg(&first)
        .arg(&aggregates)
        .arg(&inclusives)
        .arg(&status);
    // SAFETY: each of the `tiles` blocks takes one ticket from the counter (one u64), tile
    // t = ticket − first < tiles; it reads and writes elements [t·TILE, (t+1)·TILE) ∩ [0, n)
    // of `buf` in place, the last tile element n (n + 1 elements of `width` u32, checked
    // above), and look-back entries t and below: aggregates and inclusives of 4 u32 and status
    // words of 2 u32 per tile, each region `cap` ≥ tiles entries.
    unsafe { launch(pass_k, &mut args, tile_grid(n)?) }?;
    // Only once launched: the device's counter has then taken `tiles` tickets.
    scratch.issued = first + tiles as u64;
    Ok(())
}

/// The sort's buffers of a workspace, grown to `n` keys: (keys, values) twice.
#[allow(clippy::type_complexity)]
pub(super) fn sort_buffers<'w>(
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

/// The most passes of a sort: 64-bit keys (`RADIX_MAX_PASSES` in plan.cu).
const MAX_PASSES: usize = 64 / RADIX_BITS as usize;
/// Look-back tags are 30 bits (plan.cu's look-back word); tag 0 is never used, so words of a
/// freshly zeroed buffer read as not yet written.
const TAG_LIMIT: u32 = 1 << 30;

/// A workspace's scratch for [`radix_sort`]: each pass's digit counts and tile counter (zeroed
/// per sort), a look-back word per (tile, digit), and the tag of the last pass run on them.
pub(super) struct SortScratch<'w> {
    pub(super) counts: &'w mut Option<DeviceVec<u32>>,
    pub(super) lookback: &'w mut Option<DeviceVec<u64>>,
    pub(super) tag: &'w mut u32,
}

/// Sorts the first `n` keys of buffer 0 (with their values) by bits `lo..hi`, stably, in
/// passes of [`RADIX_BITS`]: one launch counts every pass's digits, then one launch a pass
/// (onesweep: tiles find their offsets by decoupled look-back); returns the buffer that holds
/// the result. With `unsorted` (a status word the key kernel wrote), the passes do nothing on
/// the device when it is 0, but leave the keys in the same buffer as a sort would.
pub(super) fn radix_sort(
    gpu: &Gpu,
    (keys, vals): ([&DeviceVec<u64>; 2], [&DeviceVec<u32>; 2]),
    scratch: SortScratch<'_>,
    n: usize,
    (lo, hi): (u32, u32),
    unsorted: Option<&CudaView<'_, u64>>,
) -> Result<usize> {
    let passes: Vec<u32> = (lo..hi).step_by(RADIX_BITS as usize).collect();
    if n <= 1 || passes.is_empty() {
        return Ok(0);
    }
    let np = passes.len();
    if np > MAX_PASSES {
        return Err(Error::InvalidArgument {
            what: "radix sort bits",
            why: format!("{lo}..{hi} takes {np} passes of {RADIX_BITS} bits, over {MAX_PASSES}"),
        });
    }
    let bins = 1usize << RADIX_BITS;
    let tiles = n.div_ceil(TILE);
    // Each pass's digit counts, then each pass's tile counter.
    let counts = crate::buffer::grown(gpu, scratch.counts, "radix counts", np * bins + np)?;
    counts.fill(0)?;
    let lookback = crate::buffer::grown(gpu, scratch.lookback, "radix look-back", tiles * bins)?;
    if *scratch.tag >= TAG_LIMIT - np as u32 {
        lookback.fill(0)?;
        *scratch.tag = 0;
    }
    let (n64, np32) = (n as u64, np as u32);
    let grid = tile_grid(n)?;
    let name = spattn_kernels_sys::kernel!(PLAN, "plan_radix_histogram");
    let f = kernel(gpu, name)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(keys[0].slice())
        .arg(&n64)
        .arg(&lo)
        .arg(&np32)
        .arg(counts.slice())
        .view_or_null(unsorted);
    // SAFETY: block t reads keys [t·TILE, (t+1)·TILE) ∩ [0, n) of buffer 0 (n keys at least)
    // and adds to counts[0, np·256) (np·256 + np at least); the status word is read only. The
    // top pass's shift, lo + 8(np − 1), is below hi ≤ 64.
    unsafe { launch(name, &mut args, grid) }?;
    let mut cur = 0usize;
    for (p, &shift) in passes.iter().enumerate() {
        *scratch.tag += 1;
        let tag = *scratch.tag;
        let totals = counts.slice().slice(p * bins..(p + 1) * bins);
        let next_tile = counts.slice().slice(np * bins + p..np * bins + p + 1);
        let last_odd = u32::from(p + 1 == np && np % 2 == 1);
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_radix_onesweep");
        let f = kernel(gpu, name)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(keys[cur].slice())
            .arg(vals[cur].slice())
            .arg(keys[1 - cur].slice())
            .arg(vals[1 - cur].slice())
            .arg(&n64)
            .arg(&shift)
            .arg(&totals)
            .arg(&next_tile)
            .arg(lookback.slice())
            .arg(&tag)
            .arg(&last_odd)
            .view_or_null(unsorted);
        // SAFETY: `tiles` blocks take the tile ids 0..tiles from `next_tile` (one zeroed u32);
        // tile t reads keys and values [t·TILE, (t+1)·TILE) ∩ [0, n) of the current buffers
        // and writes each to its place, a permutation of [0, n) (the 256 `totals` sum to n),
        // in the other buffers (n elements each at least); it writes look-back words
        // [t·256, (t+1)·256) and reads those of tiles below t (tiles·256 allocated).
        unsafe { launch(name, &mut args, grid) }?;
        cur = 1 - cur;
    }
    Ok(cur)
}
