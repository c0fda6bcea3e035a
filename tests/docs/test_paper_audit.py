"""The audit of docs/reproduce.md: every regularizer and diagnostic against its paper's
formula, computed independently in plain torch on scikit-learn's digits.

``docs/reproduce/audit.py`` builds the rows (sharpcli's number, the independent number,
their agreement); here every row must agree within its tolerance, every registered
regularizer and every diagnostic command must have rows, and the page's audit table must
list every row, so neither the code nor the page can drift from the papers' formulas.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_audit():
    spec = importlib.util.spec_from_file_location("audit", ROOT / "docs" / "reproduce" / "audit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("audit", module)
    spec.loader.exec_module(module)
    return module


audit = _load_audit()


@pytest.fixture(scope="module")
def batch():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    arrays = audit.digits_arrays()
    x = torch.as_tensor(arrays["x"][: audit.BATCH], dtype=torch.float64)
    y = torch.as_tensor(arrays["y"][: audit.BATCH])
    yield arrays, x, y
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def regularizer_rows(batch):
    _, x, y = batch
    return audit.regularizer_rows(x, y)


@pytest.fixture(scope="module")
def diagnostic_rows(batch, tmp_path_factory):
    arrays, _, _ = batch
    return audit.diagnostic_rows(tmp_path_factory.mktemp("audit"), arrays)


def _failures(rows) -> list[str]:
    return [
        f"{row.item} | {row.paper} | {row.quantity}: {row.agreement()} (tol {row.tol:g})"
        for row in rows
        if not row.ok
    ]


def test_every_regularizer_matches_its_formula(regularizer_rows):
    assert not _failures(regularizer_rows), "\n".join(_failures(regularizer_rows))
    # the exact computations agree to rounding, not merely "closely"
    exact = [row for row in regularizer_rows if "fd" not in row.item and row.kind == "rel"]
    assert len(exact) >= 20 and all(row.error < 1e-12 for row in exact)


def test_every_registered_regularizer_is_audited(regularizer_rows):
    """Every regularizer of the catalogue has rows, each citing the paper its record names."""
    from sharpcli import catalogue

    audited = {row.item.split(" ")[0] for row in regularizer_rows}
    assert audited == set(catalogue.REGULARIZERS.names()) - {"none"}
    for row in regularizer_rows:
        paper = catalogue.REGULARIZERS.entry(row.item.split(" ")[0]).paper
        assert re.search(rf"(^|\[){re.escape(paper)}(\]|\s)", row.paper), (row.item, row.paper)


def test_every_diagnostic_matches_an_explicit_computation(diagnostic_rows):
    assert not _failures(diagnostic_rows), "\n".join(_failures(diagnostic_rows))
    commands = {row.item.split(" ")[0] for row in diagnostic_rows}
    assert commands == {"gn-nme", "bound-check", "weight-rescale", "activation-stats"}


def test_the_page_lists_every_audit_row(regularizer_rows, diagnostic_rows):
    page = (ROOT / "docs" / "reproduce.md").read_text(encoding="utf-8")
    table = page[page.index("## Audit") :]
    for row in [*regularizer_rows, *diagnostic_rows]:
        assert f"| {row.item} | {row.paper} | {row.quantity} |" in table, row
