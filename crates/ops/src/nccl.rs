//! NCCL between GPUs: a communicator per rank ([`NcclComm`]) and the one collective a
//! partitioned plan needs, an all-to-all of variable-sized blocks of device memory, as NCCL's
//! grouped send/recv. libnccl is loaded at run time (cudarc's bindings), like libcuda: the
//! crate builds and runs without it, and [`NcclComm::available`] says why it cannot be used.
//!
//! cudarc looks for `libnccl.so` (and versioned names such as `libnccl.so.12`), not
//! `libnccl.so.2`, the only name PyPI's `nvidia-nccl-cu12` / `-cu13` wheels (which torch
//! installs) ship: a directory holding a link `libnccl.so → …/nvidia/nccl/lib/libnccl.so.2`
//! on `LD_LIBRARY_PATH` makes it found.
//!
//! ```no_run
//! use spattn_ops::{NcclComm, NcclId};
//! use spattn_ops::{DeviceVec, Gpu};
//!
//! NcclComm::available()?;
//! // One rank per thread here; one process per GPU passes the id's bytes over any channel.
//! let id = NcclId::new()?;
//! std::thread::scope(|s| {
//!     for rank in 0..2 {
//!         s.spawn(move || -> spattn_ops::Result<()> {
//!             let gpu = Gpu::new(rank)?;
//!             let comm = NcclComm::new(&gpu, rank, 2, &id)?;
//!             // Rank r sends r + 1 values to each rank.
//!             let send = DeviceVec::from_host(&gpu, &vec![rank as f32; 2 * (rank + 1)])?;
//!             let mut recv = DeviceVec::<f32>::zeros(&gpu, 1 + 2)?;
//!             comm.all_to_all(&send, &[rank + 1; 2], &mut recv, &[1, 2])?;
//!             assert_eq!(recv.to_host()?, [0.0, 1.0, 1.0]);
//!             Ok(())
//!         });
//!     }
//! });
//! # Ok::<(), spattn_ops::Error>(())
//! ```

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;

use crate::buffer::{DeviceElement, DeviceVec};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{check_same_gpu, map_driver_error};
use crate::rows::{self, RowIndex};
use crate::side_stream::SideStream;
use crate::DType;

/// The advice every "NCCL unavailable" error carries.
const WHERE: &str = "cudarc looks for libnccl.so (and libnccl.so.<CUDA major>); pip's \
                     nvidia-nccl wheels ship only libnccl.so.2: put a link named libnccl.so to \
                     it in a directory on LD_LIBRARY_PATH";

/// Runs an NCCL call, turning cudarc's panic on a missing library or symbol into an error.
fn guarded<R>(during: &'static str, f: impl FnOnce() -> R) -> Result<R> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic in cudarc's NCCL bindings".into());
        Error::NcclUnavailable {
            why: format!("{during}: {why}; {WHERE}"),
        }
    })
}

/// Maps an NCCL status to a result, with NCCL's own description.
fn check(during: &'static str, status: sys::ncclResult_t) -> Result<()> {
    if status == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any status.
    let text = guarded(during, || unsafe {
        CStr::from_ptr(sys::ncclGetErrorString(status))
            .to_string_lossy()
            .into_owned()
    })
    .unwrap_or_default();
    Err(Error::Nccl {
        during,
        code: format!("{status:?} ({text})"),
    })
}

/// Checks the layout of an all-to-all among `world` ranks: one count per rank for the blocks
/// sent and received, adding up to the send and receive buffers' lengths.
///
/// # Errors
/// [`Error::LengthMismatch`] for counts that are not one per rank, [`Error::InvalidArgument`]
/// for counts that do not add up to the buffer's length.
pub fn check_blocks(
    world: usize,
    (send_counts, send_len): (&[usize], usize),
    (recv_counts, recv_len): (&[usize], usize),
) -> Result<()> {
    for (what, counts, len) in [
        ("all-to-all send blocks", send_counts, send_len),
        ("all-to-all receive blocks", recv_counts, recv_len),
    ] {
        if counts.len() != world {
            return Err(Error::LengthMismatch {
                what,
                expected: world,
                actual: counts.len(),
            });
        }
        let total: usize = counts.iter().sum();
        if total != len {
            return Err(Error::InvalidArgument {
                what,
                why: format!("the blocks add up to {total} elements, the buffer holds {len}"),
            });
        }
    }
    Ok(())
}

/// Checks that `own_rows` rows of `row_len` from row `own_at` are exactly block `rank` of
/// `recv_counts` (elements, blocks in rank order): the block an exchange around the own block
/// leaves alone, so a rank may fill it while the others arrive.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the rows and the block otherwise.
pub fn check_own_block(
    rank: usize,
    recv_counts: &[usize],
    own_rows: usize,
    row_len: usize,
    own_at: usize,
) -> Result<()> {
    let at = recv_counts
        .iter()
        .take(rank)
        .try_fold(0usize, |at, &c| at.checked_add(c));
    let fits = recv_counts.get(rank).is_some_and(|&c| {
        own_rows.checked_mul(row_len) == Some(c)
            && at.is_some()
            && own_at.checked_mul(row_len) == at
    });
    if fits {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        what: "own block",
        why: format!(
            "{own_rows} rows of {row_len} from row {own_at} are not rank {rank}'s block of the \
             receive counts {recv_counts:?}"
        ),
    })
}

/// The unique id that makes the ranks of one world find each other: rank 0 creates it, every
/// rank passes it to [`NcclComm::new`] (one process per GPU sends its 128 bytes over any
/// channel: a file, a TCP rendezvous).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A new id (`ncclGetUniqueId`: opens the bootstrap socket the ranks will join).
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`] without libnccl; NCCL's.
    pub fn new() -> Result<Self> {
        NcclComm::available()?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid ncclUniqueId for NCCL to fill.
        let status = guarded("creating a unique id", || unsafe {
            sys::ncclGetUniqueId(&mut id)
        })?;
        check("creating a unique id", status)?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }

    /// The id from the bytes of [`as_bytes`](Self::as_bytes) (received from rank 0).
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        Self(bytes)
    }

    /// The id's bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }
}

/// What an all-to-all does with the block a rank sends itself.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OwnBlock {
    /// Copies it (device to device).
    Copy,
    /// Leaves the receive buffer's block alone; nothing is sent.
    Leave,
}

/// One rank's NCCL communicator on its GPU; its collectives run on the GPU's stream, but for
/// [`all_to_all_around_own_gathering`](Self::all_to_all_around_own_gathering)'s, which runs on the
/// communicator's own stream while the GPU's stream goes on.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    gpu: Gpu,
    rank: usize,
    world: usize,
    /// The overlapped exchange's stream, at the device's highest priority, so that its kernels
    /// take SMs ahead of the compute stream's queued CTAs.
    side: SideStream,
}

/// One buffer of [`NcclComm::all_to_all_around_own_gathering`]: the blocks this rank sends
/// (none for itself), the rows its own block is gathered from, and where everything lands.
#[derive(Debug)]
pub struct AroundOwn<'a, T: DeviceElement> {
    /// The blocks for the other ranks, in rank order.
    pub send: &'a DeviceVec<T>,
    /// The rows the own block is gathered from (this rank's K or V).
    pub own_rows: &'a DeviceVec<T>,
    /// The receive buffer: every rank's block, in rank order.
    pub recv: &'a mut DeviceVec<T>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("gpu", &self.gpu.ordinal())
            .finish_non_exhaustive()
    }
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `&self`
// methods enqueue work on the GPU's stream or the side stream under the caller's exclusive use
// of the comm and of the side stream's two events (NcclComm is not Sync, so two threads cannot
// call it at once).
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Whether libnccl can be loaded; the error says how to make it so.
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`].
    pub fn available() -> Result<()> {
        // SAFETY: `is_culib_present` only tries to dlopen libnccl under its usual names.
        if unsafe { sys::is_culib_present() } {
            Ok(())
        } else {
            Err(Error::NcclUnavailable {
                why: format!("libnccl could not be loaded; {WHERE}"),
            })
        }
    }

    /// Rank `rank` of a world of `world` ranks on `gpu`, all holding the same `id`
    /// (`ncclCommInitRank`: blocks until every rank has joined; the ranks' GPUs differ).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a rank outside the world; [`Error::NcclUnavailable`];
    /// NCCL's.
    pub fn new(gpu: &Gpu, rank: usize, world: usize, id: &NcclId) -> Result<Self> {
        if rank >= world {
            return Err(Error::InvalidArgument {
                what: "NCCL rank",
                why: format!("rank {rank} is outside a world of {world}"),
            });
        }
        let n = i32::try_from(world).map_err(|_| Error::InvalidArgument {
            what: "NCCL world size",
            why: format!("{world} ranks exceed i32"),
        })?;
        Self::available()?;
        gpu.context()
            .bind_to_thread()
            .map_err(|e| map_driver_error("binding the CUDA context", e))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let uid = sys::ncclUniqueId {
            internal: id.0.map(|b| b as _),
        };
        // SAFETY: `comm` is a valid out-pointer; rank < world (checked); the current context is
        // the GPU's, which NCCL takes as the communicator's device.
        let status = guarded("creating a communicator", || unsafe {
            sys::ncclCommInitRank(&mut comm, n, uid, rank as i32)
        })?;
        check("creating a communicator", status)?;
        let side = match SideStream::new(gpu, true) {
            Ok(side) => side,
            Err(e) => {
                // SAFETY: `comm` was created above and is not used after.
                let _ = guarded("aborting a communicator", || unsafe {
                    sys::ncclCommAbort(comm)
                });
                return Err(e);
            }
        };
        Ok(Self {
            comm,
            gpu: gpu.clone(),
            rank,
            world,
            side,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the world.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The GPU the communicator runs on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Sends `send`'s block `d` (`send_counts[d]` elements, blocks in rank order) to rank `d`
    /// and receives rank `s`'s block for this rank into `recv`'s block `s` (`recv_counts[s]`
    /// elements), for every rank at once: one NCCL group of sends and receives, on the GPU's
    /// stream (asynchronous, ordered with the ops before and after). Every rank calls it
    /// together; rank `s`'s `send_counts[r]` must equal rank `r`'s `recv_counts[s]`.
    ///
    /// # Errors
    /// Counts that are not one per rank or do not add up to the buffers' lengths; buffers of
    /// another GPU; NCCL's.
    pub fn all_to_all<T: DeviceElement>(
        &self,
        send: &DeviceVec<T>,
        send_counts: &[usize],
        recv: &mut DeviceVec<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.exchange(send, send_counts, recv, recv_counts, OwnBlock::Copy)
    }

    /// [`all_to_all`](Self::all_to_all) without this rank's own block: `send` holds only the
    /// blocks for the other ranks (`send_counts[rank]` is 0), and `recv`'s block `rank`
    /// (`recv_counts[rank]` elements, which the caller fills itself) is left as it is. A rank
    /// that gathers its own rows straight into `recv` saves the pack and the copy of them.
    ///
    /// # Errors
    /// As [`all_to_all`](Self::all_to_all), and a non-zero `send_counts[rank]`.
    pub fn all_to_all_around_own<T: DeviceElement>(
        &self,
        send: &DeviceVec<T>,
        send_counts: &[usize],
        recv: &mut DeviceVec<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.exchange(send, send_counts, recv, recv_counts, OwnBlock::Leave)
    }

    /// [`all_to_all_around_own`](Self::all_to_all_around_own) of several buffers with the same
    /// counts (K and V) in one NCCL group, on the communicator's own stream, while the GPU's
    /// stream fills their own blocks: for each of `blocks`, rows `own` (rows of `row_len`) of
    /// its `own_rows` into its `recv` from row `own_at`, which must be where block `rank` of
    /// `recv_counts` lies ([`rows::gather_rows_into`]). The transfer starts after everything
    /// before the call on the GPU's stream, and everything after the call waits for it, also
    /// when a step fails.
    ///
    /// # Errors
    /// As [`all_to_all_around_own`](Self::all_to_all_around_own) for any of `blocks` (then
    /// nothing is sent), an own block elsewhere than `own_at` or of another length; the
    /// gather's; the driver's.
    pub fn all_to_all_around_own_gathering<T: DType>(
        &self,
        blocks: &mut [AroundOwn<'_, T>],
        (send_counts, recv_counts): (&[usize], &[usize]),
        own: &RowIndex,
        row_len: usize,
        own_at: usize,
    ) -> Result<()> {
        let mut pairs: Vec<(&DeviceVec<T>, &mut DeviceVec<T>)> =
            blocks.iter_mut().map(|b| (b.send, &mut *b.recv)).collect();
        self.check_pairs(&mut pairs, send_counts, recv_counts, OwnBlock::Leave)?;
        check_own_block(self.rank, recv_counts, own.len(), row_len, own_at)?;
        // From here the GPU's stream waits for the side stream however this returns.
        let joined = self.side.fork(self.gpu.stream())?;
        self.enqueue(
            &mut pairs,
            send_counts,
            recv_counts,
            OwnBlock::Leave,
            self.side.stream(),
        )?;
        drop(pairs);
        for b in blocks.iter_mut() {
            rows::gather_rows_into(&self.gpu, b.own_rows, row_len, own, b.recv, own_at)?;
        }
        joined.join()
    }

    fn exchange<T: DeviceElement>(
        &self,
        send: &DeviceVec<T>,
        send_counts: &[usize],
        recv: &mut DeviceVec<T>,
        recv_counts: &[usize],
        own: OwnBlock,
    ) -> Result<()> {
        let pairs = &mut [(send, recv)];
        self.check_pairs(pairs, send_counts, recv_counts, own)?;
        self.enqueue(pairs, send_counts, recv_counts, own, self.gpu.stream())
    }

    /// Checks each pair's counts against its buffers and this rank's own block, and that the
    /// buffers are on this communicator's GPU.
    fn check_pairs<T: DeviceElement>(
        &self,
        pairs: &mut [(&DeviceVec<T>, &mut DeviceVec<T>)],
        send_counts: &[usize],
        recv_counts: &[usize],
        own: OwnBlock,
    ) -> Result<()> {
        let me = self.rank;
        // One count per rank even with no buffers (the own block's counts are read below).
        for (what, counts) in [
            ("send counts", send_counts),
            ("receive counts", recv_counts),
        ] {
            if counts.len() != self.world {
                return Err(Error::LengthMismatch {
                    what,
                    expected: self.world,
                    actual: counts.len(),
                });
            }
        }
        for (send, recv) in pairs.iter_mut() {
            check_blocks(
                self.world,
                (send_counts, send.len()),
                (recv_counts, recv.len()),
            )?;
            check_same_gpu(&self.gpu, "all-to-all send buffer", *send)?;
            check_same_gpu(&self.gpu, "all-to-all receive buffer", &**recv)?;
        }
        match own {
            OwnBlock::Copy if send_counts[me] != recv_counts[me] => Err(Error::InvalidArgument {
                what: "all-to-all blocks",
                why: format!(
                    "rank {me} sends itself {} elements but expects {}",
                    send_counts[me], recv_counts[me]
                ),
            }),
            OwnBlock::Leave if send_counts[me] != 0 => Err(Error::InvalidArgument {
                what: "all-to-all blocks",
                why: format!(
                    "rank {me} sends itself {} elements in an exchange around its own block \
                     (expected 0)",
                    send_counts[me]
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Enqueues the exchange of checked `pairs` ([`check_pairs`](Self::check_pairs)) on
    /// `stream`: the own blocks' copies (for [`OwnBlock::Copy`], on the GPU's stream only),
    /// then one NCCL group. On the GPU's stream the caller's borrows and the stream's order
    /// keep the buffers alive and apart until the transfer is done; on another stream the
    /// caller must make the GPU's stream wait for it before the borrows end (a [`JoinOnDrop`])
    /// and write nothing meanwhile but the receive buffers' own blocks, which NCCL leaves alone.
    fn enqueue<T: DeviceElement>(
        &self,
        pairs: &mut [(&DeviceVec<T>, &mut DeviceVec<T>)],
        send_counts: &[usize],
        recv_counts: &[usize],
        own: OwnBlock,
        stream: &CudaStream,
    ) -> Result<()> {
        let size = std::mem::size_of::<T>();
        debug_assert!(
            own != OwnBlock::Copy || std::ptr::eq(stream, &**self.gpu.stream()),
            "the own block's copy is ordered by the GPU's stream"
        );
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| map_driver_error("binding the CUDA context", e))?;
        // The buffers' addresses: they stay alive and unaliased until the transfer is done
        // (the method's contract: the borrows and the GPU's stream order, or the join).
        let ptrs: Vec<(u64, u64)> = pairs
            .iter_mut()
            .map(|(send, recv)| {
                let (src, _read) = send.slice().device_ptr(stream);
                let (dst, _write) = recv.slice_mut().device_ptr_mut(stream);
                (src, dst)
            })
            .collect();
        let raw_stream = stream.cu_stream();
        let cu_stream = raw_stream as sys::cudaStream_t;
        let starts = |counts: &[usize]| -> Vec<usize> {
            counts
                .iter()
                .scan(0, |at, &c| {
                    let s = *at;
                    *at += c;
                    Some(s)
                })
                .collect()
        };
        let (send_at, recv_at) = (starts(send_counts), starts(recv_counts));
        let me = self.rank;
        // This rank's own block is a device copy, outside NCCL (none when it is left alone).
        if own == OwnBlock::Copy && send_counts[me] > 0 {
            for &(src, dst) in &ptrs {
                let (d, s) = (
                    dst + (recv_at[me] * size) as u64,
                    src + (send_at[me] * size) as u64,
                );
                // SAFETY: both blocks are send_counts[me] elements within their buffers (the
                // counts add up to the lengths, checked), on the buffers' own stream; `recv` is
                // borrowed mutably and is a different allocation from `send` (two borrows).
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        d,
                        s,
                        send_counts[me] * size,
                        raw_stream,
                    )
                }
                .map_err(|e| map_driver_error("copying a rank's own block", e))?;
            }
        }
        let comm = self.comm;
        let run = || -> Result<()> {
            // SAFETY: group calls have no preconditions.
            check("starting a group", unsafe { sys::ncclGroupStart() })?;
            let mut first_error = Ok(());
            for &(src, dst) in &ptrs {
                for peer in (0..self.world).filter(|&p| p != me) {
                    let (sc, rc) = (send_counts[peer], recv_counts[peer]);
                    if sc > 0 {
                        let p = (src + (send_at[peer] * size) as u64) as *const c_void;
                        // SAFETY: block `peer` of a send buffer is [send_at, send_at + sc)
                        // elements, within its length (the counts add up to it, checked); the
                        // bytes stay alive and unwritten until the transfer is done (this
                        // method's contract above).
                        let s = unsafe {
                            sys::ncclSend(
                                p,
                                sc * size,
                                sys::ncclDataType_t::ncclUint8,
                                peer as i32,
                                comm,
                                cu_stream,
                            )
                        };
                        first_error = first_error.and(check("sending a block", s));
                    }
                    if rc > 0 {
                        let p = (dst + (recv_at[peer] * size) as u64) as *mut c_void;
                        // SAFETY: as above for block `peer` of a receive buffer, which nothing
                        // else writes meanwhile (only other blocks are written beside a side
                        // stream's transfer).
                        let s = unsafe {
                            sys::ncclRecv(
                                p,
                                rc * size,
                                sys::ncclDataType_t::ncclUint8,
                                peer as i32,
                                comm,
                                cu_stream,
                            )
                        };
                        first_error = first_error.and(check("receiving a block", s));
                    }
                }
            }
            // The group is closed whatever failed inside it.
            // SAFETY: closes the group opened above.
            let end = check("ending a group", unsafe { sys::ncclGroupEnd() });
            first_error.and(end)
        };
        guarded("an all-to-all", run)?
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Abort, not destroy (as torch.distributed does): ncclCommDestroy waits for every rank
        // of the host, so a rank returning an error would hang there instead of reporting it.
        // Work this rank needs has completed by then (its results were read back).
        let comm = self.comm;
        // SAFETY: `comm` was created by ncclCommInitRank and is freed once, here; nothing uses
        // it after (the communicator is being dropped). Errors cannot be reported from drop.
        let _ = guarded("aborting a communicator", || unsafe {
            sys::ncclCommAbort(comm)
        });
    }
}

/// Lets the kernels of every GPU of `gpus` read and write the memory pools of the others
/// where the devices can reach each other (`cuMemPoolSetAccess` on each device's pool). Ranks of
/// one process move data by direct pointers to each other's buffers, which come from the pools
/// (stream-ordered allocation) and are private to their device until this is done.
///
/// # Errors
/// The driver's.
pub fn share_pools(gpus: &[Gpu]) -> Result<()> {
    use cudarc::driver::sys as cu;
    for owner in gpus {
        let od = owner.context().cu_device();
        let pool = owner.memory_pool()?;
        for peer in gpus.iter().filter(|p| p.ordinal() != owner.ordinal()) {
            let pd = peer.context().cu_device();
            let mut can = 0;
            // SAFETY: `can` is a valid out-pointer; both devices exist.
            unsafe { cu::cuDeviceCanAccessPeer(&mut can, pd, od) }
                .result()
                .map_err(|e| map_driver_error("asking for peer access", e))?;
            if can == 0 {
                // NCCL then moves data through its own buffers.
                continue;
            }
            let desc = cu::CUmemAccessDesc {
                location: cu::CUmemLocation {
                    type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: peer.ordinal() as i32,
                },
                flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: one valid access descriptor for an existing pool.
            unsafe { cu::cuMemPoolSetAccess(pool, &desc, 1) }
                .result()
                .map_err(|e| map_driver_error("sharing a memory pool with a peer", e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_own_block_is_exactly_the_ranks_block() {
        // Blocks of 6, 9 and 3 elements; rows of 3: rank 1's block is rows 2..5.
        let counts = [6, 9, 3];
        assert!(check_own_block(1, &counts, 3, 3, 2).is_ok());
        assert!(check_own_block(0, &counts, 2, 3, 0).is_ok());
        assert!(check_own_block(2, &counts, 1, 3, 5).is_ok());
        for (rank, rows, at) in [(1, 3, 1), (1, 2, 2), (1, 4, 2), (3, 0, 6), (0, 3, 0)] {
            let err = check_own_block(rank, &counts, rows, 3, at)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("{rows} rows of 3 from row {at}"))
                    && err.contains(&format!("rank {rank}'s block")),
                "{err}"
            );
        }
        // Sizes that overflow are refused, not wrapped.
        assert!(check_own_block(0, &[0], usize::MAX, 2, 0).is_err());
        assert!(check_own_block(2, &[usize::MAX, 1, 0], 0, 1, 0).is_err());
    }

    #[test]
    fn block_counts_are_one_per_rank_and_add_up_to_the_buffers() {
        assert!(check_blocks(2, (&[1, 2], 3), (&[0, 4], 4)).is_ok());
        let err = check_blocks(3, (&[1, 2], 3), (&[0, 4, 0], 4)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::LengthMismatch {
                    expected: 3,
                    actual: 2,
                    ..
                }
            ),
            "{err}"
        );
        let err = check_blocks(2, (&[1, 2], 3), (&[0, 4], 5))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("receive blocks")
                && err.contains("add up to 4 elements, the buffer holds 5"),
            "{err}"
        );
    }

    #[test]
    fn without_libnccl_every_entry_point_says_how_to_provide_it() {
        let Err(missing) = NcclComm::available() else {
            // libnccl loads here: an id can be made (no GPU needed), and it round-trips.
            let id = NcclId::new().expect("libnccl is present");
            assert_eq!(NcclId::from_bytes(*id.as_bytes()), id);
            return;
        };
        for err in [missing, NcclId::new().unwrap_err()] {
            let text = err.to_string();
            assert!(matches!(err, Error::NcclUnavailable { .. }), "{text}");
            assert!(
                text.contains("libnccl.so.2") && text.contains("LD_LIBRARY_PATH"),
                "{text}"
            );
        }
    }
}
