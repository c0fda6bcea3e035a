"""The examples in the docstrings of the curvature operators and estimators run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

import sharpcli.curvature.data
import sharpcli.curvature.density
import sharpcli.curvature.engine
import sharpcli.curvature.hutchpp
import sharpcli.curvature.krylov_plan
import sharpcli.curvature.operators
import sharpcli.curvature.power
import sharpcli.curvature.ritz
import sharpcli.curvature.split
import sharpcli.curvature.trace
import sharpcli.curvature.tridiagonal
import sharpcli.curvature.warm_start

# each module with the number of docstrings that hold examples
MODULES = [
    (sharpcli.curvature.data, 1),
    (sharpcli.curvature.density, 1),
    (sharpcli.curvature.engine, 1),
    (sharpcli.curvature.hutchpp, 1),
    (sharpcli.curvature.operators, 3),
    (sharpcli.curvature.power, 1),
    (sharpcli.curvature.split, 1),
    (sharpcli.curvature.trace, 2),
    (sharpcli.curvature.krylov_plan, 1),
    # the package's name `lanczos` is the function, so the module is looked up by name
    (importlib.import_module("sharpcli.curvature.lanczos"), 1),
    (sharpcli.curvature.ritz, 1),
    (sharpcli.curvature.tridiagonal, 1),
    (sharpcli.curvature.warm_start, 1),
]


@pytest.mark.parametrize("module,docstrings", MODULES, ids=[m.__name__ for m, _ in MODULES])
def test_docstring_examples_run(module, docstrings):
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(module, module.__name__) if t.examples]
    assert len(tests) >= docstrings  # the examples are still there
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= docstrings and result.failed == 0
