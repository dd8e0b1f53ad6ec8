//! The scaling run's JSON: the record of every rank count, graph and shape that ran or did not
//! fit, and its writing to `--json`.

use serde::{Deserialize, Serialize};

use crate::cli::RunArgs;
use crate::error::{Error, Result};
use crate::fit::DeviceFloor;
use crate::outln;

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

/// Writes `rec` to `--json`, where given.
pub(super) fn write_json(args: &RunArgs, rec: &ScalingRecord) -> Result<()> {
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(rec)
            .map_err(|e| Error::new(format!("serializing the scaling record: {e}")))?;
        std::fs::write(path, text)
            .map_err(|e| Error::new(format!("writing {}: {e}", path.display())))?;
        outln!("wrote {}", path.display());
    }
    Ok(())
}
