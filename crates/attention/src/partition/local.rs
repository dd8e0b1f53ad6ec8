//! [`LocalExchange`]: the ranks of one world as threads of this process, blocks handed over
//! through a shared mailbox; [`run_local`] runs a rank's work on each.

use std::any::Any;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use bytemuck::Pod;

use super::{check_parts, Exchange};
use crate::error::{Error, Result};

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
pub(super) fn join_ranks<R>(
    joins: Vec<std::thread::ScopedJoinHandle<'_, Result<R>>>,
) -> Vec<Result<R>> {
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
