//! `cargo xtask gpu-bundle`: everything the GPU machine needs to run the tests, without Rust.
//!
//! Layout of the bundle (default target/gpu-bundle):
//!
//! ```text
//! run.sh          unpacks bin.tar.* and bench.tar.* into a temporary folder and runs every
//!                 test executable with --include-ignored --test-threads=1, from any folder
//!                 (`--quick`: the shared-graph loops on cora alone, R-MAT 12 for 16)
//! bin.tar.xz      test executables, stripped of debug info, named <package>-<target>
//!                 (<package>-lib for unit tests)
//! bench.tar.xz    bench/: criterion bench executables and the spattn-bench binaries
//! data/           graphs (*.mtx.gz); run.sh points SPATTN_DATA_DIR here
//! peers/          crates/bench/peers/*.py and *.sh, and crates/bench/run_gpu_bench.sh
//! ```
//!
//! The executables travel compressed: each one that links spattn-kernels-sys embeds all the
//! PTX (megabytes of text), and xz keeps one copy of it across the archive when its dictionary
//! spans the whole archive (preset 9 with a 1 GiB dictionary: 825 MB of test executables pack
//! into 9.7 MB, against 16.2 MB with plain `-9`'s 64 MiB; xz then needs about 11 GB of memory to
//! compress, 1 GiB to unpack). Where xz is missing, gzip (about 4 times).

use serde_json::Value;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::ptx_hash::file_name;

/// The most the bundle may weigh: the device tool carries at most 64 MiB with the work tree.
const MAX_BYTES: u64 = 60 * 1024 * 1024;

/// Graphs every bundle carries besides the `--graph` ones.
const DEFAULT_GRAPHS: &[&str] = &["cora", "pubmed", "ogbn-arxiv"];

/// The small graph that ships inside the repository (tests of spattn-formats read it).
const BUNDLED_CORA: &str = "crates/formats/tests/data/cora.mtx.gz";

/// Where the shared graphs are: the `shared/` folder beside the repository.
const SHARED_GRAPHS: &str = "../shared/data/mtx";

/// The peer scripts of the benchmarks (torch.sparse, PyG-style, fused kernels), where they
/// exist.
const PEERS: &str = "crates/bench/peers";

/// The script that runs spattn-bench and the peers graph by graph (into peers/ too).
const RUN_GPU_BENCH: &str = "crates/bench/run_gpu_bench.sh";

/// The bench package, whose binaries go into bench/.
const BENCH_PACKAGE: &str = "spattn-bench";

/// The second line of every run.sh this command writes: how a folder is known as a bundle
/// (and so may be emptied by the next run).
const MARKER: &str = "# spattn GPU test bundle, made by `cargo xtask gpu-bundle`";

/// Command-line options of `gpu-bundle`.
#[derive(Debug, Default)]
pub struct Options {
    /// The bundle folder; `None` for target/gpu-bundle.
    pub out: Option<PathBuf>,
    /// Extra graph names from ../shared/data/mtx.
    pub graphs: Vec<String>,
}

impl Options {
    /// Parses `[--out DIR] [--graph NAME]...` (also `--out=DIR`, `--graph=NAME`); a relative
    /// DIR is taken from `invoked_from`, the folder the command was started in.
    pub fn parse(args: &[&str], invoked_from: &Path) -> Result<Self, String> {
        let mut options = Options::default();
        let mut it = args.iter();
        while let Some(&arg) = it.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v)),
                _ => (arg, None),
            };
            let mut value = || {
                inline
                    .or_else(|| it.next().copied())
                    .filter(|v| !v.is_empty())
                    .ok_or_else(|| format!("gpu-bundle: {flag} needs a value"))
            };
            match flag {
                "--out" => options.out = Some(invoked_from.join(value()?)),
                "--graph" => options.graphs.push(value()?.to_string()),
                _ => {
                    return Err(format!(
                        "gpu-bundle: unknown argument `{arg}` (expected --out DIR, --graph NAME)"
                    ))
                }
            }
        }
        Ok(options)
    }
}

/// What `cargo metadata` says about the workspace.
struct Workspace {
    /// The repository root: every path below is taken from it, wherever cargo was started.
    root: PathBuf,
    target_dir: PathBuf,
    /// Package id → package name, for the workspace members.
    names: BTreeMap<String, String>,
    has_benches: bool,
    has_bench_package: bool,
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs a cargo command, its diagnostics on our stderr, and returns its JSON messages.
fn cargo_json(args: &[&str]) -> Result<Vec<Value>, String> {
    let line = format!("cargo {}", args.join(" "));
    eprintln!("gpu-bundle: {line}");
    let out = cargo()
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("`{line}` failed ({})", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

fn metadata() -> Result<Workspace, String> {
    let out = cargo()
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("`cargo metadata` failed ({})", out.status));
    }
    let meta: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("cannot parse `cargo metadata`: {e}"))?;
    let target_dir = meta["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .ok_or("`cargo metadata` names no target directory")?;
    let root = meta["workspace_root"]
        .as_str()
        .map(PathBuf::from)
        .ok_or("`cargo metadata` names no workspace root")?;
    let mut names = BTreeMap::new();
    let mut has_benches = false;
    let mut has_bench_package = false;
    for package in meta["packages"].as_array().into_iter().flatten() {
        let (Some(id), Some(name)) = (package["id"].as_str(), package["name"].as_str()) else {
            continue;
        };
        names.insert(id.to_string(), name.to_string());
        let targets = package["targets"].as_array().into_iter().flatten();
        let kinds: Vec<&str> = targets
            .flat_map(|t| t["kind"].as_array().into_iter().flatten())
            .filter_map(Value::as_str)
            .collect();
        has_benches |= kinds.contains(&"bench");
        has_bench_package |= name == BENCH_PACKAGE && kinds.contains(&"bin");
    }
    Ok(Workspace {
        root,
        target_dir,
        names,
        has_benches,
        has_bench_package,
    })
}

/// One executable cargo built, with the name it gets in the bundle.
struct Executable {
    path: PathBuf,
    name: String,
}

/// The executables among cargo's JSON messages that `keep` accepts (given the target kind and
/// whether it was built as a test), named by `name_of(package, kind, target)`.
fn executables(
    messages: &[Value],
    ws: &Workspace,
    keep: impl Fn(&str, bool) -> bool,
    name_of: impl Fn(&str, &str, &str) -> String,
) -> Vec<Executable> {
    let mut out = Vec::new();
    for m in messages {
        if m["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(path) = m["executable"].as_str() else {
            continue;
        };
        let kind = m["target"]["kind"][0].as_str().unwrap_or("");
        let is_test = m["profile"]["test"].as_bool().unwrap_or(false);
        if !keep(kind, is_test) {
            continue;
        }
        let id = m["package_id"].as_str().unwrap_or("");
        let Some(package) = ws.names.get(id) else {
            continue; // not a workspace member
        };
        let target = m["target"]["name"].as_str().unwrap_or("");
        out.push(Executable {
            path: PathBuf::from(path),
            name: name_of(package, kind, target),
        });
    }
    out
}

/// The bundle name of a test executable: `<package>-lib` for a library's unit tests,
/// `<package>-bin-<target>` for a binary's, `<package>-<target>` for tests/ and benches/.
fn test_name(package: &str, kind: &str, target: &str) -> String {
    match kind {
        "lib" | "rlib" | "dylib" | "cdylib" | "staticlib" | "proc-macro" => {
            format!("{package}-lib")
        }
        "bin" => format!("{package}-bin-{target}"),
        _ => format!("{package}-{target}"),
    }
}

/// Whether `dir` holds a bundle (its run.sh carries [`MARKER`]) or nothing at all: the only
/// folders this command empties.
fn is_bundle_or_empty(dir: &Path) -> bool {
    let is_bundle = fs::read_to_string(dir.join("run.sh"))
        .map(|s| s.lines().nth(1).is_some_and(|l| l.starts_with(MARKER)))
        .unwrap_or(false);
    is_bundle || fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none())
}

/// Empties `out` for a new bundle, refusing to touch a folder that is not one.
fn prepare(out: &Path) -> Result<(), String> {
    if out.exists() {
        if !is_bundle_or_empty(out) {
            return Err(format!(
                "{} exists and is not a GPU bundle; choose another --out or remove it",
                out.display()
            ));
        }
        fs::remove_dir_all(out).map_err(|e| format!("cannot empty {}: {e}", out.display()))?;
    }
    for sub in ["bin", "bench", "data"] {
        let dir = out.join(sub);
        fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Copies an executable without its debug info (`strip --strip-debug`, else `objcopy`, else a
/// plain copy with a warning).
fn copy_stripped(from: &Path, to: &Path) -> Result<(), String> {
    let stripped = [
        ("strip", vec!["--strip-debug", "-o"]),
        ("objcopy", vec!["--strip-debug"]),
    ]
    .iter()
    .any(|(tool, args)| {
        let mut cmd = Command::new(tool);
        cmd.args(args);
        if *tool == "strip" {
            cmd.arg(to).arg(from);
        } else {
            cmd.arg(from).arg(to);
        }
        cmd.stdin(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    });
    if !stripped {
        eprintln!(
            "warning: neither strip nor objcopy worked; {} keeps its debug info",
            to.display()
        );
        fs::copy(from, to).map_err(|e| format!("cannot copy {}: {e}", from.display()))?;
    }
    Ok(())
}

/// Copies a data file as rw-r--r-- (the shared graphs are read-only, and the next bundle
/// must be able to replace this one).
fn copy_file(from: &Path, to: &Path) -> Result<(), String> {
    fs::copy(from, to)
        .map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(to, fs::Permissions::from_mode(0o644))
            .map_err(|e| format!("{}: {e}", to.display()))?;
    }
    Ok(())
}

/// Where graph `name` comes from: the repository's own cora, else ../shared/data/mtx.
fn graph_source(root: &Path, name: &str) -> PathBuf {
    let stem = name.trim_end_matches(".gz").trim_end_matches(".mtx");
    let bundled = root.join(BUNDLED_CORA);
    if stem == "cora" && bundled.is_file() {
        return bundled;
    }
    root.join(SHARED_GRAPHS).join(format!("{stem}.mtx.gz"))
}

/// Total size of the files under `dir`.
fn size_of(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => size_of(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Places `exes` into `dir`, refusing two executables of one name.
fn place(exes: &[Executable], dir: &Path) -> Result<(), String> {
    let mut seen = BTreeMap::new();
    for exe in exes {
        if let Some(first) = seen.insert(exe.name.clone(), exe.path.clone()) {
            if first != exe.path {
                return Err(format!(
                    "two executables would be named {}: {} and {}",
                    exe.name,
                    first.display(),
                    exe.path.display()
                ));
            }
            continue;
        }
        copy_stripped(&exe.path, &dir.join(&exe.name))?;
    }
    Ok(())
}

/// The graphs to bundle, as (source, file name in data/), checked to exist.
fn graph_files(root: &Path, extra: &[String]) -> Result<Vec<(PathBuf, String)>, String> {
    let names = DEFAULT_GRAPHS
        .iter()
        .map(|s| s.to_string())
        .chain(extra.iter().cloned());
    let mut files: Vec<(PathBuf, String)> = Vec::new();
    for name in names {
        let from = graph_source(root, &name);
        let file = file_name(&from);
        if files.iter().any(|(_, f)| *f == file) {
            continue;
        }
        if !from.is_file() {
            return Err(format!(
                "graph `{name}` not found at {} (the shared graphs live in {SHARED_GRAPHS}, \
                 beside the repository)",
                from.display()
            ));
        }
        files.push((from, file));
    }
    Ok(files)
}

/// The peer scripts (crates/bench/peers/*.py and *.sh) and run_gpu_bench.sh, sorted.
fn peer_scripts(root: &Path) -> Vec<PathBuf> {
    let mut scripts: Vec<PathBuf> = fs::read_dir(root.join(PEERS))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "py" || e == "sh"))
        .collect();
    let runner = root.join(RUN_GPU_BENCH);
    if runner.is_file() {
        scripts.push(runner);
    }
    scripts.sort();
    scripts
}

/// Builds the test executables, the bench executables and the spattn-bench binaries.
fn build(ws: &Workspace) -> Result<(Vec<Executable>, Vec<Executable>), String> {
    let messages = cargo_json(&[
        "test",
        "--workspace",
        "--exclude",
        "xtask",
        "--release",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ])?;
    let tests = executables(&messages, ws, |_, is_test| is_test, test_name);
    if tests.is_empty() {
        return Err("cargo built no test executable".to_string());
    }
    let mut benches = Vec::new();
    if ws.has_bench_package {
        let messages = cargo_json(&[
            "build",
            "--release",
            "--package",
            BENCH_PACKAGE,
            "--bins",
            "--message-format=json-render-diagnostics",
        ])?;
        benches.extend(executables(
            &messages,
            ws,
            |kind, _| kind == "bin",
            |_, _, target| target.to_string(),
        ));
    }
    if ws.has_benches {
        let messages = cargo_json(&[
            "bench",
            "--workspace",
            "--exclude",
            "xtask",
            "--no-run",
            "--bench",
            "*",
            "--message-format=json-render-diagnostics",
        ])?;
        benches.extend(executables(
            &messages,
            ws,
            |kind, _| kind == "bench",
            test_name,
        ));
    }
    Ok((tests, benches))
}

/// Packs `out/<folder>` into `out/<folder>.tar.xz` (gzip where xz is missing) and removes the
/// folder. Returns the archive's file name.
fn pack(out: &Path, folder: &str) -> Result<String, String> {
    let mut tried = Vec::new();
    for (ext, flag) in [("tar.xz", "-J"), ("tar.gz", "-z")] {
        let name = format!("{folder}.{ext}");
        let archive = out.join(&name);
        let status = Command::new("tar")
            .env("XZ_OPT", "--lzma2=preset=9,dict=1GiB")
            .env("GZIP", "-9")
            .arg("-C")
            .arg(out)
            .arg("-c")
            .arg(flag)
            .arg("-f")
            .arg(&archive)
            .arg(folder)
            .stdin(Stdio::null())
            .status();
        match status {
            Ok(s) if s.success() => {
                let dir = out.join(folder);
                fs::remove_dir_all(&dir)
                    .map_err(|e| format!("cannot remove {}: {e}", dir.display()))?;
                return Ok(name);
            }
            Ok(s) => tried.push(format!("tar {flag} ({s})")),
            Err(e) => tried.push(format!("tar {flag} ({e})")),
        }
        let _ = fs::remove_file(&archive);
    }
    Err(format!(
        "cannot pack {}: {} failed; install tar with xz-utils or gzip",
        out.join(folder).display(),
        tried.join(", ")
    ))
}

/// `cargo xtask gpu-bundle`.
pub fn run(options: &Options) -> Result<(), String> {
    let ws = metadata()?;
    let out = options
        .out
        .clone()
        .unwrap_or_else(|| ws.target_dir.join("gpu-bundle"));
    // Everything that can be checked before a long build is checked first.
    let graphs = graph_files(&ws.root, &options.graphs)?;
    let peers = peer_scripts(&ws.root);
    if peers.is_empty() {
        return Err(format!(
            "no peer scripts in {}",
            ws.root.join(PEERS).display()
        ));
    }
    if out.exists() && !is_bundle_or_empty(&out) {
        return Err(format!(
            "{} exists and is not a GPU bundle; choose another --out or remove it",
            out.display()
        ));
    }

    // Build before emptying `out`, so a compile error leaves the previous bundle in place.
    let (tests, benches) = build(&ws)?;

    prepare(&out)?;
    // run.sh (which carries the marker) first: an interrupted run still leaves a folder the
    // next run recognises as a bundle.
    write_run_sh(&out)?;
    place(&tests, &out.join("bin"))?;
    place(&benches, &out.join("bench"))?;
    let unpacked = size_of(&out.join("bin")) + size_of(&out.join("bench"));
    eprintln!(
        "gpu-bundle: packing {} of executables (xz with a 1 GiB dictionary takes minutes)",
        mib(unpacked)
    );
    let mut archives = vec![pack(&out, "bin")?];
    if !benches.is_empty() {
        archives.push(pack(&out, "bench")?);
    } else {
        let _ = fs::remove_dir(out.join("bench"));
    }
    for (from, file) in &graphs {
        copy_file(from, &out.join("data").join(file))?;
    }
    if !peers.is_empty() {
        let dir = out.join("peers");
        fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        for script in &peers {
            copy_file(script, &dir.join(file_name(script)))?;
        }
    }

    let size = size_of(&out);
    eprintln!(
        "gpu-bundle: {} ({} test executables and {} bench executables in {}, {} graphs, {} peer \
         scripts): {}",
        out.display(),
        tests.len(),
        benches.len(),
        archives.join(" and "),
        graphs.len(),
        peers.len(),
        mib(size)
    );
    if size > MAX_BYTES {
        return Err(format!(
            "the bundle is {}, over the limit of {}: drop --graph flags or shrink the executables",
            mib(size),
            mib(MAX_BYTES)
        ));
    }
    eprintln!(
        "gpu-bundle: on the GPU machine run `bash run.sh [FILTER]` in the bundle \
         (SANITIZE=memcheck|racecheck for compute-sanitizer)"
    );
    Ok(())
}

/// The commit the bundle was built from, where git can tell (read only).
fn commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

fn write_run_sh(out: &Path) -> Result<(), String> {
    let script = RUN_SH
        .replace("@MARKER@", MARKER)
        .replace("@COMMIT@", &commit());
    let path = out.join("run.sh");
    fs::write(&path, script).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// run.sh; `@MARKER@` must stay on the second line (see [`MARKER`]).
const RUN_SH: &str = r#"#!/usr/bin/env bash
@MARKER@ (commit @COMMIT@).
#
#   bash run.sh [--quick] [ARGS...]   run every test executable, GPU tests included
#   SANITIZE=memcheck bash run.sh      the same under compute-sanitizer (memcheck or racecheck;
#                                      SANITIZER_FLAGS=... adds compute-sanitizer options)
#
# Runs from any folder: the test executables (bin.tar.*) and spattn-bench (bench.tar.*) are
# unpacked into a temporary folder for each run; every executable runs as
# `EXE --include-ignored --test-threads=1 ARGS...` (ARGS: e.g. a test name filter) from this
# folder, with SPATTN_DATA_DIR set to data/ and SPATTN_BENCH_BIN to the unpacked spattn-bench.
# --quick sets SPATTN_QUICK=1: the tests that loop over the shared graphs run on cora alone,
# the R-MAT 16 sweeps on R-MAT 12.
# Prints PASS or FAIL and the seconds per executable, then `N passed, M failed`; exits non-zero
# if any failed. Benches: `tar -xf bench.tar.*` here, then run bench/spattn-bench or
# bench/<package>-<bench> --bench.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export SPATTN_DATA_DIR="$here/data"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"
if [ "${1:-}" = "--quick" ]; then
    export SPATTN_QUICK=1
    shift
fi

find_archive() {
    local candidate
    for candidate in "$here/$1.tar.xz" "$here/$1.tar.gz"; do
        if [ -f "$candidate" ]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}
archive="$(find_archive bin)" || {
    echo "run.sh: no bin.tar.xz or bin.tar.gz beside run.sh" >&2
    exit 2
}
work="$(mktemp -d "${TMPDIR:-/tmp}/spattn-bundle.XXXXXX")" || exit 2
status_file="$work/status"
trap 'rm -rf "$work"' EXIT
for a in "$archive" $(find_archive bench); do
    if ! tar -C "$work" -xf "$a"; then
        echo "run.sh: cannot unpack $a (needs tar, and xz for .tar.xz)" >&2
        exit 2
    fi
done
if [ -x "$work/bench/spattn-bench" ]; then
    export SPATTN_BENCH_BIN="$work/bench/spattn-bench"
fi

wrap=()
case "${SANITIZE:-}" in
    "") ;;
    memcheck | racecheck | initcheck | synccheck)
        sanitizer="$(command -v compute-sanitizer || true)"
        for dir in "${CUDA_HOME:-}" /usr/local/cuda; do
            if [ -z "$sanitizer" ] && [ -n "$dir" ] && [ -x "$dir/bin/compute-sanitizer" ]; then
                sanitizer="$dir/bin/compute-sanitizer"
            fi
        done
        if [ -z "$sanitizer" ]; then
            echo "run.sh: SANITIZE=$SANITIZE, but compute-sanitizer is neither on PATH nor in \$CUDA_HOME/bin or /usr/local/cuda/bin" >&2
            exit 2
        fi
        # --require-cuda-init no: the CPU-only test executables never initialise CUDA, which is
        #   no error. --report-api-errors no: error-path tests make failing driver calls on
        #   purpose and check the result themselves; the sanitizer judges the kernels' memory
        #   accesses and races. SANITIZER_FLAGS adds more (e.g. --report-api-errors explicit).
        # --target-processes all: the test runs as a child of a small shell (see run_one).
        # shellcheck disable=SC2206
        wrap=("$sanitizer" --tool "$SANITIZE" --error-exitcode 1 --target-processes all
            --require-cuda-init no --report-api-errors no ${SANITIZER_FLAGS:-})
        echo "run.sh: under ${wrap[*]}"
        ;;
    *)
        echo "run.sh: SANITIZE must be memcheck or racecheck (or initcheck, synccheck), not '$SANITIZE'" >&2
        exit 2
        ;;
esac

# Runs one executable (under the sanitizer, if any); on failure sets $reason and returns 1.
# compute-sanitizer does not always pass the program's exit status on (with
# --require-cuda-init no, a program that never touched CUDA "succeeds" whatever it returned), so
# a small shell between the two writes the test's own status to a file.
run_one() {
    local exe="$1"
    shift
    reason=""
    if [ "${#wrap[@]}" -eq 0 ]; then
        (cd "$here" && "$exe" --include-ignored --test-threads=1 "$@")
        local status=$?
        [ "$status" -eq 0 ] || reason="exit $status"
    else
        echo 255 >"$status_file"
        (cd "$here" && "${wrap[@]}" bash -c '"$@"; echo $? >"$0"' "$status_file" \
            "$exe" --include-ignored --test-threads=1 "$@")
        local sanitizer_status=$?
        local test_status
        test_status="$(cat "$status_file")"
        if [ "$test_status" != 0 ]; then
            reason="exit $test_status"
        elif [ "$sanitizer_status" != 0 ]; then
            reason="compute-sanitizer --tool $SANITIZE reported errors"
        fi
    fi
    [ -z "$reason" ]
}

passed=0
failed=0
results=()
total_start=$SECONDS
for exe in "$work"/bin/*; do
    [ -f "$exe" ] && [ -x "$exe" ] || continue
    name="$(basename "$exe")"
    echo "=== $name"
    start=$SECONDS
    if run_one "$exe" "$@"; then
        passed=$((passed + 1))
        line="PASS $name ($((SECONDS - start)) s)"
    else
        failed=$((failed + 1))
        line="FAIL $name ($reason, $((SECONDS - start)) s)"
    fi
    results+=("$line")
    echo "$line"
done

echo
echo "=== summary${SANITIZE:+ (compute-sanitizer --tool $SANITIZE)}${SPATTN_QUICK:+ (quick)}"
if [ "${#results[@]}" -gt 0 ]; then
    printf '%s\n' "${results[@]}"
fi
echo "$passed passed, $failed failed in $((SECONDS - total_start)) s"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_both_spellings_and_reject_the_rest() {
        let from = Path::new("/work/here");
        let o = Options::parse(&["--out", "b", "--graph=flickr", "--graph", "cora"], from).unwrap();
        assert_eq!(o.out.as_deref(), Some(Path::new("/work/here/b")));
        assert_eq!(o.graphs, ["flickr", "cora"]);
        let o = Options::parse(&["--out=/abs"], from).unwrap();
        assert_eq!(o.out.as_deref(), Some(Path::new("/abs")));
        assert!(Options::parse(&["--out"], from).is_err());
        assert!(Options::parse(&["--graph="], from).is_err());
        assert!(Options::parse(&["--frobnicate"], from).is_err());
    }

    #[test]
    fn executables_get_stable_names() {
        assert_eq!(
            test_name("spattn-ops", "lib", "spattn_ops"),
            "spattn-ops-lib"
        );
        assert_eq!(
            test_name("spattn-ops", "test", "gpu_dense"),
            "spattn-ops-gpu_dense"
        );
        assert_eq!(
            test_name("spattn-bench", "bin", "spattn-bench"),
            "spattn-bench-bin-spattn-bench"
        );
    }

    #[test]
    fn run_sh_carries_the_marker_on_its_second_line() {
        let script = RUN_SH.replace("@MARKER@", MARKER);
        assert!(script.lines().nth(1).unwrap().starts_with(MARKER));
        assert!(script.contains("--include-ignored --test-threads=1"));
    }
}
