//! The CPU bodies of [`GraphCore`]'s calls: the f32 / f64 reference ops of `spattn::ops::cpu`
//! on host memory at the addresses the package passes (the contract is in the `graph`
//! module's documentation), as [`crate::cuda`] holds the CUDA bodies.

use pyo3::prelude::*;
use spattn::ops::cpu::{self, AttentionInputs, Real};
use spattn::{AttentionConfig, Csr, DTypeKind, Dropout, Shape};

use crate::errors::{ops_to_py, to_py};
use crate::graph::GraphCore;
use crate::host;

/// The scale in effect: the one given, or 1/√head_dim computed as the plans do (in f32 for the
/// f32 path, in f64 for the f64 one).
pub(crate) fn scale_of<F: Real>(scale: Option<f64>, head_dim: usize) -> F {
    match scale {
        Some(s) => F::from_f64(s),
        None if F::NAME == "f64" => F::from_f64(1.0 / (head_dim.max(1) as f64).sqrt()),
        None => F::from_f32(AttentionConfig::new(1, head_dim, DTypeKind::F32).scale()),
    }
}

impl GraphCore {
    pub(crate) fn cpu_forward<F: Real>(
        &self,
        sq: Shape,
        skv: Shape,
        scale: Option<f64>,
        [q, k, v, out]: [u64; 4],
    ) -> PyResult<()> {
        // SAFETY: the package's contract (module documentation): contiguous host tensors of F
        // with these element counts, alive for the call; `out` fresh, so unaliased.
        let (q, k, v, out) = unsafe {
            (
                host::slice::<F>("q", q, sq.len())?,
                host::slice::<F>("k", k, skv.len())?,
                host::slice::<F>("v", v, skv.len())?,
                host::slice_mut::<F>("out", out, sq.len())?,
            )
        };
        let inputs = AttentionInputs::new(q, sq, k, skv, v, skv);
        cpu::attention(
            self.csr_py()?,
            &inputs,
            scale_of::<F>(scale, sq.head_dim),
            out,
        )
        .map_err(ops_to_py)
    }

    pub(crate) fn cpu_backward<F: Real>(
        &self,
        sq: Shape,
        skv: Shape,
        scale: Option<f64>,
        [q, k, v, out, d_out, dq, dk, dv]: [u64; 8],
    ) -> PyResult<f64> {
        // SAFETY: as in `cpu_forward`; dq, dk, dv are fresh outputs.
        let (q, k, v, out, d_out) = unsafe {
            (
                host::slice::<F>("q", q, sq.len())?,
                host::slice::<F>("k", k, skv.len())?,
                host::slice::<F>("v", v, skv.len())?,
                host::slice::<F>("out", out, sq.len())?,
                host::slice::<F>("d_out", d_out, sq.len())?,
            )
        };
        let inputs = AttentionInputs::new(q, sq, k, skv, v, skv);
        let g = cpu::attention_backward(
            self.csr_py()?,
            &inputs,
            scale_of::<F>(scale, sq.head_dim),
            out,
            d_out,
        )
        .map_err(ops_to_py)?;
        // SAFETY: as above: fresh outputs of these lengths.
        let (dq, dk, dv) = unsafe {
            (
                host::slice_mut::<F>("dq", dq, sq.len())?,
                host::slice_mut::<F>("dk", dk, skv.len())?,
                host::slice_mut::<F>("dv", dv, skv.len())?,
            )
        };
        dq.copy_from_slice(&g.dq);
        dk.copy_from_slice(&g.dk);
        dv.copy_from_slice(&g.dv);
        Ok(g.d_scale.to_f64())
    }

    pub(crate) fn cpu_gat_forward<F: Real>(
        &self,
        sq: Shape,
        skv: Shape,
        slope: f64,
        dropout: Option<Dropout>,
        [x, a_dst, a_src, out, bias]: [u64; 5],
    ) -> PyResult<()> {
        let h = sq.heads;
        let a: &Csr = self.csr_py()?;
        let edges = a.nnz() * h;
        // SAFETY: the package's contract: `nnz × heads` values of F where given.
        let bias = unsafe { host::slice::<F>("bias", bias, if bias == 0 { 0 } else { edges })? };
        // SAFETY: the package's contract: x (`n_cols × heads × dim`), a_dst (`n_rows ×
        // heads`), a_src (`n_cols × heads`) of F, alive; `out` fresh.
        let (x, a_dst, a_src, out) = unsafe {
            (
                host::slice::<F>("x", x, skv.len())?,
                host::slice::<F>("alpha_dst", a_dst, sq.rows * h)?,
                host::slice::<F>("alpha_src", a_src, skv.rows * h)?,
                host::slice_mut::<F>("out", out, sq.len())?,
            )
        };
        let bias = (!bias.is_empty()).then_some(bias);
        let slope = F::from_f64(slope);
        cpu::gat_attention(
            a,
            h,
            slope,
            (a_dst, a_src, bias),
            dropout.as_ref(),
            x,
            skv,
            out,
        )
        .map(|_| ())
        .map_err(ops_to_py)
    }

    pub(crate) fn cpu_gat_backward<F: Real>(
        &self,
        sq: Shape,
        skv: Shape,
        slope: f64,
        dropout: Option<Dropout>,
        [x, a_dst, a_src, d_out, dx, da_dst, da_src, bias, d_bias]: [u64; 9],
    ) -> PyResult<()> {
        let h = sq.heads;
        let a: &Csr = self.csr_py()?;
        // SAFETY: as in `cpu_gat_forward`; dx, da_dst, da_src are fresh outputs.
        let (x, a_dst, a_src, d_out, dx, da_dst, da_src) = unsafe {
            (
                host::slice::<F>("x", x, skv.len())?,
                host::slice::<F>("alpha_dst", a_dst, sq.rows * h)?,
                host::slice::<F>("alpha_src", a_src, skv.rows * h)?,
                host::slice::<F>("d_out", d_out, sq.len())?,
                host::slice_mut::<F>("dx", dx, skv.len())?,
                host::slice_mut::<F>("d_alpha_dst", da_dst, sq.rows * h)?,
                host::slice_mut::<F>("d_alpha_src", da_src, skv.rows * h)?,
            )
        };
        let (at, map) = self.transpose().map_err(to_py)?;
        let edges = a.nnz() * h;
        let blen = if bias == 0 { 0 } else { edges };
        // SAFETY: as above: the forward's bias and a fresh d_bias, `nnz × heads` where given.
        let (bias, d_bias) = unsafe {
            (
                host::slice::<F>("bias", bias, blen)?,
                host::slice_mut::<F>("d_bias", d_bias, blen)?,
            )
        };
        let slope = F::from_f64(slope);
        // The forward's scores and probabilities, recomputed (the package keeps nothing).
        let bias = (!bias.is_empty()).then_some(bias);
        let (s, p) = cpu::gat_scores(a, h, slope, (a_dst, a_src, bias)).map_err(ops_to_py)?;
        let ds = cpu::gat_attention_backward(
            a,
            (at, map),
            h,
            slope,
            dropout.as_ref(),
            (&s, &p),
            (d_out, x, skv),
            (dx, da_dst, da_src),
        )
        .map_err(ops_to_py)?;
        // dS after the LeakyReLU's slope is the bias's gradient, edge by edge.
        d_bias.copy_from_slice(&ds[..blen]);
        Ok(())
    }
}
