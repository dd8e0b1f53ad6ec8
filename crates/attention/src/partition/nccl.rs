//! [`NcclExchange`]: the ranks of a partitioned plan on one GPU each, the halo and the
//! gradients' partials moved GPU to GPU by NCCL (`spattn_ops::nccl`: grouped send/recv). One
//! process per GPU joins through [`NcclExchange::from_env`] (torchrun's variables; the NCCL
//! unique id travels over [`TcpExchange`]'s rendezvous) or [`NcclExchange::over`] (any other
//! exchange); one process over the GPUs of its host runs [`run_nccl`].

use bytemuck::Pod;
use spattn_ops::RowIndex;
use spattn_ops::{AroundOwn, NcclComm, NcclId};
use spattn_ops::{DType, DeviceElement, DeviceVec, Gpu};

use super::{check_parts, join_ranks, Exchange, TcpExchange};
use crate::error::{Error, Result};

/// One rank's exchange over NCCL, on its GPU. Host blocks ([`Exchange::all_to_all`]: the
/// plan's requests, ∂L/∂scale) go through the GPU too; device blocks
/// ([`Exchange::all_to_all_device`], [`Exchange::all_to_all_device_around_own`]) go straight
/// from GPU to GPU. Every rank must make the same collective calls in the same order; a rank
/// that stops between collectives leaves the others waiting in NCCL, as with torch.distributed's NCCL backend. Dropping it aborts the
/// communicator (no wait for the other ranks), so a failing rank reports its error.
#[derive(Debug)]
pub struct NcclExchange {
    comm: NcclComm,
}

impl NcclExchange {
    /// Rank `rank` of `world` on `gpu`, joining the ranks that hold `id` (blocks until every
    /// rank has joined). Several ranks of one process (threads of the caller's own, not
    /// [`run_nccl`]'s) first call [`spattn_ops::share_pools`] on their GPUs: NCCL moves
    /// their blocks by direct pointers into each other's pool memory.
    ///
    /// Errors: a rank outside the world ([`Error::RankOutOfRange`]); NCCL unavailable or
    /// failing ([`Error::Ops`]).
    pub fn new(gpu: &Gpu, rank: usize, world: usize, id: &NcclId) -> Result<Self> {
        check_parts(world)?;
        if rank >= world {
            return Err(Error::RankOutOfRange { rank, world });
        }
        Ok(Self {
            comm: NcclComm::new(gpu, rank, world, id)?,
        })
    }

    /// Joins the world of `ex` (any exchange, such as a [`TcpExchange`]) on `gpu`: rank 0
    /// creates the NCCL id and sends it to the others over `ex`. A collective of `ex`.
    ///
    /// Errors: as [`new`](Self::new), and the exchange's.
    pub fn over(ex: &impl Exchange, gpu: &Gpu) -> Result<Self> {
        let (rank, world) = (ex.rank(), ex.world());
        // Rank 0's id, or its failure, reaches every rank (no rank waits for an id that
        // never comes): an empty block means "no id".
        let mine = if rank == 0 {
            match NcclId::new() {
                Ok(id) => Ok(id.as_bytes().to_vec()),
                Err(e) => Err(e),
            }
        } else {
            Ok(Vec::new())
        };
        let send = match &mine {
            Ok(bytes) => vec![bytes.clone(); world],
            Err(_) => vec![Vec::new(); world],
        };
        let got = ex.all_to_all(send)?;
        mine?;
        let bytes: [u8; 128] = got[0].as_slice().try_into().map_err(|_| Error::Exchange {
            why: format!(
                "rank 0 could not create an NCCL id ({} bytes came instead of 128)",
                got[0].len()
            ),
        })?;
        Self::new(gpu, rank, world, &NcclId::from_bytes(bytes))
    }

    /// One process per GPU, as torchrun starts them: `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
    /// `MASTER_PORT` as [`TcpExchange::from_env`] reads them (which carries the NCCL id); the
    /// GPU is `LOCAL_RANK`, or where it is unset `RANK` modulo the GPUs of this host. Build the
    /// rank's buffers and plans on [`gpu`](Self::gpu).
    ///
    /// Errors: as [`TcpExchange::from_env`] and [`over`](Self::over); a `LOCAL_RANK` that is not
    /// a number or not a device.
    pub fn from_env() -> Result<Self> {
        let tcp = TcpExchange::from_env()?;
        let local = match std::env::var("LOCAL_RANK") {
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .map_err(|_| Error::InvalidConfig {
                    what: "LOCAL_RANK",
                    why: format!("{v:?} is not a non-negative integer"),
                })?,
            Err(_) => tcp.rank() % Gpu::device_count()?.max(1),
        };
        let gpu = Gpu::new(local)?;
        Self::over(&tcp, &gpu)
    }

    /// The GPU this rank runs on.
    pub fn gpu(&self) -> &Gpu {
        self.comm.gpu()
    }
}

impl Exchange for NcclExchange {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn all_to_all<T: Pod + Send>(&self, send: Vec<Vec<T>>) -> Result<Vec<Vec<T>>> {
        let world = self.world();
        if send.len() != world {
            return Err(Error::WorldMismatch {
                what: "all_to_all blocks",
                expected: world,
                actual: send.len(),
            });
        }
        let gpu = self.gpu();
        // The sizes first (one u64 per pair of ranks), then the bytes.
        let sizes: Vec<u64> = send
            .iter()
            .map(|b| std::mem::size_of_val(b.as_slice()) as u64)
            .collect();
        let sizes_dev = DeviceVec::from_host(gpu, &sizes)?;
        let mut incoming = DeviceVec::<u64>::zeros(gpu, world)?;
        let ones = vec![1; world];
        self.comm
            .all_to_all(&sizes_dev, &ones, &mut incoming, &ones)?;
        let recv_bytes: Vec<usize> = incoming.to_host()?.iter().map(|&n| n as usize).collect();
        let send_bytes: Vec<usize> = sizes.iter().map(|&n| n as usize).collect();
        let flat: Vec<u8> = send
            .iter()
            .flat_map(|b| bytemuck::cast_slice::<T, u8>(b).iter().copied())
            .collect();
        let out = DeviceVec::from_host(gpu, &flat)?;
        let mut back = DeviceVec::<u8>::zeros(gpu, recv_bytes.iter().sum())?;
        self.comm
            .all_to_all(&out, &send_bytes, &mut back, &recv_bytes)?;
        let bytes = if back.is_empty() {
            Vec::new()
        } else {
            back.to_host()?
        };
        let size = std::mem::size_of::<T>().max(1);
        let mut at = 0;
        let mut blocks = Vec::with_capacity(world);
        for (s, &n) in recv_bytes.iter().enumerate() {
            if n % size != 0 {
                return Err(Error::Exchange {
                    why: format!(
                        "rank {s} sent {n} bytes, not a whole number of {size}-byte elements \
                         (ranks must call the same collectives in the same order)"
                    ),
                });
            }
            let mut block = vec![T::zeroed(); n / size];
            bytemuck::cast_slice_mut::<T, u8>(&mut block).copy_from_slice(&bytes[at..at + n]);
            blocks.push(block);
            at += n;
        }
        Ok(blocks)
    }

    fn all_to_all_device<T: DeviceElement>(
        &self,
        _gpu: &Gpu,
        send: &DeviceVec<T>,
        send_counts: &[usize],
        recv: &mut DeviceVec<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        // The buffers must be on this rank's GPU (checked by the communicator).
        Ok(self.comm.all_to_all(send, send_counts, recv, recv_counts)?)
    }

    fn all_to_all_device_around_own<T: DeviceElement>(
        &self,
        _gpu: &Gpu,
        send: &DeviceVec<T>,
        send_counts: &[usize],
        recv: &mut DeviceVec<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        Ok(self
            .comm
            .all_to_all_around_own(send, send_counts, recv, recv_counts)?)
    }

    fn all_to_all_device_around_own_gathering<T: DType>(
        &self,
        _gpu: &Gpu,
        blocks: &mut [AroundOwn<'_, T>],
        counts: (&[usize], &[usize]),
        own: &RowIndex,
        row_len: usize,
        own_at: usize,
    ) -> Result<()> {
        // The buffers must be on this rank's GPU (checked by the communicator).
        Ok(self
            .comm
            .all_to_all_around_own_gathering(blocks, counts, own, row_len, own_at)?)
    }
}

/// Runs `f` on one rank per GPU of `gpus` (one thread each, NCCL between them) and returns
/// their results in rank order, the first error otherwise. The GPUs must be distinct devices,
/// and the ranks' buffers and plans made on `ex.gpu()` (the handle the communicator holds). A
/// rank whose `f` fails between collectives leaves the others waiting in the next one (NCCL's
/// blocking communicators, as in torch.distributed without its watchdog): make the checks that
/// can fail before the first collective.
///
/// Errors: no GPUs, the same device twice ([`Error::InvalidConfig`]); NCCL's; `f`'s.
pub fn run_nccl<R: Send>(
    gpus: &[Gpu],
    f: impl Fn(&NcclExchange) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    check_parts(gpus.len())?;
    let mut ordinals: Vec<usize> = gpus.iter().map(Gpu::ordinal).collect();
    ordinals.sort_unstable();
    if let Some(w) = ordinals.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::InvalidConfig {
            what: "NCCL ranks",
            why: format!(
                "GPU {} is given twice: NCCL needs one device per rank",
                w[0]
            ),
        });
    }
    let id = NcclId::new()?;
    // Ranks of one process send by direct pointers into each other's pool memory.
    spattn_ops::share_pools(gpus)?;
    let world = gpus.len();
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let joins: Vec<_> = gpus
            .iter()
            .enumerate()
            .map(|(rank, gpu)| {
                let f = &f;
                s.spawn(move || f(&NcclExchange::new(gpu, rank, world, &id)?))
            })
            .collect();
        join_ranks(joins)
    });
    results.into_iter().collect()
}
