//! `spattn-bench report`: BENCHMARKS.md and an SVG chart from the JSON of device runs.
//!
//! The markdown has a header (GPU, driver, copy bandwidth, commit, command, date), the
//! geo-means of our time ratios to each peer, one table per graph (each case's time, % of the
//! HBM floor, speedup over `unfused-csr`, error, and each peer's time with the ratio), and the
//! commands that reproduce it. The chart shows each algorithm's speedup over
//! `torch_sparse_attention` per graph (geo-mean over the graph's shapes and dtypes).

mod chart;
mod markdown;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::cases::{self, ATTENTION_PEERS};
use crate::cli::ReportArgs;
use crate::error::{io_error, Error, Result};
use crate::peers::{read_peers, Peers};
use crate::record::{CaseRecord, GraphRecord, PeerComparison, PeerRecord, RunRecord};
use crate::run::read_json;
use crate::timing::geo_mean;

pub use chart::chart_svg;
pub use markdown::{markdown, page_markdown};

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
