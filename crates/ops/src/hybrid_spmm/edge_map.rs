//! The attention extras' edge map of a [`DeviceHybrid`](super::DeviceHybrid): which caller
//! CSR edge each tensor-core bit and each CUDA-core edge of the structure is, so that the `_x`
//! kernels read the caller's per-edge bias and dropout ([`hybrid_edge_map`], built on the host
//! by the first call with extras, and [`HybridEdgeMap`], its device copy).

use spattn_formats::Csr;

use super::WINDOW_ROWS;
use crate::buffer::DeviceVec;
use crate::device_bsb::BsbExtrasStage;
use crate::error::{Error, Result};

/// Where the caller's per-edge extras are for the `_x` kernels: per block its first edge in
/// block-and-bit order (every block, bits row-major), then the edge count (n_blocks + 1
/// entries, so that a step's span of edges is two loads), per such edge its caller CSR edge, per
/// CUDA-core edge its caller CSR edge, and the tensor-core edges' extras gathered in their
/// order by the last call.
#[derive(Debug)]
pub(super) struct HybridEdgeMap {
    pub(super) block_edge_start: DeviceVec<u32>,
    pub(super) edge_ids: DeviceVec<u32>,
    pub(super) cd_edge_ids: DeviceVec<u32>,
    /// The tensor-core warps' extras of each call in their edge order.
    pub(super) stage: BsbExtrasStage,
}

/// The edge maps of [`HybridEdgeMap`] for the structure given by its host arrays (rows
/// renumbered: `row_ids` per row its row of `graph`; blocks of window `w` are
/// `window_offsets[w]..window_offsets[w + 1]`, 8 columns and 4 bitmap words each; the CUDA-core
/// edges of row `r` are `cd_row_offsets[r]..cd_row_offsets[r + 1]` of `cd_columns`). Each
/// (row, column) is found in `graph`'s row by binary search.
pub(super) fn hybrid_edge_map(
    graph: &Csr,
    window_offsets: &[u32],
    row_ids: &[u32],
    block_columns: &[u32],
    bitmap_words: &[u32],
    cd_row_offsets: &[u32],
    cd_columns: &[u32],
) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    use rayon::prelude::*;
    let mismatch = |why: String| Error::InvalidArgument {
        what: "graph of the hybrid structure",
        why,
    };
    let n = graph.n_rows();
    if row_ids.len() != n || cd_row_offsets.len() != n + 1 {
        return Err(mismatch(format!(
            "the structure has {} rows, the graph {n}",
            row_ids.len()
        )));
    }
    let offsets = graph.row_offsets();
    // The caller edge of (renumbered row r, column c).
    let find = |r: usize, c: u32| -> Result<u32> {
        let row = *row_ids
            .get(r)
            .ok_or_else(|| mismatch(format!("row {r} is past the graph")))?
            as usize;
        if row >= n {
            return Err(mismatch(format!(
                "row id {row} is past the graph's {n} rows"
            )));
        }
        let (s, e) = (offsets[row] as usize, offsets[row + 1] as usize);
        let cols = &graph.col_indices()[s..e];
        match cols.binary_search(&c) {
            // Edge indices are below nnz ≤ MAX_NNZ < 2³².
            Ok(i) => Ok((s + i) as u32),
            Err(_) => Err(mismatch(format!("row {row} has no edge to column {c}"))),
        }
    };
    let windows = window_offsets.len().saturating_sub(1);
    let per_window: Vec<Result<(Vec<u32>, Vec<u32>)>> = (0..windows)
        .into_par_iter()
        .map(|w| {
            let mut starts = Vec::new();
            let mut ids = Vec::new();
            for b in window_offsets[w] as usize..window_offsets[w + 1] as usize {
                starts.push(ids.len() as u32);
                for word in 0..4 {
                    let bits = bitmap_words[4 * b + word];
                    for i in (0..32).filter(|i| bits >> i & 1 == 1) {
                        let bit = 32 * word + i;
                        let (r, c) = (bit / 8, bit % 8);
                        ids.push(find(w * WINDOW_ROWS + r, block_columns[8 * b + c])?);
                    }
                }
            }
            Ok((starts, ids))
        })
        .collect();
    let mut starts = Vec::with_capacity(block_columns.len() / 8 + 1);
    let mut ids = Vec::with_capacity(graph.nnz());
    for w in per_window {
        let (s, i) = w?;
        let base = ids.len() as u32;
        starts.extend(s.into_iter().map(|x| x + base));
        ids.extend(i);
    }
    // The edge count past the last block: the tile loop reads a step's span as
    // starts[blk0]..starts[min(blk0 + 2, end)] (BsbExtras::span).
    starts.push(ids.len() as u32);
    if ids.len() != graph.nnz() {
        return Err(mismatch(format!(
            "the structure's blocks hold {} edges, the graph {}",
            ids.len(),
            graph.nnz()
        )));
    }
    let cd_ids = cd_columns
        .par_iter()
        .enumerate()
        .map(|(i, &c)| {
            // The row whose range holds edge i.
            let r = cd_row_offsets.partition_point(|&o| o as usize <= i) - 1;
            find(r, c)
        })
        .collect::<Result<Vec<u32>>>()?;
    Ok((starts, ids, cd_ids))
}
