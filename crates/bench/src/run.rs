//! The benchmark run: device choice, graphs, configurations, cases, table, JSON.

use std::path::Path;

use half::{bf16, f16};
use std::sync::Arc;

use spattn_ops::DeviceGraph;
use spattn_ops::{DType, DTypeKind, Gpu};

use crate::cases::{self, Case, CaseKind, Problem, Target, BASELINE};
use crate::cli::RunArgs;
use crate::error::{io_error, Error, Result};
use crate::graphs::{self, DataDirs, Graph, GraphSpec, LoadOptions};
use crate::inputs::{config_seed, HostInputs};
use crate::measure::{Measured, RunSettings};
use crate::memory;
use crate::outln;
use crate::peers::{read_peers, Peers};
use crate::progress::step;
use crate::record::{self, CaseRecord, DeviceRecord, GraphRecord, RunRecord, Settings};
use crate::table::{self, Columns};
use crate::{cpu_bench, gpu_bench};

/// The default R-MAT scale of a run without graph options.
pub const DEFAULT_RMAT_SCALE: u32 = 14;

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Everything measured (also written with `--json`).
    pub record: RunRecord,
    /// Cases whose check failed.
    pub failed: usize,
    /// Cases that stopped with an error.
    pub errors: usize,
}

impl Outcome {
    /// Whether every case ran and passed its check.
    pub fn success(&self) -> bool {
        self.failed == 0 && self.errors == 0
    }
}

/// The graphs a run is asked for: `--graph`s then `--rmat`s; cora and R-MAT 14 without either.
pub fn graph_specs(args: &RunArgs) -> Vec<GraphSpec> {
    // `--graph cora` is the default graph: from the data folders, else the built-in copy.
    let mut specs: Vec<GraphSpec> = args
        .graphs
        .iter()
        .map(|g| match g.as_str() {
            "cora" => GraphSpec::Cora,
            _ => GraphSpec::File(g.clone()),
        })
        .collect();
    specs.extend(args.rmat.iter().map(|&s| GraphSpec::Rmat(s)));
    if specs.is_empty() {
        specs = vec![GraphSpec::Cora, GraphSpec::Rmat(DEFAULT_RMAT_SCALE)];
    }
    specs
}

/// How `args` asks for graphs to be loaded from `data_dirs`.
pub fn load_options<'a>(args: &RunArgs, data_dirs: &'a DataDirs) -> LoadOptions<'a> {
    LoadOptions {
        data_dirs,
        symmetrize: !args.no_symmetrize,
        rmat_seed: args.rmat_seed,
        host_memory: args.host_memory,
    }
}

/// The GPU, or why there is none.
enum Device {
    Gpu(Gpu),
    Cpu(String),
}

fn open_device(args: &RunArgs) -> Result<Device> {
    if args.cpu {
        return Ok(Device::Cpu("--cpu given".into()));
    }
    match Gpu::new(args.device) {
        Ok(gpu) => {
            if args.keep_freed_memory {
                gpu.keep_freed_memory(u64::MAX)?;
            }
            Ok(Device::Gpu(gpu))
        }
        Err(e) => Ok(Device::Cpu(gpu_bench::cpu_reason(&e))),
    }
}

/// Runs the benchmarks `args` asks for. `argv` is the command line, for the record.
///
/// # Errors
/// Bad options (an unknown case, a graph that cannot be found or read), a JSON or dump file
/// that cannot be written, a GPU that fails before any case runs. A case that fails is not an
/// error here: it is counted in the [`Outcome`].
pub fn run(args: &RunArgs, argv: &[String]) -> Result<Outcome> {
    cases::check_names(&args.algorithms)?;
    let date = record::now_rfc3339();
    let data_dirs = DataDirs::new(args.data_dir.as_deref());
    let specs = graph_specs(args);
    // Resolve every file first, so a typo fails before anything slow runs.
    let mut names = Vec::with_capacity(specs.len());
    for spec in &specs {
        names.push(match spec {
            GraphSpec::Cora => "cora".to_string(),
            GraphSpec::File(arg) => graphs::graph_name(&graphs::resolve(arg, &data_dirs)?),
            GraphSpec::Rmat(scale) => graphs::rmat_name(*scale),
        });
    }
    let dumps = match &args.dump_csr {
        Some(target) => Some(graphs::dump_paths(target, &names)?),
        None => None,
    };
    let load_options = load_options(args, &data_dirs);
    if args.dump_only {
        let dumps = dumps.unwrap_or_default();
        for (spec, path) in specs.iter().zip(&dumps) {
            let graph = graphs::load(spec, &load_options)?;
            dump(&graph, path)?;
        }
        return Ok(Outcome {
            record: empty_record(
                args,
                argv,
                date,
                cpu_bench::device_record("--dump-only given"),
            ),
            failed: 0,
            errors: 0,
        });
    }

    let device = open_device(args)?;
    let backend = match device {
        Device::Gpu(_) => Target::Gpu,
        Device::Cpu(_) => Target::Cpu,
    };
    let selected = cases::select(&args.algorithms, backend)?;
    let mut peer_records = Vec::new();
    for path in &args.peers {
        peer_records.extend(read_peers(path)?);
    }
    let peers = Peers::new(peer_records);

    outln!(
        "spattn-bench {} (commit {})",
        env!("CARGO_PKG_VERSION"),
        record::commit()
    );
    let device_record = match &device {
        Device::Gpu(gpu) => gpu_bench::device_record(gpu, &format!("GPU {} opened", args.device))?,
        Device::Cpu(reason) => cpu_bench::device_record(reason),
    };
    outln!("{}", table::device_line(&device_record));
    if !peers.is_empty() {
        let gpus: Vec<&str> = peers
            .records()
            .iter()
            .filter_map(|r| r.gpu.as_deref())
            .collect();
        if !device_record.is_gpu() {
            outln!("note: the peers were timed on a GPU and this run is on the CPU: not compared");
        } else if let Some(other) = gpus.iter().find(|g| **g != device_record.name) {
            outln!(
                "note: some peers were timed on {other}, not on {}",
                device_record.name
            );
        }
    }

    let dtypes: Vec<DTypeKind> = if args.dtype.is_empty() {
        vec![if device_record.is_gpu() {
            DTypeKind::F16
        } else {
            DTypeKind::F32
        }]
    } else {
        dedup(args.dtype.clone())
    };
    let heads_list = if args.heads.is_empty() {
        vec![1]
    } else {
        dedup(args.heads.clone())
    };
    let dims = if args.head_dim.is_empty() {
        vec![64]
    } else {
        dedup(args.head_dim.clone())
    };
    let settings = RunSettings {
        warmup: args.warmup,
        reps: args.reps,
        check: !args.no_check,
        reorder: args.reorder,
    };
    outln!(
        "cases: {}; {} warm-up runs, median of {} {}; {}",
        selected
            .iter()
            .map(|c| c.name)
            .collect::<Vec<_>>()
            .join(", "),
        settings.warmup,
        settings.reps,
        if device_record.is_gpu() {
            "(CUDA events)"
        } else {
            "(wall clock)"
        },
        if settings.check {
            "checked against the f64 CPU reference"
        } else {
            "not checked (--no-check)"
        },
    );
    if settings.reps < 20 {
        outln!(
            "note: fewer than 20 timed runs (--reps {}): not for publication",
            settings.reps
        );
    }

    let mut record = empty_record(args, argv, date, device_record);
    record.peers = peers.records().to_vec();
    let columns = Columns::fit(names.iter().map(String::as_str));
    let compare_peers = record.device.is_gpu();
    let (mut failed, mut errors) = (0, 0);

    // Every graph in turn; what was measured before an error (a GPU fault, an unreadable
    // graph) still goes to the JSON.
    let mut all_graphs = || -> Result<()> {
        for (i, spec) in specs.iter().enumerate() {
            let graph = graphs::load(spec, &load_options)?;
            let stats = graphs::statistics(&graph)?;
            outln!();
            outln!("{}", table::graph_block(&stats));
            if let Some(path) = dumps.as_ref().map(|d| &d[i]) {
                dump(&graph, path)?;
            }
            if let Some(other) = peers.nnz_mismatch(&graph.name, stats.nnz) {
                outln!(
                    "  note: peer records of {} have nnz {}, this graph {}: not compared \
                     (symmetrize the peers' graph the same way)",
                    graph.name,
                    table::thousands(other),
                    table::thousands(stats.nnz)
                );
            }
            let gpu_graph = match &device {
                Device::Gpu(gpu) => {
                    let (dev, _) = step(&format!("uploading {}", graph.name), || {
                        let shared = gpu_bench::shared_graph(gpu, &graph.csr);
                        shared.csr().map(|_| ()).map(|()| shared)
                    });
                    Some((
                        gpu,
                        dev.map_err(|e| Error::new(format!("uploading {}: {e}", graph.name)))?,
                    ))
                }
                Device::Cpu(_) => None,
            };
            let mut timer = match &gpu_graph {
                Some((gpu, _)) => Some(gpu.timer()?),
                None => None,
            };
            for &dtype in &dtypes {
                for &heads in &heads_list {
                    for &head_dim in &dims {
                        let seed = config_seed(
                            args.seed,
                            &graph.name,
                            heads as usize,
                            head_dim as usize,
                            dtype,
                        );
                        check_memory(
                            &graph,
                            (heads, head_dim, dtype),
                            settings.check,
                            args.host_memory,
                            &gpu_graph,
                        )?;
                        outln!();
                        outln!(
                            "  H={heads} D={head_dim} {dtype}: inputs uniform in [-1, 1], seed {seed:#018x}"
                        );
                        outln!("{}", columns.header());
                        let ctx = ConfigContext {
                            graph: &graph,
                            stats: &stats,
                            heads,
                            head_dim,
                            dtype,
                            seed,
                            bandwidth_gbs: record.device.copy_bandwidth_gbs,
                            peers: if compare_peers { Some(&peers) } else { None },
                        };
                        let mut baseline_ms = None;
                        let mut done = |case: &Case, m: Measured| {
                            if let Some(why) = &m.skipped {
                                outln!(
                                    "  {:<gw$}  {:<cw$} skipped: {why}",
                                    graph.name,
                                    case.name,
                                    gw = columns.graph,
                                    cw = columns.case
                                );
                                return;
                            }
                            let rec = case_record(&ctx, case, &m, &mut baseline_ms, settings.reps);
                            if rec.error.is_some() {
                                errors += 1;
                            } else if rec.passed == Some(false) {
                                failed += 1;
                            }
                            outln!("{}", columns.row(&rec));
                            record.cases.push(rec);
                        };
                        let shape = (
                            graph.csr.n_rows(),
                            graph.csr.n_cols(),
                            heads as usize,
                            head_dim as usize,
                        );
                        match (&gpu_graph, timer.as_mut()) {
                            (Some((gpu, dev)), Some(timer)) => {
                                let job = GpuJob {
                                    gpu,
                                    timer,
                                    csr: &graph.csr,
                                    dev,
                                    cases: &selected,
                                    settings,
                                };
                                match dtype {
                                    DTypeKind::F32 => job.run::<f32>(shape, seed, &mut done)?,
                                    DTypeKind::F16 => job.run::<f16>(shape, seed, &mut done)?,
                                    DTypeKind::Bf16 => job.run::<bf16>(shape, seed, &mut done)?,
                                }
                            }
                            _ => match dtype {
                                DTypeKind::F32 => run_cpu::<f32>(
                                    &graph.csr, shape, seed, &selected, settings, &mut done,
                                )?,
                                DTypeKind::F16 => run_cpu::<f16>(
                                    &graph.csr, shape, seed, &selected, settings, &mut done,
                                )?,
                                DTypeKind::Bf16 => run_cpu::<bf16>(
                                    &graph.csr, shape, seed, &selected, settings, &mut done,
                                )?,
                            },
                        }
                    }
                }
            }
            record.graphs.push(stats);
        }
        Ok(())
    };
    let result = all_graphs();

    outln!();
    let total = record.cases.len();
    let checked = record.cases.iter().filter(|c| c.passed.is_some()).count();
    outln!(
        "{total} case runs: {} passed the check, {failed} failed, {errors} stopped with an error{}",
        checked - failed,
        if settings.check { "" } else { " (not checked)" }
    );
    if let Some(path) = &args.json {
        write_json(path, &record)?;
        outln!("wrote {}", path.display());
    }
    result?;
    Ok(Outcome {
        record,
        failed,
        errors,
    })
}

/// Everything a case record needs besides the measurement.
struct ConfigContext<'a> {
    graph: &'a Graph,
    stats: &'a GraphRecord,
    heads: u32,
    head_dim: u32,
    dtype: DTypeKind,
    seed: u64,
    bandwidth_gbs: Option<f64>,
    peers: Option<&'a Peers>,
}

/// The record of one measured case: floor, speedup over the baseline, peers, check.
fn case_record(
    ctx: &ConfigContext<'_>,
    case: &Case,
    m: &Measured,
    baseline_ms: &mut Option<f64>,
    reps: u32,
) -> CaseRecord {
    let problem = Problem {
        n_rows: ctx.graph.csr.n_rows() as u64,
        n_cols: ctx.graph.csr.n_cols() as u64,
        nnz: ctx.graph.csr.nnz() as u64,
        heads: u64::from(ctx.heads),
        head_dim: u64::from(ctx.head_dim),
        dtype: ctx.dtype,
    };
    let floor = cases::floor_bytes(case, &problem);
    let median = m.timings.map(|t| t.median_ms).filter(|t| *t > 0.0);
    if case.name == BASELINE {
        *baseline_ms = median;
    }
    let floor_ms = ctx.bandwidth_gbs.map(|bw| floor as f64 / (bw * 1e6));
    let tolerance = cases::tolerance(case, ctx.dtype);
    let dtype = ctx.dtype.to_string();
    CaseRecord {
        graph: ctx.graph.name.clone(),
        case: case.name.to_string(),
        kind: case.kind.name().to_string(),
        heads: ctx.heads,
        head_dim: ctx.head_dim,
        dtype: dtype.clone(),
        seed: ctx.seed,
        median_ms: median,
        min_ms: m.timings.map(|t| t.min_ms),
        max_ms: m.timings.map(|t| t.max_ms),
        reps: m.timings.map_or(reps, |t| t.reps as u32),
        floor_bytes: floor,
        floor_ms,
        effective_gbs: median.map(|t| floor as f64 / (t * 1e6)),
        pct_of_floor: floor_ms.zip(median).map(|(f, t)| f / t * 100.0),
        speedup_vs_unfused: match case.kind {
            CaseKind::Algorithm => baseline_ms.zip(median).map(|(b, t)| b / t),
            CaseKind::Op => None,
        },
        rel_error: m.rel_error.filter(|e| e.is_finite()),
        tolerance,
        passed: m.rel_error.map(|e| e <= tolerance),
        peers: ctx
            .peers
            .map(|p| {
                p.compare(
                    case,
                    &ctx.graph.name,
                    ctx.stats.nnz,
                    ctx.heads,
                    ctx.head_dim,
                    &dtype,
                    median,
                )
            })
            .unwrap_or_default(),
        choice: m.choice.clone(),
        plan_ms: m.plan.map(|b| b.ms),
        graph_device_bytes: m.plan.map(|b| b.graph_device_bytes),
        plan_host_peak_bytes: m.plan.and_then(|b| b.host_peak_bytes),
        error: m.error.clone(),
    }
}

/// Checks that a configuration fits in host (and GPU) memory before anything is drawn, so a
/// shape too large for the machine is a one-line error naming what would fit, not an abort.
fn check_memory(
    graph: &Graph,
    (heads, head_dim, dtype): (u32, u32, DTypeKind),
    check: bool,
    host_memory: Option<u64>,
    gpu_graph: &Option<(&Gpu, Arc<DeviceGraph>)>,
) -> Result<()> {
    let size = memory::ConfigSize {
        n_rows: graph.csr.n_rows() as u64,
        n_cols: graph.csr.n_cols() as u64,
        nnz: graph.csr.nnz() as u64,
        heads: u64::from(heads),
        head_dim: u64::from(head_dim),
        dtype,
        check,
    };
    let context = |e: Error| e.context(&graph.name);
    let host = host_memory.or_else(spattn_formats::alloc::available_host_bytes);
    let side = match gpu_graph {
        Some(_) => memory::Side::GpuHost,
        None => memory::Side::Cpu,
    };
    if let Some(available) = host {
        memory::check(&size, side, available).map_err(context)?;
    }
    if let Some((gpu, _)) = gpu_graph {
        // Freed memory a kept pool holds is free for this process.
        let free = gpu.available_memory()?;
        memory::check(&size, memory::Side::Device, free as u64).map_err(context)?;
    }
    Ok(())
}

/// The GPU side of one configuration.
struct GpuJob<'a> {
    gpu: &'a Gpu,
    timer: &'a mut spattn_ops::GpuTimer,
    csr: &'a spattn_formats::Csr,
    dev: &'a Arc<DeviceGraph>,
    cases: &'a [&'static Case],
    settings: RunSettings,
}

impl GpuJob<'_> {
    fn run<T: DType>(
        self,
        (n_rows, n_cols, heads, head_dim): (usize, usize, usize, usize),
        seed: u64,
        done: &mut dyn FnMut(&Case, Measured),
    ) -> Result<()> {
        let (host, _) = step("drawing the inputs", || {
            HostInputs::<T>::draw(n_rows, n_cols, heads, head_dim, seed)
        });
        gpu_bench::run_config(
            &mut gpu_bench::GpuRun {
                gpu: self.gpu,
                timer: self.timer,
                csr: self.csr,
                graph: self.dev,
                settings: self.settings,
            },
            host?,
            self.cases,
            done,
        )
    }
}

fn run_cpu<T: DType>(
    csr: &spattn_formats::Csr,
    (n_rows, n_cols, heads, head_dim): (usize, usize, usize, usize),
    seed: u64,
    cases: &[&Case],
    settings: RunSettings,
    done: &mut dyn FnMut(&Case, Measured),
) -> Result<()> {
    let host = HostInputs::<T>::draw(n_rows, n_cols, heads, head_dim, seed)?;
    cpu_bench::run_config(csr, &host, cases, settings, done);
    Ok(())
}

fn dedup<T: PartialEq>(values: Vec<T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(values.len());
    for v in values {
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

fn empty_record(args: &RunArgs, argv: &[String], date: String, device: DeviceRecord) -> RunRecord {
    RunRecord {
        schema: record::SCHEMA_VERSION,
        tool: format!("spattn-bench {}", env!("CARGO_PKG_VERSION")),
        date,
        commit: record::commit(),
        command: record::shell_command(argv),
        settings: Settings {
            warmup: args.warmup,
            reps: args.reps,
            timing: if device.is_gpu() {
                "cuda-events"
            } else {
                "wall-clock"
            }
            .into(),
            seed: args.seed,
            rmat_seed: args.rmat_seed,
            check: !args.no_check,
            symmetrize: !args.no_symmetrize,
            reorder: args.reorder.name().to_string(),
        },
        device,
        graphs: Vec::new(),
        cases: Vec::new(),
        peers: Vec::new(),
    }
}

fn dump(graph: &Graph, path: &Path) -> Result<()> {
    crate::csr_file::write_csr(path, &graph.csr)?;
    outln!(
        "  wrote {} ({} x {}, nnz {})",
        path.display(),
        table::thousands(graph.csr.n_rows() as u64),
        table::thousands(graph.csr.n_cols() as u64),
        table::thousands(graph.csr.nnz() as u64)
    );
    Ok(())
}

/// Writes `record` as pretty JSON to `path`, creating its folder.
///
/// # Errors
/// When the file cannot be written.
pub fn write_json(path: &Path, record: &RunRecord) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| io_error("create the folder", dir, e))?;
    }
    let text = serde_json::to_string_pretty(record)?;
    std::fs::write(path, text + "\n").map_err(|e| io_error("write", path, e))
}

/// Reads a run's JSON.
///
/// # Errors
/// When the file cannot be read or is not a run record.
pub fn read_json(path: &Path) -> Result<RunRecord> {
    let text = std::fs::read_to_string(path).map_err(|e| io_error("read", path, e))?;
    let record: RunRecord = serde_json::from_str(&text).map_err(|e| {
        Error::new(format!(
            "{}: not the JSON of a spattn-bench run: {e}",
            path.display()
        ))
    })?;
    if record.schema > record::SCHEMA_VERSION {
        return Err(Error::new(format!(
            "{}: made by a newer spattn-bench (schema {}; this one reads {})",
            path.display(),
            record.schema,
            record::SCHEMA_VERSION
        )));
    }
    Ok(record)
}
