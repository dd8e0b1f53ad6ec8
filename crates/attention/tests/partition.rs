//! Row-partitioned attention over the local exchange: P = 1, 2, 3 and 8 ranks give the single
//! plan's output and gradients (f64 and f32) on cora, R-MAT, a hub row, a rectangular graph,
//! ranks without rows and a halo that is every node; bad input is a typed error.

use std::ops::Range;

use rand::Rng;
use spattn::ops::cpu::{self, AttentionInputs, Real};
use std::time::Duration;

use spattn::partition::{
    run_local, run_nccl, Blocks, Exchange, LocalExchange, Partition, Pod, RankPlan, TcpExchange,
};
use spattn::{Csr, Error, Shape};
use spattn_test_support::{fresh_rng, hub_graph, random_graph, rmat_graph, shared_graph};

/// Inputs of one problem: Q (rows), K and V (columns), dOut (rows).
struct Problem<F> {
    q: Vec<F>,
    k: Vec<F>,
    v: Vec<F>,
    d_out: Vec<F>,
    heads: usize,
    dim: usize,
}

fn draw<F: Real>(a: &Csr, heads: usize, dim: usize, seed: &str) -> Problem<F> {
    let mut rng = fresh_rng(seed);
    let mut vals = |n: usize| -> Vec<F> {
        (0..n * heads * dim)
            .map(|_| F::from_f64(rng.random_range(-1.0..1.0)))
            .collect()
    };
    Problem {
        q: vals(a.n_rows()),
        k: vals(a.n_cols()),
        v: vals(a.n_cols()),
        d_out: vals(a.n_rows()),
        heads,
        dim,
    }
}

fn rel(got: &[f64], want: &[f64]) -> f64 {
    cpu::rel_l2_error(got, want)
}

fn up<F: Real>(x: &[F]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

fn slice<F: Copy>(x: &[F], r: Range<usize>, row_len: usize) -> Vec<F> {
    x[r.start * row_len..r.end * row_len].to_vec()
}

/// Runs the partitioned forward and backward on `parts` ranks and compares them with the
/// single CPU reference; returns the ranks' stats.
fn check<F: Real + Pod>(
    a: &Csr,
    parts: usize,
    p: &Problem<F>,
    tol: f64,
) -> Vec<spattn::partition::RankStats> {
    let (heads, dim) = (p.heads, p.dim);
    let row_len = heads * dim;
    let scale = F::from_f64(0.37);
    let (sq, skv) = (
        Shape::new(a.n_rows(), heads, dim).unwrap(),
        Shape::new(a.n_cols(), heads, dim).unwrap(),
    );
    let inputs = AttentionInputs::new(&p.q, sq, &p.k, skv, &p.v, skv);
    let mut want = vec![F::ZERO; sq.len()];
    cpu::attention(a, &inputs, scale, &mut want).unwrap();
    let want_g = cpu::attention_backward(a, &inputs, scale, &want, &p.d_out).unwrap();

    let part = Partition::balanced(a, parts).unwrap();
    let results = run_local(parts, |ex| {
        let plan = RankPlan::new(a, &part, ex)?;
        let (rows, kv) = (plan.rows(), plan.kv_rows());
        let q = slice(&p.q, rows.clone(), row_len);
        let k = slice(&p.k, kv.clone(), row_len);
        let v = slice(&p.v, kv, row_len);
        let out = plan.forward(ex, &q, &k, &v, heads, dim, scale)?;
        // A training step gathers the halo once for the forward and the backward.
        let halo = plan.gather_halo(ex, &k, &v, heads, dim)?;
        assert!(
            plan.forward_on(&halo, &q, scale)? == out,
            "forward_on differs from forward"
        );
        let d_out = slice(&p.d_out, rows, row_len);
        let g = plan.backward(ex, &halo, (&q, &out, &d_out), scale)?;
        Ok((out, g, plan.stats()))
    })
    .unwrap();
    let out: Vec<F> = results.iter().flat_map(|r| r.0.iter().copied()).collect();
    let dq: Vec<F> = results
        .iter()
        .flat_map(|r| r.1.dq.iter().copied())
        .collect();
    let dk: Vec<F> = results
        .iter()
        .flat_map(|r| r.1.dk.iter().copied())
        .collect();
    let dv: Vec<F> = results
        .iter()
        .flat_map(|r| r.1.dv.iter().copied())
        .collect();
    let what = format!(
        "{}x{} nnz {} on {parts} ranks",
        a.n_rows(),
        a.n_cols(),
        a.nnz()
    );
    for (name, got, want) in [
        ("out", &out, &want),
        ("dq", &dq, &want_g.dq),
        ("dk", &dk, &want_g.dk),
        ("dv", &dv, &want_g.dv),
    ] {
        assert_eq!(got.len(), want.len(), "{what}: {name} length");
        let e = rel(&up(got), &up(want));
        assert!(e <= tol, "{what}: {name} off by {e:.2e} > {tol:.0e}");
    }
    for (r, res) in results.iter().enumerate() {
        let d = (res.1.d_scale.to_f64() - want_g.d_scale.to_f64()).abs();
        let scale_of = want_g.d_scale.to_f64().abs().max(1.0);
        assert!(
            d <= tol * scale_of * 10.0,
            "{what}: rank {r}'s d_scale off by {d:.2e}"
        );
    }
    let stats: Vec<_> = results.iter().map(|r| r.2).collect();
    assert_eq!(stats.iter().map(|s| s.rows).sum::<usize>(), a.n_rows());
    assert_eq!(stats.iter().map(|s| s.edges).sum::<usize>(), a.nnz());
    // What the ranks receive from others is what the others send.
    assert_eq!(
        stats.iter().map(|s| s.remote_rows).sum::<usize>(),
        stats.iter().map(|s| s.sent_rows).sum::<usize>(),
        "{what}"
    );
    stats
}

fn graphs() -> Vec<(&'static str, Csr)> {
    let mut rng = fresh_rng("partition graphs");
    vec![
        ("cora", shared_graph("cora")),
        ("rmat-10", rmat_graph(10)),
        ("hub", hub_graph(&mut rng, 3000, 17)),
        ("random with empty rows", random_graph(&mut rng, 500, 6, 7)),
    ]
}

#[test]
fn every_world_size_gives_the_single_plan_result_in_f64_and_f32() {
    for (name, a) in graphs() {
        let p64 = draw::<f64>(&a, 2, 8, name);
        let p32 = draw::<f32>(&a, 3, 5, name);
        for parts in [1, 2, 3, 8] {
            check(&a, parts, &p64, 1e-12);
            check(&a, parts, &p32, 1e-5);
        }
    }
}

#[test]
fn balanced_partition_splits_edges_evenly() {
    let a = rmat_graph(12);
    let part = Partition::balanced(&a, 4).unwrap();
    let offsets = a.row_offsets();
    let share = a.nnz() as f64 / 4.0;
    let max_row = (0..a.n_rows())
        .map(|i| (offsets[i + 1] - offsets[i]) as f64)
        .fold(0.0, f64::max);
    for r in 0..4 {
        let rows = part.rows.block(r).unwrap();
        let edges = (offsets[rows.end] - offsets[rows.start]) as f64;
        // Within one row (plus the empty rows counted as one edge each) of an equal share.
        assert!(
            (edges - share).abs() <= max_row + a.n_rows() as f64 / 4.0,
            "rank {r}: {edges} edges, share {share}"
        );
    }
    assert_eq!(
        part.kv, part.rows,
        "square graph: K/V rows live with their node"
    );
}

#[test]
fn ranks_without_rows_and_a_halo_of_every_node() {
    // 5 rows on 8 ranks: at least three ranks own nothing.
    let a = Csr::from_edges(5, 5, &[(0, 1), (1, 2), (2, 0), (3, 4), (4, 3), (4, 4)]).unwrap();
    let stats = check(&a, 8, &draw::<f64>(&a, 1, 4, "tiny"), 1e-12);
    assert!(
        stats.iter().filter(|s| s.rows == 0).count() >= 3,
        "{stats:?}"
    );

    // A complete graph: every rank's halo is every node.
    let n = 24;
    let edges: Vec<(u32, u32)> = (0..n).flat_map(|i| (0..n).map(move |j| (i, j))).collect();
    let a = Csr::from_edges(n as usize, n as usize, &edges).unwrap();
    let stats = check(&a, 3, &draw::<f64>(&a, 2, 3, "complete"), 1e-12);
    for s in &stats {
        assert_eq!(s.halo_rows, n as usize);
        assert_eq!(s.remote_rows, n as usize - s.rows);
    }
}

#[test]
fn rectangular_graphs_split_the_columns_evenly() {
    let mut rng = fresh_rng("rectangular");
    let edges: Vec<(u32, u32)> = (0..300)
        .map(|_| (rng.random_range(0..40), rng.random_range(0..90)))
        .collect();
    let a = Csr::from_edges(40, 90, &edges).unwrap();
    let part = Partition::balanced(&a, 3).unwrap();
    assert_eq!(part.kv, Blocks::even(90, 3).unwrap());
    check(&a, 3, &draw::<f64>(&a, 2, 4, "rectangular"), 1e-12);
}

#[test]
fn bad_input_is_a_typed_error() {
    let a = Csr::from_edges(6, 6, &[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0)]).unwrap();
    assert!(matches!(
        Partition::balanced(&a, 0),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        Blocks::from_bounds(vec![0, 4, 2, 6]),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        Blocks::even(6, 2).unwrap().block(2),
        Err(Error::RankOutOfRange { rank: 2, world: 2 })
    ));
    // A partition of 2 ranks in a world of 3.
    let part = Partition::balanced(&a, 2).unwrap();
    let errs = run_local(3, |ex| Ok(RankPlan::new(&a, &part, ex).err())).unwrap();
    for e in errs {
        let e = e.expect("a world-size error");
        assert!(
            matches!(
                e,
                Error::WorldMismatch {
                    expected: 3,
                    actual: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("3 ranks"), "{e}");
    }
    // A partition of another graph.
    let other = Csr::from_edges(7, 7, &[(0, 1)]).unwrap();
    let part7 = Partition::balanced(&other, 2).unwrap();
    let errs = run_local(2, |ex| Ok(RankPlan::new(&a, &part7, ex).err())).unwrap();
    assert!(errs
        .iter()
        .all(|e| matches!(e, Some(Error::InvalidConfig { .. }))));
    // Operands of the wrong length name themselves.
    let part = Partition::balanced(&a, 2).unwrap();
    let errs = run_local(2, |ex| {
        let plan = RankPlan::new(&a, &part, ex)?;
        let n = plan.rows().len() * 4;
        let kv = plan.kv_rows().len() * 4;
        Ok(plan
            .forward(
                ex,
                &vec![0.0f64; n + 1],
                &vec![0.0; kv],
                &vec![0.0; kv],
                1,
                4,
                1.0,
            )
            .err())
    })
    .unwrap();
    for e in errs {
        let e = e.expect("a length error");
        assert!(e.to_string().contains("q (this rank's rows)"), "{e}");
    }
    // The exchange checks its own arguments.
    let errs = run_local(2, |ex: &LocalExchange| {
        Ok(ex.all_to_all(vec![vec![1u8]]).err())
    })
    .unwrap();
    for e in errs {
        assert!(matches!(e, Some(Error::WorldMismatch { .. })));
    }
}

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Runs `f` on `world` ranks over TCP on this host, one thread each (as separate processes
/// would), and returns their results in rank order.
fn run_tcp<R: Send>(
    world: usize,
    f: impl Fn(&TcpExchange) -> spattn::Result<R> + Sync,
) -> spattn::Result<Vec<R>> {
    let master = format!("127.0.0.1:{}", free_port());
    std::thread::scope(|s| {
        let joins: Vec<_> = (0..world)
            .map(|rank| {
                let (f, master) = (&f, master.clone());
                s.spawn(move || {
                    let ex = TcpExchange::connect(rank, world, &master, Duration::from_secs(30))?;
                    f(&ex)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

/// One rank's forward and backward (2 heads of 8): its output, dK and ∂L/∂scale.
fn rank_step<E: Exchange>(
    a: &Csr,
    part: &Partition,
    p: &Problem<f64>,
    ex: &E,
) -> spattn::Result<(Vec<f64>, Vec<f64>, f64)> {
    let plan = RankPlan::new(a, part, ex)?;
    let (rows, kv) = (plan.rows(), plan.kv_rows());
    let (q, k, v) = (
        slice(&p.q, rows.clone(), 16),
        slice(&p.k, kv.clone(), 16),
        slice(&p.v, kv, 16),
    );
    let halo = plan.gather_halo(ex, &k, &v, 2, 8)?;
    let out = plan.forward_on(&halo, &q, 0.3)?;
    let d_out = slice(&p.d_out, rows, 16);
    let g = plan.backward(ex, &halo, (&q, &out, &d_out), 0.3)?;
    Ok((out, g.dk, g.d_scale))
}

#[test]
fn tcp_ranks_compute_what_the_local_world_does() {
    let a = shared_graph("cora");
    let p = draw::<f64>(&a, 2, 8, "tcp");
    for world in [1, 2, 3] {
        let part = Partition::balanced(&a, world).unwrap();
        let local = run_local(world, |ex| rank_step(&a, &part, &p, ex)).unwrap();
        let tcp = run_tcp(world, |ex| rank_step(&a, &part, &p, ex)).unwrap();
        // The same blocks in the same order: bit for bit.
        for (r, (l, t)) in local.iter().zip(&tcp).enumerate() {
            assert_eq!(l.0, t.0, "world {world} rank {r}: out");
            assert_eq!(l.1, t.1, "world {world} rank {r}: dk");
            assert_eq!(l.2, t.2, "world {world} rank {r}: d_scale");
        }
    }
}

#[test]
fn tcp_blocks_of_every_size_arrive_whole() {
    // 4 ranks each send rank-and-destination-stamped blocks of different sizes, one of 3 MB.
    let got = run_tcp(4, |ex| {
        let me = ex.rank();
        let send: Vec<Vec<u32>> = (0..4)
            .map(|d| {
                let n = if me == 1 && d == 2 {
                    750_000
                } else {
                    me * 10 + d
                };
                (0..n as u32)
                    .map(|i| i ^ ((me * 4 + d) as u32) << 24)
                    .collect()
            })
            .collect();
        ex.all_to_all(send)
    })
    .unwrap();
    for (me, recv) in got.iter().enumerate() {
        for (s, block) in recv.iter().enumerate() {
            let n = if s == 1 && me == 2 {
                750_000
            } else {
                s * 10 + me
            };
            let want: Vec<u32> = (0..n as u32)
                .map(|i| i ^ ((s * 4 + me) as u32) << 24)
                .collect();
            assert_eq!(block, &want, "rank {me} from {s}");
        }
    }
}

#[test]
fn tcp_rendezvous_errors_name_what_they_waited_on() {
    // Nobody listens on the master's port: the timeout names the address.
    let master = format!("127.0.0.1:{}", free_port());
    let e = TcpExchange::connect(1, 2, &master, Duration::from_millis(300)).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("timed out") && msg.contains(&master), "{msg}");
    assert!(matches!(
        TcpExchange::connect(2, 2, &master, Duration::from_millis(10)),
        Err(Error::RankOutOfRange { rank: 2, world: 2 })
    ));
    assert!(matches!(
        TcpExchange::connect(0, 2, "not an address", Duration::from_millis(10)),
        Err(Error::InvalidConfig { .. })
    ));
    // The environment torchrun sets: a missing or malformed variable is named.
    let vars = |table: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            table
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    };
    let e = TcpExchange::from_vars(vars(&[("WORLD_SIZE", "2")])).unwrap_err();
    assert!(
        matches!(e, Error::InvalidConfig { what: "RANK", .. }),
        "{e}"
    );
    let e = TcpExchange::from_vars(vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
    assert!(
        e.to_string().contains("RANK") && e.to_string().contains("\"x\""),
        "{e}"
    );
    let e = TcpExchange::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
        ("SPATTN_RENDEZVOUS_TIMEOUT", "-3"),
    ]))
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                what: "SPATTN_RENDEZVOUS_TIMEOUT",
                ..
            }
        ),
        "{e}"
    );
    // A world of one needs nobody.
    let solo = TcpExchange::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ]))
    .unwrap();
    assert_eq!(solo.all_to_all(vec![vec![7u8]]).unwrap(), vec![vec![7u8]]);
}

#[test]
fn a_failing_rank_stops_the_local_world_instead_of_hanging_it() {
    // Rank 1 fails before its first collective; ranks 0 and 2 are inside theirs.
    let e = run_local(3, |ex| {
        if ex.rank() == 1 {
            return Err(Error::InvalidConfig {
                what: "test",
                why: "rank 1 gives up".into(),
            });
        }
        ex.all_to_all(vec![vec![1u32]; 3])?;
        ex.all_to_all(vec![vec![2u32]; 3])?;
        Ok(())
    })
    .unwrap_err();
    assert!(e.to_string().contains("rank 1 gives up"), "{e}");
    // A rank with operands of the wrong length while the others are right.
    let a = shared_graph("cora");
    let part = Partition::balanced(&a, 2).unwrap();
    let e = run_local(2, |ex| {
        let plan = RankPlan::new(&a, &part, ex)?;
        let extra = usize::from(ex.rank() == 1);
        let q = vec![0.0f32; plan.rows().len() * 4 + extra];
        let kv = vec![0.0f32; plan.kv_rows().len() * 4];
        plan.forward(ex, &q, &kv, &kv, 1, 4, 1.0)
    })
    .unwrap_err();
    assert!(e.to_string().contains("q (this rank's rows)"), "{e}");
}

#[test]
fn panicking_or_early_returning_ranks_and_mismatched_partitions_are_errors_not_hangs() {
    // A rank that panics.
    let e = run_local(3, |ex| {
        if ex.rank() == 2 {
            panic!("rank 2 trips");
        }
        ex.all_to_all(vec![vec![0u8]; 3])?;
        Ok(())
    })
    .unwrap_err();
    assert!(e.to_string().contains("panicked"), "{e}");
    // A rank that returns Ok before the others' collective.
    let e = run_local(3, |ex| {
        if ex.rank() == 0 {
            return Ok(());
        }
        ex.all_to_all(vec![vec![0u8]; 3])?;
        Ok(())
    })
    .unwrap_err();
    assert!(e.to_string().contains("returned"), "{e}");
    // Ranks that split the graph differently: rank 1 is asked for rows it does not own.
    let a = shared_graph("cora");
    let n = a.n_rows();
    let split = |at: usize| Partition {
        rows: Blocks::from_bounds(vec![0, at, n]).unwrap(),
        kv: Blocks::from_bounds(vec![0, at, n]).unwrap(),
    };
    // Rank 0 thinks rank 1 owns n/3.., rank 1 that it owns 2n/3.. only.
    let parts = [split(n / 3), split(2 * n / 3)];
    let e = run_local(2, |ex| RankPlan::new(&a, &parts[ex.rank()], ex).map(|_| ())).unwrap_err();
    assert!(e.to_string().contains("does not own"), "{e}");
}

#[test]
fn tcp_worlds_past_eight_ranks_and_failures_mid_collective() {
    // Nine ranks (the rendezvous table grows with the world).
    let got = run_tcp(9, |ex| {
        ex.all_to_all((0..9).map(|d| vec![ex.rank() as u32 * 10 + d]).collect())
    })
    .unwrap();
    for (me, recv) in got.iter().enumerate() {
        for (s, block) in recv.iter().enumerate() {
            assert_eq!(block, &vec![s as u32 * 10 + me as u32]);
        }
    }
    // Rank 1 gives up while the others exchange 8 MB blocks: they get errors, not a hang.
    let results: Vec<spattn::Result<()>> = {
        let master = format!("127.0.0.1:{}", free_port());
        std::thread::scope(|s| {
            let joins: Vec<_> = (0..4)
                .map(|rank| {
                    let master = master.clone();
                    s.spawn(move || -> spattn::Result<()> {
                        let ex = TcpExchange::connect(rank, 4, &master, Duration::from_secs(30))?;
                        if rank == 1 {
                            return Err(Error::Exchange {
                                why: "rank 1 gives up".into(),
                            });
                        }
                        ex.all_to_all(vec![vec![1.0f32; 2_000_000]; 4])?;
                        Ok(())
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        })
    };
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.is_err(),
            "rank {rank} finished a collective rank 1 never joined"
        );
    }
    // Ranks out of step (one skips a collective): errors, not each other's data. Whichever rank
    // reads the other's frame first names the mismatch; the other sees the link shut.
    let master = format!("127.0.0.1:{}", free_port());
    let results: Vec<spattn::Result<()>> = std::thread::scope(|s| {
        let joins: Vec<_> = (0..2)
            .map(|rank| {
                let master = master.clone();
                s.spawn(move || -> spattn::Result<()> {
                    let ex = TcpExchange::connect(rank, 2, &master, Duration::from_secs(30))?;
                    if rank == 0 {
                        ex.all_to_all(vec![vec![1.5f32]; 2])?;
                    }
                    ex.all_to_all(vec![vec![7u32]; 2]).map(|_| ())
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    assert!(
        results.iter().any(|r| r
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("same collectives")),
        "{results:?}"
    );
}

/// One rank's output, dQ, dK, dV and ∂L/∂scale.
type RankResult<T> = (Vec<T>, Vec<T>, Vec<T>, Vec<T>, f32);

/// How the ranks of a GPU check run: threads of one GPU over the local exchange (`parts`
/// ranks), or one thread per GPU of `gpus` over NCCL.
enum Ranks<'a> {
    Local(usize),
    Nccl(&'a [spattn::Gpu]),
}

/// One rank of a GPU check: forward and backward of its rows on `gpu`, through `ex`.
fn gpu_rank<T: spattn::DType, E: Exchange>(
    ex: &E,
    gpu: &spattn::Gpu,
    a: &Csr,
    part: &Partition,
    config: &spattn::AttentionConfig,
    (q, k, v, d_out): (&[T], &[T], &[T], &[T]),
) -> spattn::Result<RankResult<T>> {
    use spattn::DeviceMatrix;
    let (heads, dim) = (config.heads, config.head_dim);
    let row_len = heads * dim;
    let plan = RankPlan::new(a, part, ex)?;
    let local = plan.gpu_plan(gpu, config.clone())?;
    let (rows, kv) = (plan.rows(), plan.kv_rows());
    let up = |x: &[T], r: Range<usize>| {
        let s = Shape::new(r.len(), heads, dim)?;
        Ok::<_, spattn::Error>(DeviceMatrix::from_host(gpu, s, &slice(x, r, row_len))?)
    };
    let (dq_, dk_, dv_) = (up(q, rows.clone())?, up(k, kv.clone())?, up(v, kv.clone())?);
    let dg = up(d_out, rows.clone())?;
    let mut out = DeviceMatrix::<T>::zeros(gpu, dq_.shape())?;
    let halo = plan.forward_gpu(ex, &local, &dq_, &dk_, &dv_, &mut out)?;
    let (mut gq, mut gk, mut gv) = (
        DeviceMatrix::<T>::zeros(gpu, dq_.shape())?,
        DeviceMatrix::<T>::zeros(gpu, dk_.shape())?,
        DeviceMatrix::<T>::zeros(gpu, dv_.shape())?,
    );
    let d_scale = plan.backward_gpu(
        ex,
        &local,
        &halo,
        (&dq_, &out, &dg),
        (&mut gq, &mut gk, &mut gv),
    )?;
    Ok((
        out.to_host()?,
        gq.to_host()?,
        gk.to_host()?,
        gv.to_host()?,
        d_scale,
    ))
}

/// The partitioned plan on one GPU: `parts` ranks (threads of the local exchange sharing the
/// device) each run a GPU plan of `alg` on their rows against their halo; the gathered output
/// and gradients equal the f64 reference within `T`'s tolerance (the backward's dK/dV partials
/// summed in f32 across ranks).
fn check_gpu<T: spattn::DType>(
    a: &Csr,
    parts: usize,
    alg: spattn::Algorithm,
    heads: usize,
    dim: usize,
) {
    check_gpu_ranks::<T>(a, Ranks::Local(parts), alg, heads, dim);
}

fn check_gpu_ranks<T: spattn::DType>(
    a: &Csr,
    ranks: Ranks<'_>,
    alg: spattn::Algorithm,
    heads: usize,
    dim: usize,
) {
    use spattn::AttentionConfig;
    let p = draw::<f64>(a, heads, dim, "partition gpu");
    // The inputs in T, and the reference on those rounded values.
    let round = |x: &[f64]| -> Vec<T> { x.iter().map(|&v| T::from_f64(v)).collect() };
    let (q, k, v, d_out) = (round(&p.q), round(&p.k), round(&p.v), round(&p.d_out));
    let wide = |x: &[T]| -> Vec<f64> { x.iter().map(|v| v.to_f64()).collect() };
    let (sq, skv) = (
        Shape::new(a.n_rows(), heads, dim).unwrap(),
        Shape::new(a.n_cols(), heads, dim).unwrap(),
    );
    let config = AttentionConfig::new(heads, dim, T::KIND).with_algorithm(alg);
    let scale = f64::from(config.scale());
    let (q64, k64, v64, g64) = (wide(&q), wide(&k), wide(&v), wide(&d_out));
    let inputs = AttentionInputs::new(&q64, sq, &k64, skv, &v64, skv);
    let mut want = vec![0.0f64; sq.len()];
    cpu::attention(a, &inputs, scale, &mut want).unwrap();
    let want_g = cpu::attention_backward(a, &inputs, scale, &want, &g64).unwrap();

    let inputs = (&q[..], &k[..], &v[..], &d_out[..]);
    let (parts, results) = match ranks {
        Ranks::Local(parts) => {
            let gpu = spattn_test_support::gpu();
            let part = Partition::balanced(a, parts).unwrap();
            let results = run_local(parts, |ex| gpu_rank(ex, &gpu, a, &part, &config, inputs));
            (parts, results.unwrap())
        }
        Ranks::Nccl(gpus) => {
            let part = Partition::balanced(a, gpus.len()).unwrap();
            let results = run_nccl(gpus, |ex| gpu_rank(ex, ex.gpu(), a, &part, &config, inputs));
            (gpus.len(), results.unwrap())
        }
    };
    let cat = |f: fn(&RankResult<T>) -> &Vec<T>| -> Vec<f64> {
        results.iter().flat_map(|r| wide(f(r))).collect()
    };
    let tol = spattn_test_support::tol_tf32::<T>().max(if T::KIND == spattn::DTypeKind::F32 {
        1e-4
    } else {
        0.0
    });
    let what = format!(
        "{alg} {} on {parts} ranks, H{heads} D{dim}, nnz {}",
        T::NAME,
        a.nnz()
    );
    for (name, got, want) in [
        ("out", cat(|r| &r.0), &want),
        ("dq", cat(|r| &r.1), &want_g.dq),
        ("dk", cat(|r| &r.2), &want_g.dk),
        ("dv", cat(|r| &r.3), &want_g.dv),
    ] {
        let e = rel(&got, want);
        assert!(e <= tol, "{what}: {name} off by {e:.2e} > {tol:.0e}");
    }
    for (r, res) in results.iter().enumerate() {
        let d = (f64::from(res.4) - want_g.d_scale).abs();
        assert!(
            d <= tol * want_g.d_scale.abs().max(1.0) * 10.0,
            "{what}: rank {r}'s d_scale off by {d:.2e}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_partitioned_plans_equal_the_reference() {
    use half::f16;
    use spattn::Algorithm;
    let mut rng = fresh_rng("partition gpu graphs");
    let graphs = [
        shared_graph("cora"),
        rmat_graph(12),
        hub_graph(&mut rng, 5_000, 3),
    ];
    for a in &graphs {
        for parts in [1, 2, 3] {
            check_gpu::<f32>(a, parts, Algorithm::UnfusedCsr, 2, 16);
            check_gpu::<f32>(a, parts, Algorithm::FusedCsr, 1, 64);
            check_gpu::<f16>(a, parts, Algorithm::Auto, 8, 64);
        }
        check_gpu::<f32>(a, 8, Algorithm::FusedCsr, 2, 16);
    }
    // Ranks without rows (empty blocks, empty local plans) and a halo of every node.
    let tiny = Csr::from_edges(5, 5, &[(0, 1), (1, 2), (2, 0), (3, 4), (4, 3), (4, 4)]).unwrap();
    check_gpu::<f32>(&tiny, 8, Algorithm::FusedCsr, 1, 4);
    check_gpu::<f16>(&tiny, 8, Algorithm::Auto, 2, 16);
    let n = 40u32;
    let edges: Vec<(u32, u32)> = (0..n).flat_map(|i| (0..n).map(move |j| (i, j))).collect();
    let complete = Csr::from_edges(n as usize, n as usize, &edges).unwrap();
    check_gpu::<f32>(&complete, 3, Algorithm::UnfusedCsr, 2, 16);
    check_gpu::<f16>(&complete, 3, Algorithm::Auto, 1, 64);
}

/// Elements rank `s` sends rank `d` in the around-own checks (0 for some pairs).
fn around_count(s: usize, d: usize) -> usize {
    (s * 3 + d * 5 + 1) % 4
}

/// Element `i` of the block rank `s` sends rank `d`: exact in f32.
fn around_value(s: usize, d: usize, i: usize) -> f32 {
    (s * 1000 + d * 100 + i) as f32
}

/// One rank of the around-own check: sends every other rank its block, receives around an own
/// block of 3 elements poisoned with NaN; returns what it received (by sender block) and the
/// error of a call that sends itself a block (refused on every rank, before the collective).
fn around_own_rank<E: Exchange>(
    ex: &E,
    gpu: &spattn::Gpu,
) -> spattn::Result<(Vec<f32>, Vec<usize>, String)> {
    use spattn::DeviceVec;
    let (me, world) = (ex.rank(), ex.world());
    let send_counts: Vec<usize> = (0..world)
        .map(|d| if d == me { 0 } else { around_count(me, d) })
        .collect();
    let recv_counts: Vec<usize> = (0..world)
        .map(|s| if s == me { 3 } else { around_count(s, me) })
        .collect();
    let send: Vec<f32> = (0..world)
        .flat_map(|d| (0..send_counts[d]).map(move |i| around_value(me, d, i)))
        .collect();
    let d_send = DeviceVec::from_host(gpu, &send)?;
    let mut recv = DeviceVec::<f32>::zeros(gpu, recv_counts.iter().sum())?;
    recv.fill_nan()?;
    ex.all_to_all_device_around_own(gpu, &d_send, &send_counts, &mut recv, &recv_counts)?;
    let mut bad = send_counts.clone();
    bad[me] = 1;
    let d_bad = DeviceVec::from_host(gpu, &vec![0.0f32; send.len() + 1])?;
    let err = ex
        .all_to_all_device_around_own(gpu, &d_bad, &bad, &mut recv, &recv_counts)
        .expect_err("a block sent to itself is refused")
        .to_string();
    Ok((recv.to_host()?, recv_counts, err))
}

/// Every rank's received blocks are the senders' exact values and its own block is still NaN.
fn check_around_own(results: &[(Vec<f32>, Vec<usize>, String)], what: &str) {
    for (me, (got, counts, err)) in results.iter().enumerate() {
        let mut at = 0;
        for (s, &c) in counts.iter().enumerate() {
            let block = &got[at..at + c];
            if s == me {
                assert!(
                    block.iter().all(|x| x.is_nan()),
                    "{what}: rank {me}'s own block was written: {block:?}"
                );
            } else {
                let want: Vec<f32> = (0..c).map(|i| around_value(s, me, i)).collect();
                assert_eq!(block, want, "{what}: rank {me}'s block from rank {s}");
            }
            at += c;
        }
        assert!(err.contains("(expected 0)"), "{what}: rank {me}: {err}");
    }
}

/// One rank's halo of K and V from `gather_halo_gpu`, after NaN-filled buffers of the halo's
/// size were freed into the pool (so an unwritten halo element would likely read NaN, not a
/// previous gather's right value); returns the halo's global ids with its K and V rows.
fn poisoned_halo_rank<E: Exchange>(
    ex: &E,
    gpu: &spattn::Gpu,
    a: &Csr,
    part: &Partition,
    (k, v): (&[f32], &[f32]),
    row_len: usize,
) -> spattn::Result<(Vec<u32>, Vec<f32>, Vec<f32>)> {
    use spattn::DeviceMatrix;
    let plan = RankPlan::new(a, part, ex)?;
    let kv = plan.kv_rows();
    let skv = Shape::new(kv.len(), 1, row_len)?;
    let dk = DeviceMatrix::from_host(gpu, skv, &slice(k, kv.clone(), row_len))?;
    let dv = DeviceMatrix::from_host(gpu, skv, &slice(v, kv, row_len))?;
    let sh = Shape::new(plan.halo().len(), 1, row_len)?;
    for _ in 0..4 {
        let mut poison = DeviceMatrix::<f32>::zeros(gpu, sh)?;
        poison.fill_nan()?;
    }
    let halo = plan.gather_halo_gpu(ex, gpu, &dk, &dv)?;
    Ok((
        plan.halo().to_vec(),
        halo.k().to_host()?,
        halo.v().to_host()?,
    ))
}

/// The exchange around a rank's own block (the forward's halo fetch) moves the other ranks'
/// blocks and leaves the own block alone, over the local exchange's host path; the lean halo
/// gather (own rows gathered into an unset halo, the others exchanged around them) writes every
/// halo row with its K and V row.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_exchanges_around_the_own_block_leave_it_alone() {
    let gpu = spattn_test_support::gpu();
    for world in 1..=3 {
        let results = run_local(world, |ex| around_own_rank(ex, &gpu)).unwrap();
        check_around_own(&results, &format!("local world of {world}"));
    }
    let row_len = 24;
    let (a, k, v) = numbered_kv(row_len);
    for world in [1, 2, 3, 8] {
        let part = Partition::balanced(&a, world).unwrap();
        let results = run_local(world, |ex| {
            poisoned_halo_rank(ex, &gpu, &a, &part, (&k, &v), row_len)
        })
        .unwrap();
        check_halos(&results, (&k, &v), row_len, &format!("local world {world}"));
    }
}

/// R-MAT 10 with K and V rows numbered by their element (V negated), `row_len` features a row.
fn numbered_kv(row_len: usize) -> (Csr, Vec<f32>, Vec<f32>) {
    let a = rmat_graph(10);
    let n = a.n_cols();
    let k: Vec<f32> = (0..n * row_len).map(|i| i as f32).collect();
    let v: Vec<f32> = (0..n * row_len).map(|i| -(i as f32)).collect();
    (a, k, v)
}

/// Every halo row of every rank ([`poisoned_halo_rank`]'s results) is its K and V row.
fn check_halos(
    results: &[(Vec<u32>, Vec<f32>, Vec<f32>)],
    (k, v): (&[f32], &[f32]),
    row_len: usize,
    what: &str,
) {
    for (r, (ids, hk, hv)) in results.iter().enumerate() {
        assert_eq!(hk.len(), ids.len() * row_len, "{what} rank {r}");
        assert_eq!(hv.len(), ids.len() * row_len, "{what} rank {r}");
        for (i, &c) in ids.iter().enumerate() {
            let c = c as usize;
            assert_eq!(
                &hk[i * row_len..(i + 1) * row_len],
                &k[c * row_len..(c + 1) * row_len],
                "{what} rank {r} halo row {i} of K"
            );
            assert_eq!(
                &hv[i * row_len..(i + 1) * row_len],
                &v[c * row_len..(c + 1) * row_len],
                "{what} rank {r} halo row {i} of V"
            );
        }
    }
}

/// The partitioned plan with one rank per GPU of this machine over NCCL (one rank where there
/// is one GPU: the plumbing, its own block copied on the device). Needs libnccl: where it
/// cannot be loaded the test fails with the error that says how to provide it.
#[test]
#[ignore = "needs an NVIDIA GPU and libnccl"]
fn gpu_partitioned_plans_over_nccl_equal_the_reference() {
    use half::bf16;
    use spattn::{Algorithm, Gpu};
    spattn::ops::NcclComm::available().unwrap();
    let count = Gpu::device_count().unwrap();
    assert!(count > 0, "no GPU");
    let gpus: Vec<Gpu> = (0..count).map(|i| Gpu::new(i).unwrap()).collect();
    eprintln!("NCCL over {count} GPU(s)");
    let mut rng = fresh_rng("partition nccl graphs");
    let graphs = [
        shared_graph("cora"),
        rmat_graph(12),
        hub_graph(&mut rng, 5_000, 3),
    ];
    // The exchange around each rank's own block, GPU to GPU.
    let results = run_nccl(&gpus, |ex| around_own_rank(ex, ex.gpu())).unwrap();
    check_around_own(&results, &format!("NCCL over {count} GPU(s)"));
    // The halo gather: K and V in one group on the exchange's stream, the own rows gathered on
    // the GPU's stream meanwhile, into a halo over NaN-filled freed memory.
    let row_len = 24;
    let (a, k, v) = numbered_kv(row_len);
    let part = Partition::balanced(&a, count).unwrap();
    for round in 0..2 {
        let results = run_nccl(&gpus, |ex| {
            poisoned_halo_rank(ex, ex.gpu(), &a, &part, (&k, &v), row_len)
        })
        .unwrap();
        check_halos(
            &results,
            (&k, &v),
            row_len,
            &format!("NCCL over {count}, round {round}"),
        );
    }
    for a in &graphs {
        check_gpu_ranks::<f32>(a, Ranks::Nccl(&gpus), Algorithm::FusedCsr, 2, 16);
        check_gpu_ranks::<bf16>(a, Ranks::Nccl(&gpus), Algorithm::Auto, 8, 64);
    }
    // The GPUs given twice are refused by name, before NCCL is asked.
    let twice = [gpus[0].clone(), gpus[0].clone()];
    let err = run_nccl(&twice, |_| Ok(())).unwrap_err().to_string();
    assert!(err.contains("given twice"), "{err}");
}
