//! `spattn-bench report`: BENCHMARKS.md and an SVG chart from the JSON of device runs.
//!
//! The markdown has a header (GPU, driver, copy bandwidth, commit, command, date), the
//! geo-means of our time ratios to each peer, one table per graph (each case's time, % of the
//! HBM floor, speedup over `unfused-csr`, error, and each peer's time with the ratio), and the
//! commands that reproduce it. The chart shows each algorithm's speedup over
//! `torch_sparse_attention` per graph (geo-mean over the graph's shapes and dtypes).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::cases::{self, ATTENTION_PEERS};
use crate::cli::ReportArgs;
use crate::error::{io_error, Error, Result};
use crate::peers::{read_peers, Peers};
use crate::record::{CaseRecord, GraphRecord, PeerComparison, RunRecord};
use crate::run::read_json;
use crate::table::{fmt_ms, fmt_ratio, thousands};
use crate::timing::geo_mean;

/// The peer the chart compares with.
pub const CHART_PEER: &str = "torch_sparse_attention";

/// The comment every generated file carries, followed by the fingerprint of its inputs: a file
/// is overwritten only where it carries the same one (or with `--force`).
pub const MARKER: &str = "spattn-bench report inputs fnv1a64=";

/// Writes the report `args` asks for; returns the paths written.
///
/// # Errors
/// Unreadable or malformed JSON, files that cannot be written, and an existing output that was
/// not generated from the same inputs (unless `--force`).
pub fn report(args: &ReportArgs) -> Result<Vec<PathBuf>> {
    let runs = args
        .json
        .iter()
        .map(|p| read_json(p))
        .collect::<Result<Vec<_>>>()?;
    let mut extra = Vec::new();
    for path in &args.peers {
        extra.extend(read_peers(path)?);
    }
    let appended = args
        .append
        .iter()
        .map(|p| std::fs::read_to_string(p).map_err(|e| io_error("read", p, e)))
        .collect::<Result<Vec<_>>>()?;
    let mark = marker(args.json.iter().chain(&args.peers).chain(&args.append))?;
    let svg_path = args.svg_path();
    for path in [&args.out, &svg_path] {
        check_overwrite(path, &mark, args.force)?;
    }
    let data = ReportData::new(&runs, extra);
    let svg = chart_svg(&data)? + &format!("\n<!-- {mark} -->\n");
    let link = relative_to(&svg_path, &args.out);
    let inputs: Vec<String> = args.json.iter().map(|p| p.display().to_string()).collect();
    let mut md = markdown(&data, Some(&link), &inputs);
    for text in &appended {
        md.push('\n');
        md.push_str(text.trim_end());
        md.push('\n');
    }
    md.push_str(&format!("\n<!-- {mark} -->\n"));
    write_file(&svg_path, &svg)?;
    write_file(&args.out, &md)?;
    Ok(vec![args.out.clone(), svg_path])
}

/// The marker of a report made from `inputs`: [`MARKER`] and an FNV-1a hash of their bytes.
fn marker<'a>(inputs: impl Iterator<Item = &'a PathBuf>) -> Result<String> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for path in inputs {
        let bytes = std::fs::read(path).map_err(|e| io_error("read", path, e))?;
        // Each file's length first, so that moving bytes between files changes the hash.
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(&bytes) {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    Ok(format!("{MARKER}{h:016x}"))
}

/// Refuses to overwrite `path` unless it carries `mark` (the same inputs made it) or `force`.
fn check_overwrite(path: &Path, mark: &str, force: bool) -> Result<()> {
    if force || !path.exists() {
        return Ok(());
    }
    let same = std::fs::read_to_string(path).is_ok_and(|text| text.contains(mark));
    if same {
        return Ok(());
    }
    Err(Error::new(format!(
        "{} exists and was not generated from these inputs: not overwritten (pass --force to \
         replace it, or --out / --svg another file)",
        path.display()
    )))
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| io_error("create the folder", dir, e))?;
    }
    std::fs::write(path, text).map_err(|e| io_error("write", path, e))
}

/// `path` relative to the folder of `base` where it lies under it (for a link from `base`).
pub fn relative_to(path: &Path, base: &Path) -> String {
    let dir = base.parent().unwrap_or(Path::new(""));
    let rel = path.strip_prefix(dir).unwrap_or(path);
    rel.to_string_lossy().replace('\\', "/")
}

/// The chart's data: graphs along x, one series of bars per algorithm.
#[derive(Clone, Debug, PartialEq)]
pub struct ChartData {
    /// Graph names, in the order of the runs.
    pub graphs: Vec<String>,
    /// One series per algorithm case.
    pub series: Vec<ChartSeries>,
}

/// The bars of one algorithm: its speedup per graph (`None`: not timed there).
#[derive(Clone, Debug, PartialEq)]
pub struct ChartSeries {
    /// Case name.
    pub case: String,
    /// Per graph of [`ChartData::graphs`].
    pub values: Vec<Option<f64>>,
}

/// A geo-mean of our ratios to one peer.
#[derive(Clone, Debug, PartialEq)]
pub struct GeoMean {
    /// Our case.
    pub case: String,
    /// The peer.
    pub peer: String,
    /// Geo-mean of peer time / our time.
    pub ratio: f64,
    /// Configurations it is taken over.
    pub count: usize,
}

/// The runs of a report, merged: cases with their peer comparisons recomputed from every peer
/// record available.
#[derive(Clone, Debug)]
pub struct ReportData<'a> {
    /// The runs, in the order given.
    pub runs: &'a [RunRecord],
    /// Graph statistics by name (first run that has the graph wins).
    pub graphs: Vec<&'a GraphRecord>,
    /// Every case with its comparisons.
    pub cases: Vec<(&'a CaseRecord, Vec<PeerComparison>)>,
}

impl<'a> ReportData<'a> {
    /// Merges `runs`, adding the peer records `extra` to those the runs recorded.
    pub fn new(runs: &'a [RunRecord], extra: Vec<crate::record::PeerRecord>) -> Self {
        let mut graphs: Vec<&GraphRecord> = Vec::new();
        for g in runs.iter().flat_map(|r| &r.graphs) {
            if !graphs.iter().any(|h| h.name == g.name) {
                graphs.push(g);
            }
        }
        let mut records: Vec<_> = runs.iter().flat_map(|r| r.peers.iter().cloned()).collect();
        records.extend(extra);
        let peers = Peers::new(records);
        let cases = runs
            .iter()
            .flat_map(|r| r.cases.iter().map(move |c| (r, c)))
            .map(|(run, c)| {
                let nnz = run.graphs.iter().find(|g| g.name == c.graph).map(|g| g.nnz);
                (c, comparisons(&peers, c, nnz, run.device.is_gpu()))
            })
            .collect();
        ReportData {
            runs,
            graphs,
            cases,
        }
    }

    /// Geo-means of the ratios per (our case, peer), with the number of configurations, in the
    /// order: attention algorithms against each attention peer, then ops against theirs.
    pub fn geo_means(&self) -> Vec<GeoMean> {
        let mut order: Vec<&str> = Vec::new();
        let mut pairs: BTreeMap<(usize, usize, usize, String, String), Vec<f64>> = BTreeMap::new();
        for (c, comps) in &self.cases {
            if !order.contains(&c.case.as_str()) {
                order.push(&c.case);
            }
            let appearance = order.iter().position(|x| *x == c.case).unwrap_or(0);
            for p in comps {
                if let Some(r) = p.ratio {
                    let key = (
                        usize::from(c.kind == "op"),
                        peer_rank(&p.peer),
                        appearance,
                        c.case.clone(),
                        p.peer.clone(),
                    );
                    pairs.entry(key).or_default().push(r);
                }
            }
        }
        pairs
            .into_iter()
            .filter_map(|((_, _, _, case, peer), rs)| {
                geo_mean(rs.iter().copied()).map(|ratio| GeoMean {
                    case,
                    peer,
                    ratio,
                    count: rs.len(),
                })
            })
            .collect()
    }

    /// Per graph, per algorithm case: the geo-mean speedup over [`CHART_PEER`].
    pub fn chart_series(&self) -> ChartData {
        let mut graphs: Vec<String> = Vec::new();
        let mut cases: Vec<String> = Vec::new();
        let mut ratios: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
        for (c, comps) in &self.cases {
            let Some(r) = comps
                .iter()
                .find(|p| p.peer == CHART_PEER)
                .and_then(|p| p.ratio)
            else {
                continue;
            };
            if !graphs.contains(&c.graph) {
                graphs.push(c.graph.clone());
            }
            if !cases.contains(&c.case) {
                cases.push(c.case.clone());
            }
            ratios
                .entry((c.graph.clone(), c.case.clone()))
                .or_default()
                .push(r);
        }
        let series = cases
            .into_iter()
            .map(|case| {
                let values = graphs
                    .iter()
                    .map(|g| {
                        ratios
                            .get(&(g.clone(), case.clone()))
                            .and_then(|rs| geo_mean(rs.iter().copied()))
                    })
                    .collect();
                ChartSeries { case, values }
            })
            .collect();
        ChartData { graphs, series }
    }
}

/// Sort rank of a peer: the attention peers in their order, then the op peers.
fn peer_rank(peer: &str) -> usize {
    ATTENTION_PEERS
        .iter()
        .position(|p| *p == peer)
        .unwrap_or(ATTENTION_PEERS.len())
}

/// The peers of a recorded case: the registry's, or by kind for a case this binary does not
/// know (an algorithm added later).
fn peer_names(c: &CaseRecord) -> Vec<&'static str> {
    match cases::find(&c.case) {
        Some(case) => case.peers.to_vec(),
        None if c.kind == "algorithm" => ATTENTION_PEERS.to_vec(),
        None => Vec::new(),
    }
}

fn comparisons(peers: &Peers, c: &CaseRecord, nnz: Option<u64>, gpu: bool) -> Vec<PeerComparison> {
    if !gpu {
        return Vec::new();
    }
    let mut out = Vec::new();
    for name in peer_names(c) {
        let found = peers
            .find(name, &c.graph, c.heads, c.head_dim, &c.dtype)
            .filter(|r| nnz.is_none_or(|n| n == r.nnz));
        match found {
            Some(r) => out.push(PeerComparison {
                peer: r.peer.clone(),
                median_ms: r.median_ms,
                dtype_used: r.dtype_used.clone().unwrap_or_else(|| r.dtype.clone()),
                ratio: c.median_ms.filter(|t| *t > 0.0).map(|t| r.median_ms / t),
            }),
            None => out.extend(c.peers.iter().filter(|p| p.peer == name).cloned()),
        }
    }
    out
}

/// The markdown of the report; `svg` is the chart's link relative to the markdown file,
/// `inputs` the JSON files it was made from.
pub fn markdown(data: &ReportData<'_>, svg: Option<&str>, inputs: &[String]) -> String {
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(w, "# spattn benchmarks\n");
    let _ = writeln!(
        w,
        "<!-- Generated by `spattn-bench report` from {}; regenerate it rather than editing it. -->\n",
        inputs.join(", ")
    );
    let _ = writeln!(
        w,
        "Sparse graph attention `out = softmax(scale · QKᵀ masked by A) · V` (scale = 1/√head_dim), \
         timed against the HBM floor and against the peers measured in the same session on the \
         same GPU.\n"
    );
    if data.runs.iter().any(|r| !r.device.is_gpu()) {
        let _ = writeln!(
            w,
            "> **Not GPU results:** {} made on the CPU (no GPU was available), with no peers \
             and no HBM floor. Regenerate this file from a GPU run (see \"How to reproduce\").\n",
            if data.runs.len() == 1 {
                "this report's run was"
            } else {
                "some of this report's runs were"
            }
        );
    }
    header(w, data.runs);
    summary(w, data, svg);
    results(w, data);
    reproduce(w, data.runs);
    md
}

fn header(w: &mut String, runs: &[RunRecord]) {
    let Some(first) = runs.first() else {
        let _ = writeln!(w, "No runs.\n");
        return;
    };
    let d = &first.device;
    let _ = writeln!(w, "| | |\n|---|---|");
    if d.is_gpu() {
        let mut gpu = d.name.clone();
        let mut extra = Vec::new();
        if let Some(cc) = &d.compute_capability {
            extra.push(format!("sm_{}", cc.replace('.', "")));
        }
        if let Some(sm) = d.sm_count {
            extra.push(format!("{sm} SMs"));
        }
        if let Some(m) = d.memory_bytes {
            extra.push(format!("{:.0} GiB", m as f64 / (1u64 << 30) as f64));
        }
        if !extra.is_empty() {
            gpu += &format!(" ({})", extra.join(", "));
        }
        let _ = writeln!(w, "| GPU | {gpu} |");
        let _ = writeln!(
            w,
            "| CUDA driver | {} |",
            d.driver_version.as_deref().unwrap_or("unknown")
        );
        if let Some(bw) = d.copy_bandwidth_gbs {
            let _ = writeln!(
                w,
                "| copy bandwidth | {} GB/s (device-to-device copy of {:.2} GiB, bytes read + written) |",
                thousands(bw.round() as u64),
                d.copy_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64
            );
        }
    } else {
        let _ = writeln!(
            w,
            "| device | CPU, {} threads — {}; not a GPU run |",
            d.cpu_threads, d.reason
        );
    }
    let mut commits: Vec<&str> = runs.iter().map(|r| r.commit.as_str()).collect();
    commits.dedup();
    let _ = writeln!(w, "| commit | `{}` |", commits.join("`, `"));
    let dates: Vec<&str> = runs.iter().map(|r| r.date.as_str()).collect();
    let date = match (dates.iter().min(), dates.iter().max()) {
        (Some(a), Some(b)) if a != b => format!("{a} – {b}"),
        (Some(a), _) => a.to_string(),
        _ => "unknown".into(),
    };
    let _ = writeln!(w, "| date | {date} |");
    let s = &first.settings;
    let _ = writeln!(
        w,
        "| timing | {}, {} warm-up runs, median of {} |",
        if s.timing == "cuda-events" {
            "CUDA events around the launches"
        } else {
            "wall clock"
        },
        s.warmup,
        s.reps
    );
    let mut torch: Vec<String> = runs
        .iter()
        .flat_map(|r| &r.peers)
        .filter_map(|p| p.torch.as_ref().map(|t| format!("torch {t}")))
        .collect();
    torch.sort();
    torch.dedup();
    if !torch.is_empty() {
        let _ = writeln!(w, "| peers | {} (peers/torch_peers.py) |", torch.join(", "));
    }
    let others: Vec<&str> = runs
        .iter()
        .filter(|r| r.device.name != d.name)
        .map(|r| r.device.name.as_str())
        .collect();
    if !others.is_empty() {
        let _ = writeln!(
            w,
            "| note | some runs are on other devices: {} |",
            others.join(", ")
        );
    }
    for r in runs {
        let _ = writeln!(w, "| command | `{}` |", r.command.replace('|', "\\|"));
    }
    let _ = writeln!(w);
}

fn summary(w: &mut String, data: &ReportData<'_>, svg: Option<&str>) {
    let _ = writeln!(w, "## Summary\n");
    let means = data.geo_means();
    if means.is_empty() {
        let _ = writeln!(
            w,
            "No peer timings in these runs (run with `--peers`, see \"How to reproduce\").\n"
        );
    } else {
        let _ = writeln!(
            w,
            "Geometric means over every graph, shape and dtype both were timed on. \
             Ratio = peer time / spattn time: above 1, spattn is faster.\n"
        );
        let _ = writeln!(w, "| spattn | peer | geo-mean ratio | configurations |");
        let _ = writeln!(w, "|---|---|---:|---:|");
        for m in &means {
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} |",
                m.case,
                m.peer,
                fmt_ratio(m.ratio),
                m.count
            );
        }
        let _ = writeln!(w);
    }
    if let Some(svg) = svg {
        let _ = writeln!(
            w,
            "![speedup of each algorithm over torch.sparse attention, per graph]({svg})\n"
        );
    }
}

fn results(w: &mut String, data: &ReportData<'_>) {
    let _ = writeln!(w, "## Results\n");
    let _ = writeln!(
        w,
        "- **time**: median time of the timed runs (ms): GPU time between CUDA events around \
         the launches, or wall time for CPU runs.\n\
         - **% floor**: the HBM floor's time over ours, ×100. The floor is the bytes that must \
         move once (Q, K, V read and out written; for an op its own operands, scores and \
         probabilities in f32; plus each index array the kernels read) over the measured copy \
         bandwidth.\n\
         - **vs unfused-csr**: unfused-csr's time over ours (same graph, shape, dtype).\n\
         - **error**: ‖out − ref‖ / ‖ref‖ against the f64 CPU reference; ✓ within the tolerance \
         (f32 1e-5, tf32 1e-3 for f32 on tensor cores, f16 5e-3, bf16 2e-2; f32 outputs of ops 1e-5), ✗ not.\n\
         - **peers**: their median time, and in brackets peer time / ours (above 1: spattn is \
         faster). † the peer ran in another dtype (cuSPARSE falls back to f32 where it has no \
         half-precision path).\n"
    );
    let mut graph_names: Vec<&str> = data.graphs.iter().map(|g| g.name.as_str()).collect();
    for (c, _) in &data.cases {
        if !graph_names.contains(&c.graph.as_str()) {
            graph_names.push(&c.graph);
        }
    }
    for name in graph_names {
        let _ = writeln!(w, "### {name}\n");
        if let Some(g) = data.graphs.iter().find(|g| g.name == name) {
            let _ = writeln!(
                w,
                "{} · n {} · nnz {} · degree min {} / mean {:.2} / max {} · empty rows {} · \
                 ME-BCRS fill {:.3} ({} blocks) · BSB fill {:.3} ({} blocks)\n",
                if g.symmetrized {
                    "symmetrized + self loops"
                } else {
                    "as stored"
                },
                thousands(g.n),
                thousands(g.nnz),
                g.degree.min,
                g.degree.mean,
                thousands(g.degree.max),
                thousands(g.degree.empty_rows),
                g.mebcrs.fill,
                thousands(g.mebcrs.blocks),
                g.bsb.fill,
                thousands(g.bsb.blocks),
            );
        }
        let rows: Vec<&(&CaseRecord, Vec<PeerComparison>)> =
            data.cases.iter().filter(|(c, _)| c.graph == name).collect();
        let mut peer_cols: Vec<String> = Vec::new();
        for (_, comps) in &rows {
            for p in comps {
                if !peer_cols.contains(&p.peer) {
                    peer_cols.push(p.peer.clone());
                }
            }
        }
        peer_cols.sort_by_key(|p| (peer_rank(p), p.clone()));
        let _ = write!(
            w,
            "| H | D | dtype | case | time (ms) | % floor | vs unfused-csr | error |"
        );
        for p in &peer_cols {
            let _ = write!(w, " {p} |");
        }
        let _ = write!(w, "\n|--:|--:|---|---|--:|--:|--:|--:|");
        for _ in &peer_cols {
            let _ = write!(w, "--:|");
        }
        let _ = writeln!(w);
        for (c, comps) in rows {
            let dash = || "–".to_string();
            let error = match (&c.error, c.rel_error, c.passed) {
                (Some(e), _, _) => format!("error: {}", e.replace('|', "\\|")),
                (None, Some(e), Some(true)) => format!("{e:.1e} ✓"),
                (None, Some(e), Some(false)) => format!("{e:.1e} ✗"),
                (None, None, Some(false)) => "not finite ✗".into(),
                (None, Some(e), None) => format!("{e:.1e}"),
                (None, None, _) => "not checked".into(),
            };
            let _ = write!(
                w,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                c.heads,
                c.head_dim,
                c.dtype,
                c.case,
                c.median_ms.map(fmt_ms).unwrap_or_else(dash),
                c.pct_of_floor
                    .map(|p| format!("{p:.1}%"))
                    .unwrap_or_else(dash),
                c.speedup_vs_unfused.map(fmt_ratio).unwrap_or_else(dash),
                error
            );
            for p in &peer_cols {
                let cell = comps
                    .iter()
                    .find(|x| &x.peer == p)
                    .map(|x| {
                        let dagger = if x.dtype_used != c.dtype { "†" } else { "" };
                        format!(
                            "{}{dagger} ({})",
                            fmt_ms(x.median_ms),
                            x.ratio.map(fmt_ratio).unwrap_or_else(dash)
                        )
                    })
                    .unwrap_or_else(dash);
                let _ = write!(w, " {cell} |");
            }
            let _ = writeln!(w);
        }
        let _ = writeln!(w);
        let choices: Vec<String> = data
            .cases
            .iter()
            .filter(|(c, _)| c.graph == name)
            .filter_map(|(c, _)| {
                let choice = c
                    .choice
                    .as_deref()
                    .filter(|x| !x.ends_with(": requested"))?;
                Some(format!(
                    "- H={} D={} {} {}: {}",
                    c.heads, c.head_dim, c.dtype, c.case, choice
                ))
            })
            .collect();
        if !choices.is_empty() {
            let _ = writeln!(w, "Algorithm choices:\n\n{}\n", choices.join("\n"));
        }
    }
}

fn reproduce(w: &mut String, runs: &[RunRecord]) {
    let _ = writeln!(w, "## How to reproduce\n");
    let _ = writeln!(
        w,
        "On a machine with Rust, build the GPU bundle (the `spattn-bench` binary, the peer \
         scripts and the graphs); on the GPU machine (an NVIDIA driver, and python3 with torch \
         and torch_geometric for the peers), run the script from the repository root; then \
         generate this file from the JSON it wrote (`--force`: replace this file, which other \
         runs made):\n"
    );
    let _ = writeln!(
        w,
        "```sh\n\
         cargo xtask gpu-bundle\n\
         bash crates/bench/run_gpu_bench.sh --bundle target/gpu-bundle --out bench-results\n\
         cargo run --release -p spattn-bench -- report --json bench-results/spattn-*.json \\\n    \
         --out BENCHMARKS.md --svg docs/benchmarks.svg --force\n\
         ```\n"
    );
    let _ = writeln!(w, "The runs of this report:\n\n```sh");
    for r in runs {
        let _ = writeln!(w, "{}", r.command);
    }
    let _ = writeln!(w, "```");
}

/// Bar colours of the chart, one per algorithm.
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn plot_err<E: std::fmt::Display>(e: E) -> Error {
    Error::new(format!("drawing the chart: {e}"))
}

/// The SVG chart: per graph, each algorithm's speedup over [`CHART_PEER`] (geo-mean over the
/// graph's shapes and dtypes), with a line at 1×. Without such data, an SVG that says so.
///
/// # Errors
/// Drawing failures.
pub fn chart_svg(data: &ReportData<'_>) -> Result<String> {
    let ChartData { graphs, series } = data.chart_series();
    let n = graphs.len();
    let width = (200 + 60 * n * series.len().max(1)).clamp(640, 1600) as u32;
    let height = 520u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        if n == 0 || series.is_empty() {
            let style = TextStyle::from(("sans-serif", 18).into_font())
                .pos(Pos::new(HPos::Center, VPos::Center));
            root.draw(&Text::new(
                format!("no {CHART_PEER} peer timings in these runs"),
                (width as i32 / 2, height as i32 / 2),
                style,
            ))
            .map_err(plot_err)?;
            root.present().map_err(plot_err)?;
        } else {
            draw_bars(&root, &graphs, &series)?;
        }
    }
    Ok(svg)
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    graphs: &[String],
    series: &[ChartSeries],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let n = graphs.len();
    let top = series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .fold(1.0f64, |m, &x| m.max(x));
    // Headroom above the tallest bar for its label and the legend (upper right).
    let y_max = (top * 1.45).max(1.5);
    let mut chart = ChartBuilder::on(root)
        .caption(
            "spattn speedup over torch.sparse attention (cuSPARSE SDDMM → softmax → SpMM)",
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, 0f64..y_max)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE)
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .y_desc("speedup (torch.sparse time / spattn time)")
        .y_label_formatter(&|y| format!("{y:.1}×"))
        .draw()
        .map_err(plot_err)?;
    let k = series.len() as f64;
    let slot = 0.8 / k;
    for (s, ChartSeries { case, values }) in series.iter().enumerate() {
        let color = COLORS[s % COLORS.len()];
        let bars = values.iter().enumerate().filter_map(|(g, v)| {
            v.map(|v| {
                let x0 = g as f64 + 0.1 + s as f64 * slot;
                Rectangle::new(
                    [(x0 + 0.05 * slot, 0.0), (x0 + 0.95 * slot, v)],
                    color.filled(),
                )
            })
        });
        chart
            .draw_series(bars)
            .map_err(plot_err)?
            .label(case.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        let labels = values.iter().enumerate().filter_map(|(g, v)| {
            v.map(|v| {
                let x = g as f64 + 0.1 + (s as f64 + 0.5) * slot;
                Text::new(
                    format!("{v:.2}×"),
                    (x, v),
                    TextStyle::from(("sans-serif", 12).into_font())
                        .pos(Pos::new(HPos::Center, VPos::Bottom)),
                )
            })
        });
        chart.draw_series(labels).map_err(plot_err)?;
    }
    // Drawn over the bars: where a bar ends below it, spattn is slower than torch.sparse.
    chart
        .draw_series(LineSeries::new(
            [(0.0, 1.0), (n as f64, 1.0)],
            BLACK.stroke_width(1),
        ))
        .map_err(plot_err)?
        .label("1× = torch.sparse")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 12, y)], BLACK.stroke_width(1)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    let style =
        TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (g, name) in graphs.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        root.draw(&Text::new(name.clone(), (x, y + 8), style.clone()))
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}
