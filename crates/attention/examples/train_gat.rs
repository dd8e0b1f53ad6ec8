//! Trains a 2-layer GAT on a node-classification task that needs the graph, and an MLP on the
//! same features, and prints both accuracies.
//!
//! The task is a stochastic block model: `classes` blocks, edges inside a block with
//! probability `p_in`, across blocks with `p_out ≪ p_in`; each node's features are its class
//! mean plus heavy Gaussian noise, so the features alone say little (the MLP) while averaging
//! over a node's mostly same-class neighbours removes most of the noise (the GAT).
//!
//! ```sh
//! cargo run --release --example train_gat -p spattn            # GPU if there is one, else CPU
//! cargo run --release --example train_gat -p spattn -- --cpu   # force the CPU
//! ```

use rand::{Rng, SeedableRng};
use rand_distr_free::normal;
use rand_pcg::Pcg64;
use spattn::layers::{
    Activation, Adam, Device, GatCache, GatConfig, GatConv, GpuContext, GpuGraph, Host, HostGraph,
    Linear,
};
use spattn_formats::Csr;
use spattn_ops::{DeviceMatrix, Gpu, Shape};
use std::sync::Arc;

/// A node-classification task: graph, features, labels and the train / test split.
pub struct Task {
    /// Symmetrized adjacency with self loops.
    pub graph: Csr,
    /// `n × dim` features, row-major.
    pub features: Vec<f32>,
    /// Feature dimension.
    pub dim: usize,
    /// Class of each node.
    pub labels: Vec<usize>,
    /// Number of classes.
    pub classes: usize,
    /// Whether each node is in the training set (the rest is the test set).
    pub train: Vec<bool>,
}

/// A seeded stochastic block model (see the file's documentation).
#[allow(clippy::too_many_arguments)]
pub fn sbm(
    seed: u64,
    n: usize,
    classes: usize,
    p_in: f64,
    p_out: f64,
    dim: usize,
    noise: f64,
    train_fraction: f64,
) -> Result<Task, spattn::Error> {
    let mut rng = Pcg64::seed_from_u64(seed);
    let labels: Vec<usize> = (0..n).map(|i| i % classes).collect();
    let mut edges = Vec::new();
    for i in 0..n {
        for j in i + 1..n {
            let p = if labels[i] == labels[j] { p_in } else { p_out };
            if rng.random_bool(p) {
                edges.push((i as u32, j as u32));
            }
        }
    }
    let graph = Csr::from_edges(n, n, &edges)?.symmetrize_with_self_loops()?;
    let means: Vec<f64> = (0..classes * dim).map(|_| normal(&mut rng)).collect();
    let features = (0..n * dim)
        .map(|x| (means[labels[x / dim] * dim + x % dim] + noise * normal(&mut rng)) as f32)
        .collect();
    let train = (0..n).map(|_| rng.random_bool(train_fraction)).collect();
    Ok(Task {
        graph,
        features,
        dim,
        labels,
        classes,
        train,
    })
}

/// Softmax cross-entropy over the training nodes: the mean loss and its gradient
/// (`n × classes`, zero on test nodes).
pub fn cross_entropy(task: &Task, logits: &[f32]) -> (f64, Vec<f32>) {
    let c = task.classes;
    let n_train = task.train.iter().filter(|&&t| t).count().max(1) as f64;
    let mut grad = vec![0.0f32; logits.len()];
    let mut loss = 0.0;
    for (i, (row, g)) in logits.chunks(c).zip(grad.chunks_mut(c)).enumerate() {
        if !task.train[i] {
            continue;
        }
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f64 = row.iter().map(|&v| f64::from(v - m).exp()).sum();
        loss -= f64::from(row[task.labels[i]] - m) - sum.ln();
        for (k, gk) in g.iter_mut().enumerate() {
            let p = f64::from(row[k] - m).exp() / sum;
            let y = if k == task.labels[i] { 1.0 } else { 0.0 };
            *gk = ((p - y) / n_train) as f32;
        }
    }
    (loss / n_train, grad)
}

/// Accuracy of the arg-max of `logits` over the test nodes.
pub fn test_accuracy(task: &Task, logits: &[f32]) -> f64 {
    let c = task.classes;
    let (mut right, mut total) = (0usize, 0usize);
    for (i, row) in logits.chunks(c).enumerate() {
        if task.train[i] {
            continue;
        }
        let best = (0..c).fold(0, |b, k| if row[k] > row[b] { k } else { b });
        right += usize::from(best == task.labels[i]);
        total += 1;
    }
    right as f64 / total.max(1) as f64
}

/// Which model to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    /// GATConv(dim → 8 heads × 8, concat) → ELU → GATConv(64 → classes, 1 head).
    Gat,
    /// Linear(dim → 64) → ELU → Linear(64 → classes): the same features, no graph.
    Mlp,
}

/// A hidden width of 8 heads × 8 features.
const HEADS: usize = 8;
const HIDDEN: usize = 8;
/// Dropout on the GAT layers' attention coefficients in training, as the GAT paper trains.
const GAT_DROPOUT: f32 = 0.6;

/// Per-epoch losses and the final test accuracy.
pub struct Outcome {
    /// Training loss of every epoch.
    pub losses: Vec<f64>,
    /// Test accuracy after the last epoch.
    pub accuracy: f64,
}

/// One layer of either model on the host.
enum HostLayer {
    Gat(Box<GatConv<Host<f32>>>),
    Dense(Linear<Host<f32>>),
}

enum HostCache {
    Gat(Box<GatCache<Host<f32>>>),
    Dense(Vec<f32>),
}

impl HostLayer {
    fn new(
        model: Model,
        graph: &Arc<HostGraph>,
        i: usize,
        o: usize,
        heads: usize,
        seed: u64,
    ) -> Result<Self, spattn::Error> {
        Ok(match model {
            Model::Gat => HostLayer::Gat(Box::new(GatConv::new(
                GatConfig::new(i, o, heads)
                    .with_concat(heads > 1)
                    .with_dropout(GAT_DROPOUT),
                graph,
                seed,
            )?)),
            Model::Mlp => HostLayer::Dense(Linear::new(i, o * heads, true, seed)),
        })
    }
    fn forward(&self, x: &[f32], n: usize) -> Result<(Vec<f32>, HostCache), spattn::Error> {
        match self {
            HostLayer::Gat(l) => l.forward(x).map(|(y, c)| (y, HostCache::Gat(Box::new(c)))),
            HostLayer::Dense(l) => Ok((l.forward(x, n)?, HostCache::Dense(x.to_vec()))),
        }
    }
    /// The forward of evaluation: no dropout.
    fn evaluate(&self, x: &[f32], n: usize) -> Result<Vec<f32>, spattn::Error> {
        match self {
            HostLayer::Gat(l) => Ok(l.forward_with_dropout(x, None)?.0),
            HostLayer::Dense(l) => l.forward(x, n),
        }
    }
    fn backward(
        &mut self,
        cache: &HostCache,
        n: usize,
        dy: &[f32],
    ) -> Result<Vec<f32>, spattn::Error> {
        match (self, cache) {
            (HostLayer::Gat(l), HostCache::Gat(c)) => l.backward(c, dy),
            (HostLayer::Dense(l), HostCache::Dense(x)) => {
                let mut dx = vec![0.0; n * l.in_dim];
                l.backward(x, n, dy, Some((&mut dx, false)))?;
                Ok(dx)
            }
            _ => unreachable!("caches come from the same layer"),
        }
    }
    fn params_mut(&mut self) -> Vec<&mut spattn::layers::HostParam<f32>> {
        match self {
            HostLayer::Gat(l) => l.params_mut(),
            HostLayer::Dense(l) => l.params_mut(),
        }
    }
}

/// Trains `model` on the CPU in f32.
pub fn train_host(
    task: &Task,
    model: Model,
    epochs: usize,
    lr: f32,
    verbose: bool,
) -> Result<Outcome, spattn::Error> {
    let graph = HostGraph::new(&task.graph)?;
    let n = graph.n();
    let mut l1 = HostLayer::new(model, &graph, task.dim, HIDDEN, HEADS, 1)?;
    let mut l2 = HostLayer::new(model, &graph, HEADS * HIDDEN, task.classes, 1, 2)?;
    let mut adam = Adam::new(lr);
    let elu = Activation::Elu;
    let mut losses = Vec::new();
    for epoch in 0..epochs {
        let (h, c1) = l1.forward(&task.features, n)?;
        let a: Vec<f32> = h.iter().map(|&v| elu.apply(f64::from(v)) as f32).collect();
        let (out, c2) = l2.forward(&a, n)?;
        let (loss, d_out) = cross_entropy(task, &out);
        let da = l2.backward(&c2, n, &d_out)?;
        let dh: Vec<f32> = da
            .iter()
            .zip(&h)
            .map(|(&d, &v)| d * elu.derivative(f64::from(v)) as f32)
            .collect();
        l1.backward(&c1, n, &dh)?;
        let mut params = l1.params_mut();
        params.extend(l2.params_mut());
        adam.step(params)?;
        if verbose {
            println!("{model:?} epoch {epoch:3}: loss {loss:.4}");
        }
        losses.push(loss);
    }
    // Evaluation: the trained model without dropout.
    let h = l1.evaluate(&task.features, n)?;
    let a: Vec<f32> = h.iter().map(|&v| elu.apply(f64::from(v)) as f32).collect();
    let logits = l2.evaluate(&a, n)?;
    Ok(Outcome {
        accuracy: test_accuracy(task, &logits),
        losses,
    })
}

/// One layer of either model on the GPU.
enum GpuLayer {
    Gat(Box<GatConv<Device<f32>>>),
    Dense(Box<Linear<Device<f32>>>),
}

/// Trains `model` on the GPU in f32 (the loss is computed on the host from the downloaded
/// logits: `n × classes` floats per epoch).
pub fn train_gpu(
    task: &Task,
    model: Model,
    epochs: usize,
    lr: f32,
    ctx: &GpuContext,
    verbose: bool,
) -> Result<Outcome, spattn::Error> {
    let host_graph = HostGraph::new(&task.graph)?;
    let graph = GpuGraph::upload(ctx, &host_graph)?;
    let gpu = ctx.gpu();
    let n = graph.n();
    let to_gpu = |l: HostLayer| -> Result<GpuLayer, spattn::Error> {
        Ok(match l {
            HostLayer::Gat(l) => GpuLayer::Gat(Box::new(l.to_device(&graph)?)),
            HostLayer::Dense(l) => GpuLayer::Dense(Box::new(l.to_device(gpu)?)),
        })
    };
    let mut l1 = to_gpu(HostLayer::new(
        model,
        &host_graph,
        task.dim,
        HIDDEN,
        HEADS,
        1,
    )?)?;
    let mut l2 = to_gpu(HostLayer::new(
        model,
        &host_graph,
        HEADS * HIDDEN,
        task.classes,
        1,
        2,
    )?)?;
    let x = DeviceMatrix::from_host(gpu, Shape::new(n, 1, task.dim)?, &task.features)?;
    let mut adam = Adam::new(lr);
    let mut losses = Vec::new();
    let elu = Activation::Elu;
    // Forward and backward of one layer; the input must outlive the backward (the dense
    // layers keep no copy), so both run here with it.
    for epoch in 0..epochs {
        let (h, c1) = match &l1 {
            GpuLayer::Gat(l) => {
                let (y, c) = l.forward(&x)?;
                (y, Some(c))
            }
            GpuLayer::Dense(l) => (l.forward(ctx, &x)?, None),
        };
        let mut a = DeviceMatrix::zeros(gpu, h.shape())?;
        spattn_ops::elementwise::activation(gpu, elu, &h, &mut a)?;
        let (out, c2) = match &l2 {
            GpuLayer::Gat(l) => {
                let (y, c) = l.forward(&a)?;
                (y, Some(c))
            }
            GpuLayer::Dense(l) => (l.forward(ctx, &a)?, None),
        };
        let host_out = out.to_host()?;
        let (loss, d_out) = cross_entropy(task, &host_out);
        let d_out = DeviceMatrix::from_host(gpu, out.shape(), &d_out)?;
        let da = match (&mut l2, &c2) {
            (GpuLayer::Gat(l), Some(c)) => l.backward(c, &d_out)?,
            (GpuLayer::Dense(l), _) => {
                let mut da = DeviceMatrix::zeros(gpu, a.shape())?;
                l.backward(ctx, &a, &d_out, Some((&mut da, false)))?;
                da
            }
            _ => unreachable!("caches come from the same layer"),
        };
        let mut dh = DeviceMatrix::zeros(gpu, h.shape())?;
        spattn_ops::elementwise::activation_backward(gpu, elu, &h, &da, &mut dh)?;
        match (&mut l1, &c1) {
            (GpuLayer::Gat(l), Some(c)) => {
                l.backward(c, &dh)?;
            }
            (GpuLayer::Dense(l), _) => l.backward(ctx, &x, &dh, None)?,
            _ => unreachable!("caches come from the same layer"),
        }
        let mut params = match &mut l1 {
            GpuLayer::Gat(l) => l.params_mut(),
            GpuLayer::Dense(l) => l.params_mut(),
        };
        params.extend(match &mut l2 {
            GpuLayer::Gat(l) => l.params_mut(),
            GpuLayer::Dense(l) => l.params_mut(),
        });
        adam.step(params)?;
        if verbose {
            println!("{model:?} epoch {epoch:3}: loss {loss:.4}");
        }
        losses.push(loss);
    }
    // Evaluation: the trained model without dropout.
    let eval = |l: &GpuLayer, x: &DeviceMatrix<f32>| -> Result<DeviceMatrix<f32>, spattn::Error> {
        match l {
            GpuLayer::Gat(l) => Ok(l.forward_with_dropout(x, None)?.0),
            GpuLayer::Dense(l) => l.forward(ctx, x),
        }
    };
    let h = eval(&l1, &x)?;
    let mut a = DeviceMatrix::zeros(gpu, h.shape())?;
    spattn_ops::elementwise::activation(gpu, elu, &h, &mut a)?;
    let logits = eval(&l2, &a)?.to_host()?;
    Ok(Outcome {
        accuracy: test_accuracy(task, &logits),
        losses,
    })
}

/// A standard normal draw (Box–Muller), so the example needs no distribution crate.
mod rand_distr_free {
    use rand::Rng;
    /// One N(0, 1) sample.
    pub fn normal(rng: &mut impl Rng) -> f64 {
        let u1: f64 = rng.random_range(f64::EPSILON..1.0);
        let u2: f64 = rng.random();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let force_cpu = std::env::args().any(|a| a == "--cpu");
    let task = sbm(42, 3000, 6, 0.008, 0.0004, 32, 3.0, 0.3)?;
    println!(
        "stochastic block model: {} nodes, {} edges (with self loops), {} classes, {} features (class mean + N(0, 3²) noise)",
        task.graph.n_rows(),
        task.graph.nnz(),
        task.classes,
        task.dim
    );
    let (epochs, lr) = (100, 0.01);
    let ctx = if force_cpu {
        None
    } else {
        match Gpu::new(0)
            .map_err(spattn::Error::from)
            .and_then(|g| GpuContext::new(&g))
        {
            Ok(ctx) => Some(ctx),
            Err(e) => {
                println!("no GPU training ({e}): training on the CPU");
                None
            }
        }
    };
    let run = |model| match &ctx {
        Some(ctx) => train_gpu(&task, model, epochs, lr, ctx, true),
        None => train_host(&task, model, epochs, lr, true),
    };
    let where_ = ctx
        .as_ref()
        .map_or("CPU".to_string(), |c| c.gpu().name().to_string());
    let gat = run(Model::Gat)?;
    let mlp = run(Model::Mlp)?;
    println!("on {where_}, {epochs} epochs of Adam (lr {lr}):");
    println!(
        "  2-layer GAT (8 heads x 8, ELU): test accuracy {:.1}%",
        100.0 * gat.accuracy
    );
    println!(
        "  2-layer MLP (64 hidden, ELU, no graph): test accuracy {:.1}%",
        100.0 * mlp.accuracy
    );
    Ok(())
}
