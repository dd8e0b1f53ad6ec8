//! One rank's run under NCCL: its inputs drawn, its plan built and probed, its forwards timed
//! between barriers; and the settling of every rank's end, a GPU out of memory included.

use std::time::Instant;

use spattn::partition::{Exchange, NcclExchange, Partition, RankPlan};
use spattn::{AttentionConfig, Csr, DType, DeviceMatrix, Shape};

use crate::error::Result;
use crate::inputs::mix64;

/// Uniform values in [-1, 1) of element `i` under `seed`: a hash of the element, so every rank
/// draws its own rows without the whole matrix on any host.
fn value(seed: u64, i: u64) -> f32 {
    ((mix64(seed ^ mix64(i)) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The rows `rows` of an `n × row_len` input matrix `which` (0: Q, 1: K, 2: V), drawn on every
/// core (R-MAT 26's half on two ranks is 4.3 G elements a matrix).
pub(super) fn rows_of<T: DType>(
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
pub(super) struct RankResult {
    pub(super) stats: spattn::partition::RankStats,
    pub(super) plan_ms: f64,
    pub(super) rank_plan_ms: f64,
    pub(super) forward_ms: f64,
    pub(super) exchange_ms: f64,
    pub(super) local_ms: f64,
    pub(super) algorithm: String,
    pub(super) device_used: u64,
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
pub(super) fn rank_run<T: DType>(
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

/// Settles a run from what [`run_nccl`](spattn::partition::run_nccl) returned: every rank's
/// result; else the first GPU out of memory where every failing rank ran out; else the first
/// other failure, as an error naming its rank.
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
