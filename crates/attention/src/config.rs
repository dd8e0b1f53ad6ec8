//! What a plan computes: heads, head_dim, dtype, scale, and the algorithm.

use spattn_ops::DTypeKind;

use crate::error::{Error, Result};

/// How attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Chosen per graph and shape from the format statistics (and, with
    /// [`AttentionConfig::autotune`], by timing each candidate once when the plan is built).
    Auto,
    /// SDDMM → edge softmax → SpMM on CUDA cores over CSR (three kernels; scores in device
    /// memory).
    UnfusedCsr,
    /// SDDMM → edge softmax → SpMM on tensor cores over ME-BCRS.
    UnfusedTensorCore,
    /// One kernel on CSR, CUDA cores, online softmax (DF-GNN style, without its 128-neighbour
    /// limit).
    FusedCsr,
    /// One kernel on BSB bitmaps, tensor cores (Fused3S style).
    FusedTensorCore,
    /// Tensor-core and CUDA-core warps splitting the tiles of one kernel (RT-GNN style).
    Hybrid,
}

impl Algorithm {
    /// Every algorithm, `Auto` first.
    pub const ALL: [Algorithm; 6] = [
        Algorithm::Auto,
        Algorithm::UnfusedCsr,
        Algorithm::UnfusedTensorCore,
        Algorithm::FusedCsr,
        Algorithm::FusedTensorCore,
        Algorithm::Hybrid,
    ];

    /// The name used on command lines and in results: `auto`, `unfused-csr`, `unfused-tc`,
    /// `fused-csr`, `fused-tc`, `hybrid`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::UnfusedCsr => "unfused-csr",
            Algorithm::UnfusedTensorCore => "unfused-tc",
            Algorithm::FusedCsr => "fused-csr",
            Algorithm::FusedTensorCore => "fused-tc",
            Algorithm::Hybrid => "hybrid",
        }
    }

    /// Whether this build implements the algorithm on the GPU.
    pub const fn is_implemented(self) -> bool {
        matches!(
            self,
            Algorithm::Auto
                | Algorithm::UnfusedCsr
                | Algorithm::UnfusedTensorCore
                | Algorithm::FusedCsr
                | Algorithm::FusedTensorCore
                | Algorithm::Hybrid
        )
    }
}

impl Algorithm {
    /// Whether the algorithm takes edge features among attention's extras (`spattn::extras`;
    /// every algorithm takes a score bias, dropout and the weights out): the CUDA-core ones
    /// (they read a third row stream per edge); fused-tc, in its kernel for f16 and bf16 heads
    /// of 64 or 128 features (others run the CUDA-core composition); and unfused-tc, whose
    /// extras run the CUDA-core
    /// composition (the tensor-core ops' slot layout carries no per-edge data). Hybrid takes a
    /// bias and dropout in its kernel, not edge features.
    pub const fn takes_edge_features(self) -> bool {
        matches!(
            self,
            Algorithm::UnfusedCsr
                | Algorithm::FusedCsr
                | Algorithm::FusedTensorCore
                | Algorithm::UnfusedTensorCore
        )
    }

    /// The algorithms that take edge features, for messages.
    pub const EXTRAS: &'static str = "unfused-csr, fused-csr, fused-tc and unfused-tc";
}

spattn_formats::named_choice!(Algorithm, Error, "algorithm", |why| Error::InvalidConfig {
    what: "algorithm",
    why
});

/// The configuration of an [`AttentionPlan`](crate::AttentionPlan).
///
/// ```
/// use spattn::{Algorithm, AttentionConfig};
/// use spattn_ops::DTypeKind;
/// let c = AttentionConfig::new(8, 64, DTypeKind::F16).with_algorithm(Algorithm::FusedCsr);
/// assert_eq!(c.scale(), 0.125); // 1/√64 by default
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionConfig {
    /// Number of heads (≥ 1).
    pub heads: usize,
    /// Features per head of Q, K and V (≥ 1).
    pub head_dim: usize,
    /// Element type of Q, K, V and the output (sums are always f32).
    pub dtype: DTypeKind,
    /// The score scale; `None` means 1/√head_dim.
    pub scale: Option<f32>,
    /// The algorithm ([`Algorithm::Auto`] by default).
    pub algorithm: Algorithm,
    /// With [`Algorithm::Auto`] on a GPU: time each candidate once when the plan is built and
    /// keep the fastest (like cuDNN's benchmark mode). Off by default.
    pub autotune: bool,
    /// For [`Algorithm::Hybrid`]: a fixed threshold and warp split instead of the plan-time
    /// calibration (`None`, the default, calibrates).
    pub hybrid: Option<HybridParams>,
    /// How the plan renumbers the rows internally ([`Reorder::Auto`] by default). For the
    /// tensor-core algorithms, which tile rows into windows (16 rows for `fused-tc` and
    /// `hybrid`, 8 for `unfused-tc`), `Auto` is chosen per window height; for `fused-csr` it is
    /// the order its units run in, and `Auto` takes the locality order only where it makes the
    /// rows in flight share many more columns (large graphs stored in a scattered order, such
    /// as ogbn-arxiv). Invisible to the caller: inputs and outputs keep the graph's node order.
    pub reorder: Reorder,
    /// Whether the plan will run with extras (a score bias, edge features, dropout or the
    /// attention weights out: [`AttentionPlan::forward_with`](crate::AttentionPlan::forward_with)):
    /// [`Algorithm::Auto`] then chooses fused-csr, which takes every extra in its kernel
    /// (unfused-csr where fused-csr cannot hold the head), or, where
    /// [`edge_features`](Self::edge_features) is off, fused-tc for f16 and bf16 (fused-csr on a
    /// graph seen once, as without extras). Every algorithm takes a bias, dropout and the
    /// weights out; one asked for by name that takes no edge features (hybrid)
    /// refuses them, with an error naming those that do, when called with them. Off by default.
    pub edge_extras: bool,
    /// Whether the extras may include edge features (on by default). Turned off, `Auto` plans
    /// f16 and bf16 extras on fused-tc, whose kernel takes a bias and dropout and is faster with
    /// them than fused-csr's (H100, heads 8, head_dim 64, f16, bias and dropout: ogbn-arxiv
    /// 1.11 against 1.73 ms, R-MAT 18 4.31 against 4.73 ms); edge features passed to such a
    /// plan anyway still run, through the unfused composition.
    pub edge_features: bool,
}

/// How a plan renumbers the graph's rows before tiling them into windows (fused-tc, hybrid and
/// unfused-tc), so that a window's rows share more columns and the kernels gather fewer K/V
/// rows, or before running them (fused-csr), so that the rows in flight share columns in L2;
/// invisible to the caller. Defined in the formats crate, which also chooses the order
/// ([`spattn_formats::RowOrder`]).
pub use spattn_formats::Reorder;

/// Fixed parameters of the hybrid algorithm (see [`AttentionConfig::with_hybrid`]).
pub use spattn_ops::HybridParams;

impl AttentionConfig {
    /// `heads × head_dim` of `dtype`, automatic algorithm, scale 1/√head_dim.
    pub fn new(heads: usize, head_dim: usize, dtype: DTypeKind) -> Self {
        Self {
            heads,
            head_dim,
            dtype,
            scale: None,
            algorithm: Algorithm::Auto,
            autotune: false,
            hybrid: None,
            reorder: Reorder::Auto,
            edge_extras: false,
            edge_features: true,
        }
    }
    /// Sets the algorithm.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }
    /// Sets the score scale.
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Turns plan-time autotuning on or off.
    pub fn with_autotune(mut self, autotune: bool) -> Self {
        self.autotune = autotune;
        self
    }
    /// Fixes the hybrid algorithm's threshold and warp split (no plan-time calibration).
    pub fn with_hybrid(mut self, params: HybridParams) -> Self {
        self.hybrid = Some(params);
        self
    }
    /// Sets how the plan renumbers rows internally (`fused-csr`, `fused-tc`, `hybrid`,
    /// `unfused-tc`).
    pub fn with_reorder(mut self, reorder: Reorder) -> Self {
        self.reorder = reorder;
        self
    }
    /// Declares that the plan will run with extras (see [`AttentionConfig::edge_extras`]).
    pub fn with_edge_extras(mut self, edge_extras: bool) -> Self {
        self.edge_extras = edge_extras;
        self
    }
    /// Declares whether those extras may include edge features (see
    /// [`AttentionConfig::edge_features`]): `false` for a bias, dropout or the weights only.
    pub fn with_edge_features(mut self, edge_features: bool) -> Self {
        self.edge_features = edge_features;
        self
    }
    /// The scale in effect.
    pub fn scale(&self) -> f32 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.head_dim.max(1) as f32).sqrt())
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.heads == 0 {
            return Err(Error::InvalidConfig {
                what: "heads",
                why: "must be at least 1".into(),
            });
        }
        if self.head_dim == 0 {
            return Err(Error::InvalidConfig {
                what: "head_dim",
                why: "must be at least 1".into(),
            });
        }
        if !self.scale().is_finite() {
            return Err(Error::InvalidConfig {
                what: "scale",
                why: format!("{} is not finite", self.scale()),
            });
        }
        Ok(())
    }
}
