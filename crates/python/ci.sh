#!/usr/bin/env bash
# The Python package's CI (called by .ci/run; runs anywhere, no GPU, no CUDA):
#  1. builds the wheel with maturin in a virtual environment (target/python-ci/build), linked
#     by zig against glibc 2.28 (the manylinux_2_28 tag: maturin refuses newer symbols);
#  2. installs it with numpy and pytest in a fresh virtual environment (target/python-ci/test)
#     and runs the numpy tests, without torch: the package must work without it;
#  3. installs torch (PyPI's wheel; CPU use) and torch_geometric 2.8 there and runs every test
#     (the CPU ones run, the GPU ones skip). Failing to install torch within
#     SPATTN_TORCH_INSTALL_TIMEOUT seconds (default 900) fails the CI: its tests are checks.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=target/python-ci
python=${PYTHON:-python3}
start=$SECONDS
# torch's wheels (with their CUDA libraries, ~4 GB installed) must not be cached a second time.
export PIP_NO_CACHE_DIR=1

echo "-- building the wheel"
rm -rf "$ROOT/wheels"
"$python" -m venv --clear "$ROOT/build"
# The versions this was tested with (a newer zig may not suit this maturin).
"$ROOT/build/bin/pip" install --quiet --disable-pip-version-check "maturin==1.16.*" "ziglang==0.17.*"
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
t0=$SECONDS
if timeout "${SPATTN_TORCH_INSTALL_TIMEOUT:-900}" $pip install torch "torch_geometric==2.8.*"; then
    echo "-- torch installed in $((SECONDS - t0)) s; every test (GPU tests skip without CUDA)"
    (cd crates/python && "$py" -m pytest -q -p no:cacheprovider tests)
else
    echo "!! torch could not be installed: the torch and PyG tests cannot run" >&2
    df -h . >&2
    exit 1
fi
echo "-- Python package checks took $((SECONDS - start)) s"
