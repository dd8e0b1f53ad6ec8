//! Finding NVRTC 12.x and the CUDA headers on this machine, and compiling one source with it.
//!
//! cudarc loads libnvrtc by file name only (`dlopen("libnvrtc.so.12")` and similar), which
//! finds a library in the loader's search path but not one inside a pip package. So we locate
//! the library ourselves and load it by full path first, with `RTLD_GLOBAL`: when cudarc then
//! asks for `libnvrtc.so.12`, the dynamic loader answers with the library already loaded under
//! that soname. No `LD_LIBRARY_PATH`, no re-exec.

use crate::ptx::LINEINFO;
use crate::ptx_hash::NVRTC_OPTIONS;
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The one major version of NVRTC whose PTX (ISA 8.x) loads on both CUDA 12 and CUDA 13 drivers.
const NVRTC_MAJOR: c_int = 12;

/// The file name of the NVRTC 12 shared library.
const LIB_NAME: &str = "libnvrtc.so.12";

/// How to get NVRTC, for the error message when none is found.
const INSTALL_HINT: &str = "install it with `pip install nvidia-cuda-nvrtc-cu12==12.4.* \
nvidia-cuda-runtime-cu12==12.4.*` (library and headers), or set CUDA_HOME to a CUDA 12 toolkit";

/// A loaded NVRTC, ready to compile.
pub struct Nvrtc {
    /// The library file that was loaded.
    pub lib_path: PathBuf,
    /// Where cuda_fp16.h and friends are.
    pub include_dir: PathBuf,
    /// Where they were found: `CUDA_HOME`, pip, ...
    pub origin: String,
    /// NVRTC's (major, minor) version.
    pub version: (c_int, c_int),
    /// Keeps our handle, so the library stays loaded for cudarc.
    _lib: libloading::Library,
}

/// One place NVRTC may live.
struct Candidate {
    lib: PathBuf,
    include: PathBuf,
    origin: String,
}

/// Finds NVRTC 12 and the CUDA headers, loads NVRTC and checks cudarc uses that one.
pub fn load() -> Result<Nvrtc, String> {
    let candidates = candidates();
    let mut rejected = Vec::new();
    for c in &candidates {
        if !c.lib.is_file() {
            continue;
        }
        if !c.include.join("cuda_fp16.h").is_file() {
            rejected.push(format!(
                "{} has {} but no CUDA headers in {} (pip: also install nvidia-cuda-runtime-cu12==12.4.*)",
                c.origin,
                c.lib.display(),
                c.include.display()
            ));
            continue;
        }
        return open(c);
    }
    let mut msg = format!("NVRTC 12 ({LIB_NAME}) not found; {INSTALL_HINT}.");
    let searched: Vec<String> = candidates
        .iter()
        .map(|c| c.lib.display().to_string())
        .collect();
    msg.push_str(&format!("\n  searched: {}", searched.join(", ")));
    for r in rejected {
        msg.push_str("\n  note: ");
        msg.push_str(&r);
    }
    Err(msg)
}

/// Loads the candidate's library and makes sure cudarc resolves to it.
fn open(c: &Candidate) -> Result<Nvrtc, String> {
    let lib = load_global(&c.lib).map_err(|e| format!("cannot load {}: {e}", c.lib.display()))?;
    let ours = version_of(&lib).map_err(|e| format!("{}: {e}", c.lib.display()))?;
    if ours.0 != NVRTC_MAJOR {
        return Err(format!(
            "{} is NVRTC {}.{}; spattn's PTX must come from NVRTC {NVRTC_MAJOR}.x; {INSTALL_HINT}",
            c.lib.display(),
            ours.0,
            ours.1
        ));
    }
    // SAFETY: only dlopen()s candidate names; our handle above guarantees one of them resolves.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "cudarc could not open NVRTC although {} is loaded",
            c.lib.display()
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid for writes.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion failed: {e}"))?;
    if (major, minor) != ours {
        return Err(format!(
            "cudarc picked another libnvrtc (version {major}.{minor}) than {} ({}.{}): a \
             libnvrtc.so earlier in the loader's path shadows it; set CUDA_HOME or remove it",
            c.lib.display(),
            ours.0,
            ours.1
        ));
    }
    Ok(Nvrtc {
        lib_path: c.lib.clone(),
        include_dir: c.include.clone(),
        origin: c.origin.clone(),
        version: ours,
        _lib: lib,
    })
}

#[cfg(unix)]
fn load_global(path: &Path) -> Result<libloading::Library, libloading::Error> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: libnvrtc's initialisers have no preconditions; it is a plain C library.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map(Into::into)
}

#[cfg(not(unix))]
fn load_global(path: &Path) -> Result<libloading::Library, libloading::Error> {
    // SAFETY: as above.
    unsafe { libloading::Library::new(path) }
}

/// Asks a loaded library for its NVRTC version, through our own handle.
fn version_of(lib: &libloading::Library) -> Result<(c_int, c_int), String> {
    type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
    // SAFETY: nvrtcVersion has had this signature in every NVRTC release.
    let f = unsafe { lib.get::<VersionFn>(b"nvrtcVersion\0") }
        .map_err(|e| format!("not an NVRTC library: {e}"))?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes.
    let status = unsafe { f(&mut major, &mut minor) };
    if status != 0 {
        return Err(format!("nvrtcVersion returned {status}"));
    }
    Ok((major, minor))
}

/// Every place NVRTC may be, in order of preference: CUDA_HOME, CUDA_PATH, pip packages of
/// the `python3` on PATH, common site-packages folders, /usr/local/cuda.
fn candidates() -> Vec<Candidate> {
    let mut out = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            out.push(toolkit(Path::new(&root), var));
        }
    }
    for dir in pip_nvidia_dirs() {
        out.push(Candidate {
            lib: dir.join("cuda_nvrtc/lib").join(LIB_NAME),
            include: dir.join("cuda_runtime/include"),
            origin: format!("pip packages in {}", dir.display()),
        });
    }
    out.push(toolkit(Path::new("/usr/local/cuda"), "/usr/local/cuda"));
    out
}

fn toolkit(root: &Path, origin: &str) -> Candidate {
    Candidate {
        lib: root.join("lib64").join(LIB_NAME),
        include: root.join("include"),
        origin: format!("{origin} ({})", root.display()),
    }
}

/// The `nvidia/` folders of pip's NVIDIA packages: asked of `python3`, then guessed from the
/// usual site-packages folders (a virtualenv, the user's, the system's).
fn pip_nvidia_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let asked = Command::new("python3")
        .args([
            "-c",
            "import nvidia, sys; sys.stdout.write('\\n'.join(nvidia.__path__))",
        ])
        .output();
    if let Ok(out) = asked {
        if out.status.success() {
            let text = String::from_utf8_lossy(&out.stdout);
            dirs.extend(text.lines().filter(|l| !l.is_empty()).map(PathBuf::from));
        }
    }
    let mut roots = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(venv).join("lib"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    roots.push(PathBuf::from("/usr/local/lib"));
    roots.push(PathBuf::from("/usr/lib"));
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| crate::ptx_hash::file_name(p).starts_with("python3"))
            .collect();
        pythons.sort();
        for python in pythons {
            for site in ["site-packages", "dist-packages"] {
                let dir = python.join(site).join("nvidia");
                if dir.is_dir() && !dirs.contains(&dir) {
                    dirs.push(dir);
                }
            }
        }
    }
    dirs
}

impl Nvrtc {
    /// The full option list for one compilation: [`NVRTC_OPTIONS`] (and [`LINEINFO`] where
    /// asked) and the include paths.
    ///
    /// `cuda_dir` is given relative to the working directory (the workspace root), so the
    /// `-lineinfo` file names in the PTX are the same on every machine.
    pub fn options(&self, cuda_dir: &Path, lineinfo: bool) -> Vec<String> {
        let mut opts: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
        if lineinfo {
            opts.push(LINEINFO.to_string());
        }
        opts.push(format!("--include-path={}", cuda_dir.display()));
        opts.push(format!("--include-path={}", self.include_dir.display()));
        opts
    }

    /// Compiles one CUDA C++ source to PTX. Returns the PTX and NVRTC's log (warnings), or an
    /// error holding the log.
    pub fn compile(
        &self,
        source: &[u8],
        name: &str,
        options: &[String],
    ) -> Result<(String, String), String> {
        let src = CString::new(source).map_err(|_| format!("{name} contains a NUL byte"))?;
        let cname = CString::new(name).map_err(|_| format!("{name}: bad file name"))?;
        let prog = result::create_program(&src, Some(&cname))
            .map_err(|e| format!("{name}: nvrtcCreateProgram failed: {e}"))?;
        // SAFETY: `prog` was just created and is destroyed once, below; `src` and `cname`
        // outlive it.
        let compiled = unsafe { result::compile_program(prog, options) };
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog) }
            .map(|raw| c_chars_to_string(&raw))
            .unwrap_or_default();
        let ptx = match compiled {
            // SAFETY: as above; the program compiled.
            Ok(()) => unsafe { result::get_ptx(prog) }
                .map(|raw| c_chars_to_string(&raw))
                .map_err(|e| format!("{name}: nvrtcGetPTX failed: {e}")),
            Err(e) => Err(format!("{name}: NVRTC failed ({e})\n{}", log.trim_end())),
        };
        // SAFETY: created above, not destroyed before.
        let _ = unsafe { result::destroy_program(prog) };
        Ok((ptx?, log))
    }
}

/// A NUL-terminated C buffer as a String.
fn c_chars_to_string(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}
