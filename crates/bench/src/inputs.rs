//! Random inputs: Q, K, V uniform in [-1, 1], drawn from a seed that depends on the base seed
//! and the configuration (graph, heads, head_dim, dtype) only, never on the order of the run or
//! the number of threads.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use rayon::prelude::*;
use spattn_ops::{DType, DTypeKind, Shape};

use crate::error::Result;

/// Elements drawn per RNG stream (fixed, so the data does not depend on the thread count).
const CHUNK: usize = 1 << 16;

/// SplitMix64's finalizer: a bijective mix of 64 bits.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The seed of one configuration's inputs: the base seed mixed with an FNV-1a hash of
/// `graph/heads/head_dim/dtype`.
pub fn config_seed(base: u64, graph: &str, heads: usize, head_dim: usize, dtype: DTypeKind) -> u64 {
    let key = format!("{graph}/{heads}/{head_dim}/{dtype}");
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    mix64(base ^ h)
}

/// `len` values uniform in [-1, 1], rounded to `T`, from `seed` and a `stream` number (one per
/// matrix), in parallel.
///
/// # Errors
/// Where the host cannot hold `len` values (fallible allocation, never an abort).
pub fn uniform<T: DType>(len: usize, seed: u64, stream: u64) -> Result<Vec<T>> {
    let mut out = spattn_formats::alloc::try_filled(len, T::default(), "random inputs")?;
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let chunk_seed = mix64(seed ^ mix64((stream << 40) ^ i as u64));
            let mut rng = Pcg64::seed_from_u64(chunk_seed);
            for x in chunk {
                *x = T::from_f64(rng.random::<f64>() * 2.0 - 1.0);
            }
        });
    Ok(out)
}

/// Widens host data to f64, in parallel.
pub fn to_f64<T: DType>(x: &[T]) -> Vec<f64> {
    x.par_iter()
        .with_min_len(1 << 14)
        .map(|v| v.to_f64())
        .collect()
}

/// The host inputs of one configuration.
#[derive(Clone, Debug)]
pub struct HostInputs<T> {
    /// Queries, `n_rows × heads × head_dim`.
    pub q: Vec<T>,
    /// Keys, `n_cols × heads × head_dim`.
    pub k: Vec<T>,
    /// Values, `n_cols × heads × head_dim`.
    pub v: Vec<T>,
    /// Shape of Q and out.
    pub shape_q: Shape,
    /// Shape of K and V.
    pub shape_kv: Shape,
    /// The seed they were drawn from.
    pub seed: u64,
    /// The softmax scale, `1 / sqrt(head_dim)`.
    pub scale: f32,
}

impl<T: DType> HostInputs<T> {
    /// Draws Q, K, V for a graph of `n_rows × n_cols` from `seed`.
    ///
    /// # Errors
    /// When the shapes overflow or the host cannot hold them.
    pub fn draw(
        n_rows: usize,
        n_cols: usize,
        heads: usize,
        head_dim: usize,
        seed: u64,
    ) -> Result<Self> {
        let shape_q = Shape::new(n_rows, heads, head_dim)?;
        let shape_kv = Shape::new(n_cols, heads, head_dim)?;
        Ok(HostInputs {
            q: uniform(shape_q.len(), seed, 0)?,
            k: uniform(shape_kv.len(), seed, 1)?,
            v: uniform(shape_kv.len(), seed, 2)?,
            shape_q,
            shape_kv,
            seed,
            scale: 1.0 / (head_dim as f32).sqrt(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let a: Vec<f32> = uniform(200_000, 7, 1).unwrap();
        let b: Vec<f32> = uniform(200_000, 7, 1).unwrap();
        let c: Vec<f32> = uniform(200_000, 7, 2).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|x| (-1.0..=1.0).contains(x)));
        let mean = a.iter().map(|&x| f64::from(x)).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.01, "{mean}");
        let h: Vec<half::f16> = uniform(10, 7, 1).unwrap();
        assert!(h.iter().zip(&a).all(|(h, a)| (h.to_f32() - a).abs() < 1e-3));
    }

    #[test]
    fn seeds_depend_on_the_configuration() {
        let s = config_seed(1, "cora", 1, 64, DTypeKind::F16);
        assert_eq!(s, config_seed(1, "cora", 1, 64, DTypeKind::F16));
        assert_ne!(s, config_seed(1, "cora", 1, 64, DTypeKind::F32));
        assert_ne!(s, config_seed(2, "cora", 1, 64, DTypeKind::F16));
    }
}
