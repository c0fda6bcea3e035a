"""Checkpoints as researchers save them: training-checkpoint dicts, DDP ``module.``, Lightning
``.ckpt``, ``torch.compile``'s ``_orig_mod.``, float16/bfloat16 weights and tied weights.

Each layout is written by hand (``torch.save``/``safetensors``, no Lightning dependency) from
a tiny model that a ``--model-factory`` module in ``tmp_path`` builds, then

- loaded by the library: the logits are ``torch.equal`` to the original model's (float32),
  or close for half-precision weights, and the notes say what was done;
- run through the CLI (``sharp eigen ... --json -``): exit 0, the checkpoint's notes in the
  report's ``checkpoint.notes`` and on stderr.

Files that fit no reading of their keys (or fit two readings that disagree) exit 2 with one
line naming the file, a sample of the keys found and of the keys the model expects.
"""

from __future__ import annotations

import argparse
import textwrap

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from safetensors.torch import save_file, save_model

from fixtures.make_checkpoint_fixtures import lightning_checkpoint as lightning
from fixtures.make_checkpoint_fixtures import prefixed, tiny_mlp_spec
from sharpcli.errors import InputError
from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.models import build_model

DATA = "blobs:n=40,dim=8,classes=3"

FACTORY = textwrap.dedent(
    '''
    """Users' model definitions, importable as --model-factory layoutmodels:NAME."""
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self, d_in=8, hidden=6, classes=3):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh())
            self.head = nn.Linear(hidden, classes)

        def forward(self, x):
            return self.head(self.body(x))


    class Tied(nn.Module):
        """The decoder reuses the encoder's weight: state_dict names it twice."""

        def __init__(self, d=8, classes=3):
            super().__init__()
            self.enc = nn.Linear(d, d)
            self.dec = nn.Linear(d, d)
            self.dec.weight = self.enc.weight
            self.head = nn.Linear(d, classes)

        def forward(self, x):
            return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x)))))


    class Wrapped(nn.Module):
        """A wrapper whose state_dict keys all start with 'net.' (the file's do not)."""

        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)


    def build(**kwargs):
        return Net(**kwargs)


    def build_tied():
        return Tied()


    def build_wrapped():
        return Wrapped()
    '''
)


@pytest.fixture
def factory(tmp_path, monkeypatch):
    """The module ``layoutmodels`` importable from tmp_path (the CLI also looks in the cwd)."""
    import importlib
    import sys

    (tmp_path / "layoutmodels.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("layoutmodels", None)
    return importlib.import_module("layoutmodels")


def optimizer_state(model) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return opt.state_dict()


# name -> (file name, how the file holds the state_dict sd of the model m, the note it must give)
LAYOUTS = {
    "plain": ("plain.pt", lambda sd, m: sd, None),
    "epoch-state_dict-optimizer": (
        "train.pth",
        lambda sd, m: {"epoch": 3, "state_dict": sd, "optimizer": optimizer_state(m)},
        "'state_dict' entry",
    ),
    "model_state_dict": (
        "tutorial.pt",
        lambda sd, m: {
            "epoch": 3,
            "model_state_dict": sd,
            "optimizer_state_dict": optimizer_state(m),
            "loss": 0.25,
        },
        "'model_state_dict' entry",
    ),
    "model-entry": (
        "other.pt",
        lambda sd, m: {"model": sd, "optimizer": optimizer_state(m), "epoch": 9},
        "'model' entry",
    ),
    "ddp-module-prefix": ("ddp.pt", lambda sd, m: prefixed(sd, "module."), "'module.' stripped"),
    "lightning-ckpt": ("last.ckpt", lambda sd, m: lightning(sd), "'model.' stripped"),
    "lightning-other-attribute": (
        "epoch=4-step=120.ckpt",
        lambda sd, m: lightning(sd, "classifier."),
        "'classifier.' stripped",
    ),
    "torch-compile-prefix": (
        "compiled.safetensors",
        lambda sd, m: prefixed(sd, "_orig_mod."),
        "'_orig_mod.' stripped",
    ),
    "ddp-of-compiled-in-dict": (
        "both.pt",
        lambda sd, m: {"epoch": 1, "model_state_dict": prefixed(sd, "module._orig_mod.")},
        "'module._orig_mod.' stripped",
    ),
    "pth-tar": (
        "model_best.pth.tar",
        lambda sd, m: {"epoch": 90, "arch": "net", "state_dict": prefixed(sd, "module.")},
        "'module.' stripped",
    ),
}


def write(path, payload) -> None:
    if str(path).endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in payload.items()}, str(path))
    else:
        torch.save(payload, str(path))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_loads_the_exact_weights(layout, factory, tmp_path, capsys):
    name, wrap, note = LAYOUTS[layout]
    torch.manual_seed(0)
    model = factory.build()
    path = tmp_path / name
    write(path, wrap(model.state_dict(), model))
    x = torch.randn(11, 8)

    loaded = load_checkpoint(path, model_factory="layoutmodels:build")
    assert torch.equal(loaded.model(x), model(x))
    if note is None:
        assert loaded.notes == []
    else:
        assert len(loaded.notes) == 1 and note in loaded.notes[0] and str(path) in loaded.notes[0]

    run = run_cli(
        capsys,
        "eigen",
        path,
        "--model-factory",
        "layoutmodels:build",
        "--data",
        DATA,
        "--max-matvecs",
        "8",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    report = run.json()
    assert report["checkpoint"].get("notes", []) == loaded.notes
    assert "notes" not in report["data"]  # the checkpoint's notes are not the data's
    if note is not None:
        assert f"sharp: note: {loaded.notes[0]}" in run.err


def test_lightning_ckpt_with_a_zoo_arch(tmp_path, capsys):
    """``--arch mlp --arch-args`` reads a Lightning file whose module holds the MLP as ``net``."""
    spec = tiny_mlp_spec(d_in=8, classes=3, width=5)
    torch.manual_seed(1)
    model = build_model(spec)
    path = tmp_path / "mlp.ckpt"
    torch.save(lightning(model.state_dict(), "net."), str(path))
    loaded = load_checkpoint(path, arch="mlp", arch_args=spec["args"])
    x = torch.randn(6, 8)
    assert torch.equal(loaded.model(x), model(x))
    import json

    run = run_cli(
        capsys,
        "trace",
        path,
        "--arch",
        "mlp",
        "--arch-args",
        json.dumps(spec["args"]),
        "--data",
        DATA,
        "--quiet",
    )
    assert run.code == 0, run.err


def test_model_side_prefix_is_added(factory, tmp_path):
    """A factory that wraps the network (keys ``net.*``) reads the bare network's weights."""
    torch.manual_seed(2)
    bare = factory.build()
    path = tmp_path / "bare.safetensors"
    write(path, bare.state_dict())
    loaded = load_checkpoint(path, model_factory="layoutmodels:build_wrapped")
    x = torch.randn(4, 8)
    assert torch.equal(loaded.model(x), bare(x))
    assert "'net.' (the model's) added" in loaded.notes[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_half_precision_weights_are_cast_with_a_note(dtype, suffix, factory, tmp_path, capsys):
    torch.manual_seed(3)
    model = factory.build()
    half = {k: v.to(dtype) for k, v in model.state_dict().items()}
    path = tmp_path / f"half{suffix}"
    write(path, prefixed(half, "module."))
    loaded = load_checkpoint(path, model_factory="layoutmodels:build")
    # the loaded weights are the file's values exactly, in the model's float32
    for name, value in loaded.model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, half[name].float())
    x = torch.randn(9, 8)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(loaded.model(x), model(x), atol=tolerance, rtol=tolerance)
    name = str(dtype).replace("torch.", "")
    assert any(f"stored as {name} (4 of 4 tensors)" in n for n in loaded.notes), loaded.notes

    run = run_cli(
        capsys,
        "eigen",
        path,
        "--model-factory",
        "layoutmodels:build",
        "--data",
        DATA,
        "--max-matvecs",
        "8",
        "--dtype",
        "float64",
    )
    assert run.code == 0, run.err
    assert f"stored as {name}" in run.err and "cast to the analysis dtype" in run.err


def test_tied_weights_load_with_both_names_one_name_and_not_with_two_values(factory, tmp_path):
    torch.manual_seed(4)
    model = factory.build_tied()
    x = torch.randn(5, 8)
    state = model.state_dict()
    assert "enc.weight" in state and "dec.weight" in state  # state_dict names a tied weight twice

    both = tmp_path / "both.pt"
    torch.save(prefixed(state, "module."), str(both))
    one = tmp_path / "one.safetensors"
    save_model(model, str(one))  # safetensors keeps one name of a shared tensor
    for path in (both, one):
        loaded = load_checkpoint(path, model_factory="layoutmodels:build_tied")
        assert torch.equal(loaded.model(x), model(x)), path
        assert loaded.model.dec.weight is loaded.model.enc.weight  # still tied

    differ = {k: v.clone() for k, v in state.items()}
    differ["dec.weight"][0, 0] += 1.0
    path = tmp_path / "differ.pt"
    torch.save(differ, str(path))
    with pytest.raises(InputError, match="tied weights enc.weight and dec.weight") as info:
        load_checkpoint(path, model_factory="layoutmodels:build_tied")
    assert info.value.source == str(path)


def test_mismatched_file_names_the_keys_found_and_expected(factory, tmp_path, capsys):
    torch.manual_seed(5)
    other = torch.nn.Sequential(
        torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)
    )
    path = tmp_path / "other.ckpt"
    torch.save(lightning(other.state_dict()), str(path))
    run = run_cli(capsys, "eigen", path, "--model-factory", "layoutmodels:build", "--data", DATA)
    assert_one_line_error(
        run,
        2,
        str(path),
        "does not match the model",
        "holds 6 keys (model.0.weight, model.0.bias, model.2.weight, model.2.bias, "
        "model.3.weight, ...)",
        "the model expects 4 (body.0.weight, body.0.bias, head.weight, head.bias)",
    )


def test_prefix_is_not_stripped_unless_every_key_has_it(factory, tmp_path, capsys):
    """A LightningModule that also saved a loss weight: 'model.' fits, but not every key has it."""
    torch.manual_seed(6)
    model = factory.build()
    payload = lightning(model.state_dict())
    payload["state_dict"]["loss_fn.weight"] = torch.ones(3)
    path = tmp_path / "with_loss.ckpt"
    torch.save(payload, str(path))
    run = run_cli(capsys, "eigen", path, "--model-factory", "layoutmodels:build", "--data", DATA)
    assert_one_line_error(
        run,
        2,
        str(path),
        "holds 5 keys",
        "the 4 keys under 'model.' would fit, but 1 other key (loss_fn.weight) does not",
    )


def test_two_entries_that_fit_with_different_weights_are_ambiguous(factory, tmp_path):
    torch.manual_seed(7)
    first, second = factory.build(), factory.build()
    path = tmp_path / "two.pt"
    torch.save({"state_dict": first.state_dict(), "model": second.state_dict()}, str(path))
    with pytest.raises(InputError, match="is ambiguous: the 'state_dict' entry and the 'model'"):
        load_checkpoint(path, model_factory="layoutmodels:build")
    # the same weights under two names are not ambiguous
    torch.save({"state_dict": first.state_dict(), "model": first.state_dict()}, str(path))
    x = torch.randn(3, 8)
    assert torch.equal(load_checkpoint(path, model_factory="layoutmodels:build").model(x), first(x))


@pytest.mark.parametrize(
    "payload, needles",
    [
        (
            {"epoch": 3, "optimizer": {"state": {}, "param_groups": []}},
            ("does not hold a state_dict", "2 entries (epoch, optimizer)", "model_state_dict"),
        ),
        ({0: torch.zeros(2)}, ("does not hold a state_dict",)),
        ([torch.zeros(2)], ("does not hold a state_dict", "list")),
        (
            {"bad\nkey\x1b[31m": torch.zeros(2)},
            ("does not match the model", "'bad\\nkey\\x1b[31m'"),
        ),
    ],
    ids=["no-weights-entry", "integer-keys", "list", "control-characters-in-key"],
)
def test_files_without_usable_weights_exit_2(payload, needles, factory, tmp_path, capsys):
    path = tmp_path / "bad.pt"
    torch.save(payload, str(path))
    run = run_cli(capsys, "eigen", path, "--model-factory", "layoutmodels:build", "--data", DATA)
    assert_one_line_error(run, 2, str(path), *needles)
    assert "\x1b" not in run.err


def test_pickled_hyper_parameters_need_trust_pickle(factory, tmp_path):
    """A Lightning file whose hyper_parameters hold an argparse.Namespace is not weights only."""
    torch.manual_seed(8)
    model = factory.build()
    payload = lightning(model.state_dict())
    payload["hyper_parameters"] = {"args": argparse.Namespace(lr=0.1)}
    path = tmp_path / "namespace.ckpt"
    torch.save(payload, str(path))
    with pytest.raises(InputError, match=r"pickled Python object \(argparse.Namespace\)"):
        load_checkpoint(path, model_factory="layoutmodels:build")
    loaded = load_checkpoint(path, model_factory="layoutmodels:build", trust_pickle=True)
    x = torch.randn(3, 8)
    assert torch.equal(loaded.model(x), model(x))
