"""The examples in every docstring of the package run as written (doctest).

The modules are found by walking the package, not listed by hand: a new module's examples run
as soon as it exists. A docstring's example is written in its module's source, so the modules
whose source holds no ``>>>`` prompt are not imported here (``callbacks.lightning`` alone took
18 s to import Lightning for no example). The entry point (``python -m sharpcli``) is left
out: it runs the CLI when imported.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sharpcli"
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages([str(PACKAGE)], "sharpcli.")
    if info.name != "sharpcli.__main__"
)


def _has_prompt(name: str) -> bool:
    """Whether the module's source holds a doctest prompt."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, name
    return ">>>" in Path(spec.origin).read_text(encoding="utf-8")


WITH_EXAMPLES = [name for name in MODULES if _has_prompt(name)]


def test_the_walk_finds_the_modules_with_examples():
    assert len(MODULES) > 100 and "sharpcli.callbacks.lightning" in MODULES
    assert {
        "sharpcli.api",
        "sharpcli.memory",
        "sharpcli.registry",
        "sharpcli.tracker",
        "sharpcli.curvature.trace.hutchinson",
    } <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False, report=True)
    assert result.attempted > 0, f"{name}: a >>> prompt outside any docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
