//! cuBLAS GEMM (every transpose, f32 / f16 / bf16 operands, output in the operands' type or
//! f32) and the layer kernels of `elementwise` against the CPU in f64, on odd shapes, with
//! outputs poisoned with NaN before each launch.

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn_ops::cpu;
use spattn_ops::elementwise::{self, Activation};
use spattn_ops::{Blas, Dims, GemmElement};
use spattn_ops::{DType, DeviceMatrix, DeviceVec, Gpu, Shape};

fn setup() -> (Gpu, Blas) {
    let gpu = Gpu::new(0).expect("a GPU");
    let blas = Blas::new(&gpu).expect("libcublas");
    (gpu, blas)
}

fn random<T: DType>(len: usize, rng: &mut Pcg64) -> (Vec<T>, Vec<f64>) {
    let v: Vec<T> = (0..len)
        .map(|_| T::from_f64(rng.random_range(-1.0..1.0)))
        .collect();
    let f = v.iter().map(|x| x.to_f64()).collect();
    (v, f)
}

/// rel L2 of device data against the f64 reference (+∞ on any NaN).
fn rel_l2_error<T: DType>(out: &[T], want: &[f64]) -> f64 {
    let wide: Vec<f64> = out.iter().map(|x| x.to_f64()).collect();
    cpu::rel_l2_error(&wide, want)
}

/// L2 of device data minus the f64 reference, over the L2 of the terms' magnitudes `mag` (the
/// same GEMM of |A|, |B| and |C|): rounding error scales with the terms, not with a result
/// that cancels (+∞ on any NaN).
fn error_over_terms<T: DType>(out: &[T], want: &[f64], mag: &[f64]) -> f64 {
    let diff: f64 = out
        .iter()
        .zip(want)
        .map(|(x, w)| (x.to_f64() - w).powi(2))
        .sum();
    let norm: f64 = mag.iter().map(|m| m * m).sum();
    if diff.is_nan() {
        return f64::INFINITY;
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

fn tol<T: DType>() -> f64 {
    match T::NAME {
        "f32" => 1e-5,
        "f16" => 5e-3,
        _ => 2e-2,
    }
}

fn check_gemm<T: GemmElement, C: GemmElement>(gpu: &Gpu, blas: &Blas, rng: &mut Pcg64) {
    for &(m, n, k) in &[
        (1, 1, 1),
        (7, 33, 129),
        (129, 7, 33),
        (33, 129, 1),
        (1, 129, 7),
    ] {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for beta in [0.0f32, 1.0] {
                let a_dims = Dims::new(m, k).op(ta);
                let b_dims = Dims::new(k, n).op(tb);
                let (a, a64) = random::<T>(m * k, rng);
                let (b, b64) = random::<T>(k * n, rng);
                let (c0, mut want) = random::<C>(m * n, rng);
                let abs = |v: &[f64]| v.iter().map(|x| x.abs()).collect::<Vec<f64>>();
                let mut mag = abs(&want);
                spattn_ops::host_gemm(
                    1.5,
                    (&a64, a_dims, ta),
                    (&b64, b_dims, tb),
                    f64::from(beta),
                    (&mut want, Dims::new(m, n)),
                )
                .unwrap();
                spattn_ops::host_gemm(
                    1.5,
                    (&abs(&a64), a_dims, ta),
                    (&abs(&b64), b_dims, tb),
                    f64::from(beta),
                    (&mut mag, Dims::new(m, n)),
                )
                .unwrap();
                let da = DeviceVec::from_host(gpu, &a).unwrap();
                let db = DeviceVec::from_host(gpu, &b).unwrap();
                let mut dc = DeviceVec::from_host(gpu, &c0).unwrap();
                if beta == 0.0 {
                    dc.fill_nan().unwrap();
                }
                spattn_ops::gemm(
                    blas,
                    1.5,
                    (&da, a_dims, ta),
                    (&db, b_dims, tb),
                    beta,
                    (&mut dc, Dims::new(m, n)),
                )
                .unwrap();
                let err = error_over_terms(&dc.to_host().unwrap(), &want, &mag);
                let bound = tol::<T>().max(tol::<C>());
                assert!(
                    err <= bound,
                    "{} x {} x {} {}·{} ta {ta} tb {tb} beta {beta} -> {}: L2 error over the \
                     terms' {err:.2e}",
                    m,
                    n,
                    k,
                    T::NAME,
                    T::NAME,
                    C::NAME
                );
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemm_matches_the_cpu_on_odd_shapes() {
    let (gpu, blas) = setup();
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = Pcg64::seed_from_u64(seed);
    check_gemm::<f32, f32>(&gpu, &blas, &mut rng);
    check_gemm::<f16, f16>(&gpu, &blas, &mut rng);
    check_gemm::<f16, f32>(&gpu, &blas, &mut rng);
    check_gemm::<bf16, bf16>(&gpu, &blas, &mut rng);
    check_gemm::<bf16, f32>(&gpu, &blas, &mut rng);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemm_rejects_bad_shapes() {
    let (gpu, blas) = setup();
    let a = DeviceVec::<f32>::zeros(&gpu, 6).unwrap();
    let mut c = DeviceVec::<f32>::zeros(&gpu, 4).unwrap();
    let err = spattn_ops::gemm(
        &blas,
        1.0,
        (&a, Dims::new(2, 3), false),
        (&a, Dims::new(2, 3), false),
        0.0,
        (&mut c, Dims::new(2, 2)),
    )
    .unwrap_err();
    assert!(matches!(
        err,
        spattn_ops::Error::DimsMismatch { what: "op(B)", .. }
    ));
}

fn check_kernels<T: DType>(gpu: &Gpu, rng: &mut Pcg64) {
    // Odd widths walk one feature a lane; 32 and 264 (a multiple of 8) the 16-byte vectors, 264
    // with more vectors than lanes.
    for &(rows, heads, dim) in &[
        (1, 1, 1),
        (7, 2, 3),
        (33, 8, 17),
        (129, 1, 70),
        (9, 8, 32),
        (3, 2, 264),
    ] {
        let s = Shape::new(rows, heads, dim).unwrap();
        let (x, x64) = random::<T>(s.len(), rng);
        let dx = DeviceMatrix::from_host(gpu, s, &x).unwrap();
        // Activations.
        for act in [Activation::Relu, Activation::Elu] {
            let mut y = DeviceMatrix::<T>::zeros(gpu, s).unwrap();
            y.fill_nan().unwrap();
            elementwise::activation(gpu, act, &dx, &mut y).unwrap();
            let want: Vec<f64> = x64.iter().map(|&v| act.apply(v)).collect();
            assert!(rel_l2_error(&y.to_host().unwrap(), &want) <= tol::<T>());
            let (g, g64) = random::<T>(s.len(), rng);
            let dg = DeviceMatrix::from_host(gpu, s, &g).unwrap();
            y.fill_nan().unwrap();
            elementwise::activation_backward(gpu, act, &dx, &dg, &mut y).unwrap();
            let want: Vec<f64> = x64
                .iter()
                .zip(&g64)
                .map(|(&v, &d)| d * act.derivative(v))
                .collect();
            assert!(rel_l2_error(&y.to_host().unwrap(), &want) <= tol::<T>());
        }
        // Per-head dot with an attention vector.
        let (att, att64) = random::<T>(heads * dim, rng);
        let datt = DeviceVec::from_host(gpu, &att).unwrap();
        let mut e = DeviceMatrix::<T>::zeros(gpu, Shape::new(rows, heads, 1).unwrap()).unwrap();
        e.fill_nan().unwrap();
        elementwise::head_dot(gpu, &dx, &datt, &mut e).unwrap();
        let want: Vec<f64> = (0..rows * heads)
            .map(|p| {
                (0..dim)
                    .map(|d| x64[p * dim + d] * att64[(p % heads) * dim + d])
                    .sum()
            })
            .collect();
        assert!(rel_l2_error(&e.to_host().unwrap(), &want) <= tol::<T>());
        // The f32 twins: f32 attention vectors and scores (f32 accuracy of the sums whatever
        // T), one vector or two at once (GAT's source and target: vector t's scores in rows
        // t·rows..), and the outer products added into the features' gradient.
        for k in [1usize, 2] {
            let (att32, att32_64) = random::<f32>(k * heads * dim, rng);
            let datt32 = DeviceVec::from_host(gpu, &att32).unwrap();
            let scores = Shape::new(k * rows, heads, 1).unwrap();
            let mut e32 = DeviceMatrix::<f32>::zeros(gpu, scores).unwrap();
            e32.fill_nan().unwrap();
            elementwise::head_dot_f32(gpu, &dx, &datt32, &mut e32).unwrap();
            let att_at = |t: usize, p: usize, d: usize| att32_64[(t * heads + p % heads) * dim + d];
            let want: Vec<f64> = (0..k * rows * heads)
                .map(|q| {
                    let (t, p) = (q / (rows * heads), q % (rows * heads));
                    (0..dim).map(|d| x64[p * dim + d] * att_at(t, p, d)).sum()
                })
                .collect();
            assert!(rel_l2_error(&e32.to_host().unwrap(), &want) <= tol::<f32>());
            let (de, de64) = random::<f32>(k * rows * heads, rng);
            let dde = DeviceMatrix::from_host(gpu, scores, &de).unwrap();
            let mut grad = DeviceMatrix::from_host(gpu, s, &x).unwrap();
            elementwise::head_outer_add_f32(gpu, &dde, &datt32, &mut grad).unwrap();
            let want: Vec<f64> = (0..s.len())
                .map(|i| {
                    let (p, d) = (i / dim, i % dim);
                    let outer: f64 = (0..k)
                        .map(|t| de64[t * rows * heads + p] * att_at(t, p, d))
                        .sum();
                    x64[i] + outer
                })
                .collect();
            assert!(rel_l2_error(&grad.to_host().unwrap(), &want) <= tol::<T>());
            // The attention vectors' gradients: every vector's weighted column sums from one
            // read of x, added to what the output held.
            let mut da = DeviceVec::from_host(gpu, &vec![0.25f32; k * heads * dim]).unwrap();
            elementwise::head_weighted_sum(gpu, &dx, &dde, &mut da).unwrap();
            let want: Vec<f64> = (0..k * heads * dim)
                .map(|q| {
                    let (t, c) = (q / (heads * dim), q % (heads * dim));
                    let sum: f64 = (0..rows)
                        .map(|i| {
                            x64[i * heads * dim + c] * de64[t * rows * heads + i * heads + c / dim]
                        })
                        .sum();
                    0.25 + sum
                })
                .collect();
            assert!(rel_l2_error(&da.to_host().unwrap(), &want) <= tol::<f32>());
            // Not a whole number of vectors, or more than the kernels take: refused, named.
            let one = heads * dim;
            let bad = if one > 1 {
                vec![one + 1, 5 * one]
            } else {
                vec![5]
            };
            // Five weight vectors: more than the column sums take.
            let five =
                DeviceMatrix::<f32>::zeros(gpu, Shape::new(5 * rows, heads, 1).unwrap()).unwrap();
            let err = elementwise::head_weighted_sum(gpu, &dx, &five, &mut da).unwrap_err();
            assert!(
                matches!(
                    err,
                    spattn_ops::Error::InvalidArgument {
                        what: "weights",
                        ..
                    }
                ),
                "{err}"
            );
            for len in bad {
                let bad = DeviceVec::<f32>::zeros(gpu, len).unwrap();
                let err = elementwise::head_dot_f32(gpu, &dx, &bad, &mut e32).unwrap_err();
                assert!(
                    matches!(
                        err,
                        spattn_ops::Error::InvalidArgument {
                            what: "attention vector",
                            ..
                        }
                    ),
                    "{err}"
                );
            }
        }
        // Row normalization.
        let mut xhat = DeviceMatrix::<T>::zeros(gpu, s).unwrap();
        let mut inv = DeviceVec::<f32>::zeros(gpu, rows).unwrap();
        xhat.fill_nan().unwrap();
        elementwise::row_normalize(gpu, &dx, None, &mut xhat, None, &mut inv).unwrap();
        let rl = heads * dim;
        let want: Vec<f64> = x64
            .chunks(rl)
            .flat_map(|r| {
                let nrm = r.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
                r.iter().map(move |v| v / nrm).collect::<Vec<_>>()
            })
            .collect();
        assert!(rel_l2_error(&xhat.to_host().unwrap(), &want) <= tol::<T>());
        // Head mean.
        let mut m = DeviceMatrix::<T>::zeros(gpu, Shape::new(rows, 1, dim).unwrap()).unwrap();
        m.fill_nan().unwrap();
        elementwise::head_mean(gpu, &dx, &mut m).unwrap();
        let want: Vec<f64> = (0..rows * dim)
            .map(|i| {
                (0..heads)
                    .map(|h| x64[((i / dim) * heads + h) * dim + i % dim])
                    .sum::<f64>()
                    / heads as f64
            })
            .collect();
        assert!(rel_l2_error(&m.to_host().unwrap(), &want) <= tol::<T>());
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn layer_kernels_match_the_cpu() {
    let (gpu, _) = setup();
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = Pcg64::seed_from_u64(seed);
    check_kernels::<f32>(&gpu, &mut rng);
    check_kernels::<f16>(&gpu, &mut rng);
    check_kernels::<bf16>(&gpu, &mut rng);
}

/// The layers' column sums (a bias's gradient, a GAT attention vector's) and AGNN's ∂β: within
/// f32 rounding of the f64 sum of the same terms, added to what the output held, and bitwise
/// the same over reruns (block parts summed in a fixed order, no float atomics) — up to 200k
/// rows, where the sums span many blocks.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn layer_sums_are_accurate_and_deterministic() {
    let (gpu, _) = setup();
    let mut rng = Pcg64::seed_from_u64(7);
    for &(rows, heads, dim) in &[
        (1, 1, 1),
        (129, 2, 35),
        (200_000, 4, 16),
        (3_001, 8, 32),
        (50_000, 1, 40),
    ] {
        let s = Shape::new(rows, heads, dim).unwrap();
        let (x, x64) = random::<f32>(s.len(), &mut rng);
        let (w, w64) = random::<f32>(rows * heads, &mut rng);
        let dx = DeviceMatrix::from_host(&gpu, s, &x).unwrap();
        let dw = DeviceMatrix::from_host(&gpu, Shape::new(rows, heads, 1).unwrap(), &w).unwrap();
        let cols = heads * dim;
        let runs = |f: &dyn Fn(&mut DeviceVec<f32>), len: usize| -> Vec<f32> {
            let mut first: Option<Vec<f32>> = None;
            for _ in 0..3 {
                let mut out = DeviceVec::from_host(&gpu, &vec![0.5f32; len]).unwrap();
                f(&mut out);
                let got = out.to_host().unwrap();
                let want = first.get_or_insert_with(|| got.clone());
                let same = got
                    .iter()
                    .zip(want.iter())
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{rows} x {heads} x {dim}: reruns differ");
            }
            first.unwrap()
        };
        let check = |what: &str, got: &[f32], terms: &dyn Fn(usize, usize) -> f64| {
            for (c, &g) in got.iter().enumerate() {
                let (mut sum, mut mag) = (0.5f64, 0.5f64);
                for i in 0..rows {
                    let t = terms(i, c);
                    sum += t;
                    mag += t.abs();
                }
                assert!(
                    (f64::from(g) - sum).abs() <= 1e-5 * mag,
                    "{what} {rows} x {heads} x {dim} column {c}: {g} vs {sum} (Σ|terms| {mag})"
                );
            }
        };
        let got = runs(
            &|out| elementwise::bias_grad(&gpu, &dx, Dims::new(rows, cols), out).unwrap(),
            cols,
        );
        check("bias_grad", &got, &|i, c| x64[i * cols + c]);
        let got = runs(
            &|out| elementwise::head_weighted_sum(&gpu, &dx, &dw, out).unwrap(),
            cols,
        );
        check("head_weighted_sum", &got, &|i, c| {
            x64[i * cols + c] * w64[i * heads + c / dim]
        });
        // ∂β = Σ dq ⊙ xhat (here xhat = x with every row's inverse norm 1: only the sum is
        // checked).
        let inv = DeviceVec::from_host(&gpu, &vec![1.0f32; rows]).unwrap();
        let (q, q64) = random::<f32>(s.len(), &mut rng);
        let dq = DeviceMatrix::from_host(&gpu, s, &q).unwrap();
        let got = runs(
            &|out| {
                let mut dxo = DeviceMatrix::<f32>::zeros(&gpu, s).unwrap();
                elementwise::row_normalize_backward(
                    &gpu,
                    &dx,
                    &inv,
                    &dq,
                    None,
                    None,
                    &mut dxo,
                    Some(out),
                )
                .unwrap()
            },
            1,
        );
        check("dbeta", &got, &|i, _| {
            (0..cols)
                .map(|c| x64[i * cols + c] * q64[i * cols + c])
                .sum()
        });
    }
}
