//! `spattn-bench --gpus`: a lower bound of the device memory each rank of a partition needs,
//! counted on the host from the graph and the partition alone (no plan, no GPU), so that a
//! rank count whose partition cannot fit its GPUs is recorded as not fitting without being
//! planned (R-MAT 26's one-GPU plan took two minutes to run out of memory).
//!
//! # What the bound counts
//!
//! Only buffers a rank of `--gpus` certainly holds at once, when its probe forward runs (the
//! local plan built, its inputs uploaded, the forward's buffers allocated; `scaling.rs`,
//! `rank_run` and `probe_forward`), at `row_bytes = heads × head_dim × dtype size` per row:
//!
//! - its Q and output rows: `2 × rows × row_bytes`;
//! - its own K and V rows (the K/V block it owns and serves): `2 × kv_rows × row_bytes`;
//! - the K and V halo, every K/V row its edges touch, its own included (the exact count, as
//!   `RankPlan` finds it): `2 × halo_rows × row_bytes`;
//! - the K and V rows it packs for the other ranks (each of its K/V rows once per other rank
//!   whose halo holds it, the exact count; both packed before they are sent together):
//!   `2 × sent_rows × row_bytes`;
//! - the u32 row index the probe allocates for the halo and the packed rows:
//!   `4 × (halo_rows + sent_rows)`;
//! - the local graph on the device, in the format of the algorithm asked for
//!   ([`graph_floor`]): `unfused-csr` its CSR (offsets, columns, row indices) and f32 scores per
//!   edge and head; `fused-csr` its column indices; `unfused-tc` ME-BCRS's edge-to-slot map and
//!   f32 scores per edge and head (a slot per edge at least); `fused-tc` 6 bytes per column
//!   slot of its 16-row BSB windows (a u32 column, and a 16-byte bitmap per 8 slots);
//!   `auto` and `hybrid` 4 bytes per such slot (every format above holds at least that, and
//!   `auto` may pick any of them). The slots are counted from below: every column the rank
//!   touches is in at least one window, and a window's column serves at most 16 of its edges,
//!   so at least `max(halo_rows, ceil(edges / 16))`.
//!
//! Left out, because their size depends on the plan or the driver: the plans' schedules, row
//! orders, workspaces and padding, the BSB's window offsets, the fused kernels' partials, the
//! rows' gather indices built by the first timed forward, NCCL's buffers, the CUDA context and
//! the pool's fragmentation. The bound is therefore below what a rank needs: a scale it rules
//! out certainly does not fit, and one it lets through may still run out of memory.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use spattn::partition::Partition;
use spattn::{Algorithm, Csr};
use spattn_formats::alloc::describe_bytes;

use crate::error::{Error, Result};
use crate::table::thousands;

/// What one rank of a partition holds, counted on the host without planning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankCounts {
    /// Its rows (of Q and the output).
    pub rows: usize,
    /// Its own K/V rows (the block it owns).
    pub kv_rows: usize,
    /// Its rows' edges.
    pub edges: usize,
    /// K/V rows its edges touch, its own included (its halo).
    pub halo_rows: usize,
    /// Its own K/V rows in other ranks' halos, counted once per such rank (the rows it packs
    /// for them per forward).
    pub sent_rows: usize,
}

/// The lower bound of one rank's device bytes, by part (module docs say what each counts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceFloor {
    /// Its Q and output rows.
    pub q_out: u64,
    /// Its own K and V rows.
    pub kv_own: u64,
    /// The K and V halo.
    pub kv_halo: u64,
    /// The K and V rows packed for the other ranks.
    pub packed: u64,
    /// The u32 index of the halo and packed rows.
    pub indices: u64,
    /// The local graph on the device ([`graph_floor`]).
    pub graph: u64,
}

impl DeviceFloor {
    /// The floor of a rank holding `c`, at `row_bytes` per Q/K/V row, `heads` heads, with the
    /// local plan's `algorithm`. Saturates at `u64::MAX`, which stays a lower bound.
    pub fn of(c: &RankCounts, row_bytes: u64, heads: usize, algorithm: Algorithm) -> Self {
        let rows = |n: usize| (n as u64).saturating_mul(row_bytes);
        DeviceFloor {
            q_out: rows(c.rows).saturating_mul(2),
            kv_own: rows(c.kv_rows).saturating_mul(2),
            kv_halo: rows(c.halo_rows).saturating_mul(2),
            packed: rows(c.sent_rows).saturating_mul(2),
            indices: (c.halo_rows as u64)
                .saturating_add(c.sent_rows as u64)
                .saturating_mul(4),
            graph: graph_floor(algorithm, c, heads),
        }
    }

    /// The whole floor, bytes.
    pub fn total(&self) -> u64 {
        [
            self.q_out,
            self.kv_own,
            self.kv_halo,
            self.packed,
            self.indices,
            self.graph,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }
}

/// The least device bytes the local graph of a rank holding `c` takes in the format of
/// `algorithm`, with `heads` heads (module docs: what each format surely holds).
pub fn graph_floor(algorithm: Algorithm, c: &RankCounts, heads: usize) -> u64 {
    let edges = c.edges as u64;
    let per_edge = |bytes: u64| edges.saturating_mul(bytes);
    // f32 scores per edge and head, where the algorithm keeps them in device memory.
    let scores = per_edge(4).saturating_mul(heads as u64);
    // Column slots of 16-row windows: each touched column in one window at least, and one
    // window's column covers at most 16 edges.
    let slots = (c.halo_rows as u64).max(edges.div_ceil(16));
    match algorithm {
        // Row offsets, column indices and row indices, and the scores.
        Algorithm::UnfusedCsr => ((c.rows as u64).saturating_add(1))
            .saturating_mul(4)
            .saturating_add(per_edge(8))
            .saturating_add(scores),
        // The work units' column indices.
        Algorithm::FusedCsr => per_edge(4),
        // ME-BCRS's edge-to-slot map, and the scores (a slot per edge at least).
        Algorithm::UnfusedTensorCore => per_edge(4).saturating_add(scores),
        // BSB: a u32 column per slot and a 16-byte bitmap per block of 8 slots.
        Algorithm::FusedTensorCore => slots.saturating_mul(6),
        // Hybrid's tile columns plus its CUDA-core edges' columns cover every window column;
        // auto picks one of the formats above, all at least this.
        Algorithm::Auto | Algorithm::Hybrid => slots.saturating_mul(4),
    }
}

/// Per rank of `part`, what it holds of `a` ([`RankCounts`]): the exact halo and sent rows
/// `RankPlan::new` would find, from one bitmap of `a`'s columns reused rank by rank (one pass
/// over the edges in all, in parallel, and `ranks × n_cols / 64` words).
///
/// # Errors
/// A partition that does not cover `a`; the host out of memory for the bitmap.
pub fn rank_counts(a: &Csr, part: &Partition) -> Result<Vec<RankCounts>> {
    if part.rows.len() != a.n_rows() || part.kv.len() != a.n_cols() {
        return Err(Error::new(format!(
            "partition covers {} rows and {} K/V rows, the graph has {} and {}",
            part.rows.len(),
            part.kv.len(),
            a.n_rows(),
            a.n_cols()
        )));
    }
    let ranks = part.parts();
    let rows: Vec<Range<usize>> = (0..ranks)
        .map(|r| part.rows.block(r))
        .collect::<Result<_, _>>()?;
    let kv: Vec<Range<usize>> = (0..ranks)
        .map(|r| part.kv.block(r))
        .collect::<Result<_, _>>()?;
    let offsets = a.row_offsets();
    let mut sent = vec![0usize; ranks];
    let mut counts = Vec::with_capacity(ranks);
    for (d, block) in rows.iter().enumerate() {
        let marks = a.row_block_columns(block.clone())?;
        for (r, own) in kv.iter().enumerate() {
            if r != d {
                sent[r] += ones_in(&marks, own.clone());
            }
        }
        counts.push(RankCounts {
            rows: block.len(),
            kv_rows: kv[d].len(),
            edges: (offsets[block.end] - offsets[block.start]) as usize,
            halo_rows: ones_in(&marks, 0..a.n_cols()),
            sent_rows: 0,
        });
    }
    for (c, s) in counts.iter_mut().zip(sent) {
        c.sent_rows = s;
    }
    Ok(counts)
}

/// Set bits of `marks` at positions `range` (past the bitmap: none).
fn ones_in(marks: &[u64], range: Range<usize>) -> usize {
    if range.is_empty() {
        return 0;
    }
    let (first, last) = (range.start / 64, (range.end - 1) / 64);
    (first..=last)
        .filter_map(|w| marks.get(w).map(|&m| (w, m)))
        .map(|(w, mut word)| {
            if w == first {
                word &= !0u64 << (range.start % 64);
            }
            if w == last {
                // Keep bits up to (range.end - 1) % 64 inclusive.
                word &= !0u64 >> (63 - (range.end - 1) % 64);
            }
            word.count_ones() as usize
        })
        .sum()
}

/// A rank whose device floor exceeds its GPU's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// The rank (its GPU ordinal is the same).
    pub rank: usize,
    /// Its floor.
    pub floor: DeviceFloor,
    /// Its GPU's total memory, bytes.
    pub device_bytes: u64,
}

impl Shortfall {
    /// One line: the rank, the bytes it needs at least (by part) and its GPU's.
    pub fn message(&self) -> String {
        let f = &self.floor;
        format!(
            "rank {} needs at least {} bytes{} for Q and output {}, own K/V {}, K/V halo {}, \
             packed for other ranks {}, row indices {}, local graph {}; its GPU has {} \
             bytes{}: not planned",
            self.rank,
            thousands(f.total()),
            in_units(f.total()),
            thousands(f.q_out),
            thousands(f.kv_own),
            thousands(f.kv_halo),
            thousands(f.packed),
            thousands(f.indices),
            thousands(f.graph),
            thousands(self.device_bytes),
            in_units(self.device_bytes)
        )
    }
}

/// ` (x.y GiB)` or ` (x.y MiB)` as [`describe_bytes`] gives it; empty below a MiB.
fn in_units(bytes: u64) -> String {
    let d = describe_bytes(bytes);
    d.find(" (")
        .map_or_else(String::new, |at| d[at..].to_string())
}

/// The lowest rank whose floor exceeds its GPU's total memory (`device_bytes[rank]`); none
/// where every rank's fits.
///
/// # Errors
/// Fewer GPU capacities than ranks.
pub fn first_shortfall(floors: &[DeviceFloor], device_bytes: &[u64]) -> Result<Option<Shortfall>> {
    if device_bytes.len() < floors.len() {
        return Err(Error::new(format!(
            "{} ranks but the memory of {} GPU(s)",
            floors.len(),
            device_bytes.len()
        )));
    }
    Ok(floors
        .iter()
        .zip(device_bytes)
        .enumerate()
        .find(|(_, (f, &have))| f.total() > have)
        .map(|(rank, (&floor, &device_bytes))| Shortfall {
            rank,
            floor,
            device_bytes,
        }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use spattn::partition::{run_local, Blocks, RankPlan};

    /// 6 nodes; rows 0-1 on rank 0, rows 2-5 on rank 1 (Q and K/V blocks alike).
    fn small() -> (Csr, Partition) {
        let edges = [
            (0, 0),
            (0, 3),
            (0, 5),
            (1, 1),
            (1, 3),
            (2, 0),
            (2, 2),
            (3, 3),
            (4, 4),
            (4, 5),
            (5, 5),
        ];
        let a = Csr::from_edges(6, 6, &edges).expect("a valid graph");
        let blocks = Blocks::from_bounds(vec![0, 2, 6]).expect("valid bounds");
        let part = Partition {
            rows: blocks.clone(),
            kv: blocks,
        };
        (a, part)
    }

    #[test]
    fn the_counts_of_a_small_partition_by_hand() {
        let (a, part) = small();
        let counts = rank_counts(&a, &part).expect("counts");
        // Rank 0: rows 0-1, 5 edges touching columns {0, 1, 3, 5}; rank 1: rows 2-5, 6
        // edges touching {0, 2, 3, 4, 5}. Rank 0 sends column 0 to rank 1 (1 row); rank 1
        // sends columns 3 and 5 to rank 0 (2 rows).
        assert_eq!(
            counts,
            [
                RankCounts {
                    rows: 2,
                    kv_rows: 2,
                    edges: 5,
                    halo_rows: 4,
                    sent_rows: 1
                },
                RankCounts {
                    rows: 4,
                    kv_rows: 4,
                    edges: 6,
                    halo_rows: 5,
                    sent_rows: 2
                },
            ]
        );
    }

    #[test]
    fn the_floor_of_a_small_partition_in_exact_bytes() {
        let (a, part) = small();
        let counts = rank_counts(&a, &part).expect("counts");
        // One head of 128 f16 features: 256 bytes a row.
        let f = DeviceFloor::of(&counts[1], 256, 1, Algorithm::Auto);
        assert_eq!(
            f,
            DeviceFloor {
                q_out: 2 * 4 * 256,
                kv_own: 2 * 4 * 256,
                kv_halo: 2 * 5 * 256,
                // Its 2 sent rows, of K and of V.
                packed: 2 * 2 * 256,
                indices: 4 * (5 + 2),
                // max(5 halo rows, ceil(6 / 16)) slots, 4 bytes each.
                graph: 4 * 5,
            }
        );
        assert_eq!(f.total(), 2048 + 2048 + 2560 + 1024 + 28 + 20);
        assert_eq!(f.total(), 7728);
        // Rank 0 at P = 1 sizes: one rank holds everything, sends nothing.
        let whole = Partition::balanced(&a, 1).expect("one rank");
        let one = rank_counts(&a, &whole).expect("counts")[0];
        assert_eq!((one.rows, one.kv_rows, one.edges), (6, 6, 11));
        assert_eq!((one.halo_rows, one.sent_rows), (6, 0));
        let f = DeviceFloor::of(&one, 256, 1, Algorithm::Auto);
        assert_eq!(f.total(), 6 * 6 * 256 + 4 * 6 + 4 * 6);
        assert_eq!(f.total(), 9264);
    }

    #[test]
    fn the_graph_floor_follows_the_algorithm() {
        let c = RankCounts {
            rows: 10,
            kv_rows: 10,
            edges: 100,
            halo_rows: 3,
            sent_rows: 0,
        };
        // ceil(100 / 16) = 7 slots beat the 3 halo rows.
        assert_eq!(graph_floor(Algorithm::Auto, &c, 2), 7 * 4);
        assert_eq!(graph_floor(Algorithm::Hybrid, &c, 2), 7 * 4);
        assert_eq!(graph_floor(Algorithm::FusedTensorCore, &c, 2), 7 * 6);
        assert_eq!(graph_floor(Algorithm::FusedCsr, &c, 2), 400);
        assert_eq!(graph_floor(Algorithm::UnfusedTensorCore, &c, 2), 400 + 800);
        assert_eq!(graph_floor(Algorithm::UnfusedCsr, &c, 2), 44 + 800 + 800);
        // Every format holds at least auto's floor.
        for alg in Algorithm::ALL {
            assert!(graph_floor(alg, &c, 1) >= graph_floor(Algorithm::Auto, &c, 1));
        }
        // Sizes past 64 bits saturate instead of wrapping.
        let huge = RankCounts {
            rows: usize::MAX,
            kv_rows: usize::MAX,
            edges: usize::MAX,
            halo_rows: usize::MAX,
            sent_rows: usize::MAX,
        };
        let f = DeviceFloor::of(&huge, u64::MAX, usize::MAX, Algorithm::UnfusedCsr);
        assert_eq!(f.total(), u64::MAX);
    }

    #[test]
    fn the_counts_are_what_the_rank_plans_find() {
        let a = spattn_formats::rmat(&spattn_formats::RmatConfig::benchmark(9).with_seed(3))
            .expect("R-MAT 9");
        for ranks in [1, 2, 3, 5] {
            let part = Partition::balanced(&a, ranks).expect("partition");
            let counts = rank_counts(&a, &part).expect("counts");
            let stats = run_local(ranks, |ex| -> spattn::Result<_> {
                Ok(RankPlan::new(&a, &part, ex)?.stats())
            })
            .expect("rank plans");
            for (r, (c, s)) in counts.iter().zip(&stats).enumerate() {
                let got = (c.rows, c.edges, c.halo_rows, c.sent_rows);
                let want = (s.rows, s.edges, s.halo_rows, s.sent_rows);
                assert_eq!(got, want, "rank {r} of {ranks}");
                assert_eq!(c.kv_rows, part.kv.block(r).expect("block").len());
            }
        }
    }

    #[test]
    fn a_partition_of_another_graph_is_refused() {
        let (a, _) = small();
        let part = Partition::balanced(&Csr::from_edges(3, 3, &[(0, 1)]).expect("csr"), 2)
            .expect("partition");
        let e = rank_counts(&a, &part).unwrap_err();
        assert!(e.message().contains("the graph has 6 and 6"), "{e}");
    }

    #[test]
    fn bits_are_counted_in_any_range() {
        let marks = [u64::MAX, 0b1011, 1 << 63];
        assert_eq!(ones_in(&marks, 0..192), 64 + 3 + 1);
        assert_eq!(ones_in(&marks, 0..64), 64);
        assert_eq!(ones_in(&marks, 63..66), 1 + 2);
        assert_eq!(ones_in(&marks, 65..66), 1);
        assert_eq!(ones_in(&marks, 66..191), 1);
        assert_eq!(ones_in(&marks, 191..192), 1);
        assert_eq!(ones_in(&marks, 5..5), 0);
        // Past the bitmap: nothing, no panic.
        assert_eq!(ones_in(&marks, 150..1000), 1);
    }

    #[test]
    fn the_lowest_rank_over_its_gpu_is_named() {
        let floor = |bytes: u64| DeviceFloor {
            q_out: bytes,
            ..DeviceFloor::default()
        };
        let floors = [floor(10), floor(30), floor(50)];
        // Equal to the GPU's memory still fits; over it does not.
        assert_eq!(first_shortfall(&floors, &[10, 30, 50]), Ok(None));
        let s = first_shortfall(&floors, &[100, 29, 40])
            .expect("enough GPUs")
            .expect("rank 1 does not fit");
        assert_eq!((s.rank, s.floor.total(), s.device_bytes), (1, 30, 29));
        assert!(first_shortfall(&floors, &[100, 100]).is_err());
        let s = Shortfall {
            rank: 0,
            floor: DeviceFloor {
                q_out: 34_359_738_368,
                kv_own: 34_359_738_368,
                kv_halo: 34_359_738_368,
                packed: 0,
                indices: 268_435_456,
                graph: 536_870_912,
            },
            device_bytes: 85_031_714_816,
        };
        assert_eq!(
            s.message(),
            "rank 0 needs at least 103,884,521,472 bytes (96.8 GiB) for Q and output \
             34,359,738,368, own K/V 34,359,738,368, K/V halo 34,359,738,368, packed for other \
             ranks 0, row indices 268,435,456, local graph 536,870,912; its GPU has \
             85,031,714,816 bytes (79.2 GiB): not planned"
        );
        // Small sizes have no unit.
        let small = Shortfall {
            rank: 2,
            floor: floor(1000),
            device_bytes: 999,
        };
        assert_eq!(
            small.message(),
            "rank 2 needs at least 1,000 bytes for Q and output 1,000, own K/V 0, K/V halo 0, \
             packed for other ranks 0, row indices 0, local graph 0; its GPU has 999 bytes: \
             not planned"
        );
    }
}
