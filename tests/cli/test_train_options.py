"""``train``'s options declared once (sharpcli/cli/train_options.py) and ``sweep``'s subset of
them; the dataclass-of-options machinery (sharpcli/cli/declared.py)."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Annotated

import pytest
import typer
import typer.main

from sharpcli.cli import declared
from sharpcli.cli.app import app
from sharpcli.cli.train_options import SWEEP_OPTIONS, TrainOptions
from sharpcli.errors import UsageError
from sharpcli.training.config import TrainConfig, validate_config


def _params(command: str) -> dict:
    group = typer.main.get_command(app)
    return {p.name: p for p in group.commands[command].params}


def test_default_options_make_the_default_configuration():
    assert TrainOptions().config().to_dict() == TrainConfig().to_dict()


def test_options_set_their_fields_and_fold_the_model_and_data_options(tmp_path):
    (tmp_path / "d.npz").write_bytes(b"")  # only its name is read here
    opts = TrainOptions(
        depth=3,
        per_sample_norm=True,
        model_args='{"bias": false}',
        regs=["wd:0.1"],
        track="eigen, trace",
        data=str(tmp_path / "d.npz"),
        x_key="inputs",
        epochs=2,
    )
    cfg = opts.config()
    assert cfg.model_args == {"bias": False, "per_sample_norm": True, "depth": 3}
    assert [r.spec() for r in cfg.regs] == ["wd:sigma=0.1"]
    assert cfg.track == ["eigen", "trace"] and cfg.epochs == 2
    assert isinstance(cfg.data, dict) and cfg.data["x_key"] == "inputs"
    with pytest.raises(UsageError, match="not both"):
        TrainOptions(model="cnn", model_factory="m:f").config()


def test_sweep_shares_train_declarations_with_its_own_helps():
    train, sweep = _params("train"), _params("sweep")
    for name in SWEEP_OPTIONS.names or ():
        assert sweep[name].opts == train[name].opts, name
        assert sweep[name].default == train[name].default, name
    assert sweep["epochs"].help == "Epochs per run." != train["epochs"].help
    # train-only settings are sweep's --set, not options
    assert "momentum" in train and "momentum" not in sweep


def test_config_values_are_checked_against_the_field_types():
    cases = [
        ("epochs", "abc", "must be an integer, got 'abc'"),
        ("epochs", True, "must be an integer, got True"),
        ("lr", [1], "must be a number, got [1]"),
        ("input_noise", float("nan"), "must be a finite number"),
        ("augment", 1, "must be true or false"),
        ("label_column", 3, "must be a string, got 3"),
        ("data", 3, "must be a string or a dict, got 3"),
        ("track", ["eigen", 1], "must be a list of strings"),
        ("regs", ["wd"], "must be parsed regularizers"),
    ]
    for name, value, message in cases:
        cfg = TrainConfig()
        setattr(cfg, name, value)
        with pytest.raises(UsageError, match=re.escape(message)) as info:
            validate_config(cfg)
        assert info.value.source == name
    cfg = TrainConfig(lr=1, loss="cross-entropy")  # an integer is a number; None or a string
    validate_config(cfg)


@dataclass
class _Opts:
    size: int = declared.option(Annotated[int, typer.Option("--size")], 3)
    name: str = declared.option(Annotated[str, typer.Option("--name")], "x")


def test_with_options_expands_and_rebuilds_the_dataclass():
    received = {}

    def command(first: int, opts: _Opts, last: str = "z") -> None:
        received.update(first=first, opts=opts, last=last)

    wrapped = declared.with_options(opts=declared.OptionSet(_Opts, names=("name",)))(command)
    assert list(inspect.signature(wrapped).parameters) == ["first", "name", "last"]
    wrapped(first=1, name="y", last="w")
    assert received == {"first": 1, "opts": _Opts(size=3, name="y"), "last": "w"}

    def clash(name: str, opts: _Opts) -> None:
        pass

    with pytest.raises(TypeError, match="declared twice: name"):
        declared.with_options(opts=_Opts)(clash)
    with pytest.raises(TypeError, match="declares no option colour"):
        declared.OptionSet(_Opts, names=("colour",)).fields()
