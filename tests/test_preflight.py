"""The preflight checks live below session and training, and build_session takes only its own
keywords (a misspelt option is a TypeError, not silently ignored)."""

from __future__ import annotations

import inspect

import pytest

from sharpcli import preflight, session
from sharpcli.cli.common import CommonOptions


def test_build_session_takes_no_stray_keywords():
    parameters = inspect.signature(session.build_session).parameters.values()
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in parameters)
    with pytest.raises(TypeError, match="unexpected keyword argument 'split_name'"):
        session.build_session("never-read.safetensors", split_name="test")


def test_the_cli_passes_exactly_what_build_session_takes():
    # what a command passes itself: the checkpoint and how it differentiates the model
    passed = {"checkpoint", "curvature", "double_backward"}
    takes = set(inspect.signature(session.build_session).parameters) - passed
    assert set(CommonOptions().settings()) == takes


def test_session_uses_the_preflight_checks():
    for name in ("check_seed", "resolve_dtype", "resolve_device", "check_second_derivatives"):
        assert getattr(session, name) is getattr(preflight, name)
    assert preflight.check_seed(7) == 7
    assert preflight.loss_for_task("regression") == "mse"
    assert preflight.loss_for_task("classification", per_position=True) == "token-cross-entropy"
