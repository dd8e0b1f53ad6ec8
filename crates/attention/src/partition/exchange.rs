//! [`Exchange`]: the one collective a partitioned plan needs (an all-to-all of variable-sized
//! blocks), with default device all-to-alls that go through host memory.

use bytemuck::Pod;
use spattn_ops::AroundOwn;
use spattn_ops::RowIndex;
use spattn_ops::{DType, DeviceElement, DeviceVec, Gpu};

use crate::error::{Error, Result};

/// The collective a partitioned plan needs: an all-to-all of variable-sized blocks among the
/// ranks of one world. Every rank of the world calls it the same number of times, in the same
/// order (as NCCL collectives).
pub trait Exchange {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the world.
    fn world(&self) -> usize;
    /// Sends `send[d]` to rank `d` (`send.len() == world`) and returns what each rank sent to
    /// this one, indexed by sender.
    fn all_to_all<T: Pod + Send>(&self, send: Vec<Vec<T>>) -> Result<Vec<Vec<T>>>;

    /// [`all_to_all`](Self::all_to_all) of device memory on `gpu`: block `d` of `send`
    /// (`send_counts[d]` elements, blocks in rank order) goes to rank `d`, and rank `s`'s block
    /// for this rank lands in block `s` of `recv` (`recv_counts[s]` elements). The receiver
    /// knows the sizes (rank `s`'s `send_counts[r]` is rank `r`'s `recv_counts[s]`). This
    /// default goes through host memory; [`NcclExchange`](super::NcclExchange) moves the blocks
    /// GPU to GPU.
    ///
    /// Errors: counts that are not one per rank or do not add up to the buffers' lengths, a
    /// block of another size than announced, the GPU's and the exchange's.
    fn all_to_all_device<T: DeviceElement>(
        &self,
        _gpu: &Gpu,
        send: &DeviceVec<T>,
        send_counts: &[usize],
        recv: &mut DeviceVec<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        spattn_ops::check_blocks(
            self.world(),
            (send_counts, send.len()),
            (recv_counts, recv.len()),
        )?;
        let got = host_all_to_all(self, send, send_counts, recv_counts)?;
        if !recv.is_empty() {
            recv.copy_from_host(&got.concat())?;
        }
        Ok(())
    }

    /// [`all_to_all_device`](Self::all_to_all_device) without this rank's own block: `send`
    /// holds only the blocks for the other ranks (`send_counts[rank]` is 0), and `recv`'s block
    /// `rank` (`recv_counts[rank]` elements, which the caller fills itself) is left as it is.
    /// This default goes through host memory (whatever [`all_to_all_device`](Self::all_to_all_device)
    /// does: an exchange that overrides only that one still takes this path for the forward's
    /// halo); [`NcclExchange`](super::NcclExchange) moves the blocks GPU to GPU.
    ///
    /// Errors: as [`all_to_all_device`](Self::all_to_all_device), and a non-zero
    /// `send_counts[rank]`.
    fn all_to_all_device_around_own<T: DeviceElement>(
        &self,
        _gpu: &Gpu,
        send: &DeviceVec<T>,
        send_counts: &[usize],
        recv: &mut DeviceVec<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let me = self.rank();
        spattn_ops::check_blocks(
            self.world(),
            (send_counts, send.len()),
            (recv_counts, recv.len()),
        )?;
        if send_counts[me] != 0 {
            return Err(Error::InvalidConfig {
                what: "all-to-all blocks",
                why: format!(
                    "rank {me} sends itself {} elements in an exchange around its own block \
                     (expected 0)",
                    send_counts[me]
                ),
            });
        }
        // What arrives from this rank itself is its empty block.
        let mut expected = recv_counts.to_vec();
        expected[me] = 0;
        let got = host_all_to_all(self, send, send_counts, &expected)?;
        let mut at = 0;
        for (block, &c) in got.iter().zip(recv_counts) {
            recv.copy_from_host_at(at, block)?;
            at += c;
        }
        Ok(())
    }

    /// [`all_to_all_device_around_own`](Self::all_to_all_device_around_own) of several buffers
    /// with the same counts (a halo's K and V), each own block filled on `gpu` with rows `own`
    /// (rows of `row_len`) of its `own_rows` from row `own_at` of its `recv`, which must be
    /// where block `rank` lies ([`spattn_ops::gather_rows_into`]).
    /// [`NcclExchange`](super::NcclExchange) moves every buffer in one NCCL group on a stream of
    /// its own while `gpu`'s stream gathers the own blocks; this default gathers, then moves the
    /// buffers one after the other.
    ///
    /// Errors: as [`all_to_all_device_around_own`](Self::all_to_all_device_around_own); an own
    /// block elsewhere than block `rank`; the gather's.
    fn all_to_all_device_around_own_gathering<T: DType>(
        &self,
        gpu: &Gpu,
        blocks: &mut [AroundOwn<'_, T>],
        counts: (&[usize], &[usize]),
        own: &RowIndex,
        row_len: usize,
        own_at: usize,
    ) -> Result<()> {
        let (send_counts, recv_counts) = counts;
        let me = self.rank();
        spattn_ops::check_own_block(me, recv_counts, own.len(), row_len, own_at)?;
        for b in blocks.iter_mut() {
            spattn_ops::gather_rows_into(gpu, b.own_rows, row_len, own, b.recv, own_at)?;
            self.all_to_all_device_around_own(gpu, b.send, send_counts, b.recv, recv_counts)?;
        }
        Ok(())
    }
}

/// The host path of the device all-to-alls: `send`'s blocks (`send_counts`, which add up to
/// its length) through [`Exchange::all_to_all`], each block received checked against
/// `recv_counts`; returns them by sender.
fn host_all_to_all<T: DeviceElement, E: Exchange + ?Sized>(
    ex: &E,
    send: &DeviceVec<T>,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<Vec<Vec<T>>> {
    let host = send.to_host()?;
    let mut blocks = Vec::with_capacity(send_counts.len());
    let mut at = 0;
    for &c in send_counts {
        blocks.push(host[at..at + c].to_vec());
        at += c;
    }
    let got = ex.all_to_all(blocks)?;
    for (s, (block, &c)) in got.iter().zip(recv_counts).enumerate() {
        if block.len() != c {
            return Err(Error::Exchange {
                why: format!("rank {s} sent {} elements, expected {c}", block.len()),
            });
        }
    }
    Ok(got)
}
