//! `spattn-bench --gpus N`: the partitioned plan on 1, 2, 4, … N GPUs of this host, one rank
//! per GPU, the halo moved by NCCL ([`spattn::partition::run_nccl`]). Strong scaling: the same
//! graph on every rank count; weak scaling (`--weak-rmat S`): R-MAT `S + log2 P` on P GPUs (P a
//! power of two), so each GPU keeps about the same edges.
//!
//! Per rank count it prints and records (`--json`): the forward time (the slowest rank's median
//! of `--reps` wall-clock runs, each between two barriers, the halo exchange included), the
//! efficiency against one GPU (`T1 / (P · TP)` strong, `T1 / TP` weak; T1 the plain one-GPU
//! plan's forward, i.e. the P = 1 rank's local forward) or, where the graph did not fit one GPU,
//! against the smallest rank count b that ran (`Tb · b / (P · TP)`, `Tb / TP`), the plan build
//! time, and per rank its rows, edges, halo rows, rows sent and received, bytes moved per
//! forward and the device memory in use. A rank count on which a GPU runs out of memory is
//! recorded as not fitting (the allocation's bytes) and the ladder goes on.
//!
//! `--largest-rmat S`: per rank count, the largest R-MAT scale ≥ S that runs ([`search_scales`]),
//! up to the first that does not: a GPU out of memory, a rank whose device-memory lower bound
//! exceeds its GPU's memory (below), or a graph the host has no memory to generate
//! ([`check_rmat_host`], checked before generating it). Freed device memory stays in
//! each GPU's pool ([`spattn::Gpu::keep_freed_memory`]), as torch's caching allocator keeps it.
//! Results are not checked here: the partitioned plan's tests compare it with the single plan.
//!
//! Before a graph is planned on P ranks (every mode), each rank's device-memory lower bound is
//! counted from the partition ([`crate::fit`]) and compared with its GPU's total memory; where
//! one exceeds it, the rank count is recorded as not fitting (`memory` `"gpu-estimate"`, the
//! bound by part in `estimate`) without planning, as an out of memory would be.

mod rank;
mod record;
mod rmat;
mod search;
#[cfg(test)]
mod tests;

use std::time::Instant;

use spattn::partition::{run_nccl, NcclExchange, Partition};
use spattn::{AttentionConfig, DTypeKind, Gpu};

use crate::cli::RunArgs;
use crate::error::{Error, Result};
use crate::fit::{first_shortfall, rank_counts, DeviceFloor};
use crate::graphs::{self, GraphSpec};
use crate::inputs::config_seed;
use crate::outln;
use spattn_formats::alloc::describe_bytes;

pub use rank::{gpu_out_of_memory, settle, Attempt, RankEnd};
pub use record::{
    FitEstimate, LargestRmat, NotFitting, RankRecord, ScalingRecord, ScalingRun,
    SCALING_SCHEMA_VERSION,
};
pub use rmat::{check_rmat_host, host_room, rmat_host_bytes};
pub use search::{search_scales, Found, Trial, MAX_RMAT_SCALE};

use rank::rank_run;
use record::write_json;
use rmat::RmatSource;

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

/// The base of a run's efficiency among the `(ranks, time)` of the earlier runs of its graph
/// (weak: of its ladder) and shape, and its own: the smallest rank count. A P = 1 run's time
/// is the plain one-GPU plan's forward ([`base_time`]).
pub fn efficiency_base(
    earlier: impl IntoIterator<Item = (usize, f64)>,
    this: (usize, f64),
) -> (usize, f64) {
    earlier
        .into_iter()
        .chain(std::iter::once(this))
        .min_by_key(|&(ranks, _)| ranks)
        .unwrap_or(this)
}

/// The time a run is a base with: at P = 1 the local forward alone (the plain one-GPU plan;
/// the P = 1 "exchange" only copies K/V into the halo, which one plan never does), else the
/// partitioned forward.
pub fn base_time(ranks: usize, forward_ms: f64, rank0_local_ms: f64) -> f64 {
    if ranks == 1 {
        rank0_local_ms
    } else {
        forward_ms
    }
}

/// A run on `p` ranks of forward `t_p` against `(b, t_b)`: strong `t_b · b / (p · t_p)` (the
/// same work on more GPUs), weak `t_b / t_p` (the work grows with the GPUs).
pub fn efficiency((b, t_b): (usize, f64), p: usize, t_p: f64, weak: bool) -> f64 {
    if weak {
        t_b / t_p
    } else {
        t_b * b as f64 / (p as f64 * t_p)
    }
}

/// One shape of a run: element type, heads, features per head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Case {
    dtype: DTypeKind,
    heads: usize,
    dim: usize,
}

impl Case {
    /// The not-fitting record of `graph` on `ranks` GPUs in this shape: `memory` says what ran
    /// short, `bytes` by how much; no rank and no estimate (callers add theirs).
    fn not_fitting(
        self,
        graph: String,
        ranks: usize,
        memory: &str,
        bytes: u64,
        message: String,
    ) -> NotFitting {
        NotFitting {
            graph,
            ranks,
            heads: self.heads,
            head_dim: self.dim,
            dtype: self.dtype.name().to_string(),
            memory: memory.into(),
            rank: None,
            bytes,
            message,
            estimate: None,
        }
    }
}

/// What every measurement of one scaling run shares.
struct Bench<'a> {
    gpus: &'a [Gpu],
    /// Each GPU's total memory, bytes (by ordinal), for the estimate before planning.
    device_bytes: Vec<u64>,
    algorithm: spattn::Algorithm,
    seed: u64,
    warmup: usize,
    reps: usize,
    weak: bool,
}

impl Bench<'_> {
    /// `graph` with `case` on the first `p` GPUs: its run, or that it did not fit; recorded
    /// in `rec` and printed.
    fn measure(
        &self,
        graph: &graphs::Graph,
        p: usize,
        case: Case,
        rec: &mut ScalingRecord,
    ) -> Result<Trial<ScalingRun, NotFitting>> {
        let Case { dtype, heads, dim } = case;
        let part = Partition::balanced(&graph.csr, p)?;
        if let Some(not) =
            precheck_device_memory(graph, &part, case, self.algorithm, &self.device_bytes, rec)?
        {
            return Ok(Trial::NotFit(not));
        }
        let config = AttentionConfig::new(heads, dim, dtype).with_algorithm(self.algorithm);
        let seed = config_seed(self.seed, &graph.name, heads, dim, dtype);
        let (warmup, reps) = (self.warmup, self.reps);
        let body = |ex: &NcclExchange| match dtype {
            DTypeKind::F32 => rank_run::<f32>(ex, &graph.csr, &part, &config, seed, warmup, reps),
            DTypeKind::F16 => {
                rank_run::<half::f16>(ex, &graph.csr, &part, &config, seed, warmup, reps)
            }
            DTypeKind::Bf16 => {
                rank_run::<half::bf16>(ex, &graph.csr, &part, &config, seed, warmup, reps)
            }
        };
        let results = match settle(run_nccl(&self.gpus[..p], body))
            .map_err(|e| Error::new(format!("{} on {p} GPU(s): {e}", graph.name)))?
        {
            Attempt::Ran(results) => results,
            Attempt::OutOfMemory {
                rank,
                bytes,
                message,
            } => {
                outln!(
                    "  {:<16} H{heads} D{dim} {:<4} P={p:<2} does not fit: {message}",
                    graph.name,
                    dtype.name()
                );
                let not = NotFitting {
                    rank,
                    ..case.not_fitting(graph.name.clone(), p, "gpu", bytes, message)
                };
                rec.not_fitting.push(not.clone());
                return Ok(Trial::NotFit(not));
            }
        };
        let elem = dtype.size_bytes() as u64;
        let row_bytes = (heads * dim) as u64 * elem * 2;
        let forward_ms = results.iter().map(|r| r.forward_ms).fold(0.0, f64::max);
        let plan_ms = results.iter().map(|r| r.plan_ms).fold(0.0, f64::max);
        let earlier = rec.runs.iter().filter(|r| {
            (self.weak || r.graph == graph.name)
                && (r.heads, r.head_dim, r.dtype.as_str()) == (heads, dim, dtype.name())
        });
        let base = efficiency_base(
            earlier.map(|r| {
                (
                    r.ranks,
                    base_time(r.ranks, r.forward_ms, r.per_rank[0].local_ms),
                )
            }),
            (p, base_time(p, forward_ms, results[0].local_ms)),
        );
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
            efficiency: efficiency(base, p, forward_ms, self.weak),
            efficiency_base_ranks: base.0,
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
        let slowest = |f: fn(&RankRecord) -> f64| run.per_rank.iter().map(f).fold(0.0, f64::max);
        let against = if base.0 == 1 {
            String::new()
        } else {
            format!(" (vs P={})", base.0)
        };
        outln!(
            "  {:<16} H{heads} D{dim} {:<4} P={p:<2} forward {:>9.3} ms (exchange {:.3}, local {:.3})  efficiency {:>5.1}%{against}  plan {:>8.1} ms (partition {:.1})  {}  most halo rows received {}",
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
        rec.runs.push(run.clone());
        Ok(Trial::Ran(run))
    }
}

/// Before `graph` is planned with `case` on the ranks of `part`: each rank's device-memory
/// lower bound ([`crate::fit`]) against its GPU's total memory (`device_bytes`, by rank).
/// Where one exceeds it, the rank count's not-fitting record (`"gpu-estimate"`), printed and
/// pushed into `rec`; none where every rank's bound fits, and the graph is to be planned.
///
/// # Errors
/// A partition that does not cover the graph, fewer GPUs than ranks, the host out of memory
/// for the counts' bitmap.
fn precheck_device_memory(
    graph: &graphs::Graph,
    part: &Partition,
    case: Case,
    algorithm: spattn::Algorithm,
    device_bytes: &[u64],
    rec: &mut ScalingRecord,
) -> Result<Option<NotFitting>> {
    let Case { dtype, heads, dim } = case;
    let p = part.parts();
    let t = Instant::now();
    let row_bytes = (heads as u64)
        .saturating_mul(dim as u64)
        .saturating_mul(dtype.size_bytes() as u64);
    let floors: Vec<DeviceFloor> = rank_counts(&graph.csr, part)?
        .iter()
        .map(|c| DeviceFloor::of(c, row_bytes, heads, algorithm))
        .collect();
    let seconds = t.elapsed().as_secs_f64();
    let Some(short) = first_shortfall(&floors, device_bytes)? else {
        return Ok(None);
    };
    let message = short.message();
    outln!(
        "  {:<16} H{heads} D{dim} {:<4} P={p:<2} does not fit by the estimate ({seconds:.1} s, nothing planned): {message}",
        graph.name,
        dtype.name()
    );
    let bytes = short.floor.total();
    let not = NotFitting {
        rank: Some(short.rank),
        estimate: Some(FitEstimate {
            floor: short.floor,
            device_bytes: short.device_bytes,
            largest_floor: floors.iter().map(DeviceFloor::total).max().unwrap_or(0),
            seconds,
        }),
        ..case.not_fitting(graph.name.clone(), p, "gpu-estimate", bytes, message)
    };
    rec.not_fitting.push(not.clone());
    Ok(Some(not))
}

/// The GPUs `0..n`, refusing more than the machine has.
fn open_gpus(n: usize) -> Result<Vec<Gpu>> {
    let count = Gpu::device_count()?;
    if n == 0 || n > count {
        return Err(Error::new(format!(
            "--gpus {n}: this machine has {count} GPU(s); give 1 to {count}"
        )));
    }
    spattn::ops::NcclComm::available()?;
    (0..n)
        .map(|i| Gpu::new(i).map_err(|e| Error::new(format!("opening GPU {i}: {e}"))))
        .collect()
}

/// Runs the scaling benchmark `args` asks for (`--gpus N`, optionally `--weak-rmat S` or
/// `--largest-rmat S`).
///
/// # Errors
/// More GPUs asked for than there are, no libnccl, a graph that cannot be loaded, a rank's
/// failure other than a GPU out of memory (the first), a JSON file that cannot be written.
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
        date: crate::record::now_rfc3339(),
        commit: crate::record::commit(),
        command: crate::record::shell_command(argv),
        gpus: gpus.iter().map(|g| g.name().to_string()).collect(),
        mode: match (weak, args.largest_rmat) {
            (Some(_), _) => "weak",
            (None, Some(_)) => "largest-rmat",
            (None, None) => "strong",
        }
        .into(),
        runs: Vec::new(),
        not_fitting: Vec::new(),
        largest_rmat: Vec::new(),
    };
    // The whole card, not what is free now: the bound is of what a rank needs in all.
    let device_bytes = gpus
        .iter()
        .map(|g| Ok(g.memory_info()?.1 as u64))
        .collect::<Result<Vec<u64>>>()?;
    outln!(
        "spattn-bench {} (commit {}): {} scaling on {} GPU(s) ({}), NCCL; forward = the slowest \
         rank's median of {} wall-clock runs between barriers, halo exchange included; freed \
         memory kept in each GPU's pool; efficiency against the plain one-GPU plan (else the \
         smallest rank count that ran); a GPU out of memory, or a rank whose device-memory \
         lower bound exceeds its GPU's memory ({} bytes by ordinal; not planned), is recorded, \
         not fatal; not checked",
        env!("CARGO_PKG_VERSION"),
        rec.commit,
        rec.mode,
        n,
        rec.gpus.join(", "),
        args.reps,
        device_bytes
            .iter()
            .map(|&b| crate::table::thousands(b))
            .collect::<Vec<_>>()
            .join(" / ")
    );
    let bench = Bench {
        gpus: &gpus,
        device_bytes,
        algorithm,
        seed: args.seed,
        warmup: args.warmup as usize,
        reps: args.reps as usize,
        weak: weak.is_some(),
    };
    let mut cases = Vec::new();
    for &dtype in &dtypes {
        for &heads in &heads_list {
            for &dim in &dims {
                cases.push(Case {
                    dtype,
                    heads: heads as usize,
                    dim: dim as usize,
                });
            }
        }
    }
    if let Some(min) = args.largest_rmat {
        largest_rmat(&bench, min, &ladder, &cases, &load_options, &mut rec)?;
        return write_json(args, &rec);
    }
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
    let mut loaded: Option<(GraphSpec, graphs::Graph)> = None;
    for (p, spec) in jobs {
        if loaded.as_ref().map(|(s, _)| s) != Some(&spec) {
            // The previous graph goes before the next one is built.
            drop(loaded.take());
            loaded = Some((spec.clone(), graphs::load(&spec, &load_options)?));
        }
        let graph = &loaded.as_ref().expect("loaded just above").1;
        for &case in &cases {
            bench.measure(graph, p, case, &mut rec)?;
        }
    }
    write_json(args, &rec)
}

/// `--largest-rmat min`: per case and rank count of `ladder`, [`search_scales`] over the
/// R-MAT scales from `min`, each P starting where the one before stopped; one graph in host
/// memory at a time, kept while the next try can use it.
fn largest_rmat(
    bench: &Bench<'_>,
    min: u32,
    ladder: &[usize],
    cases: &[Case],
    options: &graphs::LoadOptions<'_>,
    rec: &mut ScalingRecord,
) -> Result<()> {
    let mut source = RmatSource::new(options);
    for &case in cases {
        let Case { dtype, heads, dim } = case;
        let row_bytes = (heads * dim * dtype.size_bytes()) as u64;
        let mut start = min;
        for &p in ladder {
            let found = search_scales(
                min,
                MAX_RMAT_SCALE,
                start,
                |scale| -> Result<Trial<ScalingRun, NotFitting>> {
                    let generate = |s| graphs::load(&GraphSpec::Rmat(s), options);
                    match source.get(scale, row_bytes, generate)? {
                        Ok(graph) => bench.measure(graph, p, case, rec),
                        Err((memory, bytes, message)) => {
                            outln!(
                                "  {:<16} H{heads} D{dim} {:<4} P={p:<2} not tried: {message}",
                                graphs::rmat_name(scale),
                                dtype.name()
                            );
                            let not = case.not_fitting(
                                graphs::rmat_name(scale),
                                p,
                                memory,
                                bytes,
                                message,
                            );
                            rec.not_fitting.push(not.clone());
                            Ok(Trial::NotFit(not))
                        }
                    }
                },
            )?;
            start = found.next_start(min);
            let what = match &found.largest {
                Some((s, run)) => format!(
                    "scale {s} (forward {:.3} ms, device memory up to {} per rank)",
                    run.forward_ms,
                    describe_bytes(
                        run.per_rank
                            .iter()
                            .map(|r| r.device_used_bytes)
                            .max()
                            .unwrap_or(0)
                    )
                ),
                None => format!("none from scale {min}"),
            };
            let next = match &found.first_not_fitting {
                Some((s, not)) => format!("scale {s} does not fit: {}", not.message),
                None => format!("scale {MAX_RMAT_SCALE} is the largest R-MAT"),
            };
            outln!(
                "largest R-MAT on {p} GPU(s), H{heads} D{dim} {}: {what}; {next}",
                dtype.name()
            );
            rec.largest_rmat.push(LargestRmat {
                ranks: p,
                heads,
                head_dim: dim,
                dtype: dtype.name().to_string(),
                largest_scale: found.largest.as_ref().map(|(s, _)| *s),
                run: found.largest.map(|(_, r)| r),
                first_not_fitting: found.first_not_fitting.map(|(_, n)| n),
            });
        }
    }
    Ok(())
}
