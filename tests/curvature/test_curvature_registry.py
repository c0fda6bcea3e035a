"""The operator registry (sharpcli/curvature/operators/registry.py): built-ins against dense matrices,
registering and removing an operator, the UsageError for unknown names, and the ``--operator``
help and docs that are made from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from conftest import setup_and_reference

from sharpcli.curvature import AnalysisData, CurvatureEngine, MatrixOperator, ParamScope
from sharpcli.curvature.operators.registry import (
    OPERATORS,
    SPLIT,
    build_operator,
    operator_help,
    operator_names,
    operator_spec,
    operator_table,
    register_operator,
    unregister_operator,
)
from sharpcli.errors import UsageError

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _gelu_pass():
    """A float64 GELU MLP's pass (3 unequal batches) and its dense H and G."""
    model, x, y, H, G = setup_and_reference("gelu")
    data = AnalysisData(x, y, "cross-entropy", batch_size=10)
    return CurvatureEngine(model, data, ParamScope.resolve(model)), H, G


def test_builtin_operators_equal_dense_h_g_and_n():
    engine, H, G = _gelu_pass()
    dense = {"hessian": H, "ggn": G, "nme": H - G}
    assert operator_names()[:3] == SPLIT == ("hessian", "ggn", "nme")
    for name in SPLIT:
        op = build_operator(name, engine)
        assert torch.allclose(op.to_dense(), dense[name], atol=1e-10, rtol=0)
    assert [OPERATORS[n].symbol for n in SPLIT] == ["H", "G", "N"]
    assert [OPERATORS[n].psd for n in SPLIT] == [False, True, False]
    # the built-ins share the pass (and its cached first-order graphs)
    assert build_operator("ggn", engine).engine is engine


def test_ggn_rank_bound_counts_c_minus_one_for_cross_entropy():
    bound = OPERATORS["ggn"].rank_bound
    assert bound(23, 3, "cross-entropy") == 46 and bound(23, 3, "mse") == 69
    assert OPERATORS["hessian"].rank_bound is None


def test_unknown_name_is_a_usage_error_listing_the_choices():
    with pytest.raises(UsageError) as info:
        operator_spec("jacobian")
    assert info.value.source == "operator"
    assert "'jacobian'" in str(info.value) and "accepted: hessian, ggn, nme" in str(info.value)


def test_register_then_unregister_an_operator(capsys):
    engine, H, _ = _gelu_pass()
    spec = register_operator(
        "hessian-twice",
        lambda engine: MatrixOperator(2 * engine.hessian().to_dense(), name="2H"),
        symbol="2H",
        description="twice the   Hessian",  # whitespace is normalised for one-line help
        psd=False,
    )
    try:
        assert spec.description == "twice the Hessian"
        assert operator_names()[-1] == "hessian-twice"
        op = build_operator("hessian-twice", engine)
        assert torch.allclose(op.to_dense(), 2 * H, atol=1e-10, rtol=0)
        assert "hessian-twice (2H: twice the Hessian)" in operator_help()
        assert "| `hessian-twice` | 2H | twice the Hessian | no |" in operator_table()
        help_run = run_cli(capsys, "trace", "--help")
        assert "hessian-twice" in " ".join(help_run.out.split())
        with pytest.raises(ValueError, match="already registered"):
            register_operator(
                "hessian-twice", CurvatureEngine.hessian, symbol="H", description="", psd=False
            )
    finally:
        assert unregister_operator("hessian-twice") is spec
    assert "hessian-twice" not in OPERATORS
    with pytest.raises(UsageError, match="accepted: hessian, ggn, nme, ef, fisher$"):
        operator_spec("hessian-twice")


@pytest.mark.parametrize("name", ["Fisher", "2nd", "ggn_x", "", "a b"])
def test_names_must_be_cli_values(name):
    with pytest.raises(ValueError, match="lower case"):
        register_operator(name, CurvatureEngine.hessian, symbol="X", description="x", psd=False)


def test_the_split_cannot_be_unregistered():
    for name in SPLIT:
        with pytest.raises(ValueError, match="H = G \\+ N"):
            unregister_operator(name)
    with pytest.raises(ValueError, match="not registered"):
        unregister_operator("no-such-operator")


def test_operator_help_comes_from_the_registry(capsys):
    run = run_cli(capsys, "density", "--help")
    flat = " ".join(run.out.replace("│", " ").split())
    assert operator_help() in flat


def test_docs_operator_table_and_synopses_match_the_registry():
    """docs/commands/eigen.md prints ``operator_table()`` (the registered names, the built-ins:
    no other test leaves one behind); every ``[--operator ...]`` synopsis names its value
    ``NAME``, which that table lists, rather than a pasted list that an extension outdates."""
    eigen = (DOCS / "commands" / "eigen.md").read_text(encoding="utf-8")
    assert operator_table() in eigen
    assert all(f"`{name}`" in operator_table() for name in operator_names())
    pages = 0
    for page in sorted((DOCS / "commands").glob("*.md")):
        for listed in re.findall(r"\[--operator ([A-Za-z|-]+)\]", page.read_text(encoding="utf-8")):
            assert listed == "NAME", (page.name, listed)
            pages += 1
    assert pages >= 3  # eigen, trace, density


def test_gn_nme_split_is_keyed_by_the_registry_names():
    from sharpcli.curvature.trace.split import gn_nme_split

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GELU(), torch.nn.Linear(4, 2))
    model = model.double().eval()
    x, y = torch.randn(9, 3, dtype=torch.float64), torch.randint(0, 2, (9,))
    data = AnalysisData(x, y, loss="cross-entropy", batch_size=4)
    engine = CurvatureEngine(model, data, ParamScope.resolve(model))
    split = gn_nme_split(engine, tol=1e-1, max_matvecs=16, seed=0)
    assert tuple(split.values) == SPLIT
    h, g, n = (split.values[name]["trace"]["estimate"] for name in SPLIT)
    assert h == pytest.approx(g + n, abs=1e-12)
