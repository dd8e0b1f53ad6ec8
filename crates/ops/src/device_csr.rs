//! [`DeviceCsr`]: a [`Csr`] attention mask uploaded once, for the CUDA-core kernels.

use spattn_formats::{Csr, DegreeStats};

use crate::buffer::DeviceVec;
use crate::csr_ops::CsrSchedule;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::launch::OnGpu;

/// A CSR mask in device memory: row offsets, column indices, the row of every edge (the COO
/// row array, for edge-parallel kernels) and the values where the matrix has them, all 32-bit.
///
/// Uploaded once and reused by every launch; the host-side [`DegreeStats`] stay with it for
/// scheduling decisions (e.g. splitting hub rows) that need no download.
///
/// ```no_run
/// use spattn_formats::Csr;
/// use spattn_ops::{DeviceCsr, Gpu};
/// let gpu = Gpu::new(0)?;
/// let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (2, 0)])?;
/// let d = DeviceCsr::upload(&gpu, &a)?;
/// assert_eq!((d.n_rows(), d.nnz(), d.degree_stats().max), (3, 3, 2));
/// assert_eq!(d.to_host()?, a);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct DeviceCsr {
    n_rows: usize,
    n_cols: usize,
    nnz: usize,
    row_offsets: DeviceVec<u32>,
    col_indices: DeviceVec<u32>,
    row_indices: DeviceVec<u32>,
    values: Option<DeviceVec<f32>>,
    degree_stats: DegreeStats,
    /// Load-balancing schedules of the CUDA-core kernels (built once here).
    schedule: CsrSchedule,
}

impl DeviceCsr {
    /// Uploads `csr` to `gpu`: row offsets, column indices, the row index of every entry, and
    /// the values if `csr` has them. The degree statistics are computed on the host.
    pub fn upload(gpu: &Gpu, csr: &Csr) -> Result<Self> {
        let row_indices = csr.row_indices();
        Ok(DeviceCsr {
            n_rows: csr.n_rows(),
            n_cols: csr.n_cols(),
            nnz: csr.nnz(),
            row_offsets: DeviceVec::from_host_named(gpu, "CSR row offsets", csr.row_offsets())?,
            col_indices: DeviceVec::from_host_named(gpu, "CSR column indices", csr.col_indices())?,
            row_indices: DeviceVec::from_host_named(gpu, "CSR row indices", &row_indices)?,
            values: csr
                .values()
                .map(|v| DeviceVec::from_host_named(gpu, "CSR values", v))
                .transpose()?,
            degree_stats: csr.degree_stats(),
            schedule: CsrSchedule::upload(gpu, csr)?,
        })
    }

    /// A CSR built on the device (`crate::device_plan`): `(n_rows, n_cols, nnz)`, row offsets
    /// (`n_rows + 1`), column and row indices (`nnz` each), its degree statistics and
    /// schedules, all computed there.
    pub(crate) fn from_parts(
        (n_rows, n_cols, nnz): (usize, usize, usize),
        row_offsets: DeviceVec<u32>,
        col_indices: DeviceVec<u32>,
        row_indices: DeviceVec<u32>,
        degree_stats: DegreeStats,
        schedule: CsrSchedule,
    ) -> Self {
        debug_assert_eq!(row_offsets.len(), n_rows + 1);
        debug_assert_eq!((col_indices.len(), row_indices.len()), (nnz, nnz));
        DeviceCsr {
            n_rows,
            n_cols,
            nnz,
            row_offsets,
            col_indices,
            row_indices,
            values: None,
            degree_stats,
            schedule,
        }
    }

    /// The CUDA-core kernels' load-balancing schedules (built at upload).
    pub(crate) fn schedule(&self) -> &CsrSchedule {
        &self.schedule
    }

    /// Downloads the matrix back into a [`Csr`] (checked by [`Csr::try_new`]).
    pub fn to_host(&self) -> Result<Csr> {
        let values = self.values.as_ref().map(DeviceVec::to_host).transpose()?;
        Ok(Csr::try_new(
            self.n_rows,
            self.n_cols,
            self.row_offsets.to_host()?,
            self.col_indices.to_host()?,
            values,
        )?)
    }

    /// Number of rows (query nodes).
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Number of columns (key nodes).
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }

    /// Number of stored entries (edges).
    pub fn nnz(&self) -> usize {
        self.nnz
    }

    /// Row offsets, `n_rows + 1` entries: row `i` holds entries
    /// `row_offsets[i]..row_offsets[i + 1]`.
    pub fn row_offsets(&self) -> &DeviceVec<u32> {
        &self.row_offsets
    }

    /// Column index of every entry, sorted within each row (`nnz` entries).
    pub fn col_indices(&self) -> &DeviceVec<u32> {
        &self.col_indices
    }

    /// Row index of every entry, in CSR order (`nnz` entries).
    pub fn row_indices(&self) -> &DeviceVec<u32> {
        &self.row_indices
    }

    /// Values of the entries (`nnz`), where the matrix has them.
    pub fn values(&self) -> Option<&DeviceVec<f32>> {
        self.values.as_ref()
    }

    /// Degree statistics of the rows, computed at upload (on the device for a CSR built
    /// there).
    pub fn degree_stats(&self) -> &DegreeStats {
        &self.degree_stats
    }

    /// The handle the matrix was uploaded with.
    pub fn gpu(&self) -> &Gpu {
        self.row_offsets.gpu()
    }

    /// Device memory the matrix occupies, in bytes.
    pub fn device_bytes(&self) -> usize {
        self.row_offsets.allocated_bytes()
            + self.col_indices.allocated_bytes()
            + self.row_indices.allocated_bytes()
            + self.values.as_ref().map_or(0, DeviceVec::allocated_bytes)
            + self.schedule.device_bytes()
    }
}

impl OnGpu for DeviceCsr {
    fn gpu(&self) -> &Gpu {
        self.row_offsets.gpu()
    }
}
