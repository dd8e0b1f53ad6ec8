#!/usr/bin/env bash
# spattn-bench and its peers on the GPU machine, where there is no Rust: the binaries come from
# `cargo xtask gpu-bundle` (bench/spattn-bench, data/*.mtx.gz, peers/torch_peers.py).
#
#   bash crates/bench/run_gpu_bench.sh [OPTIONS] [-- EXTRA SPATTN-BENCH ARGS...]
#
#   --bundle DIR        the bundle (default: $SPATTN_BUNDLE, else target/gpu-bundle beside this
#                       script's repository)
#   --out DIR           where the results go (default: bench-results/<UTC date>)
#   --graphs "A B"      graph names or files (default: every data/*.mtx.gz of the bundle)
#   --rmat "16 18"      R-MAT scales (default: "16 18 20"; "" for none)
#   --heads "1 8"       heads (default: 1)
#   --head-dim "64 128" features per head (default: "64 128")
#   --dtype "f16 f32"   element types (default: "f16 f32")
#   --bin PATH          the spattn-bench binary (default: BUNDLE/bench/spattn-bench)
#   --peers-script PATH torch_peers.py (default: BUNDLE/peers/torch_peers.py)
#   --data DIR          the graphs (default: BUNDLE/data)
#   --python EXE        the python with torch and torch_geometric (default: python3)
#   --peers-args "..."  extra arguments of torch_peers.py (e.g. "--dense-max-n 50000")
#   --fused-build DIR   also time the fused peers (Fused3S, FlashSparse, DF-GNN) whose extension
#                       modules were built from their public sources into DIR (fused_peers.py
#                       --build-dir DIR; peers/build_peers.sh builds them, see its header)
#   --fused-args "..."  extra arguments of fused_peers.py
#   --no-peers          spattn-bench only
#   --no-report         no BENCHMARKS.md at the end
#
# For each graph and scale, in turn:
#   1. spattn-bench --dump-csr OUT/graphs/NAME.csr --dump-only: the graph as benchmarked
#      (symmetrized with self loops), so the peers time exactly the same graph;
#   2. python3 torch_peers.py OUT/graphs/NAME.csr --name NAME ... --json OUT/peers-NAME.json
#      (and, with --fused-build, fused_peers.py ... --json OUT/peers-fused-NAME.json);
#   3. spattn-bench ... --peers OUT/peers-NAME.json --json OUT/spattn-NAME.json
#      (the table also goes to OUT/spattn-NAME.txt);
# then `spattn-bench report --json OUT/spattn-*.json --out OUT/BENCHMARKS.md --svg
# OUT/docs/benchmarks.svg`: copy OUT/BENCHMARKS.md and OUT/docs/ into the repository root (or
# rerun the report there). A graph that fails does not stop the others; the exit status is
# non-zero when any step failed. Large graphs: pass `-- --no-check` to skip the f64 CPU
# reference, and split the graphs over several calls where a command has a time limit.
set -u
set -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bundle="${SPATTN_BUNDLE:-$here/../../target/gpu-bundle}"
out=""
graphs=""
graphs_set=0
rmat="16 18 20"
heads="1"
head_dim="64 128"
dtype="f16 f32"
bin=""
peers_script=""
data=""
python="python3"
peers_args=""
fused_build=""
fused_args=""
peers=1
report=1
extra=()

die() {
    echo "run_gpu_bench.sh: $*" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) bundle="${2:?--bundle needs a folder}"; shift 2 ;;
        --out) out="${2:?--out needs a folder}"; shift 2 ;;
        --graphs) graphs="${2?--graphs needs a list}"; graphs_set=1; shift 2 ;;
        --rmat) rmat="${2?--rmat needs a list}"; shift 2 ;;
        --heads) heads="${2:?--heads needs a list}"; shift 2 ;;
        --head-dim) head_dim="${2:?--head-dim needs a list}"; shift 2 ;;
        --dtype) dtype="${2:?--dtype needs a list}"; shift 2 ;;
        --bin) bin="${2:?--bin needs a path}"; shift 2 ;;
        --peers-script) peers_script="${2:?--peers-script needs a path}"; shift 2 ;;
        --data) data="${2:?--data needs a folder}"; shift 2 ;;
        --python) python="${2:?--python needs an executable}"; shift 2 ;;
        --peers-args) peers_args="${2?--peers-args needs a string}"; shift 2 ;;
        --fused-build) fused_build="${2:?--fused-build needs a folder}"; shift 2 ;;
        --fused-args) fused_args="${2?--fused-args needs a string}"; shift 2 ;;
        --no-peers) peers=0; shift ;;
        --no-report) report=0; shift ;;
        --) shift; extra=("$@"); break ;;
        -h | --help) sed -n '2,42p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

[ -d "$bundle" ] || [ -n "$bin" ] || die "no bundle at $bundle (run \`cargo xtask gpu-bundle\`, or pass --bundle / --bin)"
if [ -z "$bin" ]; then
    for candidate in "$bundle/bench/spattn-bench" "$bundle/bin/spattn-bench"; do
        if [ -x "$candidate" ]; then bin="$candidate"; break; fi
    done
fi
[ -n "$bin" ] && [ -x "$bin" ] || die "no spattn-bench executable in $bundle/bench (pass --bin)"
[ -n "$data" ] || data="$bundle/data"
if [ -z "$peers_script" ]; then
    for candidate in "$bundle/peers/torch_peers.py" "$here/peers/torch_peers.py"; do
        if [ -f "$candidate" ]; then peers_script="$candidate"; break; fi
    done
fi
if [ "$peers" -eq 1 ]; then
    if [ -z "$peers_script" ] || [ ! -f "$peers_script" ]; then
        echo "run_gpu_bench.sh: no torch_peers.py found: running without peers" >&2
        peers=0
    elif ! "$python" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
        echo "run_gpu_bench.sh: $python has no CUDA torch: running without peers" >&2
        peers=0
    fi
fi
[ -n "$out" ] || out="bench-results/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out/graphs" || die "cannot create $out"
export SPATTN_DATA_DIR="$data"

if [ "$graphs_set" -eq 0 ]; then
    graphs=""
    for f in "$data"/*.mtx.gz; do
        [ -f "$f" ] && graphs="$graphs $(basename "$f" .mtx.gz)"
    done
fi

# One spattn-bench argument list per shape option, and the peers' (space-separated lists).
shape_args=()
for h in $heads; do shape_args+=(--heads "$h"); done
for d in $head_dim; do shape_args+=(--head-dim "$d"); done
for t in $dtype; do shape_args+=(--dtype "$t"); done

failed=()
log() { echo "=== $*"; }

# bench_one NAME GRAPH_ARGS...: dump, peers, spattn-bench for one graph.
bench_one() {
    local name="$1"
    shift
    local csr="$out/graphs/$name.csr"
    local peer_json="$out/peers-$name.json"
    log "$name: dumping the graph"
    if ! "$bin" "$@" --dump-csr "$csr" --dump-only; then
        failed+=("$name (dump)")
        return
    fi
    local peer_flags=()
    if [ "$peers" -eq 1 ]; then
        log "$name: peers ($peers_script)"
        # shellcheck disable=SC2086 # the lists are meant to split
        if "$python" "$peers_script" "$csr" --name "$name" --heads $heads --head-dim $head_dim \
            --dtype $dtype $peers_args --json "$peer_json"; then
            peer_flags=(--peers "$peer_json")
        else
            failed+=("$name (peers)")
        fi
        if [ -n "$fused_build" ]; then
            local fused_json="$out/peers-fused-$name.json"
            log "$name: fused peers ($fused_build)"
            # shellcheck disable=SC2086
            if "$python" "$(dirname "$peers_script")/fused_peers.py" "$csr" --name "$name" \
                --build-dir "$fused_build" --heads $heads --head-dim $head_dim --dtype $dtype \
                $fused_args --json "$fused_json"; then
                peer_flags+=(--peers "$fused_json")
            else
                failed+=("$name (fused peers)")
            fi
        fi
    fi
    log "$name: spattn-bench"
    if ! "$bin" "$@" "${shape_args[@]}" ${peer_flags[@]+"${peer_flags[@]}"} \
        --json "$out/spattn-$name.json" ${extra[@]+"${extra[@]}"} | tee "$out/spattn-$name.txt"; then
        failed+=("$name (spattn-bench)")
    fi
}

for g in $graphs; do
    case "$g" in
        */* | *.mtx | *.gz | *.csr) name="$(basename "$g")"; name="${name%.gz}"; name="${name%.mtx}"; name="${name%.csr}" ;;
        *) name="$g" ;;
    esac
    bench_one "$name" --graph "$g"
done
for s in $rmat; do
    bench_one "rmat-$s" --rmat "$s"
done

if [ "$report" -eq 1 ]; then
    runs=("$out"/spattn-*.json)
    if [ -f "${runs[0]}" ]; then
        log "report"
        "$bin" report --json "${runs[@]}" --out "$out/BENCHMARKS.md" \
            --full "$out/docs/benchmarks-full.md" --svg "$out/docs/benchmarks.svg" --force \
            || failed+=("report")
    fi
fi

echo
echo "results in $out"
if [ "${#failed[@]}" -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}"
    exit 1
fi
