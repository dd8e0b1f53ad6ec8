"""The README's Python example runs as written (on the CPU here; on CUDA where the inputs are)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import REPO  # noqa: E402


def readme_example() -> str:
    path = REPO / "README.md"
    if not path.is_file():
        pytest.skip("README.md is not beside these tests (a copy of the tests alone)")
    text = path.read_text(encoding="utf-8")
    section = text[text.index("## Python") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_readme_example_runs(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(0)
    n = 50
    edge_index = torch.randint(0, n, (2, 300), generator=gen)
    edge_index = torch.unique(edge_index, dim=1).to(device)
    x = torch.randn(n, 16, generator=gen).to(device)
    y = torch.randint(0, 40, (n,), generator=gen).to(device)
    scope = {"x": x, "edge_index": edge_index, "y": y}
    exec(compile(readme_example(), "README.md", "exec"), scope)
    model = scope["model"]
    assert all(p.grad is not None for p in model.parameters())
