//! `Hybrid`: RT-GNN-style fused attention, tensor-core and CUDA-core warps of one kernel
//! splitting each window's work (kernel: `crates/kernels-sys/cuda/hybrid.cu`, launched through
//! [`crate::DeviceHybrid`]).
//!
//! Rows are renumbered ([`Reorder`], as for fused-tc: by default the order with the fewest
//! K/V row gathers among the graph's own, degree and locality orders; invisible to the caller: K/V are gathered by original id, Q
//! and the output go through the renumbered rows' original ids), each window's columns ordered
//! by hits, and the 16×8 blocks at or above a fill threshold go to tensor-core warps, the rest
//! of the edges to CUDA-core warps of the same CTA.
//!
//! # Two kernels
//!
//! f16/bf16 heads of exactly 64 or 128 features run the **pipelined** kernel
//! ([`DeviceHybrid::pipelined`]): each tensor-core warp owns a window as fused-tc's pipelined
//! kernel does (K/V tiles through shared memory by `cp.async`), and one CUDA-core warp per CTA
//! takes the sparse edges of the CTA's windows in turn, handing each window's partial to its
//! tensor-core warp through that warp's shared memory, the two warps meeting on a pair of
//! shared-memory mbarriers. Other shapes run the general kernel, where all warps of a CTA share
//! one window at a time.
//!
//! # Choosing the threshold and the split (pipelined kernel: measured)
//!
//! The plan times candidates on the graph, cuDNN-benchmark style, and keeps the fastest
//! ([`crate::hybrid_plan::choose_split`], shared with the hybrid SpMM): every block on
//! tensor cores without a CUDA-core warp (2 tensor-core warps per CTA), every edge on CUDA
//! cores (1 + 1 warps), and, for each of [`crate::hybrid_plan::CD_FRACTIONS`], the highest
//! threshold that leaves at most that fraction of the edges to CUDA cores, with 1, 2 and 3
//! tensor-core warps per CUDA-core warp (the TC:CD ratio). The unit schedule's block and edge
//! costs come from the two extreme runs. The chosen values and their times are in
//! [`HybridInfo`].
//!
//! # Cost model (general kernel, calibrated at plan time)
//!
//! The plan times the kernel twice on the graph, once with every block on tensor cores
//! (threshold 0) and once with every edge on CUDA cores (threshold > 1), both with
//! [`CALIBRATION_SPLIT`] warps, and derives the cost of a pair of blocks on a tensor-core warp
//! and of an edge on a CUDA-core warp. A work item (window, head) costs the slower of its two
//! sides: `max(⌈pairs / T⌉ · c_pair, edges / C · c_edge)` for `T` tensor-core and `C` CUDA-core
//! warps. The plan evaluates every threshold (popcount 0..=129 of 128) and every split of
//! [`WARPS`] warps over all windows, keeps the cheapest prediction, times it, and keeps
//! whichever of it and the two calibration runs was fastest.

use crate::hybrid_plan::{choose_split, Candidates};
use crate::hybrid_spmm::slice_for;
use crate::tune::median_ms;
use crate::{DType, DTypeKind, DeviceHybrid, DeviceMatrix, Gpu, Shape, WarpSplit};
use spattn_formats::{Csr, HybridBlocks};

use crate::error::{Error, Result};
use spattn_formats::Reorder;
use spattn_formats::RowOrder;

/// Warps per CTA the model splits.
pub(crate) const WARPS: usize = 4;
/// The warp split of the calibration runs.
pub(crate) const CALIBRATION_SPLIT: WarpSplit = WarpSplit { tc: 2, cd: 2 };

/// The name in errors and reports.
const KERNEL: &str = "hybrid";

/// Fixed parameters of the hybrid algorithm (instead of timing candidates at plan time).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HybridParams {
    /// Fill threshold (edges / 128 of a 16×8 block) at or above which a block goes to tensor
    /// cores: 0 sends every block there, anything above 1 every edge to CUDA cores.
    pub threshold: f64,
    /// Tensor-core warps per CTA (≥ 1).
    pub tc_warps: usize,
    /// CUDA-core warps per CTA (≥ 1; at most 8 warps in all).
    pub cd_warps: usize,
}

/// What the hybrid plan chose, and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HybridInfo {
    /// Fill threshold (popcount / 128) at or above which a block goes to tensor cores.
    pub threshold: f64,
    /// Tensor-core warps per CTA.
    pub tc_warps: usize,
    /// CUDA-core warps per CTA.
    pub cd_warps: usize,
    /// Fraction of the edges on tensor cores.
    pub tc_edge_fraction: f64,
    /// Fraction of the edges on CUDA cores.
    pub cd_edge_fraction: f64,
    /// Measured time of the all-tensor-core calibration run, ms (NaN if not calibrated).
    pub all_tc_ms: f64,
    /// Measured time of the all-CUDA-core calibration run, ms (NaN if not calibrated).
    pub all_cd_ms: f64,
    /// Measured time of the chosen configuration, ms (NaN if not calibrated).
    pub chosen_ms: f64,
    /// The model's prediction for the chosen configuration, ms (NaN if not calibrated, and
    /// for the pipelined kernel, whose plan times its candidates instead of predicting).
    pub predicted_ms: f64,
    /// Configurations timed at plan time (0 when the parameters were fixed).
    pub candidates: usize,
}

impl std::fmt::Display for HybridInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A time not measured (or not predicted) reads "-", not "NaN".
        let ms = |x: f64| {
            if x.is_nan() {
                "-".to_string()
            } else {
                format!("{x:.4} ms")
            }
        };
        write!(
            f,
            "hybrid threshold {:.4} ({} TC : {} CD warps), edges {:.1}% TC / {:.1}% CD; \
             all-TC {}, all-CD {}, chosen {} (predicted {}; {} timed)",
            self.threshold,
            self.tc_warps,
            self.cd_warps,
            100.0 * self.tc_edge_fraction,
            100.0 * self.cd_edge_fraction,
            ms(self.all_tc_ms),
            ms(self.all_cd_ms),
            ms(self.chosen_ms),
            ms(self.predicted_ms),
            self.candidates
        )
    }
}

/// Per window: the popcounts of its blocks (non-increasing) and its edge count.
struct WindowProfile {
    pops: Vec<u32>,
    edges: u64,
}

/// Predicted cost of every (popcount threshold, tensor-core warps) in units of the calibrated
/// costs: `cost[p][t - 1]` for threshold `p / 128` and `t` tensor-core warps of [`WARPS`].
fn predict(profiles: &[WindowProfile], c_pair: f64, c_edge: f64) -> Vec<[f64; WARPS - 1]> {
    let mut cost = vec![[0.0f64; WARPS - 1]; 130];
    for w in profiles {
        // Walk the thresholds from high (nothing dense) to low, adding blocks as they qualify.
        let mut k = 0usize;
        let mut tc_edges = 0u64;
        for p in (0..130u32).rev() {
            while k < w.pops.len() && w.pops[k] >= p {
                tc_edges += u64::from(w.pops[k]);
                k += 1;
            }
            let pairs = k.div_ceil(2) as f64;
            let cd_edges = (w.edges - tc_edges) as f64;
            for (i, c) in cost[p as usize].iter_mut().enumerate() {
                let t = (i + 1) as f64;
                let tc = (pairs / t).ceil() * c_pair;
                let cd = cd_edges / (WARPS as f64 - t) * c_edge;
                *c += tc.max(cd);
            }
        }
    }
    cost
}

/// The hybrid algorithm of one plan.
#[derive(Debug)]
pub struct Hybrid {
    device: DeviceHybrid,
    warps: WarpSplit,
    info: HybridInfo,
}

impl Hybrid {
    /// Whether the hybrid kernel can run heads of `head_dim` features of `dtype`.
    pub fn supports(head_dim: usize, dtype: DTypeKind) -> Result<()> {
        slice_for(head_dim, dtype)
            .map(|_| ())
            .map_err(|why| Error::Unsupported {
                kernel: KERNEL,
                why,
            })
    }

    /// Whether heads of `head_dim` features of `dtype` run the pipelined kernel: f16 or bf16 at
    /// exactly 64 or 128 features (each tensor-core warp owns a window and streams its K/V
    /// tiles through shared memory, as fused-tc's pipelined kernel), which takes at most 4
    /// tensor-core warps and one CUDA-core warp per CTA ([`HybridParams`]).
    ///
    /// ```
    /// use spattn_ops::{DTypeKind, Hybrid};
    /// assert!(Hybrid::pipelined(DTypeKind::F16, 128));
    /// assert!(!Hybrid::pipelined(DTypeKind::F32, 64));
    /// assert!(!Hybrid::pipelined(DTypeKind::Bf16, 96));
    /// ```
    pub fn pipelined(dtype: DTypeKind, head_dim: usize) -> bool {
        DeviceHybrid::pipelined(dtype, head_dim)
    }

    /// Builds the tile structure of `graph`, calibrates the cost model on `gpu` (unless
    /// `params` fixes the threshold and the split) and uploads the chosen split.
    pub fn new<T: DType>(
        gpu: &Gpu,
        graph: &Csr,
        heads: usize,
        head_dim: usize,
        scale: f32,
        params: Option<HybridParams>,
        reorder: Reorder,
    ) -> Result<Self> {
        Self::supports(head_dim, T::KIND)?;
        if let Err(e) = gpu.require_compute_capability("hybrid (mma.sync)", 8, 0) {
            return Err(Error::Unsupported {
                kernel: KERNEL,
                why: format!("{e}; use fused-csr"),
            });
        }
        let order = RowOrder::choose(graph, reorder, 16)?;
        let blocks = HybridBlocks::from_csr_in_row_order(graph, &order)?;
        let nnz = graph.nnz().max(1) as f64;
        let info_of = |split: &spattn_formats::HybridSplit, w: WarpSplit| HybridInfo {
            threshold: split.threshold(),
            tc_warps: w.tc,
            cd_warps: w.cd,
            tc_edge_fraction: split.tc_edges() as f64 / nnz,
            cd_edge_fraction: split.cd_edges() as f64 / nnz,
            all_tc_ms: f64::NAN,
            all_cd_ms: f64::NAN,
            chosen_ms: f64::NAN,
            predicted_ms: f64::NAN,
            candidates: 0,
        };
        let pipelined = DeviceHybrid::pipelined(T::KIND, head_dim);
        if let Some(p) = params {
            let warps = WarpSplit::new(p.tc_warps, p.cd_warps)?;
            let split = blocks.classify(p.threshold)?;
            let device = DeviceHybrid::upload(gpu, &blocks, &split, heads)?;
            device.check_warps(warps, pipelined)?;
            return Ok(Self {
                device,
                warps,
                info: info_of(&split, warps),
            });
        }

        // Calibration: all blocks on tensor cores, then all edges on CUDA cores.
        let shape_q = Shape::new(graph.n_rows(), heads, head_dim)?;
        let shape_kv = Shape::new(graph.n_cols(), heads, head_dim)?;
        let q = DeviceMatrix::<T>::zeros(gpu, shape_q)?;
        // K and V in separate buffers: one buffer for both would halve the gathered bytes
        // and time a kernel that runs faster than the caller's.
        let k = DeviceMatrix::<T>::zeros(gpu, shape_kv)?;
        let v = DeviceMatrix::<T>::zeros(gpu, shape_kv)?;
        let mut out = DeviceMatrix::<T>::zeros(gpu, shape_q)?;
        let mut time = |d: &DeviceHybrid, w: WarpSplit| -> crate::Result<f64> {
            median_ms(gpu, || d.attention(gpu, &q, &k, &v, scale, w, &mut out))
        };
        if pipelined {
            return Self::choose_pipelined(gpu, &blocks, heads, graph.nnz(), &mut time);
        }
        let all_tc = blocks.classify(0.0)?;
        let all_cd = blocks.classify(2.0)?;
        let d_tc = DeviceHybrid::upload(gpu, &blocks, &all_tc, heads)?;
        let t_tc = time(&d_tc, CALIBRATION_SPLIT)?;
        drop(d_tc);
        let d_cd = DeviceHybrid::upload(gpu, &blocks, &all_cd, heads)?;
        let t_cd = time(&d_cd, CALIBRATION_SPLIT)?;

        let profiles: Vec<WindowProfile> = (0..blocks.n_windows())
            .map(|w| {
                let pops: Vec<u32> = blocks.bitmaps()[blocks.window_blocks(w)]
                    .iter()
                    .map(|b| b.count_ones())
                    .collect();
                let edges = pops.iter().map(|&p| u64::from(p)).sum();
                WindowProfile { pops, edges }
            })
            .collect();
        // Work of the calibration runs in model units: the all-TC run is Σ ⌈pairs / 2⌉ pair
        // steps per warp, the all-CD run Σ edges / 2 edges per warp.
        let (ct, cc) = (CALIBRATION_SPLIT.tc as f64, CALIBRATION_SPLIT.cd as f64);
        let tc_steps: f64 = profiles
            .iter()
            .map(|w| (w.pops.len().div_ceil(2) as f64 / ct).ceil())
            .sum();
        let cd_steps: f64 = profiles.iter().map(|w| w.edges as f64 / cc).sum();
        let c_pair = t_tc / tc_steps.max(1.0);
        let c_edge = t_cd / cd_steps.max(1.0);
        let cost = predict(&profiles, c_pair, c_edge);
        let (mut best_p, mut best_t, mut best) = (0usize, 1usize, f64::INFINITY);
        for (p, row) in cost.iter().enumerate() {
            for (i, &c) in row.iter().enumerate() {
                if c < best {
                    (best_p, best_t, best) = (p, i + 1, c);
                }
            }
        }
        // Popcount threshold p as a fill; 129 (above 1) sends every edge to CUDA cores.
        let threshold = best_p as f64 / 128.0;
        let warps = WarpSplit::new(best_t, WARPS - best_t)?;
        let split = blocks.classify(threshold)?;
        let device =
            DeviceHybrid::upload_with_costs(gpu, &blocks, &split, heads, c_pair / 2.0, c_edge)?;
        let t_chosen = time(&device, warps)?;
        let mut info = info_of(&split, warps);
        info.candidates = 3;
        info.all_tc_ms = t_tc;
        info.all_cd_ms = t_cd;
        info.chosen_ms = t_chosen;
        info.predicted_ms = best;
        // Keep the measured best of the chosen split and the two calibration runs.
        if t_chosen <= t_tc.min(t_cd) {
            return Ok(Self {
                device,
                warps,
                info,
            });
        }
        drop(device);
        let (split, device) = if t_tc <= t_cd {
            (&all_tc, DeviceHybrid::upload(gpu, &blocks, &all_tc, heads)?)
        } else {
            (&all_cd, d_cd)
        };
        let mut fallback = info_of(split, CALIBRATION_SPLIT);
        fallback.all_tc_ms = t_tc;
        fallback.all_cd_ms = t_cd;
        fallback.chosen_ms = t_tc.min(t_cd);
        fallback.predicted_ms = best;
        fallback.candidates = 3;
        Ok(Self {
            device,
            warps: CALIBRATION_SPLIT,
            info: fallback,
        })
    }

    /// The pipelined kernel's plan: times the candidates of the module documentation with
    /// `time` and keeps the fastest.
    fn choose_pipelined(
        gpu: &Gpu,
        blocks: &HybridBlocks,
        heads: usize,
        nnz: usize,
        time: &mut dyn FnMut(&DeviceHybrid, WarpSplit) -> crate::Result<f64>,
    ) -> Result<Self> {
        let c = choose_split(gpu, blocks, heads, nnz, Candidates::PIPELINED, time)?;
        let split = c.device.stats();
        let nnz_f = nnz.max(1) as f64;
        let info = HybridInfo {
            threshold: c.threshold,
            tc_warps: c.warps.tc,
            cd_warps: c.warps.cd,
            tc_edge_fraction: split.tc_edges as f64 / nnz_f,
            cd_edge_fraction: split.cd_edges as f64 / nnz_f,
            all_tc_ms: c.all_tc_ms,
            all_cd_ms: c.all_cd_ms,
            chosen_ms: c.chosen_ms,
            predicted_ms: f64::NAN,
            candidates: c.candidates,
        };
        Ok(Self {
            device: c.device,
            warps: c.warps,
            info,
        })
    }

    /// What the plan chose.
    pub fn info(&self) -> HybridInfo {
        self.info
    }

    /// `out = softmax(scale · Q Kᵀ ⊙ A) · V` in one kernel; shapes are checked by the plan.
    pub fn forward<T: DType>(
        &self,
        gpu: &Gpu,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        scale: f32,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        self.device.attention(gpu, q, k, v, scale, self.warps, out)
    }

    /// [`forward`](Self::forward) with a score bias and dropout in the caller's CSR order of
    /// `graph`, the graph this plan was built from (see
    /// `DeviceHybrid::attention_with_extras`).
    ///
    /// Errors: as that method.
    pub fn forward_with_extras<T: DType>(
        &self,
        gpu: &Gpu,
        graph: &Csr,
        qkv: (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        scale: f32,
        extras: &super::CsrExtras<'_, T>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        self.device
            .attention_with_extras(gpu, graph, qkv, scale, self.warps, extras, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_prefers_the_cheaper_side() {
        // One window of 4 full blocks (512 edges): tensor cores win when pairs are cheap.
        let w = vec![WindowProfile {
            pops: vec![128; 4],
            edges: 512,
        }];
        let cost = predict(&w, 1.0, 1.0);
        // p = 0: all TC; 2 pairs. With 1 TC warp: 2; 2: 1; 3: 1.
        assert_eq!(cost[0], [2.0, 1.0, 1.0]);
        // p = 129: all CD; 512 edges over 3, 2, 1 CD warps.
        assert_eq!(cost[129], [512.0 / 3.0, 256.0, 512.0]);
        // A window of sparse blocks: CUDA cores win whatever the pair cost is.
        let sparse = vec![WindowProfile {
            pops: vec![1; 40],
            edges: 40,
        }];
        let cost = predict(&sparse, 50.0, 1.0);
        let best = cost
            .iter()
            .enumerate()
            .flat_map(|(p, r)| r.iter().map(move |&c| (p, c)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap();
        assert!(best.0 > 1, "{best:?}");
    }

    #[test]
    fn supported_heads() {
        assert!(Hybrid::supports(128, DTypeKind::F16).is_ok());
        assert!(Hybrid::supports(1, DTypeKind::Bf16).is_ok());
        assert!(Hybrid::supports(64, DTypeKind::F32).is_ok());
        assert!(matches!(
            Hybrid::supports(129, DTypeKind::F16),
            Err(Error::Unsupported { .. })
        ));
        assert!(Hybrid::supports(65, DTypeKind::F32).is_err());
        assert!(Hybrid::supports(0, DTypeKind::F32).is_err());
    }

    #[test]
    fn info_says_what_was_not_measured() {
        let mut info = HybridInfo {
            threshold: 0.0625,
            tc_warps: 2,
            cd_warps: 1,
            tc_edge_fraction: 0.953,
            cd_edge_fraction: 0.047,
            all_tc_ms: 0.0188,
            all_cd_ms: 0.0267,
            chosen_ms: 0.0173,
            predicted_ms: f64::NAN,
            candidates: 11,
        };
        let s = info.to_string();
        assert!(
            s.contains("chosen 0.0173 ms (predicted -; 11 timed)"),
            "{s}"
        );
        info.all_tc_ms = f64::NAN;
        assert!(info.to_string().contains("all-TC -, all-CD 0.0267 ms"));
    }
}
