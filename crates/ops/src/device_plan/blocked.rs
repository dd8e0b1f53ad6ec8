//! The blocked formats on the device, from a CSR there in its own row order: fused-tc's BSB
//! (16-row windows of 16×8 bitmap blocks) with its extras edge map, and the tensor-core ops'
//! ME-BCRS (8-row windows of 8×1 vectors). Both rank each entry among its window's entries by
//! (column, row) and number the distinct (window, column) runs; one read back each (the window
//! offsets, the window pointers) sizes what the host schedules.

use cudarc::driver::PushKernelArg;
use spattn_formats::{Bsb, FillStats, MeBcrs};

use super::sort::{scan, Lanes, ScanScratch};
use super::{kernel, PlanWorkspace};
use crate::buffer::{grown, DeviceVec};
use crate::device_bsb::{BsbLayout, DeviceBsb, OrderedBsb};
use crate::device_csr::DeviceCsr;
use crate::device_mebcrs::DeviceMeBcrs;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{check_same_gpu, launch, stride_grid, to_u32, PushOptionalArg};

/// The workspace's window-ordered keys of a CSR's entries, the exclusive scan of their
/// first-of-(window, column) flags, and (where asked) each place's entry.
struct WindowKeys<'w> {
    wkeys: &'w DeviceVec<u64>,
    dex: &'w DeviceVec<u32>,
    places: Option<&'w DeviceVec<u32>>,
}

/// The workspace buffers [`window_keys`] fills: window keys, distinct numbers, places.
type KeyBuffers<'w> = (
    &'w mut Option<DeviceVec<u64>>,
    &'w mut Option<DeviceVec<u32>>,
    Option<&'w mut Option<DeviceVec<u32>>>,
);

/// Ranks `a`'s entries in windows of `2^win_bits` rows by (column, row): `wkeys[p]` =
/// `w << (32 + win_bits) | c << win_bits | r mod 2^win_bits` in window order, `dex` (`nnz + 1` entries) each place's distinct
/// (window, column) number with the total last, and where a buffer is given each place's entry.
fn window_keys<'w>(
    gpu: &Gpu,
    a: &DeviceCsr,
    win_bits: u32,
    (wkeys, flags, places): KeyBuffers<'w>,
    sums: &mut ScanScratch,
) -> Result<WindowKeys<'w>> {
    let (n_rows, nnz) = (a.n_rows(), a.nnz());
    let wkeys = grown(gpu, wkeys, "window keys", nnz)?;
    let dex = grown(gpu, flags, "distinct columns of windows", nnz + 1)?;
    let places = match places {
        Some(p) => Some(&*grown(gpu, p, "window places' edges", nnz)?),
        None => None,
    };
    let (n_rows32, nnz64) = (to_u32("rows", n_rows)?, nnz as u64);
    if nnz > 0 {
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_bsb_rank");
        let f = kernel(gpu, name)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_offsets().slice())
            .arg(a.col_indices().slice())
            .arg(a.row_indices().slice())
            .arg(&n_rows32)
            .arg(&nnz64)
            .arg(&win_bits)
            .arg(wkeys.slice())
            .arg_or_null(places);
        // SAFETY: edge e < nnz reads its row and column, the row offsets of its window's rows
        // (< n_rows + 1) and column indices inside those rows (< nnz), and writes wkeys (and
        // places, where given: nnz each) at its window's first entry plus its place among the
        // window's entries: a permutation of [0, nnz).
        unsafe { launch(name, &mut args, stride_grid(nnz)?) }?;
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_bsb_flags");
        let f = kernel(gpu, name)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(wkeys.slice())
            .arg(&nnz64)
            .arg(&win_bits)
            .arg(dex.slice());
        // SAFETY: reads wkeys [0, nnz), writes dex [0, nnz) (nnz + 1 allocated).
        unsafe { launch(name, &mut args, stride_grid(nnz)?) }?;
    }
    scan(gpu, dex, nnz, Lanes::One, sums)?;
    Ok(WindowKeys { wkeys, dex, places })
}

/// The BSB of `a` (a CSR on the device, rows in its order) built on the device, and what the
/// host keeps of it for scheduling: one read back (the window offsets).
pub(crate) fn build_bsb(
    gpu: &Gpu,
    a: &DeviceCsr,
    ws: &mut PlanWorkspace,
) -> Result<(DeviceBsb, BsbLayout)> {
    let (n_rows, nnz) = (a.n_rows(), a.nnz());
    let n_windows = n_rows.div_ceil(Bsb::WINDOW_ROWS);
    // Each window's blocks: ⌈distinct / 8⌉ ≤ distinct / 8 + 1.
    let max_blocks = nnz / Bsb::BLOCK_COLS + n_windows;
    let slots = max_blocks * Bsb::BLOCK_COLS;
    to_u32("BSB block slots", slots)?;
    let mut block_columns = DeviceVec::<u32>::alloc(gpu, "BSB block columns", slots, false)?;
    block_columns.fill(Bsb::PADDING)?;
    let mut bitmap_words = DeviceVec::<u64>::alloc(gpu, "BSB bitmaps", 2 * max_blocks, true)?;
    let mut window_offsets =
        DeviceVec::<u32>::alloc(gpu, "BSB window offsets", n_windows + 1, false)?;
    let (n_rows32, n_windows32, nnz64) = (
        to_u32("rows", n_rows)?,
        to_u32("BSB windows", n_windows)?,
        nnz as u64,
    );
    ws.bind(gpu);
    let PlanWorkspace {
        flags, sums, wkeys, ..
    } = ws;
    let WindowKeys { wkeys, dex, .. } = window_keys(gpu, a, 4, (wkeys, flags, None), sums)?;
    if n_windows > 0 {
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_bsb_window_blocks");
        let f = kernel(gpu, name)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_offsets().slice())
            .arg(&n_rows32)
            .arg(&n_windows32)
            .arg(dex.slice())
            .arg(window_offsets.slice());
        // SAFETY: window w < n_windows reads two row offsets (≤ n_rows), dex at two of them
        // (≤ nnz: nnz + 1 entries) and writes window_offsets[w] (n_windows + 1 allocated).
        unsafe { launch(name, &mut args, stride_grid(n_windows)?) }?;
    }
    scan(gpu, &mut window_offsets, n_windows, Lanes::One, sums)?;
    if nnz > 0 {
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_bsb_fill");
        let f = kernel(gpu, name)?;
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
        unsafe { launch(name, &mut args, stride_grid(nnz)?) }?;
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
        (a.n_rows(), a.n_cols()),
        fill,
        window_offsets,
        block_columns,
        bitmap_words,
        order,
    );
    Ok((bsb, layout))
}

/// A shared graph's BSB as fused-tc plans read it, built on the device.
pub(crate) fn ordered_bsb(gpu: &Gpu, a: &DeviceCsr, ws: &mut PlanWorkspace) -> Result<OrderedBsb> {
    let t = std::time::Instant::now();
    let (device, layout) = build_bsb(gpu, a, ws)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(OrderedBsb::built_on_device(device, layout, ms))
}

/// fused-tc's extras edge map of `bsb`, built from `a` (the CSR it was built from, in the
/// same row order: A for A's BSB, Aᵀ for Aᵀ's) with each entry named `ids_of[e]` (Aᵀ's
/// entries' edges of A), or `e` where `None`: per block the index of its first edge in
/// block-and-bit order (bits row-major), then the edge count (`n_blocks + 1` entries), and per
/// edge in that order its name (`nnz`) — what the host builds from a downloaded BSB and CSR
/// (`OrderedBsb::edge_map`), without either leaving the device.
///
/// Errors: [`Error::InvalidArgument`] where `a`'s rows or `ids_of`'s length do not match;
/// allocation and launch failures.
pub(crate) fn bsb_edge_map(
    gpu: &Gpu,
    bsb: &DeviceBsb,
    a: &DeviceCsr,
    ids_of: Option<&DeviceVec<u32>>,
    ws: &mut PlanWorkspace,
) -> Result<(DeviceVec<u32>, DeviceVec<u32>)> {
    let (n_blocks, nnz) = (bsb.n_blocks(), a.nnz());
    if a.n_rows() != bsb.n_rows() || ids_of.is_some_and(|m| m.len() != nnz) {
        return Err(Error::InvalidArgument {
            what: "graph of the BSB",
            why: format!(
                "the BSB has {} rows, the CSR {} rows and {nnz} entries, the edge names {}",
                bsb.n_rows(),
                a.n_rows(),
                ids_of.map_or(nnz, DeviceVec::len)
            ),
        });
    }
    check_same_gpu(gpu, "graph of the BSB", a)?;
    check_same_gpu(gpu, "BSB", bsb)?;
    let mut starts = DeviceVec::<u32>::alloc(gpu, "BSB block edge starts", n_blocks + 1, false)?;
    if n_blocks > 0 {
        let blocks32 = to_u32("BSB blocks", n_blocks)?;
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_bsb_block_edges");
        let f = kernel(gpu, name)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(bsb.bitmap_words().slice())
            .arg(&blocks32)
            .arg(starts.slice_mut());
        // SAFETY: block b < n_blocks reads its 2 bitmap words (2 · n_blocks held) and writes
        // starts[b] (n_blocks + 1 allocated).
        unsafe { launch(name, &mut args, stride_grid(n_blocks)?) }?;
    }
    ws.bind(gpu);
    scan(gpu, &mut starts, n_blocks, Lanes::One, &mut ws.sums)?;
    // Zeroed: an entry the BSB lacks (a CSR of another graph) leaves a valid edge id.
    let mut ids = DeviceVec::<u32>::alloc(gpu, "BSB edge ids", nnz, true)?;
    if nnz > 0 {
        let nnz64 = nnz as u64;
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_bsb_edge_ids");
        let f = kernel(gpu, name)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_indices().slice())
            .arg(a.col_indices().slice())
            .arg(&nnz64)
            .arg_or_null(ids_of)
            .arg(bsb.window_offsets().slice())
            .arg(bsb.block_columns().slice())
            .arg(bsb.bitmap_words().slice())
            .arg(starts.slice())
            .arg(ids.slice_mut());
        // SAFETY: entry e < nnz reads its row (< n_rows, the BSB's too: checked above) and
        // column, ids_of[e] where given (nnz entries, checked), the window offsets w and w + 1
        // of its row's window (n_windows + 1 entries), block columns inside its window's blocks
        // (8 a block), the 2 bitmap words and the start of the block found there (n_blocks + 1
        // starts), and writes ids at an index it checks is below nnz (nnz allocated).
        unsafe { launch(name, &mut args, stride_grid(nnz)?) }?;
    }
    Ok((starts, ids))
}

/// The ME-BCRS of `a` (a CSR on the device, rows in its order) built on the device, with its
/// edge → slot map and the tensor-core ops' schedule: one read back (the window pointers, 4
/// bytes per 8 rows), from which the host cuts the work items.
///
/// Errors: [`Error::TooLarge`] where the slots (8 per vector) do not fit u32; allocation,
/// launch and copy failures.
pub(crate) fn build_mebcrs(
    gpu: &Gpu,
    a: &DeviceCsr,
    ws: &mut PlanWorkspace,
) -> Result<DeviceMeBcrs> {
    let (n_rows, nnz) = (a.n_rows(), a.nnz());
    let n_windows = n_rows.div_ceil(MeBcrs::WINDOW_ROWS);
    let (n_rows32, n_windows32, nnz64) = (
        to_u32("rows", n_rows)?,
        to_u32("ME-BCRS windows", n_windows)?,
        nnz as u64,
    );
    // At most one vector per entry.
    let mut column_indices = DeviceVec::<u32>::alloc(gpu, "ME-BCRS column indices", nnz, false)?;
    let mut row_masks = DeviceVec::<u8>::alloc(gpu, "ME-BCRS row masks", nnz, false)?;
    let edge_to_slot = DeviceVec::<u32>::alloc(gpu, "ME-BCRS edge to slot", nnz, false)?;
    let row_pointers = DeviceVec::<u32>::alloc(gpu, "ME-BCRS row pointers", n_windows + 1, false)?;
    ws.bind(gpu);
    let PlanWorkspace {
        flags,
        sums,
        wkeys,
        places,
        ..
    } = ws;
    let keys = window_keys(gpu, a, 3, (wkeys, flags, Some(places)), sums)?;
    let name = spattn_kernels_sys::kernel!(PLAN, "plan_mebcrs_pointers");
    let f = kernel(gpu, name)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_offsets().slice())
        .arg(&n_rows32)
        .arg(&n_windows32)
        .arg(keys.dex.slice())
        .arg(row_pointers.slice());
    // SAFETY: w ≤ n_windows reads the row offset of row min(8w, n_rows) (n_rows + 1 entries),
    // dex there (≤ nnz: nnz + 1 entries) and writes row_pointers[w] (n_windows + 1).
    unsafe { launch(name, &mut args, stride_grid(n_windows + 1)?) }?;
    if nnz > 0 {
        let name = spattn_kernels_sys::kernel!(PLAN, "plan_mebcrs_fill");
        let f = kernel(gpu, name)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(keys.wkeys.slice())
            .arg(&nnz64)
            .arg(keys.dex.slice())
            .arg_or_null(keys.places)
            .arg(column_indices.slice())
            .arg(row_masks.slice())
            .arg(edge_to_slot.slice());
        // SAFETY: place p < nnz reads wkeys at p - 1 ..= the end of its (window, column) run
        // (< nnz), dex[p] (nnz + 1 entries) and its edge (places: a permutation of [0, nnz),
        // always given here); writes edge_to_slot at that edge (nnz) and, for a run's first
        // place, the run's vector d < the number of runs ≤ nnz in column_indices and row_masks
        // (nnz each).
        unsafe { launch(name, &mut args, stride_grid(nnz)?) }?;
    }
    let pointers = row_pointers.to_host()?;
    let n_vectors = pointers[n_windows] as usize;
    to_u32(
        "ME-BCRS slots",
        n_vectors.saturating_mul(MeBcrs::WINDOW_ROWS),
    )?;
    column_indices.truncate(n_vectors)?;
    row_masks.truncate(n_vectors)?;
    DeviceMeBcrs::built_on_device(
        gpu,
        (n_rows, a.n_cols(), nnz),
        &pointers,
        row_pointers,
        (column_indices, row_masks, edge_to_slot),
    )
}
