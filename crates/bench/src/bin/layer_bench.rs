//! `layer_bench`: forward and forward + backward GPU time of the spattn layers (GATConv,
//! AGNNConv, the graph-transformer attention layer) per graph and dtype, the Rust side of the
//! layer comparison with PyG and torch.sparse (`peers/layer_peers.py`).
//!
//! ```sh
//! layer_bench --data ../shared/data/mtx --graphs cora pubmed ogbn-arxiv --rmat 16 17 18 \
//!             --dtype f32 f16 --dump-dir graphs --json layers.json
//! ```
//!
//! Shapes (the peers use the same): 64 input features; GAT 8 heads × 8 (concatenated, bias);
//! AGNN on 64 features (β learnable); transformer 8 heads × 8 with Q/K/V/O projections
//! 64 → 64 and biases. Each case: 3 warm-up steps, then the median of `--reps` CUDA-event
//! timings of one forward, and of one forward + backward (parameter gradients included; the
//! optimizer step is not timed). Graphs are symmetrized with self loops; `--dump-dir` writes
//! each as the binary CSR that the peer script reads, so both time the same graph.

use std::path::PathBuf;

use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn::layers::{
    AgnnConv, GatConfig, GatConv, GpuContext, GpuGraph, GraphTransformerLayer, Host, HostGraph,
    TransformerConfig,
};
use spattn::Algorithm;
use spattn_formats::{read_matrix_market, rmat, Csr, RmatConfig};
use spattn_ops::GemmElement;
use spattn_ops::{DType, DTypeKind, DeviceMatrix, Gpu, Shape};

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "GPU time of the spattn layers' forward and backward")]
struct Args {
    /// Folder of the MatrixMarket graphs.
    #[arg(long, default_value = "../shared/data/mtx")]
    data: PathBuf,
    /// Graph names (FILE.mtx.gz in --data).
    #[arg(long, num_args = 0.., default_values = ["cora", "pubmed", "ogbn-arxiv"])]
    graphs: Vec<String>,
    /// R-MAT scales (symmetrized, with self loops).
    #[arg(long, num_args = 0.., default_values_t = [16u32, 17, 18])]
    rmat: Vec<u32>,
    /// Element types.
    #[arg(long, num_args = 1.., default_values = ["f32", "f16"])]
    dtype: Vec<DTypeKind>,
    /// Timed repetitions per case.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Write each graph as NAME.csr here (for peers/layer_peers.py).
    #[arg(long)]
    dump_dir: Option<PathBuf>,
    /// Write the records as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

const FEATURES: usize = 64;
const HEADS: usize = 8;
const HEAD_DIM: usize = 8;

/// One measured case.
struct Record {
    layer: &'static str,
    graph: String,
    n: usize,
    nnz: usize,
    dtype: DTypeKind,
    algorithm: String,
    forward_ms: f32,
    train_ms: f32,
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

/// Median GPU time of `f` over `reps` runs after 3 warm-ups.
fn time(gpu: &Gpu, reps: usize, mut f: impl FnMut() -> spattn::Result<()>) -> spattn::Result<f32> {
    for _ in 0..3 {
        f()?;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let mut err = None;
        let ms = gpu.time_ms(|| {
            if let Err(e) = f() {
                err = Some(e);
            }
            Ok(())
        })?;
        if let Some(e) = err {
            return Err(e);
        }
        times.push(ms);
    }
    Ok(median(times))
}

fn random<T: DType>(gpu: &Gpu, n: usize, rng: &mut Pcg64) -> spattn::Result<DeviceMatrix<T>> {
    let host: Vec<T> = (0..n * FEATURES)
        .map(|_| T::from_f64(rng.random_range(-1.0..1.0)))
        .collect();
    Ok(DeviceMatrix::from_host(
        gpu,
        Shape::new(n, 1, FEATURES)?,
        &host,
    )?)
}

fn bench_graph<T: GemmElement>(
    ctx: &GpuContext,
    name: &str,
    a: &Csr,
    reps: usize,
    out: &mut Vec<Record>,
) -> spattn::Result<()> {
    let gpu = ctx.gpu();
    let host = HostGraph::new(a)?;
    let dev = GpuGraph::upload(ctx, &host)?;
    let mut rng = Pcg64::seed_from_u64(1);
    let x = random::<T>(gpu, a.n_rows(), &mut rng)?;
    let dy = random::<T>(gpu, a.n_rows(), &mut rng)?;
    let mut push = |layer, algorithm: String, forward_ms, train_ms| {
        let r = Record {
            layer,
            graph: name.to_string(),
            n: a.n_rows(),
            nnz: a.nnz(),
            dtype: T::KIND,
            algorithm,
            forward_ms,
            train_ms,
        };
        println!(
            "{:<12} {:<12} {:<5} n {:>8} nnz {:>9}  forward {:>8.3} ms  forward+backward {:>8.3} ms  ({})",
            r.layer, r.graph, r.dtype, r.n, r.nnz, r.forward_ms, r.train_ms, r.algorithm
        );
        out.push(r);
    };

    let mut gat = GatConv::<Host<f32>>::new(GatConfig::new(FEATURES, HEAD_DIM, HEADS), &host, 1)?
        .to_device::<T>(&dev)?;
    let fwd = time(gpu, reps, || gat.forward(&x).map(|_| ()))?;
    let step = time(gpu, reps, || {
        let (_, cache) = gat.forward(&x)?;
        gat.backward(&cache, &dy).map(|_| ())
    })?;
    push("gat", "csr ops".into(), fwd, step);

    let mut agnn =
        AgnnConv::<Host<f32>>::new(FEATURES, &host, Algorithm::Auto)?.to_device::<T>(&dev)?;
    let alg = agnn.plan().algorithm().to_string();
    let fwd = time(gpu, reps, || agnn.forward(&x).map(|_| ()))?;
    let step = time(gpu, reps, || {
        let (_, cache) = agnn.forward(&x)?;
        agnn.backward(&cache, &dy).map(|_| ())
    })?;
    push("agnn", alg, fwd, step);

    let cfg = TransformerConfig::new(FEATURES, HEADS, HEAD_DIM, FEATURES);
    let mut tr = GraphTransformerLayer::<Host<f32>>::new(cfg, &host, 1)?.to_device::<T>(&dev)?;
    let alg = tr.plan().algorithm().to_string();
    let fwd = time(gpu, reps, || tr.forward(&x).map(|_| ()))?;
    let step = time(gpu, reps, || {
        let (_, cache) = tr.forward(&x)?;
        tr.backward(&cache, &dy).map(|_| ())
    })?;
    push("transformer", alg, fwd, step);
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let gpu = Gpu::new(0)?;
    let ctx = GpuContext::new(&gpu)?;
    println!("{} (driver {:?})", gpu.name(), gpu.driver_version()?);
    let mut graphs: Vec<(String, Csr)> = Vec::new();
    for g in &args.graphs {
        let path = args.data.join(format!("{g}.mtx.gz"));
        match read_matrix_market(&path) {
            Ok(a) => graphs.push((g.clone(), a.symmetrize_with_self_loops()?)),
            Err(e) => println!("skipping {g}: {e}"),
        }
    }
    for &s in &args.rmat {
        let cfg = RmatConfig::new(s)
            .with_seed(1)
            .with_symmetrize(true)
            .with_self_loops(true);
        graphs.push((format!("rmat-{s}"), rmat(&cfg)?));
    }
    let mut records = Vec::new();
    for (name, a) in &graphs {
        if let Some(dir) = &args.dump_dir {
            std::fs::create_dir_all(dir)?;
            spattn_bench::csr_file::write_csr(&dir.join(format!("{name}.csr")), a)?;
        }
        for &dt in &args.dtype {
            match dt {
                DTypeKind::F32 => bench_graph::<f32>(&ctx, name, a, args.reps, &mut records)?,
                DTypeKind::F16 => bench_graph::<half::f16>(&ctx, name, a, args.reps, &mut records)?,
                DTypeKind::Bf16 => {
                    bench_graph::<half::bf16>(&ctx, name, a, args.reps, &mut records)?
                }
            }
        }
    }
    if let Some(path) = &args.json {
        let json: Vec<serde_json::Value> = records
            .iter()
            .map(|r| {
                serde_json::json!({
                    "layer": r.layer, "graph": r.graph, "n": r.n, "nnz": r.nnz,
                    "dtype": r.dtype.name(), "algorithm": r.algorithm,
                    "forward_ms": r.forward_ms, "train_ms": r.train_ms, "gpu": gpu.name(),
                })
            })
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}
