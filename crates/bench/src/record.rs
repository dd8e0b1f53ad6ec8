//! The machine-readable results of a run (`--json`), read back by `spattn-bench report`.
//!
//! Times are milliseconds, bandwidths GB/s (10^9 bytes per second), sizes bytes. Numbers that
//! do not apply (no GPU, no check, no peer) are `null`.

use serde::{Deserialize, Serialize};

/// Version of this layout; bumped when a field changes meaning.
pub const SCHEMA_VERSION: u32 = 2;

/// Everything one run measured.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RunRecord {
    /// [`SCHEMA_VERSION`].
    pub schema: u32,
    /// `spattn-bench <version>`.
    pub tool: String,
    /// When the run started, RFC 3339 UTC.
    pub date: String,
    /// The git commit the binary was built from (`unknown` where it cannot tell).
    pub commit: String,
    /// The command line, shell-quoted.
    pub command: String,
    /// Where it ran.
    pub device: DeviceRecord,
    /// Run-wide settings.
    pub settings: Settings,
    /// The graphs, with their statistics.
    pub graphs: Vec<GraphRecord>,
    /// One record per case × graph × heads × head_dim × dtype.
    pub cases: Vec<CaseRecord>,
    /// The peer records given with `--peers`, as read.
    #[serde(default)]
    pub peers: Vec<PeerRecord>,
}

/// The device of a run.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct DeviceRecord {
    /// `"gpu"` or `"cpu"`.
    pub kind: String,
    /// GPU name as the driver reports it, or `"CPU"`.
    pub name: String,
    /// Why this device was used (e.g. `no CUDA driver (libcuda not found)`).
    pub reason: String,
    /// CUDA driver version, `"12.4"`.
    pub driver_version: Option<String>,
    /// Compute capability, `"9.0"`.
    pub compute_capability: Option<String>,
    /// Streaming multiprocessors.
    pub sm_count: Option<u32>,
    /// Device memory in bytes.
    pub memory_bytes: Option<u64>,
    /// Measured device-to-device copy bandwidth, counting bytes read + written.
    pub copy_bandwidth_gbs: Option<f64>,
    /// Bytes of the copy that measured it (each of source and destination).
    pub copy_bytes: Option<u64>,
    /// Threads of the CPU work (rayon).
    pub cpu_threads: usize,
}

impl DeviceRecord {
    /// Whether the run was on a GPU.
    pub fn is_gpu(&self) -> bool {
        self.kind == "gpu"
    }
}

/// Settings shared by every case of a run.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Settings {
    /// Untimed runs before the timed ones.
    pub warmup: u32,
    /// Timed runs per case.
    pub reps: u32,
    /// `"cuda-events"` (GPU time of the launches) or `"wall-clock"` (CPU).
    pub timing: String,
    /// Base seed of the random inputs.
    pub seed: u64,
    /// Seed of the R-MAT generator.
    pub rmat_seed: u64,
    /// Whether outputs were checked against the f64 CPU reference.
    pub check: bool,
    /// Whether graphs were symmetrized with self loops.
    pub symmetrize: bool,
    /// The row order the attention plans were asked for (`--reorder`; runs recorded before
    /// the option existed used `auto`).
    #[serde(default = "default_reorder")]
    pub reorder: String,
}

fn default_reorder() -> String {
    spattn_formats::Reorder::Auto.name().to_string()
}

/// A graph and its statistics.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct GraphRecord {
    /// Name used in every record: the file stem, or `rmat-<scale>`.
    pub name: String,
    /// Where it came from (path, `built-in cora`, `R-MAT scale 14, seed 1`).
    pub source: String,
    /// Rows (nodes).
    pub n: u64,
    /// Stored entries (edges), self loops included.
    pub nnz: u64,
    /// Whether it was symmetrized with self loops (A + Aᵀ + I).
    pub symmetrized: bool,
    /// Degree statistics (row lengths).
    pub degree: DegreeRecord,
    /// ME-BCRS fill (8-row windows, 8 vectors per block).
    pub mebcrs: FillRecord,
    /// BSB fill (16-row windows, 16 × 8 blocks).
    pub bsb: FillRecord,
    /// Seconds spent reading or generating it (and symmetrizing).
    pub load_seconds: f64,
}

/// Row-length statistics.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct DegreeRecord {
    /// Shortest row.
    pub min: u64,
    /// Mean row length.
    pub mean: f64,
    /// Longest row.
    pub max: u64,
    /// Rows without entries.
    pub empty_rows: u64,
}

/// How a blocked tensor-core format fills its blocks.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct FillRecord {
    /// Row windows.
    pub windows: u64,
    /// Blocks (partial ones counted whole).
    pub blocks: u64,
    /// Slots the blocks span.
    pub slots: u64,
    /// `edges / slots`.
    pub fill: f64,
}

/// One case on one graph and shape.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct CaseRecord {
    /// Graph name.
    pub graph: String,
    /// Case name (`unfused-csr`, `sddmm-csr`, …).
    pub case: String,
    /// `"op"` or `"algorithm"`.
    pub kind: String,
    /// Attention heads.
    pub heads: u32,
    /// Features per head.
    pub head_dim: u32,
    /// Element type of the dense operands.
    pub dtype: String,
    /// Seed of this configuration's inputs.
    pub seed: u64,
    /// Median time of the timed runs.
    pub median_ms: Option<f64>,
    /// Fastest timed run.
    pub min_ms: Option<f64>,
    /// Slowest timed run.
    pub max_ms: Option<f64>,
    /// Timed runs.
    pub reps: u32,
    /// Bytes that must move at least once (see [`crate::cases::floor_bytes`]).
    pub floor_bytes: u64,
    /// `floor_bytes` over the measured copy bandwidth.
    pub floor_ms: Option<f64>,
    /// `floor_bytes / median time`, GB/s.
    pub effective_gbs: Option<f64>,
    /// `floor_ms / median_ms × 100`.
    pub pct_of_floor: Option<f64>,
    /// `unfused-csr`'s median over this case's (same graph, shape, dtype).
    pub speedup_vs_unfused: Option<f64>,
    /// `‖out − ref‖ / ‖ref‖` against the f64 CPU reference (`null` when not checked, or not
    /// finite: then `passed` is false).
    pub rel_error: Option<f64>,
    /// The tolerance the error is held to.
    pub tolerance: f64,
    /// Whether the error is within the tolerance (`null` when not checked).
    pub passed: Option<bool>,
    /// The peers timed on the same graph, shape and dtype.
    #[serde(default)]
    pub peers: Vec<PeerComparison>,
    /// What the algorithm choice said (plans that choose, e.g. `auto`).
    #[serde(default)]
    pub choice: Option<String>,
    /// How long the case's plan took to build, ms (`on_graph`: formats on the graph's first
    /// plan, reordering, autotuning); `null` for cases without a plan.
    #[serde(default)]
    pub plan_ms: Option<f64>,
    /// The graph's device uploads once the plan was built, bytes (`null` without a plan).
    #[serde(default)]
    pub graph_device_bytes: Option<u64>,
    /// The host memory the plan's build took at its peak, above the process's resident memory
    /// before it, bytes (`null` without a plan, or where the system cannot tell).
    #[serde(default)]
    pub plan_host_peak_bytes: Option<u64>,
    /// The error that stopped this case, if one did.
    #[serde(default)]
    pub error: Option<String>,
}

/// One peer's time next to one of our cases.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PeerComparison {
    /// Peer name (`torch_sparse_attention`, `cusparse_spmm`, …).
    pub peer: String,
    /// The peer's median time (`null` where it could not run the case).
    pub median_ms: Option<f64>,
    /// The element type the peer actually ran in (cuSPARSE may fall back to f32).
    pub dtype_used: String,
    /// Peer time / our time: above 1, spattn is faster.
    pub ratio: Option<f64>,
    /// The peer's `‖out − ref‖ / ‖ref‖` against the f64 reference, where measured.
    #[serde(default)]
    pub rel_err: Option<f64>,
    /// Whether that error is within the dtype's tolerance (`null`: not measured).
    #[serde(default)]
    pub ok: Option<bool>,
    /// `ok`, `unsupported`, `oom` or `error` (see [`PeerRecord::status`]).
    #[serde(default = "status_ok")]
    pub status: String,
    /// Why the peer could not run the case.
    #[serde(default)]
    pub reason: Option<String>,
    /// The form of the peer that was timed (the fastest its users can find).
    #[serde(default)]
    pub variant: Option<String>,
}

fn status_ok() -> String {
    "ok".to_string()
}

/// A record of the peer scripts (`peers/torch_peers.py`, `peers/fused_peers.py`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PeerRecord {
    /// Graph name.
    pub graph: String,
    /// Rows.
    pub n: u64,
    /// Entries, as the peer's graph had them.
    pub nnz: u64,
    /// Heads.
    pub heads: u32,
    /// Features per head.
    pub head_dim: u32,
    /// The element type asked for.
    pub dtype: String,
    /// Peer name.
    pub peer: String,
    /// Median time, ms (`null` where the peer could not run the case).
    pub median_ms: Option<f64>,
    /// The element type it ran in.
    #[serde(default)]
    pub dtype_used: Option<String>,
    /// Remarks (e.g. `per-head loop`).
    #[serde(default)]
    pub note: Option<String>,
    /// GPU name.
    #[serde(default)]
    pub gpu: Option<String>,
    /// torch version.
    #[serde(default)]
    pub torch: Option<String>,
    /// `ok` (ran; its time and error are measured), `unsupported` (a shape, dtype or size the
    /// peer cannot take, or would not fit), `oom` (ran out of GPU memory), `error` (failed or
    /// crashed). Older records have none: `ok`.
    #[serde(default = "status_ok")]
    pub status: String,
    /// Why it did not run, in one line.
    #[serde(default)]
    pub reason: Option<String>,
    /// The form that was timed (layout, dtype, kernel variant).
    #[serde(default)]
    pub variant: Option<String>,
    /// `‖out − ref‖ / ‖ref‖` against the f64 reference.
    #[serde(default)]
    pub rel_err: Option<f64>,
    /// The tolerance of the dtype asked for.
    #[serde(default)]
    pub tolerance: Option<f64>,
    /// `rel_err ≤ tolerance` (false on NaN).
    #[serde(default)]
    pub ok: Option<bool>,
}

impl PeerRecord {
    /// Whether the peer ran the case and has a time.
    pub fn ran(&self) -> bool {
        self.status == "ok" && self.median_ms.is_some()
    }
}

/// `secs` since the Unix epoch as an RFC 3339 UTC date, `2025-01-31T12:00:00Z`.
pub fn rfc3339_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The current time as [`rfc3339_utc`].
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339_utc(secs)
}

/// The command line, each argument quoted for a POSIX shell where it needs it.
pub fn shell_command(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            let plain = !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c));
            if plain {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The commit of this binary: `$SPATTN_COMMIT` at run time, else the one recorded at build
/// time, else `git rev-parse --short HEAD` now, else `unknown`.
pub fn commit() -> String {
    if let Ok(c) = std::env::var("SPATTN_COMMIT") {
        if !c.trim().is_empty() {
            return c.trim().to_string();
        }
    }
    let built = env!("SPATTN_BUILD_COMMIT");
    if built != "unknown" {
        return built.to_string();
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_700_000_000), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn quoting() {
        let args = [
            "spattn-bench",
            "--graph",
            "a b.mtx",
            "--dtype",
            "f16,f32",
            "it's",
        ];
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            shell_command(&args),
            r"spattn-bench --graph 'a b.mtx' --dtype f16,f32 'it'\''s'"
        );
    }
}
