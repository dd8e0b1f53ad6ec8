//! The fused tensor-core kernel's tuning probe: `tune` (ignored; needs a GPU; idle unless
//! `SPATTN_PROBES` is set) times the kernels, row orders, chunk sizes and CTA sizes over the
//! graphs and shapes named by environment variables, and prints the timings.

use super::tests::draw_f16;
use super::*;

/// Times the kernels, row orders, chunk sizes and CTA sizes (graphs found as every test finds
/// them, by `spattn_test_support::shared_graph`: `SPATTN_DATA_DIR` first;
/// `SPATTN_TUNE_GRAPHS` a comma list of graph names or `rmatSCALE`, default pubmed and
/// ogbn-arxiv; `SPATTN_TUNE_SHAPES` a comma list of HEADSxHEAD_DIM, default 1x128,1x64,8x64);
/// prints only. Q, K and V are separate random buffers (one buffer for all three would let
/// the kernel's evict-first Q loads evict K/V rows). "single" is the median of events
/// around one forward (launch latency included, as spattn-bench measures), "batched" the
/// mean of 20 back-to-back forwards.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tune() {
    use crate::Shape;
    if !crate::probes::enabled() {
        return;
    }
    let gpu = Gpu::new(0).expect("an NVIDIA GPU");
    let graphs = std::env::var("SPATTN_TUNE_GRAPHS").unwrap_or_else(|_| "pubmed,ogbn-arxiv".into());
    let shapes: Vec<(usize, usize)> = std::env::var("SPATTN_TUNE_SHAPES")
        .unwrap_or_else(|_| "1x128,1x64,8x64".into())
        .split(',')
        .map(|hd| {
            let (h, d) = hd.split_once('x').expect("HEADSxHEAD_DIM");
            (h.parse().expect("heads"), d.parse().expect("head_dim"))
        })
        .collect();
    for name in graphs.split(',') {
        let a = match name.strip_prefix("rmat") {
            Some(scale) => spattn_formats::rmat(&spattn_formats::RmatConfig::benchmark(
                scale.parse().expect("rmatSCALE"),
            ))
            .unwrap(),
            None => spattn_test_support::shared_graph(name),
        };
        println!("tune {name}: n={} nnz={}", a.n_rows(), a.nnz());
        // Each row order and its BSB once, for every variant below.
        let orders: Vec<(Reorder, Arc<OrderedBsb>)> = [
            Reorder::None,
            Reorder::Degree,
            Reorder::Locality,
            Reorder::Cluster,
        ]
        .into_iter()
        .map(|r| (r, Arc::new(OrderedBsb::upload(&gpu, &a, r).unwrap())))
        .collect();
        for &(heads, d) in &shapes {
            let sq = Shape::new(a.n_rows(), heads, d).unwrap();
            let draw = |seed: usize| draw_f16(&gpu, sq, seed);
            let (q, k, v) = (draw(1), draw(2), draw(3));
            let mut out = DeviceMatrix::<half::f16>::zeros(&gpu, sq).unwrap();
            for (reorder, ordered) in &orders {
                let mut variants = vec![Options {
                    pipelined: false,
                    ..Options::default()
                }];
                for cta_warps in [None, Some(1), Some(4)] {
                    for chunk in [None, Some(8), Some(16), Some(32), Some(64)] {
                        variants.push(Options {
                            chunk,
                            cta_warps,
                            ..Options::default()
                        });
                    }
                }
                for options in variants {
                    let Ok(mut f) = FusedTensorCore::with_options::<half::f16>(
                        &gpu,
                        ordered.clone(),
                        heads,
                        d,
                        options,
                    ) else {
                        continue;
                    };
                    let mut run = |n: usize| {
                        gpu.time_ms(|| {
                            for _ in 0..n {
                                f.forward(&gpu, &q, &k, &v, 0.1, &mut out).map_err(|e| {
                                    crate::Error::InvalidArgument {
                                        what: "forward",
                                        why: e.to_string(),
                                    }
                                })?;
                            }
                            Ok(())
                        })
                        .unwrap()
                    };
                    run(3);
                    let mut t: Vec<f32> = (0..25).map(|_| run(1)).collect();
                    t.sort_by(f32::total_cmp);
                    let batched = run(20) / 20.0;
                    println!(
                        "tune {name:>10} h={heads} d={d} {reorder:>8} {:>22} chunk={:<8} \
                         cta={:<8} units={:>6}: {:.4} ms single, {:.4} ms batched",
                        f.kernel,
                        format!("{:?}", options.chunk),
                        format!("{:?}", options.cta_warps),
                        f.n_units,
                        t[t.len() / 2],
                        batched
                    );
                }
            }
        }
    }
}
