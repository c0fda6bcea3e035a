"""The examples in the docstrings of the model zoo, its specs and activations run as written."""

from __future__ import annotations

import doctest

import pytest

import sharpcli.models.activation_functions
import sharpcli.models.activations
import sharpcli.models.outputs
import sharpcli.models.specs
import sharpcli.models.state_size
import sharpcli.models.zoo

# each module with the number of docstrings that hold examples
MODULES = [
    (sharpcli.models.activation_functions, 1),
    (sharpcli.models.activations, 1),
    (sharpcli.models.outputs, 1),
    (sharpcli.models.specs, 2),
    (sharpcli.models.state_size, 1),
    (sharpcli.models.zoo, 1),
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
