//! `--largest-rmat`'s search: the largest R-MAT scale that runs on a rank count, each scale
//! tried at most once.

/// The largest R-MAT scale (2^31 nodes: 32-bit indices).
pub const MAX_RMAT_SCALE: u32 = 31;

/// One try of a scale in [`search_scales`].
#[derive(Debug, PartialEq)]
pub enum Trial<R, F> {
    /// It ran.
    Ran(R),
    /// It did not fit, for this reason.
    NotFit(F),
}

/// What [`search_scales`] found.
#[derive(Debug, PartialEq)]
pub struct Found<R, F> {
    /// The largest scale that ran, with its run.
    pub largest: Option<(u32, R)>,
    /// The scale above it that did not, with why; none where `max` ran.
    pub first_not_fitting: Option<(u32, F)>,
}

impl<R, F> Found<R, F> {
    /// Where the search of the next (larger) rank count starts: the scale that did not fit
    /// here (more GPUs likely fit it, and its graph is the one generated last), else the
    /// largest that ran, else `min`.
    pub fn next_start(&self, min: u32) -> u32 {
        self.first_not_fitting
            .as_ref()
            .map(|(s, _)| *s)
            .or(self.largest.as_ref().map(|(s, _)| *s))
            .unwrap_or(min)
    }
}

/// The largest scale in `min..=max` that runs (`try_scale` says, and is assumed to fit every
/// scale below one that fits), trying `start` first (clamped into the range), then upward
/// while scales run, or downward until one does. Each scale is tried at most once.
///
/// # Errors
/// The first error of `try_scale`, which ends the search.
pub fn search_scales<R, F, E>(
    min: u32,
    max: u32,
    start: u32,
    mut try_scale: impl FnMut(u32) -> Result<Trial<R, F>, E>,
) -> Result<Found<R, F>, E> {
    let mut found = Found {
        largest: None,
        first_not_fitting: None,
    };
    let mut s = start.clamp(min, max.max(min));
    match try_scale(s)? {
        Trial::Ran(r) => {
            found.largest = Some((s, r));
            while s < max {
                s += 1;
                match try_scale(s)? {
                    Trial::Ran(r) => found.largest = Some((s, r)),
                    Trial::NotFit(f) => {
                        found.first_not_fitting = Some((s, f));
                        break;
                    }
                }
            }
        }
        Trial::NotFit(f) => {
            found.first_not_fitting = Some((s, f));
            while s > min {
                s -= 1;
                match try_scale(s)? {
                    Trial::Ran(r) => {
                        found.largest = Some((s, r));
                        break;
                    }
                    Trial::NotFit(f) => found.first_not_fitting = Some((s, f)),
                }
            }
        }
    }
    Ok(found)
}
