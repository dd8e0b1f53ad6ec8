//! Records the git commit the binary is built from (`SPATTN_BUILD_COMMIT`), for the results'
//! provenance. `SPATTN_COMMIT` in the build environment overrides it; without git it is
//! "unknown" (the binary then asks git at run time, where it can).

use std::path::Path;
use std::process::{Command, Stdio};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=SPATTN_COMMIT");
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let dot_git = Path::new(&manifest).join("../../.git");
    // A worktree's `.git` is a file naming its git dir (HEAD there; branches in the common dir).
    let git_dir = match std::fs::read_to_string(&dot_git) {
        Ok(text) => match text.trim().strip_prefix("gitdir: ") {
            Some(dir) => Path::new(&manifest).join("../..").join(dir),
            None => dot_git.clone(),
        },
        Err(_) => dot_git.clone(),
    };
    let common_dir = std::fs::read_to_string(git_dir.join("commondir"))
        .map(|c| git_dir.join(c.trim()))
        .unwrap_or_else(|_| git_dir.clone());
    // Rebuild when HEAD moves: HEAD itself, the branch it points to, packed refs. Only files
    // that exist are named (cargo reruns every build for a missing one).
    let head = git_dir.join("HEAD");
    if head.is_file() {
        println!("cargo:rerun-if-changed={}", head.display());
        if let Ok(text) = std::fs::read_to_string(&head) {
            if let Some(reference) = text.trim().strip_prefix("ref: ") {
                for base in [&git_dir, &common_dir] {
                    let branch = base.join(reference);
                    if branch.is_file() {
                        println!("cargo:rerun-if-changed={}", branch.display());
                    }
                }
            }
        }
        let packed = common_dir.join("packed-refs");
        if packed.is_file() {
            println!("cargo:rerun-if-changed={}", packed.display());
        }
    }
    let commit = std::env::var("SPATTN_COMMIT")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .or_else(|| {
            Command::new("git")
                .args(["rev-parse", "--short", "HEAD"])
                .current_dir(&manifest)
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .filter(|s| !s.is_empty())
        })
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=SPATTN_BUILD_COMMIT={commit}");
}
