"""The penalty protocol: one class per regularizer mode, picked at parse time, each declaring
its needs in one frozen ``PenaltyNeeds`` record; ``TrainConfig`` parses its regularizers once
and ``train``/``sweep`` build it through one ``config_from_options``."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from sharpcli.errors import UsageError
from sharpcli.regularizers.base import family_of
from sharpcli.regularizers.passes import PenaltyNeeds
from sharpcli.regularizers.penalties.flatness import (
    ExactFlatnessAware,
    FiniteDifferenceFlatnessAware,
    FlatnessAware,
)
from sharpcli.regularizers.penalties.nme import (
    ExactGradientPenalty,
    ExactHessianTrace,
    FiniteDifferenceGradientPenalty,
    FiniteDifferenceHessianTrace,
    GradientPenalty,
    HessianTrace,
)
from sharpcli.regularizers.registry import REGISTRY, data_parallel_refusal, parse_reg
from sharpcli.training import loop
from sharpcli.training.config import TrainConfig, config_from_options

MODES = [
    ("gp", GradientPenalty, {"exact": ExactGradientPenalty, "fd": FiniteDifferenceGradientPenalty}),
    (
        "hessian-trace",
        HessianTrace,
        {"exact": ExactHessianTrace, "fd": FiniteDifferenceHessianTrace},
    ),
    ("fa", FlatnessAware, {"exact": ExactFlatnessAware, "fd": FiniteDifferenceFlatnessAware}),
]


@pytest.mark.parametrize("name, family, classes", MODES)
def test_each_mode_is_its_own_class_chosen_when_parsed(name, family, classes):
    assert REGISTRY[name] is family
    assert type(parse_reg(name)) is classes["exact"]  # the default mode
    for mode, cls in classes.items():
        for text in (f"{name}:mode={mode}", f"{name}:mode={mode.upper()}"):
            reg = parse_reg(text)
            assert type(reg) is cls and isinstance(reg, family) and cls.mode == mode
            assert reg.params["mode"] == mode and parse_reg(reg.spec()) == reg
            # a copy keeps its class (copy/deepcopy call __new__ without the parameters)
            assert type(copy.deepcopy(reg)) is cls and copy.copy(reg) == reg
            # a mode class answers with its family's data-parallel verdict, stated once there
            assert family_of(cls) is family and "data_parallel" in vars(family)
            assert data_parallel_refusal(reg) == family.data_parallel


def test_a_bad_mode_is_reported_in_hyper_parameter_order():
    with pytest.raises(UsageError, match="rho must be >= 0"):
        parse_reg("gp:rho=-1,mode=bogus")
    with pytest.raises(UsageError, match="mode must be one of exact, fd; got 'bogus'"):
        parse_reg("gp:mode=bogus")
    with pytest.raises(TypeError, match="computes gp mode=fd, not mode=exact"):
        FiniteDifferenceGradientPenalty(mode="exact")


def test_needs_are_one_frozen_record_per_class():
    expected = {
        "wd": PenaltyNeeds(),
        "ad": PenaltyNeeds(),
        "gp": PenaltyNeeds(autograd=True, loss_grad_graph="to_differentiate"),
        "gp:mode=fd": PenaltyNeeds(autograd=True, extra_passes=True),
        "hessian-trace": PenaltyNeeds(autograd=True, loss_grad_graph="always"),
        "hessian-trace:mode=fd": PenaltyNeeds(extra_passes=True, deferred_value=True),
        "gn-trace": PenaltyNeeds(autograd=True),
        "fa": PenaltyNeeds(autograd=True, loss_grad_graph="always"),
        "fa:mode=fd": PenaltyNeeds(extra_passes=True, deferred_value=True),
    }
    for spec, needs in expected.items():
        reg = parse_reg(spec)
        assert reg.needs == needs, spec
        # a penalty with needs of its own declares them in its own class body
        assert spec in ("wd", "ad") or "needs" in vars(type(reg)), spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_reg("gp").needs.autograd = False  # type: ignore[misc]


@pytest.mark.parametrize(
    "graph, want_grad, kept",
    [
        ("never", True, False),
        ("to_differentiate", False, False),
        ("to_differentiate", True, True),
        ("always", False, True),
    ],
)
def test_the_loss_gradient_keeps_its_graph_as_declared(graph, want_grad, kept):
    assert PenaltyNeeds(loss_grad_graph=graph).keeps_loss_grad_graph(want_grad) is kept


def test_needs_refuse_an_inconsistent_record():
    with pytest.raises(ValueError, match="set extra_passes"):
        PenaltyNeeds(deferred_value=True)
    with pytest.raises(ValueError, match="not a known mode"):
        PenaltyNeeds(loss_grad_graph="sometimes")  # type: ignore[arg-type]


def test_train_config_parses_and_checks_its_regularizers_once():
    cfg = TrainConfig(regs=["wd:0.1", "gp:mode=fd"])
    assert [type(r).__name__ for r in cfg.regs] == [
        "WeightDecay",
        "FiniteDifferenceGradientPenalty",
    ]
    assert cfg.to_dict()["regs"] == ["wd:sigma=0.1", "gp:rho=0.01,p=1,mode=fd,eps=0.001"]
    assert TrainConfig(regs=cfg.regs).regs == cfg.regs  # parsed objects pass through
    with pytest.raises(UsageError, match="at most one perturbation"):
        TrainConfig(regs=["sam", "nso"])
    with pytest.raises(UsageError, match="wd given more than once"):
        TrainConfig(regs=["wd", "wd:0.2"])
    cfg.regs = ["wd"]  # set after construction: never parsed, so refused rather than re-parsed
    with pytest.raises(UsageError, match="must be parsed regularizers"):
        loop.validate_config(cfg)


def test_config_from_options_puts_the_size_options_into_model_args():
    cfg = config_from_options(
        model_args={"per_sample_norm": True}, depth=2, width=None, activation="gelu", epochs=3
    )
    assert cfg.model_args == {"per_sample_norm": True, "depth": 2, "activation": "gelu"}
    assert cfg.epochs == 3 and [r.name for r in cfg.regs] == ["none"]
    for option in ("depth", "width"):
        with pytest.raises(UsageError) as info:
            config_from_options(**{option: 0})
        assert info.value.source == option
    with pytest.raises(TypeError, match="not a training setting: colour"):
        config_from_options(colour="red")
