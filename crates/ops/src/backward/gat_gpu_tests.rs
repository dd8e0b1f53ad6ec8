//! GPU tests of GAT's attention kernels (the fused backward, the row-statistics forward and
//! backward) against the f64 CPU reference, with the helpers of `gpu_tests`.

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn_formats::{Csr, Reorder};
use spattn_ops::backward::{self, DeviceTranspose};
use spattn_ops::cpu;
use spattn_ops::csr_ops::UnitWalk;
use spattn_ops::graph::DeviceGraph;
use spattn_ops::{DType, DeviceCsr, DeviceMatrix, DeviceVec, Gpu, Shape};
use spattn_test_support::*;

use super::gpu_tests::{check, f32s, mask_vec, nan_vec, small_graphs, up};
use crate::test_util::{gpu, tolerance};

/// GAT's fused backward against the f64 CPU reference (on the inputs rounded to `T`): dx
/// within `T`'s rounding, the score terms' and the bias's gradients (f32) within f32's of the
/// terms they sum; over graphs with empty rows, a hub row (split rows) and a hub column (split
/// columns), heads 1–8 and head_dim 1–64 (every lane layout up to one vector a lane, groups of
/// up to 8 lanes), with and without a bias and dropout; wide heads (groups of 32 lanes, up to 4
/// vectors a lane) on the hub graphs. Two runs give the same bits; a head the layouts do not
/// take (130) and a bias without its gradient are refused.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gat_fused_backward_matches_the_f64_reference_and_reruns_bitwise() {
    let gpu = gpu();
    let mut rng = fresh_rng("gat_fused_backward_matches_the_f64_reference_and_reruns_bitwise");
    let mut graphs = small_graphs(&mut rng);
    let hub = hub_graph(&mut rng, 5000, 3);
    graphs.push(hub.transpose_with_map().0);
    for (gi, a) in graphs.iter().enumerate() {
        for (ci, (heads, head_dim)) in [(1, 1), (3, 20), (8, 32), (2, 64), (1, 130)]
            .into_iter()
            .enumerate()
        {
            let (bias, drop) = ((gi + ci) % 2 == 0, (gi + ci) % 3 == 0);
            gat_fused_case::<f32>(&gpu, &mut rng, a, (heads, head_dim), (bias, drop));
            gat_fused_case::<f16>(&gpu, &mut rng, a, (heads, head_dim), (bias, drop));
            gat_fused_case::<bf16>(&gpu, &mut rng, a, (heads, head_dim), (bias, drop));
        }
    }
    // Wide heads: 32-lane groups and several vectors a lane, some lanes holding only the first.
    for a in [&graphs[1], &graphs[graphs.len() - 1]] {
        for head_dim in [128, 136, 512] {
            gat_fused_case::<f32>(&gpu, &mut rng, a, (1, head_dim), (true, true));
        }
        for head_dim in [256, 512] {
            gat_fused_case::<f16>(&gpu, &mut rng, a, (1, head_dim), (true, false));
        }
    }
}

/// Which GAT backward a case runs: the fused passes, or the row-statistics passes (which take
/// the forward's output: `gat_forward_rows` runs first and is checked too).
#[derive(Clone, Copy, PartialEq)]
enum GatPath {
    Fused,
    Rows,
}

/// GAT's row-statistics forward and backward (`gat_forward_rows`, `gat_backward_rows`) on the
/// same graphs and heads as the fused backward's test (empty rows, hub rows and columns split
/// across units, heads 1–8 with 1–64 features, f32/f16/bf16, with a bias), plus the
/// widest heads they take (256 f16, 128 f32, 31 odd) and one they refuse, dropout (the
/// backward's mask drawn again, or kept from the forward on the second run; refused without
/// one), and a graph without edges: the forward within
/// T's tolerance of the f64 layer, the gradients of the f64 reference, two runs bitwise equal
/// (the second walking the units in a degree order of the rows, and of the columns where
/// square: the same bits in any walk).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gat_rows_forward_and_backward_match_the_f64_reference_and_rerun_bitwise() {
    let gpu = gpu();
    let mut rng = fresh_rng("gat_rows_forward_and_backward_match_the_f64_reference");
    let mut graphs = small_graphs(&mut rng);
    let hub = hub_graph(&mut rng, 5000, 3);
    graphs.push(hub.transpose_with_map().0);
    graphs.push(hub);
    // No edge at all: zeros out of both directions, no index read.
    graphs.push(Csr::from_edges(3, 4, &[]).unwrap());
    for (gi, a) in graphs.iter().enumerate() {
        for (ci, (heads, head_dim)) in [
            (1, 1),
            (3, 20),
            (8, 32),
            (2, 64),
            (1, 40),
            (5, 31),
            (8, 8),
            (4, 8),
        ]
        .into_iter()
        .enumerate()
        {
            let extras = ((gi + ci) % 2 == 0, (gi + ci) % 3 == 0);
            let shape = (heads, head_dim);
            gat_case::<f32>(&gpu, &mut rng, a, shape, extras, GatPath::Rows);
            gat_case::<f16>(&gpu, &mut rng, a, shape, extras, GatPath::Rows);
            gat_case::<bf16>(&gpu, &mut rng, a, shape, extras, GatPath::Rows);
        }
    }
    for a in [&graphs[1], &graphs[graphs.len() - 1]] {
        gat_case::<f32>(&gpu, &mut rng, a, (2, 128), (true, true), GatPath::Rows);
        gat_case::<f32>(&gpu, &mut rng, a, (1, 132), (false, false), GatPath::Rows);
        gat_case::<f16>(&gpu, &mut rng, a, (2, 256), (true, false), GatPath::Rows);
        gat_case::<bf16>(&gpu, &mut rng, a, (1, 264), (false, true), GatPath::Rows);
    }
}

/// GAT's backward by `path` (the rows kernels with fresh NaN-filled workspaces, the dropout
/// mask drawn again or `kept` from the forward, their units walked in `walk`'s order; `out`
/// read by them only).
fn gat_backward_by<T: DType>(
    (path, kept, walk): (GatPath, Option<&DeviceVec<u32>>, &UnitWalk),
    gpu: &Gpu,
    graph: (&DeviceCsr, &DeviceTranspose),
    terms: backward::GatScoreTerms<'_>,
    (x, out, d_out): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
    grads: backward::GatGrads<'_, T>,
) -> spattn_ops::Result<()> {
    match path {
        GatPath::Fused => backward::gat::gat_fused_backward(gpu, graph, terms, (x, d_out), grads),
        GatPath::Rows => {
            let heads = x.shape().heads;
            let mut lse = nan_vec(gpu, graph.0.n_rows() * heads);
            let mut ds = nan_vec(gpu, graph.0.nnz() * heads);
            // Both masks drawn, or Aᵀ's alone beside the forward's kept one.
            let copies = if kept.is_some() { 1 } else { 2 };
            let mut mask = terms
                .dropout
                .map(|_| mask_vec(gpu, graph.0.nnz(), heads, copies));
            let bits = backward::KeepBits::of(kept, mask.as_mut());
            let ws = (backward::RowStats::Recompute(&mut lse), &mut ds, bits);
            backward::gat_rows::gat_backward_rows(
                gpu,
                graph,
                walk,
                terms,
                (x, out, d_out),
                ws,
                grads,
            )
        }
    }
}

fn gat_fused_case<T: DType>(
    gpu: &Gpu,
    rng: &mut Pcg64,
    a: &Csr,
    (heads, head_dim): (usize, usize),
    (with_bias, with_dropout): (bool, bool),
) {
    gat_case::<T>(
        gpu,
        rng,
        a,
        (heads, head_dim),
        (with_bias, with_dropout),
        GatPath::Fused,
    );
}

fn gat_case<T: DType>(
    gpu: &Gpu,
    rng: &mut Pcg64,
    a: &Csr,
    (heads, head_dim): (usize, usize),
    (with_bias, with_dropout): (bool, bool),
    path: GatPath,
) {
    let (n, m, nnz) = (a.n_rows(), a.n_cols(), a.nnz());
    let (sx, so) = (
        Shape::new(m, heads, head_dim).unwrap(),
        Shape::new(n, heads, head_dim).unwrap(),
    );
    let rounded = |v: Vec<f32>| -> (Vec<T>, Vec<f64>) {
        let t: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
        let w = t.iter().map(|x| x.to_f64()).collect();
        (t, w)
    };
    let (x, x64) = rounded(f32s(rng, sx.len(), -1.0, 1.0));
    let (d, d64) = rounded(f32s(rng, so.len(), -1.0, 1.0));
    let (a_dst, a_src) = (
        f32s(rng, n * heads, -2.0, 2.0),
        f32s(rng, m * heads, -2.0, 2.0),
    );
    let bias = with_bias.then(|| f32s(rng, nnz * heads, -1.0, 1.0));
    let dropout = with_dropout.then(|| spattn_ops::Dropout::new(0.3, rng.random(), 11).unwrap());
    let slope = 0.2f32;
    let bias64 = bias.as_deref().map(up);
    let (s, p) = cpu::gat_scores(
        a,
        heads,
        f64::from(slope),
        (&up(&a_dst), &up(&a_src), bias64.as_deref()),
    )
    .unwrap();
    let (at, from_a) = a.transpose_with_map();
    let (mut dx64, mut dd64, mut ds64) = (
        vec![0.0; sx.len()],
        vec![0.0; n * heads],
        vec![0.0; m * heads],
    );
    let db64 = cpu::gat_attention_backward(
        a,
        (&at, &from_a),
        heads,
        f64::from(slope),
        dropout.as_ref(),
        (&s, &p),
        (&d64, &x64, sx),
        (&mut dx64, &mut dd64, &mut ds64),
    )
    .unwrap();
    let (a_dev, t) = (
        DeviceCsr::upload(gpu, a).unwrap(),
        DeviceTranspose::upload(gpu, a).unwrap(),
    );
    // A walk of the units in another row order (the graph's own numbering is the default).
    let walk = DeviceGraph::new(gpu, a.clone())
        .unit_walk(Reorder::Degree)
        .unwrap();
    assert!(
        walk.device_bytes() > 0,
        "a degree order's walk lists the units"
    );
    let numbered = UnitWalk::default();
    let per = |rows| Shape::new(rows, heads, 1).unwrap();
    let xd = DeviceMatrix::from_host(gpu, sx, &x).unwrap();
    let dd = DeviceMatrix::from_host(gpu, so, &d).unwrap();
    let a_dst_d = DeviceMatrix::from_host(gpu, per(n), &a_dst).unwrap();
    let a_src_d = DeviceMatrix::from_host(gpu, per(m), &a_src).unwrap();
    let bias_d = bias.as_ref().map(|b| DeviceVec::from_host(gpu, b).unwrap());
    let terms = backward::GatScoreTerms {
        a_dst: &a_dst_d,
        a_src: &a_src_d,
        bias: bias_d.as_ref(),
        slope,
        dropout: dropout.as_ref(),
    };
    let head_taken = match path {
        GatPath::Fused => backward::FusedBackward::supports::<T>(head_dim),
        GatPath::Rows => backward::gat_rows::gat_rows_supports::<T>(head_dim),
    };
    let supported = head_taken;
    // The rows path's forward: out (checked against the f64 layer) and, beside it, the sizes
    // of the terms D_i = <dOut_i, out_i> sums (out's rounding to T enters the gradients there).
    let mut out_d = DeviceMatrix::<T>::zeros(gpu, so).unwrap();
    let mut d_terms = vec![0.0f64; n * heads];
    let mut fwd_mask = dropout.as_ref().map(|_| mask_vec(gpu, nnz, heads, 1));
    if path == GatPath::Rows && supported {
        let mut out64 = vec![0.0; so.len()];
        cpu::gat_attention(
            a,
            heads,
            f64::from(slope),
            (&up(&a_dst), &up(&a_src), bias64.as_deref()),
            dropout.as_ref(),
            &x64,
            sx,
            &mut out64,
        )
        .unwrap();
        out_d.fill_nan().unwrap();
        let mut lse = nan_vec(gpu, n * heads);
        let ws = (&mut lse, fwd_mask.as_mut());
        backward::gat_rows::gat_forward_rows(gpu, (&a_dev, &walk), terms, &xd, ws, &mut out_d)
            .unwrap();
        let walked = out_d.to_host().unwrap();
        let ws = (&mut lse, fwd_mask.as_mut());
        backward::gat_rows::gat_forward_rows(gpu, (&a_dev, &numbered), terms, &xd, ws, &mut out_d)
            .unwrap();
        let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&walked),
            bits(&out_d.to_host().unwrap()),
            "forward's walk"
        );
        // A walk of another graph's units (two rows: two units) is refused, naming it.
        let two = Csr::from_edges(2, 2, &[(1, 0), (1, 1)]).unwrap();
        let foreign = DeviceGraph::new(gpu, two)
            .unit_walk(Reorder::Degree)
            .unwrap();
        if n > 2 {
            let ws = (&mut lse, fwd_mask.as_mut());
            let on = (&a_dev, &*foreign);
            let e = backward::gat_rows::gat_forward_rows(gpu, on, terms, &xd, ws, &mut out_d);
            assert!(format!("{}", e.unwrap_err()).contains("unit walk"));
        }
        if dropout.is_some() {
            // Without its mask workspace, dropout is refused, naming it (a graph without edges
            // has no mask to draw: it takes none).
            let ws = (&mut lse, None);
            let on = (&a_dev, &numbered);
            let e = backward::gat_rows::gat_forward_rows(gpu, on, terms, &xd, ws, &mut out_d);
            match nnz {
                0 => e.unwrap(),
                _ => assert!(format!("{}", e.unwrap_err()).contains("dropout mask")),
            }
        }
        let out: Vec<f32> = out_d
            .to_host()
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let what = format!("forward {} {heads}x{head_dim} n={n} nnz={nnz}", T::NAME);
        check(&what, &out, &out64, tolerance::<T>());
        for (i, t) in d_terms.iter_mut().enumerate() {
            *t = (0..head_dim)
                .map(|k| (d64[i * head_dim + k] * out64[i * head_dim + k]).abs())
                .sum();
        }
    }
    let run = |kept: Option<&DeviceVec<u32>>, walk: &UnitWalk| {
        let mut dx = DeviceMatrix::<T>::zeros(gpu, sx).unwrap();
        dx.fill_nan().unwrap();
        let mut d_dst = DeviceMatrix::<f32>::zeros(gpu, per(n)).unwrap();
        d_dst.fill_nan().unwrap();
        let mut d_src = DeviceMatrix::<f32>::zeros(gpu, per(m)).unwrap();
        d_src.fill_nan().unwrap();
        let mut d_bias = with_bias.then(|| nan_vec(gpu, nnz * heads));
        let grads = backward::GatGrads {
            dx: &mut dx,
            d_dst: &mut d_dst,
            d_src: &mut d_src,
            d_bias: d_bias.as_mut(),
        };
        let io = (&xd, &out_d, &dd);
        let done = gat_backward_by((path, kept, walk), gpu, (&a_dev, &t), terms, io, grads);
        done.map(|()| {
            (
                dx.to_host().unwrap(),
                d_dst.to_host().unwrap(),
                d_src.to_host().unwrap(),
                d_bias.map(|b| b.to_host().unwrap()),
            )
        })
    };
    if !supported {
        let e = run(None, &numbered).unwrap_err();
        assert!(format!("{e}").contains("head_dim"), "{e}");
        return;
    }
    let first = run(None, &numbered).unwrap();
    let what = format!("{} {heads}x{head_dim} n={n} nnz={nnz}", T::NAME);
    let (dx, d_dst, d_src, d_bias) = &first;
    let dx: Vec<f32> = dx.iter().map(|v| v.to_f32()).collect();
    check(&format!("dx {what}"), &dx, &dx64, tolerance::<T>());
    // The score terms' gradients cancel (Σ_j dS = 0 but for the slope): their error is f32's
    // rounding of the terms, measured against the terms' size before cancellation, P (|dP| +
    // |D_i|) per edge.
    let scale = {
        let (offsets, cols) = (a.row_offsets(), a.col_indices());
        let mut sq = 0.0;
        for i in 0..n {
            let edges = offsets[i] as usize..offsets[i + 1] as usize;
            for h in 0..heads {
                let dp = |e: usize| {
                    let (r, c) = (
                        (i * heads + h) * head_dim,
                        (cols[e] as usize * heads + h) * head_dim,
                    );
                    let dw: f64 = (0..head_dim).map(|k| d64[r + k] * x64[c + k]).sum();
                    let f = dropout.as_ref().map_or(1.0, |d| {
                        let kept = d.keeps(e as u64, h as u64, heads as u64);
                        if kept {
                            f64::from(d.scale())
                        } else {
                            0.0
                        }
                    });
                    dw * f
                };
                let big_d: f64 = edges.clone().map(|e| p[e * heads + h] * dp(e)).sum();
                // The rows path takes D from out in T: its rounding, relative to D's terms.
                let d_err = match path {
                    GatPath::Fused => 0.0,
                    GatPath::Rows => d_terms[i * heads + h] * tolerance::<T>() / 1e-5,
                };
                for e in edges.clone() {
                    sq += (p[e * heads + h] * (dp(e).abs() + big_d.abs() + d_err)).powi(2);
                }
            }
        }
        sq.sqrt()
    };
    for (got, want, name) in [(d_dst, &dd64, "d_dst"), (d_src, &ds64, "d_src")] {
        let diff = got
            .iter()
            .zip(want.iter())
            .map(|(&g, &w)| (f64::from(g) - w).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!(
            diff <= 1e-5 * (norm + scale) + 1e-30,
            "{name} {what}: error {diff:e}, norm {norm:e}, terms {scale:e}"
        );
    }
    if let Some(db) = d_bias {
        // The rows path's dS carries out's rounding to T through D_i.
        let tol = if path == GatPath::Rows {
            tolerance::<T>().max(1e-5)
        } else {
            1e-5
        };
        check(&format!("d_bias {what}"), db, &db64, tol);
    }
    // The rows kernels' second run reads the forward's kept mask and walks the units in
    // another order: the same bits as drawn again, in the numbered walk.
    let kept = (path == GatPath::Rows)
        .then_some(fwd_mask.as_ref())
        .flatten();
    let second = run(kept, &walk).unwrap();
    assert!(
        first
            .0
            .iter()
            .zip(&second.0)
            .all(|(a, b)| a.to_f64().to_bits() == b.to_f64().to_bits())
            && first
                .1
                .iter()
                .zip(&second.1)
                .all(|(a, b)| a.to_bits() == b.to_bits())
            && first
                .2
                .iter()
                .zip(&second.2)
                .all(|(a, b)| a.to_bits() == b.to_bits())
            && first
                .3
                .iter()
                .flatten()
                .zip(second.3.iter().flatten())
                .all(|(a, b)| a.to_bits() == b.to_bits()),
        "two runs differ: {what}"
    );
    // A bias without its gradient's buffer is refused, naming it.
    if let Some(b) = &bias_d {
        let mut dx = DeviceMatrix::<T>::zeros(gpu, sx).unwrap();
        let mut d_dst = DeviceMatrix::<f32>::zeros(gpu, per(n)).unwrap();
        let mut d_src = DeviceMatrix::<f32>::zeros(gpu, per(m)).unwrap();
        let terms = backward::GatScoreTerms {
            bias: Some(b),
            ..terms
        };
        let grads = backward::GatGrads {
            dx: &mut dx,
            d_dst: &mut d_dst,
            d_src: &mut d_src,
            d_bias: None,
        };
        let io = (&xd, &out_d, &dd);
        let by = (path, None, &numbered);
        let e = gat_backward_by(by, gpu, (&a_dev, &t), terms, io, grads).unwrap_err();
        assert!(format!("{e}").contains("d_bias"), "{e}");
    }
}

/// GATv2's inputs on the host (rounded to `T`, widened to f64 for the reference): `xl`
/// (`n_cols` rows), `xr` (`n_rows`), `ef` (`nnz`), `att` (`heads × dim`) and `dOut` (`n_rows`).
struct Gatv2Case {
    xl: Vec<f64>,
    xr: Vec<f64>,
    ef: Option<Vec<f64>>,
    att: Vec<f32>,
    d_out: Vec<f64>,
}

/// What GATv2's reference computes: `out`, ∂xl, ∂xr, each row's share of ∂att, ∂ef.
struct Gatv2Want {
    out: Vec<f64>,
    d_xl: Vec<f64>,
    d_xr: Vec<f64>,
    d_att_rows: Vec<f64>,
    d_ef: Vec<f64>,
}

/// GATv2's forward and exact backward in f64 (no dropout), written from the definition:
/// `s_e = Σ_c att[h,c] · LeakyReLU(z_e)`, `z_e = xl[j] + xr[i] (+ ef[e])`, `P` the row softmax,
/// `out[i] = Σ_e P_e · xl[j]`.
fn gatv2_reference(a: &Csr, c: &Gatv2Case, heads: usize, dim: usize, slope: f64) -> Gatv2Want {
    let hd = heads * dim;
    // LeakyReLU' is 1 at z ≥ 0, as every kernel and the CPU reference take it (a tie z = 0 is
    // common in bf16).
    let lrelu = |x: f64| if x >= 0.0 { x } else { slope * x };
    let dlrelu = |x: f64| if x >= 0.0 { 1.0 } else { slope };
    let mut w = Gatv2Want {
        out: vec![0.0; a.n_rows() * hd],
        d_xl: vec![0.0; a.n_cols() * hd],
        d_xr: vec![0.0; a.n_rows() * hd],
        d_att_rows: vec![0.0; a.n_rows() * hd],
        d_ef: vec![0.0; a.nnz() * hd],
    };
    for i in 0..a.n_rows() {
        let edges: Vec<usize> = a.row_range(i).collect();
        for h in 0..heads {
            let z = |e: usize, k: usize| {
                let j = a.col_indices()[e] as usize;
                let ef = c.ef.as_ref().map_or(0.0, |ef| ef[e * hd + h * dim + k]);
                c.xl[j * hd + h * dim + k] + c.xr[i * hd + h * dim + k] + ef
            };
            let att = |k: usize| f64::from(c.att[h * dim + k]);
            let s: Vec<f64> = edges
                .iter()
                .map(|&e| (0..dim).map(|k| att(k) * lrelu(z(e, k))).sum())
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = s.iter().map(|x| (x - m).exp()).sum();
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / total).collect();
            let dp: Vec<f64> = edges
                .iter()
                .map(|&e| {
                    let j = a.col_indices()[e] as usize;
                    (0..dim)
                        .map(|k| c.d_out[i * hd + h * dim + k] * c.xl[j * hd + h * dim + k])
                        .sum()
                })
                .collect();
            let pdp: f64 = p.iter().zip(&dp).map(|(p, d)| p * d).sum();
            for (n, &e) in edges.iter().enumerate() {
                let j = a.col_indices()[e] as usize;
                let ds = p[n] * (dp[n] - pdp);
                for k in 0..dim {
                    let (o, x) = (i * hd + h * dim + k, j * hd + h * dim + k);
                    let g = ds * att(k) * dlrelu(z(e, k));
                    w.out[o] += p[n] * c.xl[x];
                    w.d_xr[o] += g;
                    w.d_xl[x] += g + p[n] * c.d_out[o];
                    w.d_att_rows[o] += ds * lrelu(z(e, k));
                    w.d_ef[e * hd + h * dim + k] = g;
                }
            }
        }
    }
    w
}

/// The Euclidean norm of `x`.
fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

/// `len` values drawn in [-1, 1), rounded to `T`: the device's copy and the reference's.
fn gatv2_draw<T: DType>(rng: &mut Pcg64, len: usize) -> (Vec<T>, Vec<f64>) {
    let x: Vec<T> = f32s(rng, len, -1.0, 1.0)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let wide = x.iter().map(|v| v.to_f64()).collect();
    (x, wide)
}

/// GATv2's composition (`gatv2_forward`, `gatv2_backward`) against [`gatv2_reference`] on
/// inputs rounded to `T`: the output and ∂xl, ∂xr, ∂ef within `T`'s tolerance, the rows' shares
/// of ∂att (f32) within 1e-4 (the last three measured against ∂xl's size where their own
/// vanishes); a rerun gives the same bits.
fn gatv2_case<T: DType>(
    gpu: &Gpu,
    rng: &mut Pcg64,
    a: &Csr,
    (heads, dim): (usize, usize),
    ef: bool,
) {
    let (sq, skv) = (
        Shape::new(a.n_rows(), heads, dim).unwrap(),
        Shape::new(a.n_cols(), heads, dim).unwrap(),
    );
    let se = Shape::new(a.nnz(), heads, dim).unwrap();
    let (xl, xl64) = gatv2_draw::<T>(rng, skv.len());
    let (xr, xr64) = gatv2_draw::<T>(rng, sq.len());
    let (efh, ef64) = gatv2_draw::<T>(rng, se.len());
    let (d_out, d_out64) = gatv2_draw::<T>(rng, sq.len());
    let att = f32s(rng, heads * dim, -1.0, 1.0);
    let case = Gatv2Case {
        xl: xl64,
        xr: xr64,
        ef: ef.then_some(ef64),
        att: att.clone(),
        d_out: d_out64,
    };
    let slope = 0.2;
    let want = gatv2_reference(a, &case, heads, dim, f64::from(slope));

    let (a_dev, t) = (
        DeviceCsr::upload(gpu, a).unwrap(),
        DeviceTranspose::upload(gpu, a).unwrap(),
    );
    let up_m = |s: Shape, x: &[T]| DeviceMatrix::from_host(gpu, s, x).unwrap();
    let (xl_d, xr_d, ef_d) = (up_m(skv, &xl), up_m(sq, &xr), up_m(se, &efh));
    let (att_d, d_out_d) = (DeviceVec::from_host(gpu, &att).unwrap(), up_m(sq, &d_out));
    let ops = backward::Gatv2Operands {
        xl: &xl_d,
        xr: &xr_d,
        ef: ef.then_some(&ef_d),
        att: &att_d,
        slope,
    };
    let n = a.nnz() * heads;
    let what = format!(
        "{} n={} nnz={} {heads}x{dim} ef={ef}",
        T::NAME,
        a.n_rows(),
        a.nnz()
    );
    let tol = tolerance::<T>().max(1e-4);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
        out.fill_nan().unwrap();
        let mut p = nan_vec(gpu, n);
        backward::gatv2_forward(gpu, &a_dev, &ops, None, &mut p, &mut out).unwrap();
        let mut d_xl = DeviceMatrix::<T>::zeros(gpu, skv).unwrap();
        let mut d_xr = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
        let mut d_ef = DeviceMatrix::<T>::zeros(gpu, se).unwrap();
        let mut d_att = nan_vec(gpu, sq.len());
        d_xr.fill_nan().unwrap();
        d_ef.fill_nan().unwrap();
        let (mut w0, mut w1, mut w2) = (nan_vec(gpu, n), nan_vec(gpu, n), nan_vec(gpu, n));
        let grads = backward::Gatv2Grads {
            d_xl: &mut d_xl,
            d_xr: &mut d_xr,
            d_att_rows: &mut d_att,
            d_ef: ef.then_some(&mut d_ef),
        };
        let ws = [&mut w0, &mut w1, &mut w2];
        backward::gatv2_backward(gpu, (&a_dev, &t), &ops, None, &d_out_d, ws, grads).unwrap();
        let f = |m: &DeviceMatrix<T>| -> Vec<f32> {
            m.to_host().unwrap().iter().map(|v| v.to_f32()).collect()
        };
        let got = [
            f(&out),
            f(&d_xl),
            f(&d_xr),
            d_att.to_host().unwrap(),
            f(&d_ef),
        ];
        check(&format!("gatv2 out {what}"), &got[0], &want.out, tol);
        check(&format!("gatv2 d_xl {what}"), &got[1], &want.d_xl, tol);
        // ∂xr, ∂att and ∂ef are sums of dS, which cancel to zero on a row of one edge or of one
        // LeakyReLU side: their error is measured against ∂xl's size where theirs vanishes.
        let floor = norm(&want.d_xl);
        let scaled = |name: &str, got: &[f32], want: &[f64], tol: f64| {
            let diff: Vec<f64> = got
                .iter()
                .zip(want)
                .map(|(g, w)| f64::from(*g) - w)
                .collect();
            let err = norm(&diff) / norm(want).max(floor);
            assert!(err <= tol, "gatv2 {name} {what}: error {err:e} > {tol:e}");
        };
        scaled("d_xr", &got[2], &want.d_xr, tol);
        scaled("d_att_rows", &got[3], &want.d_att_rows, 1e-4);
        if ef {
            scaled("d_ef", &got[4], &want.d_ef, tol);
        }
        runs.push(got.map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
    }
    assert!(runs[0] == runs[1], "gatv2 {what}: a rerun changed bits");
}

/// GATv2's forward and backward (`backward::gatv2_forward`, `gatv2_backward`) against the f64
/// reference over graphs with empty rows and a hub row, 1–4 heads of 1–64 features, with and
/// without edge features, f32 / f16 / bf16, bitwise on a rerun; `d_ef` without edge features
/// and a short `att` are refused, naming the operand.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gatv2_composition_matches_the_f64_reference_and_reruns_bitwise() {
    let gpu = gpu();
    let mut rng = fresh_rng("gatv2_composition_matches_the_f64_reference_and_reruns_bitwise");
    let graphs = [
        random_graph(&mut rng, 60, 5, 7),
        hub_graph(&mut rng, 2000, 3),
        random_graph(&mut rng, 5, 2, 3),
    ];
    for a in &graphs {
        for (heads, dim) in [(1, 1), (2, 8), (4, 20), (1, 64)] {
            for ef in [false, true] {
                gatv2_case::<f32>(&gpu, &mut rng, a, (heads, dim), ef);
                gatv2_case::<f16>(&gpu, &mut rng, a, (heads, dim), ef);
                gatv2_case::<bf16>(&gpu, &mut rng, a, (heads, dim), ef);
            }
        }
    }
    // Errors name the operand.
    let a = &graphs[0];
    let s = Shape::new(a.n_rows(), 2, 8).unwrap();
    let (a_dev, t) = (
        DeviceCsr::upload(&gpu, a).unwrap(),
        DeviceTranspose::upload(&gpu, a).unwrap(),
    );
    let x = DeviceMatrix::<f32>::zeros(&gpu, s).unwrap();
    let short = DeviceVec::<f32>::zeros(&gpu, 15).unwrap();
    let att = DeviceVec::<f32>::zeros(&gpu, 16).unwrap();
    let n = a.nnz() * 2;
    let mut p = nan_vec(&gpu, n);
    let mut out = DeviceMatrix::<f32>::zeros(&gpu, s).unwrap();
    let bad = backward::Gatv2Operands {
        xl: &x,
        xr: &x,
        ef: None,
        att: &short,
        slope: 0.2,
    };
    match backward::gatv2_forward(&gpu, &a_dev, &bad, None, &mut p, &mut out) {
        Err(crate::Error::LengthMismatch { what: "att", .. }) => {}
        other => panic!("expected LengthMismatch {{ what: \"att\" }}, got {other:?}"),
    }
    let ops = backward::Gatv2Operands { att: &att, ..bad };
    let zeros = || DeviceMatrix::<f32>::zeros(&gpu, s).unwrap();
    let (mut d_xl, mut d_xr) = (zeros(), zeros());
    let mut d_ef = DeviceMatrix::<f32>::zeros(&gpu, Shape::new(a.nnz(), 2, 8).unwrap()).unwrap();
    let mut d_att = nan_vec(&gpu, s.len());
    let (mut w0, mut w1, mut w2) = (nan_vec(&gpu, n), nan_vec(&gpu, n), nan_vec(&gpu, n));
    let grads = backward::Gatv2Grads {
        d_xl: &mut d_xl,
        d_xr: &mut d_xr,
        d_att_rows: &mut d_att,
        d_ef: Some(&mut d_ef),
    };
    let ws = [&mut w0, &mut w1, &mut w2];
    match backward::gatv2_backward(&gpu, (&a_dev, &t), &ops, None, &x, ws, grads) {
        Err(crate::Error::InvalidArgument { what: "d_ef", .. }) => {}
        other => panic!("expected InvalidArgument {{ what: \"d_ef\" }}, got {other:?}"),
    }
}
