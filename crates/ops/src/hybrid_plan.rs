//! Choosing a hybrid split by measurement (cuDNN-benchmark style), and [`HybridSpmm`]: a hybrid
//! SpMM planned once and run many times.
//!
//! [`choose_split`] times a few candidate (threshold, warp split) pairs of one
//! [`HybridBlocks`] structure with a caller's timing closure and keeps the fastest: every
//! block on tensor cores, every edge on CUDA cores, and for each of [`CD_FRACTIONS`] the
//! highest fill threshold that leaves at most that share of the edges to CUDA cores
//! ([`candidate_thresholds`]), with 1, 2 and 3 tensor-core warps per CUDA-core warp (the
//! pipelined kernel) or the splits of 4 warps (the general kernel). A mixed candidate is kept
//! only when it beats the faster pure run by [`MIXED_MARGIN`] (timing noise on small graphs).
//! The unit schedule of the mixed candidates is built from the costs the two extreme runs
//! measured. `spattn`'s hybrid attention plan and [`HybridSpmm`] both use it.
//!
//! ```no_run
//! use spattn_formats::{Csr, Reorder};
//! use spattn_ops::{DeviceMatrix, Gpu, HybridSpmm, Shape};
//! let gpu = Gpu::new(0)?;
//! let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (1, 0), (2, 2)])?;
//! let plan = HybridSpmm::plan::<half::f16>(&gpu, &a, 1, 64, Reorder::Auto)?;
//! println!("{}", plan.info());
//! let shape = Shape::new(3, 1, 64)?;
//! let v = DeviceMatrix::<half::f16>::zeros(&gpu, shape)?;
//! let mut out = DeviceMatrix::<half::f16>::zeros(&gpu, shape)?;
//! plan.run(&gpu, &v, &mut out)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use spattn_formats::{Csr, HybridBlocks, Reorder, RowOrder};

use crate::buffer::DeviceMatrix;
use crate::dtype::{DType, DTypeKind};
use crate::error::Result;
use crate::gpu::Gpu;
use crate::hybrid_spmm::{spmm_widths, spmm_with, DeviceHybrid, WarpSplit};
use crate::shape::Shape;
use crate::tune::{median_ms, Fastest};
use crate::Error;

/// Shares of the edges the search tries on CUDA cores (besides none and all).
pub(crate) const CD_FRACTIONS: [f64; 3] = [0.05, 0.15, 0.3];
/// How much faster than the faster pure run (all tensor cores or all CUDA cores) a mixed
/// candidate must time to be kept: single-launch medians of small graphs move by about this
/// much between calls (docs/kernels/hybrid.md).
pub(crate) const MIXED_MARGIN: f64 = 0.05;

/// Whether a mixed candidate timed `t` ms replaces the best so far (`best` ms), given the
/// faster pure run `pure` ms: it must be faster than both, and faster than `pure` by
/// [`MIXED_MARGIN`].
fn keeps_mixed(t: f64, best: f64, pure: f64) -> bool {
    t < best && t < pure * (1.0 - MIXED_MARGIN)
}

/// The warp splits [`choose_split`] tries for one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Candidates {
    /// The split of the all-tensor-core run.
    pub all_tc: WarpSplit,
    /// The split of the all-CUDA-core run.
    pub all_cd: WarpSplit,
    /// The splits tried at each mixed threshold.
    pub mixed: [WarpSplit; 3],
}

impl Candidates {
    /// The pipelined kernel's candidates (see [`DeviceHybrid::pipelined`]): 2 tensor-core
    /// warps without a CUDA-core warp (fused-tc's CTA shape), 1 + 1, and 1, 2 or 3 tensor-core
    /// warps beside one CUDA-core warp.
    pub(crate) const PIPELINED: Self = Self {
        all_tc: WarpSplit { tc: 2, cd: 0 },
        all_cd: WarpSplit { tc: 1, cd: 1 },
        mixed: [
            WarpSplit { tc: 1, cd: 1 },
            WarpSplit { tc: 2, cd: 1 },
            WarpSplit { tc: 3, cd: 1 },
        ],
    };
    /// The general kernel's candidates: CTAs of 4 warps.
    pub(crate) const GENERAL: Self = Self {
        all_tc: WarpSplit { tc: 4, cd: 0 },
        all_cd: WarpSplit { tc: 1, cd: 3 },
        mixed: [
            WarpSplit { tc: 1, cd: 3 },
            WarpSplit { tc: 2, cd: 2 },
            WarpSplit { tc: 3, cd: 1 },
        ],
    };
    /// The candidates of the kernel that runs `pipelined` (see [`DeviceHybrid::pipelined`]).
    pub(crate) fn for_kernel(pipelined: bool) -> Self {
        if pipelined {
            Self::PIPELINED
        } else {
            Self::GENERAL
        }
    }
}

/// The thresholds [`choose_split`] tries besides 0 and "all on CUDA cores": for each of
/// [`CD_FRACTIONS`], the highest popcount threshold `p / 128` whose blocks below it hold at
/// most that fraction of the `nnz` edges, where that is some edges; distinct, increasing.
pub(crate) fn candidate_thresholds(blocks: &HybridBlocks, nnz: usize) -> Vec<f64> {
    let mut hist = [0u64; 129];
    for b in blocks.bitmaps() {
        hist[b.count_ones() as usize] += 1;
    }
    // below[p]: edges in blocks of popcount < p, for p in 0..=129.
    let mut below = [0u64; 130];
    for p in 1..130 {
        below[p] = below[p - 1] + (p as u64 - 1) * hist[p - 1];
    }
    let mut out: Vec<f64> = Vec::new();
    for f in CD_FRACTIONS {
        let limit = f * nnz as f64;
        let Some(p) = (1..=128).rev().find(|&p| below[p] as f64 <= limit) else {
            continue;
        };
        let t = p as f64 / 128.0;
        if below[p] > 0 && !out.contains(&t) {
            out.push(t);
        }
    }
    out
}

/// What [`choose_split`] kept, with the times it measured (ms).
#[derive(Debug)]
pub(crate) struct SplitChoice {
    /// The chosen split, uploaded.
    pub device: DeviceHybrid,
    /// The chosen warps per CTA.
    pub warps: WarpSplit,
    /// The chosen fill threshold (above 1: every edge on CUDA cores).
    pub threshold: f64,
    /// The all-tensor-core run.
    pub all_tc_ms: f64,
    /// The all-CUDA-core run.
    pub all_cd_ms: f64,
    /// The chosen configuration's run.
    pub chosen_ms: f64,
    /// Configurations timed.
    pub candidates: usize,
}

/// Times the candidates of the module documentation on `blocks` (for `heads` heads; `nnz`
/// edges) with `time` (one configuration's time, ms) and keeps the fastest.
///
/// Errors: those of uploading and of `time`.
pub(crate) fn choose_split(
    gpu: &Gpu,
    blocks: &HybridBlocks,
    heads: usize,
    nnz: usize,
    warps: Candidates,
    time: &mut dyn FnMut(&DeviceHybrid, WarpSplit) -> Result<f64>,
) -> Result<SplitChoice> {
    let all_tc = blocks.classify(0.0).map_err(formats_error)?;
    let all_cd = blocks.classify(2.0).map_err(formats_error)?;
    let d_tc = DeviceHybrid::upload(gpu, blocks, &all_tc, heads)?;
    let t_tc = time(&d_tc, warps.all_tc)?;
    let d_cd = DeviceHybrid::upload(gpu, blocks, &all_cd, heads)?;
    let t_cd = time(&d_cd, warps.all_cd)?;
    // Unit schedule costs from the two extremes: per block on a tensor-core warp, per edge on
    // a CUDA-core warp (only their ratio and scale against the unit bound matter).
    let block_cost = (t_tc / blocks.n_blocks().max(1) as f64).max(f64::MIN_POSITIVE);
    let edge_cost = (t_cd / nnz.max(1) as f64).max(f64::MIN_POSITIVE);
    let mut best = if t_tc <= t_cd {
        (t_tc, 0.0, warps.all_tc, d_tc)
    } else {
        (t_cd, 2.0, warps.all_cd, d_cd)
    };
    // The faster pure run, which a mixed candidate must beat by the margin.
    let pure = best.0;
    let mut candidates = 2;
    for threshold in candidate_thresholds(blocks, nnz) {
        let split = blocks.classify(threshold).map_err(formats_error)?;
        let device =
            DeviceHybrid::upload_with_costs(gpu, blocks, &split, heads, block_cost, edge_cost)?;
        let mut kept = false;
        for w in warps.mixed {
            let t = time(&device, w)?;
            candidates += 1;
            if keeps_mixed(t, best.0, pure) {
                (best.0, best.1, best.2) = (t, threshold, w);
                kept = true;
            }
        }
        if kept {
            best.3 = device;
        }
    }
    let (chosen_ms, threshold, warps, device) = best;
    Ok(SplitChoice {
        device,
        warps,
        threshold,
        all_tc_ms: t_tc,
        all_cd_ms: t_cd,
        chosen_ms,
        candidates,
    })
}

fn formats_error(e: spattn_formats::Error) -> Error {
    Error::InvalidArgument {
        what: "hybrid split",
        why: e.to_string(),
    }
}

/// A hybrid SpMM `out[i, h, :] = Σ_j A[i, j] · V[j, h, :]` planned once for one matrix and
/// shape: rows renumbered as a [`Reorder`] asks (zero-copy: V and out stay in the caller's
/// order), and, by timing on scratch buffers of `heads × head_dim` features of `T`, the
/// feature width the kernel runs each row in (each of the candidate widths) and for it the
/// threshold and the warp split (`choose_split`). Run it with [`HybridSpmm::run`].
#[derive(Debug)]
pub struct HybridSpmm {
    choice: SplitChoice,
    order: RowOrder,
    dtype: DTypeKind,
    heads: usize,
    head_dim: usize,
    width: usize,
}

impl HybridSpmm {
    /// Plans the hybrid SpMM of `a` (binary, or weighted by its values) for V of
    /// `a.n_cols() × heads × head_dim` and out of `a.n_rows() × heads × head_dim` of `T`.
    ///
    /// Every shape is taken: a row's `heads × head_dim` features run as pieces of a width one
    /// warp holds (the largest divisor of `heads × head_dim` that a warp's slice holds, when
    /// no wider width divides it).
    ///
    /// Errors: [`Error::InvalidArgument`] for zero heads or head_dim,
    /// [`Error::UnsupportedComputeCapability`] below 8.0, allocation and launch failures.
    pub fn plan<T: DType>(
        gpu: &Gpu,
        a: &Csr,
        heads: usize,
        head_dim: usize,
        reorder: Reorder,
    ) -> Result<Self> {
        let v = DeviceMatrix::<T>::zeros(gpu, Shape::new(a.n_cols(), heads, head_dim)?)?;
        let mut out = DeviceMatrix::<T>::zeros(gpu, Shape::new(a.n_rows(), heads, head_dim)?)?;
        gpu.require_compute_capability("hybrid kernels (mma.sync)", 8, 0)?;
        let widths = spmm_widths(T::KIND, heads, head_dim);
        let order = RowOrder::choose(a, reorder, 16).map_err(formats_error)?;
        let blocks = HybridBlocks::from_csr_in_row_order(a, &order).map_err(formats_error)?;
        let mut fastest = Fastest::new();
        for &width in &widths {
            let pipelined = DeviceHybrid::pipelined(T::KIND, width);
            let mut time = |d: &DeviceHybrid, w: WarpSplit| -> Result<f64> {
                median_ms(gpu, || spmm_with(gpu, d, &v, w, width, &mut out))
            };
            let choice = choose_split(
                gpu,
                &blocks,
                heads * head_dim / width,
                a.nnz(),
                Candidates::for_kernel(pipelined),
                &mut time,
            )?;
            let ms = choice.chosen_ms;
            fastest.offer(format!("width {width}"), (choice, width), ms, 0.0);
        }
        let Some(((choice, width), _)) = fastest.into_best() else {
            return Err(Error::InvalidArgument {
                what: "hybrid SpMM shape",
                why: format!("{heads} heads × {head_dim} features: no feature width"),
            });
        };
        Ok(Self {
            choice,
            order,
            dtype: T::KIND,
            heads,
            head_dim,
            width,
        })
    }

    /// `out = A · V` (dtype and shapes as planned).
    ///
    /// Errors: [`Error::InvalidArgument`] when `T` is not the planned dtype (the warp split
    /// was chosen for that dtype's kernel); [`Error::ShapeMismatch`] naming the operand when V
    /// or out does not have the planned rows, heads and head_dim; [`Error::ForeignGpu`];
    /// launch failures.
    pub fn run<T: DType>(
        &self,
        gpu: &Gpu,
        v: &DeviceMatrix<T>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        if T::KIND != self.dtype {
            return Err(Error::InvalidArgument {
                what: "hybrid SpMM dtype",
                why: format!("planned for {}, run with {}", self.dtype, T::KIND),
            });
        }
        let planned = Shape::new(self.choice.device.n_cols(), self.heads, self.head_dim)?;
        planned.expect_rows_like("V", v.shape(), self.choice.device.n_cols())?;
        planned.expect_rows_like("out", out.shape(), self.choice.device.n_rows())?;
        spmm_with(
            gpu,
            &self.choice.device,
            v,
            self.choice.warps,
            self.width,
            out,
        )
    }

    /// The feature width the kernel runs each row's `heads × head_dim` features in (one of
    /// the candidate widths, the fastest measured).
    pub fn width(&self) -> usize {
        self.width
    }

    /// What the plan measured and chose (the probes' table).
    #[cfg(test)]
    pub(crate) fn choice(&self) -> &SplitChoice {
        &self.choice
    }

    /// One line for a report: the row order, the threshold, the split, the edge shares and the
    /// measured times.
    pub fn info(&self) -> String {
        let c = &self.choice;
        let s = c.device.stats();
        let nnz = (s.tc_edges + s.cd_edges).max(1) as f64;
        let widths_timed = spmm_widths(self.dtype, self.heads, self.head_dim).len();
        format!(
            "{}; features as {} × {} ({} width{} timed); hybrid threshold {:.4} ({} TC : {} CD \
             warps), edges {:.1}% TC / {:.1}% CD; all-TC {:.4} ms, all-CD {:.4} ms, chosen \
             {:.4} ms ({} timed)",
            self.order.info(),
            self.heads * self.head_dim / self.width,
            self.width,
            widths_timed,
            if widths_timed == 1 { "" } else { "s" },
            c.threshold,
            c.warps.tc,
            c.warps.cd,
            100.0 * s.tc_edges as f64 / nnz,
            100.0 * s.cd_edges as f64 / nnz,
            c.all_tc_ms,
            c.all_cd_ms,
            c.chosen_ms,
            c.candidates
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidate_thresholds_example() -> std::result::Result<(), Box<dyn std::error::Error>> {
        use spattn_formats::{Csr, HybridBlocks};
        // 16 rows × 8 columns, all set: one full block, nothing a CUDA core could take.
        let edges: Vec<(u32, u32)> = (0..16).flat_map(|r| (0..8).map(move |c| (r, c))).collect();
        let a = Csr::from_edges(16, 8, &edges)?;
        let blocks = HybridBlocks::from_csr(&a)?;
        assert!(crate::hybrid_plan::candidate_thresholds(&blocks, a.nnz()).is_empty());
        Ok(())
    }

    #[test]
    fn a_mixed_split_must_beat_the_pure_runs_by_the_margin() {
        // 4% faster than the pure run: within the noise, not kept.
        assert!(!keeps_mixed(0.96, 1.0, 1.0));
        // 6% faster: kept.
        assert!(keeps_mixed(0.94, 1.0, 1.0));
        // Against an earlier mixed candidate only "faster" counts, the margin is to the pure run.
        assert!(keeps_mixed(0.93, 0.935, 1.0));
        assert!(!keeps_mixed(0.94, 0.93, 1.0));
    }

    #[test]
    fn thresholds_leave_the_asked_shares() {
        // Window 0: rows 0..16 all hit columns 0..8 (one full block, 128 edges); rows 16..32
        // (window 1) each hit 4 columns of their own (64 edges in 8 blocks of popcount 8).
        let mut edges: Vec<(u32, u32)> =
            (0..16).flat_map(|r| (0..8).map(move |c| (r, c))).collect();
        edges.extend((16..32u32).flat_map(|r| (0..4).map(move |c| (r, 100 + 4 * r + c))));
        let a = Csr::from_edges(32, 300, &edges).unwrap();
        let blocks = HybridBlocks::from_csr(&a).unwrap();
        let nnz = a.nnz();
        assert_eq!(nnz, 192);
        // 64 of 192 edges (1/3) are in popcount-8 blocks: above every asked share (≤ 0.3), so
        // the highest threshold under each share leaves none on CUDA cores: no candidate.
        assert!(candidate_thresholds(&blocks, nnz).is_empty());
        // With 1000 extra edges in full blocks, 64 / 1192 = 5.4%: only 0.15 and 0.3 take the
        // sparse blocks, both at the highest threshold below the full blocks (one candidate).
        let mut more = edges.clone();
        more.extend((32..160u32).flat_map(|r| (0..8).map(move |c| (r, 200 + 8 * (r / 16) + c))));
        let b = Csr::from_edges(160, 300, &more).unwrap();
        let blocks = HybridBlocks::from_csr(&b).unwrap();
        let t = candidate_thresholds(&blocks, b.nnz());
        assert_eq!(t, vec![128.0 / 128.0]);
        let split = blocks.classify(t[0]).unwrap();
        assert_eq!(split.cd_edges(), 64);
    }
}
