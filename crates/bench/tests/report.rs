//! `spattn-bench report` on a synthetic GPU run: the expected ratios in the markdown, an SVG.

mod common;

use common::{bench, cpu_run, temp_dir, text};
use spattn_bench::record::*;

fn graph(name: &str, nnz: u64) -> GraphRecord {
    let fill = FillRecord {
        windows: 10,
        blocks: 20,
        slots: 1280,
        fill: 0.25,
    };
    GraphRecord {
        name: name.into(),
        source: format!("{name}.mtx.gz"),
        n: 1000,
        nnz,
        symmetrized: true,
        degree: DegreeRecord {
            min: 1,
            mean: nnz as f64 / 1000.0,
            max: 50,
            empty_rows: 0,
        },
        mebcrs: fill.clone(),
        bsb: fill,
        load_seconds: 0.1,
    }
}

fn case(graph: &str, name: &str, kind: &str, ms: f64, vs_unfused: Option<f64>) -> CaseRecord {
    CaseRecord {
        graph: graph.into(),
        case: name.into(),
        kind: kind.into(),
        heads: 1,
        head_dim: 64,
        dtype: "f16".into(),
        seed: 7,
        median_ms: Some(ms),
        min_ms: Some(ms * 0.9),
        max_ms: Some(ms * 1.1),
        reps: 30,
        floor_bytes: 1_000_000,
        floor_ms: Some(0.001),
        effective_gbs: Some(1.0 / ms),
        pct_of_floor: Some(0.1 / ms),
        speedup_vs_unfused: vs_unfused,
        rel_error: Some(1e-4),
        tolerance: 5e-3,
        passed: Some(true),
        peers: Vec::new(),
        choice: None,
        plan_ms: None,
        graph_device_bytes: None,
        plan_host_peak_bytes: None,
        error: None,
    }
}

fn peer(graph: &str, nnz: u64, name: &str, ms: f64, used: &str) -> PeerRecord {
    PeerRecord {
        graph: graph.into(),
        n: 1000,
        nnz,
        heads: 1,
        head_dim: 64,
        dtype: "f16".into(),
        peer: name.into(),
        median_ms: Some(ms),
        dtype_used: Some(used.into()),
        note: None,
        gpu: Some("NVIDIA H100 80GB HBM3".into()),
        torch: Some("2.11.0".into()),
        status: "ok".into(),
        reason: None,
        variant: None,
        rel_err: None,
        tolerance: None,
        ok: None,
    }
}

/// A peer that ran with a measured error (`ok` against the f16 tolerance).
fn checked_peer(graph: &str, nnz: u64, name: &str, ms: f64, err: f64) -> PeerRecord {
    PeerRecord {
        rel_err: Some(err),
        tolerance: Some(5e-3),
        ok: Some(err <= 5e-3),
        ..peer(graph, nnz, name, ms, "f16")
    }
}

/// A peer that could not run the configuration.
fn limited_peer(graph: &str, nnz: u64, name: &str, status: &str, reason: &str) -> PeerRecord {
    PeerRecord {
        median_ms: None,
        dtype_used: None,
        status: status.into(),
        reason: Some(reason.into()),
        ..peer(graph, nnz, name, 0.0, "f16")
    }
}

fn run() -> RunRecord {
    RunRecord {
        schema: SCHEMA_VERSION,
        tool: "spattn-bench 0.1.0".into(),
        date: "2026-01-02T03:04:05Z".into(),
        commit: "abc1234".into(),
        command: "spattn-bench --graph cora --rmat 16 --json run.json".into(),
        device: DeviceRecord {
            kind: "gpu".into(),
            name: "NVIDIA H100 80GB HBM3".into(),
            reason: "GPU 0 opened".into(),
            driver_version: Some("12.8".into()),
            compute_capability: Some("9.0".into()),
            sm_count: Some(132),
            memory_bytes: Some(80 << 30),
            copy_bandwidth_gbs: Some(3000.0),
            copy_bytes: Some(1 << 30),
            cpu_threads: 16,
        },
        settings: Settings {
            warmup: 5,
            reps: 30,
            timing: "cuda-events".into(),
            seed: 1,
            rmat_seed: 1,
            check: true,
            symmetrize: true,
            reorder: "auto".into(),
        },
        graphs: vec![graph("cora", 13264), graph("rmat-16", 2_000_000)],
        cases: vec![
            case("cora", "sddmm-csr", "op", 0.1, None),
            case("cora", "unfused-csr", "algorithm", 0.5, Some(1.0)),
            // An algorithm this binary does not know yet: compared by kind.
            case("cora", "fused-csr", "algorithm", 0.25, Some(2.0)),
            case("rmat-16", "unfused-csr", "algorithm", 1.0, Some(1.0)),
            case("rmat-16", "fused-csr", "algorithm", 0.8, Some(1.25)),
            case("cora", "auto", "algorithm", 0.2, Some(2.5)),
            case("rmat-16", "auto", "algorithm", 0.5, Some(2.0)),
        ],
        peers: vec![
            peer("cora", 13264, "torch_sparse_attention", 1.0, "f16"),
            peer("cora", 13264, "cusparse_sddmm", 0.3, "f32"),
            peer("rmat-16", 2_000_000, "torch_sparse_attention", 4.0, "f16"),
            // Another graph than ours (not symmetrized): never compared.
            peer("rmat-16", 1_000_000, "pyg_attention", 9.0, "f16"),
            // Fast but wrong: shown with its error, not counted as a win.
            checked_peer("cora", 13264, "fused3s", 0.1, 0.5),
            checked_peer("rmat-16", 2_000_000, "fused3s", 1.5, 1e-3),
            // Limits are results too.
            limited_peer("cora", 13264, "dfgnn_tiling", "unsupported", "f32 only"),
            limited_peer(
                "rmat-16",
                2_000_000,
                "dfgnn_tiling",
                "unsupported",
                "f32 only",
            ),
        ],
    }
}

/// `report` of `json` into `dir`/B.md with its chart `dir`/b.svg; the page's text.
fn report_page(dir: &std::path::Path, json: &std::path::Path) -> String {
    let md = dir.join("B.md");
    let svg = dir.join("b.svg");
    let out = bench(&[
        "report",
        "--json",
        json.to_str().unwrap(),
        "--out",
        md.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out).1);
    std::fs::read_to_string(&md).unwrap()
}

#[test]
fn report_has_the_expected_ratios_and_a_chart() {
    let dir = temp_dir("report");
    let json = dir.join("run.json");
    std::fs::write(&json, serde_json::to_string_pretty(&run()).unwrap()).unwrap();
    // An extra peer file given to the report only.
    let extra = dir.join("extra-peers.json");
    let extra_peers = vec![peer("rmat-16", 2_000_000, "dense_sdpa", 2.0, "f16")];
    std::fs::write(&extra, serde_json::to_string(&extra_peers).unwrap()).unwrap();
    let md = dir.join("BENCHMARKS.md");
    let svg = dir.join("docs/benchmarks.svg");
    let out = bench(&[
        "report",
        "--json",
        json.to_str().unwrap(),
        "--peers",
        extra.to_str().unwrap(),
        "--out",
        md.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let md = std::fs::read_to_string(&md).unwrap();

    // Header.
    for want in [
        "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 80 GiB)",
        "| CUDA driver | 12.8 |",
        "3,000 GB/s",
        "`abc1234`",
        "2026-01-02T03:04:05Z",
        "`spattn-bench --graph cora --rmat 16 --json run.json`",
        "torch 2.11.0",
    ] {
        assert!(md.contains(want), "missing {want:?} in\n{md}");
    }
    // Per-configuration rows: times, ratios (peer / ours), the † of an f32 fallback.
    assert!(
        md.contains(
            "| 1 | 64 | f16 | unfused-csr | 0.5000 | 0.2% | 1.00× | 1.0e-4 ✓ | 1.000 (2.00×) | 0.1000 (0.20×) 5.0e-1 ✗ | unsupported | – |"
        ),
        "{md}"
    );
    assert!(
        md.contains(
            "| 1 | 64 | f16 | fused-csr | 0.2500 | 0.4% | 2.00× | 1.0e-4 ✓ | 1.000 (4.00×) | 0.1000 (0.40×) 5.0e-1 ✗ | unsupported | – |"
        ),
        "{md}"
    );
    assert!(
        md.contains(
            "| 1 | 64 | f16 | sddmm-csr | 0.1000 | 1.0% | – | 1.0e-4 ✓ | – | – | – | 0.3000† (3.00×) |"
        ),
        "{md}"
    );
    assert!(md.contains("| 1 | 64 | f16 | unfused-csr | 1.000 | 0.1% | 1.00× | 1.0e-4 ✓ | 4.000 (4.00×) | 2.000 (2.00×) | 1.500 (1.50×) 1.0e-3 ✓ | unsupported |"), "{md}");
    assert!(
        !md.contains("pyg_attention"),
        "a peer of another graph was compared:\n{md}"
    );
    // Geo-means: unfused vs torch √(2·4), fused √(4·5), auto √(5·8), sddmm 3; fused3s only
    // where it was within tolerance (rmat-16).
    // In order: algorithms (as they first appear) against each attention peer, then ops.
    let summary = [
        "| unfused-csr | torch_sparse_attention | 2.83× | 2 |",
        "| fused-csr | torch_sparse_attention | 4.47× | 2 |",
        "| auto | torch_sparse_attention | 6.32× | 2 |",
        "| unfused-csr | dense_sdpa | 2.00× | 1 |",
        "| fused-csr | dense_sdpa | 2.50× | 1 |",
        "| auto | dense_sdpa | 4.00× | 1 |",
        "| unfused-csr | fused3s | 1.50× | 1 |",
        "| fused-csr | fused3s | 1.88× | 1 |",
        "| auto | fused3s | 3.00× | 1 |",
        "| sddmm-csr | cusparse_sddmm | 3.00× | 1 |",
    ]
    .join("\n");
    assert!(md.contains(&summary), "{md}");
    // auto against each peer: the wrong fused3s run is a ✗, not a win; dfgnn's limits counted.
    for want in [
        "| torch_sparse_attention | f16 | 6.32× | 5.00× | 2 | 0 | 0 | – | 1.0e-4 |",
        "| fused3s | f16 | 3.00× | 3.00× | 1 | 1 | 0 | 5.0e-1 | 1.0e-4 |",
        "| dfgnn_tiling | f16 | – | – | 0 | 0 | 2 | – | – |",
        "| dfgnn_tiling | unsupported | f32 only | 2 (cora H1 D64 f16, rmat-16 H1 D64 f16) |",
        "| 1 | 64 | f16 | auto | 0.2000 | 0.5% | 2.50× | 1.0e-4 ✓ | 1.000 (5.00×) | 0.1000 (0.50×) 5.0e-1 ✗ | unsupported | – |",
    ] {
        assert!(md.contains(want), "missing {want:?} in\n{md}");
    }
    assert!(md.contains("](docs/benchmarks.svg)"), "{md}");
    assert!(
        md.contains("## How to reproduce") && md.contains("cargo xtask gpu-bundle"),
        "{md}"
    );

    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("</svg>"), "{svg}");
    // auto against each peer that ran within tolerance, per graph: torch 5× and 8×, dense 4×,
    // fused3s 3× on rmat-16 only.
    for want in [
        "cora",
        "rmat-16",
        "torch_sparse_attention",
        "dense_sdpa",
        "fused3s",
        "5.00×",
        "8.00×",
        "4.00×",
        "3.00×",
    ] {
        assert!(svg.contains(want), "missing {want:?} in the SVG");
    }
    assert!(!svg.contains("0.50×"), "the wrong fused3s run was charted");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn report_appends_the_given_markdown_after_the_tables() {
    let dir = temp_dir("report-append");
    let json = dir.join("run.json");
    std::fs::write(&json, serde_json::to_string_pretty(&run()).unwrap()).unwrap();
    let extra = dir.join("training.md");
    std::fs::write(
        &extra,
        "## Training\n\n| layer | ms |\n|---|---:|\n| gat | 0.2 |\n\n",
    )
    .unwrap();
    let md = dir.join("B.md");
    let svg = dir.join("b.svg");
    let args = [
        "report",
        "--json",
        json.to_str().unwrap(),
        "--out",
        md.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
        "--append",
        extra.to_str().unwrap(),
    ];
    let out = bench(&args);
    assert!(out.status.success(), "{}", text(&out).1);
    let md_text = std::fs::read_to_string(&md).unwrap();
    let at = md_text.find("## Training").expect("the appended section");
    assert!(
        at > md_text.find("## How to reproduce").unwrap(),
        "{md_text}"
    );
    assert!(md_text[at..].contains("| gat | 0.2 |\n"), "{md_text}");

    // A missing file is one clear error naming it.
    let missing = dir.join("missing.md");
    let mut bad = args;
    bad[8] = missing.to_str().unwrap();
    let out = bench(&bad);
    assert!(!out.status.success());
    assert!(text(&out).1.contains("missing.md"), "{}", text(&out).1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn report_of_a_cpu_run_says_so() {
    let dir = temp_dir("report-cpu");
    let json = dir.join("run.json");
    cpu_run(&["--rmat", "5", "--json", json.to_str().unwrap()], 2, 0);
    let md = report_page(&dir, &json);
    assert!(
        md.contains("not a GPU run") && md.contains("cpu-unfused"),
        "{md}"
    );
    assert!(md.contains("](b.svg)"), "{md}");
    assert!(std::fs::read_to_string(dir.join("b.svg"))
        .unwrap()
        .contains("no peer timings of auto"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn report_never_overwrites_a_file_it_did_not_generate_from_the_same_inputs() {
    let dir = temp_dir("report-clobber");
    let json = dir.join("run.json");
    std::fs::write(&json, serde_json::to_string_pretty(&run()).unwrap()).unwrap();
    let md = dir.join("BENCHMARKS.md");
    let svg = dir.join("docs/benchmarks.svg");
    let hand_written = "# Benchmarks\n\nTables of an earlier run, edited by hand.\n";
    std::fs::write(&md, hand_written).unwrap();
    let args = |force: bool| {
        let mut a = vec![
            "report".to_string(),
            "--json".into(),
            json.display().to_string(),
            "--out".into(),
            md.display().to_string(),
            "--svg".into(),
            svg.display().to_string(),
        ];
        if force {
            a.push("--force".into());
        }
        a
    };
    let run_with = |force: bool| {
        let a = args(force);
        bench(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };

    // Refused, with a one-line message naming the file; nothing written.
    let out = run_with(false);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains("BENCHMARKS.md exists and was not generated from these inputs")
            && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&md).unwrap(), hand_written);
    assert!(
        !svg.exists(),
        "the chart was written although the report was refused"
    );

    // --force replaces it and says what it wrote.
    let out = run_with(true);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!("wrote {}", md.display()))
            && stdout.contains(&format!("wrote {}", svg.display())),
        "{stdout}"
    );
    let first = std::fs::read_to_string(&md).unwrap();
    assert!(
        first.contains("spattn-bench report inputs fnv1a64="),
        "{first}"
    );

    // The same inputs again: regenerated without --force, identically.
    let out = run_with(false);
    assert!(out.status.success(), "{}", text(&out).1);
    assert_eq!(std::fs::read_to_string(&md).unwrap(), first);

    // Other inputs: refused again.
    let mut other = run();
    other.cases.truncate(1);
    std::fs::write(&json, serde_json::to_string_pretty(&other).unwrap()).unwrap();
    let out = run_with(false);
    assert!(!out.status.success());
    assert_eq!(std::fs::read_to_string(&md).unwrap(), first);

    // --out is required: no report picks a file on its own.
    let out = bench(&["report", "--json", json.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(text(&out).1.contains("--out"), "{}", text(&out).1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn report_with_full_tables_writes_one_page_and_links_them() {
    let dir = temp_dir("report-full");
    let json = dir.join("run.json");
    std::fs::write(&json, serde_json::to_string_pretty(&run()).unwrap()).unwrap();
    let (page, full, svg) = (
        dir.join("BENCHMARKS.md"),
        dir.join("docs/benchmarks-full.md"),
        dir.join("docs/benchmarks.svg"),
    );
    let summary = dir.join("training.md");
    std::fs::write(&summary, "## Training\n\nOne line.\n").unwrap();
    let out = bench(&[
        "report",
        "--json",
        json.to_str().unwrap(),
        "--out",
        page.to_str().unwrap(),
        "--full",
        full.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
        "--append",
        summary.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!("wrote {}", full.display())),
        "{stdout}"
    );
    let page = std::fs::read_to_string(&page).unwrap();
    let full = std::fs::read_to_string(&full).unwrap();
    // The page: auto's summary, key configurations, limits, links; no per-graph tables.
    for want in [
        "## `auto` against each peer",
        "## Key configurations",
        "## What the peers could not run",
        "](docs/benchmarks-full.md)",
        "](docs/benchmarks.svg)",
        "## Training",
    ] {
        assert!(page.contains(want), "missing {want:?} in the page\n{page}");
    }
    assert!(!page.contains("### cora"), "{page}");
    // The page counts the peers' limits and links their reasons and the runs' commands, which
    // the full tables list.
    for want in [
        "(docs/benchmarks-full.md#what-the-peers-could-not-run)",
        "(docs/benchmarks-full.md#how-to-reproduce)",
    ] {
        assert!(page.contains(want), "missing {want:?} in the page\n{page}");
    }
    for unwanted in ["| peer | status | reason |", "The runs of this report:"] {
        assert!(!page.contains(unwanted), "{unwanted:?} in the page\n{page}");
        assert!(
            full.contains(unwanted),
            "missing {unwanted:?} in the full tables\n{full}"
        );
    }
    // The full tables: every graph, the chart linked from its own folder.
    assert!(
        full.contains("### cora") && full.contains("### rmat-16"),
        "{full}"
    );
    assert!(full.contains("](benchmarks.svg)"), "{full}");
    assert!(!full.contains("## Training"), "{full}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn report_lists_plan_times_beside_the_peers_preprocessing() {
    let dir = temp_dir("report-plan-time");
    let mut r = run();
    for (c, ms) in r
        .cases
        .iter_mut()
        .zip([0.0, 12.5, 3.25, 40.0, 7.0, 2.0, 9.0])
    {
        if c.kind == "algorithm" {
            c.plan_ms = Some(ms);
            c.graph_device_bytes = Some(3 << 20);
        }
    }
    // A second configuration of cora's auto, planned faster (formats already uploaded).
    let mut again = r.cases[5].clone();
    again.heads = 8;
    again.plan_ms = Some(0.5);
    r.cases.push(again);
    r.peers
        .push(peer("cora", 13264, "fused3s_preprocess", 4.5, "f16"));
    let json = dir.join("run.json");
    std::fs::write(&json, serde_json::to_string_pretty(&r).unwrap()).unwrap();
    let md_text = report_page(&dir, &json);
    let at = md_text.find("## Plan time").expect("a plan-time section");
    let section = &md_text[at..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |e| e + 1)];
    // Fastest–slowest over cora's two auto plans, their count, the uploads, and Fused3S's
    // preprocessing on the graph's first row.
    assert!(
        section.contains("| cora | auto | 0.5000–2.000 | 2 | 3.0 | fused3s: 4.500 |"),
        "{section}"
    );
    // With the plans' host peak recorded, its column (the largest over the configurations).
    let mut peaked = r.clone();
    for c in peaked.cases.iter_mut().filter(|c| c.plan_ms.is_some()) {
        c.plan_host_peak_bytes = Some(if c.heads == 8 { 5 << 20 } else { 2 << 20 });
    }
    let dir2 = temp_dir("report-plan-peak");
    let json2 = dir2.join("run.json");
    std::fs::write(&json2, serde_json::to_string_pretty(&peaked).unwrap()).unwrap();
    let md2 = report_page(&dir2, &json2);
    assert!(
        md2.contains("| graph | algorithm | plan (ms) | configurations | graph uploads (MiB) | plan host peak (MiB) |"),
        "{md2}"
    );
    assert!(
        md2.contains("| cora | auto | 0.5000–2.000 | 2 | 3.0 | 5.0 | fused3s: 4.500 |"),
        "{md2}"
    );
    assert!(
        section
            .lines()
            .any(|l| l.starts_with("| rmat-16 | fused-csr | ") && l.contains("| 1 |")),
        "{section}"
    );
    // Cases without a plan (ops) have no row.
    assert!(!section.contains("sddmm-csr"), "{section}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn report_header_names_each_commit_once_in_the_runs_order() {
    let dir = temp_dir("report-commits");
    let mut paths = Vec::new();
    // Runs of one commit need not be adjacent: a graph rerun at another commit sits between.
    for (i, commit) in ["c0401c0", "9eea0a7", "c0401c0"].into_iter().enumerate() {
        let mut r = run();
        r.commit = commit.into();
        let path = dir.join(format!("run-{i}.json"));
        std::fs::write(&path, serde_json::to_string_pretty(&r).unwrap()).unwrap();
        paths.push(path);
    }
    let md = dir.join("B.md");
    let mut args = vec!["report", "--json"];
    args.extend(paths.iter().map(|p| p.to_str().unwrap()));
    args.extend(["--out", md.to_str().unwrap()]);
    let out = bench(&args);
    assert!(out.status.success(), "{}", text(&out).1);
    let page = std::fs::read_to_string(&md).unwrap();
    assert!(page.contains("| commit | `c0401c0`, `9eea0a7` |"), "{page}");
    std::fs::remove_dir_all(&dir).unwrap();
}
