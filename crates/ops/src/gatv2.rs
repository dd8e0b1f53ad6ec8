//! GATv2's per-edge score operands: what its SDDMM (`csr_ops`) and its edge gradients
//! (`backward`) both read, in a module of its own so that neither imports the other for it.

use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::device_csr::DeviceCsr;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::check_same_gpu;
use crate::shape::Shape;

/// GATv2's per-edge score operands (PyG's `GATv2Conv`): the projected sources `xl`
/// (`n_cols × heads × dim`), targets `xr` (`n_rows × heads × dim`), the optional projected edge
/// features `ef` (`nnz × heads × dim`, CSR order), the attention vector `att` (`heads · dim`
/// f32) and LeakyReLU's negative slope.
#[derive(Debug, Clone, Copy)]
pub struct Gatv2Operands<'a, T: DType> {
    /// Sources' features `W_s x_j`.
    pub xl: &'a DeviceMatrix<T>,
    /// Targets' features `W_t x_i`.
    pub xr: &'a DeviceMatrix<T>,
    /// Edge features `W_e e_ij`, per edge in CSR order.
    pub ef: Option<&'a DeviceMatrix<T>>,
    /// The attention vector, `heads × dim` f32.
    pub att: &'a DeviceVec<f32>,
    /// LeakyReLU's slope for negative inputs.
    pub slope: f32,
}

impl<T: DType> Gatv2Operands<'_, T> {
    /// Checks the shapes against `a` and the GPU; returns `(heads, dim)`.
    pub(crate) fn check(&self, gpu: &Gpu, a: &DeviceCsr) -> Result<(usize, usize)> {
        let s = self.xr.shape();
        Shape::new(a.n_rows(), s.heads, s.head_dim)?.expect_eq("xr", s)?;
        s.expect_rows_like("xl", self.xl.shape(), a.n_cols())?;
        if let Some(ef) = self.ef {
            s.expect_rows_like("edge features", ef.shape(), a.nnz())?;
        }
        let hd = s.heads * s.head_dim;
        if self.att.len() != hd {
            return Err(Error::LengthMismatch {
                what: "att",
                expected: hd,
                actual: self.att.len(),
            });
        }
        check_same_gpu(gpu, "A", a)?;
        check_same_gpu(gpu, "xl", self.xl)?;
        check_same_gpu(gpu, "xr", self.xr)?;
        check_same_gpu(gpu, "att", self.att)?;
        if let Some(ef) = self.ef {
            check_same_gpu(gpu, "edge features", ef)?;
        }
        Ok((s.heads, s.head_dim))
    }
}
