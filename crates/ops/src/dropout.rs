//! Attention dropout from a counter-based generator: Philox 4×32-10 (Salmon et al., SC 2011),
//! the generator of torch's and FlashAttention's dropout.
//!
//! The mask of edge `e` (in the caller's CSR order) and head `h` is a pure function of
//! `(seed, offset, e, h)`: with `i = e · heads + h` and `c = ⌊i / 4⌋`, counter
//! `[c mod 2³², c / 2³², offset mod 2³², offset / 2³²]`, key `[seed mod 2³², seed / 2³²]`, the
//! edge is kept when output word `i mod 4` is at least `⌊rate · 2³²⌋` (one draw serves four
//! consecutive elements, as torch's Philox dropout uses all four words); a kept probability is
//! scaled by `1 / (1 − rate)`.
//! Every algorithm, on the GPU (`philox4x32_10` in `common.cuh`) and on the CPU, draws the same
//! mask for the same seed and offset, and the backward regenerates it instead of storing it.
//! A new `offset` per call (as torch advances its generator's offset) gives a new mask from
//! one seed.
//!
//! ```
//! use spattn_ops::Dropout;
//! let d = Dropout::new(0.5, 42, 0)?;
//! let kept = (0..10_000u64).filter(|&e| d.keeps(e, 0, 1)).count();
//! assert!((4_800..5_200).contains(&kept)); // about half
//! assert_eq!(d.keeps(7, 1, 2), d.keeps(7, 1, 2)); // the same mask every time
//! assert_eq!(d.scale(), 2.0);
//! # Ok::<(), spattn_ops::Error>(())
//! ```

use crate::error::{Error, Result};

/// Philox 4×32's round multipliers.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
/// Philox's key schedule (the golden ratio and √3 − 1, as 32-bit fractions).
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4×32 with 10 rounds: four pseudo-random words of `counter` under `key`.
pub(crate) fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Dropout of attention probabilities: a rate in `[0, 1)`, a seed and an offset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    rate: f32,
    seed: u64,
    offset: u64,
    threshold: u32,
}

impl Dropout {
    /// Dropout at `rate` (each probability is zeroed with that chance, the kept ones scaled by
    /// `1 / (1 − rate)`), its mask drawn from `seed` and `offset`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `dropout rate` when it is not in `[0, 1)` (NaN
    /// included).
    pub fn new(rate: f32, seed: u64, offset: u64) -> Result<Self> {
        if !(0.0..1.0).contains(&rate) {
            return Err(Error::InvalidArgument {
                what: "dropout rate",
                why: format!("{rate} is not in [0, 1)"),
            });
        }
        // rate < 1, so the product is below 2^32.
        let threshold = (f64::from(rate) * 4_294_967_296.0).floor() as u32;
        Ok(Self {
            rate,
            seed,
            offset,
            threshold,
        })
    }

    /// The rate.
    pub fn rate(&self) -> f32 {
        self.rate
    }
    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
    /// The offset.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// The kept probabilities' factor, `1 / (1 − rate)`.
    pub fn scale(&self) -> f32 {
        1.0 / (1.0 - self.rate)
    }
    /// The draw below which an edge is dropped, `⌊rate · 2³²⌋` (what the kernels compare).
    pub(crate) fn threshold(&self) -> u32 {
        self.threshold
    }
    /// The key words the kernels take: `[seed mod 2³², seed / 2³²]`.
    pub(crate) fn key(&self) -> [u32; 2] {
        [self.seed as u32, (self.seed >> 32) as u32]
    }

    /// Whether edge `edge` (caller CSR order) keeps its probability at head `head` of `heads`.
    pub fn keeps(&self, edge: u64, head: u64, heads: u64) -> bool {
        if self.threshold == 0 {
            return true;
        }
        let i = edge.wrapping_mul(heads).wrapping_add(head);
        let c = i >> 2;
        let counter = [
            c as u32,
            (c >> 32) as u32,
            self.offset as u32,
            (self.offset >> 32) as u32,
        ];
        philox4x32_10(counter, self.key())[(i & 3) as usize] >= self.threshold
    }

    /// The factor of edge `edge`'s probability at `head`: `1 / (1 − rate)` kept, 0 dropped.
    pub(crate) fn factor(&self, edge: u64, head: u64, heads: u64) -> f64 {
        if self.keeps(edge, head, heads) {
            1.0 / (1.0 - f64::from(self.rate))
        } else {
            0.0
        }
    }
}

/// The words a kernel takes for an optional dropout (key, offset, threshold, scale), pushed
/// last by the kernels that replay it; none is threshold 0, which keeps every edge and skips the
/// generator.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DropoutWords {
    pub(crate) key: [u32; 2],
    pub(crate) offset: [u32; 2],
    pub(crate) threshold: u32,
    pub(crate) scale: f32,
}

impl DropoutWords {
    /// The words of `dropout` (none: threshold 0, key and offset 0, scale 1).
    pub(crate) fn of(dropout: Option<&Dropout>) -> Self {
        match dropout {
            Some(d) => Self {
                key: d.key(),
                offset: [d.offset() as u32, (d.offset() >> 32) as u32],
                threshold: d.threshold(),
                scale: d.scale(),
            },
            None => Self {
                key: [0; 2],
                offset: [0; 2],
                threshold: 0,
                scale: 1.0,
            },
        }
    }

    /// Pushes key, offset, threshold and scale (the kernels' `key0, key1, off0, off1,
    /// threshold, drop_scale`).
    pub(crate) fn push<'a>(&'a self, args: &mut cudarc::driver::LaunchArgs<'a>) {
        use crate::launch::PushKernelArg;
        args.arg(&self.key[0])
            .arg(&self.key[1])
            .arg(&self.offset[0])
            .arg(&self.offset[1])
            .arg(&self.threshold)
            .arg(&self.scale);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for philox4x32-10.
    #[test]
    fn known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn one_draw_serves_four_consecutive_elements() {
        let d = Dropout::new(0.5, 0x0123_4567_89ab_cdef, 7).unwrap();
        let heads = 3u64;
        for e in 0..100u64 {
            for h in 0..heads {
                let i = e * heads + h;
                let c = i / 4;
                let counter = [c as u32, (c >> 32) as u32, 7, 0];
                let word = philox4x32_10(counter, d.key())[(i % 4) as usize];
                assert_eq!(
                    d.keeps(e, h, heads),
                    word >= d.threshold(),
                    "edge {e} head {h}"
                );
            }
        }
    }

    #[test]
    fn rates_are_checked_and_kept_fractions_match() {
        for bad in [-0.1, 1.0, 1.5, f32::NAN] {
            let e = Dropout::new(bad, 1, 0).unwrap_err();
            assert!(e.to_string().contains("dropout rate"), "{e}");
        }
        let none = Dropout::new(0.0, 1, 0).unwrap();
        assert!((0..1000).all(|e| none.keeps(e, 0, 1)));
        for rate in [0.1f32, 0.6, 0.9] {
            let d = Dropout::new(rate, 7, 3).unwrap();
            let n = 200_000u64;
            let kept = (0..n).filter(|&e| d.keeps(e / 4, e % 4, 4)).count() as f64 / n as f64;
            assert!(
                (kept - (1.0 - f64::from(rate))).abs() < 0.01,
                "{rate}: {kept}"
            );
        }
        // Another seed or offset, another mask.
        let (a, b, c) = (
            Dropout::new(0.5, 1, 0).unwrap(),
            Dropout::new(0.5, 2, 0).unwrap(),
            Dropout::new(0.5, 1, 1).unwrap(),
        );
        let same =
            |x: &Dropout, y: &Dropout| (0..4096).all(|e| x.keeps(e, 0, 1) == y.keeps(e, 0, 1));
        assert!(!same(&a, &b) && !same(&a, &c));
    }
}
