//! The R-MAT generator (determinism, counts, post-processing, validation) and the degree
//! reordering permutation (proptest properties).

use proptest::prelude::*;
use spattn_formats::{rmat, rmat_edges, Csr, Error, Permutation, RmatConfig};

// ---------------------------------------------------------------------------------------------
// R-MAT
// ---------------------------------------------------------------------------------------------

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

#[test]
fn rmat_is_deterministic_from_the_seed() {
    let cfg = RmatConfig::benchmark(12).with_seed(11);
    let a = rmat(&cfg).unwrap();
    assert_eq!(rmat(&cfg).unwrap(), a);
    assert_ne!(rmat(&cfg.clone().with_seed(12)).unwrap(), a);
    // Not on the number of threads: more edges than one RNG stream draws, so several streams.
    let big = RmatConfig::new(14).with_seed(3);
    assert!(big.n_edges() > 2 * (1 << 16));
    let one = in_pool(1, || rmat_edges(&big).unwrap());
    let three = in_pool(3, || rmat_edges(&big).unwrap());
    assert_eq!(one, three);
    assert_eq!(
        in_pool(1, || rmat(&cfg).unwrap()),
        in_pool(4, || rmat(&cfg).unwrap())
    );
}

#[test]
fn rmat_edge_count_and_range() {
    let cfg = RmatConfig::new(9).with_edge_factor(5).with_seed(2);
    let (src, dst) = rmat_edges(&cfg).unwrap();
    assert_eq!(src.len(), 5 * 512);
    assert_eq!(dst.len(), 5 * 512);
    assert!(src.iter().chain(&dst).all(|&v| v < 512));
    let a = rmat(&cfg).unwrap();
    assert_eq!((a.n_rows(), a.n_cols()), (512, 512));
    assert!(a.nnz() <= src.len());
    // A power-law graph at this density has some repeated edges, but not many.
    assert!(a.nnz() > src.len() * 3 / 4, "{}", a.nnz());
}

/// Fraction of the edges in each top-level quadrant, without label permutation.
fn quadrant_fractions(cfg: &RmatConfig) -> [f64; 4] {
    let (src, dst) = rmat_edges(&cfg.clone().with_permute_labels(false)).unwrap();
    let half = 1u32 << (cfg.scale - 1);
    let mut count = [0usize; 4];
    for (&i, &j) in src.iter().zip(&dst) {
        count[2 * usize::from(i >= half) + usize::from(j >= half)] += 1;
    }
    count.map(|c| c as f64 / src.len() as f64)
}

#[test]
fn rmat_quadrant_probabilities() {
    for (a, b, c) in [(0.57, 0.19, 0.19), (0.25, 0.25, 0.25), (0.45, 0.15, 0.3)] {
        let cfg = RmatConfig::new(12).with_probabilities(a, b, c).with_seed(5);
        let m = cfg.n_edges() as f64;
        let got = quadrant_fractions(&cfg);
        for (p, q) in [a, b, c, 1.0 - a - b - c].into_iter().zip(got) {
            let sigma = (p * (1.0 - p) / m).sqrt();
            assert!((p - q).abs() < 6.0 * sigma, "expected {p}, got {q}");
        }
    }
    // Degenerate probabilities: everything in one quadrant at every level.
    let cfg = RmatConfig::new(6).with_probabilities(0.0, 0.0, 0.0);
    let (src, dst) = rmat_edges(&cfg.with_permute_labels(false)).unwrap();
    assert!(src.iter().chain(&dst).all(|&v| v == 63));
    let cfg = RmatConfig::new(6).with_probabilities(0.0, 1.0, 0.0);
    let (src, dst) = rmat_edges(&cfg.with_permute_labels(false)).unwrap();
    assert!(src.iter().all(|&v| v == 0) && dst.iter().all(|&v| v == 63));
}

#[test]
fn rmat_uniform_distinct_edge_count() {
    // With a = b = c = d, edges are uniform over the n² cells: each is drawn at least once
    // with probability 1 − (1 − 1/n²)^m.
    let cfg = RmatConfig::new(8)
        .with_probabilities(0.25, 0.25, 0.25)
        .with_edge_factor(64)
        .with_self_loops(true)
        .with_seed(9);
    let a = rmat(&cfg).unwrap();
    let (n, m) = (256f64, cfg.n_edges() as f64);
    let cells = n * n;
    let hit = 1.0 - (1.0 - 1.0 / cells).powf(m); // chance that a given cell is drawn
                                                 // Off-diagonal cells drawn, plus the whole diagonal (drawn or added as self loops).
    let expected = (cells - n) * hit + n;
    let got = a.nnz() as f64;
    assert!(
        (got - expected).abs() < 0.01 * expected,
        "expected about {expected}, got {got}"
    );
}

#[test]
fn rmat_matches_its_edge_list() {
    for (sym, loops) in [(false, false), (false, true), (true, false), (true, true)] {
        let cfg = RmatConfig::new(8)
            .with_seed(4)
            .with_symmetrize(sym)
            .with_self_loops(loops);
        let (src, dst) = rmat_edges(&cfg).unwrap();
        let mut edges: Vec<(u32, u32)> = src.iter().copied().zip(dst.iter().copied()).collect();
        if sym {
            edges.extend(
                src.iter()
                    .copied()
                    .zip(dst.iter().copied())
                    .map(|(i, j)| (j, i)),
            );
        }
        edges.retain(|&(i, j)| i != j);
        if loops {
            edges.extend((0..256).map(|i| (i, i)));
        }
        let want = Csr::from_edges(256, 256, &edges).unwrap();
        assert_eq!(
            rmat(&cfg).unwrap(),
            want,
            "symmetrize {sym}, self loops {loops}"
        );
    }
}

#[test]
fn rmat_symmetric_with_self_loops() {
    let a = rmat(&RmatConfig::benchmark(11).with_seed(8)).unwrap();
    assert_eq!(a.transpose(), a);
    for i in 0..a.n_rows() {
        assert!(a.row(i).binary_search(&(i as u32)).is_ok(), "row {i}");
    }
    assert_eq!(a.values(), None);
    // The convention of the benchmarks, A + Aᵀ + I, computed the long way.
    let directed = rmat(&RmatConfig::new(11).with_seed(8).with_self_loops(true)).unwrap();
    assert_eq!(directed.symmetrize_with_self_loops().unwrap(), a);
}

#[test]
fn rmat_without_self_loops_has_none() {
    let a = rmat(&RmatConfig::new(10).with_seed(1).with_symmetrize(true)).unwrap();
    assert_eq!(a.transpose(), a);
    for i in 0..a.n_rows() {
        assert!(a.row(i).binary_search(&(i as u32)).is_err(), "row {i}");
    }
    // R-MAT does draw self loops (they were removed above).
    let (src, dst) = rmat_edges(&RmatConfig::new(10).with_seed(1)).unwrap();
    assert!(src.iter().zip(&dst).any(|(i, j)| i == j));
}

#[test]
fn rmat_label_permutation_only_renames_nodes() {
    let cfg = RmatConfig::new(10).with_seed(6);
    let plain = rmat(&cfg.clone().with_permute_labels(false)).unwrap();
    let permuted = rmat(&cfg).unwrap();
    assert_ne!(plain, permuted);
    assert_eq!(plain.nnz(), permuted.nnz());
    let degrees = |a: &Csr| {
        let mut d: Vec<usize> = (0..a.n_rows()).map(|i| a.degree(i)).collect();
        d.sort_unstable();
        d
    };
    assert_eq!(degrees(&plain), degrees(&permuted));
    // Without permutation, the hub is node 0 (the top-left quadrant at every level).
    let s = plain.degree_stats();
    assert_eq!(plain.degree(0), s.max);
}

#[test]
fn rmat_tiny_and_empty() {
    // Scale 0: one node, every edge a self loop.
    let a = rmat(&RmatConfig::new(0)).unwrap();
    assert_eq!((a.n_rows(), a.nnz()), (1, 0));
    let a = rmat(&RmatConfig::new(0).with_self_loops(true)).unwrap();
    assert_eq!(a, Csr::identity(1).unwrap());
    let a = rmat(&RmatConfig::new(5).with_edge_factor(0)).unwrap();
    assert_eq!((a.n_rows(), a.nnz()), (32, 0));
}

#[test]
fn rmat_validation() {
    let invalid = |cfg: RmatConfig, what: &str, needle: &str| match rmat(&cfg) {
        Err(Error::InvalidParameter { what: w, why }) => {
            assert_eq!(w, what);
            assert!(why.contains(needle), "{why}");
            assert!(matches!(
                cfg.validate(),
                Err(Error::InvalidParameter { .. })
            ));
            assert!(rmat_edges(&cfg).is_err());
        }
        other => panic!("{cfg:?}: {other:?}"),
    };
    invalid(RmatConfig::new(32), "R-MAT scale", "32 exceeds 31");
    invalid(
        RmatConfig::new(4).with_probabilities(-0.1, 0.2, 0.2),
        "R-MAT probability a",
        "not in [0, 1]",
    );
    invalid(
        RmatConfig::new(4).with_probabilities(0.1, 1.5, 0.2),
        "R-MAT probability b",
        "not in [0, 1]",
    );
    invalid(
        RmatConfig::new(4).with_probabilities(0.1, 0.2, f64::NAN),
        "R-MAT probability c",
        "NaN",
    );
    invalid(
        RmatConfig::new(4).with_probabilities(0.5, 0.3, 0.3),
        "R-MAT probabilities",
        "exceeds 1",
    );
    invalid(
        RmatConfig::new(31).with_edge_factor(2),
        "R-MAT edge count",
        "exceeds the limit",
    );
    invalid(
        RmatConfig::new(20).with_edge_factor(u32::MAX),
        "R-MAT edge count",
        "exceeds the limit",
    );
    // At the edges of validity.
    assert!(RmatConfig::new(31).with_edge_factor(1).validate().is_ok());
    assert!(RmatConfig::new(4)
        .with_probabilities(0.5, 0.25, 0.25)
        .validate()
        .is_ok());
    assert!(RmatConfig::new(4)
        .with_probabilities(0.57, 0.19, 0.19)
        .validate()
        .is_ok());
}

#[test]
fn rmat_config_defaults() {
    let c = RmatConfig::new(20);
    assert_eq!((c.scale, c.edge_factor), (20, 16));
    assert_eq!((c.a, c.b, c.c), (0.57, 0.19, 0.19));
    assert!((c.d() - 0.05).abs() < 1e-12);
    assert!(c.permute_labels && !c.symmetrize && !c.self_loops);
    let b = RmatConfig::benchmark(20);
    assert!(b.symmetrize && b.self_loops && b.permute_labels);
    assert_eq!((b.n_nodes(), b.n_edges()), (1 << 20, 16 << 20));
    assert_eq!(RmatConfig::default(), RmatConfig::new(16));
}

/// The README's scale-20 benchmark graph: about 32.5M entries, hubs of ~65k. Slow in debug.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "scale 20 is slow unoptimised: cargo test --release -- --include-ignored"
)]
fn rmat_scale_20_benchmark_graph() {
    let t = std::time::Instant::now();
    let a = rmat(&RmatConfig::benchmark(20)).unwrap();
    let dt = t.elapsed();
    let s = a.degree_stats();
    println!(
        "R-MAT scale 20 (symmetrized, self loops): nnz {} max row {} in {:.2} s",
        a.nnz(),
        s.max,
        dt.as_secs_f64()
    );
    assert_eq!(a.n_rows(), 1 << 20);
    assert!((31_500_000..33_500_000).contains(&a.nnz()), "{}", a.nnz());
    assert!((40_000..100_000).contains(&s.max), "{}", s.max);
}

// ---------------------------------------------------------------------------------------------
// Permutation
// ---------------------------------------------------------------------------------------------

/// A random permutation of `0..n` as `new_of_old`.
fn perm_vec(max_n: usize) -> impl Strategy<Value = Vec<u32>> {
    (0..=max_n).prop_flat_map(|n| Just((0..n as u32).collect::<Vec<u32>>()).prop_shuffle())
}

/// A random square matrix (with values or not) and a random permutation of its nodes.
fn csr_and_perm() -> impl Strategy<Value = (Csr, Vec<u32>)> {
    (1usize..40).prop_flat_map(|n| {
        let edges = prop::collection::vec((0..n as u32, 0..n as u32), 0..(4 * n));
        let perm = Just((0..n as u32).collect::<Vec<u32>>()).prop_shuffle();
        (edges, perm, any::<bool>()).prop_map(move |(edges, perm, with_values)| {
            let mut a = Csr::from_edges(n, n, &edges).unwrap();
            if with_values {
                let vals = (0..a.nnz()).map(|k| k as f32 * 0.5 - 3.0).collect();
                a = a.with_values(Some(vals)).unwrap();
            }
            (a, perm)
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn by_degree_is_non_increasing_and_stable((a, _) in csr_and_perm()) {
        let p = Permutation::by_degree_descending(&a);
        prop_assert_eq!(p.len(), a.n_rows());
        let order = p.old_of_new();
        for w in order.windows(2) {
            let (d0, d1) = (a.degree(w[0] as usize), a.degree(w[1] as usize));
            prop_assert!(d0 >= d1, "degree {} before {}", d0, d1);
            if d0 == d1 {
                prop_assert!(w[0] < w[1], "ties must keep their order");
            }
        }
        // The permuted matrix has its rows in that order.
        let b = p.permute_csr(&a).unwrap();
        for r in 1..b.n_rows() {
            prop_assert!(b.degree(r - 1) >= b.degree(r));
        }
    }

    #[test]
    fn permute_csr_renames_every_entry((a, perm) in csr_and_perm()) {
        let p = Permutation::try_new(perm).unwrap();
        let b = p.permute_csr(&a).unwrap();
        prop_assert_eq!(b.nnz(), a.nnz());
        prop_assert_eq!(b.values().is_some(), a.values().is_some());
        let f = p.new_of_old();
        for i in 0..a.n_rows() {
            for e in a.row_range(i) {
                let j = a.col_indices()[e];
                let (bi, bj) = (f[i] as usize, f[j as usize]);
                let pos = b.row(bi).binary_search(&bj);
                prop_assert!(pos.is_ok(), "entry ({}, {}) lost", i, j);
                if let (Some(av), Some(bv)) = (a.values(), b.values()) {
                    let k = b.row_range(bi).start + pos.unwrap();
                    prop_assert_eq!(av[e], bv[k]);
                }
            }
        }
        // Sorted rows, no duplicates: the validated constructor accepts the parts.
        let (n_rows, n_cols, offsets, cols, vals) = b.clone().into_parts();
        prop_assert!(Csr::try_new(n_rows, n_cols, offsets, cols, vals).is_ok());
    }

    #[test]
    fn apply_then_unapply_is_identity_on_csr((a, perm) in csr_and_perm()) {
        let p = Permutation::try_new(perm).unwrap();
        let b = p.permute_csr(&a).unwrap();
        prop_assert_eq!(&p.unpermute_csr(&b).unwrap(), &a);
        prop_assert_eq!(&p.inverse().permute_csr(&b).unwrap(), &a);
        let d = Permutation::by_degree_descending(&a);
        prop_assert_eq!(&d.unpermute_csr(&d.permute_csr(&a).unwrap()).unwrap(), &a);
    }

    #[test]
    fn apply_then_unapply_is_identity_on_rows(perm in perm_vec(50), row_len in 0usize..5) {
        let p = Permutation::try_new(perm).unwrap();
        let data: Vec<u64> = (0..(p.len() * row_len) as u64).collect();
        let y = p.permute_rows(&data, row_len).unwrap();
        // Row `old` lands at row new_of_old[old].
        for old in 0..p.len() {
            let new = p.new_of_old()[old] as usize;
            prop_assert_eq!(
                &y[new * row_len..(new + 1) * row_len],
                &data[old * row_len..(old + 1) * row_len]
            );
        }
        prop_assert_eq!(&p.unpermute_rows(&y, row_len).unwrap(), &data);
        prop_assert_eq!(&p.inverse().permute_rows(&y, row_len).unwrap(), &data);
    }

    #[test]
    fn inverse_and_compose(p in perm_vec(30), q_seed in any::<u64>()) {
        let n = p.len();
        let p = Permutation::try_new(p).unwrap();
        // A second permutation of the same length, from the seed (rotation then reversal).
        let shift = if n == 0 { 0 } else { (q_seed % n as u64) as usize };
        let q_vec: Vec<u32> = (0..n).map(|i| ((i + shift) % n) as u32).rev().collect();
        let q = Permutation::try_new(q_vec).unwrap();
        prop_assert_eq!(&p.inverse().inverse(), &p);
        prop_assert!(p.compose(&p.inverse()).unwrap().is_identity());
        prop_assert!(p.inverse().compose(&p).unwrap().is_identity());
        let pq = p.compose(&q).unwrap();
        // Composition applies p first, then q, and stays a valid permutation.
        prop_assert_eq!(&Permutation::try_new(pq.new_of_old().to_vec()).unwrap(), &pq);
        let x: Vec<u32> = (0..n as u32).collect();
        prop_assert_eq!(
            pq.permute_rows(&x, 1).unwrap(),
            q.permute_rows(&p.permute_rows(&x, 1).unwrap(), 1).unwrap()
        );
        prop_assert_eq!(&Permutation::from_old_of_new(p.old_of_new().to_vec()).unwrap(), &p);
    }

    #[test]
    fn repeated_values_are_rejected(perm in perm_vec(30), i in any::<prop::sample::Index>(), j in any::<prop::sample::Index>()) {
        prop_assume!(perm.len() >= 2);
        let n = perm.len();
        let (i, j) = (i.index(n), j.index(n));
        prop_assume!(i != j);
        let mut bad = perm.clone();
        bad[j] = perm[i];
        let later = i.max(j);
        match Permutation::try_new(bad.clone()) {
            Err(Error::InvalidPermutation { n: got_n, why }) => {
                prop_assert_eq!(got_n, n);
                let expected = format!("value {} at index {} repeats index {}", perm[i], later, i.min(j));
                prop_assert_eq!(why, expected);
            }
            other => prop_assert!(false, "{:?}", other),
        }
        prop_assert!(Permutation::from_old_of_new(bad).is_err());
    }

    #[test]
    fn out_of_range_values_are_rejected(perm in perm_vec(30), i in any::<prop::sample::Index>(), excess in 0u32..1000) {
        prop_assume!(!perm.is_empty());
        let n = perm.len();
        let i = i.index(n);
        let mut bad = perm;
        let v = n as u32 + excess;
        bad[i] = v;
        match Permutation::try_new(bad) {
            Err(Error::InvalidPermutation { n: got_n, why }) => {
                prop_assert_eq!(got_n, n);
                prop_assert_eq!(why, format!("value {v} at index {i} is out of range"));
            }
            other => prop_assert!(false, "{:?}", other),
        }
    }
}

#[test]
fn permutation_basics() {
    let id = Permutation::identity(4).unwrap();
    assert_eq!(id.len(), 4);
    assert!(!id.is_empty() && id.is_identity());
    assert_eq!(id.new_of_old(), &[0, 1, 2, 3]);
    let empty = Permutation::identity(0).unwrap();
    assert!(empty.is_empty());
    assert_eq!(Permutation::try_new(vec![]).unwrap(), empty);
    assert!(Permutation::identity(usize::MAX).is_err());
    let p = Permutation::try_new(vec![3, 1, 0, 2]).unwrap();
    assert_eq!(p.old_of_new(), &[2, 1, 3, 0]);
    assert!(!p.is_identity());
    assert_eq!(p.inverse().new_of_old(), p.old_of_new());
    assert!(matches!(
        Permutation::try_new(vec![u32::MAX]),
        Err(Error::InvalidPermutation { n: 1, .. })
    ));
}

#[test]
fn permutation_length_errors() {
    let p = Permutation::try_new(vec![1, 0, 2]).unwrap();
    match p.permute_rows(&[1.0f32; 7], 2) {
        Err(Error::LengthMismatch {
            expected, actual, ..
        }) => assert_eq!((expected, actual), (6, 7)),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        p.unpermute_rows(&[1u8; 5], 2),
        Err(Error::LengthMismatch {
            expected: 6,
            actual: 5,
            ..
        })
    ));
    // Zero-width rows: only the empty slice fits.
    assert_eq!(p.permute_rows::<u8>(&[], 0).unwrap(), Vec::<u8>::new());
    assert!(p.permute_rows(&[1u8], 0).is_err());
    assert!(matches!(
        p.permute_rows(&[0u8; 3], usize::MAX),
        Err(Error::InvalidParameter { .. })
    ));
    let rect = Csr::from_edges(3, 4, &[(0, 3)]).unwrap();
    assert!(matches!(
        p.permute_csr(&rect),
        Err(Error::NotSquare {
            n_rows: 3,
            n_cols: 4,
            ..
        })
    ));
    let small = Csr::identity(2).unwrap();
    assert!(matches!(
        p.permute_csr(&small),
        Err(Error::LengthMismatch {
            expected: 3,
            actual: 2,
            ..
        })
    ));
    assert!(matches!(
        p.unpermute_csr(&small),
        Err(Error::LengthMismatch { .. })
    ));
    let q = Permutation::identity(4).unwrap();
    assert!(matches!(
        p.compose(&q),
        Err(Error::LengthMismatch {
            expected: 3,
            actual: 4,
            ..
        })
    ));
}

#[test]
fn degree_reordering_of_cora_groups_long_rows() {
    let path = spattn_test_support::cora_path();
    let a = spattn_formats::read_matrix_market(&path)
        .unwrap()
        .symmetrize_with_self_loops()
        .unwrap();
    let p = Permutation::by_degree_descending(&a);
    let b = p.permute_csr(&a).unwrap();
    assert_eq!(b.degree(0), a.degree_stats().max);
    assert_eq!(
        b.transpose(),
        b,
        "a renamed symmetric graph stays symmetric"
    );
    assert_eq!(p.unpermute_csr(&b).unwrap(), a);
    // Features follow their nodes.
    let x: Vec<f32> = (0..a.n_rows() * 3).map(|k| k as f32).collect();
    let y = p.permute_rows(&x, 3).unwrap();
    let hub = p.old_of_new()[0] as usize;
    assert_eq!(&y[..3], &x[hub * 3..hub * 3 + 3]);
    assert_eq!(p.unpermute_rows(&y, 3).unwrap(), x);
}

/// The transpose the definition gives: entry (r, c) of A at (c, r), rows of Aᵀ in row order of
/// A, and the map to A's entry.
fn transpose_by_definition(a: &Csr) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut by_col: Vec<Vec<(u32, u32)>> = vec![Vec::new(); a.n_cols()];
    for r in 0..a.n_rows() {
        for e in a.row_range(r) {
            by_col[a.col_indices()[e] as usize].push((r as u32, e as u32));
        }
    }
    let mut offsets = vec![0u32];
    let (mut cols, mut map) = (Vec::new(), Vec::new());
    for list in by_col {
        for (r, e) in list {
            cols.push(r);
            map.push(e);
        }
        offsets.push(cols.len() as u32);
    }
    (offsets, cols, map)
}

#[test]
fn the_parallel_transpose_is_the_definition_on_every_thread_count() {
    // Past 2^20 entries the transpose runs one column range per thread; directed R-MAT has
    // hub columns, empty columns and a rectangular variant below.
    let a = rmat(&RmatConfig::new(17).with_seed(3)).unwrap();
    assert!(
        a.nnz() > 1 << 20,
        "{} entries: the parallel path is not reached",
        a.nnz()
    );
    let (offsets, cols, map) = transpose_by_definition(&a);
    for threads in [1, 2, 3, 8] {
        let (t, m) = in_pool(threads, || a.transpose_with_map());
        assert_eq!(t.row_offsets(), &offsets[..], "{threads} threads");
        assert_eq!(t.col_indices(), &cols[..], "{threads} threads");
        assert_eq!(m, map, "{threads} threads");
    }
    // Rectangular: the rows of A past a column count.
    let wide = Csr::from_unsorted(
        a.n_rows(),
        a.n_cols() + 1000,
        &(0..a.nnz() as u32)
            .map(|e| e % a.n_rows() as u32)
            .collect::<Vec<_>>(),
        &(0..a.nnz() as u32)
            .map(|e| (e * 7) % (a.n_cols() as u32 + 1000))
            .collect::<Vec<_>>(),
        None,
    )
    .unwrap();
    assert!(wide.nnz() > 1 << 20);
    let (offsets, cols, map) = transpose_by_definition(&wide);
    let (t, m) = in_pool(4, || wide.transpose_with_map());
    assert_eq!((t.n_rows(), t.n_cols()), (wide.n_cols(), wide.n_rows()));
    assert_eq!(
        (t.row_offsets(), t.col_indices()),
        (&offsets[..], &cols[..])
    );
    assert_eq!(m, map);
    // Hub columns holding more than a task's share (ranges collapse onto them) and the last
    // columns holding a large part (the last range may be empty).
    let n: u32 = 1 << 18;
    let (mut rows, mut cols) = (Vec::new(), Vec::new());
    let mut state = 12345u64;
    for r in 0..n {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        for c in [0, 1, n - 2, n - 1, (state >> 40) as u32 % n] {
            rows.push(r);
            cols.push(c);
        }
    }
    let hub = Csr::from_unsorted(n as usize, n as usize, &rows, &cols, None).unwrap();
    assert!(hub.nnz() > 1 << 20, "{} entries", hub.nnz());
    let (offsets, cols_t, map) = transpose_by_definition(&hub);
    for threads in [2, 8, 64] {
        let (t, m) = in_pool(threads, || hub.transpose_with_map());
        assert_eq!(
            (t.row_offsets(), t.col_indices()),
            (&offsets[..], &cols_t[..])
        );
        assert_eq!(m, map);
    }
}

#[test]
fn pattern_symmetry_is_equality_with_the_transpose() {
    // Serial below 2^20 entries (R-MAT 8), parallel from there (R-MAT 17).
    for scale in [8, 17] {
        let a = rmat(&RmatConfig::new(scale).with_seed(5)).unwrap();
        let (offsets, cols, _) = transpose_by_definition(&a);
        let equal = a.row_offsets() == &offsets[..] && a.col_indices() == &cols[..];
        assert_eq!(a.is_pattern_symmetric(), equal, "R-MAT {scale} directed");
        assert!(!equal, "R-MAT {scale} directed came out symmetric");
        let s = a.symmetrize().unwrap();
        assert!(s.is_pattern_symmetric(), "R-MAT {scale} symmetrized");
        // One mirror missing: the entry of the largest row that is not a self loop.
        let r = (0..s.n_rows()).max_by_key(|&r| s.degree(r)).unwrap();
        let drop = s
            .row_range(r)
            .find(|&e| s.col_indices()[e] as usize != r)
            .unwrap();
        let (rows, cols): (Vec<u32>, Vec<u32>) = (0..s.n_rows())
            .flat_map(|i| s.row_range(i).map(move |e| (i as u32, e)))
            .filter(|&(_, e)| e != drop)
            .map(|(i, e)| (i, s.col_indices()[e]))
            .unzip();
        let cut = Csr::from_unsorted(s.n_rows(), s.n_cols(), &rows, &cols, None).unwrap();
        assert!(
            !cut.is_pattern_symmetric(),
            "R-MAT {scale}, one mirror dropped"
        );
    }
    // Rectangular is never symmetric; the empty square is.
    assert!(!Csr::from_edges(2, 3, &[(0, 1)])
        .unwrap()
        .is_pattern_symmetric());
    assert!(Csr::empty(4, 4).unwrap().is_pattern_symmetric());
}
