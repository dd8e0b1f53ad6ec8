//! The locality order (reverse Cuthill–McKee, with and without hub peeling), the row-only
//! permutation and the BSB window count; plus `locality_table` (ignored: reads the shared
//! graphs, prints the gathers table of docs/kernels/reordering.md, "Measured").

use proptest::prelude::*;
use spattn_formats::{read_matrix_market, rmat, Bsb, Csr, Error, Permutation, RmatConfig};
use spattn_test_support::{find_graph, DATA_DIR_ENV};

/// A `w × h` grid graph (4-neighbour), numbered row by row, symmetric with self loops.
fn grid(w: u32, h: u32) -> Csr {
    let mut edges = Vec::new();
    for y in 0..h {
        for x in 0..w {
            let i = y * w + x;
            if x + 1 < w {
                edges.push((i, i + 1));
            }
            if y + 1 < h {
                edges.push((i, i + w));
            }
        }
    }
    let n = (w * h) as usize;
    Csr::from_edges(n, n, &edges)
        .unwrap()
        .symmetrize_with_self_loops()
        .unwrap()
}

/// `g` with its nodes scrambled by a fixed pseudo-random permutation.
fn scrambled(g: &Csr, seed: u64) -> Csr {
    let n = g.n_rows();
    let mut keys: Vec<(u64, u32)> = (0..n as u32)
        .map(|i| {
            let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
            x ^= x >> 29;
            (x.wrapping_mul(0xBF58_476D_1CE4_E5B9), i)
        })
        .collect();
    keys.sort_unstable();
    let p = Permutation::from_old_of_new(keys.into_iter().map(|k| k.1).collect()).unwrap();
    p.permute_csr(g).unwrap()
}

fn assert_valid(p: &Permutation, n: usize) {
    assert_eq!(p.len(), n);
    let mut seen = vec![false; n];
    for (old, &new) in p.new_of_old().iter().enumerate() {
        assert!(!seen[new as usize], "{new} twice");
        seen[new as usize] = true;
        assert_eq!(p.old_of_new()[new as usize] as usize, old);
    }
}

#[test]
fn rcm_restores_a_scrambled_path_and_shrinks_a_grid() {
    let path = Csr::from_edges(200, 200, &(0..199).map(|i| (i, i + 1)).collect::<Vec<_>>())
        .unwrap()
        .symmetrize_with_self_loops()
        .unwrap();
    let a = scrambled(&path, 7);
    let p = Permutation::reverse_cuthill_mckee(&a).unwrap();
    assert_valid(&p, 200);
    assert!(Permutation::bandwidth(&a, None).unwrap() > 50);
    assert_eq!(Permutation::bandwidth(&a, Some(&p)).unwrap(), 1);

    // A 30 × 40 grid: RCM's bandwidth is about the short side, far below a random order's.
    let a = scrambled(&grid(30, 40), 3);
    let p = Permutation::reverse_cuthill_mckee(&a).unwrap();
    assert_valid(&p, 1200);
    let bw = Permutation::bandwidth(&a, Some(&p)).unwrap();
    assert!(bw <= 45, "grid bandwidth {bw}");
    assert!(Permutation::bandwidth(&a, None).unwrap() > 500);
    // ... and the BSB windows share columns: fewer gathers than the scrambled order.
    let before = Bsb::count_with_row_order(&a, None).unwrap();
    let after = Bsb::count_with_row_order(&a, Some(&p)).unwrap();
    assert!(
        (after.columns as f64) < 0.7 * before.columns as f64,
        "{after:?} vs {before:?}"
    );
    assert!(after.blocks < before.blocks);
}

#[test]
fn rcm_handles_components_isolated_nodes_and_empty_graphs() {
    // Two paths and three isolated nodes (one with a self loop only).
    let a = Csr::from_edges(
        9,
        9,
        &[(0, 4), (4, 8), (1, 5), (5, 1), (8, 4), (4, 0), (7, 7)],
    )
    .unwrap();
    for p in [
        Permutation::reverse_cuthill_mckee(&a).unwrap(),
        Permutation::reverse_cuthill_mckee_peeling_hubs(&a, 1.0).unwrap(),
    ] {
        assert_valid(&p, 9);
    }
    let p = Permutation::reverse_cuthill_mckee(&a).unwrap();
    // Each component is numbered contiguously.
    let pos = |i: usize| p.new_of_old()[i] as i64;
    assert_eq!((pos(0) - pos(4)).abs().max((pos(4) - pos(8)).abs()), 1);
    assert_eq!((pos(1) - pos(5)).abs(), 1);
    // Deterministic.
    assert_eq!(Permutation::reverse_cuthill_mckee(&a).unwrap(), p);

    let empty = Csr::from_edges(0, 0, &[]).unwrap();
    assert!(Permutation::reverse_cuthill_mckee(&empty)
        .unwrap()
        .is_empty());
    let rect = Csr::from_edges(2, 3, &[(0, 2)]).unwrap();
    assert!(matches!(
        Permutation::reverse_cuthill_mckee(&rect),
        Err(Error::NotSquare { .. })
    ));
    assert!(matches!(
        Permutation::bandwidth(&rect, None),
        Err(Error::NotSquare { .. })
    ));
    for bad in [0.0, -1.0, f64::NAN] {
        assert!(matches!(
            Permutation::reverse_cuthill_mckee_peeling_hubs(&a, bad),
            Err(Error::InvalidParameter { .. })
        ));
    }
    let id = Permutation::identity(3).unwrap();
    assert!(matches!(
        Permutation::bandwidth(&a, Some(&id)),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        Bsb::count_with_row_order(&a, Some(&id)),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        id.permute_csr_rows(&a),
        Err(Error::LengthMismatch { .. })
    ));
}

#[test]
fn peeling_puts_the_hubs_first() {
    // A star (node 5 is the hub) plus a path among the leaves.
    let mut edges: Vec<(u32, u32)> = (0..40).filter(|&i| i != 5).map(|i| (5, i)).collect();
    edges.extend(
        (0..39)
            .filter(|&i| i != 5 && i + 1 != 5)
            .map(|i| (i, i + 1)),
    );
    let a = Csr::from_edges(40, 40, &edges)
        .unwrap()
        .symmetrize_with_self_loops()
        .unwrap();
    let p = Permutation::reverse_cuthill_mckee_peeling_hubs(&a, 4.0).unwrap();
    assert_valid(&p, 40);
    assert_eq!(p.old_of_new()[0], 5);
    // No degree is above infinity times the mean: plain RCM.
    assert_eq!(
        Permutation::reverse_cuthill_mckee_peeling_hubs(&a, f64::INFINITY).unwrap(),
        Permutation::reverse_cuthill_mckee(&a).unwrap()
    );
}

fn arb_graph() -> impl Strategy<Value = Csr> {
    (1usize..80).prop_flat_map(|n| {
        proptest::collection::vec((0..n as u32, 0..n as u32), 0..(4 * n)).prop_map(move |e| {
            Csr::from_edges(n, n, &e)
                .unwrap()
                .symmetrize_with_self_loops()
                .unwrap()
        })
    })
}

/// Directed graphs: edges need not have their reverse, so a node may be reachable from nowhere.
fn arb_directed_graph() -> impl Strategy<Value = Csr> {
    (1usize..60).prop_flat_map(|n| {
        proptest::collection::vec((0..n as u32, 0..n as u32), 0..(3 * n))
            .prop_map(move |e| Csr::from_edges(n, n, &e).unwrap())
    })
}

#[test]
fn rcm_numbers_a_node_nothing_points_to() {
    // Found by the fused-tc tests: the search from node 10 (only an edge 10 -> 1, nothing
    // pointing back) moved its root to a deeper node whose search never reaches 10, and 10
    // was left without a number.
    let rows: [&[u32]; 23] = [
        &[5, 11, 21],
        &[6, 9, 11, 13, 16],
        &[3, 15],
        &[],
        &[7, 11, 12, 17, 19, 22],
        &[5, 17],
        &[3, 9, 13, 21],
        &[],
        &[4, 5, 7, 9, 11, 13],
        &[1, 2, 3, 4, 8, 17],
        &[1],
        &[],
        &[5],
        &[7],
        &[1, 3, 16, 17],
        &[],
        &[8, 15],
        &[0, 17, 18, 22],
        &[2, 3, 17],
        &[],
        &[5, 20, 21],
        &[0, 11, 18],
        &[7, 8, 13],
    ];
    let edges: Vec<(u32, u32)> = rows
        .iter()
        .enumerate()
        .flat_map(|(r, cs)| cs.iter().map(move |&c| (r as u32, c)))
        .collect();
    let a = Csr::from_edges(23, 23, &edges).unwrap();
    assert_valid(&Permutation::reverse_cuthill_mckee(&a).unwrap(), 23);
    for hub in [1.0, 32.0] {
        assert_valid(
            &Permutation::reverse_cuthill_mckee_peeling_hubs(&a, hub).unwrap(),
            23,
        );
    }
}

proptest! {
    #[test]
    fn rcm_numbers_every_node_of_a_directed_graph(a in arb_directed_graph(), hub in 1.0f64..40.0) {
        for p in [
            Permutation::reverse_cuthill_mckee(&a).unwrap(),
            Permutation::reverse_cuthill_mckee_peeling_hubs(&a, hub).unwrap(),
        ] {
            assert_valid(&p, a.n_rows());
            prop_assert_eq!(p.old_of_new().len(), a.n_rows());
        }
    }

    #[test]
    fn rcm_is_a_permutation_that_round_trips(a in arb_graph(), hub in 1.0f64..8.0) {
        for p in [
            Permutation::reverse_cuthill_mckee(&a).unwrap(),
            Permutation::reverse_cuthill_mckee_peeling_hubs(&a, hub).unwrap(),
        ] {
            assert_valid(&p, a.n_rows());
            let b = p.permute_csr(&a).unwrap();
            prop_assert_eq!(p.inverse().permute_csr(&b).unwrap(), a.clone());
            // Counting agrees with building; renaming columns changes no count.
            let rows_only = p.permute_csr_rows(&a).unwrap();
            let bsb = Bsb::from_csr(&rows_only).unwrap();
            let c = Bsb::count_with_row_order(&a, Some(&p)).unwrap();
            prop_assert_eq!(c.blocks, bsb.n_blocks());
            prop_assert_eq!(c.edges, a.nnz());
            let real = bsb.block_columns().iter().filter(|&&x| x != Bsb::PADDING).count();
            prop_assert_eq!(c.columns, real);
            let renamed = Bsb::count_with_row_order(&b, None).unwrap();
            prop_assert_eq!(renamed, c);
            // Row-only permutation keeps each row's columns.
            for new in 0..a.n_rows() {
                prop_assert_eq!(rows_only.row(new), a.row(p.old_of_new()[new] as usize));
            }
        }
    }
}

/// Prints, per graph and node order, the (window, column) pairs (= K/V row gathers of fused-tc
/// per head), BSB blocks and fill, and the time the order took. Shared graphs found as every
/// test finds them (`spattn_test_support::find_graph`: `SPATTN_DATA_DIR` first, then the
/// repository's folders and ../shared/data/mtx), symmetrized with self loops, and R-MAT 16/18
/// (`SPATTN_RMAT` to change the scales).
#[test]
#[ignore = "reads the shared graphs; prints a table"]
fn locality_table() {
    let names = std::env::var("SPATTN_GRAPHS").unwrap_or_else(|_| {
        "cora,citeseer,pubmed,ogbn-arxiv,flickr,ppi-graphsaint,PROTEINS_full,\
         facebook-page-page,lastfm-asia,deezer-RO"
            .into()
    });
    let scales = std::env::var("SPATTN_RMAT").unwrap_or_else(|_| "16,18".into());
    let mut graphs: Vec<(String, Csr)> = Vec::new();
    for name in names.split(',').filter(|s| !s.is_empty()) {
        // A graph that is not there is skipped, as one that cannot be read: the table is of
        // whatever graphs this machine has.
        let Some(path) = find_graph(name) else {
            println!("skip {name}: {name}.mtx.gz not found (set {DATA_DIR_ENV})");
            continue;
        };
        match read_matrix_market(&path) {
            Ok(a) => graphs.push((name.into(), a.symmetrize_with_self_loops().unwrap())),
            Err(e) => println!("skip {name}: {e}"),
        }
    }
    for s in scales.split(',').filter(|s| !s.is_empty()) {
        let s: u32 = s.parse().unwrap();
        graphs.push((
            format!("R-MAT {s}"),
            rmat(&RmatConfig::benchmark(s)).unwrap(),
        ));
    }
    println!(
        "| graph | n | nnz | order | gathers (window, col) | vs natural | blocks | fill | order ms |"
    );
    println!("|---|---:|---:|---|---:|---:|---:|---:|---:|");
    for (name, a) in &graphs {
        let natural = Bsb::count_with_row_order(a, None).unwrap();
        let mut rows = vec![("natural".to_string(), natural, 0.0)];
        let timed = |f: &dyn Fn() -> Permutation| {
            let t = std::time::Instant::now();
            let p = f();
            (p, t.elapsed().as_secs_f64() * 1e3)
        };
        let orders: Vec<(String, Box<dyn Fn() -> Permutation>)> = vec![
            (
                "degree".into(),
                Box::new(|| Permutation::by_degree_descending(a)),
            ),
            (
                "rcm".into(),
                Box::new(|| Permutation::reverse_cuthill_mckee(a).unwrap()),
            ),
            (
                "rcm-hubs8".into(),
                Box::new(|| Permutation::reverse_cuthill_mckee_peeling_hubs(a, 8.0).unwrap()),
            ),
            (
                "rcm-hubs32".into(),
                Box::new(|| Permutation::reverse_cuthill_mckee_peeling_hubs(a, 32.0).unwrap()),
            ),
        ];
        for (label, f) in &orders {
            let (p, ms) = timed(f.as_ref());
            rows.push((
                label.clone(),
                Bsb::count_with_row_order(a, Some(&p)).unwrap(),
                ms,
            ));
        }
        for (label, c, ms) in rows {
            println!(
                "| {name} | {} | {} | {label} | {} | {:.2}× | {} | {:.3} | {:.0} |",
                a.n_rows(),
                a.nnz(),
                c.columns,
                natural.columns as f64 / c.columns as f64,
                c.blocks,
                c.fill(),
                ms
            );
        }
    }
}
