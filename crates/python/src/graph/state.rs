//! [`GraphCore`]'s plan-once state: the host CSR (downloaded once from the device a graph was
//! built on), per CUDA device the shared upload and its plans ([`OnDevice`], cached by
//! [`PlanKey`]), the CPU GAT backward's transpose, and the plans' policy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use pyo3::prelude::*;
use spattn::{
    Algorithm, AttentionConfig, AttentionPlan, Csr, DTypeKind, DeviceGraph, PlanPolicy, Shape,
};

use super::args::plan_scale;
use super::GraphCore;
use crate::device::{self, Device};
use crate::errors::{ops_to_py, to_py};
use crate::host::DTypeName;

/// What a plan is cached by, per graph and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct PlanKey {
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    pub(super) dtype: DTypeKind,
    pub(super) algorithm: Algorithm,
    /// The scale's f32 bits; `None` for the default 1/√head_dim.
    pub(super) scale: Option<u32>,
    /// Whether the calls pass a bias or dropout (then `Auto` picks an algorithm that takes them).
    pub(super) extras: bool,
    /// Whether they pass edge features too (then `Auto` picks one whose kernel takes those).
    pub(super) edge_features: bool,
}

/// A graph's state on one CUDA device: the shared upload and the plans over it.
#[derive(Debug)]
pub(crate) struct OnDevice {
    pub(crate) device: Arc<Device>,
    pub(crate) graph: Arc<DeviceGraph>,
    pub(super) plans: Mutex<HashMap<PlanKey, Arc<AttentionPlan>>>,
}

impl PlanKey {
    pub(super) fn new(
        heads: usize,
        head_dim: usize,
        dtype: DTypeName,
        algorithm: Algorithm,
        scale: Option<f64>,
        extras: bool,
    ) -> PyResult<Self> {
        Ok(Self {
            heads,
            head_dim,
            dtype: dtype.device()?,
            algorithm,
            scale: plan_scale(scale)?,
            extras,
            edge_features: false,
        })
    }
}

impl GraphCore {
    pub(super) fn new(csr: Csr, duplicates: usize) -> Self {
        Self {
            n_rows: csr.n_rows(),
            n_cols: csr.n_cols(),
            nnz: csr.nnz(),
            host: OnceLock::from(Arc::new(csr)),
            duplicates,
            origin: None,
            transpose: OnceLock::new(),
            devices: Mutex::new(HashMap::new()),
            reuse: AtomicBool::new(true),
            fixed: AtomicBool::new(false),
            backwards: AtomicUsize::new(0),
        }
    }

    /// The policy of this graph's plans.
    pub(super) fn policy_value(&self) -> PlanPolicy {
        if self.reuse.load(Ordering::Relaxed) {
            PlanPolicy::Reuse
        } else {
            PlanPolicy::Once
        }
    }

    /// Sets the plans' policy on every device, dropping the plans built so far where it
    /// changes.
    pub(super) fn apply_policy(&self, p: PlanPolicy) {
        if self.policy_value() == p {
            return;
        }
        self.reuse.store(p == PlanPolicy::Reuse, Ordering::Relaxed);
        let _restore = device::ContextGuard::save();
        let map = self.devices.lock().unwrap_or_else(PoisonError::into_inner);
        for d in map.values() {
            d.graph.set_policy(p);
            d.plans
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
        }
    }

    /// At a call on CUDA device `device`, enqueued on `stream`, of a graph under `Once` whose
    /// policy is not fixed: under CUDA-graph capture the policy becomes fixed (the captured
    /// work reads the plans' memory, which a switch would free); otherwise, where `new_step`
    /// (a forward outside any backward pass: not activation checkpointing's recomputation)
    /// and the graph has had a backward, it switches to `Reuse` (seen again: trained on over
    /// several steps, whose plans repay a row order and fused-tc; a mini-batch's graph is new
    /// every step).
    pub(super) fn reuse_if_seen_again(
        &self,
        py: Python<'_>,
        device: i64,
        stream: u64,
        new_step: bool,
    ) -> PyResult<()> {
        if self.reuse.load(Ordering::Relaxed) || self.fixed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let ordinal = device::ordinal(device)?;
        py.detach(|| -> spattn::Result<()> {
            let _restore = device::ContextGuard::save();
            let d = device::device(ordinal)?;
            // SAFETY: `stream` is the caller's current stream of this device's primary
            // context, as for every call's bridge (the module documentation's contract).
            if unsafe { d.bridge.is_capturing(stream) }? {
                self.fixed.store(true, Ordering::Relaxed);
            } else if new_step && self.backwards.load(Ordering::Relaxed) > 0 {
                self.apply_policy(PlanPolicy::Reuse);
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// The host CSR (downloaded once from the device a graph was built on).
    fn csr(&self) -> spattn::Result<&Arc<Csr>> {
        if let Some(c) = self.host.get() {
            return Ok(c);
        }
        let built = self.origin.and_then(|o| {
            let map = self.devices.lock().unwrap_or_else(PoisonError::into_inner);
            map.get(&o).cloned()
        });
        let d = built.ok_or_else(|| {
            spattn::Error::Ops(spattn::ops::Error::InvalidArgument {
                what: "graph",
                why: "has neither a host CSR nor the device it was built on".into(),
            })
        })?;
        let _restore = device::ContextGuard::save();
        let csr = d.graph.host_shared()?.clone();
        Ok(self.host.get_or_init(|| csr))
    }

    /// [`csr`](Self::csr) as a Python error.
    pub(crate) fn csr_py(&self) -> PyResult<&Arc<Csr>> {
        self.csr().map_err(to_py)
    }

    /// The graph's state on CUDA device `ordinal` (the upload is lazy: nothing is copied until
    /// a plan or op asks for it).
    pub(super) fn on_device(&self, ordinal: usize) -> spattn::Result<Arc<OnDevice>> {
        // Entries are inserted whole: a panic elsewhere cannot leave the map half-built.
        let map = self.devices.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        drop(map);
        let host = self.csr()?.clone();
        let mut map = self.devices.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let device = device::device(ordinal)?;
        let graph = Arc::new(DeviceGraph::new(&device.gpu, host));
        graph.set_policy(self.policy_value());
        let d = Arc::new(OnDevice {
            device,
            graph,
            plans: Mutex::new(HashMap::new()),
        });
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The plan of `key` on `d`, built on first use (under the lock, so concurrent callers
    /// build it once).
    fn plan(d: &OnDevice, key: PlanKey) -> spattn::Result<Arc<AttentionPlan>> {
        let mut plans = d.plans.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = plans.get(&key) {
            return Ok(p.clone());
        }
        let mut config =
            AttentionConfig::new(key.heads, key.head_dim, key.dtype).with_algorithm(key.algorithm);
        if let Some(bits) = key.scale {
            config = config.with_scale(f32::from_bits(bits));
        }
        if key.extras {
            config = config
                .with_edge_extras(true)
                .with_edge_features(key.edge_features);
        }
        let plan = Arc::new(AttentionPlan::on_graph(&d.graph, config)?);
        plans.insert(key, plan.clone());
        Ok(plan)
    }

    /// Runs `f` on the cached plan of `key` on CUDA device `device`, without the GIL, putting
    /// the thread's current CUDA context back afterwards.
    pub(super) fn with_plan<R: Send>(
        &self,
        py: Python<'_>,
        device: i64,
        key: PlanKey,
        f: impl FnOnce(&OnDevice, &AttentionPlan) -> spattn::Result<R> + Send,
    ) -> PyResult<R> {
        let ordinal = device::ordinal(device)?;
        py.detach(|| -> spattn::Result<R> {
            let _restore = device::ContextGuard::save();
            let d = self.on_device(ordinal)?;
            let plan = Self::plan(&d, key)?;
            f(&d, &plan)
        })
        .map_err(to_py)
    }

    pub(crate) fn transpose(&self) -> spattn::Result<&(Csr, Vec<u32>)> {
        let csr = self.csr()?;
        Ok(self.transpose.get_or_init(|| csr.transpose_with_map()))
    }

    pub(super) fn shapes(&self, heads: usize, head_dim: usize) -> PyResult<(Shape, Shape)> {
        let q = Shape::new(self.n_rows, heads, head_dim).map_err(ops_to_py)?;
        let kv = Shape::new(self.n_cols, heads, head_dim).map_err(ops_to_py)?;
        Ok((q, kv))
    }
}

impl Drop for GraphCore {
    /// Frees the graph's device uploads and plans with the caller's CUDA context restored
    /// afterwards (freeing binds spattn's context to the thread).
    fn drop(&mut self) {
        let _restore = device::ContextGuard::save();
        self.devices
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}
