//! # spattn-bench
//!
//! The `spattn-bench` command: benchmarks of spattn's sparse graph attention
//! `out = softmax(scale · QKᵀ masked by A) · V`, and of its ops, on the GPU (or on the CPU where
//! there is none), with each graph's statistics, each case's HBM floor, an accuracy check
//! against the f64 CPU reference, and the times of the peers (torch.sparse / cuSPARSE, PyG,
//! dense SDPA) measured by `peers/torch_peers.py` on the same GPU.
//!
//! ```text
//! spattn-bench [--graph FILE]... [--rmat SCALE]... [--head-dim D]... [--heads H]...
//!              [--dtype f16|bf16|f32]... [--algorithms LIST] [--json FILE] [--peers FILE]...
//!              [--warmup N] [--reps N] [--cpu] [--no-symmetrize] [--dump-csr FILE] [--no-check]
//! spattn-bench report --json FILE... --out FILE.md [--svg FILE.svg] [--force]
//! ```
//!
//! The library holds the pieces the binary, the criterion benches (`benches/ops.rs`) and the
//! tests share:
//!
//! - [`cli`]: the command line; [`run`]: the benchmark run; [`report`]: BENCHMARKS.md and the
//!   SVG chart;
//! - [`cases`]: the registry of cases (name, kind, runner, HBM floor, peers);
//! - [`gpu_bench`] and [`cpu_bench`]: the runners (CUDA events / wall clock);
//! - [`graphs`], [`csr_file`]: graphs, data folders, the binary CSR of `--dump-csr`;
//! - [`fit`]: a rank's device-memory lower bound, checked before `--gpus` plans it;
//! - [`inputs`], [`memory`], [`timing`], [`measure`], [`peers`], [`record`], [`table`], [`progress`].
//!
//! Nothing here is needed by users of the spattn libraries.
#![forbid(unsafe_code)]

pub mod cases;
pub mod cli;
pub mod cpu_bench;
pub mod csr_file;
pub mod error;
pub mod fit;
pub mod gpu_bench;
pub mod graphs;
pub mod inputs;
pub mod measure;
pub mod memory;
pub mod peers;
pub mod progress;
pub mod record;
pub mod report;
pub mod run;
pub mod scaling;
pub mod table;
pub mod timing;

pub use error::{Error, Result};

/// `println!` that ignores a closed stdout (e.g. `spattn-bench | head`) instead of panicking.
#[macro_export]
macro_rules! outln {
    () => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock());
    }};
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}
