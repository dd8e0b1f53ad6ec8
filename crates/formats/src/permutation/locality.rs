//! The locality order of [`Permutation::reverse_cuthill_mckee`] and its hub-peeling variant:
//! reverse Cuthill–McKee from pseudo-peripheral roots, each breadth-first level expanded from the
//! whole frontier at once (in parallel on large frontiers, with the sequential search's result).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU32};

use rayon::prelude::*;

use super::{check_square, Permutation, UNSET};
use crate::alloc::{try_filled, try_with_capacity};
use crate::csr::Csr;
use crate::error::Result;

/// Frontiers below this many nodes are expanded on one thread (a level's fork and join cost
/// more than its few hundred edges).
const PAR_MIN_FRONTIER: usize = 2048;

/// Breadth-first search over the non-hub nodes not yet numbered, with reusable scratch. Each
/// level is expanded from the whole frontier at once; past `par_min_frontier` nodes on several
/// threads, with exactly the sequential search's result (see [`Bfs::expand`]).
struct Bfs<'a> {
    a: &'a Csr,
    /// Row lengths.
    degree: Vec<u32>,
    /// Hubs and nodes already numbered: never entered.
    done: Vec<AtomicBool>,
    /// Per node, its level in the current search ([`UNSET`] outside it).
    level: Vec<AtomicU32>,
    /// Per node, during a parallel expansion: the first frontier position that reached it
    /// ([`UNSET`] otherwise, and between expansions).
    claim: Vec<AtomicU32>,
    /// The nodes of the current search, in visiting order.
    queue: Vec<u32>,
    /// Frontiers of at least this many nodes are expanded in parallel.
    par_min_frontier: usize,
}

impl Bfs<'_> {
    /// Whether `c`, a neighbour of `v`, is new to the current search (not `v`, not numbered, no
    /// level yet). The numbering's levels change only between the phases of an expansion; the
    /// probes' by an atomic swap, which decides.
    fn is_new(&self, v: u32, c: u32) -> bool {
        c != v
            && !self.done[c as usize].load(Relaxed)
            && self.level[c as usize].load(Relaxed) == UNSET
    }

    /// Searches from `root`, leaving the visit order in `queue` and the levels in `level`;
    /// returns the start of the last level in `queue`. With `sorted`, each node's neighbours
    /// are queued by ascending degree, ties by id (the numbering); without, in row order (the
    /// pseudo-peripheral probes, which read only the levels: a node's level, and so the last
    /// level's set and the depth, do not depend on the order).
    fn run(&mut self, root: u32, sorted: bool) -> usize {
        self.queue.clear();
        self.queue.push(root);
        self.level[root as usize].store(0, Relaxed);
        let (mut start, mut lv) = (0, 0u32);
        loop {
            let end = self.queue.len();
            let next = self.expand(start..end, lv + 1, sorted);
            if next.is_empty() {
                return start;
            }
            self.queue.extend_from_slice(&next);
            (start, lv) = (end, lv + 1);
        }
    }

    /// The next level of the frontier `queue[frontier]`, in the order the sequential search
    /// queues it: each frontier node in turn appends its new neighbours (sorted by (degree, id)
    /// when `sorted`) that no earlier frontier node took. In parallel, each new node is first
    /// claimed by the lowest frontier position reaching it (an atomic minimum), then every
    /// frontier node collects the neighbours it claimed, and the lists are joined in frontier
    /// order: the same sequence. Sets the returned nodes' level to `lv`.
    fn expand(&self, frontier: std::ops::Range<usize>, lv: u32, sorted: bool) -> Vec<u32> {
        let nodes = &self.queue[frontier];
        let sort = |kids: &mut [u32]| {
            if sorted {
                let degree = &self.degree;
                kids.sort_unstable_by_key(|&c| (degree[c as usize], c));
            }
        };
        if nodes.len() < self.par_min_frontier {
            let mut next = Vec::new();
            for &v in nodes {
                let from = next.len();
                for &c in self.a.row(v as usize) {
                    if self.is_new(v, c) {
                        self.level[c as usize].store(lv, Relaxed);
                        next.push(c);
                    }
                }
                sort(&mut next[from..]);
            }
            return next;
        }
        if !sorted {
            // The probes read only the levels, so the next level's order is free: each new node
            // goes to the thread whose level swap takes it, in one pass.
            let parts: Vec<Vec<u32>> = nodes
                .par_iter()
                .fold(Vec::new, |mut kids, &v| {
                    for &c in self.a.row(v as usize) {
                        if self.is_new(v, c)
                            && self.level[c as usize]
                                .compare_exchange(UNSET, lv, Relaxed, Relaxed)
                                .is_ok()
                        {
                            kids.push(c);
                        }
                    }
                    kids
                })
                .collect();
            return parts.concat();
        }
        nodes.par_iter().enumerate().for_each(|(i, &v)| {
            // i < frontier length <= n <= MAX_DIM: fits u32.
            let i = i as u32;
            for &c in self.a.row(v as usize) {
                // Most new nodes are reached many times: a load first skips the atomic
                // read-modify-write where an earlier position already holds them.
                if self.is_new(v, c) && self.claim[c as usize].load(Relaxed) > i {
                    self.claim[c as usize].fetch_min(i, Relaxed);
                }
            }
        });
        // Chunks of frontier positions, a few per thread, each collecting its nodes' claims.
        let chunk = (nodes.len() / (8 * rayon::current_num_threads())).max(256);
        let parts: Vec<Vec<u32>> = nodes
            .par_chunks(chunk)
            .enumerate()
            .map(|(ci, part)| {
                let mut kids = Vec::new();
                for (j, &v) in part.iter().enumerate() {
                    let i = (ci * chunk + j) as u32;
                    let from = kids.len();
                    kids.extend(
                        self.a
                            .row(v as usize)
                            .iter()
                            .filter(|&&c| c != v && self.claim[c as usize].load(Relaxed) == i),
                    );
                    sort(&mut kids[from..]);
                }
                kids
            })
            .collect();
        let next = parts.concat();
        next.par_iter().for_each(|&c| {
            self.level[c as usize].store(lv, Relaxed);
            self.claim[c as usize].store(UNSET, Relaxed);
        });
        next
    }

    /// Calls `f` on every node of the last search, in parallel.
    fn each_queued(&self, f: impl Fn(usize) + Sync + Send) {
        self.queue
            .par_iter()
            .with_min_len(4096)
            .for_each(|&v| f(v as usize));
    }

    /// Forgets the levels of the last search.
    fn clear(&mut self) {
        self.each_queued(|v| self.level[v].store(UNSET, Relaxed));
    }

    /// Marks the last search's nodes numbered.
    fn mark_done(&mut self) {
        self.each_queued(|v| self.done[v].store(true, Relaxed));
    }

    /// The level of the last node queued (the search's depth).
    fn depth(&self) -> u32 {
        // The queue holds at least the root after a search.
        self.level[self.queue[self.queue.len() - 1] as usize].load(Relaxed)
    }
}

/// Most root changes of the pseudo-peripheral search (each costs one search of the component;
/// George–Liu usually settles in 2–3).
const PERIPHERAL_ROUNDS: usize = 4;

/// Reverse Cuthill–McKee, hubs (degree > `hub_factor` × mean) first when asked.
pub(super) fn locality_order(a: &Csr, hub_factor: Option<f64>) -> Result<Permutation> {
    // On one thread the parallel expansion's extra pass is pure cost.
    let par_min_frontier = if rayon::current_num_threads() > 1 {
        PAR_MIN_FRONTIER
    } else {
        usize::MAX
    };
    locality_order_with(a, hub_factor, par_min_frontier)
}

/// [`locality_order`] expanding frontiers of at least `par_min_frontier` nodes in parallel (the
/// result does not depend on it).
pub(super) fn locality_order_with(
    a: &Csr,
    hub_factor: Option<f64>,
    par_min_frontier: usize,
) -> Result<Permutation> {
    check_square(a, "reverse_cuthill_mckee")?;
    let n = a.n_rows();
    let mut degree = try_with_capacity(n, "node degrees")?;
    (0..n)
        .into_par_iter()
        .map(|i| a.degree(i) as u32)
        .collect_into_vec(&mut degree);
    let mean = if n == 0 {
        0.0
    } else {
        a.nnz() as f64 / n as f64
    };
    let is_hub = |d: u32| hub_factor.is_some_and(|f| d as f64 > f * mean);
    let mut hubs: Vec<u32> = (0..n as u32)
        .into_par_iter()
        .filter(|&i| is_hub(degree[i as usize]))
        .collect();
    hubs.sort_unstable_by_key(|&i| (std::cmp::Reverse(degree[i as usize]), i));
    let atomics = |what, value| -> Result<Vec<AtomicU32>> {
        let mut v = try_with_capacity(n, what)?;
        v.extend((0..n).map(|_| AtomicU32::new(value)));
        Ok(v)
    };
    let mut done = try_with_capacity(n, "numbered flags")?;
    done.extend((0..n).map(|_| AtomicBool::new(false)));
    for &h in &hubs {
        done[h as usize] = AtomicBool::new(true);
    }
    // Start candidates: every node by (degree, id).
    let mut starts: Vec<u32> = try_with_capacity(n, "search starts")?;
    starts.extend(0..n as u32);
    starts.par_sort_unstable_by_key(|&i| (degree[i as usize], i));
    let mut bfs = Bfs {
        a,
        degree,
        done,
        level: atomics("search levels", UNSET)?,
        // Only the parallel expansion claims.
        claim: if par_min_frontier == usize::MAX {
            Vec::new()
        } else {
            atomics("search claims", UNSET)?
        },
        queue: Vec::new(),
        par_min_frontier,
    };
    let mut order: Vec<u32> = try_with_capacity(n, "node order")?;
    for &s in &starts {
        // In a directed graph the kept root's search may not reach `s` (nothing need point
        // back to it): search again until `s` itself is numbered. Each pass numbers at least
        // its root, and once nothing unnumbered is reachable from `s`, `s` is its own root.
        while !bfs.done[s as usize].load(Relaxed) {
            // George–Liu: move the root to a lowest-degree node of the last level while that
            // deepens the search.
            let mut root = s;
            let mut last = bfs.run(root, false);
            let mut depth = bfs.depth();
            for _ in 0..PERIPHERAL_ROUNDS {
                let degree = &bfs.degree;
                let candidate = bfs.queue[last..]
                    .iter()
                    .copied()
                    .min_by_key(|&c| (degree[c as usize], c))
                    .unwrap_or(root);
                bfs.clear();
                let last_c = bfs.run(candidate, false);
                let depth_c = bfs.depth();
                if depth_c > depth {
                    root = candidate;
                    last = last_c;
                    depth = depth_c;
                } else {
                    break;
                }
            }
            // The numbering: the search from the root kept, neighbours sorted.
            bfs.clear();
            bfs.run(root, true);
            bfs.mark_done();
            order.extend_from_slice(&bfs.queue);
            bfs.clear();
        }
    }
    order.reverse();
    let mut old_of_new = hubs;
    old_of_new.extend_from_slice(&order);
    // Each node is numbered exactly once: hubs up front, every other node by the one search
    // that first reached it (marked done right after).
    debug_assert_eq!(old_of_new.len(), n);
    let mut new_of_old = try_filled(n, 0u32, "permutation")?;
    for (new, &old) in old_of_new.iter().enumerate() {
        // new < n <= MAX_DIM: fits u32.
        new_of_old[old as usize] = new as u32;
    }
    Ok(Permutation {
        new_of_old,
        old_of_new,
    })
}
