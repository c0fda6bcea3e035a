"""The examples in the docstrings of the in-memory API run as written (doctest)."""

from __future__ import annotations

import doctest

import pytest

import sharpcli.api


@pytest.mark.parametrize("module", [sharpcli.api])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted >= 20  # the Curvature, operator and Tracker examples
    assert result.failed == 0
