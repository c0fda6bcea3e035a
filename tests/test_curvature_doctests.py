"""The examples in the docstrings of the curvature operators and estimators run as written."""

from __future__ import annotations

import doctest

import pytest

import sharpcli.curvature.data
import sharpcli.curvature.density
import sharpcli.curvature.engine
import sharpcli.curvature.hutchpp
import sharpcli.curvature.operators
import sharpcli.curvature.power
import sharpcli.curvature.split
import sharpcli.curvature.trace

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
