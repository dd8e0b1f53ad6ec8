#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck on the kernels whose sources changed since 735217d (fused_bsb, fused_csr, and the hybrid which shares attention_tiles.cuh), binaries of the ab7636e tree.
set -u
X=/tmp/x; mkdir -p $X/new
tar -C $X/new -xJf .gpu/s/bin33.tar.xz
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
S="compute-sanitizer --error-exitcode 1 --require-cuda-init no --report-api-errors no"
run() { timeout 120 $S --tool $1 --kernel-name kns=$2 $X/new/$3 --include-ignored --test-threads=1 --exact $4 > /tmp/san.txt 2>&1
  echo "$1 $2 $3 $4 rc=$? $(grep -E 'SUMMARY' /tmp/san.txt | sed 's/=========//') $(grep -E '^test result' /tmp/san.txt | cut -c1-40)"; }
for t in memcheck racecheck; do
  run $t fused_csr attention-gpu_attention fused_csr_row_orders
  run $t fused_csr attention-gpu_attention head_dims_heads_and_tiny_graphs
  run $t fused_bsb attention-gpu_fused_tc dense_window
  run $t hybrid attention-gpu_hybrid tiny_graphs
  run $t hybrid attention-gpu_hybrid pipelined_hand_off
done
