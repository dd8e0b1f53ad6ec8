//! `FusedCsr`: one CUDA-core kernel per forward over CSR with an online softmax
//! (kernel: `crates/kernels-sys/cuda/fused_csr.cu`).
//!
//! Rows walk the same units as the CSR SpMM ([`spattn_ops::CsrSchedule`]): hub rows are cut
//! into chunks, each chunk leaves an exact (max, sum, f32 accumulator) partial per head, and a
//! merge kernel combines them. There is no per-row buffer, so no degree limit.

use spattn_kernels_sys::FUSED_CSR;
use spattn_ops::launch::{blocks_for, kernel_named, launch, to_u32, LaunchConfig, PushKernelArg};
use spattn_ops::schedule::{group_for, vector_width};
use spattn_ops::{DType, DeviceCsr, DeviceMatrix, DeviceVec, Gpu};

use crate::error::{Error, Result};
use crate::Algorithm;

const THREADS: u32 = 256;
/// Accumulator vectors per lane compiled for (`fused_csr_*_n{1,2,4}`).
const MAX_NV: usize = 4;

/// Lane layout of the fused kernel for one head shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Features per vector access.
    pub vec: u32,
    /// Lanes per (unit, head).
    pub group: u32,
    /// Vectors per lane (1, 2 or 4).
    pub nv: u32,
}

/// The lane layout for `head_dim` features of `elem_bytes`, or why the kernel cannot hold the
/// head in registers.
pub(crate) fn layout(head_dim: usize, elem_bytes: usize) -> Result<Layout> {
    // Narrower vectors when that gives the group more lanes (up to 32): each (row, head) is a
    // chain of dependent steps, so more lanes per step beats wider loads per lane (f16 at
    // head_dim 128: 32 lanes of 4 features rather than 16 lanes of 8).
    let widest = vector_width(head_dim, elem_bytes);
    let vec = [widest, widest / 2, widest / 4]
        .into_iter()
        .filter(|&v| v >= 1 && head_dim % v as usize == 0)
        .find(|&v| head_dim / v as usize >= 32)
        .unwrap_or(widest);
    let vectors = head_dim.div_ceil(vec as usize);
    let group = group_for(vectors as u64, 1);
    let per_lane = vectors.div_ceil(group as usize);
    let nv = per_lane.next_power_of_two();
    if nv > MAX_NV {
        return Err(Error::Unsupported {
            algorithm: Algorithm::FusedCsr,
            why: format!(
                "head_dim {head_dim} needs {per_lane} accumulator vectors of {vec} per lane \
                 (at most {MAX_NV} are compiled: head_dim ≤ {}); use unfused-csr",
                MAX_NV * 32 * vec as usize
            ),
        });
    }
    Ok(Layout {
        vec,
        group,
        nv: nv as u32,
    })
}

/// Device workspace of the fused kernel for one plan: the partials of split rows.
#[derive(Debug)]
pub(crate) struct FusedCsr {
    layout: Layout,
    /// (max, sum) per partial and head.
    part_ml: DeviceVec<f32>,
    /// Accumulator per partial, head and feature.
    part_acc: DeviceVec<f32>,
}

impl FusedCsr {
    /// Sizes the workspace for `a` and `heads × head_dim` of `T`.
    pub(crate) fn new<T: DType>(
        gpu: &Gpu,
        a: &DeviceCsr,
        heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let layout = layout(head_dim, std::mem::size_of::<T>())?;
        let parts = a.schedule().n_parts() * heads;
        Ok(Self {
            layout,
            part_ml: DeviceVec::zeros(gpu, parts * 2)?,
            part_acc: DeviceVec::zeros(gpu, parts * head_dim)?,
        })
    }

    /// `out = softmax(scale · Q Kᵀ ⊙ A) · V` in one kernel (plus a merge for split rows).
    /// Shapes are checked by the plan.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<T: DType>(
        &mut self,
        gpu: &Gpu,
        a: &DeviceCsr,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        scale: f32,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        let shape = q.shape();
        let s = a.schedule();
        let Layout { vec, group, nv } = self.layout;
        let name = kernel_named(&FUSED_CSR, format!("fused_csr_{}_v{vec}_n{nv}", T::NAME))?;
        let f = gpu.load_function(FUSED_CSR.name, FUSED_CSR.ptx, name)?;
        let n_units = to_u32("units", s.n_units())?;
        let heads = to_u32("heads", shape.heads)?;
        let head_dim = to_u32("head_dim", shape.head_dim)?;
        let groups = s.n_units() * shape.heads;
        let cfg = LaunchConfig {
            grid_dim: (blocks_for(groups, THREADS / group)?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = gpu.launch_builder(&f);
        args.arg(s.unit_rows().slice())
            .arg(s.unit_starts().slice())
            .arg(s.unit_parts().slice())
            .arg(&n_units)
            .arg(a.col_indices().slice())
            .arg(q.slice())
            .arg(k.slice())
            .arg(v.slice())
            .arg(&heads)
            .arg(&head_dim)
            .arg(&scale)
            .arg(&group)
            .arg(out.slice_mut())
            .arg(self.part_ml.slice_mut())
            .arg(self.part_acc.slice_mut());
        // SAFETY: unit arrays hold n_units (+1) entries and their edge ranges lie in [0, nnz);
        // Q rows are unit rows < n_rows, K/V rows are column indices < n_cols, each
        // heads*head_dim long (shapes checked by the plan); lanes touch features < head_dim
        // only (vec divides head_dim); out rows < n_rows; partial slots < n_parts, and
        // part_ml / part_acc hold n_parts*heads*2 / n_parts*heads*head_dim f32.
        unsafe { launch(name, &mut args, cfg) }?;

        let n_split = s.split_rows().len();
        if n_split > 0 {
            let merge = kernel_named(&FUSED_CSR, format!("fused_csr_merge_{}", T::NAME))?;
            let f = gpu.load_function(FUSED_CSR.name, FUSED_CSR.ptx, merge)?;
            let n_split_u = to_u32("split rows", n_split)?;
            let cfg = LaunchConfig {
                grid_dim: (blocks_for(n_split * shape.row_len(), THREADS)?, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = gpu.launch_builder(&f);
            args.arg(s.split_rows().slice())
                .arg(s.part_first().slice())
                .arg(&n_split_u)
                .arg(&heads)
                .arg(&head_dim)
                .arg(self.part_ml.slice())
                .arg(self.part_acc.slice())
                .arg(out.slice_mut());
            // SAFETY: reads split_rows[0..n_split), part_first[0..=n_split] (partials
            // < n_parts, within part_ml / part_acc as above), writes rows split_rows[s] < n_rows
            // of out.
            unsafe { launch(merge, &mut args, cfg) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_cover_the_head() {
        for (d, bytes) in [
            (1, 2),
            (3, 4),
            (24, 2),
            (64, 2),
            (96, 4),
            (128, 2),
            (256, 4),
            (512, 4),
        ] {
            let l = layout(d, bytes).unwrap();
            assert!(
                l.vec as usize * l.group as usize * l.nv as usize >= d,
                "d={d}"
            );
            assert_eq!(d % l.vec as usize, 0);
            assert!([1, 2, 4].contains(&l.nv));
        }
        let l = |vec, group, nv| Layout { vec, group, nv };
        assert_eq!(layout(128, 2).unwrap(), l(4, 32, 1));
        assert_eq!(layout(64, 2).unwrap(), l(2, 32, 1));
        assert_eq!(layout(256, 2).unwrap(), l(8, 32, 1));
        assert_eq!(layout(24, 2).unwrap(), l(8, 4, 1));
        // Odd head_dim beyond 4 vectors of 1 per lane cannot be held in registers.
        assert!(matches!(layout(129, 2), Err(Error::Unsupported { .. })));
    }
}
