//! Rows moved by index on the device (`rows.cu`), for the halo exchange of partitioned plans:
//! a rank packs the K/V rows each other rank asks for into one contiguous block per receiver
//! ([`gather_rows`]) and its own halo rows straight into its halo ([`gather_rows_into`]), and
//! sums the gradient rows sent back to it into its own rows ([`scatter_add_rows`], in f32,
//! segment after segment: deterministic). The indices live in a [`RowIndex`], checked once
//! against the rows they address when it is built. Rows are also resized (`resize_rows`):
//! the tensor-core kernels read heads of whole 16-byte vectors, and heads of other lengths are
//! padded with zeros for them, and their output cut back.
//!
//! ```no_run
//! use spattn_ops::{gather_rows, RowIndex};
//! use spattn_ops::{DeviceVec, Gpu};
//!
//! let gpu = Gpu::new(0)?;
//! // Four rows of two values; receiver 0 wants rows 3 and 1, receiver 1 row 0.
//! let src = DeviceVec::from_host(&gpu, &[0.0f32, 0.1, 1.0, 1.1, 2.0, 2.1, 3.0, 3.1])?;
//! let index = RowIndex::new(&gpu, &[vec![3, 1], vec![0]], 4)?;
//! let mut packed = DeviceVec::<f32>::zeros(&gpu, index.len() * 2)?;
//! gather_rows(&gpu, &src, 2, &index, &mut packed)?;
//! assert_eq!(packed.to_host()?, [3.0, 3.1, 1.0, 1.1, 0.0, 0.1]);
//! # Ok::<(), spattn_ops::Error>(())
//! ```

use std::ops::Range;

use spattn_kernels_sys::ROWS;

use crate::buffer::{expect_len, DeviceVec};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{
    check_same_gpu, kernel_named, launch, stride_grid, to_u32, PushKernelArg, PushOptionalArg,
};
use crate::schedule::{group_for, vector_width};
use crate::{DeviceMatrix, Shape};

/// The gather kernel for elements of `dtype` (a [`DType::NAME`]); the launch-name test forms it
/// too.
pub(crate) fn gather_kernel(dtype: &str) -> String {
    format!("gather_rows_{dtype}")
}

/// The scatter-add kernel for sources of `dtype` (a [`DType::NAME`]).
pub(crate) fn scatter_add_kernel(dtype: &str) -> String {
    format!("scatter_add_rows_{dtype}")
}

/// The resize kernel for elements of `dtype` (a [`DType::NAME`]).
pub(crate) fn resize_kernel(dtype: &str) -> String {
    format!("resize_rows_{dtype}")
}

/// Row indices on the device in segments (one per peer rank), each below a bound (the rows of
/// the matrix they address) and, within a segment, distinct.
#[derive(Debug)]
pub struct RowIndex {
    idx: DeviceVec<u32>,
    /// Segment `s` is `idx[offsets[s]..offsets[s + 1]]`.
    offsets: Vec<usize>,
    bound: usize,
}

impl RowIndex {
    /// Uploads `segments` (concatenated), checking every index is below `bound` and that no
    /// segment repeats one.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the segment and the index; the GPU's.
    pub fn new(gpu: &Gpu, segments: &[Vec<u32>], bound: usize) -> Result<Self> {
        let (all, offsets) = concat_checked(segments, bound)?;
        Ok(Self {
            idx: DeviceVec::from_host(gpu, &all)?,
            offsets,
            bound,
        })
    }

    /// Indices in all segments.
    pub fn len(&self) -> usize {
        self.offsets[self.offsets.len() - 1]
    }

    /// Whether there are no indices.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of segments.
    pub(crate) fn segments(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The positions of segment `s` among all indices.
    pub(crate) fn segment(&self, s: usize) -> Range<usize> {
        self.offsets[s]..self.offsets[s + 1]
    }

    /// The rows the indices address (each index is below it).
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// Whether the indices live on `gpu` (this handle or a clone of it).
    pub fn is_on(&self, gpu: &Gpu) -> bool {
        self.idx.gpu().same_as(gpu)
    }
}

/// The segments concatenated and their offsets, once every index is checked below `bound` and
/// unique within its segment.
fn concat_checked(segments: &[Vec<u32>], bound: usize) -> Result<(Vec<u32>, Vec<usize>)> {
    let mut offsets = Vec::with_capacity(segments.len() + 1);
    offsets.push(0);
    // The segment that last held each row (segments are numbered from 1 here).
    let mut seen = vec![0usize; bound];
    let mut all = Vec::with_capacity(segments.iter().map(Vec::len).sum());
    for (s, seg) in segments.iter().enumerate() {
        for &i in seg {
            let Some(last) = seen.get_mut(i as usize) else {
                return Err(Error::InvalidArgument {
                    what: "row index",
                    why: format!("segment {s} holds row {i}, past the {bound} rows"),
                });
            };
            if *last == s + 1 {
                return Err(Error::InvalidArgument {
                    what: "row index",
                    why: format!("segment {s} holds row {i} twice"),
                });
            }
            *last = s + 1;
        }
        all.extend_from_slice(seg);
        offsets.push(all.len());
    }
    Ok((all, offsets))
}

fn rows_len(rows: usize, row_len: usize) -> Result<usize> {
    rows.checked_mul(row_len).ok_or(Error::TooLarge {
        what: "rows × row length",
        value: u64::MAX,
        limit: usize::MAX as u64,
    })
}

/// `dst` = the rows of `src` (`index.bound()` rows of `row_len`) at `index`, segment after
/// segment (`index.len()` rows).
///
/// # Errors
/// Lengths that do not fit the index and `row_len`; buffers of another GPU.
pub fn gather_rows<T: DType>(
    gpu: &Gpu,
    src: &DeviceVec<T>,
    row_len: usize,
    index: &RowIndex,
    dst: &mut DeviceVec<T>,
) -> Result<()> {
    expect_len(
        "gather destination (indices × row length)",
        rows_len(index.len(), row_len)?,
        dst.len(),
    )?;
    gather_rows_into(gpu, src, row_len, index, dst, 0)
}

/// Rows `at..at + index.len()` of `dst` (rows of `row_len`) = the rows of `src` at `index`,
/// segment after segment; `dst`'s other rows are left as they are. A rank gathers its own
/// halo rows straight into its halo with it.
///
/// # Errors
/// A source that is not `index.bound()` rows, a destination without rows
/// `at..at + index.len()`; buffers of another GPU.
pub fn gather_rows_into<T: DType>(
    gpu: &Gpu,
    src: &DeviceVec<T>,
    row_len: usize,
    index: &RowIndex,
    dst: &mut DeviceVec<T>,
    at: usize,
) -> Result<()> {
    expect_len(
        "gather source (bound × row length)",
        rows_len(index.bound, row_len)?,
        src.len(),
    )?;
    let start = rows_len(at, row_len)?;
    let len = rows_len(index.len(), row_len)?;
    let end = start.checked_add(len).filter(|&e| e <= dst.len());
    let Some(end) = end else {
        return Err(Error::InvalidArgument {
            what: "gather destination",
            why: format!(
                "rows {at}..{at}+{} of {row_len} do not fit its {} elements",
                index.len(),
                dst.len()
            ),
        });
    };
    check_same_gpu(gpu, "gather source", src)?;
    check_same_gpu(gpu, "gather destination", &*dst)?;
    check_same_gpu(gpu, "row index", &index.idx)?;
    if len == 0 {
        return Ok(());
    }
    let name = kernel_named(&ROWS, gather_kernel(T::NAME))?;
    let f = gpu.load_function(ROWS.name, ROWS.ptx, name)?;
    let (n, w) = (index.len() as u64, to_u32("row length", row_len)?);
    // The kernel copies 16-byte pieces where a row's bytes are a multiple of 16 and both
    // pointers are 16-byte aligned (it checks): a row's lanes are its pieces, up to a warp.
    let bytes = row_len * std::mem::size_of::<T>();
    let g = group_for(if bytes % 16 == 0 { bytes / 16 } else { row_len } as u64, 1);
    let cfg = stride_grid(rows_len(index.len(), g as usize)?)?;
    let mut dst_rows = dst.slice_mut().slice_mut(start..end);
    let mut args = gpu.launch_builder(&f);
    args.arg(src.slice())
        .arg(index.idx.slice())
        .arg(&n)
        .arg(&w)
        .arg(&g)
        .arg(&mut dst_rows);
    // SAFETY: reads idx[0..n) and src rows idx[r] < bound (checked by RowIndex::new), i.e.
    // src[0..bound·row_len) = its length (checked); writes n·row_len elements from the start of
    // the view `dst_rows`, which is exactly dst[start..end) (checked within dst's length).
    unsafe { launch(name, &mut args, cfg) }
}

/// `acc[index[i], :] += src[i, :]` in f32, for `src`'s `index.len()` rows of `row_len` (the
/// segments concatenated) into `acc`'s `index.bound()` rows: one launch per segment, in order,
/// so every element's sum runs in segment order (deterministic).
///
/// # Errors
/// Lengths that do not fit the index and `row_len`; buffers of another GPU.
pub fn scatter_add_rows<T: DType>(
    gpu: &Gpu,
    src: &DeviceVec<T>,
    row_len: usize,
    index: &RowIndex,
    acc: &mut DeviceVec<f32>,
) -> Result<()> {
    expect_len(
        "scatter-add source (indices × row length)",
        rows_len(index.len(), row_len)?,
        src.len(),
    )?;
    expect_len(
        "scatter-add accumulator (bound × row length)",
        rows_len(index.bound, row_len)?,
        acc.len(),
    )?;
    check_same_gpu(gpu, "scatter-add source", src)?;
    check_same_gpu(gpu, "scatter-add accumulator", &*acc)?;
    check_same_gpu(gpu, "row index", &index.idx)?;
    let name = kernel_named(&ROWS, scatter_add_kernel(T::NAME))?;
    let f = gpu.load_function(ROWS.name, ROWS.ptx, name)?;
    let w = to_u32("row length", row_len)?;
    let g = group_for(row_len as u64, 1);
    for s in 0..index.segments() {
        let seg = index.segment(s);
        if seg.is_empty() || row_len == 0 {
            continue;
        }
        let n = seg.len() as u64;
        let src_seg = src.slice().slice(seg.start * row_len..seg.end * row_len);
        let idx_seg = index.idx.slice().slice(seg.clone());
        let mut args = gpu.launch_builder(&f);
        args.arg(&src_seg)
            .arg(&idx_seg)
            .arg(&n)
            .arg(&w)
            .arg(&g)
            .arg(acc.slice_mut());
        // SAFETY: reads the segment's n indices and its n rows of src (views of exactly that
        // range); writes acc rows idx[r] < bound (RowIndex::new), within acc's bound·row_len
        // (checked). A segment's indices are distinct (RowIndex::new): no two threads of the
        // launch add to one element.
        unsafe {
            launch(
                name,
                &mut args,
                stride_grid(rows_len(seg.len(), g as usize)?)?,
            )
        }?;
    }
    Ok(())
}

/// `len` elements of `elem_bytes` bytes rounded up to whole 16-byte vectors: the row length
/// the tensor-core register kernels read and write (they take heads padded to it).
pub(crate) fn vec_padded(len: usize, elem_bytes: usize) -> usize {
    let per_vec = (16 / elem_bytes.max(1)).max(1);
    len.div_ceil(per_vec) * per_vec
}

/// Most buffers [`resize_rows`] takes in one launch.
pub(crate) const MAX_RESIZES: usize = 4;

/// For each pair, `dst`'s rows (of `dst_len`) = `src`'s rows (of `src_len`, as many), cut to
/// `dst_len` elements or padded with zeros to it: up to [`MAX_RESIZES`] pairs in one launch
/// (small graphs pay a launch per copy otherwise).
///
/// # Errors
/// A zero row length; more than [`MAX_RESIZES`] pairs; a source that is not whole rows or a
/// destination of another number of rows; a row length past `u32`; buffers of another GPU.
pub(crate) fn resize_rows<T: DType>(
    gpu: &Gpu,
    (src_len, dst_len): (usize, usize),
    pairs: &mut [(&DeviceVec<T>, &mut DeviceVec<T>)],
) -> Result<()> {
    if src_len == 0 || dst_len == 0 || pairs.len() > MAX_RESIZES {
        return Err(Error::InvalidArgument {
            what: "row resize",
            why: format!(
                "rows of {src_len} -> {dst_len} elements in {} buffers (at most {MAX_RESIZES}, \
                 rows of at least one element)",
                pairs.len()
            ),
        });
    }
    let mut rows = [0u64; MAX_RESIZES];
    let mut most = 0;
    for (i, (src, dst)) in pairs.iter().enumerate() {
        let n = src.len() / src_len;
        expect_len(
            "resize source (rows × length)",
            rows_len(n, src_len)?,
            src.len(),
        )?;
        let len = rows_len(n, dst_len)?;
        expect_len("resize destination (rows × length)", len, dst.len())?;
        check_same_gpu(gpu, "resize source", *src)?;
        check_same_gpu(gpu, "resize destination", &**dst)?;
        rows[i] = n as u64;
        most = most.max(len);
    }
    if most == 0 {
        return Ok(());
    }
    let name = kernel_named(&ROWS, resize_kernel(T::NAME))?;
    let f = gpu.load_function(ROWS.name, ROWS.ptx, name)?;
    let (from, to) = (
        to_u32("resize source row length", src_len)?,
        to_u32("resize destination row length", dst_len)?,
    );
    // A thread a chunk of w destination elements (up to 16 bytes; the kernel narrows it for an
    // unaligned buffer, and the grid strides over what is left); grid.y picks the pair.
    let w = vector_width(dst_len, std::mem::size_of::<T>());
    let mut cfg = stride_grid(most / w as usize)?;
    cfg.grid_dim.1 = pairs.len() as u32; // ≤ MAX_RESIZES
    let mut args = gpu.launch_builder(&f);
    args.arg(&from).arg(&to).arg(&w);
    let mut unused = MAX_RESIZES;
    for ((src, dst), n) in pairs.iter_mut().zip(&rows) {
        args.arg(src.slice()).arg(n).arg(dst.slice_mut());
        unused -= 1;
    }
    for _ in 0..unused {
        args.arg_or_null(None::<&DeviceVec<T>>)
            .arg(&0u64)
            .arg_or_null_mut(None::<&mut DeviceVec<T>>);
    }
    // SAFETY: pair y < pairs.len() (grid.y; the null pairs past them are never read): row
    // r < rows[y] writes dst[r · dst_len + j] for j < dst_len (dst holds rows[y] · dst_len,
    // checked) and reads src[r · src_len + j] only for j < src_len (src holds rows[y] · src_len,
    // checked); a chunk of W elements starts at a multiple of W, which divides dst_len, and is
    // read whole from src only when W divides src_len too.
    unsafe { launch(name, &mut args, cfg) }
}

/// New buffers of `mats`' rows with every head (every piece of `d` elements of a row) padded
/// with zeros to `dp`, shaped rows × pieces × `dp` and named `what` (an out-of-memory error
/// says which): filled in one launch where their flag is set, left unset otherwise (for
/// outputs the caller's kernel writes).
///
/// # Errors
/// More than [`MAX_RESIZES`] matrices to fill; a row of a matrix to fill that is not whole
/// pieces of `d`; shapes past `usize`; out of device memory; buffers of another GPU.
pub(crate) fn padded_heads<T: DType, const N: usize>(
    gpu: &Gpu,
    what: &'static str,
    (d, dp): (usize, usize),
    mats: [(&DeviceMatrix<T>, bool); N],
) -> Result<[DeviceMatrix<T>; N]> {
    let mut out = Vec::with_capacity(N);
    for (m, _) in mats {
        let shape = Shape::new(m.shape().rows, m.shape().row_len() / d.max(1), dp)?;
        let data = DeviceVec::alloc(gpu, what, shape.len(), false)?;
        out.push(DeviceMatrix::from_vec(data, shape)?);
    }
    let mut pairs: Vec<_> = mats
        .iter()
        .zip(out.iter_mut())
        .filter(|((_, fill), _)| *fill)
        .map(|((m, _), p)| (m.as_vec(), p.as_vec_mut()))
        .collect();
    if !pairs.is_empty() {
        resize_rows(gpu, (d, dp), &mut pairs)?;
    }
    // One matrix was pushed per entry of `mats`.
    let Ok(out) = <[DeviceMatrix<T>; N]>::try_from(out) else {
        unreachable!("padded_heads allocates one matrix per entry")
    };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_concatenated_with_their_offsets() {
        let (all, offsets) = concat_checked(&[vec![3, 1], vec![], vec![1, 0, 2]], 4).unwrap();
        assert_eq!(all, [3, 1, 1, 0, 2]);
        assert_eq!(offsets, [0, 2, 2, 5]);
        // A row may appear in several segments (several ranks ask for it).
        let (all, offsets) = concat_checked(&[vec![0], vec![0]], 1).unwrap();
        assert_eq!((all, offsets), (vec![0, 0], vec![0, 1, 2]));
        assert_eq!(concat_checked(&[], 0).unwrap(), (vec![], vec![0]));
    }

    #[test]
    fn rows_past_the_bound_and_repeats_within_a_segment_are_refused_by_name() {
        let err = concat_checked(&[vec![0], vec![1, 4]], 4)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("segment 1 holds row 4, past the 4 rows"),
            "{err}"
        );
        let err = concat_checked(&[vec![2, 0, 2]], 3).unwrap_err().to_string();
        assert!(err.contains("segment 0 holds row 2 twice"), "{err}");
    }

    #[test]
    fn vec_padded_rounds_up_to_16_bytes() {
        assert_eq!(vec_padded(0, 2), 0);
        assert_eq!(vec_padded(1, 2), 8);
        assert_eq!(vec_padded(20, 2), 24);
        assert_eq!(vec_padded(24, 2), 24);
        assert_eq!(vec_padded(5, 4), 8);
        assert_eq!(vec_padded(3, 8), 4);
    }

    /// Rows padded with zeros and cut back (the tensor-core kernels' round trip), bitwise,
    /// in 2- and 4-byte elements (a negative zero survives the copies), three buffers of
    /// different row counts a launch; padded_heads' matrices; bad arguments refused by name.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_resize_rows_pads_with_zeros_and_cuts_back() {
        let gpu = Gpu::new(0).expect("an NVIDIA GPU");
        fn round_trip<T: DType + PartialEq + std::fmt::Debug>(gpu: &Gpu, x: impl Fn(usize) -> T) {
            let bits = |v: &[T]| v.iter().map(|e| format!("{e:?}")).collect::<Vec<_>>();
            // Chunks of 16, 8, 4 and 2 bytes; whole source chunks read as vectors (16 of 24).
            let cases = [
                (7, 20, 24),
                (1, 1, 8),
                (300, 3, 4),
                (0, 5, 8),
                (5, 16, 24),
                (999, 13, 16),
            ];
            for (rows, len, padded) in cases {
                let counts = [rows, rows / 2 + 1, 2 * rows + 3];
                let host: Vec<Vec<T>> = counts
                    .iter()
                    .enumerate()
                    .map(|(b, &n)| (0..n * len).map(|i| x(i + 7 * b)).collect())
                    .collect();
                let src: Vec<_> = host
                    .iter()
                    .map(|h| DeviceVec::from_host(gpu, h).unwrap())
                    .collect();
                let mut wide: Vec<_> = counts
                    .iter()
                    .map(|&n| {
                        let mut w = DeviceVec::<T>::zeros(gpu, n * padded).unwrap();
                        w.fill_nan().unwrap();
                        w
                    })
                    .collect();
                let mut pairs: Vec<_> = src.iter().zip(wide.iter_mut()).collect();
                resize_rows(gpu, (len, padded), &mut pairs).unwrap();
                for ((w, h), &n) in wide.iter().zip(&host).zip(&counts) {
                    let got = w.to_host().unwrap();
                    for r in 0..n {
                        let row = &got[r * padded..(r + 1) * padded];
                        assert_eq!(row[..len], h[r * len..(r + 1) * len], "row {r} of {n}");
                        assert!(row[len..].iter().all(|&v| v == T::from_f32(0.0)), "row {r}");
                    }
                }
                let mut back: Vec<_> = counts
                    .iter()
                    .map(|&n| DeviceVec::<T>::zeros(gpu, n * len).unwrap())
                    .collect();
                let mut pairs: Vec<_> = wide.iter().zip(back.iter_mut()).collect();
                resize_rows(gpu, (padded, len), &mut pairs).unwrap();
                for (b, h) in back.iter().zip(&host) {
                    let b = b.to_host().unwrap();
                    assert_eq!(bits(&b), bits(h), "{} {rows} x {len}", T::NAME);
                }
            }
            // padded_heads: 3 rows × 2 heads of 5, one filled and one only shaped.
            let host: Vec<T> = (0..30).map(&x).collect();
            let m = DeviceMatrix::from_host(gpu, Shape::new(3, 2, 5).unwrap(), &host).unwrap();
            let [p, o] = padded_heads(gpu, "test", (5, 8), [(&m, true), (&m, false)]).unwrap();
            assert_eq!(
                (p.shape(), o.shape()),
                (Shape::new(3, 2, 8).unwrap(), p.shape())
            );
            let got = p.to_host().unwrap();
            for h in 0..6 {
                assert_eq!(bits(&got[h * 8..h * 8 + 5]), bits(&host[h * 5..h * 5 + 5]));
                assert!(got[h * 8 + 5..h * 8 + 8]
                    .iter()
                    .all(|&v| v == T::from_f32(0.0)));
            }
            // Sources that are not whole rows, destinations of other row counts, zero lengths
            // and more buffers than a launch takes are refused by name.
            let src = DeviceVec::<T>::zeros(gpu, 10).unwrap();
            let mut dst = DeviceVec::<T>::zeros(gpu, 16).unwrap();
            let err = resize_rows(gpu, (4, 8), &mut [(&src, &mut dst)]).unwrap_err();
            assert!(err.to_string().contains("resize source"), "{err}");
            let err = resize_rows(gpu, (5, 4), &mut [(&src, &mut dst)]).unwrap_err();
            assert!(err.to_string().contains("resize destination"), "{err}");
            let err = resize_rows(gpu, (0, 4), &mut [(&src, &mut dst)]).unwrap_err();
            assert!(err.to_string().contains("row resize"), "{err}");
            let mut dsts: Vec<_> = (0..MAX_RESIZES + 1)
                .map(|_| DeviceVec::<T>::zeros(gpu, 20).unwrap())
                .collect();
            let mut pairs: Vec<_> = dsts.iter_mut().map(|d| (&src, d)).collect();
            let err = resize_rows(gpu, (5, 10), &mut pairs).unwrap_err();
            assert!(err.to_string().contains("at most 4"), "{err}");
        }
        round_trip::<half::f16>(&gpu, |i| half::f16::from_f32(i as f32 * 0.25 - 3.0));
        round_trip::<half::bf16>(&gpu, |i| half::bf16::from_f32(-(i as f32) * 0.5));
        round_trip::<f32>(&gpu, |i| if i == 3 { -0.0 } else { i as f32 * 1.5 });
    }
}
