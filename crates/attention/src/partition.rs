//! Row-partitioned attention: P ranks, each owning a contiguous block of rows balanced by
//! edges (its Q, output and CSR rows) and a contiguous block of K/V rows, fetch the K/V rows
//! their edges touch (the halo) from their owners and run attention on their rows alone. A
//! row's softmax needs only that row's edges, so the forward needs no reduction across ranks;
//! the backward sends the halo rows' dK and dV partials back to their owners, which sum them.
//!
//! The exchange between ranks sits behind [`Exchange`], whose one collective is an all-to-all
//! of variable-sized blocks: [`LocalExchange`] runs the P ranks as threads of one process
//! (tests, and graphs split for memory on one machine); [`TcpExchange`] runs one process per
//! rank, on one host or several, with rank and world from the environment torchrun sets
//! ([`TcpExchange::from_env`]) and a rendezvous at `MASTER_ADDR` (on `MASTER_PORT + 1`,
//! torchrun's store holding `MASTER_PORT`); [`NcclExchange`] moves device blocks GPU to GPU
//! with NCCL's grouped send/recv, one process per GPU ([`NcclExchange::from_env`], its unique id
//! sent over the TCP rendezvous) or one thread per GPU of this host ([`run_nccl`]). Each rank
//! computes on the CPU ([`RankPlan::forward`], f32 or f64) or on its GPU
//! ([`RankPlan::gpu_plan`] and [`RankPlan::forward_gpu`]: a normal [`AttentionPlan`] of the
//! rank's rows against its halo, any algorithm and dtype; the rows asked for are packed on the
//! device and the gradients' partials summed there; the local and TCP exchanges carry the
//! blocks through host memory).
//!
//! ```
//! use spattn::partition::{run_local, Partition, RankPlan};
//! use spattn::Csr;
//!
//! let a = Csr::from_edges(4, 4, &[(0, 1), (1, 2), (2, 3), (3, 0), (3, 1)])?;
//! let part = Partition::balanced(&a, 2)?;
//! let (heads, dim) = (1, 2);
//! let x: Vec<f64> = (0..4 * heads * dim).map(|i| i as f64 * 0.1).collect();
//! let outs = run_local(2, |ex| -> spattn::Result<Vec<f64>> {
//!     let plan = RankPlan::new(&a, &part, ex)?;
//!     let own = |m: &[f64], r: std::ops::Range<usize>| m[r.start * 2..r.end * 2].to_vec();
//!     let (q, kv) = (own(&x, plan.rows()), own(&x, plan.kv_rows()));
//!     plan.forward(ex, &q, &kv, &kv, heads, dim, 0.5)
//! })?;
//! let whole: Vec<f64> = outs.concat();
//! assert_eq!(whole.len(), 8);
//! # Ok::<(), spattn::Error>(())
//! ```

use std::any::Any;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

/// Plain numbers the exchanges move as bytes (`f32`, `f64`, `u32`, …).
pub use bytemuck::Pod;
use spattn_ops::cpu::{self, AttentionInputs, Real};
use spattn_ops::nccl::AroundOwn;
use spattn_ops::rows::{self, RowIndex};
use spattn_ops::{edge_extras, DType, DeviceElement, DeviceMatrix, DeviceVec, Gpu, Shape};

use crate::error::{Error, Result};
use crate::{AttentionConfig, AttentionPlan, Csr};

mod nccl;
mod tcp;
pub use nccl::{run_nccl, NcclExchange};
pub use tcp::TcpExchange;

/// Contiguous blocks of `0..n`: block `r` is `bounds[r]..bounds[r + 1]` (possibly empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocks {
    bounds: Vec<usize>,
}

impl Blocks {
    /// `n` items in `parts` blocks whose sizes differ by at most one.
    pub fn even(n: usize, parts: usize) -> Result<Self> {
        check_parts(parts)?;
        Ok(Self {
            bounds: (0..=parts).map(|r| r * n / parts).collect(),
        })
    }

    /// The blocks of the given boundaries: `bounds[0] == 0`, non-decreasing, `parts + 1` long.
    pub fn from_bounds(bounds: Vec<usize>) -> Result<Self> {
        if bounds.len() < 2 || bounds[0] != 0 {
            return Err(Error::InvalidConfig {
                what: "partition bounds",
                why: format!(
                    "expected 0 first and at least two entries, got {} entries starting at {:?}",
                    bounds.len(),
                    bounds.first()
                ),
            });
        }
        if let Some(i) = bounds.windows(2).position(|w| w[1] < w[0]) {
            return Err(Error::InvalidConfig {
                what: "partition bounds",
                why: format!(
                    "entry {} ({}) is below entry {i} ({})",
                    i + 1,
                    bounds[i + 1],
                    bounds[i]
                ),
            });
        }
        Ok(Self { bounds })
    }

    /// Number of blocks.
    pub fn parts(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Items covered (`0..len`).
    pub fn len(&self) -> usize {
        self.bounds[self.bounds.len() - 1]
    }

    /// Whether there are no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Block `r`.
    pub fn block(&self, r: usize) -> Result<Range<usize>> {
        if r >= self.parts() {
            return Err(Error::RankOutOfRange {
                rank: r,
                world: self.parts(),
            });
        }
        Ok(self.bounds[r]..self.bounds[r + 1])
    }

    /// The block holding item `i` (among empty blocks at the same boundary, the non-empty
    /// one); `None` for `i >= len`.
    pub fn owner(&self, i: usize) -> Option<usize> {
        (i < self.len()).then(|| self.bounds.partition_point(|&b| b <= i) - 1)
    }
}

/// How a graph's rows (Q, output, CSR rows) and K/V rows are split over ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Row blocks, balanced by edges.
    pub rows: Blocks,
    /// K/V row blocks: the row blocks on a square graph (a node's Q and K/V live together),
    /// an even split of the columns otherwise.
    pub kv: Blocks,
}

impl Partition {
    /// `parts` blocks of rows with about `nnz / parts` edges each (row boundaries where the
    /// running edge count crosses each share; rows without edges count as one edge so that
    /// empty regions are spread too).
    ///
    /// Errors: [`Error::InvalidConfig`] for 0 parts.
    pub fn balanced(a: &Csr, parts: usize) -> Result<Self> {
        check_parts(parts)?;
        let n = a.n_rows();
        let offsets = a.row_offsets();
        // Weight of rows 0..i: edges plus one per empty row, a prefix sum.
        let mut prefix = Vec::with_capacity(n + 1);
        prefix.push(0u64);
        for i in 0..n {
            let len = u64::from(offsets[i + 1] - offsets[i]);
            prefix.push(prefix[i] + len.max(1));
        }
        let total = prefix[n];
        let mut bounds = Vec::with_capacity(parts + 1);
        bounds.push(0);
        for r in 1..parts {
            let share = total * r as u64 / parts as u64;
            let at = prefix.partition_point(|&w| w < share).min(n);
            bounds.push(at.max(bounds[r - 1]));
        }
        bounds.push(n);
        let rows = Blocks::from_bounds(bounds)?;
        let kv = if a.n_rows() == a.n_cols() {
            rows.clone()
        } else {
            Blocks::even(a.n_cols(), parts)?
        };
        Ok(Self { rows, kv })
    }

    /// Number of ranks.
    pub fn parts(&self) -> usize {
        self.rows.parts()
    }
}

fn check_parts(parts: usize) -> Result<()> {
    if parts == 0 {
        return Err(Error::InvalidConfig {
            what: "partition",
            why: "0 parts: a partition needs at least one rank".into(),
        });
    }
    Ok(())
}

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
    /// default goes through host memory; [`NcclExchange`] moves the blocks GPU to GPU.
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
        spattn_ops::nccl::check_blocks(
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
    /// halo); [`NcclExchange`] moves the blocks GPU to GPU.
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
        spattn_ops::nccl::check_blocks(
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
    /// where block `rank` lies ([`rows::gather_rows_into`]). [`NcclExchange`] moves every
    /// buffer in one NCCL group on a stream of its own while `gpu`'s stream gathers the own
    /// blocks; this default gathers, then moves the buffers one after the other.
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
        spattn_ops::nccl::check_own_block(me, recv_counts, own.len(), row_len, own_at)?;
        for b in blocks.iter_mut() {
            rows::gather_rows_into(gpu, b.own_rows, row_len, own, b.recv, own_at)?;
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

/// The mailbox the threads of one local world share: a barrier that a failing rank can abort
/// (so the others get an error instead of waiting for it forever), and the blocks in transit.
struct Mailbox {
    state: Mutex<MailState>,
    turn: Condvar,
}

struct MailState {
    world: usize,
    /// Ranks at the barrier of the current generation.
    arrived: usize,
    generation: u64,
    /// Why the world stopped (a rank returned an error), once it has.
    aborted: Option<String>,
    /// Ranks whose work has returned: a collective can no longer complete.
    departed: usize,
    /// Per sender, its blocks by receiver (type-erased `Vec<Vec<T>>`), for the current round.
    slots: Vec<Option<Box<dyn Any + Send>>>,
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, MailState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until every rank has arrived, or the world is aborted (an error naming why).
    fn barrier(&self) -> Result<()> {
        let mut st = self.lock();
        if let Some(why) = &st.aborted {
            return Err(Error::Exchange { why: why.clone() });
        }
        if st.departed > 0 {
            return Err(Error::Exchange {
                why: "a rank returned before calling this collective".into(),
            });
        }
        st.arrived += 1;
        if st.arrived == st.world {
            st.arrived = 0;
            st.generation += 1;
            self.turn.notify_all();
            return Ok(());
        }
        let generation = st.generation;
        while st.generation == generation && st.aborted.is_none() {
            st = self.turn.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        match (&st.aborted, st.generation == generation) {
            (Some(why), true) => Err(Error::Exchange { why: why.clone() }),
            _ => Ok(()),
        }
    }

    fn abort(&self, why: String) {
        let mut st = self.lock();
        st.aborted.get_or_insert(why);
        self.turn.notify_all();
    }

    /// A rank's work has returned: ranks waiting in a collective it will never join fail.
    fn depart(&self, rank: usize) {
        let mut st = self.lock();
        st.departed += 1;
        if st.arrived > 0 {
            st.aborted.get_or_insert(format!(
                "rank {rank} returned while other ranks were in a collective"
            ));
            self.turn.notify_all();
        }
    }
}

/// The exchange of P ranks running as threads of this process (see [`run_local`]): blocks move
/// through shared memory, no copies beyond the hand-over. A rank whose work fails aborts the
/// world ([`LocalExchange::abort`], which `run_local` calls): the others' collectives then
/// return an error instead of waiting for it.
#[derive(Clone)]
pub struct LocalExchange {
    rank: usize,
    world: usize,
    mailbox: Arc<Mailbox>,
}

impl std::fmt::Debug for LocalExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalExchange")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl LocalExchange {
    /// The `world` handles of one local world, rank 0 first; each must be driven by its own
    /// thread (the collectives wait for every rank).
    pub fn world_of(world: usize) -> Result<Vec<LocalExchange>> {
        check_parts(world)?;
        let mailbox = Arc::new(Mailbox {
            state: Mutex::new(MailState {
                world,
                arrived: 0,
                generation: 0,
                aborted: None,
                departed: 0,
                slots: (0..world).map(|_| None).collect(),
            }),
            turn: Condvar::new(),
        });
        Ok((0..world)
            .map(|rank| LocalExchange {
                rank,
                world,
                mailbox: mailbox.clone(),
            })
            .collect())
    }

    /// Stops the world: every rank's current and later collectives return an error with `why`.
    pub fn abort(&self, why: impl Into<String>) {
        self.mailbox.abort(why.into());
    }
}

impl Exchange for LocalExchange {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_to_all<T: Pod + Send>(&self, send: Vec<Vec<T>>) -> Result<Vec<Vec<T>>> {
        if send.len() != self.world {
            return Err(Error::WorldMismatch {
                what: "all_to_all blocks",
                expected: self.world,
                actual: send.len(),
            });
        }
        self.mailbox.lock().slots[self.rank] = Some(Box::new(send));
        self.mailbox.barrier()?;
        let mut recv = Vec::with_capacity(self.world);
        {
            let mut st = self.mailbox.lock();
            for s in 0..self.world {
                let blocks = st.slots[s]
                    .as_mut()
                    .and_then(|b| b.downcast_mut::<Vec<Vec<T>>>())
                    .ok_or_else(|| Error::Exchange {
                        why: format!(
                            "rank {s} sent another element type in the same round (ranks must \
                             call the same collectives in the same order)"
                        ),
                    })?;
                recv.push(std::mem::take(&mut blocks[self.rank]));
            }
        }
        // Everyone has taken its blocks before the slots are reused.
        self.mailbox.barrier()?;
        self.mailbox.lock().slots[self.rank] = None;
        self.mailbox.barrier()?;
        Ok(recv)
    }
}

/// Runs `f` on `world` ranks of a local world, one thread each, and returns their results in
/// rank order (the first error of any rank otherwise).
pub fn run_local<R: Send>(
    world: usize,
    f: impl Fn(&LocalExchange) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let handles = LocalExchange::world_of(world)?;
    // The first rank to fail: its error is the one returned (the others' only say it stopped).
    let first_failed = std::sync::atomic::AtomicUsize::new(usize::MAX);
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let joins: Vec<_> = handles
            .iter()
            .map(|ex| {
                let first_failed = &first_failed;
                let f = &f;
                s.spawn(move || {
                    // A panicking rank leaves the world too (the guard's drop), so the
                    // others' collectives fail instead of waiting for it.
                    let _guard = Departs(ex);
                    let r = f(ex);
                    if let Err(e) = &r {
                        let _ = first_failed.compare_exchange(
                            usize::MAX,
                            ex.rank(),
                            std::sync::atomic::Ordering::SeqCst,
                            std::sync::atomic::Ordering::SeqCst,
                        );
                        ex.abort(format!("rank {} stopped: {e}", ex.rank()));
                    }
                    r
                })
            })
            .collect();
        join_ranks(joins)
    });
    let first = first_failed.load(std::sync::atomic::Ordering::SeqCst);
    let mut results = results;
    if first < results.len() {
        // That rank returned an error: it is the one that set `first_failed`.
        results.swap_remove(first)?;
    }
    results.into_iter().collect()
}

/// The ranks' results in rank order; a rank whose thread panicked gives an error.
fn join_ranks<R>(joins: Vec<std::thread::ScopedJoinHandle<'_, Result<R>>>) -> Vec<Result<R>> {
    joins
        .into_iter()
        .map(|j| {
            j.join().unwrap_or_else(|_| {
                Err(Error::Exchange {
                    why: "a rank's thread panicked".into(),
                })
            })
        })
        .collect()
}

/// Marks its rank as departed when dropped (returned or unwinding).
struct Departs<'a>(&'a LocalExchange);

impl Drop for Departs<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort(format!("rank {} panicked", self.0.rank));
        }
        self.0.mailbox.depart(self.0.rank);
    }
}

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
        let all = ex.all_to_all(vec![vec![g.d_scale]; ex.world()])?;
        let d_scale = all.iter().flatten().fold(F::ZERO, |s, &x| s + x);
        Ok(cpu::AttentionGrads {
            dq: g.dq,
            dk,
            dv,
            d_scale,
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
            rows::gather_rows(gpu, own.as_vec(), row_len, &index.remote, &mut packed)?;
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
            rows::scatter_add_rows(gpu, &partials, row_len, &index, &mut acc)?;
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
