//! The checked-in PTX is current: it was compiled from the `.cu` and `.cuh` files as they are
//! now, it exports the kernels [`MODULES`] lists, and it targets what the design says
//! (`compute_80`, PTX ISA 8.x from NVRTC 12, so CUDA 12 and 13 drivers load it).
//!
//! CPU only, no NVRTC: the hash is recomputed with the very code `cargo xtask ptx` stamps with.

#[path = "../../../xtask/src/ptx_hash.rs"]
mod ptx_hash;

use spattn_kernels_sys::MODULES;
use std::path::{Path, PathBuf};

const FIX: &str = "run `cargo xtask ptx` (NVRTC: `pip install nvidia-cuda-nvrtc-cu12==12.4.* \
nvidia-cuda-runtime-cu12==12.4.*`) and commit the result";

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The crate's sources, or `None` where this test executable runs away from its source tree
/// (the GPU bundle of `cargo xtask gpu-bundle`): freshness is a property of a checkout, and is
/// checked wherever there is one, CI included.
fn sources() -> Option<ptx_hash::Sources> {
    if !crate_dir().join("Cargo.toml").is_file() {
        eprintln!(
            "skipped: no source tree at {} (a bundled test executable)",
            crate_dir().display()
        );
        return None;
    }
    let cuda = crate_dir().join("cuda");
    let sources = ptx_hash::read_sources(&cuda)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", cuda.display()));
    assert!(
        !sources.kernels.is_empty(),
        "no .cu file in {}",
        cuda.display()
    );
    Some(sources)
}

fn ptx_path(stem: &str) -> PathBuf {
    crate_dir().join("ptx").join(format!("{stem}.ptx"))
}

#[test]
fn every_ptx_matches_its_sources() {
    let Some(sources) = sources() else { return };
    let options = ptx_hash::options_string();
    let mut stale = Vec::new();
    for cu in &sources.kernels {
        let stem = ptx_hash::kernel_stem(cu);
        let path = ptx_path(&stem);
        let Ok(ptx) = std::fs::read_to_string(&path) else {
            stale.push(format!("cuda/{stem}.cu has no ptx/{stem}.ptx"));
            continue;
        };
        let kernel = std::fs::read(cu).unwrap();
        let expected = ptx_hash::source_hash(&kernel, &sources.headers, &options);
        match ptx_hash::parse_stamp(&ptx) {
            None => stale.push(format!("ptx/{stem}.ptx has no spattn-ptx stamp line")),
            Some(stamp) if stamp.sha256 != expected || stamp.options != options => {
                stale.push(format!(
                    "ptx/{stem}.ptx is stale: cuda/{stem}.cu, a cuda/*.cuh header or the NVRTC \
                     options changed since it was generated"
                ))
            }
            Some(_) => {}
        }
    }
    assert!(stale.is_empty(), "{}\n{FIX}", stale.join("\n"));
}

#[test]
fn modules_are_exactly_the_cu_files() {
    let Some(sources) = sources() else { return };
    let cu: Vec<String> = sources
        .kernels
        .iter()
        .map(|p| ptx_hash::kernel_stem(p))
        .collect();
    let mut listed: Vec<String> = MODULES.iter().map(|m| m.name.to_string()).collect();
    listed.sort();
    assert_eq!(
        listed, cu,
        "MODULES (src/generated.rs) does not list one module per cuda/*.cu\n{FIX}"
    );
    let mut on_disk: Vec<String> = std::fs::read_dir(crate_dir().join("ptx"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "ptx"))
        .map(|p| ptx_hash::kernel_stem(&p))
        .collect();
    on_disk.sort();
    assert_eq!(on_disk, cu, "ptx/ holds a .ptx without its .cu\n{FIX}");
}

#[test]
fn every_listed_kernel_is_an_entry_of_its_ptx() {
    for module in MODULES {
        let entries = ptx_hash::entry_names(module.ptx);
        for kernel in module.kernels {
            assert!(
                entries.contains(kernel),
                "{kernel} is listed in {} but is not a `.visible .entry` of ptx/{}.ptx\n{FIX}",
                module.name,
                module.name
            );
        }
        assert_eq!(
            entries.len(),
            module.kernels.len(),
            "ptx/{}.ptx exports {entries:?}, MODULES lists {:?}\n{FIX}",
            module.name,
            module.kernels
        );
    }
}

#[test]
fn ptx_targets_sm_80_with_isa_8() {
    for module in MODULES {
        let name = module.name;
        let directive = |d: &str| {
            module
                .ptx
                .lines()
                .find_map(|l| l.trim().strip_prefix(d).map(str::trim))
                .unwrap_or_else(|| panic!("ptx/{name}.ptx has no {d} directive"))
        };
        assert_eq!(
            directive(".target"),
            "sm_80",
            "ptx/{name}.ptx must target sm_80 (--gpu-architecture=compute_80)"
        );
        let version = directive(".version");
        assert!(
            version.starts_with("8."),
            "ptx/{name}.ptx is PTX ISA {version}; generate it with NVRTC 12.x (ISA 8.x) so CUDA 12 \
             drivers load it"
        );
    }
}

#[test]
fn stamp_changes_with_every_input() {
    let headers = vec![("a.cuh".to_string(), b"x".to_vec())];
    let base = ptx_hash::source_hash(b"k", &headers, "o");
    assert_eq!(base.len(), 64);
    assert_ne!(base, ptx_hash::source_hash(b"k2", &headers, "o"));
    assert_ne!(base, ptx_hash::source_hash(b"k", &headers, "o2"));
    assert_ne!(base, ptx_hash::source_hash(b"k", &[], "o"));
    let renamed = vec![("b.cuh".to_string(), b"x".to_vec())];
    assert_ne!(base, ptx_hash::source_hash(b"k", &renamed, "o"));
    let crlf = vec![("a.cuh".to_string(), b"x\r\n".to_vec())];
    assert_ne!(
        ptx_hash::source_hash(b"k", &crlf, "o"),
        ptx_hash::source_hash(b"k", &[("a.cuh".to_string(), b"x\n".to_vec())], "o")
    );
    // Header order does not matter; framing keeps name and content apart.
    let two = vec![
        ("b.cuh".to_string(), b"2".to_vec()),
        ("a.cuh".to_string(), b"1".to_vec()),
    ];
    let mut sorted = two.clone();
    sorted.sort();
    assert_eq!(
        ptx_hash::source_hash(b"k", &two, "o"),
        ptx_hash::source_hash(b"k", &sorted, "o")
    );
    let line = ptx_hash::stamp_line(&base, "o p");
    let stamp = ptx_hash::parse_stamp(&line).unwrap();
    assert_eq!((stamp.sha256, stamp.options), (base.as_str(), "o p"));
    assert!(ptx_hash::parse_stamp("// Generated by NVIDIA NVVM Compiler").is_none());
}

/// Whether a PTX line is a floating-point atomic (`atom` / `red` on f16, bf16, f32 or f64),
/// predicated (`@%p atom...`) or not.
fn is_float_atomic(line: &str) -> bool {
    const FLOAT_TYPES: [&str; 6] = [".f16", ".f16x2", ".bf16", ".bf16x2", ".f32", ".f64"];
    let mut words = line.split_whitespace();
    let Some(mut op) = words.next() else {
        return false;
    };
    if op.starts_with('@') {
        op = words.next().unwrap_or("");
    }
    (op.starts_with("atom.") || op.starts_with("red."))
        && FLOAT_TYPES.iter().any(|t| op.ends_with(t))
}

/// No kernel adds floating-point values with atomics: their order would change from run to
/// run, and results with it. Sums across blocks or units store partials and add them in a fixed
/// order, so that two runs give the same bits.
#[test]
fn no_kernel_uses_floating_point_atomics() {
    // The check itself: PTX as NVRTC writes these.
    assert!(is_float_atomic("\tatom.global.add.f32 \t%f2, [%rd4], %f1;"));
    assert!(is_float_atomic("\t@%p3 red.global.add.f64 \t[%rd9], %fd1;"));
    assert!(is_float_atomic(
        "\tred.relaxed.gpu.global.add.noftz.bf16x2 \t[%rd1], %r1;"
    ));
    assert!(!is_float_atomic("\tatom.global.add.u32 \t%r5, [%rd2], 1;"));
    assert!(!is_float_atomic(
        "\t@%p1 atom.global.or.b32 \t%r3, [%rd7], %r2;"
    ));
    assert!(!is_float_atomic("\tadd.f32 \t%f3, %f1, %f2;"));
    for module in MODULES {
        for (i, line) in module.ptx.lines().enumerate() {
            assert!(
                !is_float_atomic(line),
                "ptx/{}.ptx line {}: `{}` is a floating-point atomic",
                module.name,
                i + 1,
                line.trim()
            );
        }
    }
}
