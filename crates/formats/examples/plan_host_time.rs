//! The host side of building a GPU plan, timed per step on R-MAT graphs of growing scale, to
//! see how plan time grows with the edges: R-MAT generation + symmetrize, the transpose (every
//! backward), the row order `Auto` chooses for 16-row windows (degree, locality, window packing
//! within its work bound) with the BSB built in it (fused-tc, hybrid), and ME-BCRS (the
//! tensor-core ops). Uploads and the GPU autotuning are not included (they need a GPU).
//!
//!     cargo run --release -p spattn-formats --example plan_host_time -- 16 18 20
//!     cargo run --release -p spattn-formats --example plan_host_time -- data/ogbn-arxiv.mtx.gz
//!
//! Prints one row per scale: milliseconds per step and nanoseconds per edge (flat = linear).
//! The locality order (reverse Cuthill–McKee after peeling the hubs, the part of `Auto`'s order
//! that grows fastest) is timed alone too, with a hash of its permutation to compare builds.

use std::time::Instant;

use spattn_formats::reorder::HUB_FACTOR;
use spattn_formats::{
    read_matrix_market, rmat, Bsb, MeBcrs, Permutation, Reorder, RmatConfig, RowOrder,
};

/// FNV-1a of a permutation: equal hashes, equal orders (for comparing two builds' outputs).
fn fnv(p: &Permutation) -> u64 {
    p.old_of_new().iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t = Instant::now();
    let out = f();
    (out, t.elapsed().as_secs_f64() * 1e3)
}

fn main() -> Result<(), spattn_formats::Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut graphs: Vec<String> = args.clone();
    if graphs.is_empty() {
        graphs = vec!["14".into(), "16".into(), "18".into()];
    }
    println!(
        "# host plan steps, {} rayon threads; ms (ns per edge)",
        rayon_threads()
    );
    println!("| graph | nnz | build + sym | transpose | Auto order (16 rows) | BSB | ME-BCRS | order chosen | K/V gathers (graph's order) | locality order | its hash |");
    println!("|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|---|");
    for scale in graphs {
        // An R-MAT scale, or a MatrixMarket file (symmetrized, with self loops, as the bench).
        let (a, t_gen) = timed(|| match scale.parse::<u32>() {
            Ok(s) => rmat(
                &RmatConfig::new(s)
                    .with_symmetrize(true)
                    .with_self_loops(true)
                    .with_seed(42),
            ),
            Err(_) => read_matrix_market(&scale).and_then(|g| g.symmetrize_with_self_loops()),
        });
        let a = a?;
        let nnz = a.nnz() as f64;
        let per = |ms: f64| format!("{ms:.0} ({:.0})", ms * 1e6 / nnz);
        let (_t, t_tr) = timed(|| a.transpose_with_map());
        let (order, t_order) = timed(|| RowOrder::choose(&a, Reorder::Auto, 16));
        let order = order?;
        let (bsb, t_bsb) = timed(|| match &order.permutation {
            Some(p) => p.permute_csr_rows(&a).and_then(|b| Bsb::from_csr(&b)),
            None => Bsb::from_csr(&a),
        });
        bsb?;
        let (me, t_me) = timed(|| MeBcrs::from_csr(&a, 8));
        me?;
        let (rcm, t_rcm) =
            timed(|| Permutation::reverse_cuthill_mckee_peeling_hubs(&a, HUB_FACTOR));
        let rcm = rcm?;
        println!(
            "| {scale} | {} | {} | {} | {} | {} | {} | {:?} | {} ({}) | {} | {:016x} |",
            a.nnz(),
            per(t_gen),
            per(t_tr),
            per(t_order),
            per(t_bsb),
            per(t_me),
            order.used,
            order.gathers,
            order.gathers_natural,
            per(t_rcm),
            fnv(&rcm)
        );
    }
    Ok(())
}

fn rayon_threads() -> usize {
    rayon::current_num_threads()
}
