//! The claim of `examples/train_gat.rs`, checked on the CPU at a small size: on a seeded
//! stochastic block model with noisy features, the 2-layer GAT beats the MLP (same features,
//! no graph) by a clear margin, and its training loss falls.

#[allow(dead_code)]
#[path = "../examples/train_gat.rs"]
mod train_gat;

use train_gat::{sbm, train_host, Model};

#[test]
fn gat_beats_the_mlp_on_a_stochastic_block_model() {
    let task = sbm(7, 600, 4, 0.03, 0.002, 16, 3.0, 0.4).unwrap();
    let gat = train_host(&task, Model::Gat, 60, 0.01, false).unwrap();
    let mlp = train_host(&task, Model::Mlp, 60, 0.01, false).unwrap();
    assert!(
        gat.losses.last().unwrap() < &(0.5 * gat.losses[0]),
        "{:?}",
        gat.losses
    );
    assert!(
        gat.accuracy >= mlp.accuracy + 0.15,
        "GAT {:.3} vs MLP {:.3}",
        gat.accuracy,
        mlp.accuracy
    );
    assert!(gat.accuracy >= 0.8, "GAT accuracy {:.3}", gat.accuracy);
}
