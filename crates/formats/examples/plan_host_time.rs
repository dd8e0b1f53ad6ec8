//! The host side of building a GPU plan, timed per step on R-MAT graphs of growing scale, to
//! see how plan time grows with the edges: R-MAT generation + symmetrize, the transpose (every
//! backward), the row order `Auto` chooses for 16-row windows (degree, locality, window packing
//! within its work bound) with the BSB built in it (fused-tc, hybrid), and ME-BCRS (the
//! tensor-core ops). Uploads and the GPU autotuning are not included (they need a GPU).
//!
//!     cargo run --release -p spattn-formats --example plan_host_time -- 16 18 20
//!
//! Prints one row per scale: milliseconds per step and nanoseconds per edge (flat = linear).

use std::time::Instant;

use spattn_formats::{rmat, Bsb, MeBcrs, Reorder, RmatConfig, RowOrder};

fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t = Instant::now();
    let out = f();
    (out, t.elapsed().as_secs_f64() * 1e3)
}

fn main() -> Result<(), spattn_formats::Error> {
    let scales: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let scales = if scales.is_empty() {
        vec![14, 16, 18]
    } else {
        scales
    };
    println!(
        "# host plan steps, {} rayon threads; ms (ns per edge)",
        rayon_threads()
    );
    println!("| scale | nnz | R-MAT + sym | transpose | Auto order (16 rows) | BSB | ME-BCRS | order chosen |");
    println!("|--:|--:|--:|--:|--:|--:|--:|---|");
    for scale in scales {
        let (a, t_gen) = timed(|| {
            rmat(
                &RmatConfig::new(scale)
                    .with_symmetrize(true)
                    .with_self_loops(true)
                    .with_seed(42),
            )
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
            "| {scale} | {} | {} | {} | {} | {} | {} | {:?} |",
            a.nnz(),
            per(t_gen),
            per(t_tr),
            per(t_order),
            per(t_bsb),
            per(t_me),
            order.used
        );
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
