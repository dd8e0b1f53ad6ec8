#!/usr/bin/env bash
# The Python package's CI (called by .ci/run; runs anywhere, no GPU, no CUDA):
#  1. builds the wheel with maturin in a virtual environment (target/python-ci/build), linked
#     by zig against glibc 2.28 (the manylinux_2_28 tag: maturin refuses newer symbols);
#  2. installs it with numpy and pytest in a fresh virtual environment (target/python-ci/test)
#     and runs the numpy tests, without torch: the package must work without it;
#  3. installs torch (PyPI's wheel; CPU use) and torch_geometric 2.8 there and runs every test
#     (the CPU ones run, the GPU ones skip), one package at a time to bound the disk it needs.
#     Failing to install torch within SPATTN_TORCH_INSTALL_TIMEOUT seconds (default 900) fails
#     the CI: its tests are checks.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=target/python-ci
python=${PYTHON:-python3}
start=$SECONDS
# torch's wheels (with their CUDA libraries, ~5.5 GB installed) must not be cached a second time.
export PIP_NO_CACHE_DIR=1

echo "-- building the wheel"
rm -rf "$ROOT/wheels"
"$python" -m venv --clear "$ROOT/build"
# The versions this was tested with (a newer zig may not suit this maturin).
"$ROOT/build/bin/pip" install --quiet --disable-pip-version-check "maturin==1.16.*" "ziglang==0.17.*"
# maturin finds zig as `python3 -m ziglang`, with the first python3 on PATH unless told which:
# the venv's, where ziglang is (CI does not activate the venv).
CARGO_ZIGBUILD_PYTHON_PATH="$PWD/$ROOT/build/bin/python" \
    "$ROOT/build/bin/maturin" build --release --zig --compatibility manylinux_2_28 \
    -m crates/python/Cargo.toml --out "$ROOT/wheels"
wheel=$(ls "$ROOT"/wheels/spattn-*-cp39-abi3-manylinux_2_28_x86_64.whl)
echo "-- built $wheel ($((SECONDS - start)) s)"
rm -rf "$ROOT/build"  # maturin and zig are not needed past this point; torch needs the disk

echo "-- installing it in a fresh environment; numpy tests without torch"
"$python" -m venv --clear "$ROOT/test"
pip="$ROOT/test/bin/pip --quiet --disable-pip-version-check"
$pip install numpy pytest
$pip install --no-deps "$wheel"
py="$PWD/$ROOT/test/bin/python"
(cd crates/python && "$py" -m pytest -q -p no:cacheprovider tests/test_numpy.py)

echo "-- installing torch and torch_geometric ($((SECONDS - start)) s so far)"
df -h . | tail -1 | awk '{print "-- disk: " $4 " free of " $2}'
t0=$SECONDS
# One package per pip call, pinned to what pip resolves for the pair: a single call downloads
# every wheel (~3 GB) before installing any (~5.5 GB), and CI's shared disk has once had less
# than the sum free; one at a time, the peak is what is installed plus the largest wheel.
deadline=$((SECONDS + ${SPATTN_TORCH_INSTALL_TIMEOUT:-900}))
tpip() {
    local left=$((deadline - SECONDS))
    ((left > 0)) && timeout "$left" $pip "$@"
}
install_torch() {
    local report="$ROOT/torch-report.json" pins pin
    tpip install --dry-run --report "$report" torch "torch_geometric==2.8.*" || return 1
    pins=$("$py" -c 'import json, sys
for i in json.load(open(sys.argv[1]))["install"]:
    print(i["metadata"]["name"] + "==" + i["metadata"]["version"])' "$report") || return 1
    rm -f "$report"
    for pin in $pins; do
        tpip install --no-deps "$pin" || return 1
    done
    # The pins came from one resolution: this installs nothing and checks that they agree.
    tpip install torch "torch_geometric==2.8.*" && "$ROOT/test/bin/pip" check
}
if install_torch; then
    echo "-- torch installed in $((SECONDS - t0)) s; every test (GPU tests skip without CUDA)"
    (cd crates/python && "$py" -m pytest -q -p no:cacheprovider tests)
else
    echo "!! torch could not be installed: the torch and PyG tests cannot run" >&2
    df -h . >&2
    exit 1
fi
echo "-- Python package checks took $((SECONDS - start)) s"
