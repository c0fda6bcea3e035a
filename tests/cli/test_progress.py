"""The progress channel (sharpcli.progress) and the CLI's bar (sharpcli.cli.bars).

The estimators report monotone counts that end at the result's own count with the result's
numbers; training reports every optimizer step; the bar shows counts on a terminal and
nothing under --quiet, --json - or off a terminal.
"""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from cli_helpers import run_cli
from conftest import make_data, make_mlp

from sharpcli import progress
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope, hutchpp, lanczos
from sharpcli.curvature.density import spectral_density


def _operator(dtype=torch.float64, batch_size=8):
    model = make_mlp().to(dtype).eval()
    x, y = make_data()
    data = AnalysisData(x.to(dtype), y, loss="cross-entropy", batch_size=batch_size)
    return CurvatureEngine(model, data, ParamScope.resolve(model)).hessian(), data


def _runs(events, method):
    """The events of the one run of ``method`` (batches left out), and its batch events."""
    ids = {e.run for e in events if e.method == method}
    assert len(ids) == 1, ids
    mine = [e for e in events if e.run in ids]
    return [e for e in mine if e.batch is None], [e for e in mine if e.batch is not None]


def _check_counts(steps, result_matvecs):
    done = [e.done for e in steps]
    assert done == sorted(done), done  # monotone
    assert done[0] == 0 and done[-1] == result_matvecs
    assert [e.final for e in steps] == [False] * (len(steps) - 1) + [True]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lanczos_reports_each_step_and_ends_at_its_result(dtype):
    op, data = _operator(dtype)
    events = []
    with progress.reporting(events.append), progress.phase("eigen H"):
        result = lanczos(op, top_k=2, tol=1e-6)
    steps, batches = _runs(events, "lanczos")
    _check_counts(steps, result.matvecs)
    assert len(steps) == result.krylov_dim + 2  # the start, one per step, the end
    assert all(
        e.phase == "eigen H" and e.unit == "matvecs" and e.total == min(op.shape[0], 100)
        for e in steps
    )
    last = steps[-1]
    assert last.quantity == "lambda_max"
    assert last.estimate == result.eigenvalues[0]
    assert last.residual == max(result.residuals)
    if dtype == torch.float32:  # explicit residuals: 2 more products than Krylov steps
        assert result.matvecs == result.krylov_dim + 2 == steps[-2].done + 2
    # every product passes over the data's batches, each reported
    assert {(e.batch, e.batches) for e in batches} == {
        (b, data.num_batches) for b in range(1, data.num_batches + 1)
    }


def test_hutchpp_reports_estimate_and_stderr_of_its_result():
    op, _ = _operator()
    events = []
    with progress.reporting(events.append):
        result = hutchpp(op, tol=0.05, max_matvecs=300, initial_sketch=4)
    steps, _ = _runs(events, "hutch++")
    _check_counts(steps, result.matvecs)
    last = steps[-1]
    assert (last.estimate, last.stderr, last.probes) == (
        result.estimate,
        result.stderr,
        result.samples,
    )
    probing = [e for e in steps if e.stderr is not None and not e.final]
    assert probing, "no probe reported an estimate"
    for e in probing:  # the projected stop lies between the count and the budget
        assert e.expected is None or e.done <= e.expected <= 300
    assert all(e.capped for e in steps)  # it stops at tol: its budget is no plan


def test_slq_density_runs_to_its_budget():
    op, _ = _operator()
    events = []
    with progress.reporting(events.append):
        spectral_density(op, probes=2, steps=4)
    steps, _ = _runs(events, "slq")
    assert steps and not any(e.capped for e in steps)  # its total is the plan


def test_slq_density_reports_its_trace_estimate():
    op, _ = _operator()
    events = []
    with progress.reporting(events.append):
        result = spectral_density(op, probes=3, steps=6)
    steps, _ = _runs(events, "slq")
    _check_counts(steps, result.matvecs)
    assert steps[0].total == 3 * 6
    last = steps[-1]
    assert last.probes == 3
    assert math.isclose(last.estimate, result.trace_estimate, rel_tol=1e-12)
    assert last.stderr > 0


def test_without_listener_nothing_is_recorded():
    op, _ = _operator()
    run = progress.start("lanczos", total=3)
    assert run.finished and not progress.active()
    lanczos(op, top_k=1, tol=1e-3)  # runs as before


def test_nested_runs_name_their_parent_and_a_failed_run_closes():
    events = []
    with progress.reporting(events.append):
        with progress.start("sweep", total=2, unit="runs") as outer:
            with pytest.raises(RuntimeError), progress.start("train", total=5, unit="steps"):
                raise RuntimeError("diverged")
            inner = progress.start("train", total=5, unit="steps")
            progress.batch(1, 2)
            inner.finish(5)
            outer.update(2)
    sweep = next(e.run for e in events if e.method == "sweep")
    trains = [e for e in events if e.method == "train"]
    assert {e.parent for e in trains} == {sweep}
    assert trains[1].final  # the failed run was closed on the way out
    assert [e.batch for e in trains if e.batch] == [1]  # the batch went to the open run


def test_train_reports_every_optimizer_step(tmp_path):
    from sharpcli.io.data.loading import load_dataset
    from sharpcli.training.loop import TrainConfig, train

    cfg = TrainConfig(
        data="blobs:n=90,dim=4,classes=3", epochs=2, batch_size=16, model_args={"width": 8}
    )
    events = []
    with progress.reporting(events.append):
        result = train(cfg, tmp_path / "m.safetensors")
    steps = [e for e in events if e.method == "train" and e.batch is None]
    steps_per_epoch = math.ceil(load_dataset(cfg.data).x_train.shape[0] / 16)
    records = [e for e in steps if e.record is not None]  # one per epoch, as it ends
    assert [e.done for e in records] == [steps_per_epoch, 2 * steps_per_epoch]
    assert [e.record["epoch"] for e in records] == [1, 2]
    assert [e.record["epochs"] for e in records] == [2, 2]
    for event, row in zip(records, result.history):
        assert event.record["train_loss"] == row["train_loss"]
        assert event.record["test_accuracy"] == row["test_accuracy"]
    updates = [e for e in steps if e.done > 0 and not e.final and e.record is None]
    assert len(updates) == 2 * steps_per_epoch
    assert [e.done for e in updates] == list(range(1, 2 * steps_per_epoch + 1))
    assert steps[0].total == 2 * steps_per_epoch and steps[-1].final
    assert updates[-1].detail == "epoch 2/2" and updates[-1].quantity == "loss"
    # the epoch's running mean loss: after its last step, the history's train loss
    assert math.isclose(updates[-1].estimate, result.history[-1]["train_loss"], rel_tol=1e-9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from cli_helpers import run_in_process

    out = tmp_path_factory.mktemp("progress") / "m.safetensors"
    run = run_in_process(
        "train", "--data", "blobs:n=120,dim=4,classes=3", "--epochs", "1", "--out", out, "-q"
    )
    assert run.code == 0, run.err
    return out


@pytest.fixture
def terminal(monkeypatch):
    """stderr as an 80-column terminal (rich's forced terminal), captured in a buffer."""
    from rich.console import Console

    from sharpcli.cli import runner

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=80, highlight=False)
    monkeypatch.setattr(runner, "stderr_console", console)
    return buffer


@pytest.mark.parametrize(
    "command, needle",
    [("eigen", "eigen H"), ("trace", "tr(H)")],
)
def test_cli_shows_matvec_counts_on_a_terminal(checkpoint, terminal, capsys, command, needle):
    run = run_cli(capsys, command, checkpoint)
    assert run.code == 0, run.err
    shown = terminal.getvalue()
    assert needle in shown and "matvecs" in shown
    assert "/100 matvecs" in shown if command == "eigen" else "/1000 matvecs" in shown
    assert run.err == ""  # the bar is on the terminal console, nothing else on stderr


@pytest.mark.parametrize("flags", [["--quiet"], ["--json", "-"]])
def test_cli_quiet_or_json_stdout_shows_no_bar(checkpoint, terminal, capsys, flags):
    run = run_cli(capsys, "eigen", checkpoint, *flags)
    assert run.code == 0, run.err
    assert terminal.getvalue() == "" and run.err == ""


def test_cli_off_a_terminal_stderr_stays_clean(checkpoint, capsys):
    run = run_cli(capsys, "trace", checkpoint, "--max-matvecs", "40")
    assert run.code == 0 and run.err == ""


def test_bar_text_fits_80_columns():
    from sharpcli.cli import bars

    event = progress.Event(
        phase="traces H,G,N",
        method="hutchinson H,G,N",
        run=1,
        parent=None,
        unit="matvecs",
        done=1000,
        total=1000,
        probes=1000,
        quantity="tr(H)",
        estimate=11.2345678,
        stderr=0.0123,
        batch=12,
        batches=12,
    )
    assert bars.counts_text(event) == "1000/1000 matvecs b12/12"
    assert bars.number_parts(event) == ["tr(H) 11.23", "±0.01"]  # probes == matvecs: not repeated
    bar, width = bars.widths(80)
    assert bar >= 10 and width == 80 - bars.FIXED_WIDTH - 1
    assert bars.line_text(event, width) == "1000/1000 matvecs b12/12 tr(H) 11.23 ±0.01"
    # a narrower line leaves numbers out whole, never cuts one
    assert bars.line_text(event, 36) == "1000/1000 matvecs b12/12 tr(H) 11.23"
    assert bars.line_text(event, 20) == "1000/1000 matvecs b12/12"


def test_eta_only_once_stable_and_never_from_a_cap():
    from sharpcli.cli import bars

    eta = bars._Eta()
    assert eta.update(0.0, 0, 100) is None  # nothing done
    assert eta.update(5.0, 1, 100) is None  # the first unit pays for caches: not measured
    assert eta.update(6.0, 2, 100) is None  # one measured unit
    assert eta.update(7.0, 3, 100) is None  # two measured; estimates do not agree yet
    assert eta.update(8.0, 4, 100) is None
    finish = eta.update(9.0, 5, 100)
    assert finish is not None and math.isclose(finish, 9.0 + 95.0)  # 1 s a unit after the first
    assert eta.update(10.0, 6, None) is None  # the plan is gone: no ETA
    assert bars._Eta().update(1.0, 1, None) is None
    event = progress.Event(
        phase="eigen H", method="lanczos", run=1, parent=None, unit="matvecs", done=5, total=100
    )
    assert bars.planned_total(event) == 100  # a budget the run goes to the end of: a plan
    capped = dataclasses.replace(event, capped=True)  # a budget Lanczos stops before: not a plan
    assert bars.planned_total(capped) is None
    assert bars.planned_total(dataclasses.replace(capped, expected=40)) == 40


def test_epoch_record_line_fits_80_columns():
    from sharpcli.cli import bars

    record = {
        "epoch": 3,
        "epochs": 10,
        "train_loss": 0.41234567,
        "train_accuracy": 0.8612,
        "test_loss": 0.4410123,
        "test_accuracy": 0.85,
        "seconds": 1.234,
    }
    line = bars.record_line(record, 80)
    assert line == "epoch  3/10  train loss 0.4123 acc 0.861  test loss 0.441 acc 0.850  1.2 s"
    assert bars.record_line(record, 41) == "epoch  3/10  train loss 0.4123 acc 0.861"
