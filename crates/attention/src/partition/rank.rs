//! [`RankPlan`]: one rank's part of a partitioned plan (its rows, the halo of K/V rows its edges
//! touch, who sends it what) and its forward and backward on the CPU or its GPU, with the halos
//! it fetches ([`Halo`], [`GpuHalo`]) and what it holds and moves ([`RankStats`]).

use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use bytemuck::Pod;
use spattn_ops::cpu::{self, AttentionInputs, Real};
use spattn_ops::AroundOwn;
use spattn_ops::RowIndex;
use spattn_ops::{edge_extras, DType, DeviceMatrix, DeviceVec, Gpu, Shape};

use super::{Exchange, Partition};
use crate::error::{Error, Result};
use crate::{AttentionConfig, AttentionPlan, Csr};

/// One rank's part of a partitioned plan: its rows, the halo of K/V rows its edges touch, its
/// rows' edges renumbered into the halo, and who sends it what.
#[derive(Clone, Debug)]
pub struct RankPlan {
    rank: usize,
    rows: Range<usize>,
    kv_rows: Range<usize>,
    /// Global K/V row ids of the halo, sorted (segment `s` holds rank `s`'s rows).
    halo: Vec<u32>,
    /// Halo rows per sender, in rank order.
    recv_counts: Vec<usize>,
    /// For each receiver, the K/V rows (local to this rank's block) it needs, in its order.
    send_rows: Vec<Vec<u32>>,
    local: Csr,
    /// `send_rows` on the GPU the rank runs on, built by its first device backward.
    send_index: Arc<Mutex<Option<Arc<RowIndex>>>>,
    /// The forward's halo gather on that GPU, built by its first `gather_halo_gpu`.
    halo_index: Arc<Mutex<Option<Arc<HaloIndex>>>>,
}

/// A rank's halo gather on its GPU: the rows the other ranks ask of it, packed for the
/// exchange, and its own halo rows, gathered straight into its halo.
#[derive(Debug)]
struct HaloIndex {
    /// `send_rows` with this rank's own segment empty.
    remote: RowIndex,
    /// This rank's own segment alone (its halo rows of its own K/V block).
    own: RowIndex,
    /// The halo row where the own segment starts.
    own_at: usize,
}

/// What one rank holds and moves, for reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankStats {
    /// Its rows.
    pub rows: usize,
    /// Its rows' edges.
    pub edges: usize,
    /// K/V rows its edges touch.
    pub halo_rows: usize,
    /// Of those, rows other ranks own (what the forward receives).
    pub remote_rows: usize,
    /// K/V rows it sends to other ranks per forward.
    pub sent_rows: usize,
}

impl RankPlan {
    /// This rank's plan of `a` under `part`: exchanges the halo requests with the other ranks
    /// (a collective: every rank of the world calls it).
    ///
    /// Errors: [`Error::WorldMismatch`] when the partition has another number of ranks than
    /// the world, [`Error::InvalidConfig`] when its blocks do not cover `a`.
    pub fn new(a: &Csr, part: &Partition, ex: &impl Exchange) -> Result<Self> {
        let (rank, world) = (ex.rank(), ex.world());
        if part.parts() != world {
            return Err(Error::WorldMismatch {
                what: "partition ranks",
                expected: world,
                actual: part.parts(),
            });
        }
        if part.rows.len() != a.n_rows() || part.kv.len() != a.n_cols() {
            return Err(Error::InvalidConfig {
                what: "partition",
                why: format!(
                    "covers {} rows and {} K/V rows, the graph has {} and {}",
                    part.rows.len(),
                    part.kv.len(),
                    a.n_rows(),
                    a.n_cols()
                ),
            });
        }
        let rows = part.rows.block(rank)?;
        let kv_rows = part.kv.block(rank)?;
        let (local, halo) = a.row_block_compacted(rows.clone())?;
        // Attention reads the pattern only: no edge values on the rank's GPU.
        let local = local.into_pattern();
        // Requests: the halo's rows owned by each rank, as global ids. The halo is sorted and the
        // K/V blocks cover 0..n_cols (checked above), so each rank's share is one slice of it.
        let requests: Vec<Vec<u32>> = (0..world)
            .map(|r| {
                let owned = part.kv.block(r)?;
                let lo = halo.partition_point(|&c| (c as usize) < owned.start);
                let hi = halo.partition_point(|&c| (c as usize) < owned.end);
                Ok(halo[lo..hi].to_vec())
            })
            .collect::<Result<_>>()?;
        let recv_counts = requests.iter().map(Vec::len).collect();
        let asked = ex.all_to_all(requests)?;
        let mut send_rows = Vec::with_capacity(world);
        for (s, ids) in asked.into_iter().enumerate() {
            let mut rows = Vec::with_capacity(ids.len());
            for c in ids {
                if !kv_rows.contains(&(c as usize)) {
                    return Err(Error::Exchange {
                        why: format!(
                            "rank {s} asked rank {rank} for K/V row {c}, which it does not own \
                             ({kv_rows:?}): do the ranks share one graph and partition?"
                        ),
                    });
                }
                rows.push(c - kv_rows.start as u32);
            }
            send_rows.push(rows);
        }
        Ok(Self {
            rank,
            rows,
            kv_rows,
            halo,
            recv_counts,
            send_rows,
            local,
            send_index: Arc::default(),
            halo_index: Arc::default(),
        })
    }

    /// Its rows (of Q, the output, dQ).
    pub fn rows(&self) -> Range<usize> {
        self.rows.clone()
    }

    /// Its K/V rows (of K, V, dK, dV).
    pub fn kv_rows(&self) -> Range<usize> {
        self.kv_rows.clone()
    }

    /// The K/V rows its edges touch, sorted.
    pub fn halo(&self) -> &[u32] {
        &self.halo
    }

    /// What it holds and moves.
    pub fn stats(&self) -> RankStats {
        let own = self.kv_rows.clone();
        RankStats {
            rows: self.rows.len(),
            edges: self.local.nnz(),
            halo_rows: self.halo.len(),
            remote_rows: self
                .halo
                .iter()
                .filter(|&&c| !own.contains(&(c as usize)))
                .count(),
            sent_rows: self
                .send_rows
                .iter()
                .enumerate()
                .filter(|&(d, _)| d != self.rank)
                .map(|(_, r)| r.len())
                .sum(),
        }
    }

    /// Gathers the halo of `own` (this rank's K/V rows, `row_len` values each) from every rank.
    fn gather<F: Pod + Send, E: Exchange>(
        &self,
        ex: &E,
        own: &[F],
        row_len: usize,
    ) -> Result<Vec<F>> {
        let send = self
            .send_rows
            .iter()
            .map(|rows| {
                let mut block = Vec::with_capacity(rows.len() * row_len);
                for &r in rows {
                    let r = r as usize * row_len;
                    block.extend_from_slice(&own[r..r + row_len]);
                }
                block
            })
            .collect();
        let recv = ex.all_to_all(send)?;
        for (s, (block, &n)) in recv.iter().zip(&self.recv_counts).enumerate() {
            if block.len() != n * row_len {
                return Err(Error::Exchange {
                    why: format!(
                        "rank {s} sent {} values, expected {} rows of {row_len}",
                        block.len(),
                        n
                    ),
                });
            }
        }
        Ok(recv.concat())
    }

    /// Sends the halo rows of `halo_values` back to their owners and returns this rank's K/V
    /// rows with every rank's contributions summed (in rank order: deterministic).
    fn scatter_add<F: Real + Pod, E: Exchange>(
        &self,
        ex: &E,
        halo_values: &[F],
        row_len: usize,
    ) -> Result<Vec<F>> {
        let mut send = Vec::with_capacity(self.recv_counts.len());
        let mut at = 0;
        for &n in &self.recv_counts {
            send.push(halo_values[at * row_len..(at + n) * row_len].to_vec());
            at += n;
        }
        let recv = ex.all_to_all(send)?;
        let mut own = vec![F::ZERO; self.kv_rows.len() * row_len];
        for (s, (block, rows)) in recv.iter().zip(&self.send_rows).enumerate() {
            if block.len() != rows.len() * row_len {
                return Err(Error::Exchange {
                    why: format!(
                        "rank {s} sent {} gradient values, expected {} rows of {row_len}",
                        block.len(),
                        rows.len()
                    ),
                });
            }
            for (i, &r) in rows.iter().enumerate() {
                let dst = &mut own[r as usize * row_len..(r as usize + 1) * row_len];
                for (d, &x) in dst.iter_mut().zip(&block[i * row_len..(i + 1) * row_len]) {
                    *d = *d + x;
                }
            }
        }
        Ok(own)
    }

    fn shapes(&self, heads: usize, head_dim: usize) -> Result<(Shape, Shape, Shape)> {
        Ok((
            Shape::new(self.rows.len(), heads, head_dim)?,
            Shape::new(self.kv_rows.len(), heads, head_dim)?,
            Shape::new(self.halo.len(), heads, head_dim)?,
        ))
    }

    fn check_own<F>(&self, what: &'static str, x: &[F], shape: Shape) -> Result<()> {
        if x.len() != shape.len() {
            return Err(Error::LengthMismatch {
                what,
                expected: shape.len(),
                actual: x.len(),
                shape,
            });
        }
        Ok(())
    }

    /// Fetches this rank's halo of K and V (`halo().len()` rows each) from their owners, given
    /// its own K/V rows (`kv_rows() × heads × head_dim`). A collective; a training step gathers
    /// once and passes the halo to [`forward_on`](Self::forward_on) and
    /// [`backward`](Self::backward).
    ///
    /// Errors: [`Error::LengthMismatch`] naming an operand of the wrong length, the exchange's.
    pub fn gather_halo<F: Real + Pod, E: Exchange>(
        &self,
        ex: &E,
        k: &[F],
        v: &[F],
        heads: usize,
        head_dim: usize,
    ) -> Result<Halo<F>> {
        let (_, skv, sh) = self.shapes(heads, head_dim)?;
        self.check_own("k (this rank's K/V rows)", k, skv)?;
        self.check_own("v (this rank's K/V rows)", v, skv)?;
        let row_len = heads * head_dim;
        Ok(Halo {
            k: self.gather(ex, k, row_len)?,
            v: self.gather(ex, v, row_len)?,
            shape: sh,
        })
    }

    /// This rank's rows of `softmax_row(scale · Q Kᵀ masked by A) · V` from its own rows of Q
    /// (`rows() × heads × head_dim`) and of K and V (`kv_rows() × heads × head_dim`). A
    /// collective ([`gather_halo`](Self::gather_halo), then [`forward_on`](Self::forward_on)).
    ///
    /// Errors: [`Error::LengthMismatch`] naming an operand of the wrong length, the CPU
    /// reference's, and the exchange's.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<F: Real + Pod, E: Exchange>(
        &self,
        ex: &E,
        q: &[F],
        k: &[F],
        v: &[F],
        heads: usize,
        head_dim: usize,
        scale: F,
    ) -> Result<Vec<F>> {
        let (sq, _, _) = self.shapes(heads, head_dim)?;
        // Q's length first: a wrong Q fails before the collective, on this rank alone.
        self.check_own("q (this rank's rows)", q, sq)?;
        let halo = self.gather_halo(ex, k, v, heads, head_dim)?;
        self.forward_on(&halo, q, scale)
    }

    /// The forward on a gathered halo (no exchange).
    ///
    /// Errors: as [`forward`](Self::forward).
    pub fn forward_on<F: Real + Pod>(&self, halo: &Halo<F>, q: &[F], scale: F) -> Result<Vec<F>> {
        let sq = self.halo_q_shape(halo)?;
        self.check_own("q (this rank's rows)", q, sq)?;
        let mut out = vec![F::ZERO; sq.len()];
        let inputs = AttentionInputs::new(q, sq, &halo.k, halo.shape, &halo.v, halo.shape);
        cpu::attention(&self.local, &inputs, scale, &mut out)?;
        Ok(out)
    }

    /// The gradients of the forward on `halo` given this rank's `q`, `out` and `d_out`: dQ for
    /// its rows, dK and dV for its K/V rows (every rank's contributions summed), and ∂L/∂scale
    /// summed over the world (the same on every rank). A collective (the partials go back to
    /// their owners; the halo is not fetched again).
    ///
    /// Errors: as [`forward`](Self::forward).
    pub fn backward<F: Real + Pod, E: Exchange>(
        &self,
        ex: &E,
        halo: &Halo<F>,
        (q, out, d_out): (&[F], &[F], &[F]),
        scale: F,
    ) -> Result<cpu::AttentionGrads<F>> {
        let sq = self.halo_q_shape(halo)?;
        self.check_own("q (this rank's rows)", q, sq)?;
        self.check_own("out (this rank's rows)", out, sq)?;
        self.check_own("d_out (this rank's rows)", d_out, sq)?;
        let row_len = sq.row_len();
        let inputs = AttentionInputs::new(q, sq, &halo.k, halo.shape, &halo.v, halo.shape);
        let g = cpu::attention_backward(&self.local, &inputs, scale, out, d_out)?;
        let dk = self.scatter_add(ex, &g.dk, row_len)?;
        let dv = self.scatter_add(ex, &g.dv, row_len)?;
        let all = ex.all_to_all(vec![vec![g.d_scale, g.d_scale_terms]; ex.world()])?;
        let sum = |i: usize| {
            all.iter()
                .filter_map(|r| r.get(i))
                .fold(F::ZERO, |s, &x| s + x)
        };
        Ok(cpu::AttentionGrads {
            dq: g.dq,
            dk,
            dv,
            d_scale: sum(0),
            d_scale_terms: sum(1),
        })
    }

    /// This rank's rows' edges with their columns renumbered into its halo
    /// (`rows().len() × halo().len()`): the graph of its local attention.
    pub fn local_graph(&self) -> &Csr {
        &self.local
    }

    /// A GPU plan of this rank's local attention ([`local_graph`](Self::local_graph)) with
    /// `config`, for [`forward_gpu`](Self::forward_gpu) and
    /// [`backward_gpu`](Self::backward_gpu): any algorithm and dtype a plan takes.
    ///
    /// Errors: as [`AttentionPlan::new_gpu`].
    pub fn gpu_plan(&self, gpu: &Gpu, config: AttentionConfig) -> Result<AttentionPlan> {
        AttentionPlan::new_gpu(gpu, &self.local, config)
    }

    /// [`gather_halo`](Self::gather_halo) on the GPU: this rank's own K and V rows
    /// (`kv_rows() × heads × head_dim` on `gpu`) out to the exchange, the halo back onto `gpu`.
    /// A collective. The rows other ranks ask for are packed for the exchange, which moves K
    /// and V around the own block while the halo rows this rank owns are gathered straight into
    /// it ([`Exchange::all_to_all_device_around_own_gathering`]): every halo element is written
    /// once and nothing is zero-filled first.
    ///
    /// Errors: a shape mismatch naming K or V ([`Error::Ops`]), the exchange's, the GPU's.
    pub fn gather_halo_gpu<T: DType, E: Exchange>(
        &self,
        ex: &E,
        gpu: &Gpu,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
    ) -> Result<GpuHalo<T>> {
        let (heads, head_dim) = (k.shape().heads, k.shape().head_dim);
        let (_, skv, sh) = self.shapes(heads, head_dim)?;
        skv.expect_eq("k (this rank's K/V rows)", k.shape())?;
        skv.expect_eq("v (this rank's K/V rows)", v.shape())?;
        let row_len = skv.row_len();
        let index = self.halo_index(gpu)?;
        let (mut send_counts, recv_counts) = self.block_counts(row_len);
        send_counts[self.rank] = 0;
        let pack = |own: &DeviceMatrix<T>| -> Result<DeviceVec<T>> {
            let mut packed = DeviceVec::<T>::unset(gpu, index.remote.len() * row_len)?;
            spattn_ops::gather_rows(gpu, own.as_vec(), row_len, &index.remote, &mut packed)?;
            Ok(packed)
        };
        let (pk, pv) = (pack(k)?, pack(v)?);
        // Every row is written below: the own block by the gather, the others by the exchange
        // (the receive counts add up to the halo).
        let mut hk = DeviceMatrix::<T>::unset(gpu, sh)?;
        let mut hv = DeviceMatrix::<T>::unset(gpu, sh)?;
        ex.all_to_all_device_around_own_gathering(
            gpu,
            &mut [
                AroundOwn {
                    send: &pk,
                    own_rows: k.as_vec(),
                    recv: hk.as_vec_mut(),
                },
                AroundOwn {
                    send: &pv,
                    own_rows: v.as_vec(),
                    recv: hv.as_vec_mut(),
                },
            ],
            (&send_counts, &recv_counts),
            &index.own,
            row_len,
            index.own_at,
        )?;
        Ok(GpuHalo { k: hk, v: hv })
    }

    /// The forward's halo gather on `gpu` ([`HaloIndex`]); uploaded once per GPU.
    fn halo_index(&self, gpu: &Gpu) -> Result<Arc<HaloIndex>> {
        let mut slot = self
            .halo_index
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(index) = slot.as_ref().filter(|i| i.own.is_on(gpu)) {
            return Ok(index.clone());
        }
        let bound = self.kv_rows.len();
        let mut remote = self.send_rows.clone();
        let own = std::mem::take(&mut remote[self.rank]);
        let index = Arc::new(HaloIndex {
            remote: RowIndex::new(gpu, &remote, bound)?,
            own: RowIndex::new(gpu, &[own], bound)?,
            own_at: self.recv_counts[..self.rank].iter().sum(),
        });
        *slot = Some(index.clone());
        Ok(index)
    }

    /// The K/V rows each rank asks of this one, on `gpu` (segment `d`: rank `d`'s); uploaded
    /// once per GPU.
    fn send_index(&self, gpu: &Gpu) -> Result<Arc<RowIndex>> {
        let mut slot = self
            .send_index
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(index) = slot.as_ref().filter(|i| i.is_on(gpu)) {
            return Ok(index.clone());
        }
        let index = Arc::new(RowIndex::new(gpu, &self.send_rows, self.kv_rows.len())?);
        *slot = Some(index.clone());
        Ok(index)
    }

    /// Elements per block of a halo exchange of rows of `row_len`: (sent to each rank,
    /// received from each rank).
    fn block_counts(&self, row_len: usize) -> (Vec<usize>, Vec<usize>) {
        (
            self.send_rows.iter().map(|r| r.len() * row_len).collect(),
            self.recv_counts.iter().map(|&n| n * row_len).collect(),
        )
    }

    /// This rank's rows of the attention output on its GPU, from its own rows of Q, K and V on
    /// the device (shapes as [`forward`](Self::forward)'s): gathers the halo
    /// ([`gather_halo_gpu`](Self::gather_halo_gpu)), then runs `plan`
    /// ([`gpu_plan`](Self::gpu_plan)) on it. A collective. Returns the halo for the backward.
    ///
    /// Errors: as [`gather_halo_gpu`](Self::gather_halo_gpu) and [`AttentionPlan::forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward_gpu<T: DType, E: Exchange>(
        &self,
        ex: &E,
        plan: &AttentionPlan,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<GpuHalo<T>> {
        let Some(gpu) = plan.gpu() else {
            return Err(Error::WrongPlanKind {
                plan: "CPU",
                use_instead: "RankPlan::forward",
            });
        };
        let halo = self.gather_halo_gpu(ex, gpu, k, v)?;
        plan.forward(q, &halo.k, &halo.v, out)?;
        Ok(halo)
    }

    /// The gradients of [`forward_gpu`](Self::forward_gpu) on its `halo`, given this rank's
    /// `q`, `out` and `d_out` on the device: dQ for its rows, dK and dV for its K/V rows (every
    /// rank's contributions summed in f32, in rank order, then rounded to `T`), and ∂L/∂scale
    /// summed over the world. A collective.
    ///
    /// Errors: as [`backward`](Self::backward) and [`AttentionPlan::backward`].
    pub fn backward_gpu<T: DType, E: Exchange>(
        &self,
        ex: &E,
        plan: &AttentionPlan,
        halo: &GpuHalo<T>,
        (q, out, d_out): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        (dq, dk, dv): (
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
        ),
    ) -> Result<f32> {
        let Some(gpu) = plan.gpu() else {
            return Err(Error::WrongPlanKind {
                plan: "CPU",
                use_instead: "RankPlan::backward",
            });
        };
        let sh = halo.k.shape();
        let (_, skv, _) = self.shapes(sh.heads, sh.head_dim)?;
        skv.expect_eq("dk (this rank's K/V rows)", dk.shape())?;
        skv.expect_eq("dv (this rank's K/V rows)", dv.shape())?;
        let mut hdk = DeviceMatrix::<T>::zeros(gpu, sh)?;
        let mut hdv = DeviceMatrix::<T>::zeros(gpu, sh)?;
        let d_scale = plan.backward(q, &halo.k, &halo.v, out, d_out, dq, &mut hdk, &mut hdv)?;
        let row_len = sh.row_len();
        let index = self.send_index(gpu)?;
        // The partials travel the halo's way back: this rank's halo segments to their owners.
        let (back_recv, back_send) = self.block_counts(row_len);
        // Overwritten whole by each exchange (the receive counts add up to it).
        let mut partials = DeviceVec::<T>::unset(gpu, index.len() * row_len)?;
        let mut acc = DeviceVec::<f32>::zeros(gpu, self.kv_rows.len() * row_len)?;
        for (halo_grad, own) in [(&hdk, dk), (&hdv, dv)] {
            ex.all_to_all_device(
                gpu,
                halo_grad.as_vec(),
                &back_send,
                &mut partials,
                &back_recv,
            )?;
            acc.fill(0.0)?;
            spattn_ops::scatter_add_rows(gpu, &partials, row_len, &index, &mut acc)?;
            edge_extras::cast(gpu, &acc, own.as_vec_mut())?;
        }
        let all = ex.all_to_all(vec![vec![d_scale]; ex.world()])?;
        Ok(all.iter().flatten().sum())
    }

    /// The shape of this rank's Q rows for a halo's heads and head_dim, checking the halo is
    /// this rank's.
    fn halo_q_shape<F>(&self, halo: &Halo<F>) -> Result<Shape> {
        let (sq, _, sh) = self.shapes(halo.shape.heads, halo.shape.head_dim)?;
        if sh != halo.shape {
            return Err(Error::ShapeMismatch {
                what: "halo (of another rank's plan)",
                expected: sh,
                actual: halo.shape,
            });
        }
        Ok(sq)
    }
}

/// A rank's halo of K and V rows on its GPU (`RankPlan::halo` order), fetched by
/// [`RankPlan::forward_gpu`] (or [`RankPlan::gather_halo_gpu`]) for the forward and its
/// backward.
#[derive(Debug)]
pub struct GpuHalo<T: DType> {
    k: DeviceMatrix<T>,
    v: DeviceMatrix<T>,
}

impl<T: DType> GpuHalo<T> {
    /// The halo's K rows (`halo().len() × heads × head_dim`).
    pub fn k(&self) -> &DeviceMatrix<T> {
        &self.k
    }
    /// The halo's V rows.
    pub fn v(&self) -> &DeviceMatrix<T> {
        &self.v
    }
}

/// A rank's halo of K and V rows (`RankPlan::halo` order), fetched once by
/// [`RankPlan::gather_halo`] for a forward and its backward.
#[derive(Clone, Debug)]
pub struct Halo<F> {
    k: Vec<F>,
    v: Vec<F>,
    /// `halo rows × heads × head_dim`.
    shape: Shape,
}
