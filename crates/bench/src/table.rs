//! The terminal output: graph blocks and the rows of the results table, plus the number
//! formatting the markdown report shares.

use crate::record::{CaseRecord, DeviceRecord, GraphRecord};

/// `1234567` → `1,234,567`.
pub fn thousands(x: u64) -> String {
    let digits = x.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A time in ms with about four significant digits.
pub fn fmt_ms(ms: f64) -> String {
    if !ms.is_finite() {
        "-".into()
    } else if ms < 0.01 {
        format!("{ms:.5}")
    } else if ms < 1.0 {
        format!("{ms:.4}")
    } else if ms < 100.0 {
        format!("{ms:.3}")
    } else {
        format!("{ms:.1}")
    }
}

/// A ratio as `2.31×`.
pub fn fmt_ratio(r: f64) -> String {
    if !r.is_finite() {
        "-".into()
    } else if r < 10.0 {
        format!("{r:.2}×")
    } else {
        format!("{r:.1}×")
    }
}

/// A relative error as `1.2e-07`; `inf` for a non-finite or missing one on a failed check.
pub fn fmt_error(rec: &CaseRecord) -> String {
    match (rec.rel_error, rec.passed) {
        (Some(e), _) => format!("{e:.1e}"),
        (None, Some(false)) => "inf".into(),
        (None, _) => "-".into(),
    }
}

/// `ok`, `FAIL`, `ERROR` or `-` (not checked).
pub fn check_status(rec: &CaseRecord) -> &'static str {
    if rec.error.is_some() {
        "ERROR"
    } else {
        match rec.passed {
            Some(true) => "ok",
            Some(false) => "FAIL",
            None => "-",
        }
    }
}

/// One line about the device.
pub fn device_line(d: &DeviceRecord) -> String {
    if d.is_gpu() {
        let mut s = format!("GPU: {}", d.name);
        if let Some(cc) = &d.compute_capability {
            s += &format!(", sm_{}", cc.replace('.', ""));
        }
        if let Some(sm) = d.sm_count {
            s += &format!(", {sm} SMs");
        }
        if let Some(mem) = d.memory_bytes {
            s += &format!(", {:.1} GiB", mem as f64 / (1u64 << 30) as f64);
        }
        if let Some(v) = &d.driver_version {
            s += &format!(", CUDA driver {v}");
        }
        if let Some(bw) = d.copy_bandwidth_gbs {
            let gib = d.copy_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64;
            s += &format!(
                "\ncopy bandwidth: {} GB/s (device-to-device copy of {gib:.2} GiB, bytes read + written)",
                thousands(bw.round() as u64)
            );
        }
        s
    } else {
        format!("CPU: {} ({} threads)", d.reason, d.cpu_threads)
    }
}

/// The statistics block of a graph.
pub fn graph_block(g: &GraphRecord) -> String {
    let how = if g.symmetrized {
        "symmetrized + self loops"
    } else {
        "as stored"
    };
    format!(
        "graph {} — {}, {how} ({:.2} s)\n  n {}   nnz {}   degree min {} / mean {:.2} / max {}   empty rows {}\n  ME-BCRS (8-row windows, 8-vector blocks): {} blocks, fill {:.3}\n  BSB (16-row windows, 16×8 blocks):        {} blocks, fill {:.3}",
        g.name,
        g.source,
        g.load_seconds,
        thousands(g.n),
        thousands(g.nnz),
        g.degree.min,
        g.degree.mean,
        thousands(g.degree.max),
        thousands(g.degree.empty_rows),
        thousands(g.mebcrs.blocks),
        g.mebcrs.fill,
        thousands(g.bsb.blocks),
        g.bsb.fill,
    )
}

/// Widths of the results table.
#[derive(Clone, Copy, Debug)]
pub struct Columns {
    /// Width of the graph column.
    pub graph: usize,
    /// Width of the case column.
    pub case: usize,
}

impl Columns {
    /// Widths fitting these graph names and the registry's case names.
    pub fn fit<'a>(graphs: impl IntoIterator<Item = &'a str>) -> Self {
        let graph = graphs.into_iter().map(str::len).max().unwrap_or(5).max(5);
        let case = crate::cases::CASES
            .iter()
            .map(|c| c.name.len())
            .max()
            .unwrap_or(4);
        Columns { graph, case }
    }

    /// The header line.
    pub fn header(&self) -> String {
        format!(
            "  {:<gw$}  {:<cw$} {:>3} {:>5} {:<5} {:>11} {:>8} {:>8} {:>9} {:>9} {:<5}  peers (time, peer/ours)",
            "graph",
            "case",
            "H",
            "D",
            "dtype",
            "median ms",
            "GB/s",
            "% floor",
            "×unfused",
            "rel err",
            "check",
            gw = self.graph,
            cw = self.case,
        )
    }

    /// The line of one case.
    pub fn row(&self, r: &CaseRecord) -> String {
        let opt =
            |x: Option<f64>, f: &dyn Fn(f64) -> String| x.map(f).unwrap_or_else(|| "-".into());
        let peers: Vec<String> = r
            .peers
            .iter()
            .map(|p| {
                if p.status != "ok" {
                    return format!("{} {}", p.peer, p.status);
                }
                let used = if p.dtype_used != r.dtype {
                    format!(" [{}]", p.dtype_used)
                } else {
                    String::new()
                };
                let wrong = if p.ok == Some(false) { " ✗" } else { "" };
                format!(
                    "{} {} ms{used} ({}){wrong}",
                    p.peer,
                    opt(p.median_ms, &fmt_ms),
                    opt(p.ratio, &fmt_ratio)
                )
            })
            .collect();
        let mut line = format!(
            "  {:<gw$}  {:<cw$} {:>3} {:>5} {:<5} {:>11} {:>8} {:>8} {:>9} {:>9} {:<5}  {}",
            r.graph,
            r.case,
            r.heads,
            r.head_dim,
            r.dtype,
            opt(r.median_ms, &fmt_ms),
            opt(r.effective_gbs, &|x| format!("{x:.1}")),
            opt(r.pct_of_floor, &|x| format!("{x:.1}%")),
            opt(r.speedup_vs_unfused, &fmt_ratio),
            fmt_error(r),
            check_status(r),
            peers.join(", "),
            gw = self.graph,
            cw = self.case,
        );
        if let Some(choice) = r.choice.as_deref().filter(|c| !c.ends_with(": requested")) {
            line += &format!("\n    choice: {choice}");
        }
        if let Some(ms) = r.plan_ms {
            line += &format!("\n    plan: {} ms to build", fmt_ms(ms));
        }
        if let Some(e) = &r.error {
            line += &format!("\n    error: {e}");
        }
        line.trim_end().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(fmt_ms(0.012345), "0.0123");
        assert_eq!(fmt_ms(12.3456), "12.346");
        assert_eq!(fmt_ratio(2.0), "2.00×");
        assert_eq!(fmt_ratio(12.34), "12.3×");
    }
}
