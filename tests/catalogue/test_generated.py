"""The catalogue's index is what the declarations beside the code make, and nothing else.

``python -m sharpcli.catalogue.generate --check`` (also in .ci/run) fails on a stale index; a
built-in whose declaration changed since is refused when it is first used, naming the command.
"""

from __future__ import annotations

import dataclasses

import pytest

from sharpcli import catalogue, registry
from sharpcli.catalogue import generate
from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Entry, Registry, declaration, declare
from sharpcli.specs import Param, RegistryError


def test_the_checked_in_index_is_fresh():
    assert generate.main(["--check"]) == 0
    assert registry.CHECK_INDEX


def test_the_index_holds_each_kind_s_declarations_in_definition_order():
    found = generate.collect()
    # every declared kind is one the catalogue exports a registry of
    kinds = {r.kind for r in vars(catalogue).values() if isinstance(r, Registry)}
    assert (
        {
            "check",
            "command",
            "diagonal estimator",
            "estimator",
            "loss",
            "metric",
            "model",
            "operator",
            "regularizer",
            "trackable",
        }
        <= set(found)
        <= kinds
    )
    assert [e.name for e in found["estimator"]] == list(catalogue.ESTIMATORS.builtin_names())
    # the default's module (hutchpp.py) first, then the one it builds on (trace.py), then the rest
    # (ggn_trace.py): the order of --estimator's help
    assert catalogue.ESTIMATORS.builtin_names() == ("hutchpp", "hutchinson", "gn-split", "exact")
    assert catalogue.DIAGONAL_ESTIMATORS.builtin_names()[0] == "hutchinson"  # the default
    assert catalogue.REGULARIZERS.builtin_names()[0] == "none"
    # the commands in their declared places (the workflow order of ``sharp --help``), not in
    # the order of their modules' names
    for kind in ("check", "command", "metric"):
        placed = found[kind]
        assert [e.info["order"] for e in placed] == list(range(1, len(placed) + 1)), kind
    assert catalogue.COMMANDS.builtin_names()[:3] == ("train", "eigen", "trace")
    assert catalogue.METRICS.builtin_names()[:2] == ("eigen", "trace")  # across modules
    for kind, entries in found.items():
        assert tuple(entries) == DECLARED[kind]
        for entry in entries:  # each record points at the module that defines the object
            obj = registry.resolve(entry.impl)
            assert declaration(obj) == (kind, entry), entry.name


def test_render_round_trips_every_field():
    entry = Entry(
        "toy",
        "a toy",
        "m:f",
        (Param("c", "choice", "a", "pick", choices=("a", "b")), Param("x", "float", 0.5, "x")),
        paper="NME",
        data_parallel="a reason",
        info={"symbol": "T", "psd": True},
    )
    namespace: dict = {}
    exec(generate.render({"toy": [entry]}), namespace)
    assert namespace["DECLARED"] == {"toy": (entry,)}
    with pytest.raises(ValueError, match="finite"):
        generate.render(
            {"toy": [dataclasses.replace(entry, params=(Param("x", "float", float("inf"), "x"),))]}
        )


def test_a_stale_record_is_refused_with_the_command_to_run():
    @declare("widget", "w", "new summary")
    def w():
        """A widget."""

    stale = dataclasses.replace(declaration(w)[1], summary="old summary")
    widgets = Registry("widget", source="widget", entries=[stale])
    with pytest.raises(RegistryError, match="python -m sharpcli.catalogue.generate"):
        widgets.register("w", w)
    with pytest.raises(RegistryError, match="declared as a widget, not a gadget"):
        Registry("gadget", source="gadget").add(w)
    fresh = Registry("widget", source="widget", entries=[declaration(w)[1]])
    assert fresh.register("w", w) is w


def test_the_names_torch_free_modules_use_are_the_declared_ones():
    from sharpcli.curvature.operators import registry as operators
    from sharpcli.regularizers.penalties.decay import NoRegularizer

    assert (catalogue.HESSIAN, catalogue.GGN, catalogue.NME) == operators.SPLIT
    assert NoRegularizer.name == "none"  # --reg's default (TrainConfig, sharp train's report)
    assert catalogue.REGULARIZERS.builtin_names()[0] == "none"  # listed first
