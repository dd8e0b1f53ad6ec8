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

use std::time::Instant;

use spattn_formats::{read_matrix_market, rmat, Bsb, MeBcrs, Reorder, RmatConfig, RowOrder};

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
    println!("| graph | nnz | build + sym | transpose | Auto order (16 rows) | BSB | ME-BCRS | order chosen | K/V gathers (graph's order) |");
    println!("|--:|--:|--:|--:|--:|--:|--:|---|--:|");
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
        println!(
            "| {scale} | {} | {} | {} | {} | {} | {} | {:?} | {} ({}) |",
            a.nnz(),
            per(t_gen),
            per(t_tr),
            per(t_order),
            per(t_bsb),
            per(t_me),
            order.used,
            order.gathers,
            order.gathers_natural
        );
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
