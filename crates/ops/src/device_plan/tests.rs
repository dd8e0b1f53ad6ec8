//! The device plan's tests: CPU checks of the spec and status decoding, and GPU equivalence
//! with the host plan (ignored without a GPU).

use super::*;

#[test]
fn id_bits_cover_the_largest_id() {
    assert_eq!(id_bits(0), 0);
    assert_eq!(id_bits(1), 0);
    assert_eq!(id_bits(2), 1);
    assert_eq!(id_bits(3), 2);
    assert_eq!(id_bits(256), 8);
    assert_eq!(id_bits(257), 9);
    assert_eq!(id_bits(MAX_DIM as usize), 32);
}

#[test]
fn specs_are_checked_before_any_launch() {
    let mut spec = GraphSpec::square(10);
    assert_eq!(check_spec(&spec, 7).unwrap(), 7);
    spec.symmetrize = true;
    spec.self_loops = true;
    assert_eq!(check_spec(&spec, 7).unwrap(), 24);
    spec.n_cols = 11;
    let e = check_spec(&spec, 7).unwrap_err();
    assert!(e.to_string().contains("10 x 11"), "{e}");
    spec.symmetrize = false;
    let e = check_spec(&spec, 7).unwrap_err();
    assert!(e.to_string().contains("self_loops"), "{e}");
    spec.self_loops = false;
    assert_eq!(check_spec(&spec, 7).unwrap(), 7);
    let huge = GraphSpec::square(MAX_DIM as usize + 1);
    assert!(matches!(check_spec(&huge, 1), Err(Error::TooLarge { .. })));
    let e = check_spec(&GraphSpec::square(4), u32::MAX as usize + 1).unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
}

#[test]
fn status_blocks_decode_the_statistics() {
    let mut w = [0u64; STATUS_WORDS];
    w[ST_NNZ] = 6;
    w[ST_MAX_DEGREE] = 3;
    w[ST_MIN_DEGREE_INV] = !0u64;
    w[ST_HISTOGRAM] = 2;
    w[ST_HISTOGRAM + 1] = 1;
    w[ST_HISTOGRAM + 2] = 1;
    let s = Status(w);
    assert_eq!(s.first_bad(), None);
    let d = s.degree_stats(4, 6);
    assert_eq!((d.min, d.max, d.empty_rows), (0, 3, 2));
    assert_eq!(d.histogram, vec![2, 1, 1]);
    w[ST_BAD] = !5u64;
    assert_eq!(Status(w).first_bad(), Some(5));
    let none = Status([0; STATUS_WORDS]).degree_stats(0, 0);
    assert_eq!((none.min, none.max, none.histogram), (0, 0, vec![0]));
}

use crate::backward::DeviceTranspose;
use crate::device_bsb::{BsbLayout, DeviceBsb, OrderedBsb};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_pcg::Pcg64;
use spattn_formats::{Bsb, Csr, MeBcrs};
use spattn_test_support::{fresh_rng, hub_graph, random_graph, shared_graph};

/// This crate's handle (test-support's `gpu()` is the other build of the crate's).
fn gpu() -> Gpu {
    Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)")
}

/// An edge list of `a`'s edges (as PyG's: sources = columns, targets = rows), shuffled
/// unless `sorted`, with some edges repeated.
fn edge_list(rng: &mut Pcg64, a: &Csr, sorted: bool, repeats: usize) -> (Vec<u32>, Vec<u32>) {
    let mut e: Vec<(u32, u32)> = a
        .row_indices()
        .into_iter()
        .zip(a.col_indices().iter().copied())
        .collect();
    for _ in 0..repeats.min(e.len()) {
        let x = e[rng.random_range(0..e.len())];
        e.push(x);
    }
    if sorted {
        e.sort_unstable();
    } else {
        e.shuffle(rng);
    }
    (
        e.iter().map(|x| x.1).collect(),
        e.iter().map(|x| x.0).collect(),
    )
}

/// The host's graph of the same list and spec (GraphCore's: merge, then the transforms).
fn host_graph(spec: &GraphSpec, src: &[u32], dst: &[u32]) -> Csr {
    let a = Csr::from_unsorted(spec.n_rows, spec.n_cols, dst, src, None).unwrap();
    let a = if spec.symmetrize {
        a.symmetrize().unwrap()
    } else {
        a
    };
    if spec.self_loops {
        a.with_self_loops().unwrap()
    } else {
        a
    }
}

/// Equal slices, or a panic naming `what` and the first index where they differ.
fn same<T: PartialEq + std::fmt::Debug>(got: &[T], want: &[T], what: &str) {
    if let Some(i) = (0..got.len().min(want.len())).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: element {i} is {:?}, expected {:?}",
            got[i], want[i]
        );
    }
    assert_eq!(got.len(), want.len(), "{what}: lengths");
}

/// `src` and `dst` uploaded.
fn upload_edges<I: DeviceIndex>(gpu: &Gpu, src: &[I], dst: &[I]) -> (DeviceVec<I>, DeviceVec<I>) {
    (
        DeviceVec::from_host(gpu, src).unwrap(),
        DeviceVec::from_host(gpu, dst).unwrap(),
    )
}

/// The edges of contiguous source and target buffers of one length.
fn contiguous_edges<'a, I: DeviceIndex>(
    sources: &'a DeviceVec<I>,
    targets: &'a DeviceVec<I>,
) -> DeviceEdges<'a, I> {
    DeviceEdges {
        sources: DeviceIds::contiguous(sources),
        targets: DeviceIds::contiguous(targets),
        len: sources.len(),
    }
}

/// [`same`] for a device buffer's contents.
fn same_on_device<T: DeviceElement + PartialEq + std::fmt::Debug>(
    got: &DeviceVec<T>,
    want: &[T],
    what: &str,
) {
    same(&got.to_host().unwrap(), want, what);
}

fn assert_same_csr(gpu: &Gpu, got: &DeviceCsr, want: &Csr, what: &str) {
    same_on_device(
        got.row_offsets(),
        want.row_offsets(),
        &format!("{what}: row offsets"),
    );
    same_on_device(
        got.col_indices(),
        want.col_indices(),
        &format!("{what}: columns"),
    );
    same_on_device(
        got.row_indices(),
        &want.row_indices(),
        &format!("{what}: rows"),
    );
    assert_eq!(
        *got.degree_stats(),
        want.degree_stats(),
        "{what}: degree statistics"
    );
    let up = DeviceCsr::upload(gpu, want).unwrap();
    let (g, w) = (
        got.schedule().to_host().unwrap(),
        up.schedule().to_host().unwrap(),
    );
    for (k, (g, w)) in g.iter().zip(&w).enumerate() {
        same(g, w, &format!("{what}: schedule array {k}"));
    }
}

/// Builds `a`'s edges on the device with ids of type I at `stride` and checks every format
/// against the host's: CSR, schedules, statistics, positions, duplicates, transpose and
/// edge map, BSB (bit for bit, window order included) and its extras edge maps, ME-BCRS.
fn check_build<I: DeviceIndex + TryFrom<u32>>(
    gpu: &Gpu,
    rng: &mut Pcg64,
    a: &Csr,
    spec: GraphSpec,
    (sorted, repeats, stride): (bool, usize, usize),
) where
    <I as TryFrom<u32>>::Error: std::fmt::Debug,
{
    let (src, dst) = edge_list(rng, a, sorted, repeats);
    let what = format!(
        "{} x {} with {} edges ({} ids, stride {stride}, sorted {sorted}, {spec:?})",
        spec.n_rows,
        spec.n_cols,
        src.len(),
        I::NAME
    );
    let e = src.len();
    // Both columns interleaved at `stride` (a 2 x E tensor's rows, or its transpose's).
    let mut ids = vec![I::zeroed(); (e.max(1) * stride).max(2)];
    for i in 0..e {
        ids[i * stride] = I::try_from(src[i]).unwrap();
    }
    let mut tids = vec![I::zeroed(); (e.max(1) * stride).max(2)];
    for i in 0..e {
        tids[i * stride] = I::try_from(dst[i]).unwrap();
    }
    let (ds, dt) = (
        DeviceVec::from_host(gpu, &ids).unwrap(),
        DeviceVec::from_host(gpu, &tids).unwrap(),
    );
    let edges = DeviceEdges {
        sources: DeviceIds::strided(&ds, stride).unwrap(),
        targets: DeviceIds::strided(&dt, stride).unwrap(),
        len: e,
    };
    // With self loops, one position per loop after the edges' (as the Python layers ask).
    let loops = if spec.self_loops { spec.n_rows } else { 0 };
    let mut positions = DeviceVec::<i64>::zeros(gpu, e + loops).unwrap();
    positions.fill(-7).unwrap();
    let mut ws = PlanWorkspace::new();
    let built = build_from_edges(gpu, &edges, &spec, Some(&mut positions), &mut ws).unwrap();
    let want = host_graph(&spec, &src, &dst);
    assert_same_csr(gpu, &built.csr, &want, &what);
    let distinct: std::collections::HashSet<(u32, u32)> =
        src.iter().copied().zip(dst.iter().copied()).collect();
    assert_eq!(
        built.report.duplicates,
        e - distinct.len(),
        "{what}: duplicates"
    );
    if sorted && !spec.symmetrize && !spec.self_loops {
        assert!(
            built.report.presorted,
            "{what}: a sorted list skips the sort"
        );
    }
    let pos = positions.to_host().unwrap();
    let (offsets, cols) = (want.row_offsets(), want.col_indices());
    for v in 0..loops {
        let p = usize::try_from(pos[e + v]).expect("every loop has a position");
        assert!(
            cols[p] == v as u32 && (offsets[v] as usize..offsets[v + 1] as usize).contains(&p),
            "{what}: loop {v} at entry {p}"
        );
    }
    for i in 0..e {
        let p = usize::try_from(pos[i]).expect("every input edge has a position");
        assert!(
            cols[p] == src[i]
                && (offsets[dst[i] as usize] as usize..offsets[dst[i] as usize + 1] as usize)
                    .contains(&p),
            "{what}: edge {i} ({} -> {}) at entry {p}",
            src[i],
            dst[i]
        );
    }
    let t = match built.transpose {
        Some(t) => t,
        None => build_transpose(gpu, &built.csr, &mut ws).unwrap(),
    };
    let host_t = DeviceTranspose::upload(gpu, &want).unwrap();
    assert_same_csr(
        gpu,
        t.csr(),
        &host_t.csr().to_host().unwrap(),
        &format!("{what} transposed"),
    );
    same_on_device(
        t.map(),
        &host_t.map().to_host().unwrap(),
        &format!("{what}: edge map"),
    );
    let ec = build_edge_csr(gpu, &built.csr).unwrap();
    let nnz = want.nnz() as u32;
    let host_ec = Csr::try_new(
        want.n_rows(),
        want.nnz(),
        want.row_offsets().to_vec(),
        (0..nnz).collect(),
        None,
    )
    .unwrap();
    assert_same_csr(gpu, &ec, &host_ec, &format!("{what} edge CSR"));
    let (bsb, layout) = build_bsb(gpu, &built.csr, &mut ws).unwrap();
    let host_bsb = Bsb::from_csr(&want).unwrap();
    let got_bsb = bsb.to_host().unwrap();
    same(
        got_bsb.window_offsets(),
        host_bsb.window_offsets(),
        &format!("{what}: BSB window offsets"),
    );
    same(
        got_bsb.block_columns(),
        host_bsb.block_columns(),
        &format!("{what}: BSB block columns"),
    );
    same(
        got_bsb.bitmaps(),
        host_bsb.bitmaps(),
        &format!("{what}: BSB bitmaps"),
    );
    assert!(got_bsb == host_bsb, "{what}: BSB");
    assert_eq!(*bsb.fill_stats(), host_bsb.fill_stats(), "{what}: BSB fill");
    assert!(layout == BsbLayout::of(&host_bsb), "{what}: BSB layout");
    same(
        &bsb.window_order_host().unwrap(),
        host_bsb.window_order(),
        &format!("{what}: window order"),
    );
    let graphs = (&built.csr, &t);
    check_edge_maps(
        gpu,
        (bsb, layout),
        graphs,
        &want,
        spec.symmetrize,
        &mut ws,
        &what,
    );
    let me = build_mebcrs(gpu, &built.csr, &mut ws).unwrap();
    let host_me = MeBcrs::from_csr(&want, MeBcrs::BLOCK_WIDTH_F16).unwrap();
    same_on_device(
        me.row_pointers(),
        host_me.row_pointers(),
        &format!("{what}: ME-BCRS row pointers"),
    );
    same_on_device(
        me.column_indices(),
        host_me.column_indices(),
        &format!("{what}: ME-BCRS column indices"),
    );
    same_on_device(
        me.row_masks(),
        host_me.row_masks(),
        &format!("{what}: ME-BCRS row masks"),
    );
    same_on_device(
        me.edge_to_slot(),
        &host_me.edge_to_slot().unwrap(),
        &format!("{what}: ME-BCRS edge to slot"),
    );
    assert_eq!(
        *me.fill_stats(),
        host_me.fill_stats(),
        "{what}: ME-BCRS fill"
    );
    assert_eq!(
        (me.n_windows(), me.n_vectors(), me.nnz()),
        (host_me.n_windows(), host_me.n_vectors(), host_me.nnz()),
        "{what}: ME-BCRS sizes"
    );
}

/// fused-tc's extras edge maps made on the device against the host's: A's BSB over A, Aᵀ's
/// BSB over Aᵀ with A's edge ids, and (a symmetric pattern) A's BSB standing for Aᵀ's.
fn check_edge_maps(
    gpu: &Gpu,
    (bsb, layout): (DeviceBsb, BsbLayout),
    (a, t): (&DeviceCsr, &DeviceTranspose),
    want: &Csr,
    symmetric: bool,
    ws: &mut PlanWorkspace,
    what: &str,
) {
    let host = |b: &OrderedBsb, a: &Csr, from_a: Option<&[u32]>| {
        let (starts, ids) = b.edge_map(a).unwrap();
        let ids: Vec<u32> = match from_a {
            Some(m) => ids.iter().map(|&e| m[e as usize]).collect(),
            None => ids,
        };
        (starts, ids)
    };
    let check = |got: (DeviceVec<u32>, DeviceVec<u32>), want: (Vec<u32>, Vec<u32>), side: &str| {
        same_on_device(
            &got.0,
            &want.0,
            &format!("{what}: {side} block edge starts"),
        );
        same_on_device(&got.1, &want.1, &format!("{what}: {side} edge ids"));
    };
    let a_bsb = OrderedBsb::built_on_device(bsb, layout, 0.0);
    check(
        bsb_edge_map(gpu, &a_bsb.device, a, None, ws).unwrap(),
        host(&a_bsb, want, None),
        "A's BSB",
    );
    let (at, from_a) = want.transpose_with_map();
    let inverse = t.inverse_map(gpu).unwrap();
    let (t_dev, t_layout) = build_bsb(gpu, t.csr(), ws).unwrap();
    let t_bsb = OrderedBsb::built_on_device(t_dev, t_layout, 0.0);
    check(
        bsb_edge_map(gpu, &t_bsb.device, t.csr(), Some(inverse), ws).unwrap(),
        host(&t_bsb, &at, Some(&from_a)),
        "Aᵀ's BSB",
    );
    if symmetric {
        check(
            bsb_edge_map(gpu, &a_bsb.device, t.csr(), Some(inverse), ws).unwrap(),
            host(&a_bsb, &at, Some(&from_a)),
            "A's BSB as Aᵀ's",
        );
    }
}

/// Random graphs (with empty rows and repeated edges), a 10^5-edge hub row, n of 1, 7, 17,
/// 33, no edges, edges only past a long run of empty rows, a rectangular graph, each with every
/// transform and id type, shuffled and sorted.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_device_plan_equals_the_host_plan() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu_device_plan_equals_the_host_plan");
    let mut graphs = vec![
        random_graph(&mut rng, 300, 6, 7),
        random_graph(&mut rng, 5000, 20, 11),
        hub_graph(&mut rng, 100_000, 4321),
        Csr::from_edges(5, 5, &[]).unwrap(),
    ];
    for n in [1, 7, 17, 33] {
        graphs.push(random_graph(&mut rng, n, 3, 4));
    }
    // Edges only among the last 500 of 3·10⁶ nodes (a sample keyed by global ids): the row
    // offsets of the long run of empty rows before them.
    let n_tail = 3_000_000u32;
    let tail: Vec<(u32, u32)> = (0..2000)
        .map(|_| {
            let id = |rng: &mut Pcg64| n_tail - 1 - rng.random_range(0..500u32);
            (id(&mut rng), id(&mut rng))
        })
        .collect();
    graphs.push(Csr::from_edges(n_tail as usize, n_tail as usize, &tail).unwrap());
    for a in &graphs {
        let n = a.n_rows();
        for (sym, loops) in [(false, false), (true, false), (false, true), (true, true)] {
            let spec = GraphSpec {
                symmetrize: sym,
                self_loops: loops,
                transpose: sym,
                ..GraphSpec::square(n)
            };
            check_build::<i64>(&gpu, &mut rng, a, spec, (false, a.nnz() / 10, 1));
            check_build::<i32>(&gpu, &mut rng, a, spec, (true, 0, 2));
        }
        check_build::<u32>(&gpu, &mut rng, a, GraphSpec::square(n), (true, 3, 1));
        // The transpose in the build's pass (its count a word on the device, repeats merged
        // leaving keys past it), unsymmetrized.
        let spec = GraphSpec {
            transpose: true,
            ..GraphSpec::square(n)
        };
        check_build::<i64>(&gpu, &mut rng, a, spec, (false, a.nnz() / 10 + 1, 1));
    }
    // Rectangular: 40 targets of 1000 sources.
    let mut edges = Vec::new();
    for r in 0..40u32 {
        for _ in 0..rng.random_range(0..60) {
            edges.push((r, rng.random_range(0..1000u32)));
        }
    }
    let rect = Csr::from_edges(40, 1000, &edges).unwrap();
    let spec = GraphSpec {
        n_rows: 40,
        n_cols: 1000,
        transpose: true,
        ..GraphSpec::square(0)
    };
    check_build::<i64>(&gpu, &mut rng, &rect, spec, (false, 5, 1));
}

/// Every shared graph, symmetrized with self loops from its edge list (the convention of
/// the benchmarks), against the host's.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_device_plan_equals_the_host_plan_on_the_shared_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu_device_plan_equals_the_host_plan_on_the_shared_graphs");
    for name in spattn_test_support::test_graphs(&["cora", "pubmed", "ogbn-arxiv"]) {
        let a = shared_graph(name);
        let spec = GraphSpec {
            symmetrize: true,
            self_loops: true,
            transpose: true,
            ..GraphSpec::square(a.n_rows())
        };
        check_build::<i64>(&gpu, &mut rng, &a, spec, (false, 0, 1));
    }
}

/// Ids out of range (negative, or past the graph) are reported naming the first such
/// edge, whatever the others; nothing is indexed with them.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_device_plan_reports_the_first_bad_edge() {
    let gpu = gpu();
    for (src, dst, first) in [
        (vec![0i64, 1, -3, 2, 9], vec![1i64, 2, 0, 10, 0], 2usize),
        (vec![0, 1, 2], vec![1, 4, 0], 1),
        (vec![5, 0], vec![0, 0], 0),
    ] {
        let (ds, dt) = upload_edges(&gpu, &src, &dst);
        let edges = contiguous_edges(&ds, &dt);
        for spec in [
            GraphSpec::square(4),
            GraphSpec {
                symmetrize: true,
                self_loops: true,
                transpose: true,
                ..GraphSpec::square(4)
            },
        ] {
            let e =
                build_from_edges(&gpu, &edges, &spec, None, &mut PlanWorkspace::new()).unwrap_err();
            match &e {
                Error::EdgeOutOfRange {
                    edge,
                    source_id,
                    target_id,
                    ..
                } => {
                    assert_eq!(*edge, first, "{e}");
                    assert_eq!(source_id, &src[first].to_string());
                    assert_eq!(target_id, &dst[first].to_string());
                }
                other => panic!("expected EdgeOutOfRange, got {other}"),
            }
        }
    }
    // Ids past their buffers at the stride given are refused before any launch.
    let d = DeviceVec::from_host(&gpu, &[0i32, 1, 2]).unwrap();
    let edges = DeviceEdges {
        sources: DeviceIds::strided(&d, 2).unwrap(),
        targets: DeviceIds::contiguous(&d),
        len: 3,
    };
    let e = build_from_edges(
        &gpu,
        &edges,
        &GraphSpec::square(3),
        None,
        &mut PlanWorkspace::new(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("stride 2"), "{e}");
}

/// Host costs of the plan's pieces on this machine (printed, not asserted: speed lives in
/// benchmarks): one launch, one allocation and free, and whole builds of mini-batch sizes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_device_plan_costs() {
    let gpu = gpu();
    let reps = 2000;
    let mut one = DeviceVec::<u32>::zeros(&gpu, 1).unwrap();
    let name = spattn_kernels_sys::kernel!(PLAN, "plan_iota_u32");
    let f = kernel(&gpu, name).unwrap();
    let n1 = 1u64;
    gpu.synchronize().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..reps {
        let mut args = gpu.launch_builder(&f);
        args.arg(one.slice_mut()).arg(&n1);
        // SAFETY: writes one[0] (1 element).
        unsafe { launch(name, &mut args, stride_grid(1).unwrap()) }.unwrap();
    }
    let enq = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
    gpu.synchronize().unwrap();
    let all = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
    eprintln!("launch: {enq:.2} us to enqueue, {all:.2} us each with the GPU");
    let t = std::time::Instant::now();
    for _ in 0..reps {
        drop(DeviceVec::<u32>::alloc(&gpu, "probe", 4096, false).unwrap());
    }
    gpu.synchronize().unwrap();
    eprintln!(
        "alloc + free: {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / reps as f64
    );
    let t = std::time::Instant::now();
    for _ in 0..reps {
        one.to_host().unwrap();
    }
    eprintln!(
        "read back 4 bytes: {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / reps as f64
    );
    let mut rng = fresh_rng("gpu_device_plan_costs");
    let mut ws = PlanWorkspace::new();
    for (n, avg) in [(3500usize, 2usize), (34_000, 3), (34_000, 30)] {
        let a = random_graph(&mut rng, n, avg, 0);
        let (src, dst) = edge_list(&mut rng, &a, false, 0);
        let (ds, dt) = upload_edges(&gpu, &src, &dst);
        let edges = contiguous_edges(&ds, &dt);
        for transpose in [false, true] {
            let spec = GraphSpec {
                self_loops: true,
                transpose,
                ..GraphSpec::square(n)
            };
            let mut times = Vec::new();
            for _ in 0..30 {
                gpu.synchronize().unwrap();
                let t = std::time::Instant::now();
                let b = build_from_edges(&gpu, &edges, &spec, None, &mut ws).unwrap();
                times.push(t.elapsed().as_secs_f64() * 1e3);
                drop(b);
            }
            times.sort_by(f64::total_cmp);
            eprintln!(
                "build of {} edges ({n} nodes), transpose {transpose}: median {:.3} ms",
                src.len(),
                times[times.len() / 2]
            );
        }
    }
}

/// Wall time of the blocked formats' device builds against the host path each replaces
/// (download the CSR and the BSB, build on the host, upload): fused-tc's extras edge maps (A's
/// and Aᵀ's) and the ME-BCRS, on mini-batch and larger sizes (printed, not asserted).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_blocked_format_costs() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu_blocked_format_costs");
    let mut ws = PlanWorkspace::new();
    let median = |f: &mut dyn FnMut()| {
        let mut times: Vec<f64> = (0..15)
            .map(|_| {
                gpu.synchronize().unwrap();
                let t = std::time::Instant::now();
                f();
                gpu.synchronize().unwrap();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    let mut graphs = vec![
        random_graph(&mut rng, 34_000, 3, 0),
        random_graph(&mut rng, 169_000, 7, 0),
    ];
    graphs.extend(
        spattn_test_support::test_graphs(&["ogbn-arxiv"])
            .into_iter()
            .map(shared_graph),
    );
    for a in &graphs {
        let (src, dst) = edge_list(&mut rng, a, false, 0);
        let (ds, dt) = upload_edges(&gpu, &src, &dst);
        let edges = contiguous_edges(&ds, &dt);
        let spec = GraphSpec {
            symmetrize: true,
            self_loops: true,
            transpose: true,
            ..GraphSpec::square(a.n_rows())
        };
        let built = build_from_edges(&gpu, &edges, &spec, None, &mut ws).unwrap();
        let t = built.transpose.unwrap();
        let (bsb, layout) = build_bsb(&gpu, &built.csr, &mut ws).unwrap();
        let ordered = OrderedBsb::built_on_device(bsb, layout, 0.0);
        let what = format!("{} edges ({} nodes)", built.csr.nnz(), a.n_rows());
        let device_maps = median(&mut || {
            let inverse = t.inverse_map(&gpu).unwrap();
            bsb_edge_map(&gpu, &ordered.device, &built.csr, None, &mut ws).unwrap();
            bsb_edge_map(&gpu, &ordered.device, t.csr(), Some(inverse), &mut ws).unwrap();
        });
        let host_maps = median(&mut || {
            let a = built.csr.to_host().unwrap();
            let b = ordered.device.to_host().unwrap();
            let (s, ids) = crate::device_bsb::bsb_edge_map(&a, &b, None).unwrap();
            DeviceVec::from_host(&gpu, &s).unwrap();
            DeviceVec::from_host(&gpu, &ids).unwrap();
            let (at, from_a) = a.transpose_with_map();
            let (s, ids) = crate::device_bsb::bsb_edge_map(&at, &b, None).unwrap();
            let ids: Vec<u32> = ids.iter().map(|&e| from_a[e as usize]).collect();
            DeviceVec::from_host(&gpu, &s).unwrap();
            DeviceVec::from_host(&gpu, &ids).unwrap();
        });
        eprintln!(
            "{what}: extras edge maps (A's and Aᵀ's) on the device {device_maps:.3} ms, \
             by the host {host_maps:.3} ms"
        );
        let device_me = median(&mut || {
            build_mebcrs(&gpu, &built.csr, &mut ws).unwrap();
        });
        let host_me = median(&mut || {
            let a = built.csr.to_host().unwrap();
            crate::DeviceMeBcrs::from_csr(&gpu, &a).unwrap();
        });
        eprintln!("{what}: ME-BCRS on the device {device_me:.3} ms, by the host {host_me:.3} ms");
    }
}
