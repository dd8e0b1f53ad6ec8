//! Memory budgets: what a configuration needs on the host and on the GPU, checked against what
//! is available before anything is allocated, with the largest option that would fit.
//!
//! The estimates are upper bounds of what the runners hold at once (inputs, their f64 copies
//! and the reference when checking, the case's device buffers), so a configuration that passes
//! runs without the allocator aborting the process; one that does not gets a one-line error
//! saying how much it needs, how much there is, and the largest `--head-dim` (or `--rmat`
//! scale) that fits.

use spattn_formats::alloc::describe_bytes;
use spattn_formats::RmatConfig;
use spattn_ops::DTypeKind;

use crate::error::{Error, Result};

/// A configuration's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigSize {
    /// Rows of Q and out.
    pub n_rows: u64,
    /// Rows of K and V.
    pub n_cols: u64,
    /// Stored edges.
    pub nnz: u64,
    /// Heads.
    pub heads: u64,
    /// Features per head.
    pub head_dim: u64,
    /// Element type.
    pub dtype: DTypeKind,
    /// Whether outputs are checked against the f64 reference.
    pub check: bool,
}

/// Where the configuration runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The CPU runner: f32 copies of the inputs and an f32 output besides the drawn inputs.
    Cpu,
    /// The GPU runner's host side: the drawn inputs, and the f64 references when checking.
    GpuHost,
    /// The GPU itself: Q, K, V, two outputs, the backward's gradients, per-edge scores.
    Device,
}

impl ConfigSize {
    /// Bytes per feature (one unit of `heads × head_dim`) and bytes that do not grow with it.
    fn linear(&self, side: Side) -> (u64, u64) {
        let el = self.dtype.size_bytes() as u64;
        let (q, kv) = (self.n_rows, 2 * self.n_cols);
        let all = q + kv;
        let per_feature = match side {
            // Drawn inputs, f32 widenings, f32 output; checking adds the rounded output, f64
            // copies of the inputs, the reference and the widened output.
            Side::Cpu => {
                all * el
                    + all * 4
                    + q * 4
                    + if self.check {
                        q * el + all * 8 + 2 * q * 8
                    } else {
                        0
                    }
            }
            // Drawn inputs; checking adds f64 inputs, the reference (forward and the three
            // backward gradients) and an output read back (stored type and f64).
            Side::GpuHost => {
                all * el
                    + if self.check {
                        all * 8 + q * 8 + all * 8 + q * (el + 8)
                    } else {
                        0
                    }
            }
            // Q, K, V, out, a second output, dOut, and f32 dQ, dK, dV of the training cases.
            Side::Device => all * el + 3 * q * el + all * 4,
        };
        // Per-edge scores and probabilities (f32, per head) and their f64 references.
        let per_edge = match side {
            Side::Cpu => 0,
            Side::GpuHost => {
                if self.check {
                    self.nnz * self.heads * 16
                } else {
                    0
                }
            }
            Side::Device => self.nnz * self.heads * 8,
        };
        (per_feature, per_edge)
    }

    /// Bytes the configuration needs on `side` (saturating).
    pub fn bytes(&self, side: Side) -> u64 {
        let (per_feature, fixed) = self.linear(side);
        per_feature
            .saturating_mul(self.heads.saturating_mul(self.head_dim))
            .saturating_add(fixed)
    }

    /// The largest head_dim (at these heads) whose bytes on `side` fit in `available`; 0 when
    /// not even 1 fits.
    pub fn max_head_dim(&self, side: Side, available: u64) -> u64 {
        let (per_feature, fixed) = self.linear(side);
        let per_dim = per_feature.saturating_mul(self.heads).max(1);
        available.saturating_sub(fixed) / per_dim
    }
}

/// Checks `size` against `available` bytes on `side`.
///
/// # Errors
/// A one-line message: what is needed, what is available, the largest `--head-dim` that fits.
pub fn check(size: &ConfigSize, side: Side, available: u64) -> Result<()> {
    let need = size.bytes(side);
    if need <= available {
        return Ok(());
    }
    let place = match side {
        Side::Cpu | Side::GpuHost => "host memory",
        Side::Device => "free GPU memory",
    };
    let fits = match size.max_head_dim(side, available) {
        0 => format!(
            "not even --head-dim 1 fits at {} head(s): use a smaller graph{}",
            size.heads,
            if size.check { " or --no-check" } else { "" }
        ),
        d => format!(
            "at most --head-dim {d} fits at {} head(s){}",
            size.heads,
            if size.check {
                " (more with --no-check)"
            } else {
                ""
            }
        ),
    };
    Err(Error::new(format!(
        "H={} D={} {} needs {} of {place}, {} available: {fits}",
        size.heads,
        size.head_dim,
        size.dtype,
        describe_bytes(need),
        describe_bytes(available)
    )))
}

/// Checks that generating R-MAT `config` fits in `available` host bytes.
///
/// # Errors
/// A one-line message naming the largest scale that fits.
pub fn check_rmat(config: &RmatConfig, available: u64) -> Result<()> {
    let need = config.peak_host_bytes().unwrap_or(u64::MAX);
    if need <= available {
        return Ok(());
    }
    let largest = (1..config.scale).rev().find(|&s| {
        config
            .clone()
            .with_scale(s)
            .peak_host_bytes()
            .is_some_and(|b| b <= available)
    });
    Err(Error::new(format!(
        "R-MAT scale {} needs {} of host memory to generate, {} available: {}",
        config.scale,
        describe_bytes(need),
        describe_bytes(available),
        match largest {
            Some(s) => format!("at most --rmat {s} fits"),
            None => "no scale fits".to_string(),
        }
    )))
}

/// Runs `f` and returns, beside its result, how far the process's resident memory rose above
/// where it started while `f` ran (bytes): Linux's peak resident size (VmHWM), reset first
/// through `/proc/self/clear_refs`. `None` where either is unavailable (another system, a
/// kernel that refuses the reset). Other threads' allocations count too, and the reset also
/// lowers the whole run's peak that `getrusage` or `/usr/bin/time` would report.
pub fn host_peak<T>(f: impl FnOnce() -> T) -> (T, Option<u64>) {
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = reset.then(|| status_kib("VmRSS")).flatten();
    let out = f();
    let peak = before.and_then(|b| Some(status_kib("VmHWM")?.saturating_sub(b) * 1024));
    (out, peak)
}

/// A `kB` line of /proc/self/status.
fn status_kib(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(n: u64, heads: u64, head_dim: u64) -> ConfigSize {
        ConfigSize {
            n_rows: n,
            n_cols: n,
            nnz: 5 * n,
            heads,
            head_dim,
            dtype: DTypeKind::F32,
            check: true,
        }
    }

    #[test]
    fn the_peak_of_a_large_allocation_is_seen() {
        let (sum, peak) = host_peak(|| {
            // 256 MiB touched, then freed before the measurement ends.
            let v = std::hint::black_box(vec![1u8; 256 << 20]);
            v.iter().step_by(4096).map(|&x| u64::from(x)).sum::<u64>()
        });
        assert_eq!(sum, (256 << 20) / 4096);
        if let Some(p) = peak {
            assert!(p >= 200 << 20, "peak {p} bytes for a 256 MiB buffer");
        } else {
            // Only where /proc/self cannot tell.
            assert!(
                std::fs::read_to_string("/proc/self/status").is_err()
                    || std::fs::write("/proc/self/clear_refs", "5").is_err()
            );
        }
    }

    #[test]
    fn the_largest_head_dim_that_fits_does_fit() {
        let s = size(2708, 1, 65536);
        for side in [Side::Cpu, Side::GpuHost, Side::Device] {
            let available = 4 << 30;
            let d = s.max_head_dim(side, available);
            assert!(d > 0 && d < 65536, "{side:?}: {d}");
            let fits = ConfigSize { head_dim: d, ..s };
            assert!(fits.bytes(side) <= available);
            let over = ConfigSize {
                head_dim: d + 1,
                ..s
            };
            assert!(over.bytes(side) > available);
        }
    }

    #[test]
    fn messages_say_what_fits() {
        let e = check(&size(2708, 1, 65536), Side::Cpu, 1 << 30).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("needs") && msg.contains("at most --head-dim"),
            "{msg}"
        );
        assert!(!msg.contains('\n'));
        let e = check(&size(100_000_000, 1, 64), Side::GpuHost, 1 << 30).unwrap_err();
        assert!(e.to_string().contains("not even --head-dim 1 fits"), "{e}");
        assert!(check(&size(10, 1, 8), Side::Device, 1 << 30).is_ok());
    }

    #[test]
    fn rmat_scales_that_do_not_fit_name_one_that_does() {
        let config = RmatConfig::benchmark(27);
        let e = check_rmat(&config, 24 << 30).unwrap_err().to_string();
        assert!(e.contains("R-MAT scale 27 needs"), "{e}");
        let largest: u32 = e
            .rsplit("--rmat ")
            .next()
            .and_then(|t| t.split_whitespace().next())
            .and_then(|t| t.parse().ok())
            .expect("names a scale");
        assert!(largest < 27);
        assert!(check_rmat(&RmatConfig::benchmark(largest), 24 << 30).is_ok());
        assert!(check_rmat(&RmatConfig::benchmark(10), 24 << 30).is_ok());
    }
}
