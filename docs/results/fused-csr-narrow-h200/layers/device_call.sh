#!/usr/bin/env bash
# Device call 63: the layers and backward tests on main's head (fused-csr short-tile layouts;
# Auto f32 always fused-csr), plus memcheck of the fused_csr kernels under the layers' tests.
set -u
X=/tmp/x; mkdir -p $X/new
tar -C $X/new -xJf .gpu/s/bin30.tar.xz
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
R=$OUT
timeout 200 $X/new/attention-gpu_layers --include-ignored --test-threads=2 > $R/layers.txt 2>&1; echo "gpu_layers rc=$? $(grep -E '^test result' $R/layers.txt)"
grep -hE "panicked" -A3 $R/layers.txt | head -8
timeout 200 $X/new/attention-gpu_backward --include-ignored --test-threads=2 > $R/backward.txt 2>&1; echo "gpu_backward rc=$? $(grep -E '^test result' $R/backward.txt)"
grep -hE "panicked" -A3 $R/backward.txt | head -8
S="compute-sanitizer --error-exitcode 1 --require-cuda-init no --report-api-errors no"
timeout 150 $S --tool memcheck --kernel-name kns=fused_csr $X/new/attention-gpu_layers --include-ignored --test-threads=1 --exact transformer_matches_the_f64_cpu_layer > /tmp/mc.txt 2>&1
echo "memcheck layers transformer rc=$? $(grep SUMMARY /tmp/mc.txt) $(grep -E '^test result' /tmp/mc.txt)"
