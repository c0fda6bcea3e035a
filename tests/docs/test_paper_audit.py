"""The audit of docs/reproduce.md: every regularizer and diagnostic against its paper's
formula, computed independently in plain torch on scikit-learn's digits.

``docs/reproduce/audit.py`` builds the rows (sharpcli's number, the independent number,
their agreement); here every row must agree within its tolerance, every registered
regularizer and every diagnostic command must have rows, and the page's audit table must
list every row, so neither the code nor the page can drift from the papers' formulas.
"""

from __future__ import annotations

import importlib.util
import math
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


# --------------------------------------------------------------------------- the library path
def _library_gradient(theta, x, y, activation, spec: str):
    """The gradient sharpcli.regularizers applies on the audit's batch (SGD with lr 1:
    theta - theta_after), and the penalty's value (None for an oracle)."""
    import torch.nn.functional as F

    from sharpcli import regularizers

    net = audit.sharp_model(theta, activation)
    before = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    sgd = torch.optim.SGD(net.parameters(), lr=1.0)
    gen = torch.Generator().manual_seed(3)
    # an oracle wraps the optimizer; a penalty takes none (it is added to the loss)
    oracle = regularizers.names()[spec.split(":")[0]] == "oracle"
    made = regularizers.make(spec, sgd if oracle else None, model=net, generator=gen)
    value = None
    if isinstance(made, regularizers.PerturbedOptimizer):

        def closure():
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        made.step(closure)
    else:
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        term = made(loss, logits, y)
        (loss + term).backward()
        value = float(term.detach())
        sgd.step()
    after = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return before - after, value


def _library_specs() -> list[str]:
    """Every regularizer of the catalogue usable in one's own loop, as the audit runs it."""
    from sharpcli import regularizers

    specs = {
        "wd": "wd:sigma=0.1", "ad": "ad:sigma=0.5", "gp": "gp:rho=0.1,p=1",
        "hessian-trace": "hessian-trace:sigma2=0.1,mode=exact", "gn-trace": "gn-trace:sigma2=0.1",
        "fa": "fa:lambda=0.1", "sam": "sam:rho=0.05", "usam": "usam:rho=0.5",
        "asam": "asam:rho=0.5,eta=0.01", "weight-noise": "weight-noise:sigma=0.05",
        "nso": "nso:sigma=0.05,k=2",
    }  # fmt: skip
    assert set(specs) == set(regularizers.names())  # a new regularizer joins this audit
    return [*specs.values(), "gp:rho=0.1,p=2"]


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_the_library_path_takes_the_audited_step(batch, activation):
    """sharpcli.regularizers (docs/own-loop.md) applies the gradient and the penalty value of
    sharp train's step, which the rows above check against the papers' formulas: the audit
    covers the library path."""
    _, x, y = batch
    torch.manual_seed(audit.SEED)  # the theta of regularizer_rows
    theta = torch.randn(sum(math.prod(s) for s in audit.shapes()), dtype=torch.float64) * 0.3
    step = audit.Step(theta, x, y, activation)
    for spec in _library_specs():
        want, stats = step.run(spec)
        got, value = _library_gradient(theta, x, y, activation, spec)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=spec)
        if value is not None:
            (reported,) = stats.penalties.values()
            assert abs(value - reported) <= 1e-12 * abs(reported), spec
