"""Each built-in's name is spelled, as a string literal, only where a thing of that name is declared.

A built-in (a regularizer, estimator, operator, loss, activation, data format, dataset,
command, metric, model) is declared once beside its code; every other module refers to it
through that declaration (its constant, its registry) and never spells the name again, so
renaming one is a one-line change and a typo is an import error, not a silent miss. A name
may be shared by things of different kinds (``exact`` is a trace estimator, a diagonal
estimator and a penalty's mode): it may then appear in each of their declaring modules.
The generated index is not hand-written and is not scanned.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from sharpcli import catalogue
from sharpcli.catalogue import sharpness, values
from sharpcli.registry import Registry

PACKAGE = Path(catalogue.__file__).resolve().parents[1]
GENERATED = {PACKAGE / "catalogue" / "index.py"}


def _registries() -> list[Registry[Any]]:
    """Every registry of built-ins the catalogue exports."""
    found = {id(r): r for r in vars(catalogue).values() if isinstance(r, Registry)}
    found.update({id(r): r for r in catalogue.KINDS.values()})
    return list(found.values())


def _module_path(impl: str) -> Path:
    module = impl.partition(":")[0]
    path = PACKAGE.parent / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _declaring_modules() -> tuple[set[str], dict[str, set[Path]]]:
    """The built-ins' names, and for every spelling the modules allowed to hold it."""
    names: set[str] = set()
    allowed: dict[str, set[Path]] = defaultdict(set)
    for registry in _registries():
        for entry in registry.entries():
            if entry.name not in registry.builtin_names() or not entry.impl:
                continue
            names.add(entry.name)
            where = _module_path(entry.impl)
            allowed[entry.name].add(where)
            for param in entry.params:
                for choice in param.choices or ():
                    allowed[str(choice)].add(where)
    # the closed value sets of options are declarations too (a value spelled like a built-in)
    for module in (values, sharpness):
        for value in vars(module).values():
            if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
                for v in value:
                    allowed[v].add(Path(module.__file__).resolve())
    return names, allowed


def _spellings(names: set[str]) -> dict[str, set[Path]]:
    where: dict[str, set[Path]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() in GENERATED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in names:
                    where[node.value].add(path.resolve())
    return where


NAMES, ALLOWED = _declaring_modules()
SPELLED = _spellings(NAMES)


def test_the_scan_sees_the_builtins() -> None:
    """The check covers every kind (it cannot pass by finding nothing)."""
    assert {"sam", "hutchinson", "hessian", "cross-entropy", "relu", "eigen"} <= NAMES
    assert len(NAMES) >= 50


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_builtin_name_is_spelled_only_where_it_is_declared(name: str) -> None:
    """The modules spelling ``name`` are among those declaring a thing of that name."""
    extra = sorted(str(p.relative_to(PACKAGE.parent)) for p in SPELLED[name] - ALLOWED[name])
    assert not extra, f"{name!r} spelled outside its declaration in {extra}"
