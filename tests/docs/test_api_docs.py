"""The pages of the in-memory API run as written: every ``python`` block of docs/api.md,
docs/from-pyhessian.md and docs/tracking.md, in page order, in a scratch folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ["api.md", "from-pyhessian.md", "tracking.md"]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(
        r"^```python\n(.*?)^```$", page.read_text(encoding="utf-8"), flags=re.S | re.M
    )


@pytest.mark.parametrize("name", PAGES)
def test_page_examples_run(name, tmp_path, monkeypatch, capsys):
    blocks = _python_blocks(DOCS / name)
    assert blocks, f"{name} has no python example"
    monkeypatch.chdir(tmp_path)
    for index, block in enumerate(blocks):
        if "import lightning" in block:
            pytest.importorskip("lightning")
        if "from transformers" in block:
            pytest.importorskip("transformers")
        exec(compile(block, f"{name} block {index + 1}", "exec"), {"__name__": f"docs_{index}"})
    assert capsys.readouterr().out.strip()  # every page prints its results
