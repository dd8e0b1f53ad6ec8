//! Criterion benchmarks of every GPU case of spattn-bench's registry (the CSR ops and the
//! attention algorithms) on cora and R-MAT scale 14, heads 1, head_dim 64 and 128, f16 and f32,
//! timed with CUDA events through `iter_custom` (the sum of the event-timed iterations).
//!
//! Without a GPU, a CPU group times `cpu::attention` (f32) on cora, so `cargo bench` does
//! something everywhere.
//!
//! `cargo bench -p spattn-bench [-- FILTER]`.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use spattn_bench::cases::{self, Problem, Target};
use spattn_bench::gpu_bench::{self, GpuConfig};
use spattn_bench::graphs::{self, DataDirs, Graph, GraphSpec, LoadOptions};
use spattn_bench::inputs::HostInputs;
use spattn_ops::DeviceGraph;
use spattn_ops::{cpu, DType, DTypeKind, Gpu};

const HEADS: usize = 1;
const HEAD_DIMS: [usize; 2] = [64, 128];
const SEED: u64 = 1;

fn load(spec: GraphSpec) -> Graph {
    let dirs = DataDirs::new(None);
    let options = LoadOptions {
        data_dirs: &dirs,
        symmetrize: true,
        rmat_seed: 1,
        host_memory: None,
    };
    graphs::load(&spec, &options).unwrap_or_else(|e| panic!("loading {spec:?}: {e}"))
}

fn gpu_config<T: DType>(
    c: &mut Criterion,
    gpu: &Gpu,
    graph: &Graph,
    dev: &std::sync::Arc<DeviceGraph>,
    head_dim: usize,
) {
    let a = &graph.csr;
    let host =
        HostInputs::<T>::draw(a.n_rows(), a.n_cols(), HEADS, head_dim, SEED).expect("inputs");
    let mut cfg = GpuConfig::new(gpu, a, dev, host, false).expect("uploading the inputs");
    let mut timer = gpu.timer().expect("CUDA events");
    let mut group = c.benchmark_group(format!("{}/{}", graph.name, T::NAME));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let problem = Problem {
        n_rows: a.n_rows() as u64,
        n_cols: a.n_cols() as u64,
        nnz: a.nnz() as u64,
        heads: HEADS as u64,
        head_dim: head_dim as u64,
        dtype: T::KIND,
    };
    for case in cases::cases_for(Target::Gpu) {
        let mut launch = match gpu_bench::prepare(case, &mut cfg) {
            Ok(gpu_bench::Prepared::Ready(launch)) => launch,
            Ok(gpu_bench::Prepared::Unsupported(why)) => {
                eprintln!("{}: skipped: {why}", case.name);
                continue;
            }
            Err(e) => {
                eprintln!("{}: cannot be prepared: {e}", case.name);
                continue;
            }
        };
        // Bytes of the HBM floor per iteration: criterion's GB/s is then the effective bandwidth.
        group.throughput(Throughput::Bytes(cases::floor_bytes(case, &problem)));
        group.bench_function(BenchmarkId::new(case.name, format!("D{head_dim}")), |b| {
            b.iter_custom(|iters| {
                let mut total_ms = 0.0f64;
                for _ in 0..iters {
                    timer.start().expect("start event");
                    launch.launch().expect("launch");
                    timer.stop().expect("stop event");
                    total_ms += f64::from(timer.elapsed_ms().expect("event time"));
                }
                Duration::from_secs_f64(total_ms / 1e3)
            })
        });
    }
    group.finish();
}

fn gpu_benches(c: &mut Criterion, gpu: &Gpu) {
    for spec in [GraphSpec::Cora, GraphSpec::Rmat(14)] {
        let graph = load(spec);
        let dev = gpu_bench::shared_graph(gpu, &graph.csr);
        for dtype in [DTypeKind::F16, DTypeKind::F32] {
            for head_dim in HEAD_DIMS {
                match dtype {
                    DTypeKind::F16 => gpu_config::<half::f16>(c, gpu, &graph, &dev, head_dim),
                    DTypeKind::F32 => gpu_config::<f32>(c, gpu, &graph, &dev, head_dim),
                    DTypeKind::Bf16 => gpu_config::<half::bf16>(c, gpu, &graph, &dev, head_dim),
                }
            }
        }
    }
}

fn cpu_benches(c: &mut Criterion) {
    let graph = load(GraphSpec::Cora);
    let a = &graph.csr;
    let mut group = c.benchmark_group("cpu/cora/f32");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    for head_dim in HEAD_DIMS {
        let host =
            HostInputs::<f32>::draw(a.n_rows(), a.n_cols(), HEADS, head_dim, SEED).expect("inputs");
        let inputs = cpu::AttentionInputs::new(
            &host.q,
            host.shape_q,
            &host.k,
            host.shape_kv,
            &host.v,
            host.shape_kv,
        );
        let mut out = vec![0.0f32; host.shape_q.len()];
        group.bench_function(
            BenchmarkId::new("cpu-unfused", format!("D{head_dim}")),
            |b| {
                b.iter(|| cpu::attention(a, &inputs, host.scale, &mut out).expect("cpu::attention"))
            },
        );
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    match Gpu::new(0) {
        Ok(gpu) => gpu_benches(c, &gpu),
        Err(e) => {
            eprintln!("no GPU ({e}): timing cpu::attention on cora instead");
            cpu_benches(c);
        }
    }
}

// A plain `main` rather than `criterion_group!`, whose generated `pub fn` has no doc comment.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    benches(&mut c);
    c.final_summary();
}
