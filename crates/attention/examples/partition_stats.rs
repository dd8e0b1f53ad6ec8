//! What a row-partitioned plan moves: for R-MAT graphs (or a MatrixMarket file) split over P
//! ranks, each rank's rows, edges, halo and the K/V rows it receives, and the bytes a forward
//! exchanges at a given row width, against the bytes of the rank's own Q, K, V and output. No
//! attention is computed (the ranks are threads of a `LocalExchange`, planning only).
//!
//!     cargo run --release -p spattn --example partition_stats -- 20 2,4,8 [ROW_BYTES] [rcm|lp]
//!     cargo run --release -p spattn --example partition_stats -- data/ogbn-arxiv.mtx.gz 2,4,8
//!
//! The third argument is a row's bytes (default 256: 128 f16 features); `rcm` renumbers the
//! nodes by reverse Cuthill–McKee (hubs peeled) before splitting, as a caller would relabel its
//! nodes, to see what locality buys. Each rank's K/V row gathers (16-row windows, fused-tc's)
//! are counted in its rows' own order and in the order `Reorder::Auto` picks for its
//! rectangular local graph; the `P = 1` row is the whole graph's. `lp` instead moves nodes
//! between the P blocks by label propagation (each node, in turn, to the block holding most of
//! its neighbours while that block stays within 3% of an even share of the edges; up to 10
//! passes, stopping when fewer than 0.1% of the nodes move), then renumbers the nodes block by
//! block: how much a partition that cuts fewer edges would shrink the halo.

use std::borrow::Cow;

use spattn::formats::reorder::HUB_FACTOR;
use spattn::formats::{Permutation, Reorder, RowOrder};
use spattn::partition::{run_local, Blocks, Partition, RankPlan};
use spattn::{read_matrix_market, rmat, Csr, RmatConfig};

fn main() -> spattn::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let graph = args.first().map_or("18", String::as_str);
    let parts: Vec<usize> = args
        .get(1)
        .map_or("2,4,8", String::as_str)
        .split(',')
        .filter_map(|p| p.trim().parse().ok())
        .collect();
    let row_bytes: u64 = args.get(2).and_then(|b| b.parse().ok()).unwrap_or(256);
    let rcm = args.get(3).is_some_and(|a| a == "rcm");
    let lp = args.get(3).is_some_and(|a| a == "lp");
    let a = match graph.parse::<u32>() {
        Ok(scale) => rmat(
            &RmatConfig::new(scale)
                .with_symmetrize(true)
                .with_self_loops(true)
                .with_seed(42),
        )?,
        Err(_) => read_matrix_market(graph)?.symmetrize_with_self_loops()?,
    };
    let a = if rcm {
        let order = Permutation::reverse_cuthill_mckee_peeling_hubs(&a, HUB_FACTOR)?;
        order.permute_csr(&a)?
    } else {
        a
    };
    println!(
        "# {graph}{}: n {}, nnz {}; rows of {row_bytes} bytes; per forward, each rank receives \
         the remote halo of K and V",
        if rcm {
            " renumbered by RCM"
        } else if lp {
            " split by label propagation"
        } else {
            ""
        },
        a.n_rows(),
        a.nnz()
    );
    println!("| P | rank | rows | edges | halo rows | remote rows | received (MiB) | own Q+K+V+out (MiB) | received / own | gathers, own order | gathers, Auto order |");
    println!("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    for p in parts {
        let (a, part) = if lp {
            let (relabelled, part) = label_propagation(&a, p)?;
            (Cow::Owned(relabelled), part)
        } else {
            (Cow::Borrowed(&a), Partition::balanced(&a, p)?)
        };
        let a: &Csr = &a;
        let stats = run_local(p, |ex| {
            let rank = RankPlan::new(a, &part, ex)?;
            let order = RowOrder::choose(rank.local_graph(), Reorder::Auto, 16)?;
            Ok((rank.stats(), order))
        })?;
        let (mut worst, mut total, mut sums) = (0.0f64, 0u64, (0usize, 0usize));
        for (r, (s, order)) in stats.iter().enumerate() {
            let received = 2 * s.remote_rows as u64 * row_bytes; // K and V
            let own = 4 * s.rows as u64 * row_bytes; // Q, K, V, out (square graph)
            total += received;
            let ratio = received as f64 / own.max(1) as f64;
            worst = worst.max(ratio);
            sums = (sums.0 + order.gathers_natural, sums.1 + order.gathers);
            println!(
                "| {p} | {r} | {} | {} | {} | {} | {:.1} | {:.1} | {:.2} | {} | {} ({}, {:.0} ms) |",
                s.rows,
                s.edges,
                s.halo_rows,
                s.remote_rows,
                mib(received),
                mib(own),
                ratio,
                order.gathers_natural,
                order.gathers,
                order.used,
                order.choose_ms
            );
        }
        println!(
            "| {p} | all | {} | {} | | | {:.1} | {:.1} | worst {:.2} | {} | {} |",
            a.n_rows(),
            a.nnz(),
            mib(total),
            mib(4 * a.n_rows() as u64 * row_bytes),
            worst,
            sums.0,
            sums.1
        );
    }
    Ok(())
}

/// `a` split into `p` blocks by label propagation from [`Partition::balanced`]'s, its nodes
/// renumbered block by block (each block's in their order), with the partition of the blocks.
fn label_propagation(a: &Csr, p: usize) -> spattn::Result<(Csr, Partition)> {
    let n = a.n_rows();
    let start = Partition::balanced(a, p)?;
    let mut label = vec![0usize; n];
    for r in 0..p {
        for v in start.rows.block(r)? {
            label[v] = r;
        }
    }
    let degree = |v: usize| a.row(v).len() as u64;
    let cap = (a.nnz() as f64 / p as f64 * 1.03) as u64;
    let mut load = vec![0u64; p];
    for v in 0..n {
        load[label[v]] += degree(v);
    }
    let mut count = vec![0u64; p];
    for _ in 0..10 {
        let mut moved = 0;
        for v in 0..n {
            count.fill(0);
            for &u in a.row(v).iter().filter(|&&u| u as usize != v) {
                count[label[u as usize]] += 1;
            }
            let here = label[v];
            let best = (0..p).fold(here, |b, q| if count[q] > count[b] { q } else { b });
            if best != here && load[best] + degree(v) <= cap {
                load[best] += degree(v);
                load[here] -= degree(v);
                label[v] = best;
                moved += 1;
            }
        }
        if moved == 0 || moved * 1000 < n {
            break;
        }
    }
    let mut old_of_new: Vec<u32> = (0..n as u32).collect();
    old_of_new.sort_by_key(|&v| label[v as usize]);
    let mut bounds = vec![0usize; p + 1];
    for &l in &label {
        bounds[l + 1] += 1;
    }
    for r in 0..p {
        bounds[r + 1] += bounds[r];
    }
    let order = Permutation::from_old_of_new(old_of_new)?;
    let rows = Blocks::from_bounds(bounds)?;
    Ok((
        order.permute_csr(a)?,
        Partition {
            kv: rows.clone(),
            rows,
        },
    ))
}
