//! Edge features in the tensor-core backward (the `_xf` kernels of backward_tc.cu): the
//! gradients of `out_i = Σ_j P_ij (v_j + f_e)` with `P` the row softmax of `scale · ⟨q_i, k_j +
//! f_e⟩` (fused-tc's `_xf` forward, fused-csr's and the composition's with edge features).
//!
//! The stats and dq passes copy each step's feature rows into its stage beside K and V and add
//! `X = Q Fᵀ` to the scores and `Y = dOut Fᵀ` to dP by `mma`, chunk by chunk of 16 of the step's
//! edges. The dq pass adds `dS' F` to dQ, writes `∂L/∂f_e = scale · dS_e · q_i + P_e · dOut_i`
//! (an `mma` over the window's Q and dOut rows), and leaves per edge and head the pair
//! `(scale · log2 e · X_e − lse2_i, Y_e − D_i)` at the edge's place in Aᵀ's BSB; the dK/dV pass,
//! run after it, reads the pairs instead of the columns' statistics and no feature row. Every
//! edge belongs to one unit of each pass: still deterministic.

use super::{LaunchExtras, LaunchFeatures, TensorCoreBackward, TransposeExtras, KERNEL};
use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::device_bsb::BsbBlocks;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::fused::CsrExtras;
use crate::gpu::Gpu;
use crate::graph::DeviceGraph;
use crate::launch::{check_same_gpu, product, to_u32};
use crate::shape::Shape;

impl TensorCoreBackward {
    /// [`run`](Self::run) for the forward with edge features `out_i = Σ_j P_ij (v_j + e_ij)`,
    /// `P` the row softmax of `scale · ⟨q_i, k_j + e_ij⟩` (`graph` the state's;
    /// `edge_features` nnz × heads × head_dim, row `e` for A's edge `e` in the caller's CSR
    /// order): also writes ∂L/∂E into every row of `d_edge_features` (same shape). The first
    /// call with extras builds both BSBs' edge maps on the host and uploads them; the first with
    /// edge features also the places of A's edges among Aᵀ's and a buffer of two f32 per edge
    /// and head. No bias or dropout beside the features (the composition takes those).
    ///
    /// Errors: as [`run`](Self::run); [`Error::InvalidArgument`] for a `graph` that is not the
    /// state's; [`Error::ShapeMismatch`] for the edge features or their gradient.
    #[allow(clippy::too_many_arguments)]
    pub fn run_with_edge_features<T: DType>(
        &mut self,
        gpu: &Gpu,
        graph: &DeviceGraph,
        scale: f32,
        operands: [&DeviceMatrix<T>; 4],
        grads: [&mut DeviceMatrix<T>; 3],
        edge_features: &DeviceMatrix<T>,
        d_edge_features: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        self.check_graph(graph)?;
        let shape = Shape::new(self.a_side.n_rows, self.heads, self.head_dim)?;
        let extras = CsrExtras {
            edge_features: Some(edge_features),
            ..CsrExtras::default()
        };
        extras.check(gpu, KERNEL, graph.nnz(), shape, true)?;
        Shape::new(graph.nnz(), self.heads, self.head_dim)?
            .expect_eq("d_edge_features", d_edge_features.shape())?;
        check_same_gpu(gpu, "d_edge_features", &*d_edge_features)?;
        let a = graph.host()?;
        let mut sides = match self.extras.take() {
            Some(x) if x.1.pair_pos.is_some() => x,
            kept => {
                let a_ids = self.a.edge_map(a)?.1;
                let tx = TransposeExtras::new(gpu, &self.t, a, Some(a_ids))?;
                let stage = kept.map(|x| x.0).unwrap_or_default();
                Box::new((stage, tx))
            }
        };
        let (a_bsb, t_bsb) = (
            std::sync::Arc::clone(&self.a),
            std::sync::Arc::clone(&self.t),
        );
        let heads = self.heads;
        let result = (|| {
            let (a_stage, tx) = &mut *sides;
            let (a_starts, a_ids) = a_bsb.device_edge_map(gpu, a)?;
            let n_pairs = tx.ids.len();
            let pairs_len = product("pairs (2 × edges × heads)", &[2, n_pairs, heads])?;
            if tx.pairs.as_ref().is_none_or(|p| p.len() < pairs_len) {
                tx.pairs = None;
                tx.pairs = Some(DeviceVec::alloc(gpu, "backward pairs", pairs_len, true)?);
            }
            // The gathers take no bias or dropout: they hand the launches each BSB's edge starts.
            let ga = a_stage.gather(
                gpu,
                a_ids,
                BsbBlocks {
                    bitmaps: a_bsb.device.bitmap_words(),
                    block_edge_start: a_starts,
                    n_blocks: a_bsb.device.n_blocks(),
                },
                heads,
                &extras,
            )?;
            let gt = tx.stage.gather(
                gpu,
                &tx.ids,
                BsbBlocks {
                    bitmaps: t_bsb.device.bitmap_words(),
                    block_edge_start: &tx.starts,
                    n_blocks: t_bsb.device.n_blocks(),
                },
                heads,
                &extras,
            )?;
            let (Some(pairs), Some(pair_pos)) = (tx.pairs.as_mut(), tx.pair_pos.as_ref()) else {
                return Err(Error::InvalidArgument {
                    what: "edge features",
                    why: "the pairs' buffers were not kept".into(),
                });
            };
            let x = LaunchExtras {
                a: &ga,
                t: &gt,
                a_ids,
                d_bias: None,
                feats: Some(LaunchFeatures {
                    feats: edge_features,
                    d_feats: d_edge_features,
                    pairs,
                    pair_pos,
                    n_pairs: to_u32("edges", n_pairs)?,
                }),
            };
            self.run_inner(gpu, scale, operands, None, grads, Some(x))
        })();
        self.extras = Some(sides);
        result
    }
}

/// Per edge of A's BSB (`a_ids`: its edge of A) the place of that edge in Aᵀ's BSB (`t_ids`:
/// per place, its edge of A).
///
/// Errors: [`Error::InvalidArgument`] where the two maps do not hold the same edges once each.
pub(super) fn pair_places(a_ids: &[u32], t_ids: &[u32]) -> Result<Vec<u32>> {
    let bad = |why: String| Error::InvalidArgument {
        what: "BSB edge maps",
        why,
    };
    if a_ids.len() != t_ids.len() {
        return Err(bad(format!(
            "A's BSB has {} edges, Aᵀ's {}",
            a_ids.len(),
            t_ids.len()
        )));
    }
    let mut place = vec![u32::MAX; t_ids.len()];
    for (p, &e) in t_ids.iter().enumerate() {
        let slot = place
            .get_mut(e as usize)
            .ok_or_else(|| bad(format!("Aᵀ's place {p} names edge {e} of {}", a_ids.len())))?;
        // p < t_ids.len(), which `to_u32` bounds below.
        *slot = to_u32("BSB edges", p)?;
    }
    a_ids
        .iter()
        .enumerate()
        .map(|(p, &e)| match place.get(e as usize) {
            Some(&x) if x != u32::MAX => Ok(x),
            _ => Err(bad(format!(
                "A's place {p} names edge {e}, which Aᵀ's lacks"
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::pair_places;

    #[test]
    fn pair_places_invert_the_transpose_map() {
        // A's BSB holds edges 2, 0, 1; Aᵀ's 1, 2, 0.
        assert_eq!(pair_places(&[2, 0, 1], &[1, 2, 0]).unwrap(), vec![1, 2, 0]);
        assert!(pair_places(&[0, 1], &[0]).is_err());
        assert!(pair_places(&[0, 1], &[0, 0]).is_err());
        assert!(pair_places(&[0, 1], &[0, 5]).is_err());
    }
}
