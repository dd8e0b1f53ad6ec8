//! The command line: `spattn-bench [RUN OPTIONS]` and `spattn-bench report ...`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use spattn_ops::DTypeKind;

/// `spattn-bench`: sparse graph attention benchmarks with statistics, HBM floors and peers.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "spattn-bench",
    version,
    about = "Benchmarks spattn's sparse graph attention (ops and algorithms) on the GPU, or on \
             the CPU where there is none",
    long_about = None,
    args_conflicts_with_subcommands = true,
    disable_help_subcommand = true,
    after_help = "With no graph option: the bundled cora and R-MAT scale 14, both symmetrized \
                  with self loops; head_dim 64, 1 head, f16 on the GPU (f32 on the CPU).\n\
                  `spattn-bench report --json RUN.json --out FILE.md` turns the JSON of runs into \
                  a markdown report and an SVG chart."
)]
pub struct Cli {
    /// A subcommand; without one, the benchmarks run.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Options of the benchmark run.
    #[command(flatten)]
    pub run: RunArgs,
}

/// The subcommands.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Generates BENCHMARKS.md and an SVG chart from the JSON of one or more device runs.
    Report(ReportArgs),
}

/// Options of the benchmark run.
#[derive(Args, Debug, Clone, Default)]
pub struct RunArgs {
    /// A graph: a MatrixMarket file (.mtx, .mtx.gz), a SNAP-style edge list (`# comments`,
    /// 0-based `src dst` lines; any other name), a binary CSR file (.csr, as --dump-csr
    /// writes), or the name of a graph in the data folder (e.g. `pubmed`). Repeatable.
    #[arg(long = "graph", value_name = "FILE")]
    pub graphs: Vec<String>,

    /// An R-MAT graph of 2^SCALE nodes (Graph500 parameters, 16 edges per node). Repeatable.
    #[arg(long = "rmat", value_name = "SCALE",
          value_parser = clap::value_parser!(u32).range(1..=31))]
    pub rmat: Vec<u32>,

    /// Features per head; repeatable or a comma list [default: 64].
    #[arg(long = "head-dim", value_name = "D", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub head_dim: Vec<u32>,

    /// Attention heads; repeatable or a comma list [default: 1].
    #[arg(long = "heads", value_name = "H", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub heads: Vec<u32>,

    /// Element type of Q, K, V, out: f16, bf16 or f32; repeatable or a comma list
    /// [default: f16 on the GPU, f32 on the CPU].
    #[arg(long = "dtype", value_name = "DTYPE", value_delimiter = ',')]
    pub dtype: Vec<DTypeKind>,

    /// Cases to run: a comma list of case names, or `all` (every case of the device).
    #[arg(long = "algorithms", value_name = "LIST", default_value = "all")]
    pub algorithms: String,

    /// Writes every number of the run to FILE as JSON.
    #[arg(long = "json", value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Peer timings (JSON of peers/torch_peers.py) to compare with; repeatable.
    #[arg(long = "peers", value_name = "FILE")]
    pub peers: Vec<PathBuf>,

    /// Untimed runs before the timed ones.
    #[arg(long = "warmup", value_name = "N", default_value_t = 5)]
    pub warmup: u32,

    /// Timed runs per case; the median is reported (at least 20 for published numbers).
    #[arg(long = "reps", value_name = "N", default_value_t = 30,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub reps: u32,

    /// Runs on the CPU even where a GPU is present.
    #[arg(long = "cpu")]
    pub cpu: bool,

    /// Scaling instead of the case table: the partitioned plan on 1, 2, 4, … N GPUs of this
    /// host, one rank per GPU, NCCL between them (libnccl must load), forward timed with the
    /// halo exchange; --algorithms names the local plans' algorithm (default auto), --head-dim
    /// defaults to 128.
    #[arg(long = "gpus", value_name = "N", conflicts_with_all = ["cpu", "peers", "dump_csr"])]
    pub gpus: Option<usize>,

    /// With --gpus: weak scaling, R-MAT scale S + log2 P on P GPUs (instead of the graphs).
    #[arg(long = "weak-rmat", value_name = "S", requires = "gpus",
          value_parser = clap::value_parser!(u32).range(1..=31))]
    pub weak_rmat: Option<u32>,

    /// With --gpus: per rank count P, the largest R-MAT scale ≥ S (up to 31) whose partitioned
    /// forward runs on P GPUs, and the first that does not (a GPU out of memory, a rank whose
    /// device-memory lower bound exceeds its GPU's memory, found before planning, or too little
    /// host memory to generate it), instead of the graphs.
    #[arg(long = "largest-rmat", value_name = "S", requires = "gpus",
          conflicts_with_all = ["weak_rmat", "graphs", "rmat"],
          value_parser = clap::value_parser!(u32).range(1..=31))]
    pub largest_rmat: Option<u32>,

    /// The GPU to run on (CUDA device ordinal).
    #[arg(long = "device", value_name = "ORDINAL", default_value_t = 0)]
    pub device: usize,

    /// Uses each graph as stored (no A + Aᵀ + I); R-MAT graphs stay directed, without self loops.
    #[arg(long = "no-symmetrize")]
    pub no_symmetrize: bool,

    /// Writes each graph (as benchmarked) in the binary CSR format of peers/torch_peers.py:
    /// to FILE for one graph, to FILE/NAME.csr for several (FILE is then a folder).
    #[arg(long = "dump-csr", value_name = "FILE")]
    pub dump_csr: Option<PathBuf>,

    /// With --dump-csr: writes the graphs and stops (no benchmarks).
    #[arg(long = "dump-only", requires = "dump_csr")]
    pub dump_only: bool,

    /// Skips the accuracy check against the f64 CPU reference (for huge graphs).
    #[arg(long = "no-check")]
    pub no_check: bool,

    /// Keeps freed device memory in the GPU's pool for the next allocations (as torch's caching
    /// allocator does) instead of the driver's default of handing it back at every
    /// synchronisation (`Gpu::keep_freed_memory`); `--gpus` always keeps it.
    #[arg(long = "keep-freed-memory")]
    pub keep_freed_memory: bool,

    /// How the attention plans renumber rows internally: auto, none, degree, locality or
    /// cluster (AttentionConfig::with_reorder; inputs and outputs keep the graph's order).
    #[arg(long = "reorder", value_name = "ORDER", default_value = "auto",
          value_parser = parse_reorder)]
    pub reorder: spattn_formats::Reorder,

    /// Folder of the graphs named by --graph (and of cora); else $SPATTN_DATA_DIR, the
    /// repository's folders, and last the cora built into the binary.
    #[arg(long = "data-dir", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,

    /// The host memory the run may use, e.g. `8G`, `512M` or a byte count (suffixes K, M, G, T
    /// in powers of 1024) [default: what the system reports available]. Graphs and shapes that
    /// need more are refused up front, with the largest --head-dim or --rmat that fits.
    #[arg(long = "host-memory", value_name = "BYTES", value_parser = parse_bytes)]
    pub host_memory: Option<u64>,

    /// Seed of the random inputs (each graph and shape derives its own from it).
    #[arg(long = "seed", value_name = "N", default_value_t = 1)]
    pub seed: u64,

    /// Seed of the R-MAT generator.
    #[arg(long = "rmat-seed", value_name = "N", default_value_t = 1)]
    pub rmat_seed: u64,
}

/// `8G`, `512M`, `64k`, `1000`: bytes, suffixes in powers of 1024.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("'{s}': the suffix must be K, M, G or T")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a byte count such as 8G or 512M"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("'{s}' is more than 2^64 bytes"))
}

fn parse_reorder(s: &str) -> Result<spattn_formats::Reorder, String> {
    s.parse().map_err(|e: spattn_formats::Error| e.to_string())
}

/// Options of `spattn-bench report`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// JSON of a run (`spattn-bench --json`); several files (e.g. one per graph) are merged.
    #[arg(long = "json", value_name = "FILE", required = true, num_args = 1..)]
    pub json: Vec<PathBuf>,

    /// Peer JSON (peers/torch_peers.py) to add to the peers the runs recorded.
    #[arg(long = "peers", value_name = "FILE")]
    pub peers: Vec<PathBuf>,

    /// The markdown file to write (required: the report never picks a file on its own).
    #[arg(long = "out", value_name = "FILE", required = true)]
    pub out: PathBuf,

    /// The SVG chart to write (speedups over torch_sparse_attention per graph) [default: the
    /// --out file with the extension .svg].
    #[arg(long = "svg", value_name = "FILE")]
    pub svg: Option<PathBuf>,

    /// Also writes the full tables (every graph, shape, dtype, case and peer) to FILE; --out
    /// is then one page that links to them. Without it, --out holds the full tables.
    #[arg(long = "full", value_name = "FILE")]
    pub full: Option<PathBuf>,

    /// Overwrites --out, --full and --svg even where they exist and were not generated from
    /// the same inputs (a report refuses that by default).
    #[arg(long = "force")]
    pub force: bool,

    /// Markdown appended verbatim after the generated tables: results of the benchmarks that
    /// are not `spattn-bench` runs (e.g. the training step and the layers), kept with their own
    /// GPU, commit and command so a regeneration keeps them.
    #[arg(long = "append", value_name = "FILE")]
    pub append: Vec<PathBuf>,

    /// Markdown appended verbatim after the full tables (--full).
    #[arg(long = "append-full", value_name = "FILE")]
    pub append_full: Vec<PathBuf>,
}

impl ReportArgs {
    /// The chart's path: `--svg`, else `--out` with the extension `.svg`.
    pub fn svg_path(&self) -> PathBuf {
        self.svg
            .clone()
            .unwrap_or_else(|| self.out.with_extension("svg"))
    }
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Parsed {
    /// Run the benchmarks.
    Run(Box<RunArgs>),
    /// Write a report.
    Report(ReportArgs),
    /// Print this text on stdout and exit successfully (help, version).
    Print(String),
}

/// Parses the command line (`args` includes the program name).
///
/// # Errors
/// A one-line message for bad arguments (clap's own message, its usage and tips left out).
pub fn parse<I, T>(args: I) -> Result<Parsed, crate::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    match Cli::try_parse_from(args) {
        Ok(cli) => Ok(match cli.command {
            Some(Command::Report(report)) => Parsed::Report(report),
            None => Parsed::Run(Box::new(cli.run)),
        }),
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    Ok(Parsed::Print(e.render().to_string()))
                }
                _ => Err(crate::Error::new(format!(
                    "{} (see --help)",
                    first_line_of_clap_error(&e.render().to_string())
                ))),
            }
        }
    }
}

/// The message of a clap error on one line: its first paragraph (the lines before the first
/// blank one, e.g. a list of missing arguments), without the `error: ` prefix, usage and tips.
fn first_line_of_clap_error(text: &str) -> String {
    let paragraph: Vec<&str> = text
        .lines()
        .map(str::trim)
        .skip_while(|l| l.is_empty())
        .take_while(|l| !l.is_empty())
        .collect();
    let line = paragraph.join(" ");
    let line = line.strip_prefix("error: ").unwrap_or(&line).to_string();
    if line.is_empty() {
        "invalid arguments".to_string()
    } else {
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> RunArgs {
        let argv = std::iter::once("spattn-bench").chain(args.iter().copied());
        match parse(argv).expect("parses") {
            Parsed::Run(r) => *r,
            other => panic!("expected a run, got {other:?}"),
        }
    }

    #[test]
    fn lists_and_repeats() {
        let r = run_args(&[
            "--head-dim",
            "64,128",
            "--head-dim",
            "32",
            "--dtype",
            "f16,bf16",
            "--rmat",
            "10",
            "--rmat",
            "12",
            "--heads",
            "2",
        ]);
        assert_eq!(r.head_dim, vec![64, 128, 32]);
        assert_eq!(r.dtype, vec![DTypeKind::F16, DTypeKind::Bf16]);
        assert_eq!(r.rmat, vec![10, 12]);
        assert_eq!(r.heads, vec![2]);
        assert_eq!((r.warmup, r.reps, r.algorithms.as_str()), (5, 30, "all"));
    }

    #[test]
    fn freed_memory_is_handed_back_unless_asked_to_keep_it() {
        assert!(!run_args(&[]).keep_freed_memory);
        assert!(run_args(&["--keep-freed-memory"]).keep_freed_memory);
    }

    #[test]
    fn report_subcommand() {
        let argv = [
            "spattn-bench",
            "report",
            "--json",
            "a.json",
            "b.json",
            "--out",
            "X.md",
        ];
        match parse(argv).expect("parses") {
            Parsed::Report(r) => {
                assert_eq!(r.json.len(), 2);
                assert_eq!(r.out, PathBuf::from("X.md"));
                assert_eq!(r.svg_path(), PathBuf::from("X.svg"));
                assert!(!r.force);
            }
            other => panic!("expected a report, got {other:?}"),
        }
    }

    #[test]
    fn errors_are_one_line() {
        for bad in [
            vec!["--dtype", "f64"],
            vec!["--frobnicate"],
            vec!["--reps", "0"],
            vec!["--rmat", "40"],
            vec!["--head-dim", "x"],
            vec!["--dump-only"],
            vec!["--reps", "3", "report", "--json", "a"],
        ] {
            let argv = std::iter::once("spattn-bench").chain(bad.iter().copied());
            let e = parse(argv).expect_err("must fail");
            assert!(!e.to_string().contains('\n'), "{e}");
            assert!(!e.to_string().starts_with("error:"), "{e}");
        }
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert_eq!(parse_bytes("512m"), Ok(512 << 20));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert!(parse_bytes("8X").is_err());
        assert!(parse_bytes("G").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }

    #[test]
    fn largest_rmat_needs_gpus_and_no_other_graphs() {
        let r = run_args(&["--gpus", "4", "--largest-rmat", "22", "--head-dim", "128"]);
        assert_eq!((r.gpus, r.largest_rmat), (Some(4), Some(22)));
        assert_eq!(run_args(&["--gpus", "2"]).largest_rmat, None);
        for (bad, names) in [
            (vec!["--largest-rmat", "22"], "--gpus"),
            (
                vec!["--gpus", "2", "--largest-rmat", "22", "--weak-rmat", "20"],
                "--weak-rmat",
            ),
            (
                vec!["--gpus", "2", "--largest-rmat", "22", "--rmat", "20"],
                "--rmat",
            ),
            (
                vec!["--gpus", "2", "--largest-rmat", "22", "--graph", "cora"],
                "--graph",
            ),
            (vec!["--gpus", "2", "--largest-rmat", "32"], "32"),
            (vec!["--gpus", "2", "--largest-rmat", "0"], "0"),
        ] {
            let argv = std::iter::once("spattn-bench").chain(bad.iter().copied());
            let e = parse(argv).expect_err("must fail").to_string();
            assert!(e.contains(names), "{bad:?}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn help_is_printed() {
        assert!(matches!(
            parse(["spattn-bench", "--help"]),
            Ok(Parsed::Print(_))
        ));
        assert!(matches!(
            parse(["spattn-bench", "report", "--help"]),
            Ok(Parsed::Print(_))
        ));
    }
}
