//! GPU tests of the row gather and scatter-add of the halo exchange (`rows.cu`) against the
//! same moves on the host, for rows whose bytes take 16-byte pieces and rows that do not.
//!
//! `#[ignore]`d on machines without an NVIDIA GPU; run them with
//! `cargo test -- --include-ignored` or from the GPU bundle (`cargo xtask gpu-bundle`).

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn_ops::{gather_rows, gather_rows_into, scatter_add_rows, RowIndex};
use spattn_ops::{DType, DeviceVec, Gpu};
use spattn_test_support::*;

/// Segments of distinct rows below `bound`, a row possibly in several segments.
fn segments(rng: &mut Pcg64, bound: usize, lens: &[usize]) -> Vec<Vec<u32>> {
    lens.iter()
        .map(|&len| {
            let mut rows: Vec<u32> = (0..bound as u32).collect();
            for i in 0..len.min(bound) {
                let j = rng.random_range(i..bound);
                rows.swap(i, j);
            }
            rows.truncate(len.min(bound));
            rows
        })
        .collect()
}

fn check<T: DType>(gpu: &Gpu, rng: &mut Pcg64, bound: usize, row_len: usize, lens: &[usize]) {
    let ctx = format!(
        "{} bound={bound} row_len={row_len} segments={lens:?}",
        T::NAME
    );
    let segs = segments(rng, bound, lens);
    let index = RowIndex::new(gpu, &segs, bound).unwrap();
    let all: Vec<u32> = segs.concat();
    let src: Vec<T> = random_vec(rng, bound * row_len, 1.0);
    let d_src = DeviceVec::from_host(gpu, &src).unwrap();
    let mut d_dst = DeviceVec::<T>::zeros(gpu, all.len() * row_len).unwrap();
    d_dst.fill_nan().unwrap();
    gather_rows(gpu, &d_src, row_len, &index, &mut d_dst).unwrap();
    let got = d_dst.to_host().unwrap();
    for (i, &r) in all.iter().enumerate() {
        let want = &src[r as usize * row_len..(r as usize + 1) * row_len];
        let row = &got[i * row_len..(i + 1) * row_len];
        // Bit-exact copies: compared as f32 (every value is finite).
        let same = row.iter().zip(want).all(|(a, b)| a.to_f32() == b.to_f32());
        assert!(same, "{ctx}: gathered row {i} (source row {r}) differs");
    }
    // Scatter-add the gathered rows back onto an accumulator, segment by segment.
    let acc0: Vec<f32> = random_vec(rng, bound * row_len, 1.0);
    let mut d_acc = DeviceVec::from_host(gpu, &acc0).unwrap();
    scatter_add_rows(gpu, &d_dst, row_len, &index, &mut d_acc).unwrap();
    let mut want = acc0;
    for (i, &r) in all.iter().enumerate() {
        for j in 0..row_len {
            want[r as usize * row_len + j] += got[i * row_len + j].to_f32();
        }
    }
    // Same f32 additions in the same (segment) order: equal bits.
    assert_eq!(d_acc.to_host().unwrap(), want, "{ctx}: scatter-add");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_row_gather_and_scatter_add_match_the_host_for_every_row_shape() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu rows");
    // Row bytes: 2, 6, 10 (no 16-byte piece), 16, 48, 64, 132 (f32 × 33), 2000, 4096.
    for row_len in [1, 3, 5, 8, 24, 32, 1000, 2048] {
        check::<f16>(&gpu, &mut rng, 3_000, row_len, &[700, 0, 1_500]);
        check::<bf16>(&gpu, &mut rng, 500, row_len, &[500]);
    }
    for row_len in [1, 3, 4, 12, 33, 64, 1024] {
        check::<f32>(&gpu, &mut rng, 2_000, row_len, &[1_999, 7, 0, 300]);
    }
    // More rows than one launch's threads cover: 512-byte rows take a whole warp each (32 pieces
    // of 16 bytes), and a launch's 2^24 threads hold 2^19 = 524,288 of them, so the rows loop.
    check::<f16>(&gpu, &mut rng, 600_000, 256, &[600_000]);
}

/// One `gather_rows_into` check: rows `at..at + index.len()` of a NaN-poisoned destination
/// get the source rows, bit for bit, and every other element stays NaN; one row further is
/// refused by name, with the destination's bits unchanged.
fn check_into<T: DType>(gpu: &Gpu, rng: &mut Pcg64, row_len: usize, at: usize) {
    let ctx = format!("{} row_len={row_len} at={at}", T::NAME);
    let (bound, dst_rows) = (300usize, 400usize);
    let segs = segments(rng, bound, &[120, 40]);
    let index = RowIndex::new(gpu, &segs, bound).unwrap();
    let all: Vec<u32> = segs.concat();
    let src: Vec<T> = random_vec(rng, bound * row_len, 1.0);
    let d_src = DeviceVec::from_host(gpu, &src).unwrap();
    let mut d_dst = DeviceVec::<T>::zeros(gpu, dst_rows * row_len).unwrap();
    d_dst.fill_nan().unwrap();
    gather_rows_into(gpu, &d_src, row_len, &index, &mut d_dst, at).unwrap();
    let got = d_dst.to_host().unwrap();
    for row in 0..dst_rows {
        let vals = &got[row * row_len..(row + 1) * row_len];
        match row.checked_sub(at).filter(|&i| i < all.len()) {
            Some(i) => {
                let r = all[i] as usize;
                let want = &src[r * row_len..(r + 1) * row_len];
                // Finite values: compared as f32, which is exact for every element type.
                let same = vals.iter().zip(want).all(|(a, b)| a.to_f32() == b.to_f32());
                assert!(same, "{ctx}: row {row} (source row {r}) differs");
            }
            None => assert!(
                vals.iter().all(|x| x.to_f32().is_nan()),
                "{ctx}: row {row} was written"
            ),
        }
    }
    let past = dst_rows - all.len() + 1;
    let err = gather_rows_into(gpu, &d_src, row_len, &index, &mut d_dst, past)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("gather destination") && err.contains(&format!("rows {past}..")),
        "{ctx}: {err}"
    );
    let bits = |v: &[T]| -> Vec<u32> { v.iter().map(|x| x.to_f32().to_bits()).collect() };
    assert_eq!(
        bits(&d_dst.to_host().unwrap()),
        bits(&got),
        "{ctx}: refused call wrote"
    );
}

/// `gather_rows_into` writes its rows alone, for rows of 16-byte pieces at offsets that keep
/// them aligned (f16 × 8, f32 × 64) and rows of single elements (f32 × 3, bf16 × 5);
/// `copy_from_host_at` likewise writes its range alone.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_gather_rows_into_writes_only_its_rows() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu rows into");
    check_into::<f16>(&gpu, &mut rng, 8, 5);
    check_into::<f32>(&gpu, &mut rng, 3, 7);
    check_into::<f32>(&gpu, &mut rng, 64, 0);
    check_into::<bf16>(&gpu, &mut rng, 5, 11);
    let mut d = DeviceVec::<f32>::zeros(&gpu, 10).unwrap();
    d.fill_nan().unwrap();
    d.copy_from_host_at(3, &[1.0, 2.0, 3.0]).unwrap();
    let got = d.to_host().unwrap();
    assert_eq!(&got[3..6], [1.0, 2.0, 3.0]);
    assert!(got[..3].iter().chain(&got[6..]).all(|x| x.is_nan()));
    let err = d.copy_from_host_at(8, &[0.0; 3]).unwrap_err().to_string();
    assert!(
        err.contains("3 elements at offset 8 end past the buffer's 10"),
        "{err}"
    );
    assert_eq!(DeviceVec::<f32>::unset(&gpu, 7).unwrap().len(), 7);
}
