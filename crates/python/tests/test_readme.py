"""The README's Python example runs as written (on the CPU here; on CUDA where the inputs are)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import REPO  # noqa: E402


def readme_examples() -> list:
    """The ```python blocks of the README's Python sections ("## Python quick start" and
    "## Python"), in order."""
    path = REPO / "README.md"
    if not path.is_file():
        pytest.skip("README.md is not beside these tests (a copy of the tests alone)")
    text = path.read_text(encoding="utf-8")
    blocks = []
    for part in text.split("\n## ")[1:]:
        if not part.startswith("Python"):
            continue
        at = 0
        while (start := part.find("```python\n", at)) >= 0:
            start += len("```python\n")
            end = part.index("```", start)
            blocks.append(part[start:end])
            at = end + 3
    return blocks


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_readme_examples_run(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(0)
    n = 50
    edge_index = torch.randint(0, n, (2, 300), generator=gen)
    edge_index = torch.unique(edge_index, dim=1).to(device)
    x = torch.randn(n, 16, generator=gen).to(device)
    y = torch.randint(0, 40, (n,), generator=gen).to(device)
    blocks = readme_examples()
    assert len(blocks) >= 2, "the Python section's examples (the PyG model, the extras)"
    scope = {"x": x, "edge_index": edge_index, "y": y}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    model = scope["model"]
    assert all(p.grad is not None for p in model.parameters())
    scope = {"torch": torch, "edge_index": edge_index}
    exec(compile(blocks[1], "README.md", "exec"), scope)
    g, alpha, bias = scope["g"], scope["alpha"], scope["bias"]
    assert alpha.shape == (g.num_edges, 4) and bias.grad.shape == (g.num_edges, 4)
