//! GPU tests of the backward ops (`spattn_ops::backward`) against the f64 CPU reference.
//!
//! `#[ignore]`d where there is no NVIDIA GPU. Inputs are drawn fresh (seed printed; replay with
//! SPATTN_SEED), outputs poisoned with NaN before each launch.

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn_formats::{Csr, Reorder};
use spattn_ops::backward::{self, DeviceSum, DeviceTranspose};
use spattn_ops::cpu::{self, rel_l2_error};
use spattn_ops::graph::DeviceGraph;
use spattn_ops::{DType, DeviceCsr, DeviceMatrix, DeviceVec, Gpu, Shape};
use spattn_test_support::*;

use crate::test_util::{gpu, to_f64, tolerance};

pub(super) fn f32s(rng: &mut Pcg64, len: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(lo..hi)).collect()
}

pub(super) fn up(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

pub(super) fn nan_vec(gpu: &Gpu, len: usize) -> DeviceVec<f32> {
    let mut v = DeviceVec::<f32>::zeros(gpu, len).unwrap();
    v.fill_nan().unwrap();
    v
}

/// A matrix of `s` on the device, its elements drawn in [-1, 1) and rounded to `T`.
fn random_matrix<T: DType>(gpu: &Gpu, rng: &mut Pcg64, s: Shape) -> DeviceMatrix<T> {
    let x: Vec<T> = f32s(rng, s.len(), -1.0, 1.0)
        .into_iter()
        .map(T::from_f32)
        .collect();
    DeviceMatrix::from_host(gpu, s, &x).unwrap()
}

/// The bits of `x`'s values widened to f32 (exact for f16 and bf16).
fn f32_bits<T: DType>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// A matrix of `s` on the device filled with NaN (a kernel must write every element).
fn nan_matrix<T: DType>(gpu: &Gpu, s: Shape) -> DeviceMatrix<T> {
    let mut x = DeviceMatrix::<T>::zeros(gpu, s).unwrap();
    x.fill_nan().unwrap();
    x
}

/// A workspace of `copies` dropout masks for `nnz × heads` elements, every bit set (the
/// kernels must draw them).
pub(super) fn mask_vec(gpu: &Gpu, nnz: usize, heads: usize, copies: usize) -> DeviceVec<u32> {
    let words = copies * backward::dropout_mask_words(nnz, heads).unwrap();
    let mut v = DeviceVec::<u32>::zeros(gpu, words).unwrap();
    v.fill(u32::MAX).unwrap();
    v
}

/// The graphs of every test here: empty rows, hub rows past the long-row threshold (and a
/// 10^5-edge hub), tiny n.
/// Small enough for compute-sanitizer: a hub row past the long-row threshold included.
pub(super) fn small_graphs(rng: &mut Pcg64) -> Vec<Csr> {
    let mut g = vec![random_graph(rng, 300, 6, 7), hub_graph(rng, 5000, 3)];
    for n in [1, 7, 17, 33] {
        g.push(random_graph(rng, n, 3, 4));
    }
    g
}

/// [`small_graphs`] and a 10^5-edge hub row.
fn graphs(rng: &mut Pcg64) -> Vec<Csr> {
    let mut g = small_graphs(rng);
    g.push(hub_graph(rng, 100_000, 4321));
    g
}

/// Row `i` of `a` empty ⇒ no positions to compare; everything else must match.
pub(super) fn check(what: &str, got: &[f32], want: &[f64], tol: f64) {
    let err = rel_l2_error(got, want);
    assert!(err <= tol, "{what}: rel error {err:e} > {tol:e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn edge_backward_ops_small_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("edge_backward_ops_small_graphs");
    for a in small_graphs(&mut rng) {
        edge_backward_ops(&gpu, &mut rng, &a);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn edge_backward_ops_hub_row() {
    let gpu = gpu();
    let mut rng = fresh_rng("edge_backward_ops_hub_row");
    let a = hub_graph(&mut rng, 100_000, 4321);
    edge_backward_ops(&gpu, &mut rng, &a);
}

/// edge_dot over up to 5M values (the kernel's full grid, blocks of many chunks): within f64
/// rounding of the exact sum, and bitwise the same on every run (it has no float atomics).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn edge_dot_is_exact_to_f64_and_deterministic() {
    let gpu = gpu();
    let mut rng = fresh_rng("edge_dot_is_exact_to_f64_and_deterministic");
    for n in [0, 1, 2047, 5_000_003] {
        let x = f32s(&mut rng, n, -1.0, 1.0);
        let y = f32s(&mut rng, n, -1.0, 1.0);
        let (xd, yd) = (
            DeviceVec::from_host(&gpu, &x).unwrap(),
            DeviceVec::from_host(&gpu, &y).unwrap(),
        );
        let want: f64 = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        let bound: f64 = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs())
            .sum();
        let mut acc = DeviceSum::new(&gpu).unwrap();
        let mut first = None;
        for _ in 0..3 {
            backward::edge_dot(&gpu, &xd, &yd, &mut acc).unwrap();
            let got = acc.total().to_host().unwrap()[0];
            assert!(
                (got - want).abs() <= 1e-11 * bound.max(1e-300),
                "n {n}: {got} vs {want} (Σ|terms| {bound})"
            );
            let bits = *first.get_or_insert(got.to_bits());
            assert_eq!(got.to_bits(), bits, "n {n}: reruns differ");
        }
    }
}

/// Softmax backward (both forms), transpose, the fused edge kernel, dot, scale and LeakyReLU
/// backward on `a`, heads 1, 2, 8.
fn edge_backward_ops(gpu: &Gpu, rng: &mut Pcg64, a: &Csr) {
    let a_dev = DeviceCsr::upload(gpu, a).unwrap();
    let t = DeviceTranspose::upload(gpu, a).unwrap();
    let (at, from_a) = a.transpose_with_map();
    assert_eq!(t.csr().to_host().unwrap(), at);
    for heads in [1, 2, 8] {
        let n = a.nnz() * heads;
        let ctx = format!("n={} nnz={} heads={heads}", a.n_rows(), a.nnz());
        // Probabilities of random scores, and a random dP.
        let raw = f32s(rng, n, -3.0, 3.0);
        let dp = f32s(rng, n, -1.0, 1.0);
        let scale = 0.8f32;
        let mut p64: Vec<f64> = raw
            .iter()
            .map(|&r| f64::from(scale) * f64::from(r))
            .collect();
        cpu::edge_softmax_in_place(a, &mut p64, heads, None).unwrap();
        let mut ds64 = vec![0.0; n];
        cpu::edge_softmax_backward(a, &p64, &up(&dp), heads, &mut ds64).unwrap();

        // edge_softmax_backward_in_place on f32 probabilities.
        let p32: Vec<f32> = p64.iter().map(|&x| x as f32).collect();
        let mut want = vec![0.0; n];
        cpu::edge_softmax_backward(a, &up(&p32), &up(&dp), heads, &mut want).unwrap();
        let p_dev = DeviceVec::from_host(gpu, &p32).unwrap();
        let dp_dev = DeviceVec::from_host(gpu, &dp).unwrap();
        let mut ds_dev = nan_vec(gpu, n);
        ds_dev.copy_from(&dp_dev).unwrap();
        backward::edge_softmax_backward_in_place(gpu, &a_dev, &p_dev, &mut ds_dev, heads).unwrap();
        check(
            &format!("softmax backward {ctx}"),
            &ds_dev.to_host().unwrap(),
            &want,
            1e-5,
        );
        let mut in_place = dp_dev.try_clone().unwrap();
        backward::edge_softmax_backward_in_place(gpu, &a_dev, &p_dev, &mut in_place, heads)
            .unwrap();
        check(
            &format!("in place {ctx}"),
            &in_place.to_host().unwrap(),
            &want,
            1e-5,
        );

        // transpose_edge_values against the host map.
        let mut tr = nan_vec(gpu, n);
        backward::transpose_edge_values(gpu, &t, &p_dev, heads, &mut tr).unwrap();
        let mut tr_want = vec![0.0f32; n];
        cpu::transpose_edge_values(&from_a, &p32, heads, &mut tr_want).unwrap();
        assert_eq!(tr.to_host().unwrap(), tr_want, "transpose {ctx}");

        // The fused kernel: scale·dS in A's order, P and scale·dS in Aᵀ's, dscale.
        let raw_dev = DeviceVec::from_host(gpu, &raw).unwrap();
        let mut dp_io = DeviceVec::from_host(gpu, &dp).unwrap();
        let (mut p_t, mut ds_t) = (nan_vec(gpu, n), nan_vec(gpu, n));
        // NaN-filled: every (row, head) writes its share, rows without edges included.
        let mut dscale_rows = nan_vec(gpu, a.n_rows() * heads);
        let mut d_scale = DeviceSum::new(gpu).unwrap();
        backward::attention_edge_backward(
            gpu,
            &a_dev,
            &t,
            heads,
            scale,
            &raw_dev,
            &mut dp_io,
            &mut p_t,
            &mut ds_t,
            &mut dscale_rows,
            &mut d_scale,
        )
        .unwrap();
        let sds: Vec<f64> = ds64.iter().map(|&x| f64::from(scale) * x).collect();
        check(
            &format!("fused dS {ctx}"),
            &dp_io.to_host().unwrap(),
            &sds,
            1e-5,
        );
        let mut pt_want = vec![0.0; n];
        cpu::transpose_edge_values(&from_a, &p64, heads, &mut pt_want).unwrap();
        check(
            &format!("fused Pᵀ {ctx}"),
            &p_t.to_host().unwrap(),
            &pt_want,
            1e-5,
        );
        let mut dst_want = vec![0.0; n];
        cpu::transpose_edge_values(&from_a, &sds, heads, &mut dst_want).unwrap();
        check(
            &format!("fused dSᵀ {ctx}"),
            &ds_t.to_host().unwrap(),
            &dst_want,
            1e-5,
        );
        let ds_want: f64 = ds64.iter().zip(&raw).map(|(d, &r)| d * f64::from(r)).sum();
        let bound: f64 = ds64
            .iter()
            .zip(&raw)
            .map(|(d, &r)| (d * f64::from(r)).abs())
            .sum();
        assert!(
            dscale_rows.to_host().unwrap().iter().all(|x| x.is_finite()),
            "dscale_rows {ctx}: a (row, head) share was not written"
        );
        let got = d_scale.total().to_host().unwrap()[0];
        assert!(
            (got - ds_want).abs() <= 1e-5 * bound.max(1e-30),
            "fused dscale {ctx}: {got} vs {ds_want} (Σ|terms| {bound})"
        );

        // edge_dot and edge_scale on the same data.
        let mut acc = DeviceSum::new(gpu).unwrap();
        backward::edge_dot(gpu, &dp_dev, &raw_dev, &mut acc).unwrap();
        let dot: f64 = dp
            .iter()
            .zip(&raw)
            .map(|(&x, &y)| f64::from(x) * f64::from(y))
            .sum();
        let bound: f64 = dp
            .iter()
            .zip(&raw)
            .map(|(&x, &y)| f64::from(x * y).abs())
            .sum();
        assert!((acc.total().to_host().unwrap()[0] - dot).abs() <= 1e-5 * bound.max(1e-30));
        let mut scaled = dp_dev.try_clone().unwrap();
        backward::edge_scale(gpu, &mut scaled, -0.5).unwrap();
        let want: Vec<f32> = dp.iter().map(|&x| x * -0.5).collect();
        assert_eq!(scaled.to_host().unwrap(), want);

        // LeakyReLU backward.
        let mut grad = dp_dev.try_clone().unwrap();
        backward::edge_leaky_relu_backward(gpu, &raw_dev, 0.2, &mut grad).unwrap();
        let want: Vec<f32> = dp
            .iter()
            .zip(&raw)
            .map(|(&g, &x)| if x >= 0.0 { g } else { g * 0.2 })
            .collect();
        assert_eq!(grad.to_host().unwrap(), want);
    }
}

fn row_sums<T: DType>(gpu: &Gpu, rng: &mut Pcg64, a: &Csr) {
    let a_dev = DeviceCsr::upload(gpu, a).unwrap();
    let t = DeviceTranspose::upload(gpu, a).unwrap();
    for heads in [1, 2, 8] {
        let n = a.nnz() * heads;
        let values = f32s(rng, n, -1.0, 1.0);
        let v_dev = DeviceVec::from_host(gpu, &values).unwrap();
        let mut out =
            DeviceMatrix::<T>::zeros(gpu, Shape::new(a.n_rows(), heads, 1).unwrap()).unwrap();
        out.fill_nan().unwrap();
        backward::edge_row_sum(gpu, &a_dev, &v_dev, heads, &mut out).unwrap();
        let mut want = vec![0.0; a.n_rows() * heads];
        cpu::edge_row_sum(a, &up(&values), heads, &mut want).unwrap();
        let got = to_f64(&out.to_host().unwrap());
        let err = rel_l2_error(&got, &want);
        assert!(
            err <= tolerance::<T>(),
            "row sum {} heads={heads}: {err:e}",
            T::NAME
        );
        // Column sums: row sums on Aᵀ after the transpose.
        let mut vt = nan_vec(gpu, n);
        backward::transpose_edge_values(gpu, &t, &v_dev, heads, &mut vt).unwrap();
        let mut cols =
            DeviceMatrix::<T>::zeros(gpu, Shape::new(a.n_cols(), heads, 1).unwrap()).unwrap();
        cols.fill_nan().unwrap();
        backward::edge_row_sum(gpu, t.csr(), &vt, heads, &mut cols).unwrap();
        let (at, from_a) = a.transpose_with_map();
        let mut vt_host = vec![0.0; n];
        cpu::transpose_edge_values(&from_a, &up(&values), heads, &mut vt_host).unwrap();
        let mut want = vec![0.0; a.n_cols() * heads];
        cpu::edge_row_sum(&at, &vt_host, heads, &mut want).unwrap();
        let err = rel_l2_error(&to_f64(&cols.to_host().unwrap()), &want);
        assert!(
            err <= tolerance::<T>(),
            "column sum {} heads={heads}: {err:e}",
            T::NAME
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn row_sums_on_a_and_its_transpose() {
    let gpu = gpu();
    let mut rng = fresh_rng("row_sums_on_a_and_its_transpose");
    for a in graphs(&mut rng) {
        row_sums::<f32>(&gpu, &mut rng, &a);
        row_sums::<f16>(&gpu, &mut rng, &a);
        row_sums::<bf16>(&gpu, &mut rng, &a);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn errors_name_the_operand() {
    let gpu = gpu();
    let a = Csr::from_edges(3, 3, &[(0, 1), (1, 2), (2, 2)]).unwrap();
    let a_dev = DeviceCsr::upload(&gpu, &a).unwrap();
    let t = DeviceTranspose::upload(&gpu, &a).unwrap();
    let good = DeviceVec::<f32>::zeros(&gpu, 6).unwrap();
    let mut bad = DeviceVec::<f32>::zeros(&gpu, 5).unwrap();
    let e = backward::transpose_edge_values(&gpu, &t, &good, 2, &mut bad).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::LengthMismatch { what: "dst", .. }),
        "{e}"
    );
    let e = backward::edge_softmax_backward_in_place(&gpu, &a_dev, &good, &mut bad, 2).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::LengthMismatch { what: "dp", .. }),
        "{e}"
    );
    let mut out = DeviceMatrix::<f32>::zeros(&gpu, Shape::new(3, 2, 2).unwrap()).unwrap();
    let e = backward::edge_row_sum(&gpu, &a_dev, &good, 2, &mut out).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::ShapeMismatch { what: "out", .. }),
        "{e}"
    );
}

/// `FusedBackward` on its own: the gradients of the f64 reference on the small graphs (a hub row
/// and hub columns split into units), and errors that name the operand.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fused_backward_small_graphs_and_errors() {
    let gpu = gpu();
    let mut rng = fresh_rng("fused_backward_small_graphs_and_errors");
    for a in small_graphs(&mut rng) {
        let (heads, head_dim, scale) = (3, 20, 0.3f32);
        let sq = Shape::new(a.n_rows(), heads, head_dim).unwrap();
        let skv = Shape::new(a.n_cols(), heads, head_dim).unwrap();
        let (q, k, v, d) = (
            f32s(&mut rng, sq.len(), -1.0, 1.0),
            f32s(&mut rng, skv.len(), -1.0, 1.0),
            f32s(&mut rng, skv.len(), -1.0, 1.0),
            f32s(&mut rng, sq.len(), -1.0, 1.0),
        );
        let want = cpu::attention_backward_f64_from(
            &a,
            &cpu::AttentionInputs::new(&up(&q), sq, &up(&k), skv, &up(&v), skv),
            f64::from(scale),
            &up(&d),
        )
        .unwrap();
        let (a_dev, t) = (
            DeviceCsr::upload(&gpu, &a).unwrap(),
            DeviceTranspose::upload(&gpu, &a).unwrap(),
        );
        let m = |s, x: &[f32]| DeviceMatrix::from_host(&gpu, s, x).unwrap();
        let (qd, kd, vd, dd) = (m(sq, &q), m(skv, &k), m(skv, &v), m(sq, &d));
        let mut g = [sq, skv, skv].map(|s| {
            let mut x = DeviceMatrix::<f32>::zeros(&gpu, s).unwrap();
            x.fill_nan().unwrap();
            x
        });
        let mut bwd = backward::FusedBackward::new(&gpu, &a_dev, &t, heads, head_dim).unwrap();
        let [dq, dk, dv] = &mut g;
        bwd.run(&gpu, &a_dev, &t, scale, [&qd, &kd, &vd, &dd], [dq, dk, dv])
            .unwrap();
        for (got, w, what) in [
            (&g[0], &want.dq, "dQ"),
            (&g[1], &want.dk, "dK"),
            (&g[2], &want.dv, "dV"),
        ] {
            check(what, &got.to_host().unwrap(), w, 1e-5);
        }
        let d_scale = bwd.d_scale().to_host().unwrap()[0];
        assert!(
            (d_scale - want.d_scale).abs() <= 1e-4 * want.d_scale.abs().max(1.0),
            "dscale {d_scale} vs {}",
            want.d_scale
        );
        // A wrong operand is named; a transpose of another graph is refused.
        let [dq, dk, dv] = &mut g;
        let wide =
            DeviceMatrix::<f32>::zeros(&gpu, Shape::new(a.n_rows(), heads, 21).unwrap()).unwrap();
        let e = bwd
            .run(
                &gpu,
                &a_dev,
                &t,
                scale,
                [&qd, &kd, &vd, &wide],
                [dq, dk, dv],
            )
            .unwrap_err();
        assert!(format!("{e}").contains("dOut"), "{e}");
        let other = DeviceTranspose::upload(&gpu, &random_graph(&mut rng, 3, 1, 0)).unwrap();
        if a.n_rows() != 3 {
            assert!(backward::FusedBackward::new(&gpu, &a_dev, &other, heads, head_dim).is_err());
        }
    }
    // A workspace sized for one graph refuses another.
    let (a, b) = (
        random_graph(&mut rng, 300, 6, 7),
        hub_graph(&mut rng, 5000, 3),
    );
    let (a_dev, a_t) = (
        DeviceCsr::upload(&gpu, &a).unwrap(),
        DeviceTranspose::upload(&gpu, &a).unwrap(),
    );
    let (b_dev, b_t) = (
        DeviceCsr::upload(&gpu, &b).unwrap(),
        DeviceTranspose::upload(&gpu, &b).unwrap(),
    );
    let mut bwd = backward::FusedBackward::new(&gpu, &a_dev, &a_t, 1, 8).unwrap();
    let s = Shape::new(b.n_rows(), 1, 8).unwrap();
    let x = DeviceMatrix::<f32>::zeros(&gpu, s).unwrap();
    let mut g = [s, s, s].map(|s| DeviceMatrix::<f32>::zeros(&gpu, s).unwrap());
    let [dq, dk, dv] = &mut g;
    let e = bwd
        .run(&gpu, &b_dev, &b_t, 1.0, [&x, &x, &x, &x], [dq, dk, dv])
        .unwrap_err();
    assert!(format!("{e}").contains("workspace"), "{e}");
    assert!(backward::FusedBackward::supports::<f32>(512));
    assert!(!backward::FusedBackward::supports::<f32>(1024));
}

/// `FusedBackward` walking its units in a row order (`set_row_order`, a shuffle of the rows)
/// gives the bits of the graph's own order: plain, and with edge features, a per-head bias and
/// dropout (the `_ef` passes), on the small graphs (hub rows and columns split into units,
/// empty rows), f32 and f16; an order over other rows is refused.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fused_backward_in_a_row_order_gives_the_same_bits() {
    let gpu = gpu();
    let mut rng = fresh_rng("fused_backward_in_a_row_order_gives_the_same_bits");
    // A rectangular graph too (its columns keep their order), with a hub row and a hub column.
    let mut edges: Vec<(u32, u32)> = (0..2000u32).map(|i| (i % 150, (i * 7919) % 400)).collect();
    edges.extend(
        (0..400u32)
            .map(|c| (3, c))
            .chain((0..150u32).map(|r| (r, 11))),
    );
    let rect = Csr::from_edges(150, 400, &edges).unwrap();
    for a in small_graphs(&mut rng).into_iter().chain([rect]) {
        fused_order_case::<f32>(&gpu, &mut rng, &a, 3, 20);
        fused_order_case::<f16>(&gpu, &mut rng, &a, 2, 64);
    }
}

fn fused_order_case<T: DType>(gpu: &Gpu, rng: &mut Pcg64, a: &Csr, heads: usize, head_dim: usize) {
    use spattn_formats::Permutation;
    use spattn_ops::edge_extras::DeviceBias;
    use spattn_ops::Dropout;
    let n = a.n_rows();
    let s = Shape::new(n, heads, head_dim).unwrap();
    let skv = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let se = Shape::new(a.nnz(), heads, head_dim).unwrap();
    let m = |s: Shape, rng: &mut Pcg64| random_matrix::<T>(gpu, rng, s);
    let (q, k, v, d, ef) = (m(s, rng), m(skv, rng), m(skv, rng), m(s, rng), m(se, rng));
    let bias_host: Vec<T> = f32s(rng, a.nnz() * heads, -2.0, 2.0)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let bias = DeviceVec::from_host(gpu, &bias_host).unwrap();
    let drop = Dropout::new(0.3, rng.random(), 5).unwrap();
    let mut old_of_new: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        old_of_new.swap(i, rng.random_range(0..=i));
    }
    let order = Permutation::from_old_of_new(old_of_new).unwrap();
    let (a_dev, t) = (
        DeviceCsr::upload(gpu, a).unwrap(),
        DeviceTranspose::upload(gpu, a).unwrap(),
    );
    let mut bwd = backward::FusedBackward::new(gpu, &a_dev, &t, heads, head_dim).unwrap();
    // dQ, dK, dV, ∂scale, and with the terms ∂E and ∂bias, as host bits.
    let run = |bwd: &mut backward::FusedBackward, terms: bool| {
        let mut g = [s, skv, skv].map(|s| nan_matrix::<T>(gpu, s));
        let mut d_ef = DeviceMatrix::<T>::zeros(gpu, se).unwrap();
        let mut d_bias = DeviceVec::<T>::zeros(gpu, a.nnz() * heads).unwrap();
        let [dq, dk, dv] = &mut g;
        let ops = [&q, &k, &v, &d];
        if terms {
            let terms = backward::EdgeTerms {
                features: Some((&ef, &mut d_ef)),
                bias: Some((DeviceBias::PerHead(&bias), &mut d_bias)),
                dropout: Some(&drop),
            };
            bwd.run_with_edge_terms(gpu, &a_dev, &t, 0.3, ops, [dq, dk, dv], terms)
                .unwrap();
        } else {
            bwd.run(gpu, &a_dev, &t, 0.3, ops, [dq, dk, dv]).unwrap();
        }
        let mut bits: Vec<Vec<u32>> = g
            .iter()
            .chain([&d_ef])
            .map(|x| f32_bits(&x.to_host().unwrap()))
            .collect();
        bits.push(f32_bits(&d_bias.to_host().unwrap()));
        let ds = bwd.d_scale().to_host().unwrap()[0].to_bits();
        bits.push(vec![ds as u32, (ds >> 32) as u32]);
        bits
    };
    for terms in [false, true] {
        bwd.set_row_order(gpu, a, None).unwrap();
        let own = run(&mut bwd, terms);
        bwd.set_row_order(gpu, a, Some(&order)).unwrap();
        let walked = run(&mut bwd, terms);
        assert!(
            own == walked,
            "n {n}, {} {heads} x {head_dim}, terms {terms}",
            T::NAME
        );
    }
    // An order over other rows, or the rows of another graph, is refused.
    let other = Permutation::identity(n + 1).unwrap();
    assert!(bwd.set_row_order(gpu, a, Some(&other)).is_err());
    if (0..n).any(|r| a.degree(r) > 64) {
        // Its split rows differ (the workspace was sized for a hub row cut into units).
        let one_edge = Csr::from_edges(n, a.n_cols(), &[(0, 0)]).unwrap();
        assert!(bwd.set_row_order(gpu, &one_edge, Some(&order)).is_err());
    }
}

/// The tensor-core backward's state belongs to the graph it was made for: a run with extras on
/// another graph of the same sizes is refused, also where both are symmetric (their dK/dV pass
/// reads A's own BSB, so the BSBs alone cannot tell the graphs apart).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_backward_refuses_another_graph_of_the_same_sizes() {
    use spattn_formats::Reorder;
    use spattn_ops::edge_extras::DeviceBias;
    use spattn_ops::fused::CsrExtras;
    use spattn_ops::graph::DeviceGraph;
    let gpu = gpu();
    if gpu.compute_capability() < (8, 0) {
        return;
    }
    // Rings of 40 nodes linked to the nodes 1 and 2 steps away: symmetric, 80 edges each.
    let ring = |step: u32| {
        let n = 40u32;
        let edges: Vec<(u32, u32)> = (0..n)
            .flat_map(|i| [(i, (i + step) % n), (i, (i + n - step) % n)])
            .collect();
        Csr::from_edges(n as usize, n as usize, &edges).unwrap()
    };
    let (a, b) = (ring(1), ring(2));
    assert!(a.is_pattern_symmetric() && b.is_pattern_symmetric());
    assert_eq!((a.n_rows(), a.nnz()), (b.n_rows(), b.nnz()));
    let (ga, gb) = (DeviceGraph::new(&gpu, a), DeviceGraph::new(&gpu, b));
    let s = Shape::new(40, 1, 16).unwrap();
    let mut bwd = backward::TensorCoreBackward::new::<f16>(&ga, 1, 16, Reorder::None).unwrap();
    let x = DeviceMatrix::<f16>::zeros(&gpu, s).unwrap();
    let bias = DeviceVec::<f16>::zeros(&gpu, 80).unwrap();
    let mut d_bias = DeviceVec::<f16>::zeros(&gpu, 80).unwrap();
    let extras = CsrExtras {
        bias: Some(DeviceBias::PerHead(&bias)),
        ..CsrExtras::default()
    };
    let mut g = [s, s, s].map(|s| DeviceMatrix::<f16>::zeros(&gpu, s).unwrap());
    let [dq, dk, dv] = &mut g;
    let mut run = |graph: &DeviceGraph, d_bias: &mut DeviceVec<f16>| {
        bwd.run_with_extras(
            &gpu,
            graph,
            0.25,
            [&x, &x, &x, &x],
            [&mut *dq, &mut *dk, &mut *dv],
            &extras,
            Some(d_bias),
        )
    };
    run(&ga, &mut d_bias).unwrap();
    let e = run(&gb, &mut d_bias).unwrap_err();
    assert!(format!("{e}").contains("another graph"), "{e}");
}

/// Both deterministic backward states with ∂L/∂scale turned off (`set_d_scale(false)`, what
/// the callers that never read it do): the gradients are the bits of a run that takes it, and
/// `d_scale()` keeps the last value taken, though the scale changed in between. FusedBackward
/// in f32 and f16, TensorCoreBackward in f16 (sm_80+), on the small graphs.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn backward_states_skip_d_scale_with_the_same_gradients() {
    let gpu = gpu();
    let mut rng = fresh_rng("backward_states_skip_d_scale_with_the_same_gradients");
    for a in small_graphs(&mut rng) {
        skip_d_scale_case::<f32>(&gpu, &mut rng, &a, 3, 20, false);
        skip_d_scale_case::<f16>(&gpu, &mut rng, &a, 2, 64, false);
        if gpu.compute_capability() >= (8, 0) {
            skip_d_scale_case::<f16>(&gpu, &mut rng, &a, 2, 32, true);
        }
    }
}

fn skip_d_scale_case<T: DType>(
    gpu: &Gpu,
    rng: &mut Pcg64,
    a: &Csr,
    heads: usize,
    head_dim: usize,
    tensor_cores: bool,
) {
    let s = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let skv = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let m = |s: Shape, rng: &mut Pcg64| random_matrix::<T>(gpu, rng, s);
    let (q, k, v, d) = (m(s, rng), m(skv, rng), m(skv, rng), m(s, rng));
    let (a_dev, t) = (
        DeviceCsr::upload(gpu, a).unwrap(),
        DeviceTranspose::upload(gpu, a).unwrap(),
    );
    let graph = DeviceGraph::new(gpu, a.clone());
    let mut fused = backward::FusedBackward::new(gpu, &a_dev, &t, heads, head_dim).unwrap();
    let mut tc = tensor_cores.then(|| {
        backward::TensorCoreBackward::new::<T>(&graph, heads, head_dim, Reorder::None).unwrap()
    });
    // dQ, dK, dV and the state's ∂scale, as host bits, from a run at `scale` taking ∂scale or not.
    let mut run = |scale: f32, take: bool| {
        let mut g = [s, skv, skv].map(|s| nan_matrix::<T>(gpu, s));
        let [dq, dk, dv] = &mut g;
        let ops = [&q, &k, &v, &d];
        let ds = match &mut tc {
            Some(tc) => {
                tc.set_d_scale(take);
                tc.run(gpu, scale, ops, None, [dq, dk, dv]).unwrap();
                tc.d_scale().to_host().unwrap()[0]
            }
            None => {
                fused.set_d_scale(take);
                fused
                    .run(gpu, &a_dev, &t, scale, ops, [dq, dk, dv])
                    .unwrap();
                fused.d_scale().to_host().unwrap()[0]
            }
        };
        let bits: Vec<Vec<u32>> = g.iter().map(|x| f32_bits(&x.to_host().unwrap())).collect();
        (bits, ds.to_bits())
    };
    let what = format!(
        "n {}, {} {heads} x {head_dim}, tc {tensor_cores}",
        a.n_rows(),
        T::NAME
    );
    let (_, ds_first) = run(0.3, true);
    let (skipped, ds_kept) = run(0.5, false);
    assert_eq!(ds_kept, ds_first, "{what}: a run without ∂scale changed it");
    let (taken, ds_taken) = run(0.5, true);
    assert!(skipped == taken, "{what}: gradients differ without ∂scale");
    // A row of one edge has P = 1 and no ∂scale at any scale.
    if (0..a.n_rows()).any(|r| a.degree(r) > 1) {
        assert_ne!(
            ds_taken, ds_first,
            "{what}: ∂scale did not follow the scale"
        );
    }
}
