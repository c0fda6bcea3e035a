"""docs/architecture.md's module list names every module of sharpcli (a newcomer finds each one
there), and its layers are the ones `lint-imports` checks (pyproject.toml)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module_list() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return text.split("```", 2)[1]  # the first fenced block: the layers and their modules


def test_every_module_is_named():
    listed = _module_list()
    missing = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "sharpcli").rglob("*.py"))
        if path.name != "__init__.py" or path.parent.name == "sharpcli"
        if not re.search(rf"(?<![\w.]){re.escape(path.stem)}\b", listed)
    ]
    assert not missing, missing


def test_the_layers_are_the_contract():
    """The module list's top-level entries, top first, are the layers contract's modules."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11, as import-linter
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    layered = [name.strip() for layer in contract["layers"] for name in layer.split("|")]
    entries = re.findall(r"^(\w+)(?:/|\.py)", _module_list(), flags=re.MULTILINE)
    assert [e for e in entries if e not in ("__init__",)] == layered
