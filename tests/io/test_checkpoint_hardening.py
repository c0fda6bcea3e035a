"""Checkpoint metadata cannot make the tool allocate absurdly, recurse, or fail with exit 4.

An own checkpoint's ``sharpcli.model`` metadata (and ``--arch-args``) decides what
``build_model`` allocates; before this hardening ``depth=200000`` took 117 s and 1.8 GB before a
refusal and ``width=10**9`` was an internal error (exit 4) after trying to allocate 64 GB. The
model is now sized from its arguments (:func:`sharpcli.models.estimate_state_size`, exact,
checked here against real builds) and refused against what the file stores before anything is
built. Deeply nested or wrongly typed metadata values are input errors naming the file.

The table runs in one subprocess whose address space is capped (``RLIMIT_AS``: what the
process holds after importing torch and sharpcli, plus :data:`HEADROOM`), each row through the
real CLI entry point, so a regression that allocates fails (``MemoryError``/exit 4) instead of
eating the machine, and a slow one fails on its recorded time or the subprocess timeout.
Every row must exit 2 with one line naming the checkpoint; a valid checkpoint under the same
cap (the first row) proves the cap leaves room for a normal run.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.io.checkpoints import META_DATA, META_METRICS, META_MODEL, META_TRAIN
from sharpcli.models import build_model, estimate_state_size

ROOT = Path(__file__).resolve().parents[2]
HEADROOM = 768 << 20  # bytes of address space a row may add to the imported interpreter
ROW_SECONDS = 15.0  # a refusal takes milliseconds; the old depth=200000 build took 117 s
BATCH_TIMEOUT = 400

TINY_MLP = tiny_mlp_spec()  # 16 -> 8 -> 4: 172 values in 4 tensors
ARGS = TINY_MLP["args"]


# ------------------------------------------------------------------------------- the estimate
def _grid():
    for depth, width, bias, ratio, norm in itertools.product(
        [0, 1, 3], [1, 5], [True, False], [0.0, 0.5], [False, True]
    ):
        yield {
            "name": "mlp",
            "args": {
                "in_features": 7,
                "num_classes": 3,
                "depth": depth,
                "width": width,
                "bias": bias,
                "mask_ratio": ratio,
                "per_sample_norm": norm,
            },
        }
    for channels, bn, size, ratio in itertools.product(
        [[4], [3, 5], [2, 2, 2]], [False, True], [8, [9, 13]], [0.0, 0.3]
    ):
        yield {
            "name": "cnn",
            "args": {
                "in_channels": 2,
                "image_size": size,
                "num_classes": 3,
                "channels": channels,
                "batch_norm": bn,
                "mask_ratio": ratio,
            },
        }
    for mult, bn, size, ratio in itertools.product(
        [0.05, 0.1], [False, True], [4, [3, 17]], [0.0, 0.3]
    ):
        yield {
            "name": "vgg-small",
            "args": {
                "in_channels": 3,
                "image_size": size,
                "num_classes": 5,
                "width_multiplier": mult,
                "batch_norm": bn,
                "mask_ratio": ratio,
            },
        }
    for depth, width, size, ratio, norm in itertools.product(
        [8, 14], [1, 3], [8, [7, 5], 1], [0.0, 0.3], [False, True]
    ):
        yield {
            "name": "resnet",
            "args": {
                "in_channels": 3,
                "image_size": size,
                "num_classes": 4,
                "depth": depth,
                "width": width,
                "mask_ratio": ratio,
                "per_sample_norm": norm,
            },
        }


def test_estimate_is_exact_for_every_zoo_architecture():
    """Tensors and values of the real state_dict (parameters, BatchNorm buffers, masks), equal."""
    specs = list(_grid())
    assert {s["name"] for s in specs} == {"mlp", "cnn", "vgg-small", "resnet"}
    for spec in specs:
        state = build_model(spec).state_dict()
        real = (len(state), sum(t.numel() for t in state.values()))
        assert tuple(estimate_state_size(spec)) == real, spec


def test_estimate_of_absurd_arguments_is_instant():
    """Python integers, no loop over depth: even 10**300-layer specs are sized in microseconds."""
    huge = [
        {"name": "mlp", "args": {**ARGS, "depth": 10**300, "width": 10**300}},
        {"name": "resnet", "args": {"in_channels": 3, "image_size": 10**9, "num_classes": 10,
                                    "depth": 6 * 10**300 + 2, "width": 10**200}},
        {"name": "cnn", "args": {"in_channels": 3, "image_size": 2**40, "num_classes": 10,
                                 "channels": [10**9] * 40, "mask_ratio": 0.5}},
        {"name": "vgg-small", "args": {"in_channels": 3, "image_size": 32, "num_classes": 10,
                                       "width_multiplier": 1e300}},
    ]  # fmt: skip
    start = time.perf_counter()
    for spec in huge:
        assert estimate_state_size(spec).values > 2**31
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Row:
    """One hostile checkpoint: its metadata (``None`` deletes a key) or ``--arch-args``."""

    id: str
    meta: dict | None = None  # replaces keys of a valid own checkpoint's metadata
    arch_args: dict | str | None = None  # a foreign file read with --arch mlp --arch-args
    needles: tuple[str, ...] = ()
    code: int = 2


def model_meta(**args) -> str:
    return json.dumps({"name": "mlp", "args": {**ARGS, **args}})


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


ROWS = [
    Row("control-valid-own-checkpoint", meta={}, code=0),
    Row("control-valid-foreign-with-arch", arch_args=ARGS, code=0),
    Row("mlp-depth-200000", {META_MODEL: model_meta(depth=200000)}, needles=("400,002 tensors",)),
    Row("mlp-width-1e9", {META_MODEL: model_meta(width=10**9)}, needles=("limit of 2**31",)),
    Row("mlp-width-400-digits", {META_MODEL: model_meta(width=10**400)}, needles=("10^40",)),
    Row("mlp-depth-width-1e300", {META_MODEL: model_meta(depth=10**300, width=10**300)}),
    Row("mlp-width-1e400-float", {META_MODEL: model_meta(width=1e400)}, needles=("integer",)),
    Row(
        "cnn-million-channels",
        {
            META_MODEL: json.dumps(
                {
                    "name": "cnn",
                    "args": {
                        "in_channels": 1,
                        "image_size": 4,
                        "num_classes": 4,
                        "channels": [10**6, 10**6],
                    },
                }
            )
        },
        needles=("refusing to build",),
    ),  # fmt: skip
    Row(
        "cnn-huge-image-masked",
        {
            META_MODEL: json.dumps(
                {
                    "name": "cnn",
                    "args": {
                        "in_channels": 1,
                        "image_size": 10**5,
                        "num_classes": 4,
                        "channels": [4],
                        "mask_ratio": 0.5,
                    },
                }
            )
        },
        needles=("refusing to build",),
    ),  # fmt: skip
    Row(
        "cnn-30000-blocks",
        {
            META_MODEL: json.dumps(
                {
                    "name": "cnn",
                    "args": {
                        "in_channels": 1,
                        "image_size": 8,
                        "num_classes": 4,
                        "channels": [1] * 30000,
                    },
                }
            )
        },
        needles=("2**30000 pixels a side",),
    ),  # fmt: skip
    Row(
        "vgg-small-width-multiplier-1000",
        {
            META_MODEL: json.dumps(
                {
                    "name": "vgg-small",
                    "args": {
                        "in_channels": 3,
                        "image_size": 8,
                        "num_classes": 4,
                        "width_multiplier": 1000,
                    },
                }
            )
        },
        needles=("limit of 2**31",),
    ),  # fmt: skip
    Row(
        "resnet-depth-600002",
        {
            META_MODEL: json.dumps(
                {
                    "name": "resnet",
                    "args": {"in_channels": 3, "image_size": 8, "num_classes": 4, "depth": 600002},
                }
            )
        },
        needles=("refusing to build",),
    ),  # fmt: skip
    Row(
        "resnet-width-100000",
        {
            META_MODEL: json.dumps(
                {
                    "name": "resnet",
                    "args": {"in_channels": 3, "image_size": 8, "num_classes": 4, "width": 100000},
                }
            )
        },
        needles=("limit of 2**31",),
    ),  # fmt: skip
    Row("arch-args-width-1e9", arch_args={**ARGS, "width": 10**9}, needles=("--arch-args",)),
    Row("arch-args-depth-200000", arch_args={**ARGS, "depth": 200000}, needles=("--arch-args",)),
    Row("model-nested-100000", {META_MODEL: "[" * 100000 + "]" * 100000}, needles=("nested",)),
    Row("train-nested-40", {META_TRAIN: nested(40)}, needles=(META_TRAIN, "nested")),
    Row("data-nested-5000", {META_DATA: nested(5000)}, needles=(META_DATA, "nested")),
    Row("train-list", {META_TRAIN: "[1,2]"}, needles=(META_TRAIN, "must be an object")),
    Row("model-number", {META_MODEL: "5"}, needles=(META_MODEL, "must be an object")),
    Row("model-nan", {META_MODEL: "NaN"}, needles=(META_MODEL, "must be an object")),
    Row("model-string", {META_MODEL: '"mlp"'}, needles=(META_MODEL, "a string")),
    Row("metrics-string", {META_METRICS: '"x"'}, needles=(META_METRICS,)),
    Row("data-list", {META_DATA: "[1]"}, needles=(META_DATA, "an object or a string")),
    Row(
        "model-5000-digit-integer",
        {META_MODEL: '{"name": "mlp", "args": {"width": 1' + "0" * 5000 + "}}"},
        needles=(META_MODEL, "too long"),
    ),
]


def _write_files(folder: Path) -> dict[str, list[str]]:
    """Each row's file and command line."""
    from safetensors import safe_open

    own = write_own_checkpoint(folder / "own.safetensors", spec=TINY_MLP)
    with safe_open(str(own), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    argvs = {}
    for row in ROWS:
        path = folder / f"{row.id}.safetensors"
        if row.arch_args is not None:
            save_file(tensors, str(path))
            extra = ["--arch", "mlp", "--arch-args", json.dumps(row.arch_args), "--data", "blobs"]
        else:
            changed = {**meta, **row.meta}
            save_file(tensors, str(path), metadata={k: v for k, v in changed.items() if v})
            extra = []
        argvs[row.id] = ["eigen", str(path), *extra, "--samples", "32", "--max-matvecs", "4"]
    return argvs


RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, re, resource, sys, time

    import torch, safetensors.torch  # noqa: F401  (imported before the cap is measured)
    import sharpcli.session, sharpcli.curvature  # noqa: F401
    from sharpcli.cli.app import main

    status = open("/proc/self/status").read()
    held = int(re.search(r"VmSize:\\s+(\\d+)", status).group(1)) * 1024
    cap = held + int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    argvs = json.load(open(sys.argv[1]))
    with open(sys.argv[2], "a") as out:
        for row_id, argv in argvs.items():
            err = io.StringIO()
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                try:
                    main(argv)
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException as exc:  # MemoryError under the cap: a regression
                    code = type(exc).__name__
            seconds = time.perf_counter() - start
            record = {"id": row_id, "code": code, "err": err.getvalue(), "seconds": seconds}
            out.write(json.dumps(record) + "\\n")
            out.flush()
    """
)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    """Run every row in one address-space-capped subprocess; row id -> code, stderr, seconds."""
    folder = tmp_path_factory.mktemp("hostile_checkpoints")
    argvs = _write_files(folder)
    (folder / "argvs.json").write_text(json.dumps(argvs))
    results = folder / "results.jsonl"
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, str(folder / "argvs.json"), str(results), str(HEADROOM)],
            capture_output=True,
            text=True,
            timeout=BATCH_TIMEOUT,
            env=env,
            cwd=folder,
        )
        crashed = proc.returncode != 0 and f"runner exit {proc.returncode}: {proc.stderr[-400:]}"
    except subprocess.TimeoutExpired:
        crashed = f"runner timed out after {BATCH_TIMEOUT} s"
    lines = results.read_text().splitlines() if results.exists() else []
    found = {record["id"]: record for record in map(json.loads, lines)}
    for row_id in argvs:  # rows never reached: the one after the last recorded hung or crashed
        found.setdefault(row_id, {"code": None, "err": crashed or "not run", "seconds": None})
    return {"argvs": argvs, **found}


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_hostile_checkpoint(row: Row, outcomes):
    result = outcomes[row.id]
    path = outcomes["argvs"][row.id][1]
    assert result["code"] == row.code, result
    assert result["seconds"] < ROW_SECONDS, result
    if row.code == 0:
        return
    lines = [line for line in result["err"].splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result["err"], result["err"]
    assert lines[0].startswith("sharp eigen: error: ") and path in lines[0], lines[0]
    for needle in row.needles:
        assert needle in lines[0], (needle, lines[0])
    assert "internal error" not in lines[0]


def test_valid_checkpoint_of_the_same_size_still_loads(tmp_path):
    """The size check compares with the file: a real 200-layer MLP's checkpoint loads."""
    from sharpcli.io.checkpoints import load_checkpoint

    spec = tiny_mlp_spec(depth=200, width=3)
    path = write_own_checkpoint(tmp_path / "deep.safetensors", spec=spec)
    loaded = load_checkpoint(path)
    assert len(loaded.model.state_dict()) == 2 * 201
    x = torch.randn(2, 16)
    torch.manual_seed(0)
    assert torch.equal(loaded.model(x), build_model(spec)(x))
