//! Timing probes of the fused attention algorithms on a GPU, printed for the per-kernel notes
//! (docs/kernels): `fused_tc`, fused-tc with the rows in the graph's order and as
//! `Reorder::Auto` renumbers them, beside fused-csr; `hybrid`, hybrid beside fused-tc and
//! fused-csr with the plan's calibrated threshold and split; `extras`, each algorithm that takes
//! extras with a bias, dropout and both against itself without (the extras' target ratios:
//! heads 8, head_dim 64, f16; a markdown table and one `extras-json` line per case);
//! `backward_sets`, forward + backward on the tensor-core passes against the fused CUDA-core
//! ones, plain and with extras, on fused-tc's plan in the graph's order and reordered. They print
//! and assert nothing: the published speed claims come from spattn-bench's runs
//! (BENCHMARKS.md), and correctness from the GPU tests.
//!
//! `cargo bench -p spattn --bench probes [-- fused_tc|hybrid|extras|backward_sets]`;
//! SPATTN_TIMING_GRAPHS (a comma list of shared graph names, rmatNN and uniformNN) picks the
//! graphs, SPATTN_TIMING_QUICK=1 only f16, one head of 128 for `fused_tc`. Without a GPU it
//! says so and times nothing.

use half::f16;
use rand_pcg::Pcg64;
use spattn::{
    Algorithm, AttentionConfig, AttentionPlan, BackwardKernels, DeviceBias, DeviceVec, Dropout,
    Extras, ExtrasGrads, Reorder,
};
use spattn_formats::Csr;
use spattn_ops::{DType, DTypeKind, DeviceMatrix, Gpu};
use spattn_test_support::*;

fn main() {
    run_probes(&[
        ("fused_tc", fused_tc),
        ("hybrid", hybrid),
        ("extras", extras),
        ("backward_sets", backward_sets),
    ]);
}

/// GPU time of `plan.forward` in milliseconds after warm-up: the median of `runs` single
/// launches (CUDA events around each), and the mean of `runs` launches back to back between
/// one pair of events (host launch gaps hidden).
fn time_plan<T: DType>(
    gpu: &Gpu,
    plan: &AttentionPlan,
    runs: usize,
    rng: &mut Pcg64,
) -> (f64, f64) {
    let sq = plan.shape_q();
    let skv = plan.shape_kv();
    let q = DeviceMatrix::from_host(gpu, sq, &random_vec::<T>(rng, sq.len(), 1.0)).unwrap();
    let k = DeviceMatrix::from_host(gpu, skv, &random_vec::<T>(rng, skv.len(), 1.0)).unwrap();
    let v = DeviceMatrix::from_host(gpu, skv, &random_vec::<T>(rng, skv.len(), 1.0)).unwrap();
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    let mut time = |n: usize| {
        f64::from(
            gpu.time_ms(|| {
                for _ in 0..n {
                    plan.forward(&q, &k, &v, &mut out).map_err(|e| {
                        spattn_ops::Error::InvalidArgument {
                            what: "forward",
                            why: e.to_string(),
                        }
                    })?;
                }
                Ok(())
            })
            .unwrap(),
        )
    };
    time(5);
    let mut single: Vec<f64> = (0..runs).map(|_| time(1)).collect();
    single.sort_by(f64::total_cmp);
    let batched = time(runs) / runs as f64;
    (single[runs / 2], batched)
}

/// Prints fused-tc with the rows in the graph's order and as `Reorder::Auto` chooses (f16 and
/// f32, head_dim 64/128, heads 1/8), and fused-csr at f16 d=128 h=1: timings only, no
/// assertion. Graphs: cora, pubmed, ogbn-arxiv, R-MAT 16 and 18 by default.
fn fused_tc(gpu: &Gpu) {
    let gpu = gpu.clone();
    let mut rng = fresh_rng("timings");
    println!("device: {}", gpu.name());
    // SPATTN_TIMING_GRAPHS: a comma list of shared graph names and rmatNN (default below);
    // SPATTN_TIMING_QUICK: only f16, 1 head, head_dim 128 (the issue-5 bars' shape).
    let graphs = timing_graphs(
        "SPATTN_TIMING_GRAPHS",
        "cora,pubmed,ogbn-arxiv,rmat16,rmat18",
    );
    let quick = std::env::var("SPATTN_TIMING_QUICK").is_ok();
    let dtypes: &[DTypeKind] = if quick {
        &[DTypeKind::F16]
    } else {
        &[DTypeKind::F16, DTypeKind::F32]
    };
    let shapes: &[(usize, usize)] = if quick {
        &[(1, 128)]
    } else {
        &[(1, 64), (1, 128), (8, 64), (8, 128)]
    };
    for (name, a) in graphs {
        for &dtype in dtypes {
            for &(heads, d) in shapes {
                let mut cell = Vec::new();
                let mut cases = vec![
                    (Algorithm::FusedTensorCore, Reorder::None),
                    (Algorithm::FusedTensorCore, Reorder::Auto),
                ];
                if dtype == DTypeKind::F16 && heads == 1 && d == 128 {
                    cases.push((Algorithm::FusedCsr, Reorder::None));
                }
                for (alg, reorder) in cases {
                    let config = AttentionConfig::new(heads, d, dtype)
                        .with_algorithm(alg)
                        .with_reorder(reorder);
                    let t0 = std::time::Instant::now();
                    let plan = AttentionPlan::new_gpu(&gpu, &a, config).unwrap();
                    let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
                    let (single, batched) = match dtype {
                        DTypeKind::F32 => time_plan::<f32>(&gpu, &plan, 30, &mut rng),
                        _ => time_plan::<f16>(&gpu, &plan, 30, &mut rng),
                    };
                    cell.push(format!("{alg}/{reorder} {single:.4} ({batched:.4})"));
                    if reorder == Reorder::Auto {
                        println!(
                            "plan {name} {dtype} h={heads} d={d}: {} [plan {plan_ms:.0} ms]",
                            plan.choice()
                        );
                    }
                }
                println!(
                    "timing {name:>10} n={:>7} nnz={:>8} {dtype} h={heads} d={d:>3}: {}",
                    a.n_rows(),
                    a.nnz(),
                    cell.join(" | ")
                );
            }
        }
    }
}

/// hybrid beside fused-tc and fused-csr (f16), with the plan's chosen threshold and split:
/// timings only, no assertion.
fn hybrid(gpu: &Gpu) {
    let gpu = gpu.clone();
    let mut rng = fresh_rng("timings");
    println!("device: {}", gpu.name());
    let graphs: Vec<(String, Csr)> = spattn_test_support::timing_graphs(
        "SPATTN_TIMING_GRAPHS",
        "cora,citeseer,pubmed,ogbn-arxiv,rmat16,rmat18",
    )
    .collect();
    for (name, a) in &graphs {
        for (heads, d) in [(1usize, 64usize), (1, 128), (8, 64), (8, 128)] {
            let mut t = Vec::new();
            let mut info = String::new();
            for alg in [
                Algorithm::FusedTensorCore,
                Algorithm::FusedCsr,
                Algorithm::Hybrid,
            ] {
                let config = AttentionConfig::new(heads, d, DTypeKind::F16).with_algorithm(alg);
                let plan = AttentionPlan::new_gpu(&gpu, a, config).unwrap();
                t.push(time_plan::<f16>(&gpu, &plan, 20, &mut rng).0);
                if let Some(i) = plan.hybrid_info() {
                    info = format!(
                        "threshold {:.4} {}:{} tc-edges {:.3} (all-tc {:.4} all-cd {:.4} \
                         chosen {:.4} pred {:.4}, {} timed)",
                        i.threshold,
                        i.tc_warps,
                        i.cd_warps,
                        i.tc_edge_fraction,
                        i.all_tc_ms,
                        i.all_cd_ms,
                        i.chosen_ms,
                        i.predicted_ms,
                        i.candidates
                    );
                }
            }
            println!(
                "attn-timing {name:>10} h={heads} d={d:>3}: fused-tc {:.4} ms, fused-csr {:.4} ms, \
                 hybrid {:.4} ms -> vs best pure {:.2}x | {info}",
                t[0],
                t[1],
                t[2],
                t[0].min(t[1]) / t[2]
            );
        }
    }
}

/// Median GPU time of `f` over `runs` calls after 3 warm-up calls, ms.
fn median_ms(gpu: &Gpu, runs: usize, mut f: impl FnMut() -> spattn::Result<()>) -> f64 {
    // spattn's error cannot travel through the timer's (spattn-ops') `Result`: it panics here.
    let mut call = || {
        if let Err(e) = f() {
            panic!("extras probe: {e}");
        }
        Ok(())
    };
    // Warm-ups timed like the runs (and dropped), so each ends with the GPU idle.
    for _ in 0..3 {
        gpu.time_ms(&mut call).unwrap();
    }
    spattn_ops::median_of_runs(gpu, runs, call).unwrap()
}

/// The extras' target ratios: for each algorithm that takes extras, its forward with a
/// per-head bias, with dropout (rate 0.1), with both, and forward + backward with both, each
/// against the same plan without extras (forward: `AttentionPlan::forward`; backward:
/// `backward` from the forward's output), and forward + backward with dropout alone; for the
/// algorithms that take edge features, forward and backward with edge features alone and with
/// all three; forward and backward with a bias shared by the heads. Graphs:
/// SPATTN_TIMING_GRAPHS (default ogbn-arxiv and R-MAT 18); heads × head_dim
/// SPATTN_EXTRAS_SHAPES (default `8x64`; a comma list); SPATTN_EXTRAS_DTYPE `f16` (default),
/// `bf16` or `f32`; SPATTN_EXTRAS_ALGS a comma list of the algorithms to run (default all);
/// SPATTN_EXTRAS_ONLY=features times only the plain forward and the edge features' forward and
/// forward + backward (the other columns NaN), a third of the device time.
fn extras(gpu: &Gpu) {
    let dtype = std::env::var("SPATTN_EXTRAS_DTYPE").unwrap_or_else(|_| "f16".into());
    for hd in extras_shapes("8x64") {
        match dtype.as_str() {
            "f16" => extras_at::<f16>(gpu, hd),
            "bf16" => extras_at::<half::bf16>(gpu, hd),
            "f32" => extras_at::<f32>(gpu, hd),
            other => panic!("SPATTN_EXTRAS_DTYPE: {other:?} is not f16, bf16 or f32"),
        }
    }
}

/// The heads × head_dim pairs of SPATTN_EXTRAS_SHAPES (a comma list of `HEADSxHEAD_DIM`), or
/// of `default` where it is unset.
fn extras_shapes(default: &str) -> Vec<(usize, usize)> {
    let shapes = std::env::var("SPATTN_EXTRAS_SHAPES").unwrap_or_else(|_| default.into());
    shapes
        .split(',')
        .map(|s| {
            s.split_once('x')
                .and_then(|(h, d)| Some((h.trim().parse().ok()?, d.trim().parse().ok()?)))
                .unwrap_or_else(|| panic!("SPATTN_EXTRAS_SHAPES: {s:?} is not HEADSxHEAD_DIM"))
        })
        .collect()
}

/// [`extras`] at `heads × d` in `T`.
fn extras_at<T: DType>(gpu: &Gpu, (heads, d): (usize, usize)) {
    let gpu = gpu.clone();
    let mut rng = fresh_rng("extras timings");
    println!("device: {}; {heads} × {d} {}", gpu.name(), T::KIND.name());
    println!(
        "| graph | algorithm | fwd ms | +bias | +dropout | +both | fwd+bwd ms | +both | \
         bias × | dropout × | both × | fwd+bwd both × | fwd ef ms | fwd+bwd ef ms | +bias+dropout | \
         fwd+bwd shared bias ms | fwd+bwd dropout ms |"
    );
    println!(
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let algs = std::env::var("SPATTN_EXTRAS_ALGS").ok();
    let features_only = match std::env::var("SPATTN_EXTRAS_ONLY").as_deref() {
        Ok("features") => true,
        Ok(other) => panic!("SPATTN_EXTRAS_ONLY: {other:?} is not `features`"),
        Err(_) => false,
    };
    // A column the run times, or NaN where SPATTN_EXTRAS_ONLY leaves it out.
    let timed = |keep: bool, time: &mut dyn FnMut() -> f64| if keep { time() } else { f64::NAN };
    for (name, a) in timing_graphs("SPATTN_TIMING_GRAPHS", "ogbn-arxiv,rmat18") {
        let bias =
            DeviceVec::from_host(&gpu, &random_vec::<T>(&mut rng, a.nnz() * heads, 1.0)).unwrap();
        let shared = DeviceVec::from_host(&gpu, &random_vec::<T>(&mut rng, a.nnz(), 1.0)).unwrap();
        for alg in [
            Algorithm::FusedTensorCore,
            Algorithm::Hybrid,
            Algorithm::FusedCsr,
            Algorithm::UnfusedCsr,
        ] {
            if !algs
                .as_ref()
                .is_none_or(|o| o.split(',').any(|x| x == alg.to_string()))
            {
                continue;
            }
            let config = AttentionConfig::new(heads, d, T::KIND)
                .with_algorithm(alg)
                .with_edge_extras(true);
            let plan = match AttentionPlan::new_gpu(&gpu, &a, config) {
                Ok(p) => p,
                Err(e) => {
                    println!("| {name} | {alg} | {e} |");
                    continue;
                }
            };
            let (sq, skv) = (plan.shape_q(), plan.shape_kv());
            let up = |s: spattn_ops::Shape, rng: &mut Pcg64| {
                DeviceMatrix::from_host(&gpu, s, &random_vec::<T>(rng, s.len(), 1.0)).unwrap()
            };
            let (q, k, v, g) = (
                up(sq, &mut rng),
                up(skv, &mut rng),
                up(skv, &mut rng),
                up(sq, &mut rng),
            );
            let mut out = DeviceMatrix::<T>::zeros(&gpu, sq).unwrap();
            let (mut dq, mut dk, mut dv) = (
                DeviceMatrix::<T>::zeros(&gpu, sq).unwrap(),
                DeviceMatrix::<T>::zeros(&gpu, skv).unwrap(),
                DeviceMatrix::<T>::zeros(&gpu, skv).unwrap(),
            );
            let mut db = DeviceVec::<T>::zeros(&gpu, bias.len()).unwrap();
            let mut d_shared = DeviceVec::<T>::zeros(&gpu, shared.len()).unwrap();
            let drop = Dropout::new(0.1, 7, 0).unwrap();
            let feats = alg.takes_edge_features().then(|| {
                let s = spattn_ops::Shape::new(a.nnz(), heads, d).unwrap();
                DeviceMatrix::from_host(&gpu, s, &random_vec::<T>(&mut rng, s.len(), 1.0)).unwrap()
            });
            let mut d_feats = feats
                .as_ref()
                .map(|f| DeviceMatrix::<T>::zeros(&gpu, f.shape()).unwrap());
            let with_ef = |b: bool, dr: bool, ef: bool| Extras {
                bias: b.then_some(DeviceBias::PerHead(&bias)),
                edge_features: if ef { feats.as_ref() } else { None },
                dropout: dr.then_some(drop),
            };
            let with = |b: bool, dr: bool| with_ef(b, dr, false);
            let runs = 20;
            let plain = median_ms(&gpu, runs, || plan.forward(&q, &k, &v, &mut out));
            let mut fwd = |b: bool, dr: bool| {
                let ex = with(b, dr);
                median_ms(&gpu, runs, || {
                    plan.forward_with(&q, &k, &v, &ex, &mut out, None)
                })
            };
            let all = !features_only;
            let tb = timed(all, &mut || fwd(true, false));
            let td = timed(all, &mut || fwd(false, true));
            let tbd = timed(all, &mut || fwd(true, true));
            let ef_fwd = if feats.is_some() {
                let ex = with_ef(false, false, true);
                median_ms(&gpu, runs, || {
                    plan.forward_with(&q, &k, &v, &ex, &mut out, None)
                })
            } else {
                f64::NAN
            };
            let mut y = DeviceMatrix::<T>::zeros(&gpu, sq).unwrap();
            plan.forward(&q, &k, &v, &mut y).unwrap();
            let plain_fb = timed(all, &mut || {
                median_ms(&gpu, runs, || {
                    plan.forward(&q, &k, &v, &mut out)?;
                    plan.backward(&q, &k, &v, &y, &g, &mut dq, &mut dk, &mut dv)
                        .map(|_| ())
                })
            });
            // Forward + backward with `ex`, into the gradients its extras need.
            let mut fb = |ex: &Extras<'_, T>,
                          mut d_bias: Option<&mut DeviceVec<T>>,
                          mut d_feats: Option<&mut DeviceMatrix<T>>| {
                median_ms(&gpu, runs, || {
                    plan.forward_with(&q, &k, &v, ex, &mut out, None)?;
                    let grads = ExtrasGrads {
                        dq: &mut dq,
                        dk: &mut dk,
                        dv: &mut dv,
                        d_bias: d_bias.as_deref_mut(),
                        d_edge_features: d_feats.as_deref_mut(),
                    };
                    plan.backward_with_extras(&q, &k, &v, ex, &g, grads)
                        .map(|_| ())
                })
            };
            let both_fb = timed(all, &mut || fb(&with(true, true), Some(&mut db), None));
            let drop_fb = timed(all, &mut || fb(&with(false, true), None, None));
            let (ef, ef_both) = match d_feats.as_mut() {
                Some(df) => (
                    fb(&with_ef(false, false, true), None, Some(&mut *df)),
                    timed(all, &mut || {
                        fb(&with_ef(true, true, true), Some(&mut db), Some(&mut *df))
                    }),
                ),
                None => (f64::NAN, f64::NAN),
            };
            let sb = Extras {
                bias: Some(DeviceBias::Shared(&shared)),
                edge_features: None,
                dropout: None,
            };
            let shared_fb = timed(all, &mut || fb(&sb, Some(&mut d_shared), None));
            println!(
                "| {name} | {alg} | {plain:.4} | {tb:.4} | {td:.4} | {tbd:.4} | {plain_fb:.4} | \
                 {both_fb:.4} | {:.3} | {:.3} | {:.3} | {:.3} | {ef_fwd:.4} | {ef:.4} | {ef_both:.4} | {shared_fb:.4} | {drop_fb:.4} |",
                tb / plain,
                td / plain,
                tbd / plain,
                both_fb / plain_fb
            );
            println!(
                "extras-json {{\"graph\":\"{name}\",\"nnz\":{},\"algorithm\":\"{alg}\",\"heads\":{heads},\
                 \"head_dim\":{d},\"dtype\":\"{}\",\"fwd_ms\":{plain},\"bias_ms\":{tb},\
                 \"dropout_ms\":{td},\"both_ms\":{tbd},\"fwd_bwd_ms\":{plain_fb},\
                 \"both_fwd_bwd_ms\":{both_fb},\"ef_fwd_ms\":{ef_fwd},\"ef_fwd_bwd_ms\":{ef},\"ef_both_fwd_bwd_ms\":{ef_both},\
                 \"shared_bias_fwd_bwd_ms\":{shared_fb},\"dropout_fwd_bwd_ms\":{drop_fb}}}",
                a.nnz(),
                T::KIND.name()
            );
        }
    }
}

/// Forward + backward (GPU time, medians of 20) on the tensor-core passes and on the fused
/// CUDA-core passes, without extras and with a per-head bias, dropout 0.1, both, and a shared
/// bias, on fused-tc's plan with the rows in the graph's order (as a graph seen once has them) and as
/// `Reorder::Auto` renumbers them; beside each graph its 16 × 8 blocks' mean edge count in the
/// graph's order. Graphs: SPATTN_TIMING_GRAPHS (default pubmed, ogbn-arxiv, R-MAT 16 and 18,
/// uniform17); heads × head_dim: SPATTN_EXTRAS_SHAPES (default `1x64,8x32,8x64`); f16;
/// SPATTN_SETS_RUNS runs a median (default 20; 1 under a profiler), SPATTN_SETS_CASES a comma
/// list of the cases to run (default all), SPATTN_SETS_REORDER `none` or `auto` alone. One `sets-json` line per case.
fn backward_sets(gpu: &Gpu) {
    let runs =
        std::env::var("SPATTN_SETS_RUNS").map_or(20, |r| r.parse().expect("SPATTN_SETS_RUNS"));
    let only = std::env::var("SPATTN_SETS_CASES").ok();
    let wanted = |what: &str| {
        only.as_ref()
            .is_none_or(|o| o.split(',').any(|c| c == what))
    };
    // SPATTN_SETS_REORDER: none or auto alone (default both).
    let reorders = match std::env::var("SPATTN_SETS_REORDER").as_deref() {
        Ok("none") => vec![Reorder::None],
        Ok("auto") => vec![Reorder::Auto],
        _ => vec![Reorder::None, Reorder::Auto],
    };
    let gpu = gpu.clone();
    let mut rng = fresh_rng("backward sets");
    let shapes = extras_shapes("1x64,8x32,8x64");
    println!("device: {}", gpu.name());
    let graphs = "pubmed,ogbn-arxiv,rmat16,rmat18,uniform17";
    for (name, a) in timing_graphs("SPATTN_TIMING_GRAPHS", graphs) {
        let bsb = spattn_formats::Bsb::from_csr(&a).unwrap();
        let per_block = a.nnz() as f64 / bsb.n_blocks().max(1) as f64;
        println!(
            "{name}: {} rows, {} edges, {per_block:.2} edges a block",
            a.n_rows(),
            a.nnz()
        );
        for &(heads, d) in &shapes {
            for reorder in reorders.iter().copied() {
                let config = AttentionConfig::new(heads, d, DTypeKind::F16)
                    .with_algorithm(Algorithm::FusedTensorCore)
                    .with_edge_extras(true)
                    .with_edge_features(false)
                    .with_reorder(reorder);
                let plan = match AttentionPlan::new_gpu(&gpu, &a, config) {
                    Ok(p) => p,
                    Err(e) => {
                        println!("| {name} | {heads}x{d} | {reorder} | {e} |");
                        continue;
                    }
                };
                let (sq, skv) = (plan.shape_q(), plan.shape_kv());
                let mut up = |s: spattn_ops::Shape| {
                    DeviceMatrix::from_host(&gpu, s, &random_vec::<f16>(&mut rng, s.len(), 1.0))
                        .unwrap()
                };
                let (q, k, v, g) = (up(sq), up(skv), up(skv), up(sq));
                let bias =
                    DeviceVec::from_host(&gpu, &random_vec::<f16>(&mut rng, a.nnz() * heads, 1.0))
                        .unwrap();
                let shared =
                    DeviceVec::from_host(&gpu, &random_vec::<f16>(&mut rng, a.nnz(), 1.0)).unwrap();
                let mut out = DeviceMatrix::<f16>::zeros(&gpu, sq).unwrap();
                let [mut dq, mut dk, mut dv] =
                    [sq, skv, skv].map(|s| DeviceMatrix::<f16>::zeros(&gpu, s).unwrap());
                let mut db = DeviceVec::<f16>::zeros(&gpu, bias.len()).unwrap();
                let mut ds = DeviceVec::<f16>::zeros(&gpu, shared.len()).unwrap();
                let drop = Dropout::new(0.1, 7, 0).unwrap();
                let cases: [(&str, Option<DeviceBias<'_, f16>>, bool); 5] = [
                    ("plain", None, false),
                    ("bias", Some(DeviceBias::PerHead(&bias)), false),
                    ("dropout", None, true),
                    ("bias+dropout", Some(DeviceBias::PerHead(&bias)), true),
                    ("shared", Some(DeviceBias::Shared(&shared)), false),
                ];
                for (what, b, dr) in cases {
                    if !wanted(what) {
                        continue;
                    }
                    let ex = Extras {
                        bias: b,
                        edge_features: None,
                        dropout: dr.then_some(drop),
                    };
                    let auto = plan.backward_kernels_with_extras(&ex);
                    let mut time = |kernels: BackwardKernels| {
                        median_ms(&gpu, runs, || {
                            plan.forward_with(&q, &k, &v, &ex, &mut out, None)?;
                            let d_bias = match b {
                                Some(DeviceBias::Shared(_)) => Some(&mut ds),
                                Some(_) => Some(&mut db),
                                None => None,
                            };
                            let grads = ExtrasGrads {
                                dq: &mut dq,
                                dk: &mut dk,
                                dv: &mut dv,
                                d_bias,
                                d_edge_features: None,
                            };
                            plan.backward_with_extras_using(kernels, &q, &k, &v, &ex, &g, grads)
                                .map(|_| ())
                        })
                    };
                    let tc = time(BackwardKernels::TensorCore);
                    let fused = time(BackwardKernels::Fused);
                    println!(
                        "| {name} | {heads}x{d} | {reorder} | {what} | tc {tc:.4} | fused {fused:.4} | \
                         fused/tc {:.3} | auto {auto:?} |",
                        fused / tc
                    );
                    println!(
                        "sets-json {{\"graph\":\"{name}\",\"nnz\":{},\"per_block\":{per_block},\
                         \"heads\":{heads},\"head_dim\":{d},\"reorder\":\"{reorder}\",\
                         \"extras\":\"{what}\",\"tc_ms\":{tc},\"fused_ms\":{fused},\
                         \"auto\":\"{auto:?}\"}}",
                        a.nnz()
                    );
                }
            }
        }
    }
}
