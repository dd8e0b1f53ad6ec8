//! Helpers shared by the integration tests: running the built binary, temporary folders.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The `spattn-bench` binary: `$SPATTN_BENCH_BIN` (the GPU bundle's run.sh sets it), the path
/// cargo built it at, or `spattn-bench` / `bench/spattn-bench` beside this test executable.
pub fn bench_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("SPATTN_BENCH_BIN").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_spattn-bench"));
    if built.is_file() {
        return built;
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    let dir = exe.parent().expect("the test executable's folder");
    [dir.join("spattn-bench"), dir.join("../bench/spattn-bench")]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or(built)
}

/// Runs `spattn-bench` with `args`, with no GPU data folder from the environment.
pub fn bench(args: &[&str]) -> Output {
    Command::new(bench_binary())
        .args(args)
        .env_remove("SPATTN_DATA_DIR")
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("the spattn-bench binary runs")
}

/// A fresh temporary folder for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("spattn-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// stdout and stderr as text.
pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `spattn-bench` with `args` and asserts that it succeeds (its stdout and stderr in the
/// message); returns its stdout.
#[track_caller]
pub fn bench_ok(args: &[&str]) -> String {
    let out = bench(args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    stdout
}

/// [`bench_ok`] of a quick CPU run: `--cpu`, then `args`, then `--reps reps --warmup warmup`.
#[track_caller]
pub fn cpu_run(args: &[&str], reps: u32, warmup: u32) -> String {
    let (reps, warmup) = (reps.to_string(), warmup.to_string());
    let mut all = vec!["--cpu"];
    all.extend_from_slice(args);
    all.extend(["--reps", &reps, "--warmup", &warmup]);
    bench_ok(&all)
}
