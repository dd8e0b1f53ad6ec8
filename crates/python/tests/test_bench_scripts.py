"""The Python benchmarks on the CPU: the epoch benchmark end to end (``--device cpu``, the
bundled cora: its table, JSON and ``--profile`` breakdown), and how the mini-batch benchmark,
which needs a GPU, hands each implementation to a process of its own and merges the results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from conftest import BUNDLED_CORA, REPO  # noqa: E402


def test_epoch_benchmark_profiles_on_the_cpu(tmp_path):
    out = tmp_path / "epoch.json"
    cmd = [sys.executable, str(REPO / "crates" / "python" / "bench" / "epoch.py"),
           "--graph", str(BUNDLED_CORA), "--device", "cpu", "--models", "gat_dropout",
           "--dtypes", "f32", "--impls", "spattn", "--warmup", "0", "--repeat", "1",
           "--profile", "1", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["status"] == "ok" and r["median_ms"] > 0
    p = r["profile"]
    assert p["epochs"] == 1 and p["host_ops"] and p["kernels"] == []  # no device on the CPU
    names = [o["name"] for o in p["host_ops"]]
    assert any(n.startswith("_GatAttention") for n in names), names
    assert "gat_dropout float32 spattn: per epoch" in run.stdout


def _minibatch():
    sys.path.insert(0, str(REPO / "crates" / "python" / "bench"))
    import minibatch

    return minibatch


def test_minibatch_children_get_one_implementation_each():
    mb = _minibatch()
    argv = ["--graph", "g.mtx.gz", "--impls", "pyg,spattn", "--json=out.json", "--one-process",
            "--dtypes", "f16", "--impls=pyg"]
    assert mb.child_argv(argv, "spattn", "c.json", "c.pt") == [
        "--graph", "g.mtx.gz", "--dtypes", "f16",
        "--impls", "spattn", "--json", "c.json", "--firsts", "c.pt", "--one-process"]


def test_minibatch_merges_children_and_compares_first_forwards():
    import torch

    mb = _minibatch()

    def child(impl, ms, first):
        rows = [{"impl": impl, "workload": "molecules", "model": "gat", "dtype": "float16",
                 "status": "ok", "median_ms": ms, "mean_nodes": 10, "mean_edges": 20},
                {"impl": impl, "workload": "molecules", "model": "gat", "dtype": "f32",
                 "status": "error", "reason": "no"}]
        saved = {} if first is None else {mb.case_key("molecules", "gat", "f16"): first}
        return impl, {"results": rows, "plans": {"molecules": [{"edges": 20 + ms}]}}, saved

    pyg = torch.tensor([3.0, 4.0])
    results, plans = mb.merge_children(
        [child("pyg", 2.0, pyg), child("spattn", 1.0, pyg + torch.tensor([0.0, 0.5])),
         child("spattn-reused", 0.5, None)],
        {"float16": "f16", "float32": "f32"})
    assert [r["impl"] for r in results] == ["pyg", "pyg", "spattn", "spattn", "spattn-reused",
                                            "spattn-reused"]
    assert plans == {"molecules": [{"edges": 22.0}]}  # the first child's
    diffs = [r.get("first_forward_rel_diff_vs_pyg") for r in results]
    # 0.5 / |(3, 4)| = 0.1 on every row of the case both saved; none on the failed one.
    assert diffs == pytest.approx([0.1, None, 0.1, None, 0.1, None])


def test_minibatch_phases_from_children_in_one_process_order():
    mb = _minibatch()

    class Args:
        workloads, models, dtypes, impls = "molecules,arxiv-ns", "gat", "f16,f32", "pyg,spattn"

    def rec(w, d, impl):
        return {"workload": w, "model": "gat", "dtype": d, "impl": impl}

    children = [(impl, {"phases": [rec(w, d, impl) for w in ("molecules", "arxiv-ns")
                                   for d in ("f16", "f32")]}, {}) for impl in ("pyg", "spattn")]
    rows = mb.merge_phases(children, Args)
    assert [(r["workload"], r["dtype"], r["impl"]) for r in rows] == [
        (w, d, i) for w in ("molecules", "arxiv-ns") for d in ("f16", "f32") for i in ("pyg", "spattn")]
