#!/usr/bin/env bash
# Device call 64 (main at 899fdc1): fused-csr tests after the host-only review mend, and
# racecheck + memcheck of the CSR ops, backward-shared and ME-BCRS slot kernels changed since 6ce96f8.
set -u
X=/tmp/x; mkdir -p $X/new
tar -C $X/new -xJf .gpu/s/bin31.tar.xz
cd .gpu/h
export SPATTN_DATA_DIR=$PWD/data
L=$OUT/log.txt
timeout 150 $X/new/gpu_attention --include-ignored --test-threads=2 --exact fused_csr_row_orders head_dims_heads_and_tiny_graphs hub_row_and_extreme_scores autotune_runs_the_fastest_candidate > /tmp/a.txt 2>&1
echo "gpu_attention (4 tests) rc=$? $(grep -E '^test result' /tmp/a.txt)" | tee -a $L
timeout 150 $X/new/gpu_csr_ops --include-ignored --test-threads=2 --skip shape_errors > /tmp/c.txt 2>&1
echo "gpu_csr_ops rc=$? $(grep -E '^test result' /tmp/c.txt)" | tee -a $L
CS="compute-sanitizer --error-exitcode 1 --require-cuda-init no --report-api-errors no"
run() { timeout $5 $CS --tool $1 --kernel-name kns=$2 $X/new/$3 --include-ignored --test-threads=1 --exact $4 > /tmp/s.txt 2>&1
  echo "$1 kns=$2 $3 $4 rc=$? | $(grep -E 'SUMMARY' /tmp/s.txt | tail -1) | $(grep -E '^test result' /tmp/s.txt)" | tee -a $L; }
run racecheck csr gpu_csr_ops tiny_graphs_and_empty_rows 120
run racecheck csr gpu_csr_ops hub_row_of_100k_edges 150
run memcheck csr gpu_csr_ops tiny_graphs_and_empty_rows 90
run memcheck csr gpu_csr_ops unfused_attention_matches_reference 120
run racecheck mebcrs gpu_tc_ops layout_conversions_round_trip 90
run memcheck mebcrs gpu_tc_ops layout_conversions_round_trip 90
run memcheck fused_csr gpu_attention fused_csr_row_orders 90
echo "== summary"; cat $L
