//! The CPU layers' gradients (every parameter and the input) against central finite
//! differences of their f64 forward, on small random graphs with empty rows and a hub.
//!
//! The loss is `L = Σ r ⊙ y` for a fixed random `r`, so `dy = r`. Each checked coordinate is
//! perturbed by ±1e-6; the finite difference must match the analytic gradient to
//! `1e-6 · (1 + |g|)` (the forward is smooth there: GAT's LeakyReLU kink would need a score
//! within 1e-6 of 0, which these seeds do not produce — a failure would show it).

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn::layers::{
    Adam, AgnnConv, GatConfig, GatConv, GraphTransformerLayer, Host, HostGraph, HostParam, Linear,
    Sgd, TransformerConfig,
};
use spattn::Algorithm;
use spattn_formats::Csr;

/// A directed random graph on `n` nodes: node 1 has no edges (an empty row), node 0 attends to
/// every node (a hub row), the rest to ~3 random nodes each.
fn graph(n: usize, seed: u64) -> Arc<HostGraph> {
    let mut rng = Pcg64::seed_from_u64(seed);
    let mut edges = Vec::new();
    for j in 0..n as u32 {
        edges.push((0, j));
    }
    for i in 2..n as u32 {
        for _ in 0..3 {
            edges.push((i, rng.random_range(0..n as u32)));
        }
    }
    edges.sort_unstable();
    edges.dedup();
    HostGraph::new(&Csr::from_edges(n, n, &edges).unwrap()).unwrap()
}

fn random(len: usize, rng: &mut Pcg64) -> Vec<f64> {
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

const H: f64 = 1e-6;

fn assert_close(what: &str, i: usize, fd: f64, analytic: f64) {
    let tol = 1e-6 * (1.0 + analytic.abs());
    assert!(
        (fd - analytic).abs() <= tol,
        "{what}[{i}]: finite difference {fd:.9e}, backward {analytic:.9e}"
    );
}

/// Indices to check in a buffer of `len`: all when small, else a spread of 24.
fn coords(len: usize) -> Vec<usize> {
    if len <= 24 {
        (0..len).collect()
    } else {
        (0..24).map(|k| k * (len - 1) / 23).collect()
    }
}

/// Shifts every parameter value by a random amount in ±0.3 (non-zero biases, so that their
/// gradients are exercised with the rest).
fn perturb(params: Vec<&mut HostParam<f64>>, rng: &mut Pcg64) {
    for p in params {
        p.value
            .iter_mut()
            .for_each(|v| *v += rng.random_range(-0.3..0.3));
    }
}

/// [`check_layer`] of a layer with `forward(x) -> (y, cache)`, `backward(cache, dy) -> dx` and
/// `params_mut()`, under the loss `Σ r ⊙ y` (so `dy = r`). A macro: the layer types share no
/// trait.
macro_rules! check_layer {
    ($layer:expr, $x:expr, $r:expr) => {
        check_layer(
            &mut $layer,
            &$x,
            |l, x| dot(&l.forward(x).unwrap().0, &$r),
            |l, x| {
                let (_, cache) = l.forward(x).unwrap();
                l.backward(&cache, &$r).unwrap()
            },
            |l| l.params_mut(),
        )
    };
}

/// Checks every parameter and the input of a layer given as closures: `loss(layer, x)` runs
/// the forward; `grads(layer, x)` runs forward + backward and returns dx (the parameter
/// gradients are then in the layer); `params(layer)` lists them.
fn check_layer<L>(
    layer: &mut L,
    x: &[f64],
    loss: impl Fn(&L, &[f64]) -> f64,
    grads: impl Fn(&mut L, &[f64]) -> Vec<f64>,
    params: impl Fn(&mut L) -> Vec<&mut HostParam<f64>>,
) {
    let dx = grads(layer, x);
    let analytic: Vec<Vec<f64>> = params(layer).iter().map(|p| p.grad.clone()).collect();
    let names: Vec<&str> = params(layer).iter().map(|p| p.name).collect();
    let mut xp = x.to_vec();
    for i in coords(x.len()) {
        xp[i] = x[i] + H;
        let plus = loss(layer, &xp);
        xp[i] = x[i] - H;
        let minus = loss(layer, &xp);
        xp[i] = x[i];
        assert_close("dx", i, (plus - minus) / (2.0 * H), dx[i]);
    }
    for (k, name) in names.iter().enumerate() {
        let len = analytic[k].len();
        for i in coords(len) {
            let orig = params(layer)[k].value[i];
            params(layer)[k].value[i] = orig + H;
            let plus = loss(layer, x);
            params(layer)[k].value[i] = orig - H;
            let minus = loss(layer, x);
            params(layer)[k].value[i] = orig;
            assert_close(name, i, (plus - minus) / (2.0 * H), analytic[k][i]);
        }
    }
}

#[test]
fn gat_gradients_match_finite_differences() {
    for (n, heads, concat, bias, seed) in [
        (9, 1, true, true, 1),
        (9, 4, true, false, 2),
        (11, 4, false, true, 3),
        (7, 2, false, false, 4),
    ] {
        let g = graph(n, seed);
        let (in_dim, out_dim) = (5, 3);
        let cfg = GatConfig::new(in_dim, out_dim, heads)
            .with_concat(concat)
            .with_bias(bias);
        let mut layer = GatConv::<Host<f64>>::new(cfg, &g, seed).unwrap();
        let mut rng = Pcg64::seed_from_u64(seed + 100);
        perturb(layer.params_mut(), &mut rng);
        let x = random(n * in_dim, &mut rng);
        let r = random(n * cfg.output_dim(), &mut rng);
        check_layer!(layer, x, r);
    }
}

#[test]
fn gat_with_dropout_gradients_match_finite_differences_under_a_fixed_mask() {
    let g = graph(10, 21);
    let cfg = GatConfig::new(4, 3, 3).with_dropout(0.6);
    let mut layer = GatConv::<Host<f64>>::new(cfg, &g, 21).unwrap();
    let mut rng = Pcg64::seed_from_u64(121);
    perturb(layer.params_mut(), &mut rng);
    let x = random(10 * 4, &mut rng);
    let r = random(10 * cfg.output_dim(), &mut rng);
    let d = spattn::Dropout::new(0.6, 77, 5).unwrap();
    check_layer(
        &mut layer,
        &x,
        |l, x| dot(&l.forward_with_dropout(x, Some(d)).unwrap().0, &r),
        |l, x| {
            let (_, cache) = l.forward_with_dropout(x, Some(d)).unwrap();
            l.backward(&cache, &r).unwrap()
        },
        |l| l.params_mut(),
    );
    // Training draws a new mask each forward; evaluation none; the rate is checked.
    let (a, _) = layer.forward(&x).unwrap();
    let (b, _) = layer.forward(&x).unwrap();
    assert_ne!(a, b, "two training forwards drew the same mask");
    layer.set_training(false);
    let (c, _) = layer.forward(&x).unwrap();
    let (e, _) = layer.forward_with_dropout(&x, None).unwrap();
    assert_eq!(c, e);
    assert!(GatConv::<Host<f64>>::new(GatConfig::new(4, 3, 3).with_dropout(1.0), &g, 1).is_err());
}

#[test]
fn gat_with_edge_features_gradients_match_finite_differences() {
    for (n, heads, concat, edge_dim, seed) in [(9, 2, true, 3, 41), (10, 1, false, 1, 42)] {
        let g = graph(n, seed);
        let cfg = GatConfig::new(4, 3, heads)
            .with_concat(concat)
            .with_edge_dim(edge_dim);
        let mut layer = GatConv::<Host<f64>>::new(cfg, &g, seed).unwrap();
        assert_eq!(
            layer.params_mut().len(),
            6,
            "W, a_src, a_dst, bias, W_e, a_edge"
        );
        let mut rng = Pcg64::seed_from_u64(seed + 100);
        perturb(layer.params_mut(), &mut rng);
        let x = random(n * 4, &mut rng);
        let r = random(n * cfg.output_dim(), &mut rng);
        let f = random(g.a.nnz() * edge_dim, &mut rng);
        check_layer(
            &mut layer,
            &x,
            |l, x| dot(&l.forward_with_edges(x, &f).unwrap().0, &r),
            |l, x| {
                let (_, cache) = l.forward_with_edges(x, &f).unwrap();
                l.backward(&cache, &r).unwrap()
            },
            |l| l.params_mut(),
        );
        // The edge features' own gradient, for features computed upstream.
        let (_, cache) = layer.forward_with_edges(&x, &f).unwrap();
        let (_, df) = layer.backward_with_edges(&cache, &r).unwrap();
        let df = df.expect("the forward had edge features");
        let mut fp = f.clone();
        for i in coords(f.len()) {
            fp[i] = f[i] + H;
            let plus = dot(&layer.forward_with_edges(&x, &fp).unwrap().0, &r);
            fp[i] = f[i] - H;
            let minus = dot(&layer.forward_with_edges(&x, &fp).unwrap().0, &r);
            fp[i] = f[i];
            assert_close("d_edge_attr", i, (plus - minus) / (2.0 * H), df[i]);
        }
        // The edge term changes the output; features are required, of the right length.
        let zero = vec![0.0; f.len()];
        let with = layer.forward_with_edges(&x, &f).unwrap().0;
        let without = layer.forward_with_edges(&x, &zero).unwrap().0;
        assert_ne!(with, without);
        let e = layer.forward(&x).err().expect("edge features are required");
        assert!(e.to_string().contains("forward_with_edges"), "{e}");
        let e = layer
            .forward_with_edges(&x, &f[1..])
            .err()
            .expect("a length error");
        assert!(e.to_string().contains("edge features"), "{e}");
    }
    let plain = GatConv::<Host<f64>>::new(GatConfig::new(4, 3, 1), &graph(6, 1), 1).unwrap();
    let e = plain
        .forward_with_edges(&[0.0; 24], &[0.0; 6])
        .err()
        .expect("a layer without edge_dim refuses edge features");
    assert!(e.to_string().contains("no edge_dim"), "{e}");
    assert!(
        GatConv::<Host<f64>>::new(GatConfig::new(4, 3, 1).with_edge_dim(0), &graph(6, 1), 1)
            .is_err()
    );
}

#[test]
fn transformer_gradients_match_finite_differences() {
    for (n, heads, head_dim, residual, seed) in [(8, 1, 3, false, 5), (10, 4, 2, true, 6)] {
        let g = graph(n, seed);
        let dim = 6;
        let cfg = TransformerConfig::new(dim, heads, head_dim, dim).with_residual(residual);
        let mut layer = GraphTransformerLayer::<Host<f64>>::new(cfg, &g, seed).unwrap();
        let mut rng = Pcg64::seed_from_u64(seed + 100);
        perturb(layer.params_mut(), &mut rng);
        let x = random(n * dim, &mut rng);
        let r = random(n * dim, &mut rng);
        check_layer!(layer, x, r);
    }
}

#[test]
fn transformer_with_edge_bias_and_dropout_gradients_match_finite_differences() {
    for (n, heads, shared, seed) in [(9, 2, false, 31), (10, 3, true, 32)] {
        let g = graph(n, seed);
        let dim = 5;
        let cfg = TransformerConfig::new(dim, heads, 2, dim)
            .with_residual(true)
            .with_dropout(0.3)
            .with_edge_bias(true);
        let mut layer = GraphTransformerLayer::<Host<f64>>::new(cfg, &g, seed).unwrap();
        let mut rng = Pcg64::seed_from_u64(seed + 100);
        perturb(layer.params_mut(), &mut rng);
        let x = random(n * dim, &mut rng);
        let r = random(n * dim, &mut rng);
        let nnz = g.a.nnz();
        let bias = random(if shared { nnz } else { nnz * heads }, &mut rng);
        let d = spattn::Dropout::new(0.3, 99, 2).unwrap();
        let run = |l: &GraphTransformerLayer<Host<f64>>, x: &[f64], b: &[f64]| {
            dot(
                &l.forward_full(x, Some((b, shared)), Some(d)).unwrap().0,
                &r,
            )
        };
        check_layer(
            &mut layer,
            &x,
            |l, x| run(l, x, &bias),
            |l, x| {
                let (_, cache) = l.forward_full(x, Some((&bias, shared)), Some(d)).unwrap();
                l.backward_with(&cache, &r, Some((&bias, shared)))
                    .unwrap()
                    .0
            },
            |l| l.params_mut(),
        );
        let (_, cache) = layer
            .forward_full(&x, Some((&bias, shared)), Some(d))
            .unwrap();
        let (_, d_bias) = layer
            .backward_with(&cache, &r, Some((&bias, shared)))
            .unwrap();
        let d_bias = d_bias.expect("a bias was given, so its gradient comes back");
        assert_eq!(d_bias.len(), bias.len());
        let mut bp = bias.clone();
        for i in coords(bias.len()) {
            bp[i] = bias[i] + H;
            let plus = run(&layer, &x, &bp);
            bp[i] = bias[i] - H;
            let minus = run(&layer, &x, &bp);
            bp[i] = bias[i];
            assert_close("d_bias", i, (plus - minus) / (2.0 * H), d_bias[i]);
        }
        // A bias of the wrong length is an error, not a panic.
        assert!(layer
            .forward_full(&x, Some((&bias[1..], shared)), Some(d))
            .is_err());
    }
}

#[test]
fn agnn_gradients_match_finite_differences() {
    for (n, dim, beta, seed) in [(9, 4, 1.0, 7), (12, 7, -1.7, 8), (6, 1, 2.5, 9)] {
        let g = graph(n, seed);
        let mut layer = AgnnConv::<Host<f64>>::new(dim, &g, Algorithm::Auto).unwrap();
        layer.beta.value[0] = beta;
        let mut rng = Pcg64::seed_from_u64(seed + 100);
        let x = random(n * dim, &mut rng);
        let r = random(n * dim, &mut rng);
        check_layer!(layer, x, r);
    }
}

#[test]
fn agnn_zero_rows_stay_finite() {
    let g = graph(6, 1);
    let mut layer = AgnnConv::<Host<f64>>::new(3, &g, Algorithm::Auto).unwrap();
    let mut x = vec![0.5; 18];
    x[3..6].iter_mut().for_each(|v| *v = 0.0); // node 1: all-zero features
    let (y, cache) = layer.forward(&x).unwrap();
    let dx = layer.backward(&cache, &[1.0; 18]).unwrap();
    assert!(y.iter().chain(&dx).all(|v| v.is_finite()));
}

#[test]
fn linear_gradients_match_finite_differences() {
    let (rows, i, o) = (5, 4, 3);
    let mut layer = Linear::<Host<f64>>::new(i, o, true, 3);
    let mut rng = Pcg64::seed_from_u64(3);
    let x = random(rows * i, &mut rng);
    let r = random(rows * o, &mut rng);
    check_layer(
        &mut layer,
        &x,
        |l, x| dot(&l.forward(x, rows).unwrap(), &r),
        |l, x| {
            let mut dx = vec![f64::NAN; rows * i];
            l.backward(x, rows, &r, Some((&mut dx, false))).unwrap();
            dx
        },
        |l| l.params_mut(),
    );
}

#[test]
fn optimizers_descend_and_zero_the_gradients() {
    // Minimise Σ (W − 1)² with both optimizers: the gradient is 2 (W − 1).
    let mut lin = Linear::<Host<f64>>::new(3, 2, false, 1);
    let mut adam = Adam::new(0.1);
    for _ in 0..300 {
        for p in lin.params_mut() {
            p.grad = p.value.iter().map(|v| 2.0 * (v - 1.0)).collect();
        }
        adam.step(lin.params_mut()).unwrap();
    }
    assert!(lin.weight.value.iter().all(|v| (v - 1.0).abs() < 1e-2));
    assert!(lin.weight.grad.iter().all(|&g| g == 0.0));
    let sgd = Sgd {
        lr: 0.1,
        weight_decay: 0.0,
    };
    let mut lin = Linear::<Host<f64>>::new(3, 2, false, 2);
    for _ in 0..200 {
        for p in lin.params_mut() {
            p.grad = p.value.iter().map(|v| 2.0 * (v - 1.0)).collect();
        }
        sgd.step(lin.params_mut()).unwrap();
    }
    assert!(lin.weight.value.iter().all(|v| (v - 1.0).abs() < 1e-6));
    // The number of parameters is fixed at the first step.
    let mut other = Linear::<Host<f64>>::new(3, 2, true, 3);
    assert!(adam.step(other.params_mut()).is_err());
}

#[test]
fn layer_inputs_and_configs_are_checked() {
    let g = graph(5, 1);
    let layer = GatConv::<Host<f64>>::new(GatConfig::new(3, 2, 2), &g, 1).unwrap();
    assert!(matches!(
        layer.forward(&[0.0; 14]),
        Err(spattn::Error::LengthMismatch { what: "x", .. })
    ));
    assert!(GatConv::<Host<f64>>::new(GatConfig::new(3, 0, 2), &g, 1).is_err());
    let cfg = TransformerConfig::new(3, 2, 2, 4).with_residual(true);
    assert!(matches!(
        GraphTransformerLayer::<Host<f64>>::new(cfg, &g, 1),
        Err(spattn::Error::InvalidConfig {
            what: "residual",
            ..
        })
    ));
    let rect = Csr::from_edges(2, 3, &[(0, 2)]).unwrap();
    assert!(HostGraph::new(&rect).is_err());
}
