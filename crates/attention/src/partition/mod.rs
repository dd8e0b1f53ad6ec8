//! Row-partitioned attention: P ranks, each owning a contiguous block of rows balanced by
//! edges (its Q, output and CSR rows) and a contiguous block of K/V rows, fetch the K/V rows
//! their edges touch (the halo) from their owners and run attention on their rows alone. A
//! row's softmax needs only that row's edges, so the forward needs no reduction across ranks;
//! the backward sends the halo rows' dK and dV partials back to their owners, which sum them.
//!
//! The exchange between ranks sits behind [`Exchange`], whose one collective is an all-to-all
//! of variable-sized blocks: [`LocalExchange`] runs the P ranks as threads of one process
//! (tests, and graphs split for memory on one machine); [`TcpExchange`] runs one process per
//! rank, on one host or several, with rank and world from the environment torchrun sets
//! ([`TcpExchange::from_env`]) and a rendezvous at `MASTER_ADDR` (on `MASTER_PORT + 1`,
//! torchrun's store holding `MASTER_PORT`); [`NcclExchange`] moves device blocks GPU to GPU
//! with NCCL's grouped send/recv, one process per GPU ([`NcclExchange::from_env`], its unique id
//! sent over the TCP rendezvous) or one thread per GPU of this host ([`run_nccl`]). Each rank
//! computes on the CPU ([`RankPlan::forward`], f32 or f64) or on its GPU
//! ([`RankPlan::gpu_plan`] and [`RankPlan::forward_gpu`]: a normal [`AttentionPlan`] of the
//! rank's rows against its halo, any algorithm and dtype; the rows asked for are packed on the
//! device and the gradients' partials summed there; the local and TCP exchanges carry the
//! blocks through host memory).
//!
//! [`AttentionPlan`]: crate::AttentionPlan
//!
//! ```
//! use spattn::partition::{run_local, Partition, RankPlan};
//! use spattn::Csr;
//!
//! let a = Csr::from_edges(4, 4, &[(0, 1), (1, 2), (2, 3), (3, 0), (3, 1)])?;
//! let part = Partition::balanced(&a, 2)?;
//! let (heads, dim) = (1, 2);
//! let x: Vec<f64> = (0..4 * heads * dim).map(|i| i as f64 * 0.1).collect();
//! let outs = run_local(2, |ex| -> spattn::Result<Vec<f64>> {
//!     let plan = RankPlan::new(&a, &part, ex)?;
//!     let own = |m: &[f64], r: std::ops::Range<usize>| m[r.start * 2..r.end * 2].to_vec();
//!     let (q, kv) = (own(&x, plan.rows()), own(&x, plan.kv_rows()));
//!     plan.forward(ex, &q, &kv, &kv, heads, dim, 0.5)
//! })?;
//! let whole: Vec<f64> = outs.concat();
//! assert_eq!(whole.len(), 8);
//! # Ok::<(), spattn::Error>(())
//! ```

mod exchange;
mod local;
mod nccl;
mod rank;
mod split;
mod tcp;

/// Plain numbers the exchanges move as bytes (`f32`, `f64`, `u32`, …).
pub use bytemuck::Pod;
pub use exchange::Exchange;
pub use local::{run_local, LocalExchange};
pub use nccl::{run_nccl, NcclExchange};
pub use rank::{GpuHalo, Halo, RankPlan, RankStats};
pub use split::{Blocks, Partition};
pub use tcp::TcpExchange;

// Shared by the exchanges: the world-size check and the join of rank threads (nccl.rs's
// `run_nccl` joins its threads as `run_local` does).
use local::join_ranks;
use split::check_parts;
