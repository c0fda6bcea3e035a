"""``sharp sweep``: train (then analyse) over a grid of regularizer hyper-parameters and seeds.

Each grid point x seed is one run named ``<reg>-<k>=<v>[-...]-seed<s>-<key>`` in the
output folder, with its checkpoint, its train report (``.train.json``) and its
analysis report (``.analyze.json``). Values are written exactly (``repr`` of the float:
``0.1`` and ``0.1000001`` are two runs; ``%g`` once made them one), and ``<key>`` is
:func:`run_key`, a hash of the run's complete training configuration (model, data, epochs,
learning rate, every setting, the regularizers and the seed), so a sweep run again into the
same folder with other settings trains new runs instead of reusing the old ones under the
new settings' name. The sweep is resumable: a run whose reports exist is skipped (its
analysis is redone when it was made with other ``--metrics`` or ``--analyze-samples``), a
trained run is only analysed, and a run interrupted during training continues from its
resumable state (so it ends bit for bit as an uninterrupted one). A run whose training
diverges (NaN/Inf) is recorded in ``<run>.diverged.json`` (the error object of a failed
``train`` report, with the run's name, regularizers and seed under ``sweep``) and in the
table with empty metrics, and the sweep goes on: a sweep over a regularizer's strength often
reaches one that diverges. At the end the per-run table and the per-value summary (mean and standard deviation over seeds) are written as CSV
and Markdown with a plot of accuracy and sharpness against the swept value, as
the activation-decay paper's Fig. 2 and the flatness-aware paper's table do.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sharpcli import SCHEMA_ID, __version__, catalogue, ledger, progress
from sharpcli.analyses.analyze import analyze, analyze_report, parse_metrics
from sharpcli.analyses.sharpness import SHARPNESS
from sharpcli.atomic import publication, write_text_atomic
from sharpcli.bounded import loads_json
from sharpcli.catalogue.values import TEST, TRACE_KEY, TRAIN
from sharpcli.errors import NumericalError, UsageError
from sharpcli.io.data.loading import parse_data_spec
from sharpcli.regularizers.registry import REGISTRY, parse_reg, parse_regs
from sharpcli.report.compare import render
from sharpcli.report.envelope import dumps, validate_report
from sharpcli.report.plots import plot_sweep
from sharpcli.session import build_session
from sharpcli.training.loop import history_csv_path_for, state_path_for, train, train_report


@dataclass
class SweepResult:
    """What a sweep returns: runs, summary, CSV/Markdown tables, plot, skipped and diverged runs."""

    runs: list[dict]
    summary: list[dict]
    table_csv: str
    summary_csv: str
    summary_markdown: str
    plot: str | None
    skipped: list[str] = field(default_factory=list)
    completed: bool = True
    diverged: list[str] = field(default_factory=list)


def parse_grid(items: list[str]) -> dict[str, list[float]]:
    """``["sigma=0.01,0.05", "eta=0,0.1"]`` -> ``{"sigma": [0.01, 0.05], "eta": [0.0, 0.1]}``."""
    grid: dict[str, list[float]] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"{item!r} is not NAME=V1,V2,...", source="grid")
        name, values = item.split("=", 1)
        if (
            name.strip() in grid
        ):  # a second --grid NAME=... would silently replace the first's values
            raise UsageError(
                f"{name.strip()!r} is given twice; list all its values in one NAME=V1,V2,...",
                source="grid",
            )
        try:
            grid[name.strip()] = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise UsageError(f"{item!r}: values must be numbers", source="grid") from None
        if not all(math.isfinite(v) for v in grid[name.strip()]):
            raise UsageError(f"{item!r}: values must be finite numbers", source="grid")
        if not grid[name.strip()]:
            raise UsageError(f"{item!r} has no values", source="grid")
        if len(set(grid[name.strip()])) != len(grid[name.strip()]):  # same run name twice
            raise UsageError(f"{item!r} repeats a value", source="grid")
    if not grid:
        raise UsageError("give at least one NAME=V1,V2,...", source="grid")
    return grid


def _fmt_value(v: float) -> str:
    """A grid value as a run name writes it: ``repr`` of the float, which tells every two
    floats apart (``f"{v:g}"`` wrote 0.1 and 0.1000001 both as ``0.1``)."""
    return repr(float(v))


def _run_name(reg: str, point: dict, seed: int, key: str) -> str:
    values = [f"{k}={_fmt_value(v)}" for k, v in point.items()]
    return "-".join([reg, *values, f"seed{seed}", key])


def run_key(cfg) -> str:
    """12 hex digits of the sha256 of a run's complete training configuration.

    Every field of the ``TrainConfig`` (canonical JSON), with the data spec completed as
    ``load_dataset`` would (``blobs`` and ``blobs:n=2000`` are the same data; a path is made
    absolute) and the regularizers in their canonical spelling. Runs that differ in any
    setting get different keys, so different files. A data file's content is not hashed: a
    file replaced under the same path keeps its runs' keys.
    """

    config = cfg.to_dict()
    config["data"] = parse_data_spec(cfg.data, label_column=cfg.label_column)
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _run_config(base, reg: str, point: dict, seed: int, extra_regs):
    """The training configuration of one run: ``base`` with its seed and regularizers."""

    cfg = copy.deepcopy(base)
    cfg.seed = seed
    cfg.regs = parse_regs([_point_regularizer(reg, point), *extra_regs])
    return cfg


def _read_json(path: Path) -> dict | None:
    """A report the sweep wrote earlier, or None when it is missing, unreadable or breaks the
    schema (a truncated or hand-edited file: the run is then trained or analysed again)."""
    import jsonschema

    try:
        doc = loads_json(path.read_text())
        validate_report(doc)
    except (OSError, ValueError, jsonschema.ValidationError):
        return None
    return doc if "error" not in doc else None


def run_sweep(
    base,
    reg: str,
    grid: dict[str, list[float]],
    seeds: list[int],
    out_dir: str | Path,
    *,
    metrics: list[str],
    extra_regs: Sequence[str] = (),
    analyze_samples: int | None = 512,
    max_runs: int | None = None,
) -> SweepResult:
    """Run the sweep (see module docstring).

    ``max_runs`` stops after that many new runs, as an interruption would. Everything is validated before anything is created (:func:`_check_sweep`); then per grid
    point and seed, in order, the run is skipped (reports or a divergence record exist) or
    trained (:func:`_train_run`, resumed when interrupted) and analysed (:func:`_analyze_run`).
    """

    metrics = parse_metrics(",".join(metrics))
    points = _check_sweep(reg, grid, seeds, extra_regs)
    out_dir = _make_out_dir(Path(out_dir))
    names = [
        _run_name(reg, p, s, run_key(_run_config(base, reg, p, s, extra_regs)))
        for p, s in itertools.product(points, seeds)
    ]
    _declare_outputs(out_dir, names)
    total = len(points) * len(seeds)
    state = _SweepState(total, progress.start("sweep", total=total, unit="runs"))
    analysis = {"metrics": metrics, "analyze_samples": analyze_samples}
    done_now = 0
    with state.meter:  # closed however the loop ends
        for point, seed in itertools.product(points, seeds):
            cfg = _run_config(base, reg, point, seed, extra_regs)
            name = _run_name(reg, point, seed, run_key(cfg))
            files = _RunFiles.of(out_dir, name)
            train_doc, analyze_doc = _read_json(files.train_json), _read_json(files.analyze_json)
            if files.diverged_json.exists():
                state.record(name, point, seed, None, None, skipped=True, diverged=True)
                continue
            if train_doc is not None and _analysed_with(analyze_doc, analysis):
                state.record(name, point, seed, train_doc, analyze_doc, skipped=True)
                continue
            if max_runs is not None and done_now >= max_runs:
                return state.finish(out_dir, reg, grid, completed=False)
            done_now += 1
            state.meter.update(len(state.runs), detail=name)
            if train_doc is None:
                train_doc = _train_run(cfg, name, files)
            if train_doc is None:  # diverged: recorded in files.diverged_json
                state.record(name, point, seed, None, None, diverged=True)
                continue
            analyze_doc = _analyze_run(base, seed, analysis, name, files, train_doc)
            state.record(name, point, seed, train_doc, analyze_doc)
        return state.finish(out_dir, reg, grid, completed=True)


def _declare_outputs(out_dir: Path, names: list[str]) -> None:
    """Declare (:mod:`sharpcli.ledger`) every file the sweep may write before any run: the
    files of each run still to train or analyse, the tables and the plot. A data file among them
    is then refused before the first run starts, not when the run that writes it comes."""
    for name in names:
        files = _RunFiles.of(out_dir, name)
        trained = _read_json(files.train_json) is not None
        if files.diverged_json.exists() or (trained and files.analyze_json.exists()):
            continue
        for path in files.written(trained):
            ledger.declare_output(path, "out_dir", shared=True)
    for table in _TABLES:
        ledger.declare_output(out_dir / table, "out_dir", shared=True)


def _analysed_with(analyze_doc, analysis: dict) -> bool:
    """Whether an existing analysis report was made with these ``--metrics`` and
    ``--analyze-samples`` (otherwise the run is analysed again)."""
    if not isinstance(analyze_doc, dict) or not isinstance(analyze_doc.get("settings"), dict):
        return False
    settings = analyze_doc["settings"]
    return all(settings.get(key) == value for key, value in analysis.items())


def _point_regularizer(reg: str, point: dict):
    """The regularizer ``reg`` (``NAME[:k=v,...]``, its fixed settings) at a grid point: its
    class made with the point's numbers over them (typed values, checked against the
    hyper-parameters' ranges, never written out as a spec and parsed again)."""

    entry, fixed = REGISTRY.parse(reg)
    return REGISTRY.get(entry.name)(**{**fixed, **point})


def _check_sweep(reg: str, grid: dict, seeds: list[int], extra_regs) -> list[dict]:
    """The grid points (dicts, in product order), after checking that every regularizer spec of
    the sweep parses; UsageError otherwise."""

    if not seeds:
        raise UsageError("give at least one seed", source="seeds")
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    for point in points:
        _point_regularizer(reg, point)
    for extra in extra_regs:
        parse_reg(extra)
    return points


def _make_out_dir(out_dir: Path) -> Path:
    """``out_dir``, created when missing (its parent must exist); UsageError if it is a file."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError("is not a folder", source=str(out_dir))
    if not out_dir.exists():
        if not out_dir.parent.is_dir():
            raise UsageError(f"folder {out_dir.parent} does not exist", source=str(out_dir))
        out_dir.mkdir()
    return out_dir


@dataclass
class _RunFiles:
    """The files of one run in the sweep folder."""

    ckpt: Path
    train_json: Path
    analyze_json: Path
    diverged_json: Path

    def written(self, trained: bool) -> list[Path]:
        """The files a run writes: the analysis report, and unless ``trained`` already, the
        checkpoint with its history CSV and state, the train report or the divergence record."""

        if trained:
            return [self.analyze_json]
        training = [self.ckpt, history_csv_path_for(self.ckpt), state_path_for(self.ckpt)]
        return [*training, self.train_json, self.diverged_json, self.analyze_json]

    @classmethod
    def of(cls, out_dir: Path, name: str) -> "_RunFiles":
        """The files of run ``name`` in ``out_dir``."""
        return cls(
            ckpt=out_dir / f"{name}.safetensors",
            train_json=out_dir / f"{name}.train.json",
            analyze_json=out_dir / f"{name}.analyze.json",
            diverged_json=out_dir / f"{name}.diverged.json",
        )


def _train_run(cfg, name: str, files: _RunFiles) -> dict | None:
    """Train one run (resuming an interrupted one) and write its train report, which is returned.

    The checkpoint, its history, final state and the train report are published together when
    the run ends (an interrupted sweep keeps the runs it completed). A NaN/Inf objective writes
    ``files.diverged_json`` instead (the error document of a failed ``train`` report, so it
    validates against the report schema) and returns None.
    """

    resume = state_path_for(files.ckpt).exists()
    try:
        with publication(own=True):
            result = train(cfg, files.ckpt, resume=resume)
            train_doc = train_report(
                result, {"sweep": name}, out=str(files.ckpt), device=cfg.device, dtype=cfg.dtype
            )
            write_text_atomic(files.train_json, dumps(train_doc))
    except NumericalError as exc:
        record = {
            "schema": SCHEMA_ID,
            "command": "train",
            "version": __version__,
            "error": exc.to_json(),
            "sweep": {"run": name, "regs": cfg.to_dict()["regs"], "seed": cfg.seed},
        }
        with publication(own=True):
            write_text_atomic(files.diverged_json, dumps(record))
        return None
    return train_doc


def _analyze_run(
    base, seed: int, analysis: dict, name: str, files: _RunFiles, train_doc: dict
) -> dict:
    """Analyse a trained run and write its analysis report, which is returned.

    The analysis split is the test split when the data has one, else the training split; at
    most ``analysis["analyze_samples"]`` of its samples (a seeded subset) are used, for the
    metrics ``analysis["metrics"]``. The report is ``sharp analyze``'s
    (:func:`sharpcli.analyses.analyze.analyze_report`), with the analysis settings in
    ``settings``.
    """

    metrics, analyze_samples = analysis["metrics"], analysis["analyze_samples"]
    has_test = train_doc["results"]["final"].get("test_accuracy") is not None

    def session_of(samples: int | None):
        return build_session(
            str(files.ckpt),
            split=TEST if has_test else TRAIN,
            samples=samples,
            dtype=base.dtype,
            device=base.device,
            seed=seed,
            token_reduction=base.token_reduction,  # the averaging the runs trained on
        )

    session = session_of(None)
    if analyze_samples is not None and session.num_samples > analyze_samples:
        session = session_of(analyze_samples)
    results, matvecs = analyze(session, metrics)
    analyze_doc, _ = analyze_report(session, {**analysis, "sweep": name}, results, matvecs)
    with publication(own=True):  # now: the run is complete, whatever happens to the sweep
        write_text_atomic(files.analyze_json, dumps(analyze_doc))
    return analyze_doc


@dataclass
class _SweepState:
    """The rows so far, which runs were skipped or diverged, and the sweep's progress run
    (:mod:`sharpcli.progress`; each training run and analysis inside it reports its own)."""

    total: int
    meter: progress.Run
    runs: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    diverged: list = field(default_factory=list)

    def record(
        self, name, point, seed, train_doc, analyze_doc, *, skipped=False, diverged=False
    ) -> None:
        """Add run ``name``'s row (:func:`_row`) and report progress."""
        if skipped:
            self.skipped.append(name)
        if diverged:
            self.diverged.append(name)
        self.runs.append(_row(name, point, seed, train_doc, analyze_doc))
        self.meter.update(len(self.runs), detail=name)

    def finish(self, out_dir: Path, reg: str, grid: dict, *, completed: bool) -> SweepResult:
        """Write the tables (and, when completed, the plot): :func:`_finish`."""
        return _finish(
            self.runs,
            out_dir,
            reg,
            grid,
            completed=completed,
            skipped=self.skipped,
            diverged=self.diverged,
        )


def _row(name, point, seed, train_doc, analyze_doc) -> dict:
    """One run's row; a diverged run (no reports) has every metric None."""
    final = train_doc["results"]["final"] if train_doc else {}
    res = analyze_doc["results"] if analyze_doc else {}
    hessian = res.get(catalogue.HESSIAN, {})
    return {
        "run": name,
        **point,
        "seed": seed,
        "train_accuracy": final.get("train_accuracy"),
        "test_accuracy": final.get("test_accuracy"),
        "train_loss": final.get("train_loss"),
        "test_loss": final.get("test_loss"),
        "lambda_max": hessian.get("lambda_max"),
        TRACE_KEY: hessian.get(TRACE_KEY),
        "frobenius_sq": hessian.get("frobenius_sq"),
        # the measures' errors, which the Kendall tau table's tau_noise_sd reads
        "lambda_max_data_stderr": _first(hessian.get("eigen_data_stderr")),
        "trace_stderr": hessian.get("trace_stderr"),
        "trace_data_stderr": hessian.get("trace_data_stderr"),
        "frobenius_sq_stderr": hessian.get("frobenius_sq_stderr"),
        "frobenius_sq_data_stderr": hessian.get("frobenius_sq_data_stderr"),
        "nme_share": res.get("nme_share"),
        **_flatness_columns(res),
    }


def _first(values):
    """The first of a list (lambda_max's among the top eigenvalues' errors), else ``values``."""
    return values[0] if isinstance(values, list) and values else values


# analyze's flatness metrics as sweep columns (only those the analysis reported), for the
# Kendall tau table: (column, path in the analyze results)
_FLATNESS_COLUMNS = (
    ("adaptive_sharpness", (SHARPNESS, "worst_case")),
    ("average_sharpness", (SHARPNESS, "average")),
    ("pac_bayes_flatness", ("pac_bayes", "plain", "flatness")),
    ("pac_bayes_mag_flatness", ("pac_bayes", "magnitude", "flatness")),
    ("fisher_rao_norm_sq", ("fisher_rao", "norm_sq")),
    ("fisher_rao_norm_sq_empirical", ("fisher_rao", "norm_sq_empirical")),
)


def _flatness_columns(res: dict) -> dict:
    out = {}
    for column, path in _FLATNESS_COLUMNS:
        node: object = res
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            out[column] = node
    return out


def _summary(runs: list[dict], grid: dict) -> list[dict]:
    import pandas as pd

    frame = pd.DataFrame(runs)
    keys = list(grid)
    out = []
    for values, group in frame.groupby(keys, sort=True):
        values = values if isinstance(values, tuple) else (values,)
        row = dict(zip(keys, [float(v) for v in values]))
        row["seeds"] = int(
            pd.to_numeric(group["train_accuracy"], errors="coerce").notna().sum()
        )  # not diverged
        for col in (
            "train_accuracy",
            "test_accuracy",
            "lambda_max",
            TRACE_KEY,
            "frobenius_sq",
            "nme_share",
        ):
            series = pd.to_numeric(group[col], errors="coerce").dropna()
            row[f"{col}_mean"] = float(series.mean()) if len(series) else None
            row[f"{col}_std"] = (
                float(series.std(ddof=1)) if len(series) > 1 else (0.0 if len(series) else None)
            )
        out.append(row)
    return out


# The sweep's own files in its folder: the per-run table, the summary (CSV, Markdown), the plot.
_TABLES = ("sweep-runs.csv", "sweep-summary.csv", "sweep-summary.md", "sweep.png")


def _finish(
    runs, out_dir: Path, reg: str, grid: dict, *, completed: bool, skipped: list, diverged: list
) -> SweepResult:
    import pandas as pd

    table_csv, summary_csv, summary_md, plot_png = (out_dir / name for name in _TABLES)
    summary = _summary(runs, grid) if runs else []
    plot = None
    if runs:
        write_text_atomic(table_csv, pd.DataFrame(runs).to_csv(index=False))
        frame = pd.DataFrame(summary)
        write_text_atomic(summary_csv, frame.to_csv(index=False))
        write_text_atomic(summary_md, render(frame, "markdown"))
        if completed:
            param = next(iter(grid))
            keys = (
                ("lambda_max", TRACE_KEY)
                if any(r.get("trace_mean") is not None for r in summary)
                else ("lambda_max",)
            )
            plot = str(plot_sweep(summary, param, plot_png, sharpness_keys=keys))
    return SweepResult(
        runs=runs,
        summary=summary,
        table_csv=str(table_csv),
        summary_csv=str(summary_csv),
        summary_markdown=str(summary_md),
        plot=plot,
        skipped=skipped,
        completed=completed,
        diverged=diverged,
    )
