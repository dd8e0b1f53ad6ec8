//! The hybrid attention extras' edge map checked against the caller's CSR (CPU).

use super::*;
use spattn_formats::{Reorder, RowOrder};

/// Every bit of every block and every CUDA-core edge names the caller edge of its (caller
/// row, column); together the bits name each caller edge once.
#[test]
fn hybrid_edge_map_names_each_edge_s_caller_edge() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    let n = 200usize;
    let mut edges = Vec::new();
    for r in 0..n as u32 {
        for _ in 0..next(12) {
            edges.push((r, next(n as u64) as u32));
        }
    }
    edges.extend((0..n as u32).map(|c| (7, c)));
    let a = Csr::from_edges(n, n, &edges).unwrap();
    let order = RowOrder::choose(&a, Reorder::Degree, WINDOW_ROWS).unwrap();
    let blocks = HybridBlocks::from_csr_in_row_order(&a, &order).unwrap();
    for threshold in [0.0, 0.3, 2.0] {
        let split = blocks.classify(threshold).unwrap();
        let words = blocks.bitmap_words_u32();
        let (starts, ids, cd_ids) = hybrid_edge_map(
            &a,
            blocks.window_offsets(),
            blocks.row_ids(),
            blocks.block_columns(),
            &words,
            split.cd_row_offsets(),
            split.cd_columns(),
        )
        .unwrap();
        let edge = |e: u32| {
            let e = e as usize;
            let row = a.row_offsets().partition_point(|&o| o as usize <= e) - 1;
            (row as u32, a.col_indices()[e])
        };
        // One start a block, then the edge count (the tile loop's last span ends there).
        assert_eq!(starts.len(), blocks.block_columns().len() / 8 + 1);
        assert_eq!(*starts.last().unwrap() as usize, a.nnz());
        let mut seen = vec![false; a.nnz()];
        for w in 0..blocks.n_windows() {
            for b in blocks.window_blocks(w) {
                let bits = (0..128).filter(|&i| blocks.bitmaps()[b] >> i & 1 == 1);
                for (k, bit) in (starts[b] as usize..).zip(bits) {
                    let row = blocks.row_ids()[w * 16 + bit / 8];
                    assert_eq!(edge(ids[k]), (row, blocks.block_columns()[8 * b + bit % 8]));
                    assert!(!seen[ids[k] as usize]);
                    seen[ids[k] as usize] = true;
                }
            }
        }
        assert!(seen.iter().all(|&x| x));
        let o = split.cd_row_offsets();
        for (r, w) in o.windows(2).enumerate() {
            let range = w[0] as usize..w[1] as usize;
            let columns = &split.cd_columns()[range.clone()];
            for (&e, &c) in cd_ids[range].iter().zip(columns) {
                assert_eq!(edge(e), (blocks.row_ids()[r], c));
            }
        }
    }
    // Another graph: refused with what differs.
    let b = Csr::from_edges(n, n, &[(0, 1)]).unwrap();
    let split = blocks.classify(0.3).unwrap();
    let e = hybrid_edge_map(
        &b,
        blocks.window_offsets(),
        blocks.row_ids(),
        blocks.block_columns(),
        &blocks.bitmap_words_u32(),
        split.cd_row_offsets(),
        split.cd_columns(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("has no edge"), "{e}");
}
