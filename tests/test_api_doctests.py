"""The examples in the docstrings of the in-memory API run as written (doctest)."""

from __future__ import annotations

import doctest

import pytest

import sharpcli.api
import sharpcli.tracker


@pytest.mark.parametrize(
    ("module", "examples"),
    [(sharpcli.api, 20), (sharpcli.tracker, 10)],  # Curvature and its operators; Tracker
    ids=["api", "tracker"],
)
def test_docstring_examples_run(module, examples):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted >= examples
    assert result.failed == 0
