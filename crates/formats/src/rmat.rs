//! The Graph500 R-MAT (recursive matrix) generator: power-law graphs of any size, deterministic
//! from a seed.
//!
//! Each of the `edge_factor · 2^scale` directed edges picks, `scale` times, one quadrant of the
//! adjacency matrix with probabilities `a` (top left), `b` (top right), `c` (bottom left) and
//! `d = 1 − a − b − c` (bottom right); the quadrant choices are the bits of the edge's row and
//! column. The defaults are Graph500's: a, b, c, d = 0.57, 0.19, 0.19, 0.05 and 16 edges per
//! node. As in the Graph500 reference, no noise is added to the probabilities between levels,
//! and the node labels are then permuted at random so that the hubs are not all at low indices.
//!
//! Generation runs in parallel over fixed chunks of the edge list, each with its own PCG
//! stream seeded from `(seed, chunk index)`, so the graph depends on the seed alone, never on
//! the number of threads.

use rand::RngCore;
use rand_pcg::Pcg64;
use rayon::prelude::*;

use crate::alloc;
use crate::csr::{Csr, MAX_NNZ};
use crate::error::{Error, Result};

/// Edges drawn per RNG stream. Fixed, so the output does not depend on the thread count.
const EDGES_PER_STREAM: usize = 1 << 16;

/// The stream index reserved for the label permutation (edge chunks use 0, 1, 2, ...).
const LABEL_STREAM: u64 = u64::MAX;

/// The largest supported scale: `2^31` nodes still fit 32-bit indices.
pub const MAX_SCALE: u32 = 31;

/// Parameters of [`rmat`]: graph size, quadrant probabilities, seed and post-processing.
///
/// Build it with [`RmatConfig::new`] (Graph500 defaults, directed, no self loops) or
/// [`RmatConfig::benchmark`] (symmetrized with self loops, the GAT benchmark convention), then
/// adjust with the `with_*` setters. All fields are public; [`RmatConfig::validate`] (called by
/// [`rmat`]) checks them.
///
/// ```
/// use spattn_formats::RmatConfig;
/// let cfg = RmatConfig::new(10).with_edge_factor(8).with_seed(7).with_symmetrize(true);
/// assert_eq!((cfg.n_nodes(), cfg.n_edges()), (1024, 8192));
/// assert!((cfg.d() - 0.05).abs() < 1e-12);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RmatConfig {
    /// `n = 2^scale` nodes; at most [`MAX_SCALE`].
    pub scale: u32,
    /// Directed edges drawn per node: `m = edge_factor · n` (before deduplication). Default 16.
    pub edge_factor: u32,
    /// Probability of the top-left quadrant. Default 0.57.
    pub a: f64,
    /// Probability of the top-right quadrant. Default 0.19.
    pub b: f64,
    /// Probability of the bottom-left quadrant. Default 0.19. The bottom-right one gets
    /// `d = 1 − a − b − c`.
    pub c: f64,
    /// The seed: the same configuration and seed give the same graph on any machine and any
    /// number of threads.
    pub seed: u64,
    /// Relabel the nodes by a random permutation (drawn from the seed). Default true.
    pub permute_labels: bool,
    /// Add the reverse of every edge (A + Aᵀ). Default false.
    pub symmetrize: bool,
    /// `true`: every node gets its self loop (A + I). `false`: the self loops R-MAT draws are
    /// removed, so the result has none. Default false.
    pub self_loops: bool,
}

impl Default for RmatConfig {
    /// Scale 16 with the Graph500 defaults.
    fn default() -> Self {
        Self::new(16)
    }
}

impl RmatConfig {
    /// Graph500 defaults at `2^scale` nodes: 16 edges per node, a, b, c = 0.57, 0.19, 0.19, seed
    /// 1, labels permuted, directed, no self loops.
    pub fn new(scale: u32) -> Self {
        Self {
            scale,
            edge_factor: 16,
            a: 0.57,
            b: 0.19,
            c: 0.19,
            seed: 1,
            permute_labels: true,
            symmetrize: false,
            self_loops: false,
        }
    }

    /// The graph of the GAT / graph-transformer benchmarks: [`RmatConfig::new`], symmetrized,
    /// with self loops (A + Aᵀ + I, deduplicated).
    pub fn benchmark(scale: u32) -> Self {
        Self::new(scale).with_symmetrize(true).with_self_loops(true)
    }

    /// Sets the number of directed edges drawn per node.
    pub fn with_edge_factor(mut self, edge_factor: u32) -> Self {
        self.edge_factor = edge_factor;
        self
    }
    /// Sets the quadrant probabilities `a`, `b`, `c` (`d = 1 − a − b − c`).
    pub fn with_probabilities(mut self, a: f64, b: f64, c: f64) -> Self {
        (self.a, self.b, self.c) = (a, b, c);
        self
    }
    /// Sets the scale (`2^scale` nodes).
    pub fn with_scale(mut self, scale: u32) -> Self {
        self.scale = scale;
        self
    }
    /// Sets the seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Sets whether node labels are randomly permuted.
    pub fn with_permute_labels(mut self, permute_labels: bool) -> Self {
        self.permute_labels = permute_labels;
        self
    }
    /// Sets whether the graph is symmetrized.
    pub fn with_symmetrize(mut self, symmetrize: bool) -> Self {
        self.symmetrize = symmetrize;
        self
    }
    /// Sets whether every node gets a self loop (`false` removes them all).
    pub fn with_self_loops(mut self, self_loops: bool) -> Self {
        self.self_loops = self_loops;
        self
    }

    /// The bottom-right probability `d = 1 − a − b − c` (clamped at 0 against rounding).
    pub fn d(&self) -> f64 {
        (1.0 - self.a - self.b - self.c).max(0.0)
    }
    /// Number of nodes, `2^scale` (saturating for an invalid scale; see
    /// [`RmatConfig::validate`]).
    pub fn n_nodes(&self) -> usize {
        1usize.checked_shl(self.scale).unwrap_or(usize::MAX)
    }
    /// The most host memory [`rmat`] holds at once, in bytes: the drawn edges in both
    /// directions (16 bytes an edge) and the CSR build's working set (32 bytes a node, 8 an
    /// edge). `None` where that overflows 64 bits.
    pub fn peak_host_bytes(&self) -> Option<u64> {
        let (m, n) = (self.n_edges(), self.n_nodes() as u64);
        m.checked_mul(16 + 8)
            .and_then(|b| b.checked_add(n.checked_mul(32)?))
    }
    /// Number of directed edges drawn, `edge_factor · 2^scale`, before deduplication,
    /// symmetrization and self-loop handling (saturating for an invalid scale).
    pub fn n_edges(&self) -> u64 {
        if self.scale > MAX_SCALE {
            return u64::MAX;
        }
        // edge_factor < 2^32 and scale <= 31: the product is below 2^63.
        (self.edge_factor as u64) << self.scale
    }

    /// Checks the configuration: `scale ≤ 31`, each probability in `[0, 1]`, `a + b + c ≤ 1`,
    /// and `edge_factor · 2^scale` edges within [`MAX_NNZ`].
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if self.scale > MAX_SCALE {
            return Err(Error::InvalidParameter {
                what: "R-MAT scale",
                why: format!(
                    "{} exceeds {MAX_SCALE} (2^scale nodes must fit 32-bit indices)",
                    self.scale
                ),
            });
        }
        for (name, p) in [
            ("R-MAT probability a", self.a),
            ("R-MAT probability b", self.b),
            ("R-MAT probability c", self.c),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(Error::InvalidParameter {
                    what: name,
                    why: format!("{p} is not in [0, 1]"),
                });
            }
        }
        let sum = self.a + self.b + self.c;
        if sum > 1.0 + 1e-9 {
            return Err(Error::InvalidParameter {
                what: "R-MAT probabilities",
                why: format!(
                    "a + b + c = {} + {} + {} = {sum} exceeds 1 (d = 1 - a - b - c must be >= 0)",
                    self.a, self.b, self.c
                ),
            });
        }
        let m = self.n_edges();
        if m > MAX_NNZ {
            return Err(Error::InvalidParameter {
                what: "R-MAT edge count",
                why: format!(
                    "edge_factor * 2^scale = {} * 2^{} = {m} exceeds the limit of {MAX_NNZ} entries (32-bit row offsets)",
                    self.edge_factor, self.scale
                ),
            });
        }
        Ok(())
    }
}

/// One step of SplitMix64: a bijective mixer, used to derive stream seeds.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The PCG stream of `(seed, stream)`: state and increment both hashed from the pair, so that
/// streams of one seed are unrelated and different seeds give different streams.
fn stream_rng(seed: u64, stream: u64) -> Pcg64 {
    let mut s = seed;
    let mut t = splitmix64(&mut s) ^ stream;
    let words = [
        splitmix64(&mut t),
        splitmix64(&mut t),
        splitmix64(&mut t),
        splitmix64(&mut t),
    ];
    let state = (words[0] as u128) << 64 | words[1] as u128;
    let increment = (words[2] as u128) << 64 | words[3] as u128;
    Pcg64::new(state, increment)
}

/// A uniform integer in `0..bound` (`bound > 0`), by Lemire's multiply-and-reject: unbiased,
/// and defined by the PCG stream alone (no dependence on rand's sampling algorithms).
fn below(rng: &mut Pcg64, bound: u64) -> u64 {
    let mut m = rng.next_u64() as u128 * bound as u128;
    if (m as u64) < bound {
        let threshold = bound.wrapping_neg() % bound;
        while (m as u64) < threshold {
            m = rng.next_u64() as u128 * bound as u128;
        }
    }
    (m >> 64) as u64
}

/// A probability as a threshold on a uniform 32-bit integer.
fn threshold(p: f64) -> u64 {
    (p.clamp(0.0, 1.0) * 4_294_967_296.0).round() as u64
}

/// The raw R-MAT edge list: `edge_factor · 2^scale` directed edges `(src[k], dst[k])`, with the
/// node labels permuted if the configuration says so; not deduplicated, not symmetrized, self
/// loops as drawn. [`rmat`] builds its [`Csr`] from these (row `src`, column `dst`).
///
/// ```
/// use spattn_formats::{rmat_edges, RmatConfig};
/// let (src, dst) = rmat_edges(&RmatConfig::new(6).with_seed(3))?;
/// assert_eq!(src.len(), 16 * 64);
/// assert!(src.iter().chain(&dst).all(|&v| v < 64));
/// # Ok::<(), spattn_formats::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidParameter`] from [`RmatConfig::validate`].
pub fn rmat_edges(config: &RmatConfig) -> Result<(Vec<u32>, Vec<u32>)> {
    config.validate()?;
    let scale = config.scale;
    // Validated: m <= MAX_NNZ < 2^32 fits usize.
    let m = config.n_edges() as usize;
    let ta = threshold(config.a);
    let tab = threshold(config.a + config.b);
    let tabc = threshold(config.a + config.b + config.c);

    let mut src = alloc::try_filled(m, 0u32, "R-MAT edge sources")?;
    let mut dst = alloc::try_filled(m, 0u32, "R-MAT edge destinations")?;
    src.par_chunks_mut(EDGES_PER_STREAM)
        .zip(dst.par_chunks_mut(EDGES_PER_STREAM))
        .enumerate()
        .for_each(|(chunk, (src, dst))| {
            let mut rng = stream_rng(config.seed, chunk as u64);
            for (s, d) in src.iter_mut().zip(dst.iter_mut()) {
                let (mut i, mut j) = (0u32, 0u32);
                let mut bits = 0u64;
                // One 32-bit uniform per level, two levels per 64-bit draw.
                for level in 0..scale {
                    if level % 2 == 0 {
                        bits = rng.next_u64();
                    } else {
                        bits >>= 32;
                    }
                    let u = bits & 0xFFFF_FFFF;
                    // The quadrant q = [u >= ta] + [u >= tab] + [u >= tabc] is, in binary,
                    // (row bit, column bit): 0 = a (0, 0), 1 = b (0, 1), 2 = c (1, 0),
                    // 3 = d (1, 1). Branch-free: the comparisons are unpredictable.
                    let q = u32::from(u >= ta) + u32::from(u >= tab) + u32::from(u >= tabc);
                    i = (i << 1) | (q >> 1);
                    j = (j << 1) | (q & 1);
                }
                *s = i;
                *d = j;
            }
        });

    if config.permute_labels {
        let label = random_labels(config.n_nodes(), config.seed);
        src.par_iter_mut()
            .chain(dst.par_iter_mut())
            .with_min_len(1 << 14)
            .for_each(|v| *v = label[*v as usize]);
    }
    Ok((src, dst))
}

/// A uniformly random permutation of `0..n` (Fisher–Yates on the reserved label stream).
fn random_labels(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = stream_rng(seed, LABEL_STREAM);
    // n = 2^scale <= 2^31: every label fits u32.
    let mut label: Vec<u32> = (0..n as u64).map(|v| v as u32).collect();
    for i in (1..n).rev() {
        let j = below(&mut rng, i as u64 + 1) as usize;
        label.swap(i, j);
    }
    label
}

/// Generates a Graph500 R-MAT graph as an `n × n` pattern [`Csr`], `n = 2^scale`.
///
/// Draws the edges of [`rmat_edges`] (row `src`, column `dst`), deduplicates them, adds the
/// reverse edges if `symmetrize`, and either adds every self loop (`self_loops`) or removes the
/// drawn ones. The result depends only on the configuration: not on the thread count.
///
/// # Errors
/// [`Error::InvalidParameter`] from [`RmatConfig::validate`]; [`Error::TooManyEntries`] if the
/// symmetrized graph exceeds [`MAX_NNZ`] entries.
///
/// # Example
/// ```
/// use spattn_formats::{rmat, RmatConfig};
/// let a = rmat(&RmatConfig::benchmark(10).with_seed(42))?;
/// assert_eq!(a.n_rows(), 1024);
/// assert!(a.nnz() <= 2 * 16 * 1024 + 1024);
/// assert_eq!(a.transpose(), a); // symmetric
/// assert!((0..1024).all(|i| a.row(i).binary_search(&(i as u32)).is_ok())); // self loops
/// assert_eq!(rmat(&RmatConfig::benchmark(10).with_seed(42))?, a); // deterministic
/// # Ok::<(), spattn_formats::Error>(())
/// ```
pub fn rmat(config: &RmatConfig) -> Result<Csr> {
    config.validate()?;
    // The peak: the drawn edges in both directions (4 arrays of m u32) and the CSR build's
    // working set (its rows: 32 bytes a row; its 2m sorted entries), checked before drawing.
    alloc::check_host_bytes("the R-MAT graph's edges and CSR", config.peak_host_bytes())?;
    let (mut src, mut dst) = rmat_edges(config)?;
    let n = config.n_nodes();
    if !config.self_loops {
        retain_pairs(&mut src, &mut dst, |i, j| i != j);
    }
    let csr = if config.symmetrize && 2 * src.len() as u64 <= MAX_NNZ {
        // One sort for A + Aᵀ: rows = src ++ dst, cols = dst ++ src.
        let m = src.len();
        let mut rows = src;
        alloc::try_reserve(&mut rows, m, "R-MAT reverse edges")?;
        rows.extend_from_slice(&dst);
        let mut cols = dst;
        alloc::try_reserve(&mut cols, m, "R-MAT reverse edges")?;
        cols.extend_from_slice(&rows[..m]);
        Csr::from_unsorted(n, n, &rows, &cols, None)?
    } else {
        let directed = Csr::from_unsorted(n, n, &src, &dst, None)?;
        drop((src, dst));
        if config.symmetrize {
            directed.symmetrize()?
        } else {
            directed
        }
    };
    if config.self_loops {
        csr.with_self_loops()
    } else {
        Ok(csr)
    }
}

/// Keeps the pairs `(a[k], b[k])` for which `keep` holds, in order.
fn retain_pairs(a: &mut Vec<u32>, b: &mut Vec<u32>, keep: impl Fn(u32, u32) -> bool) {
    let mut w = 0;
    for k in 0..a.len() {
        let (x, y) = (a[k], b[k]);
        if keep(x, y) {
            a[w] = x;
            b[w] = y;
            w += 1;
        }
    }
    a.truncate(w);
    b.truncate(w);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_is_in_range_and_covers() {
        let mut rng = stream_rng(5, 0);
        let mut seen = [false; 7];
        for _ in 0..1000 {
            let v = below(&mut rng, 7);
            assert!(v < 7);
            seen[v as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(below(&mut rng, 1), 0);
    }

    #[test]
    fn labels_are_a_permutation() {
        let mut l = random_labels(1000, 9);
        assert_ne!(l, (0..1000).collect::<Vec<u32>>());
        l.sort_unstable();
        assert_eq!(l, (0..1000).collect::<Vec<u32>>());
    }

    #[test]
    fn streams_differ() {
        let mut x = stream_rng(1, 0);
        let mut y = stream_rng(1, 1);
        let mut z = stream_rng(2, 0);
        let (a, b, c) = (x.next_u64(), y.next_u64(), z.next_u64());
        assert!(a != b && a != c && b != c);
    }

    #[test]
    fn thresholds_cover_the_unit_interval() {
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(1.0), 1 << 32);
        // With d = 0 (a + b + c = 1) a uniform u32 is always below tabc.
        assert!(u32::MAX as u64 <= threshold(1.0));
    }
}
