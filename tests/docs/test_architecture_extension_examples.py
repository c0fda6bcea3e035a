"""The worked examples of docs/architecture.md run as written and compute the right numbers.

The regularizer's and the trace estimator's first ``python`` block is the whole of one new
module: written into a copy of the package, then ``python -m sharpcli.catalogue.generate``
(nothing else edited) makes ``sharp train --reg l1`` / ``sharp trace --estimator girard`` run
it and ``--help`` list it. In this process the same code is an extension: the regularizer's
gradient is checked exactly in float64, Girard's estimate against the dense trace, and the
toy format's loaded tensors against the records it wrote. All are unregistered afterwards, so
other tests see the stock registries.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli

from sharpcli.errors import InputError
from sharpcli.io.data.formats import FORMATS
from sharpcli.io.data.loading import load_dataset
from sharpcli.regularizers.registry import REGISTRY, parse_reg
from sharpcli.regularizers.step import training_step

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def example(heading: str, index: int = 0) -> str:
    """The ``index``-th ```python block of the page's ``## heading`` section."""
    text = PAGE.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)
    (section,) = [s for s in sections if s.splitlines()[0].strip() == heading]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)
    assert len(blocks) > index, f"no python block {index} under '## {heading}'"
    return blocks[index]


def run_example(heading: str, *indices: int) -> dict:
    """The namespace of the section's blocks ``indices`` (default: the first), run in order."""
    namespace = {"__name__": "architecture_example"}
    for index in indices or (0,):
        exec(compile(example(heading, index), f"{PAGE.name}: {heading}", "exec"), namespace)
    return namespace


@pytest.fixture
def l1_example():
    try:
        yield run_example("Adding a regularizer", 0, 1)
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


def _tiny_mlp():
    """A seeded float64 3-5-2 tanh MLP and 24 Gaussian points with binary labels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    x, y = torch.randn(24, 3, dtype=torch.float64), torch.randint(0, 2, (24,))
    return model.double(), x, y


def test_girard_estimate_is_within_its_stderr_of_the_dense_trace():
    """The example estimator added at run time: ``Curvature.trace(estimator="girard")`` against
    the dense Hessian's trace (double backward, float64), and ``Tr(H^2)`` against ``||H||_F^2``."""
    from sharpcli import Curvature
    from sharpcli.catalogue import ESTIMATORS

    namespace = run_example("Adding a trace estimator")
    ESTIMATORS.add(namespace["girard_trace"])
    try:
        model, x, y = _tiny_mlp()
        curvature = Curvature(model, "cross-entropy", (x, y))
        H = curvature.operator().to_dense()
        for square, exact in ((False, H.trace()), (True, (H * H).sum())):
            t = curvature.trace(estimator="girard", square=square, max_matvecs=400, seed=1)
            assert t.estimator == "girard" and t.matvecs == 400
            assert abs(t.estimate - float(exact)) <= 4 * t.stderr
    finally:
        ESTIMATORS.unregister("girard")
    assert "girard" not in ESTIMATORS


def _package_copy(tmp_path: Path, module: str, heading: str) -> dict:
    """A copy of the package with the section's first block as ``module``, its index
    regenerated by the one command; the environment that runs that copy."""
    root = Path(__file__).resolve().parents[2]
    shutil.copytree(
        root / "sharpcli", tmp_path / "sharpcli", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(root / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    (tmp_path / module).write_text(example(heading), encoding="utf-8")
    env = os.environ | {"PYTHONPATH": str(tmp_path), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    generate = [sys.executable, "-m", "sharpcli.catalogue.generate"]
    subprocess.run(generate, env=env, cwd=tmp_path, check=True, capture_output=True)
    # the index and the docs' tables are fresh; the CLI reference, which links to those
    # tables, needed no change
    for command in (
        [*generate, "--check"],
        [sys.executable, "-m", "sharpcli.cli.reference", "--check"],
    ):
        check = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True)
        assert check.returncode == 0, check.stderr
    return env


def _sharp(env: dict, *args: str) -> subprocess.CompletedProcess:
    """``python -m sharpcli ARGS`` on the copy (run from it: ``-m`` puts the cwd first)."""
    return subprocess.run(
        [sys.executable, "-m", "sharpcli", *args],
        env=env,
        cwd=env["PYTHONPATH"],
        capture_output=True,
        text=True,
    )


def _flat(help_text: str) -> str:
    """The help's words, the panel's borders and line breaks gone."""
    return " ".join(help_text.replace("│", " ").split())


def _weights(path: str) -> torch.Tensor:
    """A checkpoint's weights, flattened in the file's key order."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    return torch.cat([tensors[k].reshape(-1).double() for k in sorted(tensors)])


# one full-batch float64 SGD step without momentum: theta_1 = theta_0 - lr (grad L + grad P)
ONE_STEP = [
    *("train", "--data", "blobs:n=64,dim=4,classes=3", "--epochs", "1", "--width", "8"),
    *("--batch-size", "1000", "--optimizer", "sgd", "--momentum", "0", "--lr", "1e-6"),
    *("--dtype", "float64", "--quiet"),
]


@pytest.mark.slow
def test_a_new_regularizer_module_is_a_builtin_after_the_one_command(tmp_path):
    """One new file plus the regeneration command: `--reg l1` trains as its formula says and
    `--help` lists it; the CLI reference, which links to the generated tables, stays fresh."""
    env = _package_copy(tmp_path, "sharpcli/regularizers/penalties/l1.py", "Adding a regularizer")
    assert "fa, l1, gp" in _flat(_sharp(env, "train", "--help").stdout)
    table = (tmp_path / "docs" / "commands" / "train.md").read_text(encoding="utf-8")
    assert "| `l1` | L + lam \\|\\|theta\\|\\|_1 | `lam=0.0001` |  |" in table
    lr, lam = 1e-6, 0.25
    runs = {}
    for value in (0.0, lam):
        out = str(tmp_path / f"l1-{value}.safetensors")
        run = _sharp(env, *ONE_STEP, "--reg", f"l1:lam={value}", "--out", out, "--json", "-")
        assert run.returncode == 0, run.stderr
        (row,) = json.loads(run.stdout)["results"]["history"]
        assert row["grad_evals"] == 1
        runs[value] = (row["penalties"]["l1"], _weights(out))
    (zero, theta_plain), (penalty, theta_l1) = runs[0.0], runs[lam]
    # the step moved every weight by lr * lam * sign(theta_0) more than the plain loss's step
    moved = theta_plain - theta_l1
    assert zero == 0.0 and torch.allclose(moved.abs(), torch.full_like(moved, lr * lam), rtol=1e-6)
    # P = lam ||theta_0||_1, with theta_0 = theta_plain + lr grad L within 1e-5 relative
    assert penalty == pytest.approx(lam * float(theta_plain.abs().sum()), rel=1e-5)
    assert float((moved.sign() * theta_plain).sum()) == pytest.approx(penalty / lam, rel=1e-5)


@pytest.mark.slow
def test_a_new_estimator_module_is_a_builtin_after_the_one_command(tmp_path):
    """One new file plus the regeneration command: `--estimator girard` runs, `--help` lists it,
    and its estimate is within 4 of its standard errors of the dense Hessian's trace."""
    from hessian_helpers import double_backward_hessian

    from sharpcli.session import build_session

    env = _package_copy(tmp_path, "sharpcli/curvature/trace/girard.py", "Adding a trace estimator")
    shown = _flat(_sharp(env, "trace", "--help").stdout)
    assert "girard (Gaussian probes averaged (Girard))" in shown
    table = (tmp_path / "docs" / "commands" / "trace.md").read_text(encoding="utf-8")
    assert "| `girard` | Gaussian probes averaged (Girard) | Girard1989 |" in table
    ckpt = str(tmp_path / "m.safetensors")
    trained = _sharp(env, *ONE_STEP, "--lr", "0.05", "-o", ckpt)
    assert trained.returncode == 0, trained.stderr
    argv = ["trace", ckpt, "--estimator", "girard", "--dtype", "float64", "--json", "-"]
    run = _sharp(env, *argv, "--trace-max-matvecs", "400")
    assert run.returncode == 0, run.stderr
    trace = json.loads(run.stdout)["results"]["trace"]
    assert trace["estimator"] == "girard" and trace["matvecs"] == 400
    session = build_session(ckpt, dtype="float64")  # the same model and analysis set
    params = [p for p in session.model.parameters() if p.requires_grad]
    exact = float(double_backward_hessian(session.model, params, session.x, session.y).trace())
    assert 0 < trace["stderr"] < 0.5 * abs(exact)
    assert abs(trace["estimate"] - exact) <= 4 * trace["stderr"]


def test_jsonl_record_states_what_the_extension_registered(jsonl_example):
    record = run_example("Adding a data format", 1)["RECORD"]
    entry, fmt = FORMATS.entry("jsonl"), FORMATS["jsonl"]
    assert (record.name, record.summary) == (entry.name, entry.summary)
    assert {k: record.info[k] for k in entry.info} == entry.info
    assert record.info["extensions"] == fmt.extensions
    assert record.impl.partition(":")[2] == fmt.probe.__name__
    module, _, attr = record.info["read"].partition(":")
    assert module.startswith("sharpcli.io.") and attr == fmt.read.__name__
    # its place among the built-ins: after every one of them
    builtins = [FORMATS.entry(name) for name in FORMATS.builtin_names()]
    assert record.info["order"] > max(e.info["order"] for e in builtins)


def test_examples_leave_the_registries_as_they_were(tmp_path):
    assert "l1" not in REGISTRY and "jsonl" not in FORMATS
    stray = tmp_path / "points.jsonl"
    stray.write_text('{"x": [1], "y": 0}\n')
    with pytest.raises(InputError, match="unknown data file extension '.jsonl'"):
        load_dataset(str(stray))


def _gradient_norm(model, x, y) -> float:
    """The float64 norm of the mean cross-entropy's gradient over ``(x, y)``, every parameter."""
    from hessian_helpers import flat_gradient

    params = [p for p in model.parameters() if p.requires_grad]
    return float(flat_gradient(model, params, x, y).norm())


@pytest.fixture
def grad_norm_checkpoint(tmp_path, capsys):
    """A float64 checkpoint of a small MLP after one epoch on the built-in blobs."""
    ckpt = str(tmp_path / "m.safetensors")
    argv = ["train", "--data", "blobs:n=64,dim=4,classes=3", "--epochs", "1", "--width", "8"]
    result = run_cli(capsys, *argv, "--dtype", "float64", "--quiet", "--out", ckpt)
    assert result.code == 0, result.err
    return ckpt


def test_grad_norm_metric_reaches_analyze_json_table_and_gates(grad_norm_checkpoint, capsys):
    """The example metric added at run time: ``sharp analyze --metrics grad-norm`` reports the
    float64 gradient's norm over the analysis set in its JSON and its table, and a gate on it
    is accepted before any work."""
    from sharpcli.catalogue import METRICS
    from sharpcli.session import build_session

    namespace = run_example("Adding an analyze metric")
    METRICS.add(namespace["grad_norm_metric"])
    try:
        argv = ["analyze", grad_norm_checkpoint, "--metrics", "eigen,grad-norm", "--dtype"]
        run = run_cli(capsys, *argv, "float64", "--json", "-", "--fail-if", "gradient.norm > 1e9")
        table = run_cli(capsys, *argv, "float64", "--metrics", "grad-norm")
        typo = run_cli(capsys, *argv, "float64", "--fail-if", "gradient.nrom > 1")
    finally:
        METRICS.unregister("grad-norm")
    assert run.code == 0, run.err
    results = run.json()["results"]
    assert results["metrics"] == ["eigen", "grad-norm"] and results["gates"][0]["tripped"] is False
    session = build_session(grad_norm_checkpoint, dtype="float64")
    exact = _gradient_norm(session.model, session.x, session.y)
    assert results["gradient"]["norm"] == pytest.approx(exact, rel=1e-10)
    assert 0 < results["gradient"]["minibatch_norm"]
    assert (
        table.code == 0 and "gradient.norm" in table.out and "gradient.minibatch_norm" in table.out
    )
    assert typo.code == 2 and "did you mean 'gradient.norm'" in typo.err
    assert "grad-norm" not in METRICS


def test_grad_norm_tracked_in_a_history_row_and_by_measure(capsys, tmp_path):
    """The example quantity added at run time: ``measure`` gives the float64 gradient's norm on
    the tracked set, and ``sharp train --track grad-norm`` records it in each epoch's row after
    the built-ins' keys."""
    from sharpcli.analyses.tracking import measure
    from sharpcli.catalogue import TRACKABLE
    from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope

    namespace = run_example("Adding a tracked quantity")
    TRACKABLE.add(namespace["track_grad_norm"])
    try:
        model, x, y = _tiny_mlp()
        engine = CurvatureEngine(
            model, AnalysisData(x, y, loss="cross-entropy", batch_size=8), ParamScope.resolve(model)
        )
        out, products = measure(engine, ["grad-norm"])
        argv = ["train", "--data", "blobs:n=64,dim=4,classes=3", "--epochs", "2", "--width", "8"]
        ckpt = str(tmp_path / "m.safetensors")
        run = run_cli(capsys, *argv, "--track", "grad-norm,trace", "--out", ckpt, "--json", "-")
    finally:
        TRACKABLE.unregister("grad-norm")
    assert products == 0 and out["gradient_norm"] == pytest.approx(
        _gradient_norm(model, x, y), rel=1e-10
    )
    assert run.code == 0, run.err
    for row in run.json()["results"]["history"]:
        assert (
            list(row["tracked"]) == ["trace", "gradient_norm"]
            and row["tracked"]["gradient_norm"] > 0
        )
    assert "grad-norm" not in TRACKABLE


@pytest.mark.slow
def test_a_new_metric_and_tracked_quantity_are_builtins_after_the_one_command(tmp_path):
    """Two new files plus the regeneration command: ``--metrics grad-norm`` and ``--track
    grad-norm`` run, and the generated tables of docs/commands/analyze.md and docs/tracking.md
    list them."""
    env = _package_copy(tmp_path, "sharpcli/analyses/grad_norm.py", "Adding an analyze metric")
    tracked = tmp_path / "sharpcli" / "analyses" / "grad_norm_tracked.py"
    tracked.write_text(example("Adding a tracked quantity"), encoding="utf-8")
    generate = [sys.executable, "-m", "sharpcli.catalogue.generate"]
    subprocess.run(generate, env=env, cwd=tmp_path, check=True, capture_output=True)
    docs = tmp_path / "docs"
    analyze_md = (docs / "commands" / "analyze.md").read_text(encoding="utf-8")
    assert "| `grad-norm` | \\|\\|grad L(theta)\\|\\| over the analysis set" in analyze_md
    assert "`gradient.{norm, minibatch_norm}` | AD |" in analyze_md
    tracking_md = (docs / "tracking.md").read_text(encoding="utf-8")
    assert (
        "| `grad-norm` | `gradient_norm` | \\|\\|grad L(theta)\\|\\| on the tracked subset | AD |"
        in tracking_md
    )
    ckpt = str(tmp_path / "m.safetensors")
    trained = _sharp(env, *ONE_STEP, "--track", "grad-norm", "-o", ckpt, "--json", "-")
    assert trained.returncode == 0, trained.stderr
    (row,) = json.loads(trained.stdout)["results"]["history"]
    assert list(row["tracked"]) == ["gradient_norm"] and row["tracked"]["gradient_norm"] > 0
    run = _sharp(
        env, "analyze", ckpt, "--metrics", "grad-norm", "--dtype", "float64", "--json", "-"
    )
    assert run.returncode == 0, run.stderr
    from sharpcli.session import build_session

    session = build_session(ckpt, dtype="float64")
    exact = _gradient_norm(session.model, session.x, session.y)
    assert json.loads(run.stdout)["results"]["gradient"]["norm"] == pytest.approx(exact, rel=1e-10)
