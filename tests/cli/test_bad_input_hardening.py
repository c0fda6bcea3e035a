"""Hostile input (the "Hardening" issue): one table of cases, as tests/cli/test_bad_input.py.

Each case is a command line whose input was written by someone else: a pickle that asks for
gigabytes, a data path in a checkpoint's metadata that names ``/dev/zero``, a FIFO or a file
of secrets, JSON nested a hundred thousand levels deep, an option value out of range. For
every case:

- the exit code is the one given (2: bad usage or input), never 4 (a bug in sharp);
- stderr is exactly one line, ``sharp COMMAND: error: ...``, holding every needle (the file
  or option it is about) and no traceback;
- nothing listed in ``absent`` (the content of a file that a metadata data path named)
  appears on stderr, on stdout or in the JSON error object (``--json -``).

Cases marked ``bounded`` would take gigabytes or block forever if their fix regressed: they
run in a subprocess under ``resource.setrlimit(RLIMIT_DATA)`` (:data:`MEMORY_LIMIT`: heap and
private writable mappings, so a CUDA build's reserved address space does not count) and a
timeout, so a regression fails the test instead of eating the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from string import Template

import numpy as np
import pandas as pd
import pytest
from cli_helpers import Run, run_cli

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from fixtures.make_data_fixtures import py2_pickle
from sharpcli import SCHEMA_ID

DATA = "blobs:n=64"
MEMORY_LIMIT = 1536 << 20  # data segment of a bounded case (a normal run's address space: 900 MB)
SECRET = "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


@dataclass(frozen=True)
class Case:
    """One hostile command line and what the user must see (``$name``: a fixture file)."""

    id: str
    argv: tuple[str, ...]
    code: int
    needles: tuple[str, ...]
    absent: tuple[str, ...] = ()
    bounded: bool = False


C = Case
HIDDEN = ("AWS_SECRET", "wJalrXUtnFEMI")
CASES = [
    # ------------------------------------------------------------------ 1. pickles that allocate on request
    C(
        "pickle-ndarray-200000x3072",
        ("eigen", "$own", "--data", "$bomb_ndarray"),
        2,
        ("$bomb_ndarray/data_batch_1", "refusing to unpickle", "614,400,000 bytes"),
        bounded=True,
    ),
    C(
        "pickle-bytearray-1e9",
        ("eigen", "$own", "--data", "$bomb_bytearray"),
        2,
        ("$bomb_bytearray/data_batch_1", "refusing to unpickle", "1,000,000,000 bytes"),
        bounded=True,
    ),
    C(
        "pickle-reconstruct-huge-shape",
        ("trace", "$own", "--data", "$bomb_reconstruct"),
        2,
        ("$bomb_reconstruct/data_batch_1", "refusing to unpickle", "bytes"),
        bounded=True,
    ),
    C(
        "pickle-memo-index-2e31",
        ("eigen", "$own", "--data", "$bomb_memo"),
        2,
        ("$bomb_memo/data_batch_1", "holds a list"),
        bounded=True,
    ),
    C(
        "npz-member-declares-8gb",
        ("eigen", "$own", "--data", "$bomb_npz"),
        2,
        ("$bomb_npz", "8,000,000,000 bytes"),
        bounded=True,
    ),
    # ------------------------------------------------------------------ 2. data paths that never end
    C(
        "metadata-data-dev-zero",
        ("eigen", "$meta_dev_zero"),
        2,
        ("/dev/zero", "character device", "not a regular file"),
        bounded=True,
    ),
    C(
        "metadata-data-fifo",
        ("trace", "$meta_fifo"),
        2,
        ("$fifo", "FIFO", "not a regular file"),
        bounded=True,
    ),
    C(
        "data-option-dev-zero",
        ("train", "--data", "/dev/zero", "--out", "$outdir/m.safetensors"),
        2,
        ("/dev/zero", "not a regular file"),
        bounded=True,
    ),
    C(
        "checkpoint-is-dev-zero",
        ("eigen", "/dev/zero"),
        2,
        ("/dev/zero", "not a regular file"),
        bounded=True,
    ),
    C(
        "compare-report-is-a-fifo",
        ("compare", "$fifo"),
        2,
        ("$fifo", "FIFO"),
        bounded=True,
    ),
    # ------------------------------------------------------------------ 3. file content is never echoed
    C(
        "metadata-csv-secret-header",
        ("eigen", "$meta_secret_header"),
        2,
        ("$secret_header", "has no label column 'label' (1 columns)"),
        HIDDEN,
    ),
    C(
        "metadata-csv-secret-cell",
        ("trace", "$meta_secret_cell"),
        2,
        ("$secret_cell", "1 non-numeric feature column(s)"),
        HIDDEN,
    ),
    C(
        "metadata-csv-secret-split",
        ("eigen", "$meta_secret_split"),
        2,
        (
            "$secret_split",
            "column 'split' has 2 value(s) other than train or test (the first in row 2)",
        ),
        HIDDEN,
    ),
    C(
        "metadata-npz-secret-key",
        ("eigen", "$meta_secret_key"),
        2,
        ("$secret_key", "1 key(s) besides x, y", "1 key(s) not shown"),
        HIDDEN,
    ),
    C(
        "metadata-credentials-file-as-csv",
        ("gn-nme", "$meta_credentials"),
        2,
        ("$credentials",),
        HIDDEN,
    ),
    C(
        "metadata-cifar-secret-key",
        ("eigen", "$meta_secret_cifar"),
        2,
        ("$secret_cifar/data_batch_1", "no 'data' entry (1 other key(s))"),
        HIDDEN,
    ),
    C(
        "metadata-parquet-secret-label",
        ("eigen", "$meta_secret_parquet"),
        2,
        ("$secret_parquet", "feature column 1 of 17 has a missing or NaN value (row 1)"),
        HIDDEN,
    ),
    # ------------------------------------------------------------------ 8. no exit 4 from hostile JSON
    C(
        "arch-args-nested-100000-deep",
        ("eigen", "$foreign", "--arch", "mlp", "--arch-args", "$deep_json"),
        2,
        ("--arch-args", "nested more than 32 levels"),
    ),
    C(
        "compare-report-nested-100000-deep",
        ("compare", "$deep_report"),
        2,
        ("$deep_report", "nested more than 64 levels"),
    ),
    C(
        "sweep-set-value-nested-40-deep",
        ("sweep", "--reg", "wd", "--grid", "sigma=0.1", "--set", "model_args=$deep40_json")
        + ("--out-dir", "$outdir/sweep"),
        2,
        ("--set", "model_args", "nested more than 32 levels"),
    ),
    C(
        "train-model-args-nested-40-deep",
        ("train", "--data", DATA, "--model-args", "$deep40_json", "--out", "$outdir/m.safetensors"),
        2,
        ("--model-args", "nested more than 32 levels"),
    ),
    # ------------------------------------------------------------------ 8. metadata values of the wrong kind
    C(
        "metadata-train-loss-a-list",
        ("eigen", "$meta_loss_list"),
        2,
        ("$meta_loss_list", "metadata sharpcli.train", "'loss' is not one of"),
    ),
    C(
        "metadata-train-loss-unknown",
        ("trace", "$meta_loss_unknown"),
        2,
        ("$meta_loss_unknown", "metadata sharpcli.train"),
    ),
    C(
        "metadata-data-name-a-list",
        ("eigen", "$meta_data_name_list"),
        2,
        ("$meta_data_name_list", "metadata sharpcli.data", "unknown built-in dataset"),
    ),
    C(
        "metadata-data-label-column-a-list",
        ("eigen", "$meta_label_column_list"),
        2,
        ("$meta_label_column_list", "metadata sharpcli.data", "label_column"),
    ),
    C(
        "metadata-data-argument-beyond-float",
        ("gn-nme", "$meta_huge_separation"),
        2,
        ("$meta_huge_separation", "metadata sharpcli.data", "separation"),
    ),
    # ------------------------------------------------------------------ 8. options out of range
    C(
        "train-seed-beyond-64-bits",
        ("train", "--data", DATA, "--seed", "99999999999999999999999", "--out", "$outdir/m.st"),
        2,
        ("--seed", "0..4294967295"),
    ),
    C("eigen-seed-negative", ("eigen", "$own", "--seed", "-1"), 2, ("--seed", "0..4294967295")),
    C(
        "train-momentum-negative",
        ("train", "--data", DATA, "--momentum", "-1", "--out", "$outdir/m.safetensors"),
        2,
        ("--momentum", "[0, 1)"),
    ),
    C(
        "train-input-noise-nan",
        ("train", "--data", DATA, "--input-noise", "nan", "--out", "$outdir/m.safetensors"),
        2,
        ("--input-noise", "finite"),
    ),
    C(
        "train-width-zero",
        ("train", "--data", DATA, "--width", "0", "--out", "$outdir/m.safetensors"),
        2,
        ("--width", "at least 1"),
    ),
    C(
        "sweep-set-epochs-not-an-integer",
        ("sweep", "--reg", "wd", "--grid", "sigma=0.1", "--set", "epochs=abc")
        + ("--out-dir", "$outdir/sweep"),
        2,
        ("--set", "epochs: must be an integer, got 'abc'"),
    ),
    C(
        "sweep-set-label-noise-a-list",
        ("sweep", "--reg", "wd", "--grid", "sigma=0.1", "--set", "label_noise=[1]")
        + ("--out-dir", "$outdir/sweep"),
        2,
        ("--set", "label_noise: must be a number"),
    ),
    C(
        "sweep-seeds-beyond-64-bits",
        ("sweep", "--reg", "wd", "--grid", "sigma=0.1", "--seeds", "99999999999999999999")
        + ("--out-dir", "$outdir/sweep"),
        2,
        ("--seeds", "0..4294967295"),
    ),
    C(
        "sweep-grid-infinite-value",
        ("sweep", "--reg", "wd", "--grid", "sigma=0.1,inf", "--out-dir", "$outdir/sweep"),
        2,
        ("--grid", "finite"),
    ),
    # ------------------------------------------------------------------ 8. only the command's own options
    C(
        "train-model-args-unknown-key-names-model-args",
        ("train", "--data", DATA, "--model-args", '{"bogus": 1}', "--out", "$outdir/m.st"),
        2,
        ("--model-args", "bogus"),
    ),
    C(
        "train-track-samples-zero-names-track-samples",
        ("train", "--data", DATA, "--track", "trace", "--track-samples", "0")
        + ("--out", "$outdir/m.safetensors"),
        2,
        ("--track-samples",),
    ),
    C(
        "sweep-set-loss-unknown-names-set",
        ("sweep", "--reg", "wd", "--grid", "sigma=0.1", "--set", "loss=hinge")
        + ("--out-dir", "$outdir/sweep"),
        2,
        ("--set", "loss: unknown loss 'hinge'"),
    ),
    C(
        "sweep-set-model-args-unknown-key-names-set",
        ("sweep", "--reg", "wd", "--grid", "sigma=0.1", "--set", 'model_args={"bogus": 1}')
        + ("--data", DATA, "--epochs", "1", "--out-dir", "$outdir/sweep"),
        2,
        ("--set", "bogus"),
    ),
    C(
        "sweep-set-label-column-names-set",
        ("sweep", "--reg", "wd", "--grid", "sigma=0.1", "--set", "label_column=klass")
        + ("--data", DATA, "--epochs", "1", "--out-dir", "$outdir/sweep"),
        2,
        ("--set", "no label column"),
    ),
    # ------------------------------------------------------------------ 6. resume
    C(
        "resume-with-fewer-epochs",
        ("train", "--data", DATA, "--epochs", "1", "--resume", "--out", "$run2"),
        2,
        ("--epochs", "completed 2", "at least 2"),
    ),
    C(
        "resume-with-another-lr-and-batch-size",
        ("train", "--data", DATA, "--epochs", "2", "--lr", "0.2", "--batch-size", "8")
        + ("--resume", "--out", "$run2"),
        2,
        ("--resume", "--batch-size, --lr"),
    ),
    C(
        "resume-more-epochs-under-cosine",
        ("train", "--data", DATA, "--epochs", "3", "--schedule", "cosine", "--resume")
        + ("--out", "$cosine2"),
        2,
        ("--epochs", "cosine"),
    ),
    C(
        "resume-state-is-a-list",
        ("train", "--data", DATA, "--resume", "--out", "$state_list"),
        2,
        ("$state_list.state.pt", "not a resumable state", "list"),
    ),
    C(
        "resume-state-misses-fields",
        ("train", "--data", DATA, "--resume", "--out", "$state_partial"),
        2,
        ("$state_partial.state.pt", "not a resumable state", "missing"),
    ),
    C(
        "resume-state-config-not-json",
        ("train", "--data", DATA, "--resume", "--out", "$state_badjson"),
        2,
        ("$state_badjson.state.pt", "not JSON"),
    ),
    C(
        "resume-state-is-garbage",
        ("train", "--data", DATA, "--resume", "--out", "$state_garbage"),
        2,
        ("$state_garbage.state.pt", "unreadable"),
    ),
]


# ---------------------------------------------------------------------------------------------- fixtures


def _save_with_data_spec(path: Path, data_spec, train_config: dict | None = None) -> str:
    """An own checkpoint of the tiny MLP whose metadata names ``data_spec`` as its data."""
    import torch

    from sharpcli.io.checkpoints import save_checkpoint
    from sharpcli.models import build_model

    spec = tiny_mlp_spec()
    torch.manual_seed(0)
    model = build_model(spec)
    save_checkpoint(path, model, spec, data_spec=data_spec, train_config=train_config or {})
    return str(path)


def _metadata_files(root: Path, f: dict) -> None:
    """Own checkpoints whose metadata holds values of the wrong kind."""
    blobs = {"kind": "builtin", "name": "blobs", "args": {"n": 64}}
    for name, data, train in (
        ("loss_list", blobs, {"loss": ["cross-entropy"]}),
        ("loss_unknown", blobs, {"loss": "hinge"}),
        ("data_name_list", {"kind": "builtin", "name": ["blobs"]}, None),
        (
            "label_column_list",
            {"kind": "file", "path": str(f["secret_cell"]), "label_column": [1]},
            None,
        ),
        (
            "huge_separation",
            {"kind": "builtin", "name": "blobs", "args": {"separation": 10**400}},
            None,
        ),
    ):
        f[f"meta_{name}"] = _save_with_data_spec(root / f"meta_{name}.safetensors", data, train)


def _resume_files(root: Path, f: dict) -> None:
    """Finished 2-epoch runs (constant and cosine) whose resumable state is kept, and broken
    state files beside would-be outputs."""
    import torch
    from cli_helpers import run_in_process

    for name, schedule in (("run2", "constant"), ("cosine2", "cosine")):
        f[name] = root / f"{name}.safetensors"
        run = run_in_process(
            "train", "--data", DATA, "--epochs", "2", "--schedule", schedule, "--out", f[name], "-q"
        )
        assert run.code == 0, run.err
    good = torch.load(f"{f['run2']}.state.pt", weights_only=True)
    for name, content in (
        ("state_list", [1, 2]),
        ("state_partial", {"version": 1, "epoch": 1}),
        ("state_badjson", good | {"config": "{not json"}),
    ):
        f[name] = root / f"{name}.safetensors"
        torch.save(content, f"{f[name]}.state.pt")
    f["state_garbage"] = root / "state_garbage.safetensors"
    Path(f"{f['state_garbage']}.state.pt").write_bytes(b"PK\x03\x04 not a torch file")


def _cifar_folder(root: Path, name: str, batch: bytes) -> str:
    folder = root / name / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    (folder / "data_batch_1").write_bytes(batch)
    return str(folder)


def _npz_declaring(path: Path, shape: tuple[int, ...]) -> str:
    """An .npz whose member x.npy declares ``shape`` float64 but stores 16 bytes of data."""
    from numpy.lib import format as npy_format

    header = {"descr": "<f8", "fortran_order": False, "shape": shape}
    with zipfile.ZipFile(path, "w") as archive:
        with archive.open("x.npy", "w") as member:
            npy_format.write_array_header_1_0(member, header)
            member.write(bytes(16))
        with archive.open("y.npy", "w") as member:
            np.save(member, np.zeros(2, np.int64))
    return str(path)


def _secret_files(root: Path, f: dict) -> None:
    """Files of secrets (as a metadata data path may name) and checkpoints that point at them."""
    rng = np.random.default_rng(0)
    features = {f"f{j}": rng.standard_normal(4) for j in range(16)}
    f["secret_header"] = root / "secret_header.csv"
    f["secret_header"].write_text(f"{SECRET}\n1\n2\n")
    f["secret_cell"] = root / "secret_cell.csv"
    cells = pd.DataFrame(features | {"f3": ["1", SECRET, "2", "3"], "label": [0, 1, 2, 3]})
    cells.to_csv(f["secret_cell"], index=False)
    f["secret_split"] = root / "secret_split.csv"
    split = pd.DataFrame(features | {"label": [0, 1, 2, 3], "split": ["train", SECRET] * 2})
    split.to_csv(f["secret_split"], index=False)
    f["secret_key"] = root / "secret_key.npz"
    np.savez(f["secret_key"], x=np.zeros((4, 16)), y=np.zeros(4, np.int64), **{SECRET: np.ones(1)})
    f["credentials"] = root / "credentials"  # ~/.aws/credentials, named by metadata as a csv
    f["credentials"].write_text(f"[default]\naws_access_key_id = AKIA\n{SECRET.lower()}\n")
    f["secret_cifar"] = Path(
        _cifar_folder(root, "secret_cifar", py2_pickle({SECRET.encode(): [1, 2]}))
    )
    f["secret_parquet"] = root / "secret.parquet"
    with_nan = features | {"f0": [np.nan, 1.0, 2.0, 3.0], "label": [SECRET, "b", "c", "d"]}
    pd.DataFrame(with_nan).to_parquet(f["secret_parquet"])
    formats = {"secret_key": "npz", "secret_cifar": "cifar10-python", "secret_parquet": "parquet"}
    for name in (
        "secret_header",
        "secret_cell",
        "secret_split",
        "secret_key",
        "credentials",
        "secret_cifar",
        "secret_parquet",
    ):
        spec = {"kind": "file", "path": str(f[name]), "format": formats.get(name, "csv")}
        f[f"meta_{name}"] = _save_with_data_spec(root / f"meta_{name}.safetensors", spec)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Every hostile input, built once: name -> path or text."""
    from safetensors.torch import save_file

    from sharpcli.models import build_model

    root = tmp_path_factory.mktemp("hardening")
    f: dict = {"fixdir": root}
    f["own"] = write_own_checkpoint(root / "own.safetensors", tiny_mlp_spec(), data_spec=DATA)
    f["foreign"] = root / "foreign.safetensors"
    save_file(dict(build_model(tiny_mlp_spec()).state_dict()), str(f["foreign"]))

    ndarray = b"\x80\x02cnumpy\nndarray\nJ\x40\x0d\x03\x00M\x00\x0c\x86X\x02\x00\x00\x00u1\x86R."
    bytearray_ = b"\x80\x02c__builtin__\nbytearray\nJ\x00\xca\x9a\x3b\x85R."
    reconstruct = (
        b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
        b"J\x00\x00\x00\x40\x85U\x02f8\x87R."
    )
    memo = b"\x80\x02]r\xff\xff\xff\x7f."  # LONG_BINPUT 2**31 - 1: the C unpickler sizes its memo by it
    for name, batch in (
        ("bomb_ndarray", ndarray),
        ("bomb_bytearray", bytearray_),
        ("bomb_reconstruct", reconstruct),
        ("bomb_memo", memo),
    ):
        f[name] = _cifar_folder(root, name, batch)
    f["bomb_npz"] = _npz_declaring(root / "bomb.npz", (10**9,))

    f["fifo"] = root / "data.csv"
    os.mkfifo(f["fifo"])
    f["meta_dev_zero"] = _save_with_data_spec(
        root / "dev_zero.safetensors", {"kind": "file", "path": "/dev/zero", "format": "csv"}
    )
    f["meta_fifo"] = _save_with_data_spec(
        root / "fifo.safetensors", {"kind": "file", "path": str(f["fifo"]), "format": "csv"}
    )
    _secret_files(root, f)
    _metadata_files(root, f)
    _resume_files(root, f)
    f["deep_json"] = "[" * 100_000 + "]" * 100_000
    f["deep40_json"] = '{"a": ' * 40 + "1" + "}" * 40
    f["deep_report"] = root / "deep.json"
    f["deep_report"].write_text(
        json.dumps({"schema": SCHEMA_ID, "command": "eigen", "version": "0"})[:-1]
        + ', "results": '
        + "[" * 100_000
        + "]" * 100_000
        + "}"
    )
    return {k: str(v) for k, v in f.items()}


@pytest.fixture
def outdir(tmp_path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


# ---------------------------------------------------------------------------------------------- checks


def expand(text: str, files: dict, outdir: Path) -> str:
    return Template(text).substitute(files | {"outdir": str(outdir)})


def run_bounded(argv: list[str], timeout: int = 240) -> Run:
    """``sharp ARGV`` in a subprocess limited to ``MEMORY_LIMIT`` bytes of data segment."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_DATA, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
        "from sharpcli.cli.app import main\n"
        "main(sys.argv[1:])\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def check_one_line(run: Run, case: Case, needles: list[str]) -> str:
    """Exit code, one stderr line ``sharp CMD: error: ...`` with every needle, no traceback,
    nothing of ``case.absent`` anywhere; returns the message."""
    assert run.code == case.code, (run.code, run.err, run.out[:300])
    assert "Traceback" not in run.err and "Traceback" not in run.out
    lines = [line for line in run.err.splitlines() if line.strip()]
    assert len(lines) == 1, run.err
    prefix = f"sharp {case.argv[0]}: error: "
    assert lines[0].startswith(prefix), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    for hidden in case.absent:
        assert hidden.lower() not in (run.err + run.out).lower(), (hidden, run.err, run.out)
    return lines[0][len(prefix) :]


def command_options(command: str) -> set[str]:
    """Every option name the command ``command`` takes."""
    import typer.main

    from sharpcli.cli.app import app

    click_command = typer.main.get_command(app).commands[command]
    return {opt for param in click_command.params for opt in (*param.opts, *param.secondary_opts)}


def params():
    return [pytest.param(case, id=case.id) for case in CASES]


@pytest.mark.parametrize("case", params())
def test_hostile_input(case: Case, files, outdir, capsys):
    argv = [expand(a, files, outdir) for a in case.argv]
    needles = [expand(n, files, outdir) for n in case.needles]
    if case.bounded:
        run = run_bounded([*argv, "--json", "-"])
        message = check_one_line(run, case, needles)
        assert json.loads(run.out)["error"]["message"] == message
        return
    run = run_cli(capsys, *argv)
    check_one_line(run, case, needles)
    run = run_cli(capsys, *argv, "--json", "-")
    message = check_one_line(run, case, needles)
    error = json.loads(run.out)["error"]
    assert error["message"] == message and error["exit_code"] == case.code
    assert isinstance(error.get("source"), str) and error["source"]
    if error["source"].startswith("--"):  # never an option of another command
        assert error["source"] in command_options(case.argv[0]), error


def test_table_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


# ---------------------------------------------------------------------------------------------- units


def test_restricted_unpickler_budget_admits_real_batches_and_refuses_requests():
    """Real CIFAR-sized batches in every protocol load; a constructor asking for more than the
    file justifies is refused before it allocates."""
    import pickle

    from sharpcli.errors import InputError
    from sharpcli.io.data.safe_pickle import _np_multiarray, restricted_loads

    _reconstruct = _np_multiarray._reconstruct
    rows = np.random.default_rng(0).integers(0, 256, (500, 3072), dtype=np.uint8)
    batch = {"data": rows, "labels": list(range(10)) * 50, "names": {"a", "b"}}
    for protocol in (2, 3, 4, 5):
        loaded = restricted_loads(pickle.dumps(batch, protocol=protocol), source="b")
        assert (loaded["data"] == rows).all() and loaded["names"] == {"a", "b"}
    loaded = restricted_loads(py2_pickle({b"data": rows, b"labels": [1, 2]}), source="b")
    assert (loaded[b"data"] == rows).all()
    many = pickle.dumps([rows] * 8, protocol=2)
    assert len(restricted_loads(many, source="b")) == 8  # memo: one array, eight references

    class Lying:  # an array whose BUILD state declares 10**9 bytes and holds none
        def __reduce__(self):
            state = (1, (10**9,), np.dtype("u1"), False, b"")
            return (_reconstruct, (np.ndarray, (0,), b"b"), state)

    with pytest.raises(InputError, match="numpy array of 1,000,000,000 bytes"):
        restricted_loads(pickle.dumps(Lying(), protocol=3), source="b")
    dicts = pickle.dumps([{} for _ in range(100_000)], protocol=2)  # 64 B each from 3 B of file
    with pytest.raises(InputError, match="refusing to unpickle: it asks for the pickle's opcodes"):
        restricted_loads(dicts, source="b")


def test_bounded_reader_stops_at_the_size_at_open(tmp_path):
    """A file appended to while it is read ends at its size when it was opened."""
    from sharpcli.bounded import open_data_file, read_data_file

    path = tmp_path / "growing.bin"
    path.write_bytes(b"a" * 10)
    with open_data_file(path) as handle:
        with open(path, "ab") as writer:
            writer.write(b"b" * 1000)
        assert handle.read() == b"a" * 10
        handle.seek(-2, os.SEEK_END)
        assert handle.read() == b"aa"
    assert read_data_file(path) == b"a" * 10 + b"b" * 1000


def test_library_messages_lose_quoted_content():
    from sharpcli.io.data.dataset import describe_exception

    text = describe_exception(ValueError(f"could not convert string to float: '{SECRET}'"))
    assert "AWS" not in text and "could not convert string to float" in text
    assert "AWS" not in describe_exception(KeyError(SECRET))


# ---------------------------------------------------------------------------------------------- 5. sweep keys

SWEEP = ("sweep", "--reg", "wd", "--data", DATA, "--width", "8", "--metrics", "eigen")


def _sweep(capsys, folder: Path, *args: str) -> dict:
    run = run_cli(capsys, *SWEEP, "--analyze-samples", "32", "--out-dir", folder, *args)
    assert run.code == 0, run.err
    return run.json()


def test_sweep_values_that_print_alike_are_two_runs(tmp_path, capsys):
    """``%g`` wrote 0.1 and 0.1000001 both as 0.1: one run, reused for the other value."""
    from sharpcli.io.checkpoints import load_checkpoint

    report = _sweep(
        capsys, tmp_path, "--grid", "sigma=0.1,0.1000001", "--epochs", "1", "--json", "-"
    )
    runs = report["results"]["runs"]
    assert [r["sigma"] for r in runs] == [0.1, 0.1000001] and report["results"]["skipped"] == []
    names = [r["run"] for r in runs]
    assert len(set(names)) == 2 and "sigma=0.1000001-" in names[1]
    regs = [load_checkpoint(tmp_path / f"{n}.safetensors").train_config["regs"] for n in names]
    assert regs == [["wd:sigma=0.1"], ["wd:sigma=0.1000001"]]


def test_sweep_with_other_settings_trains_new_runs(tmp_path, capsys):
    """A second sweep into the same folder with another --epochs (or --lr) trains its own runs;
    the same settings again reuse every run."""
    first = _sweep(capsys, tmp_path, "--grid", "sigma=0.01", "--epochs", "1", "--json", "-")
    again = _sweep(capsys, tmp_path, "--grid", "sigma=0.01", "--epochs", "1", "--json", "-")
    assert again["results"]["skipped"] == [r["run"] for r in first["results"]["runs"]]
    longer = _sweep(capsys, tmp_path, "--grid", "sigma=0.01", "--epochs", "2", "--json", "-")
    faster = _sweep(
        capsys, tmp_path, "--grid", "sigma=0.01", "--epochs", "1", "--lr", "0.1", "--json", "-"
    )
    names = {r["run"] for doc in (first, longer, faster) for r in doc["results"]["runs"]}
    assert len(names) == 3 and longer["results"]["skipped"] == faster["results"]["skipped"] == []
    run = longer["results"]["runs"][0]["run"]
    train = json.loads((tmp_path / f"{run}.train.json").read_text())
    assert train["settings"]["epochs"] == 2 and train["results"]["final"]["epochs_completed"] == 2
    # other --metrics: the trained run is analysed again, not retrained
    more = _sweep(
        capsys,
        tmp_path,
        "--grid",
        "sigma=0.01",
        "--epochs",
        "1",
        "--metrics",
        "eigen,trace",
        "--json",
        "-",
    )
    assert more["results"]["skipped"] == [] and more["results"]["runs"][0]["trace"] is not None


def test_run_key_covers_every_setting():
    from sharpcli.training.loop import TrainConfig
    from sharpcli.training.sweep import run_key

    base = TrainConfig(data=DATA, regs=["wd:sigma=0.1"])
    assert run_key(base) == run_key(TrainConfig(data=DATA, regs=["wd:sigma=1e-1"]))
    for change in (
        {"epochs": 6},
        {"lr": 0.1},
        {"model": "cnn"},
        {"data": "blobs:n=65"},
        {"seed": 1},
        {"momentum": 0.5},
    ):
        assert run_key(TrainConfig(**{"data": DATA, "regs": ["wd:sigma=0.1"], **change})) != (
            run_key(base)
        ), change


# ---------------------------------------------------------------------------------------------- 6. resume


def test_resume_with_more_epochs_equals_a_longer_run(tmp_path, capsys):
    """More epochs is what may change on resume: 1 epoch then --resume --epochs 2 gives the
    weights of a 2-epoch run, bit for bit, and metadata that agrees with the history."""
    from safetensors.torch import load_file

    from sharpcli.io.checkpoints import load_checkpoint

    common = ("train", "--data", DATA, "--width", "8", "--quiet")
    short, full = tmp_path / "short.safetensors", tmp_path / "full.safetensors"
    assert run_cli(capsys, *common, "--epochs", "1", "--out", short).code == 0
    resumed = run_cli(capsys, *common, "--epochs", "2", "--resume", "--out", short, "--json", "-")
    assert resumed.code == 0, resumed.err
    assert resumed.json()["results"]["resumed_from_epoch"] == 1
    assert run_cli(capsys, *common, "--epochs", "2", "--out", full).code == 0
    a, b = load_file(str(short)), load_file(str(full))
    assert all((a[k] == b[k]).all() for k in a)
    ckpt = load_checkpoint(short)
    assert ckpt.train_config["epochs"] == 2 == ckpt.metrics["epochs_completed"]
