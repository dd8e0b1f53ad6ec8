//! The one error type of the `spattn` crate.

use spattn_ops::{DTypeKind, Shape};

/// Everything that can go wrong planning or running attention.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operand has the wrong shape for the plan.
    #[error("{what} has shape {actual}, expected {expected}")]
    ShapeMismatch {
        /// Which operand.
        what: &'static str,
        /// The shape the plan expects.
        expected: Shape,
        /// The shape given.
        actual: Shape,
    },
    /// A host slice has the wrong length.
    #[error("{what} has {actual} elements, expected {expected} ({shape})")]
    LengthMismatch {
        /// Which operand.
        what: &'static str,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        actual: usize,
        /// The shape they should form.
        shape: Shape,
    },
    /// The operands' element type is not the plan's.
    #[error("the plan was built for {planned} but was run with {given}")]
    DTypeMismatch {
        /// The plan's dtype.
        planned: DTypeKind,
        /// The operands' dtype.
        given: DTypeKind,
    },
    /// A configuration value out of range.
    #[error("invalid {what}: {why}")]
    InvalidConfig {
        /// The field.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// The algorithm cannot run this configuration (the message says why and what can).
    #[error("{algorithm} cannot run this configuration: {why}")]
    Unsupported {
        /// The algorithm asked for.
        algorithm: crate::Algorithm,
        /// Why, and what to use instead.
        why: String,
    },
    /// The plan runs on the CPU (or the GPU) and was called with the other kind of operand.
    #[error("this plan runs on the {plan}; call {use_instead}")]
    WrongPlanKind {
        /// Where the plan runs.
        plan: &'static str,
        /// The method to call instead.
        use_instead: &'static str,
    },
    /// A rank outside the world (or the partition).
    #[error("rank {rank} is out of range: the world has {world} ranks")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// Ranks in the world.
        world: usize,
    },
    /// A count that must match the world's size does not.
    #[error("{what}: {actual}, but the world has {expected} ranks")]
    WorldMismatch {
        /// What was counted.
        what: &'static str,
        /// The world's size.
        expected: usize,
        /// The count given.
        actual: usize,
    },
    /// The exchange between ranks failed.
    #[error("exchange between ranks: {why}")]
    Exchange {
        /// What happened.
        why: String,
    },
    /// An error from the ops layer (driver, memory, launch).
    #[error(transparent)]
    Ops(spattn_ops::Error),
    /// An error from the formats.
    #[error(transparent)]
    Format(#[from] spattn_formats::Error),
}

impl From<spattn_ops::Error> for Error {
    /// A kernel family's [`spattn_ops::Error::Unsupported`] becomes [`Error::Unsupported`]
    /// naming the algorithm that runs it; everything else is [`Error::Ops`].
    fn from(e: spattn_ops::Error) -> Self {
        match e {
            spattn_ops::Error::Unsupported { kernel, why } => match kernel.parse() {
                Ok(algorithm) => Error::Unsupported { algorithm, why },
                Err(_) => Error::Ops(spattn_ops::Error::Unsupported { kernel, why }),
            },
            other => Error::Ops(other),
        }
    }
}

/// Result with the `spattn` [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
