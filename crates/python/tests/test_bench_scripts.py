"""The Python benchmarks run end to end on the CPU (``--device cpu``, the bundled cora): the
epoch benchmark's table, JSON and ``--profile`` breakdown."""

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
