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

use std::time::Instant;

use serde::{Deserialize, Serialize};
use spattn::partition::{run_nccl, Exchange, NcclExchange, Partition, RankPlan};
use spattn::{AttentionConfig, Csr, DType, DTypeKind, DeviceMatrix, Gpu, Shape};

use crate::cli::RunArgs;
use crate::error::{Error, Result};
use crate::fit::{first_shortfall, rank_counts, DeviceFloor};
use crate::graphs::{self, GraphSpec};
use crate::inputs::{config_seed, mix64};
use crate::{outln, record};
use spattn_formats::alloc::describe_bytes;

/// Version of the scaling JSON. 2: `efficiency_base_ranks` per run, `not_fitting` and
/// `largest_rmat` (absent from version 1, read as 1 and empty). 3: `not_fitting` records of
/// rank counts ruled out by the device-memory estimate before planning (`memory`
/// `"gpu-estimate"`, `estimate`; absent from versions 1 and 2, read as none).
pub const SCALING_SCHEMA_VERSION: u32 = 3;

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
    /// One entry per graph × shape × rank count that ran.
    pub runs: Vec<ScalingRun>,
    /// The graph × shape × rank counts that did not fit.
    #[serde(default)]
    pub not_fitting: Vec<NotFitting>,
    /// `--largest-rmat`: per shape and rank count, the largest R-MAT that ran.
    #[serde(default)]
    pub largest_rmat: Vec<LargestRmat>,
}

/// `--largest-rmat S`: on `ranks` GPUs, the largest R-MAT scale ≥ S that ran, and the first
/// above it that did not.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LargestRmat {
    /// Ranks (GPUs).
    pub ranks: usize,
    /// Heads.
    pub heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// The largest scale that ran; none where not even S did.
    pub largest_scale: Option<u32>,
    /// Its run (also in `runs`).
    pub run: Option<ScalingRun>,
    /// The first scale above it that did not run, and why (also in `not_fitting`); none where
    /// scale 31, the largest R-MAT, ran.
    pub first_not_fitting: Option<NotFitting>,
}

/// A graph and shape that did not run on `ranks` GPUs for lack of memory.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct NotFitting {
    /// Graph name.
    pub graph: String,
    /// Ranks (GPUs).
    pub ranks: usize,
    /// Heads.
    pub heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// `"gpu"`: a GPU ran out of memory for its rank's partition; `"gpu-estimate"`: a rank's
    /// device-memory lower bound exceeds its GPU's memory, so it was not planned; `"host"`:
    /// the host lacks the memory to generate the graph (`--largest-rmat`), which was not tried;
    /// `"format"`: the graph has more entries than the 32-bit CSR holds (`--largest-rmat`:
    /// refused before generating where more edges are drawn than it holds, else generated
    /// once; the message says why, a larger scale's names the scale that did not fit; `bytes`
    /// is 0).
    pub memory: String,
    /// The rank whose GPU ran out (`"gpu-estimate"`: the lowest whose bound exceeds its GPU's
    /// memory; its GPU ordinal is the same); none where the failure came out of a collective,
    /// which does not say.
    pub rank: Option<usize>,
    /// Bytes of the allocation that failed (`"gpu"`), the rank's lower bound
    /// (`"gpu-estimate"`), or the host bytes the graph needs (`"host"`).
    pub bytes: u64,
    /// The error, as printed.
    pub message: String,
    /// `"gpu-estimate"`: the rank's bound by part and its GPU's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<FitEstimate>,
}

/// Why the estimate ruled a rank count out: the lowest rank whose bound exceeds its GPU's
/// memory ([`crate::fit`]).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct FitEstimate {
    /// The rank's device-memory lower bound, by part.
    pub floor: DeviceFloor,
    /// Its GPU's total memory, bytes.
    pub device_bytes: u64,
    /// The largest bound among all ranks, bytes.
    pub largest_floor: u64,
    /// Seconds the partition's counts took on the host.
    pub seconds: f64,
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
    /// forward (the P = 1 rank's local forward, without the copy its exchange makes); where
    /// P = 1 did not run, against the base b = `efficiency_base_ranks`: `Tb · b / (P · TP)` or
    /// `Tb / TP`, Tb that run's forward.
    pub efficiency: f64,
    /// The rank count the efficiency is against: 1 where P = 1 ran, else the smallest rank
    /// count of this graph (weak: of the ladder) and shape that ran.
    #[serde(default = "one")]
    pub efficiency_base_ranks: usize,
    /// The slowest rank's plan build (its requests exchanged, its local plan), ms.
    pub plan_ms: f64,
    /// Per rank.
    pub per_rank: Vec<RankRecord>,
}

/// Version 1 records measured every efficiency against P = 1.
fn one() -> usize {
    1
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

/// The rows `rows` of an `n × row_len` input matrix `which` (0: Q, 1: K, 2: V), drawn on every
/// core (R-MAT 26's half on two ranks is 4.3 G elements a matrix).
fn rows_of<T: DType>(
    seed: u64,
    which: u64,
    rows: std::ops::Range<usize>,
    row_len: usize,
) -> Vec<T> {
    use rayon::prelude::*;
    let s = seed ^ (which << 56);
    (rows.start * row_len..rows.end * row_len)
        .into_par_iter()
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
) -> spattn::Result<RankEnd<RankResult>> {
    let gpu = ex.gpu();
    let (heads, dim) = (config.heads, config.head_dim);
    let row_len = heads * dim;
    let t0 = Instant::now();
    let plan = RankPlan::new(a, part, ex)?;
    let rank_plan_ms = t0.elapsed().as_secs_f64() * 1e3;
    // What allocates on this GPU alone, before the next collective: a rank out of memory here
    // tells the others (`agree`) instead of leaving them waiting in NCCL.
    let prepared = (|| -> spattn::Result<_> {
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
        probe_forward(&plan, &local, &q, &mut out)?;
        Ok((local, plan_ms, q, k, v, out))
    })();
    let everyone = agree(ex, prepared.is_ok())?;
    let (local, plan_ms, q, k, v, mut out) = match (prepared, everyone) {
        (Ok(p), true) => p,
        (Err(e), _) => return Ok(RankEnd::Failed(e)),
        (Ok(_), false) => return Ok(RankEnd::PeerStopped),
    };
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
    Ok(RankEnd::Ran(RankResult {
        stats: plan.stats(),
        plan_ms,
        rank_plan_ms,
        forward_ms,
        exchange_ms,
        local_ms,
        algorithm: local.algorithm().name().to_string(),
        device_used: total.saturating_sub(available) as u64,
    }))
}

/// Allocates what a forward of `plan` allocates (the K and V halo, the K and V rows packed for
/// the other ranks, the halo's row indices) and runs the local plan once on a zero halo, all
/// without a collective, then frees it into the pool the timed forwards take it from again.
fn probe_forward<T: DType>(
    plan: &RankPlan,
    local: &spattn::AttentionPlan,
    q: &DeviceMatrix<T>,
    out: &mut DeviceMatrix<T>,
) -> spattn::Result<()> {
    let gpu = q.gpu();
    let stats = plan.stats();
    let (heads, dim) = (q.shape().heads, q.shape().head_dim);
    let halo = Shape::new(stats.halo_rows, heads, dim)?;
    let (hk, hv) = (
        DeviceMatrix::<T>::zeros(gpu, halo)?,
        DeviceMatrix::<T>::zeros(gpu, halo)?,
    );
    // K's and V's, packed before they are sent together.
    let _packed = [
        spattn_ops::DeviceVec::<T>::zeros(gpu, stats.sent_rows * heads * dim)?,
        spattn_ops::DeviceVec::<T>::zeros(gpu, stats.sent_rows * heads * dim)?,
    ];
    let _index = spattn_ops::DeviceVec::<u32>::zeros(gpu, stats.halo_rows + stats.sent_rows)?;
    local.forward(q, &hk, &hv, out)?;
    gpu.synchronize()?;
    Ok(())
}

/// Tells every rank whether this one got through a step, and returns whether all did (a
/// collective: one byte to each rank).
fn agree(ex: &NcclExchange, ok: bool) -> spattn::Result<bool> {
    let got = ex.all_to_all(vec![vec![u8::from(ok)]; ex.world()])?;
    Ok(got.iter().all(|b| b.as_slice() == [1]))
}

/// How one rank's run ended.
#[derive(Debug)]
pub enum RankEnd<R> {
    /// It ran and measured.
    Ran(R),
    /// It failed before its timed runs, with this error.
    Failed(spattn::Error),
    /// It stopped before its timed runs because another rank failed.
    PeerStopped,
}

/// A graph and shape on P GPUs, settled from its ranks' ends.
#[derive(Debug, PartialEq)]
pub enum Attempt<R> {
    /// Every rank ran: their results in rank order.
    Ran(Vec<R>),
    /// A GPU ran out of memory.
    OutOfMemory {
        /// The rank whose GPU did; none where the error came out of a collective.
        rank: Option<usize>,
        /// Bytes of the allocation that failed.
        bytes: u64,
        /// The error, as printed.
        message: String,
    },
}

/// The bytes of the device allocation that failed, where `e` is a GPU out of memory
/// (`spattn_ops::Error::OutOfMemory`, which `spattn::Error::Ops` wraps); none for any other
/// error, host allocations (`spattn::Error::Format`) included.
pub fn gpu_out_of_memory(e: &spattn::Error) -> Option<u64> {
    match e {
        spattn::Error::Ops(spattn_ops::Error::OutOfMemory { bytes, .. }) => Some(*bytes as u64),
        _ => None,
    }
}

/// Settles a run from what [`run_nccl`] returned: every rank's result; else the first GPU out
/// of memory where every failing rank ran out; else the first other failure, as an error
/// naming its rank.
///
/// # Errors
/// A failure other than a GPU out of memory (such failures abort the scaling run).
pub fn settle<R>(ends: spattn::Result<Vec<RankEnd<R>>>) -> Result<Attempt<R>, String> {
    let ends = match ends {
        Ok(ends) => ends,
        Err(e) => {
            return match gpu_out_of_memory(&e) {
                Some(bytes) => Ok(Attempt::OutOfMemory {
                    rank: None,
                    bytes,
                    message: e.to_string(),
                }),
                None => Err(e.to_string()),
            };
        }
    };
    let failed = |oom: bool| {
        ends.iter().enumerate().find_map(|(rank, end)| match end {
            RankEnd::Failed(e) if gpu_out_of_memory(e).is_some() == oom => Some((rank, e)),
            _ => None,
        })
    };
    if let Some((rank, e)) = failed(false) {
        return Err(format!("rank {rank}: {e}"));
    }
    if let Some((rank, e)) = failed(true) {
        return Ok(Attempt::OutOfMemory {
            rank: Some(rank),
            bytes: gpu_out_of_memory(e).unwrap_or(0),
            message: format!("rank {rank}: {e}"),
        });
    }
    let mut results = Vec::with_capacity(ends.len());
    for (rank, end) in ends.into_iter().enumerate() {
        match end {
            RankEnd::Ran(r) => results.push(r),
            // Unreachable with `agree`, which only stops a rank when another failed.
            _ => {
                return Err(format!(
                    "rank {rank} stopped, but no rank reported an error"
                ))
            }
        }
    }
    Ok(Attempt::Ran(results))
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

/// The largest R-MAT scale (2^31 nodes: 32-bit indices).
pub const MAX_RMAT_SCALE: u32 = 31;

/// One try of a scale in [`search_scales`].
#[derive(Debug, PartialEq)]
pub enum Trial<R, F> {
    /// It ran.
    Ran(R),
    /// It did not fit, for this reason.
    NotFit(F),
}

/// What [`search_scales`] found.
#[derive(Debug, PartialEq)]
pub struct Found<R, F> {
    /// The largest scale that ran, with its run.
    pub largest: Option<(u32, R)>,
    /// The scale above it that did not, with why; none where `max` ran.
    pub first_not_fitting: Option<(u32, F)>,
}

impl<R, F> Found<R, F> {
    /// Where the search of the next (larger) rank count starts: the scale that did not fit
    /// here (more GPUs likely fit it, and its graph is the one generated last), else the
    /// largest that ran, else `min`.
    pub fn next_start(&self, min: u32) -> u32 {
        self.first_not_fitting
            .as_ref()
            .map(|(s, _)| *s)
            .or(self.largest.as_ref().map(|(s, _)| *s))
            .unwrap_or(min)
    }
}

/// The largest scale in `min..=max` that runs (`try_scale` says, and is assumed to fit every
/// scale below one that fits), trying `start` first (clamped into the range), then upward
/// while scales run, or downward until one does. Each scale is tried at most once.
///
/// # Errors
/// The first error of `try_scale`, which ends the search.
pub fn search_scales<R, F, E>(
    min: u32,
    max: u32,
    start: u32,
    mut try_scale: impl FnMut(u32) -> Result<Trial<R, F>, E>,
) -> Result<Found<R, F>, E> {
    let mut found = Found {
        largest: None,
        first_not_fitting: None,
    };
    let mut s = start.clamp(min, max.max(min));
    match try_scale(s)? {
        Trial::Ran(r) => {
            found.largest = Some((s, r));
            while s < max {
                s += 1;
                match try_scale(s)? {
                    Trial::Ran(r) => found.largest = Some((s, r)),
                    Trial::NotFit(f) => {
                        found.first_not_fitting = Some((s, f));
                        break;
                    }
                }
            }
        }
        Trial::NotFit(f) => {
            found.first_not_fitting = Some((s, f));
            while s > min {
                s -= 1;
                match try_scale(s)? {
                    Trial::Ran(r) => {
                        found.largest = Some((s, r));
                        break;
                    }
                    Trial::NotFit(f) => found.first_not_fitting = Some((s, f)),
                }
            }
        }
    }
    Ok(found)
}

/// Host bytes a `--largest-rmat` try of R-MAT `config` needs at its peak: the generator's
/// ([`spattn_formats::RmatConfig::peak_host_bytes`]), or after it the graph (at most `2m + n`
/// u32 entries symmetrized, `m` as stored, and its offsets) held twice (whole, and split into
/// the ranks' local graphs) with one of Q, K, V staged for upload (`row_bytes` per node: the
/// ranks stage their rows at once). `None` where that overflows 64 bits.
pub fn rmat_host_bytes(config: &spattn_formats::RmatConfig, row_bytes: u64) -> Option<u64> {
    let (m, n) = (config.n_edges(), config.n_nodes() as u64);
    let entries = if config.symmetrize {
        m.checked_mul(2)?.checked_add(n)?
    } else {
        m
    };
    let csr = entries.checked_add(n.checked_add(1)?)?.checked_mul(4)?;
    let after = csr.checked_mul(2)?.checked_add(n.checked_mul(row_bytes)?)?;
    Some(config.peak_host_bytes()?.max(after))
}

/// Refuses R-MAT `config` where [`rmat_host_bytes`] exceeds `available` host bytes, before
/// anything is generated (an allocation past the host's memory gets the process killed).
///
/// # Errors
/// The bytes needed (`u64::MAX` on overflow) and a one-line message naming the scale, the
/// bytes needed and available.
pub fn check_rmat_host(
    config: &spattn_formats::RmatConfig,
    row_bytes: u64,
    available: u64,
) -> Result<(), (u64, String)> {
    let need = rmat_host_bytes(config, row_bytes).unwrap_or(u64::MAX);
    if need <= available {
        return Ok(());
    }
    Err((
        need,
        format!(
            "R-MAT scale {} needs about {} of host memory to generate and run, {} available (--host-memory or the system's): not generated",
            config.scale,
            describe_bytes(need),
            describe_bytes(available)
        ),
    ))
}

/// The host bytes a new graph may take while `held` bytes of the previous one are about to be
/// freed: the `--host-memory` budget (the graph held is within it), else what the system
/// reports available (`system`, read only then) plus `held`; none where neither is known.
pub fn host_room(
    budget: Option<u64>,
    system: impl FnOnce() -> Option<u64>,
    held: u64,
) -> Option<u64> {
    match budget {
        Some(budget) => Some(budget),
        None => system().map(|a| a.saturating_add(held)),
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
    spattn::ops::nccl::NcclComm::available()?;
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
        date: record::now_rfc3339(),
        commit: record::commit(),
        command: record::shell_command(argv),
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

/// Writes `rec` to `--json`, where given.
fn write_json(args: &RunArgs, rec: &ScalingRecord) -> Result<()> {
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(rec)
            .map_err(|e| Error::new(format!("serializing the scaling record: {e}")))?;
        std::fs::write(path, text)
            .map_err(|e| Error::new(format!("writing {}: {e}", path.display())))?;
        outln!("wrote {}", path.display());
    }
    Ok(())
}

/// The R-MAT graphs of a `--largest-rmat` search, one held at a time.
struct RmatSource<'o> {
    options: &'o graphs::LoadOptions<'o>,
    /// The graph held, by scale (kept between rank counts).
    loaded: Option<(u32, graphs::Graph)>,
    /// The first scale whose graph had more entries than the 32-bit CSR holds, and the error:
    /// it and larger scales are not generated again, whatever the rank count.
    past_csr: Option<(u32, String)>,
}

/// Why a scale is not tried: the not-fitting record's `memory`, `bytes` and message.
type NotTried = (&'static str, u64, String);

impl<'o> RmatSource<'o> {
    fn new(options: &'o graphs::LoadOptions<'o>) -> Self {
        Self {
            options,
            loaded: None,
            past_csr: None,
        }
    }

    /// R-MAT `scale`, generated by `generate` unless it is held already; or why it is not tried:
    /// its host bytes (at `row_bytes` a node) past `--host-memory` or what the system has
    /// (`"host"`, not generated), or more entries than the CSR holds (`"format"`: refused before
    /// generating where more edges are drawn than it holds, else found by generating it once).
    ///
    /// # Errors
    /// `generate`'s other errors.
    fn get(
        &mut self,
        scale: u32,
        row_bytes: u64,
        generate: impl FnOnce(u32) -> Result<graphs::Graph>,
    ) -> Result<Result<&graphs::Graph, NotTried>> {
        if let Some((s, message)) = self.past_csr.as_ref().filter(|(s, _)| scale >= *s) {
            let message = if scale == *s {
                message.clone()
            } else {
                format!("larger than R-MAT scale {s}, which passed the 32-bit CSR: {message}")
            };
            return Ok(Err(("format", 0, message)));
        }
        if self.loaded.as_ref().map(|(s, _)| *s) != Some(scale) {
            let config = graphs::rmat_config(scale, self.options);
            // More edges drawn than the CSR holds: refused before generating.
            if let Err(e) = config.validate() {
                let e = Error::from(e).context(format!("R-MAT scale {scale}"));
                if config.n_edges() <= spattn_formats::MAX_NNZ {
                    return Err(e);
                }
                self.past_csr = Some((scale, e.to_string()));
                return Ok(Err(("format", 0, e.to_string())));
            }
            let host_memory = self.options.host_memory;
            let refused = |held: u64| {
                let available = host_room(
                    host_memory,
                    spattn_formats::alloc::available_host_bytes,
                    held,
                )?;
                check_rmat_host(&config, row_bytes, available).err()
            };
            // First counting the graph held as free (it goes before the next is generated), so
            // a refusal keeps it for the next P; then for real.
            let held = self.loaded.as_ref().map_or(0, |(_, g)| {
                (g.csr.n_rows() as u64 + 1 + g.csr.nnz() as u64) * 4
            });
            let mut refusal = refused(held);
            if refusal.is_none() {
                drop(self.loaded.take());
                refusal = refused(0);
            }
            if let Some((bytes, message)) = refusal {
                return Ok(Err(("host", bytes, message)));
            }
            match generate(scale) {
                Ok(graph) => self.loaded = Some((scale, graph)),
                // Past the 32-bit CSR: known only once the edges are deduplicated.
                Err(e) if e.too_many_entries().is_some() => {
                    self.past_csr = Some((scale, e.to_string()));
                    return Ok(Err(("format", 0, e.to_string())));
                }
                Err(e) => return Err(e),
            }
        }
        // Just loaded or held (the branch above returns otherwise).
        Ok(Ok(&self.loaded.as_ref().expect("held").1))
    }
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

    fn oom(bytes: usize) -> spattn::Error {
        spattn::Error::from(spattn_ops::Error::OutOfMemory {
            what: "halo",
            bytes,
        })
    }

    fn other() -> spattn::Error {
        spattn::Error::InvalidConfig {
            what: "heads",
            why: "zero".into(),
        }
    }

    #[test]
    fn only_a_device_out_of_memory_counts_as_not_fitting() {
        assert_eq!(gpu_out_of_memory(&oom(1 << 33)), Some(1 << 33));
        assert_eq!(gpu_out_of_memory(&other()), None);
        // A host allocation failing is not a GPU that is too small.
        let host = spattn::Error::from(spattn_formats::Error::OutOfMemory {
            what: "col_indices",
            bytes: 1 << 40,
            available: Some(1 << 30),
        });
        assert_eq!(gpu_out_of_memory(&host), None);
        let other_ops = spattn::Error::from(spattn_ops::Error::NoCudaDriver);
        assert_eq!(gpu_out_of_memory(&other_ops), None);
    }

    #[test]
    fn a_rank_out_of_memory_settles_as_not_fitting_with_its_bytes() {
        let ends = vec![
            RankEnd::PeerStopped,
            RankEnd::Failed(oom(123_456_789)),
            RankEnd::PeerStopped,
        ];
        match settle::<u8>(Ok(ends)) {
            Ok(Attempt::OutOfMemory {
                rank,
                bytes,
                message,
            }) => {
                assert_eq!((rank, bytes), (Some(1), 123_456_789));
                assert!(message.starts_with("rank 1: "), "{message}");
                assert!(message.contains("123456789 bytes"), "{message}");
            }
            other => panic!("expected out of memory, got {other:?}"),
        }
        // The error of a collective, out of memory too, has no rank.
        assert_eq!(
            settle::<u8>(Err(oom(7))),
            Ok(Attempt::OutOfMemory {
                rank: None,
                bytes: 7,
                message: oom(7).to_string()
            })
        );
    }

    #[test]
    fn other_failures_still_abort_even_beside_an_out_of_memory() {
        let ends = vec![RankEnd::Failed(oom(9)), RankEnd::Failed(other())];
        let e = settle::<u8>(Ok(ends)).unwrap_err();
        assert!(e.starts_with("rank 1: invalid heads"), "{e}");
        assert_eq!(settle::<u8>(Err(other())).unwrap_err(), other().to_string());
        let e = settle::<u8>(Ok(vec![RankEnd::Ran(1), RankEnd::PeerStopped])).unwrap_err();
        assert!(e.contains("rank 1 stopped"), "{e}");
        assert_eq!(
            settle(Ok(vec![RankEnd::Ran(1u8), RankEnd::Ran(2)])),
            Ok(Attempt::Ran(vec![1, 2]))
        );
    }

    #[test]
    fn efficiency_is_against_p1_where_it_ran_else_the_smallest_that_did() {
        // P = 1 ran (local forward 10 ms): the plain plan is the base, as before.
        let base = efficiency_base([(1, base_time(1, 12.0, 10.0))], (4, 4.0));
        assert_eq!(base, (1, 10.0));
        assert!((efficiency(base, 4, 4.0, false) - 0.625).abs() < 1e-12);
        assert!((efficiency(base, 4, 4.0, true) - 2.5).abs() < 1e-12);
        // P = 1 did not fit: P = 2 (forward 8 ms) is the base: 8 · 2 / (4 · 5).
        let base = efficiency_base([(2, base_time(2, 8.0, 6.0)), (4, 5.0)], (8, 3.0));
        assert_eq!(base, (2, 8.0));
        assert!((efficiency(base, 4, 5.0, false) - 0.8).abs() < 1e-12);
        assert!((efficiency(base, 4, 5.0, true) - 1.6).abs() < 1e-12);
        // The first run that fits is its own base: 100%.
        let base = efficiency_base([], (4, 5.0));
        assert_eq!(base, (4, 5.0));
        assert_eq!(efficiency(base, 4, 5.0, false), 1.0);
    }

    fn sample_record() -> ScalingRecord {
        ScalingRecord {
            schema: SCALING_SCHEMA_VERSION,
            tool: "spattn-bench 0".into(),
            date: "2026-01-01T00:00:00Z".into(),
            commit: "abc".into(),
            command: "spattn-bench --gpus 2".into(),
            gpus: vec!["H100".into(); 2],
            mode: "strong".into(),
            runs: vec![ScalingRun {
                graph: "rmat-26".into(),
                nodes: 1 << 26,
                edges: 1 << 31,
                heads: 1,
                head_dim: 128,
                dtype: "f16".into(),
                algorithm: "fused-tc".into(),
                ranks: 2,
                forward_ms: 100.0,
                efficiency: 1.0,
                efficiency_base_ranks: 2,
                plan_ms: 5000.0,
                per_rank: vec![RankRecord {
                    rows: 1 << 25,
                    edges: 1 << 30,
                    halo_rows: 1 << 26,
                    received_rows: 1 << 25,
                    sent_rows: 1 << 25,
                    received_bytes: 1 << 34,
                    sent_bytes: 1 << 34,
                    forward_ms: 100.0,
                    exchange_ms: 40.0,
                    local_ms: 60.0,
                    rank_plan_ms: 900.0,
                    local_plan_ms: 4100.0,
                    algorithm: "fused-tc".into(),
                    device_used_bytes: 70 << 30,
                }],
            }],
            largest_rmat: Vec::new(),
            not_fitting: vec![NotFitting {
                graph: "rmat-26".into(),
                ranks: 1,
                heads: 1,
                head_dim: 128,
                dtype: "f16".into(),
                memory: "gpu".into(),
                rank: Some(0),
                bytes: 17 << 30,
                message: "rank 0: out of GPU memory allocating 18253611008 bytes for halo".into(),
                estimate: None,
            }],
        }
    }

    #[test]
    fn the_json_keeps_the_new_fields() {
        let mut rec = sample_record();
        rec.mode = "largest-rmat".into();
        rec.largest_rmat.push(LargestRmat {
            ranks: 2,
            heads: 1,
            head_dim: 128,
            dtype: "f16".into(),
            largest_scale: Some(26),
            run: Some(rec.runs[0].clone()),
            first_not_fitting: Some(NotFitting {
                graph: "rmat-27".into(),
                ranks: 2,
                memory: "host".into(),
                rank: None,
                ..rec.not_fitting[0].clone()
            }),
        });
        let text = serde_json::to_string_pretty(&rec).expect("serializes");
        let back: ScalingRecord = serde_json::from_str(&text).expect("parses");
        assert_eq!(back, rec);
        assert!(text.contains("\"efficiency_base_ranks\": 2"), "{text}");
        assert!(text.contains("\"largest_scale\": 26"), "{text}");
        assert!(text.contains("\"memory\": \"host\""), "{text}");
    }

    /// A not-fitting record of the estimate, as [`precheck_device_memory`] makes one.
    fn estimated(graph: &str, ranks: usize) -> NotFitting {
        let floor = DeviceFloor {
            q_out: 32 << 30,
            kv_own: 32 << 30,
            kv_halo: 32 << 30,
            packed: 0,
            indices: 1 << 28,
            graph: 1 << 29,
        };
        NotFitting {
            graph: graph.into(),
            ranks,
            heads: 1,
            head_dim: 128,
            dtype: "f16".into(),
            memory: "gpu-estimate".into(),
            rank: Some(0),
            bytes: floor.total(),
            message: "rank 0 needs at least ...".into(),
            estimate: Some(FitEstimate {
                floor,
                device_bytes: 85_031_714_816,
                largest_floor: floor.total(),
                seconds: 1.5,
            }),
        }
    }

    #[test]
    fn the_json_keeps_the_estimate_and_leaves_it_out_elsewhere() {
        let mut rec = sample_record();
        rec.not_fitting.push(estimated("rmat-26", 1));
        let text = serde_json::to_string_pretty(&rec).expect("serializes");
        let back: ScalingRecord = serde_json::from_str(&text).expect("parses");
        assert_eq!(back, rec);
        assert!(text.contains("\"memory\": \"gpu-estimate\""), "{text}");
        assert!(text.contains("\"device_bytes\": 85031714816"), "{text}");
        // An allocation that failed has no estimate: its record reads as in version 2.
        assert_eq!(text.matches("\"estimate\"").count(), 1, "{text}");
    }

    #[test]
    fn a_version_2_record_still_reads() {
        let mut v = serde_json::to_value(sample_record()).expect("serializes");
        let obj = v.as_object_mut().expect("an object");
        obj.insert("schema".into(), 2.into());
        assert!(!serde_json::to_string(&obj)
            .expect("text")
            .contains("estimate"));
        let old: ScalingRecord = serde_json::from_value(v).expect("a version 2 record reads");
        assert_eq!(old.schema, 2);
        assert_eq!(old.not_fitting.len(), 1);
        assert_eq!(old.not_fitting[0].estimate, None);
        assert_eq!(old.not_fitting[0], sample_record().not_fitting[0]);
    }

    #[test]
    fn a_version_1_record_still_reads() {
        let mut v = serde_json::to_value(sample_record()).expect("serializes");
        let obj = v.as_object_mut().expect("an object");
        obj.remove("not_fitting");
        obj.remove("largest_rmat");
        obj.insert("schema".into(), 1.into());
        for run in obj["runs"].as_array_mut().expect("runs") {
            run.as_object_mut()
                .expect("a run")
                .remove("efficiency_base_ranks");
        }
        let old: ScalingRecord = serde_json::from_value(v).expect("a version 1 record reads");
        assert_eq!(old.schema, 1);
        assert!(old.not_fitting.is_empty() && old.largest_rmat.is_empty());
        // Version 1 measured every efficiency against P = 1.
        assert_eq!(old.runs[0].efficiency_base_ranks, 1);
    }

    /// The largest scale that ran and the first that did not.
    type Scales = (Option<u32>, Option<u32>);

    /// A search over scales where `fits(scale)` says what runs: the found scales and the
    /// scales tried, in order.
    fn search(
        min: u32,
        start: u32,
        fits: impl Fn(u32) -> Result<bool, String>,
    ) -> (Result<Scales, String>, Vec<u32>) {
        let mut tried = Vec::new();
        let found = search_scales(min, MAX_RMAT_SCALE, start, |s| {
            tried.push(s);
            Ok(if fits(s)? {
                Trial::Ran(s * 10)
            } else {
                Trial::NotFit(format!("scale {s}"))
            })
        });
        let found = found.map(|f| {
            if let Some((s, r)) = &f.largest {
                assert_eq!(*r, s * 10, "the run of the scale found");
            }
            if let Some((s, why)) = &f.first_not_fitting {
                assert_eq!(why, &format!("scale {s}"), "the reason of the scale found");
            }
            (
                f.largest.map(|(s, _)| s),
                f.first_not_fitting.map(|(s, _)| s),
            )
        });
        (found, tried)
    }

    #[test]
    fn the_search_goes_up_until_a_scale_does_not_fit() {
        let (found, tried) = search(22, 22, |s| Ok(s <= 25));
        assert_eq!(found, Ok((Some(25), Some(26))));
        assert_eq!(tried, [22, 23, 24, 25, 26]);
        // Every scale up to 31 fits: no scale failed.
        let (found, tried) = search(29, 29, |_| Ok(true));
        assert_eq!(found, Ok((Some(31), None)));
        assert_eq!(tried, [29, 30, 31]);
    }

    #[test]
    fn the_search_goes_down_from_a_start_that_does_not_fit() {
        // The next P starts at 26 (where the last one stopped) but fits only 24.
        let (found, tried) = search(22, 26, |s| Ok(s <= 24));
        assert_eq!(found, Ok((Some(24), Some(25))));
        assert_eq!(tried, [26, 25, 24]);
        // Not even the minimum fits.
        let (found, tried) = search(22, 23, |_| Ok(false));
        assert_eq!(found, Ok((None, Some(22))));
        assert_eq!(tried, [23, 22]);
        // A start past 31 is clamped.
        let (found, tried) = search(22, 40, |s| Ok(s <= 30));
        assert_eq!(found, Ok((Some(30), Some(31))));
        assert_eq!(tried, [31, 30]);
    }

    #[test]
    fn an_error_that_is_not_out_of_memory_ends_the_search() {
        let (found, tried) = search(22, 22, |s| {
            if s == 24 {
                Err("NCCL failed".to_string())
            } else {
                Ok(true)
            }
        });
        assert_eq!(found, Err("NCCL failed".to_string()));
        assert_eq!(tried, [22, 23, 24]);
    }

    #[test]
    fn the_next_rank_count_starts_where_this_one_stopped() {
        let f = |largest: Option<u32>, first: Option<u32>| Found::<(), ()> {
            largest: largest.map(|s| (s, ())),
            first_not_fitting: first.map(|s| (s, ())),
        };
        assert_eq!(f(Some(25), Some(26)).next_start(22), 26);
        assert_eq!(f(None, Some(22)).next_start(22), 22);
        assert_eq!(f(Some(31), None).next_start(22), 31);
        assert_eq!(f(None, None).next_start(22), 22);
    }

    #[test]
    fn the_host_estimate_covers_the_generator_and_the_run() {
        use spattn_formats::RmatConfig;
        let c = RmatConfig::benchmark(20);
        let (n, m) = (1u64 << 20, 16u64 << 20);
        let need = rmat_host_bytes(&c, 256).expect("fits 64 bits");
        // At least the generator's peak, and the graph twice with one input matrix staged.
        assert!(need >= c.peak_host_bytes().expect("fits"));
        assert!(need >= 2 * (2 * m + n + n + 1) * 4 + n * 256);
        // Wider rows stage more; the generator's peak is a floor for narrow ones.
        assert!(rmat_host_bytes(&c, 1 << 20).expect("fits") > need);
        assert_eq!(rmat_host_bytes(&c, 0), c.peak_host_bytes());
        // Each scale doubles it.
        let next = rmat_host_bytes(&RmatConfig::benchmark(21), 256).expect("fits");
        assert_eq!(next, 2 * need - 2 * 4);
        assert_eq!(rmat_host_bytes(&c, u64::MAX), None);
    }

    #[test]
    fn a_graph_the_host_cannot_hold_is_refused_before_generating() {
        use spattn_formats::RmatConfig;
        let c = RmatConfig::benchmark(27);
        let need = rmat_host_bytes(&c, 256).expect("fits");
        assert!(
            need > 64 << 30,
            "R-MAT 27 at 128 f16 features needs {need} bytes"
        );
        assert_eq!(check_rmat_host(&c, 256, need), Ok(()));
        let (bytes, message) = check_rmat_host(&c, 256, 64 << 30).unwrap_err();
        assert_eq!(bytes, need);
        assert!(
            message.starts_with("R-MAT scale 27 needs about "),
            "{message}"
        );
        assert!(message.contains("(64.0 GiB) available"), "{message}");
        let (bytes, _) = check_rmat_host(&c, u64::MAX, u64::MAX - 1).unwrap_err();
        assert_eq!(bytes, u64::MAX);
    }

    #[test]
    fn the_graph_held_counts_as_free_against_the_system_not_a_budget() {
        assert_eq!(host_room(None, || Some(10 << 30), 3 << 30), Some(13 << 30));
        assert_eq!(host_room(None, || Some(u64::MAX), 1), Some(u64::MAX));
        assert_eq!(host_room(None, || None, 3 << 30), None);
        let unread = || -> Option<u64> { panic!("the system is not read under a budget") };
        assert_eq!(host_room(Some(12 << 30), unread, 3 << 30), Some(12 << 30));
    }

    /// R-MAT `scale` as `--largest-rmat` loads it (symmetrized, with self loops).
    fn rmat_graph(scale: u32) -> graphs::Graph {
        let config = spattn_formats::RmatConfig::benchmark(scale);
        graphs::Graph {
            name: graphs::rmat_name(scale),
            source: format!("R-MAT scale {scale}"),
            csr: spattn_formats::rmat(&config).expect("a small R-MAT"),
            symmetrized: true,
            load_seconds: 0.0,
        }
    }

    #[test]
    fn a_scale_past_the_csr_is_not_fitting_and_never_generated_again() {
        let dirs = graphs::DataDirs::only(Vec::new());
        let options = graphs::LoadOptions {
            data_dirs: &dirs,
            symmetrize: true,
            rmat_seed: 1,
            host_memory: Some(1 << 40),
        };
        let mut source = RmatSource::new(&options);
        let mut generated = Vec::new();
        // Scales from 9 up stand in for graphs past the 32-bit CSR.
        let mut get = |source: &mut RmatSource<'_>, scale: u32| {
            let generate = |s: u32| {
                generated.push(s);
                if s >= 9 {
                    Err(Error::from(spattn_formats::Error::TooManyEntries {
                        nnz: 5_000_000_000,
                        limit: u64::from(u32::MAX),
                    })
                    .context(format!("R-MAT scale {s}")))
                } else {
                    Ok(rmat_graph(s))
                }
            };
            source
                .get(scale, 256, generate)
                .expect("only the CSR limit fails")
                .map(|g| g.csr.n_rows())
        };
        assert_eq!(get(&mut source, 8), Ok(256));
        assert_eq!(get(&mut source, 8), Ok(256), "held, not generated again");
        let (memory, bytes, message) = get(&mut source, 9).unwrap_err();
        assert_eq!((memory, bytes), ("format", 0));
        assert!(
            message.starts_with("R-MAT scale 9: 5000000000 entries exceed the limit"),
            "{message}"
        );
        // Scale 9 and above are refused from the record, without generating.
        assert_eq!(
            get(&mut source, 9).unwrap_err(),
            ("format", 0, message.clone())
        );
        let (_, _, larger) = get(&mut source, 10).unwrap_err();
        assert_eq!(
            larger,
            format!("larger than R-MAT scale 9, which passed the 32-bit CSR: {message}")
        );
        assert_eq!(get(&mut source, 7), Ok(128));
        assert_eq!(generated, [8, 9, 7]);
        // Another error still ends the search.
        let failed = source.get(6, 256, |_| Err(Error::new("disk on fire")));
        assert_eq!(failed.map(|_| ()).unwrap_err().to_string(), "disk on fire");
        // More edges drawn than the CSR holds (16 · 2^28 = 2^32): refused before generating.
        let (memory, _, drawn) = RmatSource::new(&options)
            .get(28, 256, |_| unreachable!("refused before generating"))
            .expect("a refusal")
            .map(|_| ())
            .unwrap_err();
        assert_eq!(memory, "format");
        assert!(
            drawn.starts_with("R-MAT scale 28: ") && drawn.contains("R-MAT edge count"),
            "{drawn}"
        );
        // A host budget too small refuses before generating.
        let tight = graphs::LoadOptions {
            host_memory: Some(1000),
            ..options.clone()
        };
        let refused = RmatSource::new(&tight)
            .get(8, 256, |_| unreachable!("refused before generating"))
            .expect("a refusal")
            .map(|_| ())
            .unwrap_err();
        assert_eq!(refused.0, "host");
        assert!(refused.1 > 1000, "{refused:?}");
    }

    /// One head of 128 f16 features, the case of the two-H100 search.
    const F16_128: Case = Case {
        dtype: DTypeKind::F16,
        heads: 1,
        dim: 128,
    };

    /// The bounds of `graph`'s ranks on `p` GPUs, at [`F16_128`] with `auto`, bytes.
    fn floors(graph: &graphs::Graph, p: usize) -> Vec<u64> {
        let part = Partition::balanced(&graph.csr, p).expect("a partition");
        crate::fit::rank_counts(&graph.csr, &part)
            .expect("counts")
            .iter()
            .map(|c| DeviceFloor::of(c, 256, 1, spattn::Algorithm::Auto).total())
            .collect()
    }

    #[test]
    fn a_scale_whose_bound_exceeds_the_gpu_is_not_fitting_and_never_planned() {
        // GPUs as large as R-MAT 8's bound on one rank: 6, 7 and 8 are planned, 9 is not.
        let capacity = floors(&rmat_graph(8), 1)[0];
        let nine = floors(&rmat_graph(9), 1)[0];
        assert!(nine > capacity, "R-MAT 9 needs {nine}, 8 {capacity}");
        let mut rec = sample_record();
        rec.not_fitting.clear();
        let mut planned = Vec::new();
        let found = search_scales(
            6,
            MAX_RMAT_SCALE,
            6,
            |scale| -> Result<Trial<u32, NotFitting>> {
                let graph = rmat_graph(scale);
                let part = Partition::balanced(&graph.csr, 1)?;
                let auto = spattn::Algorithm::Auto;
                if let Some(not) =
                    precheck_device_memory(&graph, &part, F16_128, auto, &[capacity], &mut rec)?
                {
                    return Ok(Trial::NotFit(not));
                }
                // Here `measure` would plan and run it.
                planned.push(scale);
                Ok(Trial::Ran(scale))
            },
        )
        .expect("no error");
        assert_eq!(planned, [6, 7, 8]);
        assert_eq!(found.largest, Some((8, 8)));
        let (scale, not) = found.first_not_fitting.expect("R-MAT 9 does not fit");
        assert_eq!(scale, 9);
        assert_eq!(rec.not_fitting, std::slice::from_ref(&not));
        assert_eq!(
            (not.graph.as_str(), not.ranks, not.memory.as_str(), not.rank),
            ("rmat-9", 1, "gpu-estimate", Some(0))
        );
        assert_eq!(not.bytes, nine);
        let estimate = not.estimate.as_ref().expect("the estimate");
        assert_eq!(estimate.floor.total(), nine);
        assert_eq!(estimate.largest_floor, nine);
        assert_eq!(estimate.device_bytes, capacity);
        let start = format!(
            "rank 0 needs at least {} bytes for Q and output ",
            crate::table::thousands(nine)
        );
        assert!(not.message.starts_with(&start), "{}", not.message);
        let has = format!("its GPU has {} bytes", crate::table::thousands(capacity));
        assert!(not.message.contains(&has), "{}", not.message);
    }

    #[test]
    fn the_estimate_names_the_rank_whose_gpu_is_too_small_and_lets_fitting_ones_plan() {
        let graph = rmat_graph(8);
        let part = Partition::balanced(&graph.csr, 2).expect("a partition");
        let bounds = floors(&graph, 2);
        let mut rec = sample_record();
        rec.not_fitting.clear();
        let auto = spattn::Algorithm::Auto;
        // Every GPU exactly as large as its rank's bound: planned, nothing recorded.
        let fits = precheck_device_memory(&graph, &part, F16_128, auto, &bounds, &mut rec);
        assert_eq!(fits, Ok(None));
        assert!(rec.not_fitting.is_empty());
        // The second GPU a byte short.
        let short = [bounds[0], bounds[1] - 1];
        let not = precheck_device_memory(&graph, &part, F16_128, auto, &short, &mut rec)
            .expect("no error")
            .expect("rank 1 does not fit");
        assert_eq!((not.ranks, not.rank, not.bytes), (2, Some(1), bounds[1]));
        assert_eq!(
            not.estimate.as_ref().map(|e| e.largest_floor),
            bounds.iter().copied().max()
        );
        assert!(
            not.message.starts_with("rank 1 needs at least "),
            "{}",
            not.message
        );
        assert_eq!(rec.not_fitting, [not]);
        // Fewer GPUs than ranks is an error, not a panic.
        assert!(
            precheck_device_memory(&graph, &part, F16_128, auto, &[u64::MAX], &mut rec).is_err()
        );
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
