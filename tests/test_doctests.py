"""The examples in every docstring of the package run as written (doctest).

The modules are found by walking the package, not listed by hand: a new module's examples run
as soon as it exists. The entry point (``python -m sharpcli``) is the one module left out: it
runs the CLI when imported.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sharpcli"
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages([str(PACKAGE)], "sharpcli.")
    if info.name != "sharpcli.__main__"
)


def test_the_walk_finds_the_modules_with_examples():
    assert {
        "sharpcli.api",
        "sharpcli.memory",
        "sharpcli.registry",
        "sharpcli.curvature.trace",
    } <= set(MODULES)
    assert len(MODULES) > 100


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
