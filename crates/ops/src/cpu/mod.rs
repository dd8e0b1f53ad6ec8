//! The CPU ops of graph attention: the reference every GPU kernel is tested against, and the
//! fallback where there is no GPU.
//!
//! Sparse attention over a mask `A` (a [`Csr`]: row `i` lists the nodes node `i` attends to) is
//!
//! ```text
//! out = softmax_row( scale · (Q Kᵀ) masked by A ) · V
//! ```
//!
//! and this module computes it, and each of its three steps, on host slices:
//!
//! | op | computes | per edge `e = (i, j)`, head `h` |
//! |---|---|---|
//! | [`sddmm`] | scores | `S[e,h] = scale · ⟨Q[i,h,:], K[j,h,:]⟩` |
//! | [`edge_softmax`], [`edge_softmax_in_place`] | probabilities | `P[e,h] = exp(S[e,h] − m) / Σ_row exp(S − m)`, optional LeakyReLU first |
//! | [`spmm`] | aggregation | `O[i,h,:] = Σ_row P[e,h] · V[j,h,:]` |
//! | [`attention`] | all three, unfused | `O = softmax_row(scale · Q Kᵀ ∘ A) · V` |
//! | [`attention_f64_from`] | the f64 reference from f32 / f16 / bf16 data | |
//! | [`attention_backward`], [`attention_backward_f64_from`] | dQ, dK, dV, dscale (module `backward`) | |
//! | [`transpose_edge_values`] | per-edge values from A's order to Aᵀ's (a backward building block) | |
//! | [`attention_extras`], [`attention_extras_backward`] | with a score bias, edge features, dropout, the weights out (module `extras`) | |
//! | [`gat_attention`], [`gat_attention_backward`] | GAT's attention: scores, LeakyReLU, softmax, dropout, aggregation, and its gradients (module `gat`) | |
//!
//! # Layouts
//!
//! - Dense operands (Q, K, V, out) are `rows × heads × head_dim`, row-major, described by a
//!   [`Shape`]: node `i`, head `h` starts at `(i * heads + h) * head_dim`. Q and the output have
//!   `a.n_rows()` rows, K and V have `a.n_cols()` rows (rectangular masks are allowed).
//! - Per-edge values (scores, probabilities) are `a.nnz() × heads`, edge-major — edge `e`,
//!   head `h` at `e * heads + h` — with edges in CSR order (the order of
//!   [`Csr::col_indices`]).
//! - Per-node GAT terms (`a_dst`, `a_src`) are `rows × heads`.
//!
//! # Conventions
//!
//! - Every op is generic over [`Real`] (`f32` or `f64`) and computes in that type.
//! - Every length is checked against the mask and the shapes before anything is read or
//!   written, with typed errors naming the operand ([`Error::LengthMismatch`],
//!   [`Error::ShapeMismatch`], [`Error::InvalidArgument`]); no input makes an op panic, and
//!   nothing is written on error.
//! - Rows run in parallel (rayon), in blocks balanced by edges, so hub rows and long runs of
//!   empty rows both split well.
//! - Numerics follow docs/kernels/README.md: softmax is max-subtracted with the running max
//!   starting at −∞; sums over a row's edges (the softmax normalizer, the SpMM aggregation) are
//!   compensated (Kahan), so their error does not grow with the degree; a row without edges
//!   gets no probabilities and an all-zero output row; NaN is never hidden.
//! - [`rel_l2_error`] is the comparison of every test: `‖out − ref‖₂ / ‖ref‖₂`, +∞ whenever
//!   `out` holds a NaN or an infinity.
//!
//! # Example
//!
//! ```
//! use spattn_formats::Csr;
//! use spattn_ops::cpu::{self, AttentionInputs};
//! use spattn_ops::Shape;
//!
//! // Node 0 attends to {0, 1}, node 1 to {1, 2}, node 2 to nothing.
//! let a = Csr::from_edges(3, 3, &[(0, 0), (0, 1), (1, 1), (1, 2)])?;
//! let (heads, head_dim) = (2, 4);
//! let shape = Shape::new(3, heads, head_dim)?;
//! let q: Vec<f32> = (0..shape.len()).map(|x| (x as f32 * 0.37).sin()).collect();
//! let k: Vec<f32> = (0..shape.len()).map(|x| (x as f32 * 0.91).cos()).collect();
//! let v: Vec<f32> = (0..shape.len()).map(|x| x as f32).collect();
//! let scale = 1.0 / (head_dim as f32).sqrt();
//!
//! // Step by step: scores, probabilities, aggregation.
//! let mut s = vec![0.0f32; a.nnz() * heads];
//! cpu::sddmm(&a, &q, &k, shape, shape, scale, &mut s)?;
//! cpu::edge_softmax_in_place(&a, &mut s, heads, None)?;
//! let p_row0_head0 = s[0] + s[heads]; // edges 0 and 1 are row 0's
//! assert!((p_row0_head0 - 1.0).abs() < 1e-6);
//! let mut out = vec![f32::NAN; shape.len()];
//! cpu::spmm(&a, &s, &v, shape, &mut out)?;
//! assert!(out[2 * heads * head_dim..].iter().all(|&x| x == 0.0)); // row 2: no edges
//!
//! // The same in one call, and the f64 reference a GPU result would be compared with.
//! let inputs = AttentionInputs::new(&q, shape, &k, shape, &v, shape);
//! let mut fused = vec![0.0f32; inputs.out_shape().len()];
//! cpu::attention(&a, &inputs, scale, &mut fused)?;
//! let reference = cpu::attention_f64_from(&a, &inputs, f64::from(scale))?;
//! assert!(cpu::rel_l2_error(&fused, &reference) <= 1e-5);
//! assert!(cpu::rel_l2_error(&out, &reference) <= 1e-5);
//!
//! // Errors name the operand.
//! let err = cpu::spmm(&a, &s[1..], &v, shape, &mut out).unwrap_err();
//! assert!(matches!(err, spattn_ops::Error::LengthMismatch { what: "p", .. }));
//! # Ok::<(), spattn_ops::Error>(())
//! ```
//!
//! [`Csr`]: spattn_formats::Csr
//! [`Csr::col_indices`]: spattn_formats::Csr::col_indices
//! [`Shape`]: crate::Shape
//! [`Error::LengthMismatch`]: crate::Error::LengthMismatch
//! [`Error::ShapeMismatch`]: crate::Error::ShapeMismatch
//! [`Error::InvalidArgument`]: crate::Error::InvalidArgument

mod attention;
mod backward;
mod check;
mod error_metric;
mod extras;
mod gat;
mod real;
mod rows;
mod sddmm;
mod softmax;
mod spmm;
#[cfg(test)]
mod tests;

pub use attention::{attention, attention_f64_from, AttentionInputs};
pub use backward::{
    attention_backward, attention_backward_f64_from, transpose_edge_values, AttentionGrads,
};
pub(crate) use backward::{edge_row_sum, edge_softmax_backward};
pub use error_metric::rel_l2_error;
pub use extras::{
    apply_dropout, attention_extras, attention_extras_backward, attention_extras_backward_f64_from,
    attention_extras_f64_from, EdgeBias, Extras, ExtrasGrads,
};
pub use gat::{gat_attention, gat_attention_backward, gat_scores, Transposed};
pub use real::Real;
pub use sddmm::sddmm;
pub(crate) use sddmm::sddmm_gat;
pub use softmax::{edge_softmax, edge_softmax_in_place};
pub use spmm::spmm;
