//! spattn's build tooling, run as `cargo xtask <command>` (the alias is in .cargo/config.toml).
//!
//! - `cargo xtask ptx`: compile crates/kernels-sys/cuda/*.cu to ptx/*.ptx with NVRTC 12
//!   (loaded at run time) and regenerate crates/kernels-sys/src/generated.rs.
//! - `cargo xtask ptx --check`: verify the PTX and generated.rs are current (no NVRTC needed).
//! - `cargo xtask ptx --lineinfo`: the same with line info, for profiling (not for a commit).
//! - `cargo xtask gpu-bundle`: build every test (and bench) executable and pack them with the
//!   graphs and a run.sh, for a GPU machine that has no Rust toolchain.
//!
//! Errors are one clear message and a non-zero exit, never a panic.

mod bundle;
mod codegen;
mod nvrtc;
mod ptx;
mod ptx_hash;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  ptx                 compile crates/kernels-sys/cuda/*.cu to ptx/*.ptx with NVRTC 12 and
                      regenerate crates/kernels-sys/src/generated.rs
  ptx --check         check the PTX and generated.rs are current (no NVRTC needed)
  ptx --lineinfo      as ptx, with line info for profilers and sanitizers (reads as stale to
                      --check: for a local profiling build, not for a commit)
  gpu-bundle [--out DIR] [--graph NAME]...
                      build test and bench executables into DIR (default target/gpu-bundle)
                      with graphs and run.sh, for a GPU machine without Rust; --graph adds
                      ../shared/data/mtx/NAME.mtx.gz to the default cora, pubmed, ogbn-arxiv
  help                this text";

/// The workspace root: the parent of xtask's own folder.
fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn run(args: &[String]) -> Result<(), String> {
    let invoked_from =
        std::env::current_dir().map_err(|e| format!("cannot read the working directory: {e}"))?;
    let root = project_root();
    std::env::set_current_dir(&root)
        .map_err(|e| format!("cannot enter the workspace root {}: {e}", root.display()))?;
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["ptx"] => ptx::generate(false),
        ["ptx", "--lineinfo"] => ptx::generate(true),
        ["ptx", "--check"] => ptx::check(),
        ["gpu-bundle", rest @ ..] => bundle::run(&bundle::Options::parse(rest, &invoked_from)?),
        [] | ["help" | "--help" | "-h"] => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(format!("unknown arguments: {}\n{USAGE}", args.join(" "))),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
