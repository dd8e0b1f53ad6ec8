//! `Csr::row_block_compacted` against the sort-and-search construction it replaces.

use proptest::prelude::*;
use spattn_formats::{rmat, Csr, Error, RmatConfig};

/// The block and its touched columns, built the obvious way: sort, dedup, binary search.
fn by_sorting(a: &Csr, rows: std::ops::Range<usize>) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let offs = a.row_offsets();
    let (e0, e1) = (offs[rows.start] as usize, offs[rows.end] as usize);
    let cols = &a.col_indices()[e0..e1];
    let mut touched = cols.to_vec();
    touched.sort_unstable();
    touched.dedup();
    let local = cols
        .iter()
        .map(|c| touched.binary_search(c).unwrap() as u32)
        .collect();
    let offsets = offs[rows.start..=rows.end]
        .iter()
        .map(|&o| o - offs[rows.start])
        .collect();
    (touched, local, offsets)
}

fn check(a: &Csr, rows: std::ops::Range<usize>) {
    let (block, touched) = a.row_block_compacted(rows.clone()).unwrap();
    let (want_touched, want_cols, want_offsets) = by_sorting(a, rows.clone());
    assert_eq!(touched, want_touched, "rows {rows:?}");
    assert_eq!(block.col_indices(), want_cols, "rows {rows:?}");
    assert_eq!(block.row_offsets(), want_offsets, "rows {rows:?}");
    assert_eq!(
        (block.n_rows(), block.n_cols()),
        (rows.len(), touched.len())
    );
    // The block is a valid CSR matrix (sorted, distinct, in bounds).
    Csr::try_new(
        block.n_rows(),
        block.n_cols(),
        block.row_offsets().to_vec(),
        block.col_indices().to_vec(),
        None,
    )
    .unwrap();
}

#[test]
fn rmat_blocks_equal_the_sorted_construction() {
    // R-MAT 14 has hub columns (many threads marking one word) and > 2^14 entries per block.
    let a = rmat(&RmatConfig::benchmark(14).with_seed(5)).unwrap();
    let n = a.n_rows();
    for rows in [
        0..n,
        0..0,
        n..n,
        0..n / 3,
        n / 3..2 * n / 3,
        n - 1..n,
        17..18,
    ] {
        check(&a, rows);
    }
}

#[test]
fn values_travel_with_their_entries() {
    let a = Csr::try_new(
        3,
        130,
        vec![0, 2, 2, 5],
        vec![3, 129, 0, 64, 129],
        Some(vec![1.0, 2.0, 3.0, 4.0, 5.0]),
    )
    .unwrap();
    let (block, touched) = a.row_block_compacted(1..3).unwrap();
    assert_eq!(touched, [0, 64, 129]);
    assert_eq!(block.col_indices(), [0, 1, 2]);
    assert_eq!(block.row_offsets(), [0, 0, 3]);
    assert_eq!(block.values(), Some(&[3.0, 4.0, 5.0][..]));
}

#[test]
fn a_range_past_the_rows_is_an_error_naming_it() {
    let a = Csr::identity(4).unwrap();
    // A range past the rows, and one whose start is past its end.
    #[allow(clippy::reversed_empty_ranges)]
    let bad = [0..5, 3..2];
    for rows in bad {
        let e = a.row_block_compacted(rows.clone()).unwrap_err();
        assert!(matches!(e, Error::InvalidParameter { .. }), "{e}");
        assert!(e.to_string().contains(&format!("{rows:?}")), "{e}");
    }
}

fn csr_and_range() -> impl Strategy<Value = (Csr, std::ops::Range<usize>)> {
    (1usize..40, 1usize..200).prop_flat_map(|(n_rows, n_cols)| {
        (
            prop::collection::vec((0..n_rows as u32, 0..n_cols as u32), 0..300),
            0..=n_rows,
            0..=n_rows,
        )
            .prop_map(move |(edges, x, y)| {
                let a = Csr::from_edges(n_rows, n_cols, &edges).unwrap();
                (a, x.min(y)..x.max(y))
            })
    })
}

proptest! {
    #[test]
    fn random_blocks_equal_the_sorted_construction((a, rows) in csr_and_range()) {
        check(&a, rows);
    }
}
