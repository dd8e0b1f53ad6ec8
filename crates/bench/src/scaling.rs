//! `spattn-bench --gpus N`: the partitioned plan on 1, 2, 4, … N GPUs of this host, one rank
//! per GPU, the halo moved by NCCL ([`spattn::partition::run_nccl`]). Strong scaling: the same
//! graph on every rank count; weak scaling (`--weak-rmat S`): R-MAT `S + log2 P` on P GPUs (P a
//! power of two), so each GPU keeps about the same edges.
//!
//! Per rank count it prints and records (`--json`): the forward time (the slowest rank's median
//! of `--reps` wall-clock runs, each between two barriers, the halo exchange included), the
//! efficiency against one GPU (`T1 / (P · TP)` strong, `T1 / TP` weak; T1 the plain one-GPU
//! plan's forward, i.e. the P = 1 rank's local forward), the plan build time,
//! and per rank its rows, edges, halo rows, rows sent and received, bytes moved per forward and
//! the device memory in use. Freed device memory stays in each GPU's pool
//! ([`spattn::Gpu::keep_freed_memory`]), as torch's caching allocator keeps it. Results are not
//! checked here: the partitioned plan's tests compare it with the single plan.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use spattn::partition::{run_nccl, Exchange, NcclExchange, Partition, RankPlan};
use spattn::{AttentionConfig, Csr, DType, DTypeKind, DeviceMatrix, Gpu, Shape};

use crate::cli::RunArgs;
use crate::error::{Error, Result};
use crate::graphs::{self, GraphSpec};
use crate::inputs::{config_seed, mix64};
use crate::{outln, record};

/// Version of the scaling JSON.
pub const SCALING_SCHEMA_VERSION: u32 = 1;

/// A scaling run: every rank count of every graph and shape.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ScalingRecord {
    /// [`SCALING_SCHEMA_VERSION`].
    pub schema: u32,
    /// `spattn-bench <version>`.
    pub tool: String,
    /// When the run started, RFC 3339 UTC.
    pub date: String,
    /// The git commit of the binary.
    pub commit: String,
    /// The command line.
    pub command: String,
    /// The GPUs, by ordinal: name as the driver reports it.
    pub gpus: Vec<String>,
    /// `"strong"` or `"weak"`.
    pub mode: String,
    /// One entry per graph × shape × rank count.
    pub runs: Vec<ScalingRun>,
}

/// One graph and shape on `ranks` GPUs.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ScalingRun {
    /// Graph name.
    pub graph: String,
    /// Its nodes and edges.
    pub nodes: usize,
    /// Edges (nnz).
    pub edges: usize,
    /// Heads.
    pub heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// The algorithm the ranks' local plans ran (`mixed` where `auto` chose differently on
    /// some; each rank's is in `per_rank`).
    pub algorithm: String,
    /// Ranks (GPUs).
    pub ranks: usize,
    /// Forward time: the slowest rank's median, ms.
    pub forward_ms: f64,
    /// Against one GPU: `T1 / (P · TP)` (strong) or `T1 / TP` (weak), T1 the one-GPU plan's
    /// forward (the P = 1 rank's local forward, without the copy its exchange makes); NaN
    /// where the ladder has no P = 1 run.
    pub efficiency: f64,
    /// The slowest rank's plan build (its requests exchanged, its local plan), ms.
    pub plan_ms: f64,
    /// Per rank.
    pub per_rank: Vec<RankRecord>,
}

/// What one rank holds and moves.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RankRecord {
    /// Its rows.
    pub rows: usize,
    /// Its rows' edges.
    pub edges: usize,
    /// K/V rows its edges touch.
    pub halo_rows: usize,
    /// Of those, other ranks' rows (received per forward).
    pub received_rows: usize,
    /// Rows it sends to other ranks per forward.
    pub sent_rows: usize,
    /// Bytes received per forward (K and V).
    pub received_bytes: u64,
    /// Bytes sent per forward (K and V).
    pub sent_bytes: u64,
    /// Its median forward, ms.
    pub forward_ms: f64,
    /// Of it, the median halo exchange alone (own rows gathered into the halo, the others
    /// packed and moved by NCCL), ms, timed separately.
    pub exchange_ms: f64,
    /// Of it, the median local plan's forward alone on the gathered halo, ms, timed separately.
    pub local_ms: f64,
    /// Its partition step (local CSR, halo, send lists), ms.
    pub rank_plan_ms: f64,
    /// Its local attention plan's build (order, formats, uploads), ms.
    pub local_plan_ms: f64,
    /// The algorithm its local plan ran.
    pub algorithm: String,
    /// Device memory in use after the runs: the whole GPU's, as the driver reports it, less the
    /// freed memory this process's pool keeps.
    pub device_used_bytes: u64,
}

/// 1, 2, 4, … up to `n`, and `n`.
pub fn rank_ladder(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |&p| p.checked_mul(2))
        .take_while(|&p| p <= n)
        .collect();
    if v.last() != Some(&n) && n > 0 {
        v.push(n);
    }
    v
}

/// Uniform values in [-1, 1) of element `i` under `seed`: a hash of the element, so every rank
/// draws its own rows without the whole matrix on any host.
fn value(seed: u64, i: u64) -> f32 {
    ((mix64(seed ^ mix64(i)) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The rows `rows` of an `n × row_len` input matrix `which` (0: Q, 1: K, 2: V).
fn rows_of<T: DType>(
    seed: u64,
    which: u64,
    rows: std::ops::Range<usize>,
    row_len: usize,
) -> Vec<T> {
    let s = seed ^ (which << 56);
    (rows.start * row_len..rows.end * row_len)
        .map(|i| T::from_f32(value(s, i as u64)))
        .collect()
}

/// One rank's measurement.
struct RankResult {
    stats: spattn::partition::RankStats,
    plan_ms: f64,
    rank_plan_ms: f64,
    forward_ms: f64,
    exchange_ms: f64,
    local_ms: f64,
    algorithm: String,
    device_used: u64,
}

/// The median of `reps` timed calls of `f` after `warmup` untimed ones, each started after a
/// barrier and ended by a device synchronisation, ms.
fn median_between_barriers(
    ex: &NcclExchange,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> spattn::Result<()>,
) -> spattn::Result<f64> {
    let mut times = Vec::with_capacity(reps);
    for i in 0..warmup + reps {
        barrier(ex)?;
        let t = Instant::now();
        f()?;
        ex.gpu().synchronize()?;
        if i >= warmup {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    // reps >= 1: the CLI refuses 0.
    Ok(times[times.len() / 2])
}

/// A barrier: an all-to-all of nothing.
fn barrier(ex: &NcclExchange) -> spattn::Result<()> {
    ex.all_to_all::<u8>(vec![Vec::new(); ex.world()])
        .map(|_| ())
}

#[allow(clippy::too_many_arguments)]
fn rank_run<T: DType>(
    ex: &NcclExchange,
    a: &Csr,
    part: &Partition,
    config: &AttentionConfig,
    seed: u64,
    warmup: usize,
    reps: usize,
) -> spattn::Result<RankResult> {
    let gpu = ex.gpu();
    let (heads, dim) = (config.heads, config.head_dim);
    let row_len = heads * dim;
    let t0 = Instant::now();
    let plan = RankPlan::new(a, part, ex)?;
    let rank_plan_ms = t0.elapsed().as_secs_f64() * 1e3;
    let local = plan.gpu_plan(gpu, config.clone())?;
    gpu.synchronize()?;
    let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (rows, kv) = (plan.rows(), plan.kv_rows());
    let up = |which: u64, r: std::ops::Range<usize>| -> spattn::Result<DeviceMatrix<T>> {
        let s = Shape::new(r.len(), heads, dim)?;
        Ok(DeviceMatrix::from_host(
            gpu,
            s,
            &rows_of::<T>(seed, which, r, row_len),
        )?)
    };
    let (q, k, v) = (up(0, rows.clone())?, up(1, kv.clone())?, up(2, kv)?);
    let mut out = DeviceMatrix::<T>::zeros(gpu, q.shape())?;
    let forward_ms = median_between_barriers(ex, warmup, reps, || {
        plan.forward_gpu(ex, &local, &q, &k, &v, &mut out)
            .map(|_| ())
    })?;
    // The two halves apart: where the time goes when ranks do not scale.
    let exchange_ms = median_between_barriers(ex, warmup, reps, || {
        plan.gather_halo_gpu(ex, gpu, &k, &v).map(|_| ())
    })?;
    let halo = plan.gather_halo_gpu(ex, gpu, &k, &v)?;
    let local_ms = median_between_barriers(ex, warmup, reps, || {
        local.forward(&q, halo.k(), halo.v(), &mut out)
    })?;
    drop(halo);
    // Freed memory the pool keeps is not in use.
    let ((_, total), available) = (gpu.memory_info()?, gpu.available_memory()?);
    Ok(RankResult {
        stats: plan.stats(),
        plan_ms,
        rank_plan_ms,
        forward_ms,
        exchange_ms,
        local_ms,
        algorithm: local.algorithm().name().to_string(),
        device_used: total.saturating_sub(available) as u64,
    })
}

/// The GPUs `0..n`, refusing more than the machine has.
fn open_gpus(n: usize) -> Result<Vec<Gpu>> {
    let count = Gpu::device_count()?;
    if n == 0 || n > count {
        return Err(Error::new(format!(
            "--gpus {n}: this machine has {count} GPU(s); give 1 to {count}"
        )));
    }
    spattn::ops::nccl::NcclComm::available()?;
    (0..n)
        .map(|i| Gpu::new(i).map_err(|e| Error::new(format!("opening GPU {i}: {e}"))))
        .collect()
}

/// Runs the scaling benchmark `args` asks for (`--gpus N`, optionally `--weak-rmat S`).
///
/// # Errors
/// More GPUs asked for than there are, no libnccl, a graph that cannot be loaded, a rank's
/// failure (the first), a JSON file that cannot be written.
pub fn run(args: &RunArgs, argv: &[String], n: usize) -> Result<()> {
    let gpus = open_gpus(n)?;
    // Each forward allocates its halo; with the driver's default release threshold every
    // allocation after a synchronisation maps fresh pages (2-4x the exchange's time).
    for g in &gpus {
        g.keep_freed_memory(u64::MAX)?;
    }
    let ladder = rank_ladder(n);
    let weak = args.weak_rmat;
    let data_dirs = graphs::DataDirs::new(args.data_dir.as_deref());
    let load_options = crate::run::load_options(args, &data_dirs);
    let dtypes = if args.dtype.is_empty() {
        vec![DTypeKind::F16]
    } else {
        args.dtype.clone()
    };
    let heads_list = if args.heads.is_empty() {
        vec![1]
    } else {
        args.heads.clone()
    };
    let dims = if args.head_dim.is_empty() {
        vec![128]
    } else {
        args.head_dim.clone()
    };
    let algorithm = match args.algorithms.as_str() {
        "all" | "auto" => spattn::Algorithm::Auto,
        name => name.parse::<spattn::Algorithm>().map_err(|e| {
            Error::new(format!("--algorithms with --gpus takes one algorithm: {e}"))
        })?,
    };
    let mut rec = ScalingRecord {
        schema: SCALING_SCHEMA_VERSION,
        tool: format!("spattn-bench {}", env!("CARGO_PKG_VERSION")),
        date: record::now_rfc3339(),
        commit: record::commit(),
        command: record::shell_command(argv),
        gpus: gpus.iter().map(|g| g.name().to_string()).collect(),
        mode: if weak.is_some() { "weak" } else { "strong" }.into(),
        runs: Vec::new(),
    };
    outln!(
        "spattn-bench {} (commit {}): {} scaling on {} GPU(s) ({}), NCCL; forward = the slowest \
         rank's median of {} wall-clock runs between barriers, halo exchange included; freed \
         memory kept in each GPU's pool; efficiency against the plain one-GPU plan; not checked",
        env!("CARGO_PKG_VERSION"),
        rec.commit,
        rec.mode,
        n,
        rec.gpus.join(", "),
        args.reps
    );
    // Strong: each graph on every rank count. Weak: R-MAT S + log2 P on P ranks.
    let mut jobs: Vec<(usize, GraphSpec)> = Vec::new();
    match weak {
        Some(base) => {
            // Powers of two only: R-MAT doubles its nodes and edges per scale.
            for &p in ladder.iter().filter(|p| p.is_power_of_two()) {
                let scale = base + p.ilog2();
                if scale > 31 {
                    return Err(Error::new(format!(
                        "--weak-rmat {base} on {p} GPUs asks for R-MAT {scale}; at most 31"
                    )));
                }
                jobs.push((p, GraphSpec::Rmat(scale)));
            }
        }
        None => {
            for spec in crate::run::graph_specs(args) {
                for &p in &ladder {
                    jobs.push((p, spec.clone()));
                }
            }
        }
    }
    let (warmup, reps) = (args.warmup as usize, args.reps as usize);
    let mut loaded: Option<(GraphSpec, graphs::Graph)> = None;
    for (p, spec) in jobs {
        if loaded.as_ref().map(|(s, _)| s) != Some(&spec) {
            // The previous graph goes before the next one is built.
            drop(loaded.take());
            loaded = Some((spec.clone(), graphs::load(&spec, &load_options)?));
        }
        let graph = &loaded.as_ref().expect("loaded just above").1;
        let part = Partition::balanced(&graph.csr, p)?;
        for &dtype in &dtypes {
            for &heads in &heads_list {
                for &dim in &dims {
                    let (heads, dim) = (heads as usize, dim as usize);
                    let config = AttentionConfig::new(heads, dim, dtype).with_algorithm(algorithm);
                    let seed = config_seed(args.seed, &graph.name, heads, dim, dtype);
                    let body = |ex: &NcclExchange| match dtype {
                        DTypeKind::F32 => {
                            rank_run::<f32>(ex, &graph.csr, &part, &config, seed, warmup, reps)
                        }
                        DTypeKind::F16 => rank_run::<half::f16>(
                            ex, &graph.csr, &part, &config, seed, warmup, reps,
                        ),
                        DTypeKind::Bf16 => rank_run::<half::bf16>(
                            ex, &graph.csr, &part, &config, seed, warmup, reps,
                        ),
                    };
                    let results = run_nccl(&gpus[..p], body)
                        .map_err(|e| Error::new(format!("{} on {p} GPU(s): {e}", graph.name)))?;
                    let elem = dtype.size_bytes() as u64;
                    let row_bytes = (heads * dim) as u64 * elem * 2;
                    let forward_ms = results.iter().map(|r| r.forward_ms).fold(0.0, f64::max);
                    let plan_ms = results.iter().map(|r| r.plan_ms).fold(0.0, f64::max);
                    // T1: one GPU's plain plan, i.e. the P = 1 rank's local forward alone (its
                    // "exchange" only copies every K/V row into the halo, which one plan never does).
                    let t1 = if p == 1 {
                        Some(results[0].local_ms)
                    } else {
                        rec.runs
                            .iter()
                            .find(|r| {
                                r.ranks == 1
                                    && (weak.is_some() || r.graph == graph.name)
                                    && (r.heads, r.head_dim, r.dtype.as_str())
                                        == (heads, dim, dtype.name())
                            })
                            .map(|o| o.per_rank[0].local_ms)
                    };
                    let efficiency = match (t1, weak) {
                        (Some(t1), Some(_)) => t1 / forward_ms,
                        (Some(t1), None) => t1 / (p as f64 * forward_ms),
                        (None, _) => f64::NAN,
                    };
                    let run = ScalingRun {
                        graph: graph.name.clone(),
                        nodes: graph.csr.n_rows(),
                        edges: graph.csr.nnz(),
                        heads,
                        head_dim: dim,
                        dtype: dtype.name().to_string(),
                        algorithm: if results.iter().all(|r| r.algorithm == results[0].algorithm) {
                            results[0].algorithm.clone()
                        } else {
                            "mixed".into()
                        },
                        ranks: p,
                        forward_ms,
                        efficiency,
                        plan_ms,
                        per_rank: results
                            .iter()
                            .map(|r| RankRecord {
                                rows: r.stats.rows,
                                edges: r.stats.edges,
                                halo_rows: r.stats.halo_rows,
                                received_rows: r.stats.remote_rows,
                                sent_rows: r.stats.sent_rows,
                                received_bytes: r.stats.remote_rows as u64 * row_bytes,
                                sent_bytes: r.stats.sent_rows as u64 * row_bytes,
                                forward_ms: r.forward_ms,
                                exchange_ms: r.exchange_ms,
                                local_ms: r.local_ms,
                                rank_plan_ms: r.rank_plan_ms,
                                local_plan_ms: r.plan_ms - r.rank_plan_ms,
                                algorithm: r.algorithm.clone(),
                                device_used_bytes: r.device_used,
                            })
                            .collect(),
                    };
                    let most_halo = run
                        .per_rank
                        .iter()
                        .map(|r| r.received_rows)
                        .max()
                        .unwrap_or(0);
                    let slowest =
                        |f: fn(&RankRecord) -> f64| run.per_rank.iter().map(f).fold(0.0, f64::max);
                    outln!(
                        "  {:<16} H{heads} D{dim} {:<4} P={p:<2} forward {:>9.3} ms (exchange {:.3}, local {:.3})  efficiency {:>5.1}%  plan {:>8.1} ms (partition {:.1})  {}  most halo rows received {}",
                        graph.name,
                        dtype.name(),
                        run.forward_ms,
                        slowest(|r| r.exchange_ms),
                        slowest(|r| r.local_ms),
                        run.efficiency * 100.0,
                        run.plan_ms,
                        slowest(|r| r.rank_plan_ms),
                        run.algorithm,
                        most_halo
                    );
                    rec.runs.push(run);
                }
            }
        }
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&rec)
            .map_err(|e| Error::new(format!("serializing the scaling record: {e}")))?;
        std::fs::write(path, text)
            .map_err(|e| Error::new(format!("writing {}: {e}", path.display())))?;
        outln!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ladder_doubles_up_to_n_and_ends_at_n() {
        assert_eq!(rank_ladder(1), [1]);
        assert_eq!(rank_ladder(2), [1, 2]);
        assert_eq!(rank_ladder(6), [1, 2, 4, 6]);
        assert_eq!(rank_ladder(8), [1, 2, 4, 8]);
        assert!(rank_ladder(0).is_empty());
    }

    #[test]
    fn every_rank_draws_the_same_values_for_the_same_rows() {
        let whole = rows_of::<f32>(7, 1, 0..10, 3);
        let part = rows_of::<f32>(7, 1, 4..6, 3);
        assert_eq!(&whole[12..18], &part[..]);
        assert!(whole.iter().all(|x| (-1.0..1.0).contains(x)));
        // Q, K and V differ.
        assert_ne!(rows_of::<f32>(7, 0, 0..2, 3), rows_of::<f32>(7, 1, 0..2, 3));
    }
}
