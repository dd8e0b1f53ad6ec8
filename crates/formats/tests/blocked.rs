//! Round trips, invariants, hand-checked layouts and errors of the blocked tensor-core formats
//! (ME-BCRS and BSB), on hand-made, random, R-MAT and real graphs.

use std::collections::BTreeMap;
use std::path::PathBuf;

use proptest::prelude::*;
use spattn_formats::{rmat, Bsb, Csr, Error, MeBcrs, RmatConfig};

// ---------------------------------------------------------------------------------------------
// Reference builders: the obvious, slow construction of each format, compared array by array.
// ---------------------------------------------------------------------------------------------

/// ME-BCRS arrays built naively: (row_pointers, column_indices, row_masks, slot values).
fn reference_mebcrs(a: &Csr) -> (Vec<u32>, Vec<u32>, Vec<u8>, Option<Vec<f32>>) {
    let mut pointers = vec![0u32];
    let (mut cols, mut masks) = (Vec::new(), Vec::new());
    let mut vals = a.values().map(|_| Vec::new());
    for w in 0..a.n_rows().div_ceil(8) {
        let mut window: BTreeMap<u32, (u8, [f32; 8])> = BTreeMap::new();
        for row in 8 * w..(8 * w + 8).min(a.n_rows()) {
            for e in a.row_range(row) {
                let entry = window.entry(a.col_indices()[e]).or_default();
                entry.0 |= 1 << (row - 8 * w);
                entry.1[row - 8 * w] = a.values().map_or(0.0, |v| v[e]);
            }
        }
        for (c, (m, v)) in window {
            cols.push(c);
            masks.push(m);
            if let Some(vals) = vals.as_mut() {
                vals.extend_from_slice(&v);
            }
        }
        pointers.push(cols.len() as u32);
    }
    (pointers, cols, masks, vals)
}

/// BSB arrays built naively: (window_offsets, block_columns, bitmaps).
fn reference_bsb(a: &Csr) -> (Vec<u32>, Vec<u32>, Vec<u128>) {
    let mut offsets = vec![0u32];
    let (mut cols, mut maps) = (Vec::new(), Vec::new());
    for w in 0..a.n_rows().div_ceil(16) {
        let mut window: BTreeMap<u32, u16> = BTreeMap::new();
        for row in 16 * w..(16 * w + 16).min(a.n_rows()) {
            for &c in a.row(row) {
                *window.entry(c).or_default() |= 1 << (row - 16 * w);
            }
        }
        let window: Vec<(u32, u16)> = window.into_iter().collect();
        for block in window.chunks(8) {
            let mut bm = 0u128;
            for (c, &(col, rows)) in block.iter().enumerate() {
                cols.push(col);
                for r in 0..16 {
                    if rows >> r & 1 == 1 {
                        bm |= 1 << (r * 8 + c);
                    }
                }
            }
            cols.resize(cols.len().next_multiple_of(8), Bsb::PADDING);
            maps.push(bm);
        }
        offsets.push(maps.len() as u32);
    }
    (offsets, cols, maps)
}

// ---------------------------------------------------------------------------------------------
// Checks shared by every test.
// ---------------------------------------------------------------------------------------------

/// Every invariant and round trip of ME-BCRS built from `a`; `naive` also compares with the
/// reference builder (slow on big graphs in debug).
fn check_mebcrs(a: &Csr, naive: bool) {
    for bw in [4usize, 8] {
        let me = MeBcrs::from_csr(a, bw).unwrap();
        assert_eq!(
            (me.n_rows(), me.n_cols(), me.nnz()),
            (a.n_rows(), a.n_cols(), a.nnz())
        );
        assert_eq!(me.block_width(), bw);
        let nw = a.n_rows().div_ceil(8);
        assert_eq!(me.n_windows(), nw);
        let rp = me.row_pointers();
        assert_eq!(rp.len(), nw + 1);
        assert_eq!(rp[0], 0);
        assert_eq!(*rp.last().unwrap() as usize, me.n_vectors());
        assert_eq!(me.column_indices().len(), me.n_vectors());
        assert_eq!(me.row_masks().len(), me.n_vectors());
        assert_eq!(me.n_slots(), 8 * me.n_vectors());
        assert_eq!(me.edge_offsets(), a.row_offsets());
        let (mut blocks, mut max_blocks, mut edges) = (0, 0, 0);
        for w in 0..nw {
            assert!(rp[w] <= rp[w + 1]);
            let cols = me.window_columns(w);
            assert!(
                cols.windows(2).all(|p| p[0] < p[1]),
                "window {w} not sorted"
            );
            assert!(cols.iter().all(|&c| (c as usize) < a.n_cols()));
            let rows_here = (a.n_rows() - 8 * w).min(8);
            for &m in me.window_masks(w) {
                assert_ne!(m, 0, "empty mask in window {w}");
                assert_eq!(u32::from(m) >> rows_here, 0, "mask past the last row");
                edges += m.count_ones() as usize;
            }
            assert_eq!(me.blocks_in_window(w), me.vectors_in_window(w).div_ceil(bw));
            blocks += me.blocks_in_window(w);
            max_blocks = max_blocks.max(me.blocks_in_window(w));
        }
        assert_eq!(edges, a.nnz());
        assert_eq!(me.n_blocks(), blocks);
        let stats = me.fill_stats();
        assert_eq!(stats.windows, nw);
        assert_eq!(stats.blocks, blocks);
        assert_eq!(stats.edges, a.nnz());
        assert_eq!(stats.slots, blocks * 8 * bw);
        assert_eq!(stats.max_blocks_per_window, max_blocks);
        assert!(stats.fill() <= 1.0);
        let fills = me.window_fills();
        assert_eq!(fills.len(), nw);
        for (w, &f) in fills.iter().enumerate() {
            assert!((0.0..=1.0).contains(&f));
            assert_eq!(f, me.window_fill(w));
            assert_eq!(f == 0.0, me.vectors_in_window(w) == 0);
        }

        // Round trip, exact.
        assert_eq!(&me.to_csr().unwrap(), a);

        // Edge map: every slot decodes back to its CSR edge, and no two edges share a slot.
        let map = me.edge_to_slot().unwrap();
        assert_eq!(map.len(), a.nnz());
        let mut used = vec![false; me.n_slots()];
        let rows = a.row_indices();
        for (e, &s) in map.iter().enumerate() {
            let (v, r) = (s as usize / 8, s as usize % 8);
            let w = rp.partition_point(|&p| p as usize <= v) - 1;
            assert_eq!(8 * w + r, rows[e] as usize, "edge {e}: wrong row");
            assert_eq!(
                me.column_indices()[v],
                a.col_indices()[e],
                "edge {e}: wrong column"
            );
            assert_eq!(me.row_masks()[v] >> r & 1, 1, "edge {e}: mask bit clear");
            assert!(
                !std::mem::replace(&mut used[s as usize], true),
                "slot {s} used twice"
            );
        }

        // Values per slot, and both directions of the slot <-> CSR order helpers.
        let edge_ids: Vec<u32> = (0..a.nnz() as u32).collect();
        let slots = me.scatter_to_slots(&edge_ids, u32::MAX).unwrap();
        for (e, &s) in map.iter().enumerate() {
            assert_eq!(slots[s as usize], e as u32);
        }
        assert_eq!(
            slots.iter().filter(|&&x| x == u32::MAX).count(),
            me.n_slots() - a.nnz()
        );
        assert_eq!(me.gather_to_csr_order(&slots).unwrap(), edge_ids);
        match a.values() {
            Some(vals) => {
                let sv = me.values().unwrap();
                assert_eq!(sv.len(), me.n_slots());
                assert_eq!(me.scatter_to_slots(vals, 0.0).unwrap(), sv);
                assert_eq!(me.gather_to_csr_order(sv).unwrap(), vals);
            }
            None => assert!(me.values().is_none()),
        }

        // The validated constructor accepts exactly these arrays.
        let rebuilt = MeBcrs::try_new(
            a.n_rows(),
            a.n_cols(),
            bw,
            rp.to_vec(),
            me.column_indices().to_vec(),
            me.row_masks().to_vec(),
            me.values().map(<[f32]>::to_vec),
        )
        .unwrap();
        assert_eq!(rebuilt, me);
        let other = if bw == 4 { 8 } else { 4 };
        let switched = me.clone().with_block_width(other).unwrap();
        assert_eq!(switched, MeBcrs::from_csr(a, other).unwrap());

        if naive {
            let (p, c, m, v) = reference_mebcrs(a);
            assert_eq!(rp, &p[..]);
            assert_eq!(me.column_indices(), &c[..]);
            assert_eq!(me.row_masks(), &m[..]);
            assert_eq!(me.values(), v.as_deref());
        }
    }
}

/// Every invariant and round trip of BSB built from `a`.
fn check_bsb(a: &Csr, naive: bool) {
    let bsb = Bsb::from_csr(a).unwrap();
    assert_eq!(
        (bsb.n_rows(), bsb.n_cols(), bsb.nnz()),
        (a.n_rows(), a.n_cols(), a.nnz())
    );
    let nw = a.n_rows().div_ceil(16);
    assert_eq!(bsb.n_windows(), nw);
    let wo = bsb.window_offsets();
    assert_eq!(wo.len(), nw + 1);
    assert_eq!(wo[0], 0);
    assert_eq!(*wo.last().unwrap() as usize, bsb.n_blocks());
    assert_eq!(bsb.block_columns().len(), 8 * bsb.n_blocks());
    assert_eq!(bsb.n_slots(), 128 * bsb.n_blocks());
    assert_eq!(bsb.edge_offsets(), a.row_offsets());
    let bc = bsb.block_columns();
    let mut edges = 0;
    for w in 0..nw {
        let blocks = bsb.window_blocks(w);
        assert_eq!(blocks.len(), bsb.blocks_in_window(w));
        let cols = &bc[blocks.start * 8..blocks.end * 8];
        let real: Vec<u32> = cols
            .iter()
            .copied()
            .filter(|&c| c != Bsb::PADDING)
            .collect();
        assert!(
            real.windows(2).all(|p| p[0] < p[1]),
            "window {w} not sorted"
        );
        assert!(real.iter().all(|&c| (c as usize) < a.n_cols()));
        // Padding only as a suffix of the last block, fewer than 8 slots.
        assert_eq!(&cols[..real.len()], &real[..]);
        assert!(cols.len() - real.len() < 8);
        let rows_here = (a.n_rows() - 16 * w).min(16);
        for b in blocks {
            let bm = bsb.bitmaps()[b];
            assert_ne!(bm, 0, "empty bitmap {b}");
            let past = bm.checked_shr(8 * rows_here as u32).unwrap_or(0);
            assert_eq!(past, 0, "bit past the last row");
            for c in 0..8 {
                let col_bits = (0..16).filter(|r| bm >> (r * 8 + c) & 1 == 1).count();
                assert_eq!(
                    col_bits == 0,
                    bc[8 * b + c] == Bsb::PADDING,
                    "block {b} slot {c}"
                );
            }
            edges += bm.count_ones() as usize;
        }
    }
    assert_eq!(edges, a.nnz());

    // Scheduling order: a permutation of the windows, by block count descending, ties by id.
    let order = bsb.window_order();
    assert_eq!(order.len(), nw);
    let mut seen = vec![false; nw];
    for &w in order {
        assert!(!std::mem::replace(&mut seen[w as usize], true));
    }
    for p in order.windows(2) {
        let (x, y) = (
            bsb.blocks_in_window(p[0] as usize),
            bsb.blocks_in_window(p[1] as usize),
        );
        assert!(
            x > y || (x == y && p[0] < p[1]),
            "window_order out of order"
        );
    }

    let stats = bsb.fill_stats();
    assert_eq!(
        (stats.windows, stats.blocks, stats.edges, stats.slots),
        (nw, bsb.n_blocks(), a.nnz(), 128 * bsb.n_blocks())
    );
    assert_eq!(
        stats.max_blocks_per_window,
        order
            .first()
            .map_or(0, |&w| bsb.blocks_in_window(w as usize))
    );
    for (w, &f) in bsb.window_fills().iter().enumerate() {
        assert!((0.0..=1.0).contains(&f));
        assert_eq!(f, bsb.window_fill(w));
    }

    // Device words: the little-endian image of every bitmap.
    let w64 = bsb.bitmap_words();
    let w32 = bsb.bitmap_words_u32();
    for (b, &bm) in bsb.bitmaps().iter().enumerate() {
        assert_eq!(
            u128::from(w64[2 * b]) | u128::from(w64[2 * b + 1]) << 64,
            bm
        );
        for k in 0..4 {
            assert_eq!(u128::from(w32[4 * b + k]), bm >> (32 * k) & 0xffff_ffff);
        }
    }

    assert_eq!(&bsb.to_csr().unwrap(), a);

    let map = bsb.edge_to_slot().unwrap();
    assert_eq!(map.len(), a.nnz());
    let rows = a.row_indices();
    let mut used = vec![false; bsb.n_slots()];
    for (e, &s) in map.iter().enumerate() {
        let (b, r, c) = (s as usize / 128, s as usize % 128 / 8, s as usize % 8);
        let w = wo.partition_point(|&p| p as usize <= b) - 1;
        assert_eq!(16 * w + r, rows[e] as usize, "edge {e}: wrong row");
        assert_eq!(bc[8 * b + c], a.col_indices()[e], "edge {e}: wrong column");
        assert_eq!(bsb.bitmaps()[b] >> (r * 8 + c) & 1, 1);
        assert!(
            !std::mem::replace(&mut used[s as usize], true),
            "slot {s} used twice"
        );
    }
    let edge_ids: Vec<u32> = (0..a.nnz() as u32).collect();
    let slots = bsb.scatter_to_slots(&edge_ids, u32::MAX).unwrap();
    for (e, &s) in map.iter().enumerate() {
        assert_eq!(slots[s as usize], e as u32);
    }
    assert_eq!(bsb.gather_to_csr_order(&slots).unwrap(), edge_ids);
    assert_eq!(bsb.values(), a.values());

    let rebuilt = Bsb::try_new(
        a.n_rows(),
        a.n_cols(),
        wo.to_vec(),
        bc.to_vec(),
        bsb.bitmaps().to_vec(),
        bsb.values().map(<[f32]>::to_vec),
    )
    .unwrap();
    assert_eq!(rebuilt, bsb);

    if naive {
        let (o, c, m) = reference_bsb(a);
        assert_eq!(wo, &o[..]);
        assert_eq!(bc, &c[..]);
        assert_eq!(bsb.bitmaps(), &m[..]);
    }
}

fn check_both(a: &Csr, naive: bool) {
    check_mebcrs(a, naive);
    check_bsb(a, naive);
    // And with values: distinct, so a misplaced value cannot hide.
    if a.values().is_none() {
        let vals: Vec<f32> = (0..a.nnz()).map(|e| e as f32 * 0.25 - 3.0).collect();
        let weighted = a.clone().with_values(Some(vals)).unwrap();
        check_mebcrs(&weighted, naive);
        check_bsb(&weighted, naive);
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-checked layouts.
// ---------------------------------------------------------------------------------------------

/// The 10 × 12 example of the module docs: rows 2 and 5 empty, a partial second ME-BCRS window,
/// one BSB window with a padded second block.
fn example() -> Csr {
    let edges = [
        (0, 1),
        (0, 4),
        (1, 4),
        (3, 0),
        (3, 9),
        (4, 4),
        (4, 7),
        (6, 2),
        (7, 7),
        (8, 3),
        (8, 5),
        (9, 5),
        (9, 11),
    ];
    Csr::from_edges(10, 12, &edges).unwrap()
}

#[test]
fn mebcrs_hand_checked() {
    let a = example();
    let me = MeBcrs::from_csr(&a, 8).unwrap();
    assert_eq!(me.row_pointers(), &[0, 6, 9]);
    assert_eq!(me.column_indices(), &[0, 1, 2, 4, 7, 9, 3, 5, 11]);
    assert_eq!(
        me.row_masks(),
        &[0x08, 0x01, 0x40, 0x13, 0x90, 0x08, 0x01, 0x03, 0x02]
    );
    assert_eq!(
        me.edge_to_slot().unwrap(),
        vec![8, 24, 25, 3, 43, 28, 36, 22, 39, 48, 56, 57, 65]
    );
    assert_eq!((me.n_vectors(), me.n_blocks(), me.n_slots()), (9, 2, 72));
    assert_eq!((me.blocks_in_window(0), me.blocks_in_window(1)), (1, 1));
    let stats = me.fill_stats();
    assert_eq!(
        (
            stats.windows,
            stats.blocks,
            stats.edges,
            stats.slots,
            stats.max_blocks_per_window
        ),
        (2, 2, 13, 128, 1)
    );
    assert_eq!(me.window_fills(), vec![9.0 / 64.0, 4.0 / 64.0]);

    let me4 = MeBcrs::from_csr(&a, 4).unwrap();
    assert_eq!((me4.blocks_in_window(0), me4.blocks_in_window(1)), (2, 1));
    let stats = me4.fill_stats();
    assert_eq!(
        (stats.blocks, stats.slots, stats.max_blocks_per_window),
        (3, 96, 2)
    );
    assert_eq!(me4.window_fill(0), 9.0 / 64.0);
    assert_eq!(me4.window_fill(1), 4.0 / 32.0);

    // Values land at their slots, zeros elsewhere.
    let vals: Vec<f32> = (1..=13).map(|x| x as f32).collect();
    let weighted = a.clone().with_values(Some(vals)).unwrap();
    let me = MeBcrs::from_csr(&weighted, 8).unwrap();
    let sv = me.values().unwrap();
    let map = me.edge_to_slot().unwrap();
    let mut expected = vec![0.0f32; 72];
    for (e, &s) in map.iter().enumerate() {
        expected[s as usize] = (e + 1) as f32;
    }
    assert_eq!(sv, &expected[..]);
    assert_eq!(sv[3], 4.0); // edge 3 = (3, 0): vector 0, row 3
    assert_eq!(me.to_csr().unwrap(), weighted);
    check_both(&a, true);
}

#[test]
fn bsb_hand_checked() {
    let a = example();
    let bsb = Bsb::from_csr(&a).unwrap();
    let p = Bsb::PADDING;
    assert_eq!(bsb.window_offsets(), &[0, 2]);
    assert_eq!(
        bsb.block_columns(),
        &[0, 1, 2, 3, 4, 5, 7, 9, 11, p, p, p, p, p, p, p]
    );
    let bits = |list: &[u32]| list.iter().fold(0u128, |m, &b| m | 1 << b);
    assert_eq!(
        bsb.bitmaps(),
        &[
            bits(&[1, 4, 12, 24, 31, 36, 38, 50, 62, 67, 69, 77]),
            bits(&[72])
        ]
    );
    assert_eq!(bsb.window_order(), &[0]);
    assert_eq!(
        bsb.edge_to_slot().unwrap(),
        vec![1, 4, 12, 24, 31, 36, 38, 50, 62, 67, 69, 77, 200]
    );
    let stats = bsb.fill_stats();
    assert_eq!(
        (
            stats.windows,
            stats.blocks,
            stats.edges,
            stats.slots,
            stats.max_blocks_per_window
        ),
        (1, 2, 13, 256, 2)
    );
    assert_eq!(bsb.window_fill(0), 13.0 / 256.0);
    let b0 = bsb.bitmaps()[0];
    assert_eq!(bsb.bitmap_words()[..2], [b0 as u64, (b0 >> 64) as u64]);
    assert_eq!(bsb.bitmap_words_u32()[4..], [0, 0, 1 << 8, 0]); // bit 72 = word 2, bit 8
}

#[test]
fn bsb_window_order() {
    // Window 0: 1 block; windows 1 and 2: 2 blocks; window 3: none; window 4 (partial): 1.
    let mut edges = vec![(0u32, 0u32)];
    edges.extend((0..9).map(|c| (16, c)));
    edges.extend((0..16).map(|c| (40, 2 * c)));
    edges.push((70, 5));
    let a = Csr::from_edges(71, 40, &edges).unwrap();
    let bsb = Bsb::from_csr(&a).unwrap();
    assert_eq!(bsb.window_offsets(), &[0, 1, 3, 5, 5, 6]);
    assert_eq!(bsb.window_order(), &[1, 2, 0, 4, 3]);
    assert_eq!(bsb.fill_stats().max_blocks_per_window, 2);
    assert_eq!(bsb.window_fill(3), 0.0);
    check_both(&a, true);
}

// ---------------------------------------------------------------------------------------------
// Edge shapes.
// ---------------------------------------------------------------------------------------------

#[test]
fn empty_and_degenerate_shapes() {
    for (r, c) in [
        (0, 0),
        (0, 5),
        (5, 0),
        (17, 0),
        (1, 1),
        (8, 8),
        (16, 16),
        (33, 3),
    ] {
        let a = Csr::empty(r, c).unwrap();
        check_both(&a, true);
        let me = MeBcrs::from_csr(&a, 8).unwrap();
        assert_eq!(
            (me.n_vectors(), me.n_blocks(), me.fill_stats().fill()),
            (0, 0, 0.0)
        );
        assert!(me.edge_to_slot().unwrap().is_empty());
        assert!(me.gather_to_csr_order::<f32>(&[]).unwrap().is_empty());
        let bsb = Bsb::from_csr(&a).unwrap();
        assert_eq!((bsb.n_blocks(), bsb.fill_stats().fill()), (0, 0.0));
        assert_eq!(bsb.window_order().len(), r.div_ceil(16));
    }
    // n = 1, with and without its self loop; identities of awkward sizes.
    check_both(&Csr::identity(1).unwrap(), true);
    for n in [1, 7, 9, 15, 17, 33] {
        let a = Csr::identity(n).unwrap();
        check_both(&a, true);
        let me = MeBcrs::from_csr(&a, 8).unwrap();
        assert_eq!(me.n_vectors(), n);
        assert!(me.row_masks().iter().all(|m| m.count_ones() == 1));
    }
}

#[test]
fn dense_rows_and_rectangles() {
    // A single dense row, alone and among empty rows.
    let dense: Vec<(u32, u32)> = (0..1000).map(|c| (0, c)).collect();
    check_both(&Csr::from_edges(1, 1000, &dense).unwrap(), true);
    let dense19: Vec<(u32, u32)> = (0..300).map(|c| (19, c)).collect();
    check_both(&Csr::from_edges(20, 300, &dense19).unwrap(), true);
    // A fully dense 24 × 24 block: every mask 0xff, every bitmap full.
    let full: Vec<(u32, u32)> = (0..24).flat_map(|r| (0..24).map(move |c| (r, c))).collect();
    let a = Csr::from_edges(24, 24, &full).unwrap();
    check_both(&a, true);
    let me = MeBcrs::from_csr(&a, 8).unwrap();
    assert!(me.row_masks().iter().all(|&m| m == 0xff));
    assert_eq!(me.fill_stats().fill(), 1.0);
    let bsb = Bsb::from_csr(&a).unwrap();
    assert_eq!(bsb.bitmaps()[..3], [u128::MAX; 3]);
    assert_eq!(bsb.bitmaps()[3..], [u128::MAX >> 64; 3]); // rows 16..24 only
                                                          // Wide and tall rectangles.
    let wide: Vec<(u32, u32)> = (0..50).map(|i| (i % 5, i * 997 % 5000)).collect();
    check_both(&Csr::from_edges(5, 5000, &wide).unwrap(), true);
    let tall: Vec<(u32, u32)> = (0..500).map(|i| (i * 7 % 1000, i % 3)).collect();
    check_both(&Csr::from_edges(1000, 3, &tall).unwrap(), true);
}

#[test]
fn hub_row_of_100k() {
    // Row 17 holds 10^5 entries; its neighbours share some of them.
    let n_cols = 150_000u32;
    let mut edges: Vec<(u32, u32)> = (0..100_000).map(|k| (17, k * 3 / 2)).collect();
    edges.extend((0..40).filter(|&r| r != 17).map(|r| (r, r * 1000)));
    edges.extend((0..2000).map(|k| (20, k * 7)));
    let a = Csr::from_edges(41, n_cols as usize, &edges).unwrap();
    assert_eq!(a.degree(17), 100_000);
    check_both(&a, true);
    let me = MeBcrs::from_csr(&a, 8).unwrap();
    assert!(me.vectors_in_window(2) >= 100_000);
    let bsb = Bsb::from_csr(&a).unwrap();
    assert_eq!(bsb.window_order()[0], 1);
    assert!(bsb.blocks_in_window(1) >= 100_000 / 8);
}

// ---------------------------------------------------------------------------------------------
// Validation errors.
// ---------------------------------------------------------------------------------------------

#[test]
fn block_width_must_be_4_or_8() {
    let a = example();
    for bw in [0usize, 1, 2, 3, 5, 6, 7, 9, 16, usize::MAX] {
        let is_param = |e: Error| {
            matches!(
                e,
                Error::InvalidParameter {
                    what: "block_width",
                    ..
                }
            )
        };
        assert!(is_param(MeBcrs::from_csr(&a, bw).unwrap_err()), "{bw}");
        let me = MeBcrs::from_csr(&a, 8).unwrap();
        assert!(is_param(me.with_block_width(bw).unwrap_err()));
        let err = MeBcrs::try_new(1, 1, bw, vec![0, 0], vec![], vec![], None).unwrap_err();
        assert!(is_param(err));
    }
    let msg = MeBcrs::from_csr(&a, 16).unwrap_err().to_string();
    assert!(msg.contains("block_width") && msg.contains("16"), "{msg}");
}

fn assert_length_mismatch<T: std::fmt::Debug>(r: Result<T, Error>, what: &str) {
    match r {
        Err(Error::LengthMismatch { what: w, .. }) if w == what => {}
        other => panic!("expected LengthMismatch for {what}, got {other:?}"),
    }
}

fn assert_layout<T: std::fmt::Debug>(r: Result<T, Error>, what: &str, index: usize, says: &str) {
    match r {
        Err(e @ Error::InvalidLayout { .. }) => {
            let Error::InvalidLayout {
                what: w, index: i, ..
            } = &e
            else {
                unreachable!()
            };
            assert_eq!((*w, *i), (what, index), "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains(says),
                "message {msg:?} should contain {says:?}"
            );
        }
        other => panic!("expected InvalidLayout at {what}[{index}], got {other:?}"),
    }
}

#[test]
fn slot_helpers_check_lengths() {
    let a = example();
    let me = MeBcrs::from_csr(&a, 8).unwrap();
    assert_length_mismatch(me.gather_to_csr_order(&[0u8; 71]), "slot data");
    assert_length_mismatch(me.scatter_to_slots(&[0u8; 12], 0), "edge data");
    let bsb = Bsb::from_csr(&a).unwrap();
    assert_length_mismatch(bsb.gather_to_csr_order(&[0u8; 255]), "slot data");
    assert_length_mismatch(bsb.scatter_to_slots(&[0u8; 14], 0), "edge data");
    assert!(bsb.gather_to_csr_order(&vec![1u8; 256]).is_ok());
}

/// A corruption of one array of a valid format, the index the error must name and a word of its
/// message.
type Corruption<T> = (fn(&mut Vec<T>), usize, &'static str);

#[test]
fn mebcrs_try_new_errors() {
    let me = MeBcrs::from_csr(&example(), 8).unwrap();
    let rp = me.row_pointers().to_vec();
    let ci = me.column_indices().to_vec();
    let rm = me.row_masks().to_vec();
    let vals: Vec<f32> = vec![0.0; 72];
    let build = |rp: Vec<u32>, ci: Vec<u32>, rm: Vec<u8>, v: Option<Vec<f32>>| {
        MeBcrs::try_new(10, 12, 8, rp, ci, rm, v)
    };
    assert!(build(rp.clone(), ci.clone(), rm.clone(), None).is_ok());

    // Dimensions.
    let too_big = MeBcrs::try_new(usize::MAX, 1, 8, vec![], vec![], vec![], None);
    assert!(matches!(
        too_big,
        Err(Error::DimensionTooLarge { what: "n_rows", .. })
    ));
    let too_big = MeBcrs::try_new(0, usize::MAX, 8, vec![0], vec![], vec![], None);
    assert!(matches!(
        too_big,
        Err(Error::DimensionTooLarge { what: "n_cols", .. })
    ));
    // Lengths.
    assert_length_mismatch(
        build(vec![0, 9], ci.clone(), rm.clone(), None),
        "row_pointers",
    );
    assert_length_mismatch(
        build(rp.clone(), ci.clone(), rm[..8].to_vec(), None),
        "row_masks",
    );
    assert_length_mismatch(
        build(rp.clone(), ci.clone(), rm.clone(), Some(vec![0.0; 71])),
        "values",
    );
    // Pointers.
    for (pointers, at, says) in [
        (vec![1, 6, 9], 0, "first"),
        (vec![0, 10, 9], 2, "decrease"),
        (vec![0, 6, 8], 2, "last"),
    ] {
        let r = build(pointers, ci.clone(), rm.clone(), None);
        assert_layout(r, "row_pointers", at, says);
    }
    // Columns.
    let columns: [Corruption<u32>; 3] = [
        (|c| c[7] = 12, 7, "out of bounds"),
        (|c| c.swap(1, 2), 2, "increasing"),
        (|c| c[4] = c[3], 4, "increasing"),
    ];
    for (corrupt, at, says) in columns {
        let mut bad = ci.clone();
        corrupt(&mut bad);
        assert_layout(
            build(rp.clone(), bad, rm.clone(), None),
            "column_indices",
            at,
            says,
        );
    }
    // A window may start below the previous window's last column.
    assert_eq!(ci[5..7], [9, 3]);
    // Masks (row 10 does not exist).
    let masks: [Corruption<u8>; 2] = [
        (|m| m[5] = 0, 5, "is 0"),
        (|m| m[8] |= 0x04, 8, "past the last row"),
    ];
    for (corrupt, at, says) in masks {
        let mut bad = rm.clone();
        corrupt(&mut bad);
        assert_layout(
            build(rp.clone(), ci.clone(), bad, None),
            "row_masks",
            at,
            says,
        );
    }
    // Values at unmasked slots.
    let mut bad = vals.clone();
    bad[8] = 1.0; // vector 1, row 0: an edge
    assert!(build(rp.clone(), ci.clone(), rm.clone(), Some(bad)).is_ok());
    let mut bad = vals.clone();
    bad[9] = 1.0; // vector 1, row 1: no edge
    assert_layout(
        build(rp.clone(), ci.clone(), rm.clone(), Some(bad)),
        "values",
        9,
        "clear",
    );
}

#[test]
fn bsb_try_new_errors() {
    let bsb = Bsb::from_csr(&example()).unwrap();
    let wo = bsb.window_offsets().to_vec();
    let bc = bsb.block_columns().to_vec();
    let bm = bsb.bitmaps().to_vec();
    let build = |wo: Vec<u32>, bc: Vec<u32>, bm: Vec<u128>, v: Option<Vec<f32>>| {
        Bsb::try_new(10, 12, wo, bc, bm, v)
    };
    assert!(build(wo.clone(), bc.clone(), bm.clone(), Some(vec![1.0; 13])).is_ok());

    let too_big = Bsb::try_new(usize::MAX, 1, vec![], vec![], vec![], None);
    assert!(matches!(
        too_big,
        Err(Error::DimensionTooLarge { what: "n_rows", .. })
    ));
    let too_big = Bsb::try_new(0, usize::MAX, vec![0], vec![], vec![], None);
    assert!(matches!(
        too_big,
        Err(Error::DimensionTooLarge { what: "n_cols", .. })
    ));
    assert_length_mismatch(
        build(vec![0, 1, 2], bc.clone(), bm.clone(), None),
        "window_offsets",
    );
    assert_length_mismatch(
        build(wo.clone(), bc[..15].to_vec(), bm.clone(), None),
        "block_columns",
    );
    assert_length_mismatch(
        build(wo.clone(), bc.clone(), bm.clone(), Some(vec![1.0; 12])),
        "values",
    );
    assert_layout(
        build(vec![1, 2], bc.clone(), bm.clone(), None),
        "window_offsets",
        0,
        "first",
    );
    assert_layout(
        build(vec![0, 1], bc.clone(), bm.clone(), None),
        "window_offsets",
        1,
        "last",
    );
    // Decreasing offsets need two windows.
    let two = |wo: Vec<u32>| Bsb::try_new(20, 12, wo, bc.clone(), bm.clone(), None);
    assert_layout(two(vec![0, 3, 2]), "window_offsets", 2, "decrease");

    // Columns: out of bounds, unsorted, duplicated. Padding: before a real slot, in a block
    // that is not the window's last, a block of padding. Bitmaps: a real slot with no bit, a
    // bit on a row past the end.
    type Corrupt = fn(&mut Vec<u32>, &mut Vec<u128>);
    let cases: [(Corrupt, &str, usize, &str); 9] = [
        (|c, _| c[8] = 12, "block_columns", 8, "out of bounds"),
        (|c, _| c[8] = 9, "block_columns", 8, "increasing"),
        (|c, _| c.swap(2, 3), "block_columns", 3, "increasing"),
        (|c, _| c.swap(8, 9), "bitmaps", 1, "padding slot 0"),
        (
            |c, m| {
                c[8..10].copy_from_slice(&[Bsb::PADDING, 11]);
                m[1] = 1 << 73; // row 9, slot 1
            },
            "block_columns",
            9,
            "follows a padding",
        ),
        (
            |c, m| {
                c[7] = Bsb::PADDING;
                m[0] &= !(1 << 31);
            },
            "block_columns",
            7,
            "not the window's last",
        ),
        (
            |c, m| {
                c[8] = Bsb::PADDING;
                *m = vec![m[0], 0];
            },
            "block_columns",
            8,
            "all padding",
        ),
        (|_, m| m[1] = 0, "bitmaps", 1, "no edge"),
        (
            |_, m| m[1] |= 1 << (10 * 8),
            "bitmaps",
            1,
            "past the last row",
        ), // row 10, slot 0
    ];
    for (corrupt, what, at, says) in cases {
        let (mut bad, mut bad_bm) = (bc.clone(), bm.clone());
        corrupt(&mut bad, &mut bad_bm);
        assert_layout(build(wo.clone(), bad, bad_bm, None), what, at, says);
    }
}

#[test]
fn edge_map_overflow_is_typed() {
    // The u32 slot limit itself is unit-tested inside the crate (a real overflow needs more than
    // 2^25 BSB blocks); here, just the largest maps that must still succeed on small inputs.
    let a = Csr::identity(64).unwrap();
    assert!(Bsb::from_csr(&a).unwrap().edge_to_slot().is_ok());
    assert!(MeBcrs::from_csr(&a, 4).unwrap().edge_to_slot().is_ok());
}

// ---------------------------------------------------------------------------------------------
// Property tests.
// ---------------------------------------------------------------------------------------------

/// A random pattern: any shape up to 70 × 70 (so never-aligned windows), clustered or uniform
/// columns, some empty rows, optional values.
fn arb_csr() -> impl Strategy<Value = Csr> {
    (
        0usize..70,
        0usize..70,
        0usize..600,
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(n_rows, n_cols, n_edges, with_values, clustered, seed)| {
            let mut state = seed | 1;
            let mut next = move || {
                // xorshift64*: deterministic from the seed, good enough to spread entries.
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11
            };
            if n_rows == 0 || n_cols == 0 {
                return Csr::empty(n_rows, n_cols).unwrap();
            }
            let mut rows = Vec::new();
            let mut cols = Vec::new();
            for _ in 0..n_edges {
                let r = next() as usize % n_rows;
                // Leave every third row empty in the clustered case, and cluster columns near
                // the row so windows share them.
                let r = if clustered && r % 3 == 0 {
                    (r + 1) % n_rows
                } else {
                    r
                };
                let c = if clustered {
                    (r + (next() as usize % 9)) % n_cols
                } else {
                    next() as usize % n_cols
                };
                rows.push(r as u32);
                cols.push(c as u32);
            }
            let vals: Vec<f32> = (0..rows.len())
                .map(|_| (next() % 1000) as f32 - 500.0)
                .collect();
            Csr::from_unsorted(
                n_rows,
                n_cols,
                &rows,
                &cols,
                with_values.then_some(&vals[..]),
            )
            .unwrap()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn prop_mebcrs_round_trip(a in arb_csr()) {
        check_mebcrs(&a, true);
    }

    #[test]
    fn prop_bsb_round_trip(a in arb_csr()) {
        check_bsb(&a, true);
    }

    #[test]
    fn prop_try_new_rejects_broken_masks(a in arb_csr(), pick in any::<prop::sample::Index>()) {
        // Clearing any one mask (or bitmap) breaks the "no empty vector/block" invariant.
        let me = MeBcrs::from_csr(&a, 8).unwrap();
        if me.n_vectors() > 0 {
            let v = pick.index(me.n_vectors());
            let mut masks = me.row_masks().to_vec();
            masks[v] = 0;
            let r = MeBcrs::try_new(a.n_rows(), a.n_cols(), 8, me.row_pointers().to_vec(),
                me.column_indices().to_vec(), masks, None);
            let ok = matches!(r, Err(Error::InvalidLayout { what: "row_masks", index, .. }) if index == v);
            prop_assert!(ok);
        }
        let bsb = Bsb::from_csr(&a).unwrap();
        if bsb.n_blocks() > 0 {
            let b = pick.index(bsb.n_blocks());
            let mut maps = bsb.bitmaps().to_vec();
            maps[b] = 0;
            let r = Bsb::try_new(a.n_rows(), a.n_cols(), bsb.window_offsets().to_vec(),
                bsb.block_columns().to_vec(), maps, None);
            let ok = matches!(r, Err(Error::InvalidLayout { what: "bitmaps", index, .. }) if index == b);
            prop_assert!(ok);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Real graphs and R-MAT.
// ---------------------------------------------------------------------------------------------

#[test]
fn cora_round_trip() {
    let path = spattn_test_support::cora_path();
    let a = spattn_formats::read_matrix_market(&path).unwrap();
    assert_eq!((a.n_rows(), a.nnz()), (2708, 10556));
    check_both(&a, true);
    let a = a.symmetrize_with_self_loops().unwrap();
    assert_eq!(a.nnz(), 13264);
    check_both(&a, true);
}

#[test]
fn shared_graphs_round_trip() {
    let Some(dir) = spattn_test_support::shared_data_root().map(|r| r.join("mtx")) else {
        eprintln!("note: ../shared/data not found, skipping the shared graphs");
        return;
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!(
            "note: {} unreadable, skipping the shared graphs",
            dir.display()
        );
        return;
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".mtx.gz"))
        .collect();
    paths.sort();
    // In debug builds the naive reference is only run on the small graphs, and the weighted
    // variant is skipped on the largest (values are covered everywhere else); every graph still
    // gets every invariant, round trip and edge-map check.
    let (naive_limit, weighted_limit) = if cfg!(debug_assertions) {
        (150_000, 500_000)
    } else {
        (usize::MAX, usize::MAX)
    };
    for path in paths {
        let a = spattn_formats::read_matrix_market(&path)
            .unwrap()
            .symmetrize_with_self_loops()
            .unwrap();
        let t = std::time::Instant::now();
        if a.nnz() <= weighted_limit {
            check_both(&a, a.nnz() <= naive_limit);
        } else {
            check_mebcrs(&a, false);
            check_bsb(&a, false);
        }
        eprintln!(
            "{}: n = {}, nnz = {}, checked in {:.2?}",
            path.display(),
            a.n_rows(),
            a.nnz(),
            t.elapsed()
        );
    }
}

#[test]
fn rmat_round_trip() {
    let scales: &[u32] = if cfg!(debug_assertions) {
        &[8, 12]
    } else {
        &[8, 12, 16]
    };
    for &scale in scales {
        for seed in [1, 2] {
            let a = rmat(&RmatConfig::benchmark(scale).with_seed(seed)).unwrap();
            check_both(&a, scale <= 12);
        }
    }
}
