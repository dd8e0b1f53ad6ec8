//! The fused tensor-core kernel's tests: CPU checks of the layouts, the schedules, the
//! prologue records and the row orders, and a GPU check (ignored without a GPU) of the phased
//! forward.

use super::schedule::{MAX_PARTS, MIN_CHUNK, NONE};
use super::*;
use crate::device_bsb::BsbLayout;
use crate::rows::vec_padded;
use spattn_formats::{Bsb, Csr, RowOrder};

/// Deterministic f16 operands in [-1, 1) of `shape` on `gpu`, one pattern per seed.
pub(super) fn draw_f16(gpu: &Gpu, shape: crate::Shape, seed: usize) -> DeviceMatrix<half::f16> {
    let host: Vec<half::f16> = (0..shape.len())
        .map(|i| {
            let x = (i * 7919 + seed * 104_729) % 1000;
            half::f16::from_f32(x as f32 / 500.0 - 1.0)
        })
        .collect();
    DeviceMatrix::from_host(gpu, shape, &host).unwrap()
}

/// A `rows × cols` graph whose row 5 is a hub (every column) and row 7 empty; every other row
/// has `per_row` columns drawn from `seed` (repeats merged) and, where `hub_column`, column 9.
pub(crate) fn hub_graph(
    rows: usize,
    cols: usize,
    per_row: usize,
    seed: u64,
    hub_column: bool,
) -> Csr {
    let mut edges: Vec<(u32, u32)> = (0..cols as u32).map(|c| (5, c)).collect();
    let mut x = seed;
    for r in (0..rows as u32).filter(|&r| r != 7) {
        if hub_column {
            edges.push((r, 9));
        }
        for _ in 0..per_row {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            edges.push((r, ((x >> 33) % cols as u64) as u32));
        }
    }
    edges.sort_unstable();
    edges.dedup();
    Csr::from_edges(rows, cols, &edges).unwrap()
}

#[test]
fn heads_pad_to_whole_16_byte_vectors() {
    for (d, bytes, want) in [(1, 2, 8), (8, 2, 8), (20, 2, 24), (100, 2, 104), (3, 4, 4)] {
        assert_eq!(vec_padded(d, bytes), want, "{d} elements of {bytes} bytes");
    }
    for dtype in DTypeKind::ALL {
        for d in 1..=520 {
            let Ok(l) = layout_with(d, dtype, None, false) else {
                continue; // past the widest head of the dtype
            };
            let dp = vec_padded(d, dtype.size_bytes());
            // The padded head fits the layout's warps, and is the head itself where it is
            // whole vectors already.
            assert!(
                dp <= l.padded() && (dp * dtype.size_bytes()) % 16 == 0,
                "{dtype} {d}"
            );
            assert_eq!(dp == d, (d * dtype.size_bytes()) % 16 == 0, "{dtype} {d}");
        }
    }
}

#[test]
fn layouts_cover_the_head_with_least_padding() {
    for dtype in DTypeKind::ALL {
        for d in [1, 3, 8, 24, 64, 96, 100, 128, 200, 256, 512] {
            let l = layout_with(d, dtype, None, false).unwrap();
            assert!(
                l.padded() >= d && l.group <= MAX_GROUP_WARPS,
                "{dtype} d={d}"
            );
            let fewest = d.div_ceil(*slices(dtype).iter().max().unwrap());
            assert_eq!(l.group, fewest, "{dtype} d={d}: {l:?}");
            kernel_name(dtype.name(), l).unwrap();
        }
    }
    let l = layout_with(128, DTypeKind::F16, None, false).unwrap();
    assert_eq!((l.slice, l.group, l.pipelined), (128, 1, false));
    for (d, dtype, pipelined) in [
        (128, DTypeKind::F16, true),
        (64, DTypeKind::Bf16, true),
        (96, DTypeKind::F16, false),
        (256, DTypeKind::F16, false),
        (128, DTypeKind::F32, false),
    ] {
        let l = layout_with(d, dtype, None, true).unwrap();
        assert_eq!(l.pipelined, pipelined, "{dtype} d={d}");
        if pipelined {
            assert_eq!((l.slice, l.group), (d, 1));
        }
        kernel_name(dtype.name(), l).unwrap();
    }
    // A slice asked for (tuning) runs the register kernel.
    assert!(
        !layout_with(128, DTypeKind::F16, Some(128), true)
            .unwrap()
            .pipelined
    );
    // Two CTAs of 4 warps with 128-feature stages fit an H100 SM's 228 KiB.
    assert!(2 * CTA_WARPS * bsb_pipe_warp_bytes(128, false, 0) <= 228 * 1024);
    assert!(PIPE_CTA_WARPS * bsb_pipe_warp_bytes(128, false, 0) > 48 * 1024);
    // The `_x` kernels' staged extras keep 8 warps of 128 features per H100 SM (4 CTAs of
    // PIPE_CTA_WARPS, each reserving 1 KiB of the SM's 228 KiB), as the plain kernel has;
    // at 64 features the dropout-only kernel keeps the plain kernel's 8 CTAs of 2 warps,
    // those with a bias 7.
    let sm = |warps_per_cta: usize, head_dim: usize, x: usize, ctas: usize| {
        ctas * (warps_per_cta * bsb_pipe_warp_bytes(head_dim, false, x) + 1024) <= 228 * 1024
    };
    for (bias, dropout) in [(true, false), (false, true), (true, true)] {
        let x = bsb_pipe_x_bytes(bias, dropout);
        assert!(sm(PIPE_CTA_WARPS, 128, x, 8 / PIPE_CTA_WARPS));
        let ctas64 = if bias { 7 } else { 8 };
        assert!(sm(PIPE_CTA_WARPS, 64, x, ctas64) && !sm(PIPE_CTA_WARPS, 64, x, ctas64 + 1));
    }
    let l = layout_with(24, DTypeKind::Bf16, None, false).unwrap();
    assert_eq!((l.slice, l.group), (32, 1));
    let l = layout_with(96, DTypeKind::Bf16, None, false).unwrap();
    assert_eq!((l.slice, l.group), (128, 1));
    let l = layout_with(256, DTypeKind::F32, None, false).unwrap();
    assert_eq!((l.slice, l.group), (64, 4));
    assert!(FusedTensorCore::supports(1024, DTypeKind::F16).is_ok());
    assert!(matches!(
        FusedTensorCore::supports(1025, DTypeKind::F16),
        Err(Error::Unsupported { .. })
    ));
    assert!(FusedTensorCore::supports(512, DTypeKind::F32).is_ok());
    assert!(FusedTensorCore::supports(513, DTypeKind::F32).is_err());
    assert!(FusedTensorCore::supports(0, DTypeKind::F32).is_err());
    assert!(layout_with(64, DTypeKind::F32, Some(128), false).is_err());
}

#[test]
fn edge_features_take_the_pipelined_layouts_and_say_why_not_elsewhere() {
    for (hd, dtype) in [(64, DTypeKind::F16), (128, DTypeKind::Bf16)] {
        let l = layout_with(hd, dtype, None, true).unwrap();
        check_feature_layout(l, dtype, hd).unwrap();
        assert_eq!(
            feature_kernel(kernel_name(dtype.name(), l).unwrap()),
            format!("fused_bsb_{}_d{hd}_pipe_xf", dtype.name())
        );
    }
    // The same head with pipelining off, another head, f32: refused, saying which and naming
    // the kernel that takes them.
    let off = layout_with(64, DTypeKind::F16, None, false).unwrap();
    for (l, dtype, hd, says) in [
        (off, DTypeKind::F16, 64, "register kernels"),
        (
            layout_with(32, DTypeKind::F16, None, true).unwrap(),
            DTypeKind::F16,
            32,
            "head of 32",
        ),
        (
            layout_with(64, DTypeKind::F32, None, true).unwrap(),
            DTypeKind::F32,
            64,
            "f32 head",
        ),
    ] {
        let e = check_feature_layout(l, dtype, hd).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains("fused-csr"), "{e}");
    }
}

#[test]
fn schedule_covers_every_block_once_largest_first() {
    // Window 0: a hub row with 300 columns; window 1: empty; window 2: 3 rows of 5.
    let mut edges: Vec<(u32, u32)> = (0..300).map(|c| (3, c)).collect();
    for r in 32..35 {
        edges.extend((0..5).map(|c| (r, c * 7)));
    }
    let a = Csr::from_edges(40, 300, &edges).unwrap();
    let bsb = Bsb::from_csr(&a).unwrap();
    assert_eq!(bsb.window_blocks(0).len(), 38);
    let s = Schedule::new(&BsbLayout::of(&bsb), 16).unwrap();
    // 38 blocks in units of 16: 3 parts; windows 1 and 2 whole.
    assert_eq!(s.n_units(), 5);
    assert_eq!(s.n_split(), 1);
    assert_eq!(s.n_parts(), 3);
    assert_eq!(s.split_part_first, vec![0, 3]);
    let units: Vec<[u32; 4]> = s
        .units
        .chunks(4)
        .map(|u| [u[0], u[1], u[2], u[3]])
        .collect();
    let sizes: Vec<u32> = units.iter().map(|u| u[2] - u[1]).collect();
    assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{sizes:?}");
    let mut covered = vec![0u32; bsb.n_blocks()];
    for u in &units {
        for b in u[1]..u[2] {
            covered[b as usize] += 1;
        }
    }
    assert!(covered.iter().all(|&c| c == 1));
    // The empty window still has its unit (it writes zeros).
    assert!(units.iter().any(|u| u[0] == 1 && u[1] == u[2]));
    let parts: Vec<u32> = units
        .iter()
        .zip(&s.unit_split)
        .filter(|(_, &sp)| sp != NONE)
        .map(|(u, _)| u[3])
        .collect();
    assert_eq!(parts.len(), 3);
    // A chunk of 2 blocks is raised to MIN_CHUNK; parts are capped at MAX_PARTS.
    assert_eq!(
        Schedule::new(&BsbLayout::of(&bsb), 2).unwrap(),
        Schedule::new(&BsbLayout::of(&bsb), MIN_CHUNK).unwrap()
    );
    let wide: Vec<(u32, u32)> = (0..20_000).map(|c| (0, c)).collect();
    let hub = Bsb::from_csr(&Csr::from_edges(1, 20_000, &wide).unwrap()).unwrap();
    let s = Schedule::new(&BsbLayout::of(&hub), 16).unwrap();
    assert!(s.n_parts() <= MAX_PARTS && s.n_parts() > 1);
}

#[test]
fn phased_schedule_runs_own_blocks_first_and_every_block_once() {
    // 64 rows × 2,000 columns; own columns 700..1300. Window 0: a hub row over every
    // column; window 1: only own columns; window 2: only remote; window 3: empty.
    let mut edges: Vec<(u32, u32)> = (0..2000).map(|c| (3, c)).collect();
    edges.extend((0..40).map(|c| (17, 800 + 3 * c)));
    edges.extend((0..40).map(|c| (33, 5 * c)));
    let a = Csr::from_edges(64, 2000, &edges).unwrap();
    let bsb = Bsb::from_csr(&a).unwrap();
    let own = 700u32..1300;
    let columns = bsb.block_columns();
    let real = |b: usize| {
        columns[b * 8..b * 8 + 8]
            .iter()
            .copied()
            .filter(|&c| c != Bsb::PADDING)
    };
    for chunk in [4, 16, 1000] {
        let (s, first) = Schedule::phased(&bsb, chunk, own.clone()).unwrap();
        let units: Vec<[u32; 4]> = s
            .units
            .chunks(4)
            .map(|u| [u[0], u[1], u[2], u[3]])
            .collect();
        let mut covered = vec![0u32; bsb.n_blocks()];
        for (i, u) in units.iter().enumerate() {
            let range = u[1] as usize..u[2] as usize;
            for (b, c) in covered
                .iter_mut()
                .enumerate()
                .take(range.end)
                .skip(range.start)
            {
                *c += 1;
                let all_own = real(b).all(|c| own.contains(&c));
                // Phase 0 holds exactly the blocks whose columns are all own.
                assert_eq!(i < first, all_own, "chunk {chunk}, unit {i}, block {b}");
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "chunk {chunk}");
        // Each split window's parts are numbered once, from either phase.
        let mut parts: Vec<u32> = units
            .iter()
            .zip(&s.unit_split)
            .filter(|(_, &sp)| sp != NONE)
            .map(|(u, _)| u[3])
            .collect();
        parts.sort_unstable();
        assert!(
            parts.iter().copied().eq(0..s.n_parts() as u32),
            "chunk {chunk}"
        );
        for w in s.split_part_first.windows(2) {
            assert!(w[1] - w[0] >= 2 && (w[1] - w[0]) as usize <= MAX_PARTS);
        }
        // The hub window mixes phases, so it is split whatever the chunk; the own-only and
        // remote-only windows are whole once the chunk holds them.
        assert!(s.n_split() >= 1);
        if chunk == 1000 {
            assert_eq!(s.n_split(), 1, "{:?}", s.split_part_first);
            assert!(units.iter().any(|u| u[0] == 3 && u[1] == u[2]));
        }
    }
    // Everything own: one phase.
    let (s, first) = Schedule::phased(&bsb, 16, 0..2000).unwrap();
    assert_eq!(first, s.n_units());
    // A 20,000-column hub row is capped at MAX_PARTS parts.
    let wide: Vec<(u32, u32)> = (0..20_000).map(|c| (0, c)).collect();
    let hub = Bsb::from_csr(&Csr::from_edges(1, 20_000, &wide).unwrap()).unwrap();
    let (s, first) = Schedule::phased(&hub, 4, 5_000..15_000).unwrap();
    assert!(s.n_parts() <= MAX_PARTS && first > 0 && first < s.n_units());
}

#[test]
fn prologue_records_hold_the_first_two_steps_and_the_caller_rows() {
    // Window 0: row 3 with 20 columns (3 blocks); window 1 (rows 16..18 of 18): 1 block.
    let mut edges: Vec<(u32, u32)> = (0..20).map(|c| (3, c * 2)).collect();
    edges.extend([(16, 5), (17, 6)]);
    let a = Csr::from_edges(18, 40, &edges).unwrap();
    let bsb = Bsb::from_csr(&a).unwrap();
    let s = Schedule::new(&BsbLayout::of(&bsb), 16).unwrap();
    let ids: Vec<u32> = (0..18).rev().collect();
    for row_ids in [None, Some(&ids[..])] {
        let pre = s.prologue(&bsb, row_ids);
        assert_eq!(pre.len(), s.n_units() * PRE_WORDS);
        for (u, rec) in s.units.chunks(4).zip(pre.chunks(PRE_WORDS)) {
            let (w, first, end) = (u[0] as usize, u[1] as usize, u[2] as usize);
            for (j, &got) in rec[..32].iter().enumerate() {
                let blk = first + 2 * (j / 16) + (j % 16) / 8;
                let want = if blk < end {
                    bsb.block_columns()[blk * 8 + j % 8]
                } else {
                    NONE
                };
                assert_eq!(got, want, "unit {u:?} word {j}");
            }
            for r in 0..16 {
                let row = w * 16 + r;
                let want = match row_ids {
                    _ if row >= 18 => NONE,
                    Some(ids) => ids[row],
                    None => row as u32,
                };
                assert_eq!(rec[32 + r], want, "window {w} row {r}");
            }
        }
        // Window 0's unit: its first two steps cover blocks 0..3, all 16 slots of step 0.
        let w0 = s.units.chunks(4).position(|u| u[0] == 0).unwrap();
        let rec = &pre[w0 * PRE_WORDS..(w0 + 1) * PRE_WORDS];
        assert!(rec[..16].iter().all(|&c| c != NONE));
        // Window 1's unit: one block, so step 1 is all NONE, rows 18.. are NONE.
        let w1 = s.units.chunks(4).position(|u| u[0] == 1).unwrap();
        let rec = &pre[w1 * PRE_WORDS..(w1 + 1) * PRE_WORDS];
        assert!(rec[16..32].iter().all(|&c| c == NONE));
        assert!(rec[32 + 2..].iter().all(|&r| r == NONE));
    }
}

#[test]
fn row_order_follows_the_request_and_auto_counts_gathers() {
    // A 24 × 24 grid numbered column-major in pairs of rows scrambled: a locality order
    // gathers fewer rows than the scrambled one.
    let (w, h) = (24u32, 24u32);
    let mut edges = Vec::new();
    for y in 0..h {
        for x in 0..w {
            let i = (x * 7919 + y * 104_729) % (w * h);
            let right = ((x + 1) % w * 7919 + y * 104_729) % (w * h);
            let down = (x * 7919 + (y + 1) % h * 104_729) % (w * h);
            edges.extend([(i, right), (i, down)]);
        }
    }
    let n = (w * h) as usize;
    let a = Csr::from_edges(n, n, &edges)
        .unwrap()
        .symmetrize_with_self_loops()
        .unwrap();
    let none = RowOrder::choose(&a, Reorder::None, WINDOW_ROWS).unwrap();
    assert!(none.permutation.is_none());
    assert_eq!(none.gathers, none.gathers_natural);
    let loc = RowOrder::choose(&a, Reorder::Locality, WINDOW_ROWS).unwrap();
    assert_eq!(loc.used, Reorder::Locality);
    assert!(loc.gathers < none.gathers, "{loc:?}");
    let auto = RowOrder::choose(&a, Reorder::Auto, WINDOW_ROWS).unwrap();
    assert_ne!(auto.used, Reorder::None);
    assert!(auto.gathers <= loc.gathers);
    assert!(auto.info().contains("-ordered"), "{}", auto.info());
    // A rectangular graph: the bipartite locality order when asked; Auto keeps its own
    // order where one window holds every row (nothing to save).
    let r = Csr::from_edges(3, 5, &[(0, 4), (2, 1), (2, 3)]).unwrap();
    let rl = RowOrder::choose(&r, Reorder::Locality, WINDOW_ROWS).unwrap();
    assert_eq!(rl.used, Reorder::Locality);
    assert_eq!(rl.gathers, rl.gathers_natural);
    assert_eq!(
        RowOrder::choose(&r, Reorder::Auto, WINDOW_ROWS)
            .unwrap()
            .used,
        Reorder::None
    );
    let d = RowOrder::choose(&r, Reorder::Degree, WINDOW_ROWS).unwrap();
    assert_eq!(d.used, Reorder::Degree);
    assert_eq!(d.permutation.unwrap().old_of_new()[0], 2);
}

/// A rank-like rectangular graph (its rows × 1,000 halo columns, own columns 400..700)
/// in two phases gives the one-launch forward's output, twice in a row (the split windows'
/// counters are left at 0), with and without a row order, on the register and the
/// pipelined kernels (the 128-feature one reads the unit records through the phase's view).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_phased_forward_equals_the_one_launch_forward() {
    use crate::Shape;
    let gpu = Gpu::new(0).expect("an NVIDIA GPU");
    let (rows, cols) = (300u32, 1000u32);
    let mut edges: Vec<(u32, u32)> = (0..cols).map(|c| (5, c)).collect(); // a hub row
    let mut x = 12345u64;
    for r in 0..rows {
        for _ in 0..12 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            // Mostly near the row's own column, some anywhere (the halo).
            let c = if (x >> 60) < 12 {
                (400 + r + ((x >> 33) % 40) as u32) % cols
            } else {
                ((x >> 33) % u64::from(cols)) as u32
            };
            edges.push((r, c));
        }
    }
    edges.sort_unstable();
    edges.dedup();
    let a = Csr::from_edges(rows as usize, cols as usize, &edges).unwrap();
    for reorder in [Reorder::None, Reorder::Locality] {
        let ordered = Arc::new(OrderedBsb::upload(&gpu, &a, reorder).unwrap());
        // (3, 20): heads of 40 bytes, padded to whole 16-byte vectors around each phase.
        for (heads, d) in [(2, 64), (1, 128), (3, 20)] {
            let draw =
                |n: usize, seed: usize| draw_f16(&gpu, Shape::new(n, heads, d).unwrap(), seed);
            let (q, k, v) = (
                draw(rows as usize, 1),
                draw(cols as usize, 2),
                draw(cols as usize, 3),
            );
            let sq = Shape::new(rows as usize, heads, d).unwrap();
            let scale = 1.0 / (d as f32).sqrt();
            let mut plain = FusedTensorCore::with_options::<half::f16>(
                &gpu,
                ordered.clone(),
                heads,
                d,
                Options::default(),
            )
            .unwrap();
            let mut want = DeviceMatrix::zeros(&gpu, sq).unwrap();
            plain.forward(&gpu, &q, &k, &v, scale, &mut want).unwrap();
            let want = want.to_host().unwrap();
            let options = Options {
                own_columns: Some((400, 700)),
                chunk: Some(4),
                ..Options::default()
            };
            let mut phased = FusedTensorCore::with_options::<half::f16>(
                &gpu,
                ordered.clone(),
                heads,
                d,
                options,
            )
            .unwrap();
            assert!(phased.phase0_units > 0 && phased.phase0_units < phased.n_units);
            // Phase 0 sees only the own rows (400..700) of K and V, the others NaN, as in a
            // halo still being received: a read of any of them would poison the output.
            let own_only = |m: &DeviceMatrix<half::f16>| {
                let row = heads * d;
                let mut h = m.to_host().unwrap();
                for (r, x) in h.chunks_mut(row).enumerate() {
                    if !(400..700).contains(&r) {
                        x.fill(half::f16::NAN);
                    }
                }
                DeviceMatrix::from_host(&gpu, m.shape(), &h).unwrap()
            };
            let (k0, v0) = (own_only(&k), own_only(&v));
            for round in 0..2 {
                let mut got = DeviceMatrix::zeros(&gpu, sq).unwrap();
                got.fill_nan().unwrap();
                phased
                    .forward_phase(&gpu, (&q, &k0, &v0), scale, 0, &mut got)
                    .unwrap();
                phased
                    .forward_phase(&gpu, (&q, &k, &v), scale, 1, &mut got)
                    .unwrap();
                let got = got.to_host().unwrap();
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for (g, w) in got.iter().zip(&want) {
                    let (g, w) = (g.to_f64(), w.to_f64());
                    num += (g - w) * (g - w);
                    den += w * w;
                }
                let err = (num / den.max(1e-30)).sqrt();
                // Only the split windows' merge order differs: f16 rounding of the output.
                assert!(
                    err <= 2e-3,
                    "{reorder:?} H{heads} D{d} round {round}: rel L2 {err:e}"
                );
            }
            assert!(phased
                .forward_phase(
                    &gpu,
                    (&q, &k, &v),
                    scale,
                    2,
                    &mut DeviceMatrix::zeros(&gpu, sq).unwrap()
                )
                .is_err());
        }
    }
}

/// `forward_with_lse` writes each caller row's log2-domain log-sum-exp (0 for a row without
/// edges) beside the plain forward's output, bit for bit: on the pipelined kernel's `_lse`
/// twin (64 features), the register kernels (20 padded, 32, 48) and a hub row's split windows
/// (their merge), in the graph's row order and renumbered; and refuses an `lse` of another
/// length, and one from the 128-feature pipelined kernel (no twin).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_forward_with_lse_writes_each_rows_log_sum_exp() {
    use crate::Shape;
    let gpu = Gpu::new(0).expect("an NVIDIA GPU");
    let (rows, cols) = (300usize, 1000usize);
    let a = hub_graph(rows, cols, 10, 987, false);
    for reorder in [Reorder::None, Reorder::Degree] {
        let ordered = Arc::new(OrderedBsb::upload(&gpu, &a, reorder).unwrap());
        for (heads, d) in [(2, 64), (1, 128), (3, 20), (2, 32), (1, 48)] {
            let draw = |n, seed| draw_f16(&gpu, Shape::new(n, heads, d).unwrap(), seed);
            let (q, k, v) = (draw(rows, 4), draw(cols, 5), draw(cols, 6));
            let sq = Shape::new(rows, heads, d).unwrap();
            let scale = 1.0 / (d as f32).sqrt();
            let mut f = FusedTensorCore::with_options::<half::f16>(
                &gpu,
                ordered.clone(),
                heads,
                d,
                Options::default(),
            )
            .unwrap();
            let mut plain = DeviceMatrix::zeros(&gpu, sq).unwrap();
            f.forward(&gpu, &q, &k, &v, scale, &mut plain).unwrap();
            let mut out = DeviceMatrix::zeros(&gpu, sq).unwrap();
            let mut lse = DeviceVec::<f32>::zeros(&gpu, rows * heads).unwrap();
            let kept = f.forward_with_lse(&gpu, &q, &k, &v, scale, &mut out, &mut lse);
            if d == 128 {
                assert!(matches!(kept, Err(Error::Unsupported { .. })), "{kept:?}");
                continue;
            }
            kept.unwrap();
            let what = format!("{reorder:?} H{heads} D{d}");
            assert_eq!(
                out.to_host().unwrap(),
                plain.to_host().unwrap(),
                "{what}: out"
            );
            let (qh, kh, lse) = (
                q.to_host().unwrap(),
                k.to_host().unwrap(),
                lse.to_host().unwrap(),
            );
            for r in 0..rows {
                for h in 0..heads {
                    let s: Vec<f64> = a
                        .row(r)
                        .iter()
                        .map(|&c| {
                            let (qo, ko) = ((r * heads + h) * d, (c as usize * heads + h) * d);
                            let dot: f64 = (0..d)
                                .map(|i| qh[qo + i].to_f64() * kh[ko + i].to_f64())
                                .sum();
                            dot * f64::from(scale)
                        })
                        .collect();
                    let want = match s.iter().cloned().reduce(f64::max) {
                        None => 0.0,
                        Some(m) => {
                            (m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln())
                                / std::f64::consts::LN_2
                        }
                    };
                    let got = f64::from(lse[r * heads + h]);
                    assert!(
                        (got - want).abs() <= 1e-3 * (1.0 + want.abs()),
                        "{what}: row {r} head {h}: lse {got} against {want}"
                    );
                }
            }
            let mut short = DeviceVec::<f32>::zeros(&gpu, rows * heads - 1).unwrap();
            assert!(f
                .forward_with_lse(&gpu, &q, &k, &v, scale, &mut out, &mut short)
                .is_err());
        }
    }
}
