#!/usr/bin/env bash
# build_peers.sh: builds the fused sparse-attention peers that fused_peers.py times (Fused3S,
# FlashSparse, DF-GNN) from their public sources at pinned commits. The peers' code is never part
# of this repository: this script exports it from a git copy the user fetched, applies our build
# fixes (patches/<peer>/*.patch beside this script, build files only) and builds it.
#
# Two stages, because the GPU machine has no network and this repository's machines have no nvcc:
#
#   1. export, where git copies of the peers are (a bare mirror or a clone of each):
#        git clone --bare https://github.com/HPCForge/Fused3S Fused3S.git
#        git clone --bare https://github.com/ParCIS/FlashSparse FlashSparse.git
#        git clone --bare https://github.com/paoxiaode/DF-GNN DF-GNN.git
#        bash build_peers.sh export .gpu-peers Fused3S.git FlashSparse.git DF-GNN.git
#      checks that each pinned commit is in one of the git dirs given (a unique commit of that
#      prefix), and writes the files of that commit that the build needs (git archive) into
#      OUTDIR/src/<Repo>/, the pins into OUTDIR/PINS.txt (github.com/owner/name@fullhash) and our
#      patches into OUTDIR/patches/. .gpu-peers/ at the repository root is git-ignored (/.gpu*/),
#      so it can be carried to the GPU machine beside the work tree (about 1.5 MB).
#   2. build, on the GPU machine (nvcc, and python3 with a CUDA torch):
#        bash build_peers.sh build .gpu-peers /tmp/peers-build
#      copies each exported tree to BUILDDIR/work/, applies the patches, builds the peer's
#      extensions with its own setup.py (torch.utils.cpp_extension, TORCH_CUDA_ARCH_LIST=9.0
#      unless --arch or the environment says otherwise) into BUILDDIR/lib/, imports each module
#      once, and writes BUILDDIR/lib/SOURCES.txt ("Repo github.com/owner/name fullhash" a line,
#      as fused_peers.py's sources() reads it). One peer failing does not stop the others; the
#      exit status names the ones that failed (their logs: BUILDDIR/logs/<peer>.log).
#   Then: run_gpu_bench.sh ... --fused-build BUILDDIR, or fused_peers.py ... --build-dir BUILDDIR.
#
# Our patches (patches/<peer>/, build and portability fixes only): DF-GNN builds only the
# extension fused_peers.py imports (fused_gtconv: about 1 min on 12 cores, where its two GAT
# extensions took over 5 min more); FlashSparse's three tf32 SpMM launchers declared float get
# a return (flowing off their end trapped, SIGILL, once built by a recent host compiler);
# Fused3S prints through printf instead of std::cout (formatting a number through std::cout
# crashed preprocess_gpu, SIGSEGV). With CUDA 13 the host compiler also needs include/cccl for
# thrust (set below).
#
# The export stage and the build's flow are tested without a GPU; the builds themselves on the
# GPU machine: all three built and ran fused_peers.py on cora (1 and 8 heads × 64, f16 / f32,
# each within its dtype's tolerance of the f64 reference but FlashSparse's tf32, as recorded)
# on an H200 (driver 580.159.04, torch 2.11.0+cu130, nvcc 13.0, TORCH_CUDA_ARCH_LIST=9.0a).
set -euo pipefail

self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
here="$(dirname "$self")"

# peer | repository folder (fused_peers.py's REPO) | github owner/name | pinned commit prefix
PEERS="fused3s Fused3S HPCForge/Fused3S 3480ef4cb01a
flashsparse FlashSparse ParCIS/FlashSparse 168764612c1a
dfgnn DF-GNN paoxiaode/DF-GNN ca6cf429218e"

# What each export keeps: the build's sources, not the peers' data sets, committed binaries or
# experiments (the git copies may even lack those large blobs).
export_paths() {
    case "$1" in
        fused3s) echo "LICENSE README.md src" ;;
        # Pathspec * matches across /: these drop the committed build/, dist/, egg-info and
        # __pycache__ of every depth (python 3.9 x86 binaries, 24 MB).
        flashsparse) echo "README.md FlashSparse :(exclude)FlashSparse/.vscode :(exclude)FlashSparse/*/build/* :(exclude)FlashSparse/build/* :(exclude)FlashSparse/dist/* :(exclude)FlashSparse/*/__pycache__/* :(exclude)FlashSparse/*.egg-info/*" ;;
        dfgnn) echo "LICENSE README.md setup.py pyproject.toml DFGNN" ;;
    esac
}

usage() {
    cat <<'EOF'
usage: build_peers.sh export [--peers LIST] OUTDIR GITDIR...
       build_peers.sh build [--peers LIST] [--python EXE] [--arch LIST] [--jobs N]
                            [--patches DIR] SRCDIR BUILDDIR

  export   for each peer, find its pinned commit in one of the GITDIRs (bare mirrors or clones),
           and write that commit's build files to OUTDIR/src/<Repo>/, the pins to
           OUTDIR/PINS.txt and our patches to OUTDIR/patches/
  build    build the peers exported in SRCDIR into BUILDDIR/lib/ (with BUILDDIR/lib/SOURCES.txt),
           for fused_peers.py --build-dir BUILDDIR / run_gpu_bench.sh --fused-build BUILDDIR

  --peers LIST    comma-separated, of fused3s, flashsparse, dfgnn (default: all three)
  --python EXE    the python with the CUDA torch the harness uses (default: python3)
  --arch LIST     TORCH_CUDA_ARCH_LIST (default: $TORCH_CUDA_ARCH_LIST, else 9.0)
  --jobs N        parallel compile jobs, MAX_JOBS (default: $MAX_JOBS, else the cores)
  --patches DIR   our patches, DIR/<peer>/*.patch applied in name order (default: SRCDIR/patches,
                  else patches/ beside this script)

Pins: Fused3S HPCForge/Fused3S@3480ef4cb01a, FlashSparse ParCIS/FlashSparse@168764612c1a,
DF-GNN paoxiaode/DF-GNN@ca6cf429218e. The comment at the top of this script says more.
EOF
}

die() {
    echo "build_peers.sh: $*" >&2
    exit 2
}

field() { # field PEER N: column N of the peer's line in PEERS
    awk -v p="$1" -v n="$2" '$1 == p { print $n }' <<<"$PEERS"
}

check_peers() {
    local p
    for p in $(tr ',' ' ' <<<"$1"); do
        [ -n "$(field "$p" 2)" ] || die "unknown peer '$p' (known: fused3s, flashsparse, dfgnn)"
    done
}

# The full hash of the one commit with this prefix in GITDIR; empty where there is none; exits 3
# where the prefix names several commits.
resolve() {
    local gitdir="$1" prefix="$2" obj found=()
    while read -r obj; do
        [ "$(git -C "$gitdir" cat-file -t "$obj" 2>/dev/null)" = commit ] && found+=("$obj")
    done < <(git -C "$gitdir" rev-parse --disambiguate="$prefix" 2>/dev/null || true)
    if [ "${#found[@]}" -gt 1 ]; then
        echo "build_peers.sh: $prefix names ${#found[@]} commits in $gitdir: ${found[*]}" >&2
        exit 3
    fi
    echo "${found[0]:-}"
}

cmd_export() {
    local peers="fused3s,flashsparse,dfgnn" out="" gitdirs=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --peers) peers="${2:?--peers needs a list}"; shift 2 ;;
            -h | --help) usage; exit 0 ;;
            -*) die "export: unknown option '$1' (see --help)" ;;
            *) if [ -z "$out" ]; then out="$1"; else gitdirs+=("$1"); fi; shift ;;
        esac
    done
    if [ -z "$out" ] || [ "${#gitdirs[@]}" -eq 0 ]; then usage >&2; exit 2; fi
    check_peers "$peers"
    command -v git >/dev/null || die "export needs git"
    local g
    for g in "${gitdirs[@]}"; do
        git -C "$g" rev-parse --git-dir >/dev/null 2>&1 || die "$g is not a git directory (a bare mirror or a clone)"
    done
    local pins="$out/PINS.txt" p repo slug prefix full where tmp n_out
    local -a paths
    # Every pin is resolved before anything is written.
    local -a fulls=() wheres=()
    for p in $(tr ',' ' ' <<<"$peers"); do
        repo="$(field "$p" 2)" slug="$(field "$p" 3)" prefix="$(field "$p" 4)"
        full="" where=""
        for g in "${gitdirs[@]}"; do
            full="$(resolve "$g" "$prefix")"
            if [ -n "$full" ]; then where="$g"; break; fi
        done
        [ -n "$full" ] || die "$repo: no commit $prefix in ${gitdirs[*]} (fetch github.com/$slug)"
        fulls+=("$full") wheres+=("$where")
    done
    mkdir -p "$out/src"
    echo "# github.com/owner/name@commit of each exported peer (build_peers.sh export)" >"$pins.new"
    local i=0
    for p in $(tr ',' ' ' <<<"$peers"); do
        repo="$(field "$p" 2)" slug="$(field "$p" 3)"
        full="${fulls[$i]}" where="${wheres[$i]}"
        i=$((i + 1))
        read -r -a paths <<<"$(export_paths "$p")"
        tmp="$out/src/.$repo.tmp"
        rm -rf "$tmp" && mkdir -p "$tmp"
        # git archive fails on a blob missing from the copy (its stderr also lists blobs of
        # paths left out, harmless, so it is shown only on failure).
        if ! git -C "$where" archive --format=tar "$full" -- "${paths[@]}" 2>"$tmp.err" | tar -x -C "$tmp"; then
            cat "$tmp.err" >&2
            die "$repo: git archive of $full failed in $where"
        fi
        n_out="$(find "$tmp" -type f | wc -l)"
        [ "$n_out" -gt 0 ] || die "$repo: git archive of $full wrote no file"
        rm -f "$tmp.err"
        rm -rf "${out:?}/src/$repo" && mv "$tmp" "$out/src/$repo"
        echo "github.com/$slug@$full" >>"$pins.new"
        echo "export: $repo github.com/$slug@$full from $where: $n_out files ($(du -sh "$out/src/$repo" | cut -f1))"
    done
    mv "$pins.new" "$pins"
    if [ -d "$here/patches" ]; then
        rm -rf "$out/patches" && cp -R "$here/patches" "$out/patches"
    fi
    echo "export: $out ($(du -sh "$out" | cut -f1)); build on the GPU machine with: bash build_peers.sh build $out BUILDDIR"
}

cmd_build() {
    local peers="fused3s,flashsparse,dfgnn" python="python3" arch="${TORCH_CUDA_ARCH_LIST:-9.0}"
    local jobs="${MAX_JOBS:-}" patches="" src="" build=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --peers) peers="${2:?--peers needs a list}"; shift 2 ;;
            --python) python="${2:?--python needs an executable}"; shift 2 ;;
            --arch) arch="${2:?--arch needs a TORCH_CUDA_ARCH_LIST}"; shift 2 ;;
            --jobs) jobs="${2:?--jobs needs a number}"; shift 2 ;;
            --patches) patches="${2:?--patches needs a folder}"; shift 2 ;;
            -h | --help) usage; exit 0 ;;
            -*) die "build: unknown option '$1' (see --help)" ;;
            *) if [ -z "$src" ]; then src="$1"; elif [ -z "$build" ]; then build="$1"; else die "build: unexpected '$1'"; fi; shift ;;
        esac
    done
    if [ -z "$src" ] || [ -z "$build" ]; then usage >&2; exit 2; fi
    check_peers "$peers"
    [ -f "$src/PINS.txt" ] || die "$src/PINS.txt missing: run \`build_peers.sh export\` first"
    if [ -z "$patches" ]; then
        if [ -d "$src/patches" ]; then patches="$src/patches"; else patches="$here/patches"; fi
    fi
    [ -n "$jobs" ] || jobs="$(nproc 2>/dev/null || echo 4)"
    "$python" -c "import torch, torch.utils.cpp_extension" 2>/dev/null || die "$python has no torch"
    command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] ||
        die "no nvcc on PATH nor in \$CUDA_HOME/bin"
    mkdir -p "$build/lib" "$build/logs" "$build/work" "$build/tmp"
    src="$(cd "$src" && pwd)" build="$(cd "$build" && pwd)"
    if [ -d "$patches" ]; then patches="$(cd "$patches" && pwd)"; else patches=""; fi
    local sources="$build/lib/SOURCES.txt"
    [ -f "$sources" ] || echo "# Repo github.com/owner/name commit, of each peer built here (build_peers.sh build)" >"$sources"
    echo "build: torch $("$python" -c 'import torch; print(torch.__version__)'), TORCH_CUDA_ARCH_LIST=$arch, MAX_JOBS=$jobs"
    local p repo slug full failed=() line
    for p in $(tr ',' ' ' <<<"$peers"); do
        repo="$(field "$p" 2)" slug="$(field "$p" 3)"
        full="$(awk -v s="github.com/$slug@" 'index($0, s) == 1 { print substr($0, length(s) + 1) }' "$src/PINS.txt")"
        # The line of an earlier build goes first: a failed rebuild must not keep claiming it.
        grep -v "^$repo " "$sources" >"$sources.new" || true
        mv "$sources.new" "$sources"
        if [ -z "$full" ] || [ ! -d "$src/src/$repo" ]; then
            echo "build: $repo FAILED: not exported in $src (no github.com/$slug@ line in PINS.txt, or no src/$repo)" >&2
            failed+=("$p")
            continue
        fi
        echo "build: $repo at ${full:0:12} (log: $build/logs/$p.log)"
        # A child bash: set -e holds inside it, and a failure stays this peer's.
        if TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$jobs" bash "$self" _one "$p" "$src/src/$repo" "$build" \
            "$python" "$patches" >"$build/logs/$p.log" 2>&1; then
            echo "$repo github.com/$slug $full" >>"$sources"
            echo "build: $repo ok"
        else
            echo "build: $repo FAILED; the end of $build/logs/$p.log:" >&2
            tail -n 25 "$build/logs/$p.log" | sed 's/^/    /' >&2
            failed+=("$p")
        fi
    done
    echo "build: $sources:"
    while IFS= read -r line; do echo "    $line"; done <"$sources"
    if [ "${#failed[@]}" -gt 0 ]; then
        echo "build_peers.sh: failed: ${failed[*]}" >&2
        exit 1
    fi
}

# _one PEER SRC BUILDDIR PYTHON PATCHES: one peer's copy, patches, build, install and import.
cmd_one() {
    local p="$1" from="$2" build="$3" python="$4" patches="$5"
    local work="$build/work/$p" tmp="$build/tmp/$p" lib="$build/lib" f
    rm -rf "$work" "$tmp"
    mkdir -p "$tmp"
    cp -R "$from" "$work"
    if [ -n "$patches" ] && [ -d "$patches/$p" ]; then
        for f in "$patches/$p"/*.patch; do
            [ -e "$f" ] || continue
            echo "+ apply $f"
            if command -v patch >/dev/null; then
                patch -p1 --forward --batch -d "$work" <"$f"
            else
                (cd "$work" && git apply -p1 "$f")
            fi
        done
    fi
    # CUDA 13 moved thrust (all of CCCL) under include/cccl, which nvcc searches and the host
    # compiler does not: Fused3S's and FlashSparse's .cpp files include thrust.
    local cuda_home
    cuda_home="$("$python" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")')"
    if [ -n "$cuda_home" ] && [ -d "$cuda_home/include/cccl" ]; then
        export CPATH="$cuda_home/include/cccl${CPATH:+:$CPATH}"
    fi
    set -x
    case "$p" in
        fused3s)
            rm -f "$lib"/F3S.*.so
            (cd "$work/src" && "$python" setup.py build_ext --force --build-lib "$lib" --build-temp "$tmp")
            "$python" -c "import sys; sys.path.insert(0, sys.argv[1]); import torch, F3S; print(F3S.__file__)" "$lib"
            ;;
        flashsparse)
            rm -f "$lib"/FS_*.so
            (cd "$work/FlashSparse" && "$python" setup.py build_ext --force --build-lib "$lib" --build-temp "$tmp")
            "$python" -c "import sys; sys.path.insert(0, sys.argv[1]); import torch, FS_Block, FS_SDDMM, FS_SpMM; print(FS_SDDMM.__file__)" "$lib"
            ;;
        dfgnn)
            # Its extensions are named package.*: built aside, fused_gtconv copied to lib/ where
            # its published wrapper (imported by fused_peers.py as dfgnn_fused_gtconv) finds it.
            (cd "$work" && "$python" setup.py build_ext --force --build-lib "$tmp/lib" --build-temp "$tmp")
            rm -f "$lib"/fused_gtconv.*.so
            cp "$tmp"/lib/package/fused_gtconv.*.so "$lib/"
            cp "$work/DFGNN/operators/fused_gtconv.py" "$lib/dfgnn_fused_gtconv.py"
            "$python" -c "import sys; sys.path.insert(0, sys.argv[1]); import torch, dfgnn_fused_gtconv as m; print(m.fused_gt.__file__)" "$lib"
            ;;
    esac
}

[ $# -gt 0 ] || { usage >&2; exit 2; }
case "$1" in
    export) shift; cmd_export "$@" ;;
    build) shift; cmd_build "$@" ;;
    _one) shift; cmd_one "$@" ;;
    -h | --help) usage ;;
    *) usage >&2; die "unknown command '$1'" ;;
esac
