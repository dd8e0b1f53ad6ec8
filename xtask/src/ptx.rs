//! `cargo xtask ptx`: compile crates/kernels-sys/cuda/*.cu to ptx/*.ptx and regenerate
//! src/generated.rs; `cargo xtask ptx --check`: verify both are current, without NVRTC.

use crate::codegen::{self, Module};
use crate::nvrtc::Nvrtc;
use crate::ptx_hash::{self, Sources};
use std::fs;
use std::path::{Path, PathBuf};

/// The kernels crate, relative to the workspace root (the working directory of every command).
const KERNELS_SYS: &str = "crates/kernels-sys";

/// Paths of the kernels crate, relative to the workspace root.
struct Layout {
    cuda: PathBuf,
    ptx: PathBuf,
    generated: PathBuf,
}

impl Layout {
    fn new() -> Self {
        let root = Path::new(KERNELS_SYS);
        Layout {
            cuda: root.join("cuda"),
            ptx: root.join("ptx"),
            generated: root.join("src/generated.rs"),
        }
    }

    fn ptx_of(&self, stem: &str) -> PathBuf {
        self.ptx.join(format!("{stem}.ptx"))
    }
}

fn read_sources(layout: &Layout) -> Result<Sources, String> {
    let sources = ptx_hash::read_sources(&layout.cuda)
        .map_err(|e| format!("cannot read {}: {e}", layout.cuda.display()))?;
    if sources.kernels.is_empty() {
        return Err(format!("no .cu file in {}", layout.cuda.display()));
    }
    Ok(sources)
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Writes `contents` to `path` unless it already holds exactly that (keeps mtimes, so cargo
/// does not rebuild for nothing). Returns whether it wrote.
fn write_if_changed(path: &Path, contents: &str) -> Result<bool, String> {
    if fs::read(path).ok().as_deref() == Some(contents.as_bytes()) {
        return Ok(false);
    }
    fs::write(path, contents).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(true)
}

/// The `.ptx` files in ptx/ whose `.cu` is gone.
fn orphans(layout: &Layout, sources: &Sources) -> Result<Vec<PathBuf>, String> {
    let stems: Vec<String> = sources
        .kernels
        .iter()
        .map(|p| ptx_hash::kernel_stem(p))
        .collect();
    let entries = match fs::read_dir(&layout.ptx) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", layout.ptx.display())),
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "ptx"))
        .filter(|p| !stems.contains(&ptx_hash::kernel_stem(p)))
        .collect();
    out.sort();
    Ok(out)
}

/// The module list for generated.rs, read from the PTX files of `sources`.
fn modules(layout: &Layout, sources: &Sources) -> Result<Vec<Module>, String> {
    let mut modules = Vec::new();
    for cu in &sources.kernels {
        let name = ptx_hash::kernel_stem(cu);
        let path = layout.ptx_of(&name);
        let ptx = String::from_utf8_lossy(&read(&path)?).into_owned();
        let kernels = ptx_hash::entry_names(&ptx)
            .into_iter()
            .map(String::from)
            .collect();
        modules.push(Module { name, kernels });
    }
    Ok(modules)
}

/// The option `cargo xtask ptx --lineinfo` adds, so that profilers and sanitizers name source
/// lines. It changes no instruction; PTX made with it reads as stale to `--check` (its stamp
/// differs), so it is for a local profiling build, not for a commit.
pub const LINEINFO: &str = "-lineinfo";

/// `cargo xtask ptx` (`--lineinfo`: with line info, for profiling; not for a commit).
pub fn generate(lineinfo: bool) -> Result<(), String> {
    let layout = Layout::new();
    let sources = read_sources(&layout)?;
    let nvrtc = crate::nvrtc::load()?;
    let (major, minor) = nvrtc.version;
    eprintln!(
        "NVRTC {major}.{minor}: {} (headers {}; found via {})",
        nvrtc.lib_path.display(),
        nvrtc.include_dir.display(),
        nvrtc.origin
    );
    fs::create_dir_all(&layout.ptx)
        .map_err(|e| format!("cannot create {}: {e}", layout.ptx.display()))?;

    let options = if lineinfo {
        // The stamp names the extra option, so --check reads this PTX as stale.
        format!(
            "{} {LINEINFO} +{}",
            ptx_hash::NVRTC_OPTIONS.join(" "),
            ptx_hash::POST_PROCESSING
        )
    } else {
        ptx_hash::options_string()
    };
    let mut failures = Vec::new();
    for cu in &sources.kernels {
        let name = ptx_hash::kernel_stem(cu);
        match compile_one(&nvrtc, &layout, &sources, cu, (&options, lineinfo)) {
            Ok(wrote) => {
                let state = if wrote { "written" } else { "unchanged" };
                eprintln!("  {} ({state})", layout.ptx_of(&name).display());
            }
            Err(e) => failures.push(e),
        }
    }
    if !failures.is_empty() {
        return Err(failures.join("\n"));
    }
    for orphan in orphans(&layout, &sources)? {
        fs::remove_file(&orphan).map_err(|e| format!("cannot remove {}: {e}", orphan.display()))?;
        eprintln!("  {} (removed: its .cu is gone)", orphan.display());
    }
    let generated = codegen::render(&modules(&layout, &sources)?)?;
    let wrote = write_if_changed(&layout.generated, &generated)?;
    let state = if wrote { "written" } else { "unchanged" };
    eprintln!("  {} ({state})", layout.generated.display());
    Ok(())
}

/// Compiles one `.cu` and writes its stamped PTX. Returns whether the file changed.
fn compile_one(
    nvrtc: &Nvrtc,
    layout: &Layout,
    sources: &Sources,
    cu: &Path,
    (options, lineinfo): (&str, bool),
) -> Result<bool, String> {
    let name = ptx_hash::kernel_stem(cu);
    let bytes = read(cu)?;
    let hash = ptx_hash::source_hash(&bytes, &sources.headers, options);
    // Named by its path from the workspace root: that is the name -lineinfo records.
    let program = format!("{}/{}", layout.cuda.display(), ptx_hash::file_name(cu));
    let (ptx, log) = nvrtc.compile(&bytes, &program, &nvrtc.options(&layout.cuda, lineinfo))?;
    let ptx = compact_loc(&portable_file_paths(&ptx, &nvrtc.include_dir));
    if !log.trim().is_empty() {
        eprintln!("{}", log.trim_end());
    }
    let entries = ptx_hash::entry_names(&ptx);
    if entries.is_empty() {
        eprintln!("warning: {program} exports no `extern \"C\" __global__` kernel");
    }
    let (major, minor) = nvrtc.version;
    let mut text = ptx_hash::stamp_line(&hash, options);
    text.push('\n');
    text.push_str(&format!(
        "// from {program} by NVRTC {major}.{minor}; generated by `cargo xtask ptx`; do not edit.\n"
    ));
    text.push_str(&ptx);
    if !text.ends_with('\n') {
        text.push('\n');
    }
    write_if_changed(&layout.ptx_of(&name), &text)
}

/// The `compact-loc` post-processing ([`ptx_hash::POST_PROCESSING`]): `.loc` lines keep file,
/// line and column but drop their `, function_name …, inlined_at …` suffix (two fifths of the
/// hybrid kernels' PTX, every helper being inlined), and NVRTC's `// begin inline asm` /
/// `// end inline asm` comments go. Both are optional in the PTX ISA and change no
/// instruction: sanitizer and profiler reports still name the source line.
fn compact_loc(ptx: &str) -> String {
    ptx.split_inclusive('\n')
        .filter(|line| {
            let t = line.trim();
            t != "// begin inline asm" && t != "// end inline asm"
        })
        .map(|line| {
            let t = line.trim_start();
            match (t.starts_with(".loc"), line.find(", function_name")) {
                (true, Some(cut)) => {
                    let mut short = line[..cut].to_string();
                    if line.ends_with('\n') {
                        short.push('\n');
                    }
                    short
                }
                _ => line.to_string(),
            }
        })
        .collect()
}

/// `-lineinfo` names source files in `.file` lines by absolute path (NVRTC prefixes the
/// working directory): make them relative to the workspace root, and CUDA's own headers
/// `cuda-include/...`, so the PTX is byte-identical on every machine.
fn portable_file_paths(ptx: &str, cuda_include: &Path) -> String {
    let mut prefixes = Vec::new();
    if let Ok(root) = std::env::current_dir() {
        prefixes.push((format!("\"{}/", root.display()), "\"".to_string()));
    }
    prefixes.push((
        format!("\"{}/", cuda_include.display()),
        "\"cuda-include/".to_string(),
    ));
    ptx.split_inclusive('\n')
        .map(|line| {
            if !line.trim_start().starts_with(".file") {
                return line.to_string();
            }
            prefixes
                .iter()
                .fold(line.to_string(), |l, (from, to)| l.replacen(from, to, 1))
        })
        .collect()
}

/// `cargo xtask ptx --check`.
pub fn check() -> Result<(), String> {
    let layout = Layout::new();
    let sources = read_sources(&layout)?;
    let options = ptx_hash::options_string();
    let mut problems = Vec::new();
    for cu in &sources.kernels {
        let name = ptx_hash::kernel_stem(cu);
        let ptx_path = layout.ptx_of(&name);
        let Ok(ptx) = fs::read(&ptx_path) else {
            problems.push(format!(
                "missing: {} (for {})",
                ptx_path.display(),
                cu.display()
            ));
            continue;
        };
        let ptx = String::from_utf8_lossy(&ptx);
        let expected = ptx_hash::source_hash(&read(cu)?, &sources.headers, &options);
        match ptx_hash::parse_stamp(&ptx) {
            None => problems.push(format!(
                "stale: {} has no `{}` stamp line",
                ptx_path.display(),
                ptx_hash::STAMP_PREFIX.trim_end()
            )),
            Some(stamp) if stamp.options != options => problems.push(format!(
                "stale: {} was compiled with options `{}`, not `{options}`",
                ptx_path.display(),
                stamp.options
            )),
            Some(stamp) if stamp.sha256 != expected => problems.push(format!(
                "stale: {} (sources changed: {} or cuda/*.cuh)",
                ptx_path.display(),
                cu.display()
            )),
            Some(_) => {}
        }
    }
    for orphan in orphans(&layout, &sources)? {
        problems.push(format!(
            "orphaned: {} (no .cu of that name)",
            orphan.display()
        ));
    }
    // generated.rs is checked against the PTX on disk, however stale that is.
    let all_present = sources
        .kernels
        .iter()
        .all(|cu| layout.ptx_of(&ptx_hash::kernel_stem(cu)).is_file());
    if all_present {
        let expected = codegen::render(&modules(&layout, &sources)?)?;
        let actual = fs::read(&layout.generated).unwrap_or_default();
        if actual != expected.as_bytes() {
            problems.push(format!(
                "stale: {} (does not list the kernels of the PTX files)",
                layout.generated.display()
            ));
        }
    }
    if problems.is_empty() {
        eprintln!(
            "ptx: {} PTX files and {} are current",
            sources.kernels.len(),
            layout.generated.display()
        );
        return Ok(());
    }
    for p in &problems {
        eprintln!("{p}");
    }
    Err(format!(
        "{} problem(s) with the generated kernels: run `cargo xtask ptx` and commit the result",
        problems.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loc_lines_lose_their_inlining_suffix_and_asm_comments_go() {
        let ptx = "\t.loc\t1 61 5, function_name $L__info_string0, inlined_at 1 262 1\n\
                   \t// begin inline asm\n\
                   \tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};\n\
                   \t// end inline asm\n\
                   \t.loc\t1 262 1\n";
        assert_eq!(
            compact_loc(ptx),
            "\t.loc\t1 61 5\n\
             \tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};\n\
             \t.loc\t1 262 1\n"
        );
    }

    #[test]
    fn file_paths_become_portable() {
        let root = std::env::current_dir().unwrap();
        let ptx = format!(
            ".version 8.4\n\t.file\t1 \"{}/crates/x.cu\"\n\t.file\t2 \"/opt/cuda/include/cuda_fp16.hpp\"\n\t.loc\t1 2 3\n",
            root.display()
        );
        let out = portable_file_paths(&ptx, Path::new("/opt/cuda/include"));
        assert_eq!(
            out,
            ".version 8.4\n\t.file\t1 \"crates/x.cu\"\n\t.file\t2 \"cuda-include/cuda_fp16.hpp\"\n\t.loc\t1 2 3\n"
        );
    }
}
