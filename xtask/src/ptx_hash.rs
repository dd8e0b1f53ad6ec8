//! The stamp that ties a generated PTX file to the sources it was compiled from.
//!
//! One file, shared by `cargo xtask ptx` (which writes the stamp) and by the freshness test of
//! spattn-kernels-sys (which recomputes it on every CI run, without NVRTC) through
//! `#[path = "../../../xtask/src/ptx_hash.rs"] mod ptx_hash;`. It therefore uses only std and
//! sha2, and knows nothing of xtask.
//!
//! A PTX file begins with
//!
//! ```text
//! // spattn-ptx sha256=<64 hex digits> options=<NVRTC_OPTIONS joined by spaces>
//! ```
//!
//! where the hash covers the kernel's `.cu` file, every `cuda/*.cuh` header (sorted by name,
//! each with its name: a change to any header marks every PTX stale, which is cheap and never
//! wrong) and the options. Bytes are hashed raw, line endings included.

use sha2::{Digest, Sha256};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The NVRTC options every kernel is compiled with, apart from the `--include-path`s.
///
/// The include paths name folders of the machine that runs NVRTC, so they are left out of the
/// stamp; everything that changes the generated code is here. No fast-math: spattn's numerics
/// (f32 accumulation, IEEE division and `expf` where the source asks for them) are the point.
/// No line info in the shipped PTX (a quarter of its size); `cargo xtask ptx --lineinfo` adds
/// it for profiling.
pub const NVRTC_OPTIONS: &[&str] = &["--gpu-architecture=compute_80", "-std=c++17"];

/// What every PTX stamp line starts with.
pub const STAMP_PREFIX: &str = "// spattn-ptx ";

/// The post-processing `cargo xtask ptx` applies to NVRTC's output (stamped with the options,
/// so PTX from another post-processing reads as stale): `compact-loc` drops the inlining
/// suffix of `.loc` lines and NVRTC's inline-asm comments (line info stays file:line).
pub const POST_PROCESSING: &str = "compact-loc";

/// [`NVRTC_OPTIONS`] and [`POST_PROCESSING`] as written into (and hashed with) each stamp.
pub fn options_string() -> String {
    format!("{} +{POST_PROCESSING}", NVRTC_OPTIONS.join(" "))
}

/// The kernel sources of a `cuda/` folder and the headers they share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sources {
    /// Every `*.cu` file, sorted by file name; each becomes `ptx/<stem>.ptx`.
    pub kernels: Vec<PathBuf>,
    /// Every `*.cuh` file as (file name, bytes), sorted by file name.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Lists the `.cu` files of `cuda_dir` and reads its `.cuh` headers (not recursive).
pub fn read_sources(cuda_dir: &Path) -> io::Result<Sources> {
    let mut kernels = Vec::new();
    let mut headers = Vec::new();
    for entry in fs::read_dir(cuda_dir)? {
        let path = entry?.path();
        if !path.is_file() {
            continue;
        }
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => kernels.push(path),
            Some("cuh") => {
                let name = file_name(&path);
                let bytes = fs::read(&path)?;
                headers.push((name, bytes));
            }
            _ => {}
        }
    }
    kernels.sort_by_key(|p| file_name(p));
    headers.sort();
    Ok(Sources { kernels, headers })
}

/// The file name of `path` as a string (lossy for names that are not UTF-8).
pub fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The stem of a kernel source, `csr_ops` for `cuda/csr_ops.cu`: the PTX file's and the
/// module's name.
pub fn kernel_stem(path: &Path) -> String {
    path.file_stem()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The sha256, in lowercase hex, of one kernel source, all headers and the options string.
///
/// Each part is framed by a tag and its length, so no two different inputs hash alike. The
/// headers are sorted here too, so the caller's order does not matter.
pub fn source_hash(kernel: &[u8], headers: &[(String, Vec<u8>)], options: &str) -> String {
    fn field(hasher: &mut Sha256, tag: &str, bytes: &[u8]) {
        hasher.update(tag.as_bytes());
        hasher.update([0u8]);
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    }
    let mut sorted: Vec<&(String, Vec<u8>)> = headers.iter().collect();
    sorted.sort();
    let mut hasher = Sha256::new();
    hasher.update(b"spattn-ptx-hash v1\n");
    field(&mut hasher, "options", options.as_bytes());
    field(&mut hasher, "kernel", kernel);
    for (name, bytes) in sorted {
        field(&mut hasher, "header-name", name.as_bytes());
        field(&mut hasher, "header", bytes);
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The first line of a generated PTX file (without its newline).
pub fn stamp_line(sha256: &str, options: &str) -> String {
    format!("{STAMP_PREFIX}sha256={sha256} options={options}")
}

/// A parsed stamp line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp<'a> {
    /// The hash of the sources the PTX was compiled from.
    pub sha256: &'a str,
    /// The options it was compiled with.
    pub options: &'a str,
}

/// Reads the stamp on the first line of `ptx`; `None` if there is none (a PTX file written by
/// hand, or by another tool).
pub fn parse_stamp(ptx: &str) -> Option<Stamp<'_>> {
    let first = ptx.lines().next()?;
    let rest = first.strip_prefix(STAMP_PREFIX)?.strip_prefix("sha256=")?;
    let (sha256, options) = rest.split_once(' ')?;
    let options = options.strip_prefix("options=")?;
    Some(Stamp { sha256, options })
}

/// The names of the kernels a PTX module exports: its `.visible .entry NAME(` lines, in order.
pub fn entry_names(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix(".visible")?.trim_start();
            let rest = rest.strip_prefix(".entry")?.trim_start();
            let end = rest.find(|c: char| c == '(' || c.is_whitespace())?;
            Some(&rest[..end])
        })
        .filter(|name| !name.is_empty())
        .collect()
}
