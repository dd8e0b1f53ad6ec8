//! Tests of the permutations: the parallel locality order against the sequential search, and
//! the bipartite row order.

use proptest::prelude::*;

use super::locality::locality_order_with;
use super::*;
use crate::{rmat, RmatConfig};

/// Both expansions of the locality order on `a`, the parallel one on 4 threads for every
/// frontier.
fn both(a: &Csr, hub_factor: Option<f64>) -> (Permutation, Permutation) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .expect("a 4-thread pool");
    let par = pool
        .install(|| locality_order_with(a, hub_factor, 0))
        .expect("the parallel order");
    let seq = locality_order_with(a, hub_factor, usize::MAX).expect("the sequential order");
    (par, seq)
}

proptest! {
    #[test]
    fn the_parallel_expansion_is_the_sequential_search(
        n in 1usize..200,
        edges in proptest::collection::vec((0u32..200, 0u32..200), 0..1200),
        symmetric in any::<bool>(),
        hub_factor in proptest::option::of(0.5f64..8.0),
    ) {
        let edges: Vec<(u32, u32)> = edges
            .into_iter()
            .filter(|&(r, c)| (r as usize) < n && (c as usize) < n)
            .collect();
        let mut a = Csr::from_edges(n, n, &edges).expect("a valid graph");
        if symmetric {
            a = a.symmetrize().expect("symmetrized");
        }
        let (par, seq) = both(&a, hub_factor);
        prop_assert_eq!(par, seq);
    }
}

proptest! {
    #[test]
    fn the_bipartite_order_is_a_permutation_of_the_rows(
        rows in 0usize..120,
        cols in 0usize..120,
        edges in proptest::collection::vec((0u32..120, 0u32..120), 0..600),
        hub_factor in 0.5f64..8.0,
    ) {
        // Any shape, empty rows and columns, hubs on either side.
        let edges: Vec<(u32, u32)> = edges
            .into_iter()
            .filter(|&(r, c)| (r as usize) < rows && (c as usize) < cols)
            .collect();
        let a = Csr::from_edges(rows, cols, &edges).expect("a valid graph");
        let p = Permutation::rows_by_bipartite_locality(&a, hub_factor)
            .expect("an order");
        prop_assert_eq!(p.len(), rows);
        let mut seen = p.old_of_new().to_vec();
        seen.sort_unstable();
        prop_assert!(seen.iter().copied().eq(0..rows as u32));
    }
}

#[test]
fn the_bipartite_order_rejects_a_bad_hub_factor() {
    let a = Csr::from_edges(2, 3, &[(0, 2), (1, 2)]).expect("a valid graph");
    for bad in [0.0, -1.0, f64::NAN] {
        let err = Permutation::rows_by_bipartite_locality(&a, bad).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidParameter {
                    what: "hub_factor",
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn the_parallel_expansion_is_the_sequential_search_on_r_mat() {
    // Frontiers of thousands of nodes: several chunks per level, on symmetric and directed
    // graphs, with and without hubs peeled.
    for symmetrize in [true, false] {
        let a = rmat(&RmatConfig::new(13).with_symmetrize(symmetrize).with_seed(7))
            .expect("an R-MAT graph");
        for hub_factor in [None, Some(32.0)] {
            let (par, seq) = both(&a, hub_factor);
            assert_eq!(par, seq, "symmetrize {symmetrize}, hubs {hub_factor:?}");
        }
    }
}
