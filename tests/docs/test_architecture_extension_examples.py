"""The worked examples of docs/architecture.md run as written and compute the right numbers.

Each example is the first ``python`` block under its heading ("Adding a regularizer",
"Adding a data format"), extracted from the page and executed; then the registered toy
regularizer's gradient is checked exactly in float64 and the toy format's loaded tensors
against the records it wrote. Both are unregistered afterwards, so other tests see the stock
registries. The second block of each section is the catalogue record that makes it a
built-in: it must state what the extension registered; the regularizer's third block, the
built-in class, states none of it and reads it from the record.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli

from sharpcli.errors import InputError
from sharpcli.io.datasets import load_dataset
from sharpcli.io.formats import FORMATS
from sharpcli.specs import RegistryError
from sharpcli.training.regularizers import REGISTRY, parse_reg, register, training_step

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def example(heading: str, index: int = 0) -> str:
    """The ``index``-th ```python block of the page's ``## heading`` section."""
    text = PAGE.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)
    (section,) = [s for s in sections if s.splitlines()[0].strip() == heading]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)
    assert len(blocks) > index, f"no python block {index} under '## {heading}'"
    return blocks[index]


def run_example(heading: str, index: int = 0) -> dict:
    namespace = {"__name__": "architecture_example"}
    exec(compile(example(heading, index), f"{PAGE.name}: {heading}", "exec"), namespace)
    return namespace


@pytest.fixture
def l1_example():
    try:
        yield run_example("Adding a regularizer")
    finally:
        REGISTRY.pop("l1", None)
    assert "l1" not in REGISTRY


@pytest.fixture
def jsonl_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example writes points.jsonl in the working directory
    try:
        yield run_example("Adding a data format")
    finally:
        FORMATS.pop("jsonl", None)
    assert "jsonl" not in FORMATS


def test_l1_gradient_is_the_loss_gradient_plus_lam_sign_theta(l1_example):
    cls = REGISTRY["l1"]
    assert cls is l1_example["L1Penalty"] and cls.data_parallel is None
    lam = 0.01
    # the example's own step: its model's gradient and the reported penalty
    model, x, y = l1_example["model"], l1_example["x"].to(torch.float64), l1_example["y"]
    params = [p for p in model.parameters()]
    assert all(p.dtype == torch.float64 for p in params)
    assert l1_example["stats"].penalties["l1"] == pytest.approx(
        lam * float(sum(p.detach().abs().sum() for p in params)), rel=1e-15
    )
    produced = [p.grad.clone() for p in params]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss_grads = torch.autograd.grad(loss, params)
    for got, g, p in zip(produced, loss_grads, params):
        assert torch.equal(got, g + lam * torch.sign(p.detach()))
    # with a zero weight the subgradient there is 0, and another lam scales exactly
    with torch.no_grad():
        params[0][0, 0] = 0.0
    for p in params:
        p.grad = None
    training_step(model, x, y, "cross-entropy", [parse_reg("l1:0.25")], torch.Generator())
    loss_grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
    for g, p in zip(loss_grads, params):
        assert torch.equal(p.grad, g + 0.25 * torch.sign(p.detach()))
    assert params[0].grad[0, 0] == loss_grads[0][0, 0]


def test_l1_runs_through_sharp_train_and_data_parallel_check(l1_example, tmp_path, capsys):
    from sharpcli.training.loop import check_data_parallel_regs

    check_data_parallel_regs([parse_reg("l1")])  # declared exact: allowed under torchrun
    out = tmp_path / "l1.safetensors"
    argv = ["train", "--data", "blobs:n=64,dim=4,classes=3", "--epochs", "1", "--width", "8"]
    result = run_cli(capsys, *argv, "--reg", "l1:lam=0.001", "--out", str(out), "--json", "-")
    assert result.code == 0, result.err
    (row,) = result.json()["results"]["history"]
    assert row["penalties"]["l1"] > 0 and row["grad_evals"] == 1


def test_jsonl_format_loads_the_written_records(jsonl_example, tmp_path):
    fmt = FORMATS["jsonl"]
    assert fmt.extensions == (".jsonl",) and not fmt.directory
    data = jsonl_example["data"]
    assert data.x_train.shape == (6, 3) and data.x_train.dtype == torch.float32
    expected = torch.tensor([[i, 0.5 * i, -i] for i in range(6)], dtype=torch.float32)
    assert torch.equal(data.x_train, expected)
    assert data.y_train.tolist() == [0, 1, 2, 0, 1, 2] and data.y_train.dtype == torch.int64
    assert data.num_classes == 3 and data.task == "classification" and data.x_test is None
    assert data.spec == {
        "kind": "file",
        "path": str(tmp_path / "points.jsonl"),
        "format": "jsonl",
        "label_column": None,
    }
    assert torch.equal(load_dataset(data.spec).x_train, data.x_train)
    with pytest.raises(InputError, match="this toy format holds a train split only"):
        data.split("test")
    # integer features stay int64 (the dataset contract), and the probe routes other names
    records = tmp_path / "ids.txt"
    records.write_text("\n".join(json.dumps({"x": [i, 2 * i], "y": i % 2}) for i in range(4)))
    ids = load_dataset(str(records))
    assert ids.spec["format"] == "jsonl" and ids.x_train.dtype == torch.int64
    assert ids.x_train.tolist() == [[0, 0], [1, 2], [2, 4], [3, 6]]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"x": [1], "y": 0}\n{"x": [1, 2]\n')
    with pytest.raises(InputError, match="cannot read JSON lines"):
        load_dataset(str(broken))


def test_l1_as_a_builtin_is_its_class_plus_its_record(l1_example):
    """The record states what the extension registered; declared (as the catalogue's list
    does), the built-in class of the third block, with only its name, docstring and code,
    reads the rest from it when it is made, and computes what the extension computed."""
    record = run_example("Adding a regularizer", 1)["RECORD"]
    assert dataclasses.replace(REGISTRY.entry("l1"), impl=record.impl) == record
    extension = l1_example["L1Penalty"]
    REGISTRY.unregister("l1")
    REGISTRY.declare(record)
    try:
        lean = run_example("Adding a regularizer", 2)["L1Penalty"]
        for attr in ("summary", "HYPERPARAMS", "data_parallel", "kind", "needs_penultimate"):
            assert attr not in vars(extension) or attr in (
                "summary",
                "HYPERPARAMS",
                "data_parallel",
            )
            assert vars(lean)[attr] == getattr(extension, attr), attr
        assert (lean.summary, lean.HYPERPARAMS) == (record.summary, record.params)
        assert register(lean) is lean and REGISTRY["l1"] is lean
        assert parse_reg("l1:0.5").params == {"lam": 0.5}
        with pytest.raises(RegistryError, match="lam must be >= 0"):
            parse_reg("l1:-1")
        params = [torch.tensor([0.5, -2.0, 0.0], dtype=torch.float64)]
        for got, want in zip(
            parse_reg("l1:0.25").analytic_grad(params), extension(lam=0.25).analytic_grad(params)
        ):
            assert torch.equal(got, want)
        # a class that states an attribute differently from its record is refused
        REGISTRY.unregister("l1")
        with pytest.raises(RegistryError, match="summary 'other' differs from its catalogue"):
            register(type("L1Penalty", (lean,), {"summary": "other", "__doc__": lean.__doc__}))
    finally:
        REGISTRY.undeclare("l1")
    assert "l1" not in REGISTRY


def test_jsonl_record_states_what_the_extension_registered(jsonl_example):
    record = run_example("Adding a data format", 1)["RECORD"]
    entry, fmt = FORMATS.entry("jsonl"), FORMATS["jsonl"]
    assert (record.name, record.summary) == (entry.name, entry.summary)
    assert {k: record.info[k] for k in entry.info} == entry.info
    assert record.info["extensions"] == fmt.extensions and record.impl == "sharpcli.io.formats"
    for key in ("probe", "read"):
        module, _, attr = record.info[key].partition(":")
        assert module.startswith("sharpcli.io.") and attr == getattr(fmt, key).__name__


def test_examples_leave_the_registries_as_they_were(tmp_path):
    assert "l1" not in REGISTRY and "jsonl" not in FORMATS
    stray = tmp_path / "points.jsonl"
    stray.write_text('{"x": [1], "y": 0}\n')
    with pytest.raises(InputError, match="unknown data file extension '.jsonl'"):
        load_dataset(str(stray))
