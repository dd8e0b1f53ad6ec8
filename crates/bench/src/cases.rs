//! The registry of benchmark cases: one entry per case, naming what it measures, where it runs,
//! how it is run, what it must move through memory (its HBM floor) and which peers it is
//! compared with.
//!
//! Adding a case is adding one entry to [`CASES`] (and, for a new way of running, one
//! [`Runner`] variant with its arm in the GPU or CPU runner). The algorithms of the `spattn`
//! crate's [`AttentionPlan`](spattn::AttentionPlan) share one runner,
//! [`Runner::Plan`]: a plan built for that algorithm, timed through `forward`. A plan case whose
//! algorithm the plan does not support for a configuration (`AttentionPlan::supports`: not
//! implemented in this build, a head_dim or dtype it cannot take, an older GPU) is skipped.

use spattn::Algorithm;
use spattn_ops::DTypeKind;

use crate::error::{Error, Result};

/// What a case measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaseKind {
    /// One op of the attention (SDDMM, softmax, SpMM) on its own.
    Op,
    /// The whole attention, `softmax(scale · QKᵀ ∘ A) · V`.
    Algorithm,
}

impl CaseKind {
    /// `"op"` or `"algorithm"`.
    pub fn name(self) -> &'static str {
        match self {
            CaseKind::Op => "op",
            CaseKind::Algorithm => "algorithm",
        }
    }
}

/// Where a case runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// On the GPU, timed with CUDA events.
    Gpu,
    /// On the CPU, timed with the wall clock.
    Cpu,
}

/// How a case is run: the arm of the GPU or CPU runner it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runner {
    /// `csr_ops::sddmm`: Q, K → f32 scores.
    SddmmCsr,
    /// `csr_ops::edge_softmax_in_place` on f32 scores.
    SoftmaxCsr,
    /// `csr_ops::spmm`: f32 probabilities, V → out.
    SpmmCsr,
    /// The three CSR ops in sequence, one `nnz × heads` f32 buffer in between.
    UnfusedCsr,
    /// `tc_ops::sddmm` (through `graph::sddmm`): Q, K → f32 scores in ME-BCRS slots.
    SddmmTc,
    /// `tc_ops::edge_softmax_in_place` on slot-layout f32 scores.
    SoftmaxTc,
    /// `tc_ops::spmm`: slot-layout f32 probabilities, V → out.
    SpmmTc,
    /// An `AttentionPlan` built for this algorithm, run with `forward`.
    Plan(Algorithm),
    /// A training step of the attention: an `AttentionPlan` (automatic algorithm) run with
    /// `forward` then `backward_with` these per-edge kernels, timed together; with `true`, the
    /// forward keeps its row statistics for the backward (`forward_keeping_stats`,
    /// `backward_with_stats`).
    TrainStep(spattn::BackwardKernels, bool),
    /// `cpu::attention` in f32.
    CpuUnfused,
}

/// The dense traffic of a case: which operands it must read and write at least once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Traffic {
    /// Reads Q, K; writes `nnz × heads` f32 scores.
    Sddmm,
    /// Reads and writes `nnz × heads` f32.
    Softmax,
    /// Reads `nnz × heads` f32 probabilities and V; writes out.
    Spmm,
    /// Reads Q, K, V; writes out.
    Attention,
    /// Forward and backward: reads Q, K, V and dOut, writes out, dQ, dK, dV (each once).
    TrainStep,
}

/// The index arrays a case's kernels read (each counted once in the floor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexReads {
    /// Row offsets, `(n + 1) × 4` bytes.
    pub row_offsets: bool,
    /// Column indices, `nnz × 4` bytes.
    pub col_indices: bool,
    /// Row index of every edge (COO rows), `nnz × 4` bytes.
    pub row_indices: bool,
}

impl IndexReads {
    /// Row offsets and column indices: CSR.
    pub const CSR: IndexReads = IndexReads {
        row_offsets: true,
        col_indices: true,
        row_indices: false,
    };
}

/// Peers of the attention algorithms (the names of peers/torch_peers.py and peers/fused_peers.py).
pub const ATTENTION_PEERS: &[&str] = &[
    "torch_sparse_attention",
    "pyg_attention",
    "dense_sdpa",
    "flex_attention",
    "flex_attention_rcm",
    "flashinfer_bsr",
    "fused3s",
    "fused3s_scaleqk",
    "flashsparse",
    "dfgnn_tiling",
    "dfgnn_hyper",
];

/// One benchmark case.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// The name on the command line and in every record.
    pub name: &'static str,
    /// Op or algorithm.
    pub kind: CaseKind,
    /// Where it runs.
    pub target: Target,
    /// How it is run.
    pub runner: Runner,
    /// What it must move through memory.
    pub traffic: Traffic,
    /// The index arrays its kernels read.
    pub indices: IndexReads,
    /// The peers it is compared with (ratio = peer time / our time).
    pub peers: &'static [&'static str],
    /// One line on what it is.
    pub about: &'static str,
}

/// The baseline of the `× unfused` column.
pub const BASELINE: &str = "unfused-csr";

/// Every case, in the order they run (the baseline before the algorithms compared with it).
pub const CASES: &[Case] = &[
    Case {
        name: "sddmm-csr",
        kind: CaseKind::Op,
        target: Target::Gpu,
        runner: Runner::SddmmCsr,
        traffic: Traffic::Sddmm,
        // Edge-parallel: each edge reads its row and column index.
        indices: IndexReads {
            row_offsets: false,
            col_indices: true,
            row_indices: true,
        },
        peers: &["cusparse_sddmm"],
        about: "SDDMM on CUDA cores: scale·⟨Q_i, K_j⟩ per edge, f32 scores",
    },
    Case {
        name: "softmax-csr",
        kind: CaseKind::Op,
        target: Target::Gpu,
        runner: Runner::SoftmaxCsr,
        traffic: Traffic::Softmax,
        indices: IndexReads {
            row_offsets: true,
            col_indices: false,
            row_indices: false,
        },
        peers: &[],
        about: "row softmax of f32 edge scores, in place",
    },
    Case {
        name: "spmm-csr",
        kind: CaseKind::Op,
        target: Target::Gpu,
        runner: Runner::SpmmCsr,
        traffic: Traffic::Spmm,
        indices: IndexReads::CSR,
        peers: &["cusparse_spmm"],
        about: "SpMM on CUDA cores: Σ_j P_ij V_j with f32 probabilities",
    },
    tc_op_case(
        "sddmm-tc",
        Runner::SddmmTc,
        Traffic::Sddmm,
        &["cusparse_sddmm"],
        "SDDMM on tensor cores (ME-BCRS, swap-and-transpose), f32 scores in slot layout",
    ),
    tc_op_case(
        "softmax-tc",
        Runner::SoftmaxTc,
        Traffic::Softmax,
        &[],
        "row softmax over ME-BCRS slots (padding slots stay 0), in place",
    ),
    tc_op_case(
        "spmm-tc",
        Runner::SpmmTc,
        Traffic::Spmm,
        &["cusparse_spmm"],
        "SpMM on tensor cores (ME-BCRS, Oᵀ = Vᵀ·Pᵀ), f32 accumulation",
    ),
    Case {
        name: "unfused-csr",
        kind: CaseKind::Algorithm,
        target: Target::Gpu,
        runner: Runner::UnfusedCsr,
        traffic: Traffic::Attention,
        // Its SDDMM reads the COO row indices too.
        indices: IndexReads {
            row_offsets: true,
            col_indices: true,
            row_indices: true,
        },
        peers: ATTENTION_PEERS,
        about: "sddmm-csr → softmax-csr → spmm-csr, straight on spattn-ops (the baseline)",
    },
    plan_case(
        "unfused-tc",
        Algorithm::UnfusedTensorCore,
        "unfused on tensor cores (ME-BCRS)",
    ),
    plan_case(
        "fused-csr",
        Algorithm::FusedCsr,
        "one fused CUDA-core kernel: online softmax per row",
    ),
    plan_case(
        "fused-tc",
        Algorithm::FusedTensorCore,
        "fused on tensor cores (BSB)",
    ),
    plan_case(
        "hybrid",
        Algorithm::Hybrid,
        "tensor cores for dense windows, CUDA cores for the rest",
    ),
    plan_case(
        "auto",
        Algorithm::Auto,
        "what AttentionPlan chooses for the graph and shape",
    ),
    train_step_case(
        "train-step",
        spattn::BackwardKernels::Auto,
        false,
        "forward (auto) + the default backward (tensor cores for f16/bf16 heads up to 64, else \
         the fused CUDA-core passes)",
    ),
    train_step_case(
        "train-step-fused",
        spattn::BackwardKernels::Fused,
        false,
        "forward (auto) + the fused CUDA-core backward: a row pass (dQ) and a column pass (dK, dV)",
    ),
    train_step_case(
        "train-step-per-edge",
        spattn::BackwardKernels::PerEdge,
        false,
        "forward (auto) + backward with the per-edge row kernel: 2 SDDMM, 1 row kernel, 3 SpMM",
    ),
    train_step_case(
        "train-step-tc",
        spattn::BackwardKernels::TensorCore,
        false,
        "forward (auto) + the tensor-core backward: row statistics, dQ and dK/dV passes over BSB \
         (f16/bf16; otherwise the fused backward)",
    ),
    train_step_case(
        "train-step-tc-kept",
        spattn::BackwardKernels::TensorCore,
        true,
        "forward (auto) keeping its row statistics + the tensor-core backward's dQ and dK/dV \
         passes (fused-tc plans; otherwise as train-step-tc)",
    ),
    train_step_case(
        "train-step-unfused",
        spattn::BackwardKernels::Unfused,
        false,
        "forward (auto) + backward composed of spattn-ops building blocks",
    ),
    Case {
        name: "cpu-unfused",
        kind: CaseKind::Algorithm,
        target: Target::Cpu,
        runner: Runner::CpuUnfused,
        traffic: Traffic::Attention,
        indices: IndexReads::CSR,
        peers: &[],
        about: "cpu::attention in f32 (rayon): SDDMM → softmax → SpMM",
    },
];

/// A tensor-core op of spattn-ops on ME-BCRS as a case. Its floor counts the same dense bytes
/// as the CSR op (the ideal; padding slots are overhead) and the CSR index arrays.
const fn tc_op_case(
    name: &'static str,
    runner: Runner,
    traffic: Traffic,
    peers: &'static [&'static str],
    about: &'static str,
) -> Case {
    Case {
        name,
        kind: CaseKind::Op,
        target: Target::Gpu,
        runner,
        traffic,
        indices: IndexReads::CSR,
        peers,
        about,
    }
}

/// An algorithm of `AttentionPlan` as a case.
const fn plan_case(name: &'static str, algorithm: Algorithm, about: &'static str) -> Case {
    Case {
        name,
        kind: CaseKind::Algorithm,
        target: Target::Gpu,
        runner: Runner::Plan(algorithm),
        traffic: Traffic::Attention,
        // Whatever format the algorithm reads, the graph's information is its CSR.
        indices: IndexReads::CSR,
        peers: ATTENTION_PEERS,
        about,
    }
}

/// Peers of the training-step cases (peers/torch_peers.py names).
pub const TRAIN_PEERS: &[&str] = &["torch_sparse_train", "pyg_train"];

/// A forward + backward of `AttentionPlan` as a case.
const fn train_step_case(
    name: &'static str,
    kernels: spattn::BackwardKernels,
    keep: bool,
    about: &'static str,
) -> Case {
    Case {
        name,
        kind: CaseKind::Algorithm,
        target: Target::Gpu,
        runner: Runner::TrainStep(kernels, keep),
        traffic: Traffic::TrainStep,
        indices: IndexReads::CSR,
        peers: TRAIN_PEERS,
        about,
    }
}

/// The case called `name`.
pub fn find(name: &str) -> Option<&'static Case> {
    CASES.iter().find(|c| c.name == name)
}

/// The cases of `target`.
pub fn cases_for(target: Target) -> impl Iterator<Item = &'static Case> {
    CASES.iter().filter(move |c| c.target == target)
}

/// Checks the names of a `--algorithms` list (before anything is loaded): every name must be
/// a case, or the whole list `all`.
///
/// # Errors
/// An unknown or empty name, listing the valid ones.
pub fn check_names(list: &str) -> Result<()> {
    if list.trim() == "all" {
        return Ok(());
    }
    for name in list.split(',').map(str::trim) {
        if find(name).is_none() {
            let valid: Vec<&str> = CASES.iter().map(|c| c.name).collect();
            let what = if name.is_empty() {
                "an empty case name".to_string()
            } else {
                format!("unknown case `{name}`")
            };
            return Err(Error::new(format!(
                "--algorithms: {what}; valid cases: {}, or all",
                valid.join(", ")
            )));
        }
    }
    Ok(())
}

/// The cases of a `--algorithms` list on `target`, in registry order without repeats.
///
/// # Errors
/// As [`check_names`], and a case of the other target (naming the cases of this one).
pub fn select(list: &str, target: Target) -> Result<Vec<&'static Case>> {
    check_names(list)?;
    if list.trim() == "all" {
        return Ok(cases_for(target).collect());
    }
    let names: Vec<&str> = list.split(',').map(str::trim).collect();
    let here: Vec<&str> = cases_for(target).map(|c| c.name).collect();
    for name in &names {
        if let Some(case) = find(name) {
            if case.target != target {
                let (needs, on) = match case.target {
                    Target::Gpu => ("a GPU", "the CPU"),
                    Target::Cpu => ("the CPU (--cpu)", "a GPU"),
                };
                return Err(Error::new(format!(
                    "--algorithms: `{name}` needs {needs}, and this run is on {on}; \
                     cases here: {}",
                    here.join(", ")
                )));
            }
        }
    }
    Ok(CASES.iter().filter(|c| names.contains(&c.name)).collect())
}

/// Sizes the floor is computed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Rows of A (query nodes).
    pub n_rows: u64,
    /// Columns of A (key nodes).
    pub n_cols: u64,
    /// Edges.
    pub nnz: u64,
    /// Heads.
    pub heads: u64,
    /// Features per head.
    pub head_dim: u64,
    /// Element type of Q, K, V, out.
    pub dtype: DTypeKind,
}

/// Bytes `case` must move at least once on `p`: its dense operands read and written once
/// (Q, K, V read and out written for the attention; each op only its own operands, with
/// per-edge scores and probabilities in f32) plus each index array its kernels read, once.
/// Over the copy bandwidth this is the case's HBM floor.
pub fn floor_bytes(case: &Case, p: &Problem) -> u64 {
    let s = p.dtype.size_bytes() as u64;
    let rows = |n: u64| n * p.heads * p.head_dim * s;
    let edges_f32 = p.nnz * p.heads * 4;
    let dense = match case.traffic {
        Traffic::Sddmm => rows(p.n_rows) + rows(p.n_cols) + edges_f32,
        Traffic::Softmax => 2 * edges_f32,
        Traffic::Spmm => edges_f32 + rows(p.n_cols) + rows(p.n_rows),
        Traffic::Attention => rows(p.n_rows) + 2 * rows(p.n_cols) + rows(p.n_rows),
        Traffic::TrainStep => 4 * rows(p.n_rows) + 4 * rows(p.n_cols),
    };
    let ix = case.indices;
    let indices = u64::from(ix.row_offsets) * (p.n_rows + 1) * 4
        + u64::from(ix.col_indices) * p.nnz * 4
        + u64::from(ix.row_indices) * p.nnz * 4;
    dense + indices
}

/// The tolerance (docs/kernels/README.md) for an output of `dtype` against the f64 reference:
/// f32 1e-5, tf32 1e-3 (f32 inputs of a tensor-core algorithm go through tf32), f16 5e-3, bf16
/// 2e-2. Ops whose output is f32 (scores, probabilities) are held to f32's.
pub fn tolerance(case: &Case, dtype: DTypeKind) -> f64 {
    let out = match case.traffic {
        Traffic::Sddmm | Traffic::Softmax => DTypeKind::F32,
        Traffic::Spmm | Traffic::Attention | Traffic::TrainStep => dtype,
    };
    let tensor_cores = matches!(
        case.runner,
        Runner::SddmmTc
            | Runner::SpmmTc
            | Runner::Plan(
                Algorithm::UnfusedTensorCore | Algorithm::FusedTensorCore | Algorithm::Hybrid
            )
    );
    match out {
        DTypeKind::F32 if tensor_cores => 1e-3,
        DTypeKind::F32 => 1e-5,
        DTypeKind::F16 => 5e-3,
        DTypeKind::Bf16 => 2e-2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_baseline_first() {
        for (i, c) in CASES.iter().enumerate() {
            assert!(
                CASES[i + 1..].iter().all(|d| d.name != c.name),
                "{}",
                c.name
            );
        }
        let base = CASES.iter().position(|c| c.name == BASELINE).unwrap();
        assert!(CASES[..base].iter().all(|c| c.kind == CaseKind::Op));
    }

    #[test]
    fn every_plan_algorithm_is_a_case() {
        for alg in Algorithm::ALL {
            let case = find(alg.name()).unwrap_or_else(|| panic!("no case for {alg}"));
            if alg != Algorithm::UnfusedCsr {
                assert_eq!(case.runner, Runner::Plan(alg));
            }
        }
    }

    #[test]
    fn selection() {
        let gpu: Vec<_> = select("all", Target::Gpu)
            .unwrap()
            .iter()
            .map(|c| c.name)
            .collect();
        assert_eq!(
            gpu,
            [
                "sddmm-csr",
                "softmax-csr",
                "spmm-csr",
                "sddmm-tc",
                "softmax-tc",
                "spmm-tc",
                "unfused-csr",
                "unfused-tc",
                "fused-csr",
                "fused-tc",
                "hybrid",
                "auto",
                "train-step",
                "train-step-fused",
                "train-step-per-edge",
                "train-step-tc",
                "train-step-tc-kept",
                "train-step-unfused"
            ]
        );
        let cpu: Vec<_> = select("all", Target::Cpu)
            .unwrap()
            .iter()
            .map(|c| c.name)
            .collect();
        assert_eq!(cpu, ["cpu-unfused"]);
        let some = select("unfused-csr, sddmm-csr", Target::Gpu).unwrap();
        assert_eq!(
            some.iter().map(|c| c.name).collect::<Vec<_>>(),
            ["sddmm-csr", "unfused-csr"]
        );
        let e = select("fused-xyz", Target::Gpu).unwrap_err().to_string();
        assert!(
            e.contains("fused-xyz") && e.contains("unfused-csr") && e.contains("all"),
            "{e}"
        );
        let e = select("unfused-csr", Target::Cpu).unwrap_err().to_string();
        assert!(
            e.contains("needs a GPU") && e.contains("cpu-unfused"),
            "{e}"
        );
        assert!(select("sddmm-csr,", Target::Gpu).is_err());
    }

    #[test]
    fn floors() {
        let p = Problem {
            n_rows: 10,
            n_cols: 10,
            nnz: 30,
            heads: 2,
            head_dim: 8,
            dtype: DTypeKind::F16,
        };
        let rows = 10 * 2 * 8 * 2; // one n × H × D f16 matrix: 320 bytes
        let att = find("unfused-csr").unwrap();
        assert_eq!(floor_bytes(att, &p), 4 * rows + 11 * 4 + 30 * 4 + 30 * 4);
        let sddmm = find("sddmm-csr").unwrap();
        assert_eq!(floor_bytes(sddmm, &p), 2 * rows + 30 * 2 * 4 + 2 * 30 * 4);
        let softmax = find("softmax-csr").unwrap();
        assert_eq!(floor_bytes(softmax, &p), 2 * 30 * 2 * 4 + 11 * 4);
        let spmm = find("spmm-csr").unwrap();
        assert_eq!(
            floor_bytes(spmm, &p),
            30 * 2 * 4 + 2 * rows + 11 * 4 + 30 * 4
        );
        assert_eq!(tolerance(sddmm, DTypeKind::Bf16), 1e-5);
        assert_eq!(tolerance(spmm, DTypeKind::Bf16), 2e-2);
        assert_eq!(tolerance(att, DTypeKind::F16), 5e-3);
        let tc = CASES
            .iter()
            .find(|c| c.runner == Runner::Plan(Algorithm::FusedTensorCore))
            .unwrap();
        assert_eq!(tolerance(tc, DTypeKind::F32), 1e-3);
        assert_eq!(tolerance(att, DTypeKind::F32), 1e-5);
    }
}
