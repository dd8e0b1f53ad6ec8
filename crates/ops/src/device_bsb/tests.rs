//! Tests of the BSB upload: the caller-edge map of each bit, and (GPU) the gathers of the extras.

use super::*;
use crate::edge_extras::DeviceBias;
use spattn_formats::Permutation;

/// Every set bit of every block, in block-and-bit order, maps to the caller's edge of its
/// (caller row, block column), with the rows in the graph's order and renumbered.
#[test]
fn edge_map_names_each_bit_s_caller_edge() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    for (n, avg) in [(1usize, 1u64), (37, 3), (300, 9)] {
        let mut edges = Vec::new();
        for r in 0..n as u32 {
            for _ in 0..next(2 * avg) {
                edges.push((r, next(n as u64) as u32));
            }
        }
        // A dense row spans several blocks.
        edges.extend((0..n as u32).map(|c| ((n / 2) as u32, c)));
        let a = Csr::from_edges(n, n, &edges).unwrap();
        for p in [None, Some(Permutation::by_degree_descending(&a))] {
            let bsb = match &p {
                Some(p) => Bsb::from_csr(&p.permute_csr_rows(&a).unwrap()).unwrap(),
                None => Bsb::from_csr(&a).unwrap(),
            };
            let ids = p.as_ref().map(Permutation::old_of_new);
            let (starts, map) = bsb_edge_map(&a, &bsb, ids).unwrap();
            assert_eq!((starts.len(), map.len()), (bsb.n_blocks() + 1, a.nnz()));
            assert_eq!(starts[bsb.n_blocks()] as usize, a.nnz());
            let mut k = 0usize;
            for w in 0..bsb.n_windows() {
                for b in bsb.window_blocks(w) {
                    assert_eq!(starts[b] as usize, k);
                    let bits = bsb.bitmaps()[b];
                    for bit in (0..128).filter(|&i| bits >> i & 1 == 1) {
                        let (r, c) = (bit / 8, bit % 8);
                        let row = w * 16 + r;
                        let caller = ids.map_or(row, |x| x[row] as usize);
                        let e = map[k] as usize;
                        let o = a.row_offsets();
                        assert!((o[caller] as usize..o[caller + 1] as usize).contains(&e));
                        assert_eq!(a.col_indices()[e], bsb.block_columns()[b * 8 + c]);
                        k += 1;
                    }
                }
            }
            assert_eq!(k, a.nnz());
        }
    }
    // Another graph is refused, naming the sizes.
    let a = Csr::from_edges(3, 3, &[(0, 1), (2, 2)]).unwrap();
    let b = Bsb::from_csr(&Csr::from_edges(3, 3, &[(0, 1)]).unwrap()).unwrap();
    let e = bsb_edge_map(&a, &b, None).unwrap_err();
    assert!(e.to_string().contains("1 edges"), "{e}");
}

/// The gathers write, per kernel edge p and head h, the bias of caller edge ids[p] times
/// log2 e (one row when shared), and per block and head the keep bits of the CPU's dropout
/// mask at the block's bits (each bit's edge is the block's start plus its rank), nothing
/// where a bit is clear.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_gather_matches_the_caller_order_bias_and_the_cpu_mask() {
    use crate::dropout::Dropout;
    let gpu = Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)");
    // Blocks of every fill, empty and full ones included (4 words each).
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let n_blocks = 300usize;
    let mut words = Vec::with_capacity(4 * n_blocks);
    for b in 0..n_blocks {
        for _ in 0..4 {
            words.push(match b % 5 {
                0 => 0,
                1 => u32::MAX,
                2 => next() as u32 & next() as u32 & next() as u32,
                _ => next() as u32,
            });
        }
    }
    let mut starts = Vec::with_capacity(n_blocks + 1);
    let mut nnz = 0usize;
    for b in 0..n_blocks {
        starts.push(nnz as u32);
        nnz += words[4 * b..4 * b + 4]
            .iter()
            .map(|w| w.count_ones() as usize)
            .sum::<usize>();
    }
    // The edge count after the last block, where the tile loop's last span ends.
    starts.push(nnz as u32);
    // A permutation of the edges (7919 is prime to nnz unless nnz is its multiple), as a
    // kernel's edge order is.
    assert_ne!(nnz % 7919, 0);
    let ids: Vec<u32> = (0..nnz as u64)
        .map(|p| (p * 7919 % nnz as u64) as u32)
        .collect();
    let d_words = DeviceVec::from_host(&gpu, &words).unwrap();
    let d_starts = DeviceVec::from_host(&gpu, &starts).unwrap();
    let d_ids = DeviceVec::from_host(&gpu, &ids).unwrap();
    let mut stage = BsbExtrasStage::default();
    for heads in [1usize, 3, 8, 11] {
        let per_head: Vec<f32> = (0..nnz * heads).map(|i| (i as f32 * 0.37).sin()).collect();
        let shared: Vec<f32> = per_head[..nnz].to_vec();
        let dropout = Dropout::new(0.3, 11, 5).unwrap();
        let (d_per_head, d_shared) = (
            DeviceVec::from_host(&gpu, &per_head).unwrap(),
            DeviceVec::from_host(&gpu, &shared).unwrap(),
        );
        for (bias, host, rows) in [
            (DeviceBias::PerHead(&d_per_head), &per_head, heads),
            (DeviceBias::Shared(&d_shared), &shared, 1),
        ] {
            let extras = CsrExtras {
                bias: Some(bias),
                edge_features: None,
                dropout: Some(dropout),
            };
            let blocks = BsbBlocks {
                bitmaps: &d_words,
                block_edge_start: &d_starts,
                n_blocks,
            };
            let g = stage.gather(&gpu, &d_ids, blocks, heads, &extras).unwrap();
            assert_eq!((g.bias_rows as usize, g.n_edges as usize), (rows, nnz));
            assert_eq!(g.takes(), (true, true));
            let got = g.bias.unwrap().to_host().unwrap();
            for h in 0..rows {
                for (p, &x) in ids.iter().enumerate() {
                    let want = host[x as usize * rows + h] * std::f32::consts::LOG2_E;
                    assert_eq!(got[h * nnz + p], want, "bias of edge {p}, head {h}");
                }
            }
            let keep = g.keep.unwrap().to_host().unwrap();
            for h in 0..heads {
                for b in 0..n_blocks {
                    let mut rank = 0usize;
                    for w in 0..4 {
                        let got_word = keep[(h * n_blocks + b) * 4 + w];
                        for bit in 0..32 {
                            let got_bit = got_word >> bit & 1 == 1;
                            if words[4 * b + w] >> bit & 1 == 0 {
                                assert!(!got_bit, "block {b} word {w} bit {bit} is clear");
                                continue;
                            }
                            let x = ids[starts[b] as usize + rank];
                            rank += 1;
                            let want = dropout.keeps(u64::from(x), h as u64, heads as u64);
                            assert_eq!(
                                got_bit, want,
                                "keep bit of block {b} word {w} bit {bit}, head {h}"
                            );
                        }
                    }
                }
            }
        }
    }
    // Bad blocks: fewer bitmaps than blocks.
    let extras = CsrExtras::<f32> {
        bias: None,
        edge_features: None,
        dropout: Some(Dropout::new(0.3, 11, 5).unwrap()),
    };
    let blocks = BsbBlocks {
        bitmaps: &d_words,
        block_edge_start: &d_starts,
        n_blocks: n_blocks + 1,
    };
    assert!(stage.gather(&gpu, &d_ids, blocks, 2, &extras).is_err());
    // And starts without the edge count after the last block.
    let short = DeviceVec::from_host(&gpu, &starts[..n_blocks]).unwrap();
    let blocks = BsbBlocks {
        bitmaps: &d_words,
        block_edge_start: &short,
        n_blocks,
    };
    match stage.gather(&gpu, &d_ids, blocks, 2, &extras) {
        Err(e) => assert!(e.to_string().contains("edge count"), "{e}"),
        Ok(_) => panic!("{n_blocks} starts for {n_blocks} blocks were taken"),
    }
}

/// An upload reads back as the BSB it was made from.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_upload_reads_back_as_the_host_bsb() {
    let gpu = Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)");
    let a = Csr::from_edges(18, 10, &[(0, 2), (0, 9), (1, 9), (17, 0)]).unwrap();
    let bsb = Bsb::from_csr(&a).unwrap();
    let d = DeviceBsb::upload(&gpu, &bsb).unwrap();
    assert_eq!((d.fill_stats().windows, d.n_blocks()), (2, 2));
    assert_eq!(d.to_host().unwrap(), bsb);
}

/// The layout constants the host mirrors are the kernels' (`#define`s of attention_tiles.cuh):
/// shared-memory sizes computed from a stale copy would let a kernel write past its CTA's share.
#[test]
fn host_mirrors_of_the_tile_constants_match_the_kernels() {
    let cuh = include_str!("../../../kernels-sys/cuda/attention_tiles.cuh");
    let defined = |name: &str| -> usize {
        let line = cuh
            .lines()
            .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
            .unwrap_or_else(|| panic!("attention_tiles.cuh defines no {name}"));
        let value = line.split_whitespace().nth(2).unwrap_or_default();
        value
            .trim_end_matches('u')
            .parse()
            .unwrap_or_else(|e| panic!("{name} = {value}: {e}"))
    };
    for (name, host) in [
        ("BSB_WINDOW_ROWS", BSB_WINDOW_ROWS),
        ("BSB_MERGE_FLOATS", BSB_MERGE_FLOATS),
        ("BSB_PIPE_STAGES", BSB_PIPE_STAGES),
        ("BSB_FEAT_FLOATS", BSB_FEAT_FLOATS),
    ] {
        assert_eq!(defined(name), host, "{name}");
    }
}
