//! Tests of the scaling run's pieces that need no GPU: the ladder, settling, efficiency, the
//! JSON and its older versions, the scale search, the host and device-memory checks.

use super::rank::rows_of;
use super::*;

#[test]
fn the_ladder_doubles_up_to_n_and_ends_at_n() {
    assert_eq!(rank_ladder(1), [1]);
    assert_eq!(rank_ladder(2), [1, 2]);
    assert_eq!(rank_ladder(6), [1, 2, 4, 6]);
    assert_eq!(rank_ladder(8), [1, 2, 4, 8]);
    assert!(rank_ladder(0).is_empty());
}

fn oom(bytes: usize) -> spattn::Error {
    spattn::Error::from(spattn_ops::Error::OutOfMemory {
        what: "halo",
        bytes,
    })
}

fn other() -> spattn::Error {
    spattn::Error::InvalidConfig {
        what: "heads",
        why: "zero".into(),
    }
}

#[test]
fn only_a_device_out_of_memory_counts_as_not_fitting() {
    assert_eq!(gpu_out_of_memory(&oom(1 << 33)), Some(1 << 33));
    assert_eq!(gpu_out_of_memory(&other()), None);
    // A host allocation failing is not a GPU that is too small.
    let host = spattn::Error::from(spattn_formats::Error::OutOfMemory {
        what: "col_indices",
        bytes: 1 << 40,
        available: Some(1 << 30),
    });
    assert_eq!(gpu_out_of_memory(&host), None);
    let other_ops = spattn::Error::from(spattn_ops::Error::NoCudaDriver);
    assert_eq!(gpu_out_of_memory(&other_ops), None);
}

#[test]
fn a_rank_out_of_memory_settles_as_not_fitting_with_its_bytes() {
    let ends = vec![
        RankEnd::PeerStopped,
        RankEnd::Failed(oom(123_456_789)),
        RankEnd::PeerStopped,
    ];
    match settle::<u8>(Ok(ends)) {
        Ok(Attempt::OutOfMemory {
            rank,
            bytes,
            message,
        }) => {
            assert_eq!((rank, bytes), (Some(1), 123_456_789));
            assert!(message.starts_with("rank 1: "), "{message}");
            assert!(message.contains("123456789 bytes"), "{message}");
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    // The error of a collective, out of memory too, has no rank.
    assert_eq!(
        settle::<u8>(Err(oom(7))),
        Ok(Attempt::OutOfMemory {
            rank: None,
            bytes: 7,
            message: oom(7).to_string()
        })
    );
}

#[test]
fn other_failures_still_abort_even_beside_an_out_of_memory() {
    let ends = vec![RankEnd::Failed(oom(9)), RankEnd::Failed(other())];
    let e = settle::<u8>(Ok(ends)).unwrap_err();
    assert!(e.starts_with("rank 1: invalid heads"), "{e}");
    assert_eq!(settle::<u8>(Err(other())).unwrap_err(), other().to_string());
    let e = settle::<u8>(Ok(vec![RankEnd::Ran(1), RankEnd::PeerStopped])).unwrap_err();
    assert!(e.contains("rank 1 stopped"), "{e}");
    assert_eq!(
        settle(Ok(vec![RankEnd::Ran(1u8), RankEnd::Ran(2)])),
        Ok(Attempt::Ran(vec![1, 2]))
    );
}

#[test]
fn efficiency_is_against_p1_where_it_ran_else_the_smallest_that_did() {
    // P = 1 ran (local forward 10 ms): the plain plan is the base, as before.
    let base = efficiency_base([(1, base_time(1, 12.0, 10.0))], (4, 4.0));
    assert_eq!(base, (1, 10.0));
    assert!((efficiency(base, 4, 4.0, false) - 0.625).abs() < 1e-12);
    assert!((efficiency(base, 4, 4.0, true) - 2.5).abs() < 1e-12);
    // P = 1 did not fit: P = 2 (forward 8 ms) is the base: 8 · 2 / (4 · 5).
    let base = efficiency_base([(2, base_time(2, 8.0, 6.0)), (4, 5.0)], (8, 3.0));
    assert_eq!(base, (2, 8.0));
    assert!((efficiency(base, 4, 5.0, false) - 0.8).abs() < 1e-12);
    assert!((efficiency(base, 4, 5.0, true) - 1.6).abs() < 1e-12);
    // The first run that fits is its own base: 100%.
    let base = efficiency_base([], (4, 5.0));
    assert_eq!(base, (4, 5.0));
    assert_eq!(efficiency(base, 4, 5.0, false), 1.0);
}

fn sample_record() -> ScalingRecord {
    ScalingRecord {
        schema: SCALING_SCHEMA_VERSION,
        tool: "spattn-bench 0".into(),
        date: "2026-01-01T00:00:00Z".into(),
        commit: "abc".into(),
        command: "spattn-bench --gpus 2".into(),
        gpus: vec!["H100".into(); 2],
        mode: "strong".into(),
        runs: vec![ScalingRun {
            graph: "rmat-26".into(),
            nodes: 1 << 26,
            edges: 1 << 31,
            heads: 1,
            head_dim: 128,
            dtype: "f16".into(),
            algorithm: "fused-tc".into(),
            ranks: 2,
            forward_ms: 100.0,
            efficiency: 1.0,
            efficiency_base_ranks: 2,
            plan_ms: 5000.0,
            per_rank: vec![RankRecord {
                rows: 1 << 25,
                edges: 1 << 30,
                halo_rows: 1 << 26,
                received_rows: 1 << 25,
                sent_rows: 1 << 25,
                received_bytes: 1 << 34,
                sent_bytes: 1 << 34,
                forward_ms: 100.0,
                exchange_ms: 40.0,
                local_ms: 60.0,
                rank_plan_ms: 900.0,
                local_plan_ms: 4100.0,
                algorithm: "fused-tc".into(),
                device_used_bytes: 70 << 30,
            }],
        }],
        largest_rmat: Vec::new(),
        not_fitting: vec![NotFitting {
            graph: "rmat-26".into(),
            ranks: 1,
            heads: 1,
            head_dim: 128,
            dtype: "f16".into(),
            memory: "gpu".into(),
            rank: Some(0),
            bytes: 17 << 30,
            message: "rank 0: out of GPU memory allocating 18253611008 bytes for halo".into(),
            estimate: None,
        }],
    }
}

#[test]
fn the_json_keeps_the_new_fields() {
    let mut rec = sample_record();
    rec.mode = "largest-rmat".into();
    rec.largest_rmat.push(LargestRmat {
        ranks: 2,
        heads: 1,
        head_dim: 128,
        dtype: "f16".into(),
        largest_scale: Some(26),
        run: Some(rec.runs[0].clone()),
        first_not_fitting: Some(NotFitting {
            graph: "rmat-27".into(),
            ranks: 2,
            memory: "host".into(),
            rank: None,
            ..rec.not_fitting[0].clone()
        }),
    });
    let text = serde_json::to_string_pretty(&rec).expect("serializes");
    let back: ScalingRecord = serde_json::from_str(&text).expect("parses");
    assert_eq!(back, rec);
    assert!(text.contains("\"efficiency_base_ranks\": 2"), "{text}");
    assert!(text.contains("\"largest_scale\": 26"), "{text}");
    assert!(text.contains("\"memory\": \"host\""), "{text}");
}

/// A not-fitting record of the estimate, as [`precheck_device_memory`] makes one.
fn estimated(graph: &str, ranks: usize) -> NotFitting {
    let floor = DeviceFloor {
        q_out: 32 << 30,
        kv_own: 32 << 30,
        kv_halo: 32 << 30,
        packed: 0,
        indices: 1 << 28,
        graph: 1 << 29,
    };
    NotFitting {
        graph: graph.into(),
        ranks,
        heads: 1,
        head_dim: 128,
        dtype: "f16".into(),
        memory: "gpu-estimate".into(),
        rank: Some(0),
        bytes: floor.total(),
        message: "rank 0 needs at least ...".into(),
        estimate: Some(FitEstimate {
            floor,
            device_bytes: 85_031_714_816,
            largest_floor: floor.total(),
            seconds: 1.5,
        }),
    }
}

#[test]
fn the_json_keeps_the_estimate_and_leaves_it_out_elsewhere() {
    let mut rec = sample_record();
    rec.not_fitting.push(estimated("rmat-26", 1));
    let text = serde_json::to_string_pretty(&rec).expect("serializes");
    let back: ScalingRecord = serde_json::from_str(&text).expect("parses");
    assert_eq!(back, rec);
    assert!(text.contains("\"memory\": \"gpu-estimate\""), "{text}");
    assert!(text.contains("\"device_bytes\": 85031714816"), "{text}");
    // An allocation that failed has no estimate: its record reads as in version 2.
    assert_eq!(text.matches("\"estimate\"").count(), 1, "{text}");
}

#[test]
fn a_version_2_record_still_reads() {
    let mut v = serde_json::to_value(sample_record()).expect("serializes");
    let obj = v.as_object_mut().expect("an object");
    obj.insert("schema".into(), 2.into());
    assert!(!serde_json::to_string(&obj)
        .expect("text")
        .contains("estimate"));
    let old: ScalingRecord = serde_json::from_value(v).expect("a version 2 record reads");
    assert_eq!(old.schema, 2);
    assert_eq!(old.not_fitting.len(), 1);
    assert_eq!(old.not_fitting[0].estimate, None);
    assert_eq!(old.not_fitting[0], sample_record().not_fitting[0]);
}

#[test]
fn a_version_1_record_still_reads() {
    let mut v = serde_json::to_value(sample_record()).expect("serializes");
    let obj = v.as_object_mut().expect("an object");
    obj.remove("not_fitting");
    obj.remove("largest_rmat");
    obj.insert("schema".into(), 1.into());
    for run in obj["runs"].as_array_mut().expect("runs") {
        run.as_object_mut()
            .expect("a run")
            .remove("efficiency_base_ranks");
    }
    let old: ScalingRecord = serde_json::from_value(v).expect("a version 1 record reads");
    assert_eq!(old.schema, 1);
    assert!(old.not_fitting.is_empty() && old.largest_rmat.is_empty());
    // Version 1 measured every efficiency against P = 1.
    assert_eq!(old.runs[0].efficiency_base_ranks, 1);
}

/// The largest scale that ran and the first that did not.
type Scales = (Option<u32>, Option<u32>);

/// A search over scales where `fits(scale)` says what runs: the found scales and the
/// scales tried, in order.
fn search(
    min: u32,
    start: u32,
    fits: impl Fn(u32) -> Result<bool, String>,
) -> (Result<Scales, String>, Vec<u32>) {
    let mut tried = Vec::new();
    let found = search_scales(min, MAX_RMAT_SCALE, start, |s| {
        tried.push(s);
        Ok(if fits(s)? {
            Trial::Ran(s * 10)
        } else {
            Trial::NotFit(format!("scale {s}"))
        })
    });
    let found = found.map(|f| {
        if let Some((s, r)) = &f.largest {
            assert_eq!(*r, s * 10, "the run of the scale found");
        }
        if let Some((s, why)) = &f.first_not_fitting {
            assert_eq!(why, &format!("scale {s}"), "the reason of the scale found");
        }
        (
            f.largest.map(|(s, _)| s),
            f.first_not_fitting.map(|(s, _)| s),
        )
    });
    (found, tried)
}

#[test]
fn the_search_goes_up_until_a_scale_does_not_fit() {
    let (found, tried) = search(22, 22, |s| Ok(s <= 25));
    assert_eq!(found, Ok((Some(25), Some(26))));
    assert_eq!(tried, [22, 23, 24, 25, 26]);
    // Every scale up to 31 fits: no scale failed.
    let (found, tried) = search(29, 29, |_| Ok(true));
    assert_eq!(found, Ok((Some(31), None)));
    assert_eq!(tried, [29, 30, 31]);
}

#[test]
fn the_search_goes_down_from_a_start_that_does_not_fit() {
    // The next P starts at 26 (where the last one stopped) but fits only 24.
    let (found, tried) = search(22, 26, |s| Ok(s <= 24));
    assert_eq!(found, Ok((Some(24), Some(25))));
    assert_eq!(tried, [26, 25, 24]);
    // Not even the minimum fits.
    let (found, tried) = search(22, 23, |_| Ok(false));
    assert_eq!(found, Ok((None, Some(22))));
    assert_eq!(tried, [23, 22]);
    // A start past 31 is clamped.
    let (found, tried) = search(22, 40, |s| Ok(s <= 30));
    assert_eq!(found, Ok((Some(30), Some(31))));
    assert_eq!(tried, [31, 30]);
}

#[test]
fn an_error_that_is_not_out_of_memory_ends_the_search() {
    let (found, tried) = search(22, 22, |s| {
        if s == 24 {
            Err("NCCL failed".to_string())
        } else {
            Ok(true)
        }
    });
    assert_eq!(found, Err("NCCL failed".to_string()));
    assert_eq!(tried, [22, 23, 24]);
}

#[test]
fn the_next_rank_count_starts_where_this_one_stopped() {
    let f = |largest: Option<u32>, first: Option<u32>| Found::<(), ()> {
        largest: largest.map(|s| (s, ())),
        first_not_fitting: first.map(|s| (s, ())),
    };
    assert_eq!(f(Some(25), Some(26)).next_start(22), 26);
    assert_eq!(f(None, Some(22)).next_start(22), 22);
    assert_eq!(f(Some(31), None).next_start(22), 31);
    assert_eq!(f(None, None).next_start(22), 22);
}

#[test]
fn the_host_estimate_covers_the_generator_and_the_run() {
    use spattn_formats::RmatConfig;
    let c = RmatConfig::benchmark(20);
    let (n, m) = (1u64 << 20, 16u64 << 20);
    let need = rmat_host_bytes(&c, 256).expect("fits 64 bits");
    // At least the generator's peak, and the graph twice with one input matrix staged.
    assert!(need >= c.peak_host_bytes().expect("fits"));
    assert!(need >= 2 * (2 * m + n + n + 1) * 4 + n * 256);
    // Wider rows stage more; the generator's peak is a floor for narrow ones.
    assert!(rmat_host_bytes(&c, 1 << 20).expect("fits") > need);
    assert_eq!(rmat_host_bytes(&c, 0), c.peak_host_bytes());
    // Each scale doubles it.
    let next = rmat_host_bytes(&RmatConfig::benchmark(21), 256).expect("fits");
    assert_eq!(next, 2 * need - 2 * 4);
    assert_eq!(rmat_host_bytes(&c, u64::MAX), None);
}

#[test]
fn a_graph_the_host_cannot_hold_is_refused_before_generating() {
    use spattn_formats::RmatConfig;
    let c = RmatConfig::benchmark(27);
    let need = rmat_host_bytes(&c, 256).expect("fits");
    assert!(
        need > 64 << 30,
        "R-MAT 27 at 128 f16 features needs {need} bytes"
    );
    assert_eq!(check_rmat_host(&c, 256, need), Ok(()));
    let (bytes, message) = check_rmat_host(&c, 256, 64 << 30).unwrap_err();
    assert_eq!(bytes, need);
    assert!(
        message.starts_with("R-MAT scale 27 needs about "),
        "{message}"
    );
    assert!(message.contains("(64.0 GiB) available"), "{message}");
    let (bytes, _) = check_rmat_host(&c, u64::MAX, u64::MAX - 1).unwrap_err();
    assert_eq!(bytes, u64::MAX);
}

#[test]
fn the_graph_held_counts_as_free_against_the_system_not_a_budget() {
    assert_eq!(host_room(None, || Some(10 << 30), 3 << 30), Some(13 << 30));
    assert_eq!(host_room(None, || Some(u64::MAX), 1), Some(u64::MAX));
    assert_eq!(host_room(None, || None, 3 << 30), None);
    let unread = || -> Option<u64> { panic!("the system is not read under a budget") };
    assert_eq!(host_room(Some(12 << 30), unread, 3 << 30), Some(12 << 30));
}

/// R-MAT `scale` as `--largest-rmat` loads it (symmetrized, with self loops).
fn rmat_graph(scale: u32) -> graphs::Graph {
    let config = spattn_formats::RmatConfig::benchmark(scale);
    graphs::Graph {
        name: graphs::rmat_name(scale),
        source: format!("R-MAT scale {scale}"),
        csr: spattn_formats::rmat(&config).expect("a small R-MAT"),
        symmetrized: true,
        load_seconds: 0.0,
    }
}

#[test]
fn a_scale_past_the_csr_is_not_fitting_and_never_generated_again() {
    let dirs = graphs::DataDirs::only(Vec::new());
    let options = graphs::LoadOptions {
        data_dirs: &dirs,
        symmetrize: true,
        rmat_seed: 1,
        host_memory: Some(1 << 40),
    };
    let mut source = RmatSource::new(&options);
    let mut generated = Vec::new();
    // Scales from 9 up stand in for graphs past the 32-bit CSR.
    let mut get = |source: &mut RmatSource<'_>, scale: u32| {
        let generate = |s: u32| {
            generated.push(s);
            if s >= 9 {
                Err(Error::from(spattn_formats::Error::TooManyEntries {
                    nnz: 5_000_000_000,
                    limit: u64::from(u32::MAX),
                })
                .context(format!("R-MAT scale {s}")))
            } else {
                Ok(rmat_graph(s))
            }
        };
        source
            .get(scale, 256, generate)
            .expect("only the CSR limit fails")
            .map(|g| g.csr.n_rows())
    };
    assert_eq!(get(&mut source, 8), Ok(256));
    assert_eq!(get(&mut source, 8), Ok(256), "held, not generated again");
    let (memory, bytes, message) = get(&mut source, 9).unwrap_err();
    assert_eq!((memory, bytes), ("format", 0));
    assert!(
        message.starts_with("R-MAT scale 9: 5000000000 entries exceed the limit"),
        "{message}"
    );
    // Scale 9 and above are refused from the record, without generating.
    assert_eq!(
        get(&mut source, 9).unwrap_err(),
        ("format", 0, message.clone())
    );
    let (_, _, larger) = get(&mut source, 10).unwrap_err();
    assert_eq!(
        larger,
        format!("larger than R-MAT scale 9, which passed the 32-bit CSR: {message}")
    );
    assert_eq!(get(&mut source, 7), Ok(128));
    assert_eq!(generated, [8, 9, 7]);
    // Another error still ends the search.
    let failed = source.get(6, 256, |_| Err(Error::new("disk on fire")));
    assert_eq!(failed.map(|_| ()).unwrap_err().to_string(), "disk on fire");
    // More edges drawn than the CSR holds (16 · 2^28 = 2^32): refused before generating.
    let (memory, _, drawn) = RmatSource::new(&options)
        .get(28, 256, |_| unreachable!("refused before generating"))
        .expect("a refusal")
        .map(|_| ())
        .unwrap_err();
    assert_eq!(memory, "format");
    assert!(
        drawn.starts_with("R-MAT scale 28: ") && drawn.contains("R-MAT edge count"),
        "{drawn}"
    );
    // A host budget too small refuses before generating.
    let tight = graphs::LoadOptions {
        host_memory: Some(1000),
        ..options.clone()
    };
    let refused = RmatSource::new(&tight)
        .get(8, 256, |_| unreachable!("refused before generating"))
        .expect("a refusal")
        .map(|_| ())
        .unwrap_err();
    assert_eq!(refused.0, "host");
    assert!(refused.1 > 1000, "{refused:?}");
}

/// One head of 128 f16 features, the case of the two-H100 search.
const F16_128: Case = Case {
    dtype: DTypeKind::F16,
    heads: 1,
    dim: 128,
};

/// The bounds of `graph`'s ranks on `p` GPUs, at [`F16_128`] with `auto`, bytes.
fn floors(graph: &graphs::Graph, p: usize) -> Vec<u64> {
    let part = Partition::balanced(&graph.csr, p).expect("a partition");
    crate::fit::rank_counts(&graph.csr, &part)
        .expect("counts")
        .iter()
        .map(|c| DeviceFloor::of(c, 256, 1, spattn::Algorithm::Auto).total())
        .collect()
}

#[test]
fn a_scale_whose_bound_exceeds_the_gpu_is_not_fitting_and_never_planned() {
    // GPUs as large as R-MAT 8's bound on one rank: 6, 7 and 8 are planned, 9 is not.
    let capacity = floors(&rmat_graph(8), 1)[0];
    let nine = floors(&rmat_graph(9), 1)[0];
    assert!(nine > capacity, "R-MAT 9 needs {nine}, 8 {capacity}");
    let mut rec = sample_record();
    rec.not_fitting.clear();
    let mut planned = Vec::new();
    let found = search_scales(
        6,
        MAX_RMAT_SCALE,
        6,
        |scale| -> Result<Trial<u32, NotFitting>> {
            let graph = rmat_graph(scale);
            let part = Partition::balanced(&graph.csr, 1)?;
            let auto = spattn::Algorithm::Auto;
            if let Some(not) =
                precheck_device_memory(&graph, &part, F16_128, auto, &[capacity], &mut rec)?
            {
                return Ok(Trial::NotFit(not));
            }
            // Here `measure` would plan and run it.
            planned.push(scale);
            Ok(Trial::Ran(scale))
        },
    )
    .expect("no error");
    assert_eq!(planned, [6, 7, 8]);
    assert_eq!(found.largest, Some((8, 8)));
    let (scale, not) = found.first_not_fitting.expect("R-MAT 9 does not fit");
    assert_eq!(scale, 9);
    assert_eq!(rec.not_fitting, std::slice::from_ref(&not));
    assert_eq!(
        (not.graph.as_str(), not.ranks, not.memory.as_str(), not.rank),
        ("rmat-9", 1, "gpu-estimate", Some(0))
    );
    assert_eq!(not.bytes, nine);
    let estimate = not.estimate.as_ref().expect("the estimate");
    assert_eq!(estimate.floor.total(), nine);
    assert_eq!(estimate.largest_floor, nine);
    assert_eq!(estimate.device_bytes, capacity);
    let start = format!(
        "rank 0 needs at least {} bytes for Q and output ",
        crate::table::thousands(nine)
    );
    assert!(not.message.starts_with(&start), "{}", not.message);
    let has = format!("its GPU has {} bytes", crate::table::thousands(capacity));
    assert!(not.message.contains(&has), "{}", not.message);
}

#[test]
fn the_estimate_names_the_rank_whose_gpu_is_too_small_and_lets_fitting_ones_plan() {
    let graph = rmat_graph(8);
    let part = Partition::balanced(&graph.csr, 2).expect("a partition");
    let bounds = floors(&graph, 2);
    let mut rec = sample_record();
    rec.not_fitting.clear();
    let auto = spattn::Algorithm::Auto;
    // Every GPU exactly as large as its rank's bound: planned, nothing recorded.
    let fits = precheck_device_memory(&graph, &part, F16_128, auto, &bounds, &mut rec);
    assert_eq!(fits, Ok(None));
    assert!(rec.not_fitting.is_empty());
    // The second GPU a byte short.
    let short = [bounds[0], bounds[1] - 1];
    let not = precheck_device_memory(&graph, &part, F16_128, auto, &short, &mut rec)
        .expect("no error")
        .expect("rank 1 does not fit");
    assert_eq!((not.ranks, not.rank, not.bytes), (2, Some(1), bounds[1]));
    assert_eq!(
        not.estimate.as_ref().map(|e| e.largest_floor),
        bounds.iter().copied().max()
    );
    assert!(
        not.message.starts_with("rank 1 needs at least "),
        "{}",
        not.message
    );
    assert_eq!(rec.not_fitting, [not]);
    // Fewer GPUs than ranks is an error, not a panic.
    assert!(precheck_device_memory(&graph, &part, F16_128, auto, &[u64::MAX], &mut rec).is_err());
}

#[test]
fn every_rank_draws_the_same_values_for_the_same_rows() {
    let whole = rows_of::<f32>(7, 1, 0..10, 3);
    let part = rows_of::<f32>(7, 1, 4..6, 3);
    assert_eq!(&whole[12..18], &part[..]);
    assert!(whole.iter().all(|x| (-1.0..1.0).contains(x)));
    // Q, K and V differ.
    assert_ne!(rows_of::<f32>(7, 0, 0..2, 3), rows_of::<f32>(7, 1, 0..2, 3));
}
