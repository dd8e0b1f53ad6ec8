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
use crate::record::{CaseRecord, GraphRecord, PeerComparison, PeerRecord, RunRecord};
use crate::run::read_json;
use crate::table::{fmt_ms, fmt_ratio, thousands};
use crate::timing::geo_mean;

/// Our case the chart compares with every peer.
pub const CHART_CASE: &str = "auto";

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
    let read_all = |paths: &[PathBuf]| {
        paths
            .iter()
            .map(|p| std::fs::read_to_string(p).map_err(|e| io_error("read", p, e)))
            .collect::<Result<Vec<_>>>()
    };
    let appended = read_all(&args.append)?;
    let appended_full = read_all(&args.append_full)?;
    let mark = marker(
        args.json
            .iter()
            .chain(&args.peers)
            .chain(&args.append)
            .chain(&args.append_full),
    )?;
    let svg_path = args.svg_path();
    let full_path = args.full.clone();
    for path in std::iter::once(&args.out)
        .chain(std::iter::once(&svg_path))
        .chain(full_path.iter())
    {
        check_overwrite(path, &mark, args.force)?;
    }
    let data = ReportData::new(&runs, extra);
    let svg = chart_svg(&data)? + &format!("\n<!-- {mark} -->\n");
    // The peer files too: a record they hold overrides the runs' own (later records win).
    let inputs: Vec<String> = args
        .json
        .iter()
        .chain(&args.peers)
        .map(|p| file_label(p))
        .collect();
    let with_tail = |mut md: String, tails: &[String]| {
        for text in tails {
            md.push('\n');
            md.push_str(text.trim_end());
            md.push('\n');
        }
        md.push_str(&format!("\n<!-- {mark} -->\n"));
        md
    };
    let mut written = vec![args.out.clone(), svg_path.clone()];
    write_file(&svg_path, &svg)?;
    match &full_path {
        Some(full) => {
            let links = Links {
                svg: Some(relative_to(&svg_path, &args.out)),
                full: Some(relative_to(full, &args.out)),
            };
            let full_links = Links {
                svg: Some(relative_to(&svg_path, full)),
                full: None,
            };
            write_file(
                full,
                &with_tail(markdown(&data, &full_links, &inputs), &appended_full),
            )?;
            write_file(
                &args.out,
                &with_tail(page_markdown(&data, &links, &inputs), &appended),
            )?;
            written.push(full.clone());
        }
        None => {
            let links = Links {
                svg: Some(relative_to(&svg_path, &args.out)),
                full: None,
            };
            let tails: Vec<String> = appended.into_iter().chain(appended_full).collect();
            write_file(
                &args.out,
                &with_tail(markdown(&data, &links, &inputs), &tails),
            )?;
        }
    }
    Ok(written)
}

/// Where the generated files point to, relative to the file being written.
#[derive(Clone, Debug, Default)]
pub struct Links {
    /// The chart.
    pub svg: Option<String>,
    /// The full tables (from the one-page report).
    pub full: Option<String>,
}

/// A file name for the report's provenance line (folders are the machine's, not the result's).
fn file_label(path: &Path) -> String {
    path.file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
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
    /// The peers' preprocessing records (`*_preprocess`: Fused3S's `preprocess_gpu`, …).
    pub preprocess: Vec<PeerRecord>,
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
        let preprocess = records
            .iter()
            .filter(|r| r.peer.ends_with("_preprocess"))
            .cloned()
            .collect();
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
            preprocess,
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
                // Only where the peer ran within tolerance: a fast wrong answer is no win.
                if let Versus::Faster(r) = versus(p) {
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

    /// Per graph, per peer: `auto`'s geo-mean speedup over the peer (configurations where the
    /// peer ran within tolerance).
    pub fn chart_series(&self) -> ChartData {
        let mut graphs: Vec<String> = Vec::new();
        let mut peers: Vec<String> = Vec::new();
        let mut ratios: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
        for (c, comps) in self.cases.iter().filter(|(c, _)| c.case == CHART_CASE) {
            for p in comps {
                let Versus::Faster(r) = versus(p) else {
                    continue;
                };
                if !graphs.contains(&c.graph) {
                    graphs.push(c.graph.clone());
                }
                if !peers.contains(&p.peer) {
                    peers.push(p.peer.clone());
                }
                ratios
                    .entry((c.graph.clone(), p.peer.clone()))
                    .or_default()
                    .push(r);
            }
        }
        peers.sort_by_key(|p| (peer_rank(p), p.clone()));
        let series = peers
            .into_iter()
            .map(|peer| {
                let values = graphs
                    .iter()
                    .map(|g| {
                        ratios
                            .get(&(g.clone(), peer.clone()))
                            .and_then(|rs| geo_mean(rs.iter().copied()))
                    })
                    .collect();
                ChartSeries { case: peer, values }
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
            Some(r) => out.push(r.compared_with(c.median_ms)),
            None => out.extend(c.peers.iter().filter(|p| p.peer == name).cloned()),
        }
    }
    out
}

/// The title and the generated-file marker both reports open with (`inputs` as in [`markdown`]).
fn preamble(inputs: &[String]) -> String {
    format!(
        "# spattn benchmarks\n\n<!-- Generated by `spattn-bench report` from {}; regenerate it \
         rather than editing it. -->\n\n",
        inputs.join(", ")
    )
}

/// A table's header row and alignment row: the fixed columns, then one right-aligned column
/// per peer.
fn table_head(w: &mut String, fixed: &str, align: &str, peers: &[String]) {
    let _ = write!(w, "{fixed}");
    for p in peers {
        let _ = write!(w, " {p} |");
    }
    let _ = write!(w, "\n{align}");
    for _ in peers {
        let _ = write!(w, "--:|");
    }
    let _ = writeln!(w);
}

/// The full report: every case of every graph with every peer; `links` relative to the
/// markdown file, `inputs` the JSON files it was made from.
pub fn markdown(data: &ReportData<'_>, links: &Links, inputs: &[String]) -> String {
    let mut md = preamble(inputs);
    let w = &mut md;
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
    summary(w, data, links.svg.as_deref());
    auto_summary(w, data);
    peer_limits(w, data);
    plan_times(w, data);
    results(w, data);
    reproduce(w, data.runs);
    md
}

/// The one-page report: what was measured, `auto` against each peer per dtype, the key
/// configurations, what the peers could not run, how to reproduce; the full tables linked.
pub fn page_markdown(data: &ReportData<'_>, links: &Links, inputs: &[String]) -> String {
    let mut md = preamble(inputs);
    let w = &mut md;
    let _ = writeln!(
        w,
        "Sparse graph attention `out = softmax(scale · QKᵀ masked by A) · V` (scale = 1/√head_dim) \
         against the peers a user would pick today, measured in the same device calls on the \
         same GPU, each peer in the fastest form found for it and with its accuracy against the \
         same f64 reference as ours. `auto` is what a user gets: fused-tc for f16/bf16, \
         fused-csr for f32.\n"
    );
    header(w, data.runs);
    auto_summary(w, data);
    if let Some(svg) = &links.svg {
        let _ = writeln!(
            w,
            "![auto's speedup over each peer (peer time / spattn time), per graph]({svg})\n"
        );
    }
    key_results(w, data);
    peer_limits(w, data);
    if let Some(full) = &links.full {
        let _ = writeln!(
            w,
            "Every graph, shape, dtype and algorithm, with the ops and the HBM floor: \
             [the full tables]({full}).\n"
        );
    }
    reproduce(w, data.runs);
    md
}

/// One `auto` case against one peer, as the summaries count it.
enum Versus {
    /// The peer ran within tolerance: peer time / ours.
    Faster(f64),
    /// The peer ran but its error exceeds the tolerance (its time is not a win).
    Wrong,
    /// The peer could not run the case (unsupported, out of memory, an error).
    Limit,
}

fn versus(p: &PeerComparison) -> Versus {
    match (p.status.as_str(), p.ok, p.ratio) {
        ("ok", Some(false), _) => Versus::Wrong,
        ("ok", _, Some(r)) => Versus::Faster(r),
        _ => Versus::Limit,
    }
}

/// The attention peers present in `data`, in registry order.
fn attention_peers_present(data: &ReportData<'_>) -> Vec<String> {
    let mut peers: Vec<String> = Vec::new();
    for (c, comps) in &data.cases {
        if c.kind != "algorithm" {
            continue;
        }
        for p in comps {
            if !peers.contains(&p.peer) {
                peers.push(p.peer.clone());
            }
        }
    }
    peers.sort_by_key(|p| (peer_rank(p), p.clone()));
    peers
}

/// `auto` against each attention peer, per dtype: geo-mean and smallest ratio over the cases
/// the peer ran correctly, how many it got wrong or could not run, and the errors.
fn auto_summary(w: &mut String, data: &ReportData<'_>) {
    let peers = attention_peers_present(data);
    let autos: Vec<&(&CaseRecord, Vec<PeerComparison>)> = data
        .cases
        .iter()
        .filter(|(c, _)| c.case == "auto")
        .collect();
    if autos.is_empty() || peers.is_empty() {
        return;
    }
    let _ = writeln!(w, "## `auto` against each peer\n");
    let _ = writeln!(
        w,
        "Ratio = peer time / spattn time (above 1: spattn is faster), geometric mean and smallest \
         over the configurations where the peer ran and its output is within the dtype's \
         tolerance. ✗: the peer ran but its error exceeds the tolerance (its time is not \
         counted as a win). limit: the peer cannot run the configuration (see below). Errors are \
         ‖out − ref‖ / ‖ref‖ against the f64 reference, the largest over the configurations \
         the peer ran.\n"
    );
    let _ = writeln!(
        w,
        "| peer | dtype | geo-mean | min | configs | ✗ | limit | peer max error | spattn max error |"
    );
    let _ = writeln!(w, "|---|---|--:|--:|--:|--:|--:|--:|--:|");
    let mut dtypes: Vec<&str> = autos.iter().map(|(c, _)| c.dtype.as_str()).collect();
    dtypes.sort();
    dtypes.dedup();
    for peer in &peers {
        for dtype in &dtypes {
            let (mut ratios, mut wrong, mut limit) = (Vec::new(), 0, 0);
            let (mut peer_err, mut our_err) = (None::<f64>, None::<f64>);
            for (c, comps) in autos.iter().filter(|(c, _)| c.dtype == *dtype) {
                let Some(p) = comps.iter().find(|p| &p.peer == peer) else {
                    continue;
                };
                match versus(p) {
                    Versus::Faster(r) => ratios.push(r),
                    Versus::Wrong => wrong += 1,
                    Versus::Limit => limit += 1,
                }
                if p.status == "ok" {
                    peer_err = max_opt(peer_err, p.rel_err);
                    our_err = max_opt(our_err, c.rel_error);
                }
            }
            if ratios.is_empty() && wrong == 0 && limit == 0 {
                continue;
            }
            let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let dash = || "–".to_string();
            let _ = writeln!(
                w,
                "| {peer} | {dtype} | {} | {} | {} | {wrong} | {limit} | {} | {} |",
                geo_mean(ratios.iter().copied())
                    .map(fmt_ratio)
                    .unwrap_or_else(dash),
                if ratios.is_empty() {
                    dash()
                } else {
                    fmt_ratio(min)
                },
                ratios.len(),
                peer_err.map(|e| format!("{e:.1e}")).unwrap_or_else(dash),
                our_err.map(|e| format!("{e:.1e}")).unwrap_or_else(dash),
            );
        }
    }
    let _ = writeln!(w);
}

fn max_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// Graphs the one-page report shows configuration by configuration, where present.
const KEY_GRAPHS: &[&str] = &["cora", "pubmed", "ogbn-arxiv", "rmat-18", "rmat-20"];
/// (heads, head_dim) of the key configurations.
const KEY_SHAPES: &[(u32, u32)] = &[(1, 128), (8, 64)];

/// `auto` and every attention peer on the key graphs and shapes.
fn key_results(w: &mut String, data: &ReportData<'_>) {
    let peers = attention_peers_present(data);
    let autos: Vec<&(&CaseRecord, Vec<PeerComparison>)> = data
        .cases
        .iter()
        .filter(|(c, _)| c.case == "auto")
        .collect();
    // The key graphs and shapes where the runs have them, else every one they have.
    let graphs_here = autos
        .iter()
        .any(|(c, _)| KEY_GRAPHS.contains(&c.graph.as_str()));
    let shapes_here = autos
        .iter()
        .any(|(c, _)| KEY_SHAPES.contains(&(c.heads, c.head_dim)));
    let rows: Vec<&(&CaseRecord, Vec<PeerComparison>)> = autos
        .into_iter()
        .filter(|(c, _)| {
            (!graphs_here || KEY_GRAPHS.contains(&c.graph.as_str()))
                && (!shapes_here || KEY_SHAPES.contains(&(c.heads, c.head_dim)))
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(w, "## Key configurations\n");
    let _ = writeln!(
        w,
        "`auto`'s time (ms) and error; each peer's time, in brackets peer time / ours, and its \
         error (✓ within tolerance, ✗ not); † the peer ran in another dtype; a limit names why \
         the peer did not run.\n"
    );
    table_head(
        w,
        "| graph | H | D | dtype | auto (ms) | error |",
        "|---|--:|--:|---|--:|--:|",
        &peers,
    );
    let mut sorted = rows;
    sorted.sort_by_key(|(c, _)| {
        (
            KEY_GRAPHS.iter().position(|g| *g == c.graph),
            c.dtype.clone(),
            c.heads,
            c.head_dim,
        )
    });
    for (c, comps) in sorted {
        let _ = write!(
            w,
            "| {} | {} | {} | {} | {} | {} |",
            c.graph,
            c.heads,
            c.head_dim,
            c.dtype,
            c.median_ms.map(fmt_ms).unwrap_or_else(|| "–".into()),
            our_error(c)
        );
        for p in &peers {
            let _ = write!(w, " {} |", peer_cell(comps, p, &c.dtype, true));
        }
        let _ = writeln!(w);
    }
    let _ = writeln!(w);
}

/// How long plans took to build, per graph and algorithm (fastest and slowest over the
/// configurations: a graph's first plan also builds and uploads its formats), the graph's
/// device uploads after them, and the peers' preprocessing on the same graph.
fn plan_times(w: &mut String, data: &ReportData<'_>) {
    // (graph, case) -> (fastest, slowest, configurations, largest graph upload, largest host
    // peak)
    type Row = (f64, f64, usize, u64, Option<u64>);
    let mut rows: BTreeMap<(String, String), Row> = BTreeMap::new();
    for (c, _) in &data.cases {
        if let Some(ms) = c.plan_ms {
            let e = rows.entry((c.graph.clone(), c.case.clone())).or_insert((
                f64::INFINITY,
                0.0,
                0,
                0,
                None,
            ));
            e.0 = e.0.min(ms);
            e.1 = e.1.max(ms);
            e.2 += 1;
            e.3 = e.3.max(c.graph_device_bytes.unwrap_or(0));
            e.4 = e.4.max(c.plan_host_peak_bytes);
        }
    }
    // Runs that recorded the host peak get its column (older JSON has none).
    let peaks = rows.values().any(|r| r.4.is_some());
    if rows.is_empty() {
        return;
    }
    let mut prep: BTreeMap<&str, BTreeMap<&str, f64>> = BTreeMap::new();
    for r in &data.preprocess {
        if let Some(ms) = r.median_ms {
            let best = prep
                .entry(&r.graph)
                .or_default()
                .entry(&r.peer)
                .or_insert(ms);
            *best = best.min(ms);
        }
    }
    let _ = writeln!(
        w,
        "## Plan time
"
    );
    let _ = writeln!(
        w,
        "`AttentionPlan::on_graph` wall time per graph and algorithm, fastest and slowest over \
         the configurations (the graph's first plan also builds and uploads its formats; later \
         plans reuse them), the graph's device uploads afterwards, {}and the peers' \
         preprocessing of the same graph (fastest over its records).\n",
        if peaks {
            "the largest rise of the process's resident memory during a build above where it \
             started (every thread's; a graph's first plan builds its formats), "
        } else {
            ""
        }
    );
    let (peak_head, peak_rule) = if peaks {
        (" plan host peak (MiB) |", "--:|")
    } else {
        ("", "")
    };
    let _ = writeln!(
        w,
        "| graph | algorithm | plan (ms) | configurations | graph uploads (MiB) |{peak_head} peers' preprocessing (ms) |"
    );
    let _ = writeln!(w, "|---|---|--:|--:|--:|{peak_rule}---|");
    let mut last_graph = "";
    for ((graph, case), (lo, hi, n, bytes, peak)) in &rows {
        let peers = if graph.as_str() != last_graph {
            prep.get(graph.as_str())
                .map(|m| {
                    m.iter()
                        .map(|(p, ms)| {
                            format!("{}: {}", p.trim_end_matches("_preprocess"), fmt_ms(*ms))
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default()
        } else {
            String::new()
        };
        last_graph = graph;
        let range = if (hi - lo).abs() < 1e-9 {
            fmt_ms(*lo)
        } else {
            format!("{}–{}", fmt_ms(*lo), fmt_ms(*hi))
        };
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let peak_cell = match (peaks, peak) {
            (false, _) => String::new(),
            (true, Some(p)) => format!(" {:.1} |", mib(*p)),
            (true, None) => " — |".into(),
        };
        let _ = writeln!(
            w,
            "| {graph} | {case} | {range} | {n} | {:.1} |{peak_cell} {peers} |",
            mib(*bytes)
        );
    }
    let _ = writeln!(w);
}

/// Every configuration a peer could not run, grouped by peer and reason.
fn peer_limits(w: &mut String, data: &ReportData<'_>) {
    let mut limits: BTreeMap<(String, String, String), Vec<String>> = BTreeMap::new();
    let mut seen = std::collections::HashSet::new();
    for (c, comps) in &data.cases {
        for p in comps.iter().filter(|p| p.status != "ok") {
            // One entry per (peer, graph, shape, dtype), whichever of our cases it sits beside.
            let key = (
                p.peer.clone(),
                c.graph.clone(),
                c.heads,
                c.head_dim,
                c.dtype.clone(),
            );
            if !seen.insert(key) {
                continue;
            }
            limits
                .entry((
                    p.peer.clone(),
                    p.status.clone(),
                    p.reason.clone().unwrap_or_else(|| "no reason given".into()),
                ))
                .or_default()
                .push(format!(
                    "{} H{} D{} {}",
                    c.graph, c.heads, c.head_dim, c.dtype
                ));
        }
    }
    if limits.is_empty() {
        return;
    }
    let _ = writeln!(w, "## What the peers could not run\n");
    let _ = writeln!(w, "| peer | status | reason | configurations |");
    let _ = writeln!(w, "|---|---|---|---|");
    for ((peer, status, reason), cases) in &limits {
        let shown: Vec<&str> = cases.iter().take(4).map(String::as_str).collect();
        let more = if cases.len() > 4 {
            format!(" and {} more", cases.len() - 4)
        } else {
            String::new()
        };
        let _ = writeln!(
            w,
            "| {peer} | {status} | {} | {} ({}){more} |",
            reason.replace('|', "\\|"),
            cases.len(),
            shown.join(", ")
        );
    }
    let _ = writeln!(w);
}

/// Our error cell: `1.2e-4 ✓`, `✗`, or why there is none.
fn our_error(c: &CaseRecord) -> String {
    match (&c.error, c.rel_error, c.passed) {
        (Some(e), _, _) => format!("error: {}", e.replace('|', "\\|")),
        (None, Some(e), Some(true)) => format!("{e:.1e} ✓"),
        (None, Some(e), Some(false)) => format!("{e:.1e} ✗"),
        (None, None, Some(false)) => "not finite ✗".into(),
        (None, Some(e), None) => format!("{e:.1e}"),
        (None, None, _) => "not checked".into(),
    }
}

/// A peer's cell beside one of our cases: `time† (ratio) error ✓/✗`, or its limit.
fn peer_cell(comps: &[PeerComparison], peer: &str, dtype: &str, with_error: bool) -> String {
    let Some(x) = comps.iter().find(|x| x.peer == peer) else {
        return "–".into();
    };
    if x.status != "ok" {
        return x.status.clone();
    }
    let Some(ms) = x.median_ms else {
        return "–".into();
    };
    let dagger = if x.dtype_used != dtype { "†" } else { "" };
    let ratio = x.ratio.map(fmt_ratio).unwrap_or_else(|| "–".into());
    let error = match (with_error, x.rel_err, x.ok) {
        (false, _, _) | (true, None, _) => String::new(),
        (true, Some(e), Some(false)) => format!(" {e:.1e} ✗"),
        (true, Some(e), _) => format!(" {e:.1e} ✓"),
    };
    format!("{}{dagger} ({ratio}){error}", fmt_ms(ms))
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
    // Each commit once, in the runs' order (runs of one commit need not be adjacent).
    let mut commits: Vec<&str> = Vec::new();
    for r in runs {
        if !commits.contains(&r.commit.as_str()) {
            commits.push(r.commit.as_str());
        }
    }
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
         - **peers**: their median time, in brackets peer time / ours (above 1: spattn is \
         faster), and their error against the same f64 reference (✓ within the tolerance, ✗ \
         not). † the peer ran in another dtype (cuSPARSE falls back to f32 where it has no \
         half-precision path). `unsupported`, `oom`, `error`: the peer could not run the \
         configuration (reasons under \"What the peers could not run\").\n"
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
        table_head(
            w,
            "| H | D | dtype | case | time (ms) | % floor | vs unfused-csr | error |",
            "|--:|--:|---|---|--:|--:|--:|--:|",
            &peer_cols,
        );
        for (c, comps) in rows {
            let dash = || "–".to_string();
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
                our_error(c)
            );
            for p in &peer_cols {
                let _ = write!(w, " {} |", peer_cell(comps, p, &c.dtype, true));
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
         # on the GPU machine, in the bundle (peers/build_peers.sh builds the fused peers from \
         their sources, if present):\n\
         tar -xf bench.tar.xz && bash peers/run_gpu_bench.sh --bundle . --out results\n\
         # back here:\n\
         cargo run --release -p spattn-bench -- report --json results/spattn-*.json \\\n    \
         --out BENCHMARKS.md --full docs/benchmarks-full.md --svg docs/benchmarks.svg --force\n\
         ```\n"
    );
    let _ = writeln!(w, "The runs of this report:\n\n```sh");
    for r in runs {
        let _ = writeln!(w, "{}", r.command);
    }
    let _ = writeln!(w, "```");
}

/// Bar colours of the chart, one per algorithm.
const COLORS: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(57, 59, 121),
    RGBColor(173, 73, 74),
];

fn plot_err<E: std::fmt::Display>(e: E) -> Error {
    Error::new(format!("drawing the chart: {e}"))
}

/// The SVG chart: per graph, `auto`'s speedup over each peer (geo-mean over the graph's shapes
/// and dtypes), with a line at 1×. Without such data, an SVG that says so.
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
                "no peer timings of auto in these runs".to_string(),
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
            "spattn auto: speedup over each peer (peer time / spattn time)",
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
        .y_desc("speedup (peer time / spattn time)")
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
        .label("1× = the peer")
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
