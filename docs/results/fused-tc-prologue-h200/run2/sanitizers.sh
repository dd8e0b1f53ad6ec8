#!/usr/bin/env bash
# compute-sanitizer on the fused_bsb kernels (prologue records).
set -u
X=/tmp/x; mkdir -p $X/new
tar -C $X/new -xJf .gpu/s/bin33.tar.xz
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
S="compute-sanitizer --error-exitcode 1 --require-cuda-init no --report-api-errors no"
for spec in "memcheck tiny_graphs" "memcheck hub_row" "memcheck split_window_wide_heads" "racecheck tiny_graphs" "racecheck hub_row" "synccheck tiny_graphs"; do set -- $spec
  timeout 150 $S --tool $1 --kernel-name kns=fused_bsb $X/new/attention-gpu_fused_tc --include-ignored --test-threads=1 --exact $2 > /tmp/san.txt 2>&1
  echo "$1 $2 rc=$? $(grep SUMMARY /tmp/san.txt) $(grep -E '^test result' /tmp/san.txt)"
done
