//! The one error type of spattn-ops.

use crate::shape::Shape;

/// Everything that can go wrong in spattn-ops: no driver, no device, shapes that do not
/// match, a failed launch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// libcuda could not be found: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded (no NVIDIA driver installed?)")]
    NoCudaDriver,
    /// The driver is there but reports no device (or not the one asked for).
    #[error("no CUDA device with ordinal {ordinal} ({count} device(s) present)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// The device is too old for the requested path.
    #[error("{what} needs compute capability {need_major}.{need_minor} or newer; the device has {major}.{minor}")]
    UnsupportedComputeCapability {
        /// The path that needs it.
        what: &'static str,
        /// Device major.
        major: i32,
        /// Device minor.
        minor: i32,
        /// Required major.
        need_major: i32,
        /// Required minor.
        need_minor: i32,
    },
    /// A device allocation failed for lack of memory.
    #[error("out of GPU memory allocating {bytes} bytes for {what}")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// Bytes requested.
        bytes: usize,
    },
    /// libnccl cannot be loaded (or lacks a symbol): the message says how to make it found.
    #[error("NCCL is not available: {why}")]
    NcclUnavailable {
        /// Why, and what to do.
        why: String,
    },
    /// An NCCL call failed.
    #[error("NCCL error while {during}: {code}")]
    Nccl {
        /// What was being done.
        during: &'static str,
        /// NCCL's status and description.
        code: String,
    },
    /// Any other CUDA driver error.
    #[error("CUDA driver error during {during}: {source}")]
    Driver {
        /// What was being done.
        during: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A dense operand has the wrong shape.
    #[error("{what} has shape {actual}, expected {expected}")]
    ShapeMismatch {
        /// Which operand.
        what: &'static str,
        /// The shape it should have.
        expected: Shape,
        /// The shape it has.
        actual: Shape,
    },
    /// A buffer has the wrong length.
    #[error("{what} has length {actual}, expected {expected}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// The length it should have.
        expected: usize,
        /// The length it has.
        actual: usize,
    },
    /// An argument out of its valid range.
    #[error("invalid {what}: {why}")]
    InvalidArgument {
        /// The argument.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// Operands live on different GPUs (contexts).
    #[error("{what} was allocated on a different GPU context than the one running the op")]
    ForeignGpu {
        /// Which operand.
        what: &'static str,
    },
    /// A kernel family cannot run this shape or device (the message says why and what can).
    #[error("{kernel} cannot run this configuration: {why}")]
    Unsupported {
        /// The kernel family (`fused-csr`, `fused-tc`, `hybrid`).
        kernel: &'static str,
        /// Why, and what to use instead.
        why: String,
    },
    /// A problem too large for the kernels' 32-bit launch arithmetic.
    #[error("{what} = {value} exceeds the kernels' limit of {limit}")]
    TooLarge {
        /// Which quantity.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// The driver rejected a PTX module (e.g. its ISA is newer than the driver supports).
    #[error("loading PTX module {module} failed: {source}")]
    ModuleLoad {
        /// The module's name.
        module: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A PTX module has no kernel of that name.
    #[error("PTX module {module} has no kernel named {kernel:?}")]
    KernelNotFound {
        /// The module's name.
        module: &'static str,
        /// The kernel asked for.
        kernel: String,
    },
    /// A dense (two-dimensional) operand of a GEMM or layer op has the wrong dimensions.
    #[error("{what} is {} x {}, expected {} x {}", actual.0, actual.1, expected.0, expected.1)]
    DimsMismatch {
        /// Which operand.
        what: &'static str,
        /// `(rows, cols)` it should have.
        expected: (usize, usize),
        /// `(rows, cols)` it has.
        actual: (usize, usize),
    },
    /// libcublas could not be loaded (the dense GEMMs of [`Blas`](crate::Blas) need it).
    #[error("no cuBLAS: libcublas could not be loaded (install the CUDA toolkit's libcublas and put its folder on LD_LIBRARY_PATH)")]
    NoCublas,
    /// A cuBLAS call failed.
    #[error("cuBLAS error during {during}: {source}")]
    Cublas {
        /// What was being done.
        during: &'static str,
        /// cuBLAS's status.
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    /// An edge of a device edge list names a node outside the graph (checked on the device
    /// while the graph is built there; the first such edge is reported).
    #[error(
        "edge {edge} ({source_id} -> {target_id}) is out of range: sources must lie in [0, {n_cols}) \
         and targets in [0, {n_rows})"
    )]
    EdgeOutOfRange {
        /// The edge's index in the list.
        edge: usize,
        /// Its source id, as given.
        source_id: String,
        /// Its target id, as given.
        target_id: String,
        /// Rows (targets) of the graph.
        n_rows: usize,
        /// Columns (sources) of the graph.
        n_cols: usize,
    },
    /// An error from the sparse formats.
    #[error(transparent)]
    Format(#[from] spattn_formats::Error),
}

/// Result with the ops [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
