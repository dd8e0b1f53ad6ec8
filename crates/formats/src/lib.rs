//! # spattn-formats
//!
//! The sparse formats of graph attention, in pure Rust with no GPU dependency: a user who only
//! preprocesses graphs depends on this crate alone.
//!
//! - [`Csr`] and [`Coo`]: the attention mask (row `i` lists the nodes node `i` attends to),
//!   validated constructors, transpose, symmetrize, self loops, [`DegreeStats`].
//! - [`read_matrix_market`], [`read_edge_list`]: readers for MatrixMarket coordinate files (plain
//!   or gzip'd) and SNAP-style edge lists, with errors that name the line.
//! - [`rmat()`]: the Graph500 R-MAT generator, deterministic from a seed.
//! - [`Permutation`]: RT-GNN degree reordering, reverse Cuthill–McKee (a locality order) and
//!   greedy window packing ([`Permutation::window_clusters`]), applied to a [`Csr`] and to
//!   feature rows; [`RowOrder`] picks one for the windowed formats by counting the K/V rows
//!   their windows gather ([`Reorder`]).
//! - [`MeBcrs`]: FlashSparse's 8-row windows of 8×1 vectors for tensor-core SpMM / SDDMM.
//! - [`Bsb`]: Fused3S's 16-row windows of 16×8 bitmap blocks for fused tensor-core attention.
//! - [`HybridBlocks`]: degree-ordered 16×8 blocks split by fill between tensor-core tiles and
//!   CUDA-core edges (RT-GNN-style hybrid kernels).
//!
//! ```
//! use spattn_formats::{Csr, MeBcrs, Bsb};
//! // A 5-node path graph, symmetrized, with self loops: the GAT benchmark convention.
//! let a = Csr::from_edges(5, 5, &[(0, 1), (1, 2), (2, 3), (3, 4)])?.symmetrize_with_self_loops()?;
//! assert_eq!(a.nnz(), 4 * 2 + 5);
//! let stats = a.degree_stats();
//! assert_eq!(stats.max, 3);
//! let me = MeBcrs::from_csr(&a, 8)?;
//! assert_eq!(me.to_csr()?, a); // exact round trip
//! let bsb = Bsb::from_csr(&a)?;
//! assert_eq!(bsb.to_csr()?, a);
//! println!("ME-BCRS fill {:.2}, BSB fill {:.2}", me.fill_stats().fill(), bsb.fill_stats().fill());
//! # Ok::<(), spattn_formats::Error>(())
//! ```
#![forbid(unsafe_code)]

pub mod alloc;
pub mod bsb;
pub mod cluster;
pub mod csr;
pub mod error;
pub mod hybrid;
pub mod io;
pub mod mebcrs;
mod offsets;
pub mod permutation;
pub mod reorder;
pub mod rmat;
pub mod stats;
mod window;

/// `Display` (its name) and `FromStr` (one of `ALL`'s names, else the error `$err(why)`, `why`
/// naming `$what` and the choices) of a closed set of named choices with `ALL` and
/// `name(self)`: the row orders here, spattn's algorithms.
#[doc(hidden)]
#[macro_export]
macro_rules! named_choice {
    ($t:ident, $err_ty:ty, $what:literal, $err:expr) => {
        impl ::core::fmt::Display for $t {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::core::str::FromStr for $t {
            type Err = $err_ty;
            #[doc = concat!("Parses a name of [`", stringify!($t), "::name`].")]
            fn from_str(s: &str) -> ::core::result::Result<Self, $err_ty> {
                $t::ALL.into_iter().find(|c| c.name() == s).ok_or_else(|| {
                    let names = $t::ALL.map($t::name).join(", ");
                    $err(format!("unknown {} {s:?}; expected one of {names}", $what))
                })
            }
        }
    };
}

pub use bsb::{Bsb, WindowCount};
pub use csr::{Coo, Csr, MAX_DIM, MAX_NNZ};
pub use error::{Error, Result};
pub use hybrid::{HybridBlocks, HybridSplit};
pub use io::{
    read_edge_list, read_edge_list_from, read_edge_list_with, read_matrix_market,
    read_matrix_market_from, EdgeListOptions,
};
pub use mebcrs::MeBcrs;
pub use permutation::Permutation;
pub use reorder::{Reorder, RowOrder};
pub use rmat::{rmat, rmat_edges, RmatConfig};
pub use stats::{DegreeStats, FillStats};
