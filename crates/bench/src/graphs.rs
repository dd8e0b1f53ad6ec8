//! The graphs of a run: where they are found, how they are loaded or generated, their names
//! and their statistics.
//!
//! A `--graph` argument is a file (MatrixMarket `.mtx` / `.mtx.gz`, a SNAP-style edge list
//! with `# comments` and 0-based `src dst` lines, plain or gzip'd, or the binary `.csr` of
//! [`crate::csr_file`]), or a bare name looked up in the data folders: `--data-dir`,
//! `$SPATTN_DATA_DIR`, `data/` beside the binary's folder (the layout of `cargo xtask
//! gpu-bundle`: `bench/spattn-bench`, `data/*.mtx.gz`), and the repository's own folders as
//! they were when the binary was built. Cora, the default graph, is also built into the binary,
//! so a copied binary runs anywhere.

use std::io::BufReader;
use std::path::{Path, PathBuf};

use spattn_formats::{
    read_edge_list, read_matrix_market, read_matrix_market_from, rmat, Bsb, Csr, MeBcrs, RmatConfig,
};

use crate::csr_file;
use crate::error::{Error, Result};
use crate::progress::step;
use crate::record::{DegreeRecord, FillRecord, GraphRecord};

/// Cora as gzip'd MatrixMarket, built into the binary: the last resort of the default run.
pub static BUILT_IN_CORA: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../formats/tests/data/cora.mtx.gz"
));

/// The environment variable naming a data folder.
pub const DATA_DIR_ENV: &str = "SPATTN_DATA_DIR";

/// ME-BCRS vectors per tensor-core block in the statistics (f16/bf16 blocks).
pub const MEBCRS_BLOCK_WIDTH: usize = 8;

/// A graph the run was asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GraphSpec {
    /// The default graph: cora from the data folders, else the built-in copy.
    Cora,
    /// A `--graph` argument: a path or a name in the data folders.
    File(String),
    /// An R-MAT graph of `2^scale` nodes.
    Rmat(u32),
}

/// The folders a graph name is looked up in, in order.
#[derive(Clone, Debug, Default)]
pub struct DataDirs {
    dirs: Vec<PathBuf>,
}

impl DataDirs {
    /// `explicit` (--data-dir), `$SPATTN_DATA_DIR`, `../data` beside the executable, and the
    /// repository's `crates/formats/tests/data` and `../shared/data/mtx` (as of the build).
    pub fn new(explicit: Option<&Path>) -> Self {
        // The folders of `spattn_test_support::data_dirs`, in its order, after --data-dir: that
        // crate is a dev-dependency, which this run-time lookup cannot call; keep the two in step.
        let mut dirs: Vec<PathBuf> = Vec::new();
        dirs.extend(explicit.map(Path::to_path_buf));
        if let Some(dir) = std::env::var_os(DATA_DIR_ENV).filter(|d| !d.is_empty()) {
            dirs.push(PathBuf::from(dir));
        }
        if let Ok(exe) = std::env::current_exe() {
            if let Some(bin_dir) = exe.parent() {
                dirs.push(bin_dir.join("data"));
                if let Some(up) = bin_dir.parent() {
                    dirs.push(up.join("data"));
                }
            }
        }
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        for dir in ["../formats/tests/data", "../../../shared/data/mtx"] {
            let dir = manifest.join(dir);
            // Clean paths in messages and records where the folder exists.
            dirs.push(std::fs::canonicalize(&dir).unwrap_or(dir));
        }
        DataDirs { dirs }
    }

    /// Only these folders (for tests).
    pub fn only(dirs: Vec<PathBuf>) -> Self {
        DataDirs { dirs }
    }

    /// The folders, in lookup order.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The first of `name`, `name.mtx.gz`, `name.mtx`, `name.csr` in the folders.
    pub fn find(&self, name: &str) -> Option<PathBuf> {
        let candidates = [
            name.to_string(),
            format!("{name}.mtx.gz"),
            format!("{name}.mtx"),
            format!("{name}.csr"),
        ];
        self.dirs
            .iter()
            .flat_map(|d| candidates.iter().map(move |c| d.join(c)))
            .find(|p| p.is_file())
    }
}

/// The name of a graph file: its file name without `.gz`, `.mtx`, `.csr`
/// (`data/ogbn-arxiv.mtx.gz` → `ogbn-arxiv`).
pub fn graph_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let mut name = file.as_str();
    name = name.strip_suffix(".gz").unwrap_or(name);
    for ext in [".mtx", ".csr", ".txt", ".edges", ".el", ".tsv"] {
        name = name.strip_suffix(ext).unwrap_or(name);
    }
    name.to_string()
}

/// The name of an R-MAT graph: `rmat-<scale>`.
pub fn rmat_name(scale: u32) -> String {
    format!("rmat-{scale}")
}

/// A graph ready to benchmark.
#[derive(Clone, Debug)]
pub struct Graph {
    /// Name in every record.
    pub name: String,
    /// Where it came from.
    pub source: String,
    /// The attention mask (pattern only).
    pub csr: Csr,
    /// Whether it was symmetrized with self loops.
    pub symmetrized: bool,
    /// Seconds spent reading or generating it.
    pub load_seconds: f64,
}

/// How a spec is loaded.
#[derive(Clone, Debug)]
pub struct LoadOptions<'a> {
    /// The folders names are looked up in.
    pub data_dirs: &'a DataDirs,
    /// A + Aᵀ + I (the benchmark convention) or the graph as stored.
    pub symmetrize: bool,
    /// Seed of R-MAT graphs.
    pub rmat_seed: u64,
    /// The host memory a generated graph may take (`--host-memory`), else what the system
    /// reports available.
    pub host_memory: Option<u64>,
}

/// Resolves a `--graph` argument to a file.
///
/// # Errors
/// When it is neither a file nor a name found in the data folders.
pub fn resolve(arg: &str, dirs: &DataDirs) -> Result<PathBuf> {
    let path = Path::new(arg);
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    let bare = !arg.contains('/') && !arg.contains(std::path::MAIN_SEPARATOR);
    if bare {
        if let Some(found) = dirs.find(arg) {
            return Ok(found);
        }
    }
    if path.exists() {
        return Err(Error::new(format!("graph {arg} is not a file")));
    }
    let looked = if bare {
        let dirs: Vec<String> = dirs
            .dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        format!(" (nor {arg}.mtx.gz in {})", dirs.join(", "))
    } else {
        String::new()
    };
    Err(Error::new(format!(
        "graph file {arg} not found{looked}; pass --data-dir DIR or set {DATA_DIR_ENV}=DIR to \
         the folder that holds it, or give the file's path"
    )))
}

/// The generator's configuration of R-MAT `scale` under `options` (what [`load`] generates):
/// the benchmark convention (symmetrized, self loops) unless `options` keeps graphs as stored.
pub fn rmat_config(scale: u32, options: &LoadOptions<'_>) -> RmatConfig {
    if options.symmetrize {
        RmatConfig::benchmark(scale)
    } else {
        RmatConfig::new(scale)
    }
    .with_seed(options.rmat_seed)
}

/// Loads or generates the graph of `spec`, symmetrized with self loops when asked, as a pattern.
///
/// # Errors
/// Unreadable or malformed files, non-square matrices, bad R-MAT parameters.
pub fn load(spec: &GraphSpec, options: &LoadOptions<'_>) -> Result<Graph> {
    let (name, source, csr, secs) = match spec {
        GraphSpec::Cora => match options.data_dirs.find("cora") {
            Some(path) => read_file(&path)?,
            None => {
                let (csr, secs) = step("reading the built-in cora", || {
                    read_matrix_market_from(BufReader::new(BUILT_IN_CORA), None)
                });
                let csr = csr.map_err(|e| Error::new(format!("built-in cora: {e}")))?;
                ("cora".to_string(), "built-in cora".to_string(), csr, secs)
            }
        },
        GraphSpec::File(arg) => read_file(&resolve(arg, options.data_dirs)?)?,
        GraphSpec::Rmat(scale) => {
            let config = rmat_config(*scale, options);
            let available = options
                .host_memory
                .or_else(spattn_formats::alloc::available_host_bytes);
            if let Some(available) = available {
                crate::memory::check_rmat(&config, available)?;
            }
            let (csr, secs) = step(&format!("generating R-MAT scale {scale}"), || rmat(&config));
            let csr = csr.map_err(|e| Error::from(e).context(format!("R-MAT scale {scale}")))?;
            let source = format!("R-MAT scale {scale}, seed {}", options.rmat_seed);
            // Generated already symmetrized with self loops when asked.
            return Ok(Graph {
                name: rmat_name(*scale),
                source,
                csr,
                symmetrized: options.symmetrize,
                load_seconds: secs,
            });
        }
    };
    let mut load_seconds = secs;
    let csr = csr.into_pattern();
    let csr = if options.symmetrize {
        if csr.n_rows() != csr.n_cols() {
            return Err(Error::new(format!(
                "graph {name} is {} x {}: only square graphs can be symmetrized \
                 (use --no-symmetrize)",
                csr.n_rows(),
                csr.n_cols()
            )));
        }
        let (sym, secs) = step(&format!("symmetrizing {name}"), || {
            csr.symmetrize_with_self_loops()
        });
        load_seconds += secs;
        sym.map_err(|e| Error::new(format!("symmetrizing {name}: {e}")))?
    } else {
        csr
    };
    Ok(Graph {
        name,
        source,
        csr,
        symmetrized: options.symmetrize,
        load_seconds,
    })
}

/// Reads a graph file: (name, source, matrix, seconds).
fn read_file(path: &Path) -> Result<(String, String, Csr, f64)> {
    let name = graph_name(path);
    let is_csr = path
        .file_name()
        .is_some_and(|f| f.to_string_lossy().ends_with(".csr"));
    let label = format!("reading {}", path.display());
    let (csr, secs) = if is_csr {
        step(&label, || csr_file::read_csr(path))
    } else {
        let (r, secs) = step(&label, || read_graph_text(path));
        (
            r.map_err(|e| match e {
                // These name the file themselves.
                spattn_formats::Error::Parse { .. } | spattn_formats::Error::Io { .. } => {
                    Error::new(format!("cannot read graph {e}"))
                }
                _ => Error::new(format!("cannot read graph {}: {e}", path.display())),
            }),
            secs,
        )
    };
    Ok((name, path.display().to_string(), csr?, secs))
}

/// Reads a text graph: MatrixMarket where the name says `.mtx` (or the first line is a
/// MatrixMarket banner), else a SNAP-style edge list (`# comments`, `src dst` lines, 0-based).
fn read_graph_text(path: &Path) -> spattn_formats::Result<Csr> {
    let file = path.file_name().map(|f| f.to_string_lossy().into_owned());
    let is_mtx = file.is_some_and(|f| f.ends_with(".mtx") || f.ends_with(".mtx.gz"));
    match read_matrix_market(path) {
        // Not a MatrixMarket banner on line 1: by content, an edge list.
        Err(spattn_formats::Error::Parse { line: 1, .. }) if !is_mtx => read_edge_list(path),
        other => other,
    }
}

/// The statistics of a graph: degrees, ME-BCRS fill (8-row windows, 8 vectors per block) and
/// BSB fill (16-row windows, 16 × 8 blocks).
///
/// # Errors
/// Where a blocked format cannot be built (too large for its 32-bit arrays).
pub fn statistics(graph: &Graph) -> Result<GraphRecord> {
    let a = &graph.csr;
    let d = a.degree_stats();
    let ((mebcrs, bsb), _) = step(
        &format!("building ME-BCRS and BSB of {}", graph.name),
        || {
            rayon::join(
                || MeBcrs::from_csr(a, MEBCRS_BLOCK_WIDTH).map(|m| m.fill_stats()),
                || Bsb::from_csr(a).map(|b| b.fill_stats()),
            )
        },
    );
    let fill = |f: spattn_formats::FillStats| FillRecord {
        windows: f.windows as u64,
        blocks: f.blocks as u64,
        slots: f.slots as u64,
        fill: f.fill(),
    };
    Ok(GraphRecord {
        name: graph.name.clone(),
        source: graph.source.clone(),
        n: a.n_rows() as u64,
        nnz: a.nnz() as u64,
        symmetrized: graph.symmetrized,
        degree: DegreeRecord {
            min: d.min as u64,
            mean: d.mean,
            max: d.max as u64,
            empty_rows: d.empty_rows as u64,
        },
        mebcrs: fill(mebcrs.map_err(|e| Error::new(format!("ME-BCRS of {}: {e}", graph.name)))?),
        bsb: fill(bsb.map_err(|e| Error::new(format!("BSB of {}: {e}", graph.name)))?),
        load_seconds: graph.load_seconds,
    })
}

/// Where `--dump-csr` writes each graph: `target` itself for one graph, `target/<name>.csr`
/// for several (creating the folder).
///
/// # Errors
/// When the folder cannot be created.
pub fn dump_paths(target: &Path, names: &[String]) -> Result<Vec<PathBuf>> {
    if names.len() == 1 && !target.is_dir() {
        return Ok(vec![target.to_path_buf()]);
    }
    std::fs::create_dir_all(target)
        .map_err(|e| crate::error::io_error("create the folder", target, e))?;
    Ok(names
        .iter()
        .map(|n| target.join(format!("{n}.csr")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            graph_name(Path::new("data/ogbn-arxiv.mtx.gz")),
            "ogbn-arxiv"
        );
        assert_eq!(graph_name(Path::new("/x/cora.mtx")), "cora");
        assert_eq!(graph_name(Path::new("rmat-14.csr")), "rmat-14");
        assert_eq!(
            graph_name(Path::new("PROTEINS_full.mtx.gz")),
            "PROTEINS_full"
        );
        assert_eq!(rmat_name(16), "rmat-16");
    }

    #[test]
    fn built_in_cora_loads() {
        let dirs = DataDirs::only(vec![]);
        let options = LoadOptions {
            data_dirs: &dirs,
            symmetrize: true,
            rmat_seed: 1,
            host_memory: None,
        };
        let g = load(&GraphSpec::Cora, &options).unwrap();
        assert_eq!(
            (g.name.as_str(), g.source.as_str()),
            ("cora", "built-in cora")
        );
        // 2,708 nodes; 13,264 entries symmetrized with self loops (shared/data/README.md).
        assert_eq!((g.csr.n_rows(), g.csr.nnz()), (2708, 13264));
        let s = statistics(&g).unwrap();
        assert!(s.mebcrs.fill > 0.0 && s.mebcrs.fill <= 1.0);
        assert!(s.bsb.fill > 0.0 && s.bsb.fill <= 1.0);
    }

    #[test]
    fn unknown_graph_is_an_error() {
        let dirs = DataDirs::only(vec![PathBuf::from("/nonexistent-spattn")]);
        let e = resolve("no-such-graph", &dirs).unwrap_err().to_string();
        assert!(
            e.contains("no-such-graph") && e.contains("/nonexistent-spattn"),
            "{e}"
        );
        let e = resolve("/no/such/file.mtx", &dirs).unwrap_err().to_string();
        assert!(e.contains("not found"), "{e}");
    }
}
