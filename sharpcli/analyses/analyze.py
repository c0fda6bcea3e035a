"""``sharp analyze``: several metrics of one checkpoint in one report, for CI gates.

Results are keyed so that ``--fail-if`` reads them as dotted paths:
``loss``, ``accuracy``, ``hessian.lambda_max``, ``hessian.lambda_min``,
``hessian.eigenvalues``, ``hessian.trace``, ``hessian.trace_stderr``,
``hessian.frobenius_sq``, ``ggn.*`` and ``nme.*`` and ``nme_share`` (gn-nme),
``activations.*`` (activation-stats), ``sharpness.*`` (adaptive worst-case and average-case
sharpness, [Andriushchenko2023]), ``pac_bayes.*`` (PAC-Bayes sigma and flatness, plain and
magnitude-aware, [Jiang2019]), ``fisher_rao.*`` ([Liang2019]).

Each metric is a function of the run (:class:`MetricRun`) declared beside its code
(``@declare("metric", ...)``: here, in :mod:`sharpcli.analyses.activations` and in
:mod:`sharpcli.analyses.sharpness`) with its place in the list, whether it is a default, its
result keys (``keys``, what ``--fail-if`` reads and the docs' table lists) and the rows it adds
to the command's table (``rows``); :func:`analyze` calls the chosen ones through
:data:`sharpcli.catalogue.METRICS` in that order and :func:`table_rows` shows their rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sharpcli import catalogue
from sharpcli.analyses import spectrum
from sharpcli.analyses.flatness import fisher_rao_norm, pac_bayes_sigma
from sharpcli.curvature.operators.registry import GGN, HESSIAN, NME
from sharpcli.curvature.products.data import all_reduce_sum
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss
from sharpcli.registry import declare

# the metrics declared here; activation-stats and sharpness are declared beside their analyses
EIGEN, TRACE, FROBENIUS, GN_NME = "eigen", "trace", "frobenius", "gn-nme"
PAC_BAYES, FISHER_RAO = "pac-bayes", "fisher-rao"

METRICS = catalogue.METRICS
DEFAULT_METRICS = catalogue.DEFAULT_METRICS

_SPLIT_KEYS = (
    "trace",
    "trace_stderr",
    "trace_data_stderr",
    "lambda_max",
    "lambda_min",
    "frobenius_sq",
    "frobenius_sq_data_stderr",
)
# the Hessian's numbers that gn-nme fills in, in this order, where eigen and trace did not
_HESSIAN_FILLED = (
    "lambda_max",
    "trace",
    "trace_stderr",
    "trace_data_stderr",
    "frobenius_sq",
    "frobenius_sq_data_stderr",
)


def result_keys(metric: str) -> tuple[str, ...]:
    """The numeric result keys of ``metric`` ("" for those of every run), as ``--fail-if``
    reads them: "*" is any one key or list index, a list also stands for its first element.

    Each metric declares its own (``info["keys"]``; an extension registered at run time too).
    ``sharp analyze`` checks its gates' keys against these before any work
    (:mod:`sharpcli.report.gate`); a test renders a full report and checks that every number
    in it matches one.

    Args:
        metric: a name of :data:`METRICS`, or "".
    """
    if not metric:
        return ("loss", "accuracy")
    return tuple(METRICS.entry(metric).info.get("keys", ()))


# Numbers outside ``results`` that a gate may read ("**": any path below).
REPORT_KEYS = (
    "timing.seconds",
    "timing.matvecs",
    "environment.threads",
    "environment.world_size",
    "settings.*",
    "data.**",
    "checkpoint.**",
)


@dataclass
class MetricRun:
    """One ``sharp analyze`` run: its session and options, and what its metrics found so far.

    Each metric (:data:`sharpcli.catalogue.METRICS`, declared beside its code as a function of
    the run) adds its results to ``results``, its part of the Hessian's group (which several
    metrics fill) to ``hessian``, its curvature products to ``matvecs`` and each estimator's own
    result to ``parts``, whose notes reach the report.
    """

    session: Any
    top_k: int
    tol: float
    eig_tol: float
    max_matvecs: int
    params: str | None
    results: dict = field(default_factory=dict)
    hessian: dict = field(default_factory=dict)
    matvecs: int = 0
    parts: list = field(default_factory=list)


def parse_metrics(text: str | None) -> list[str]:
    """The metric names of ``text`` (comma-separated; the defaults for None), deduplicated;
    UsageError on an unknown one."""
    names = [m.strip() for m in (text or ",".join(DEFAULT_METRICS)).split(",") if m.strip()]
    unknown = [m for m in names if m not in METRICS]
    if unknown or not names:
        raise UsageError(
            f"unknown metric {', '.join(unknown) or '(none)'}; accepted: {', '.join(METRICS)}",
            source="metrics",
        )
    return list(dict.fromkeys(names))


@torch.no_grad()
def loss_and_accuracy(session) -> dict:
    """Mean loss per sample and accuracy over the session's analysis data, summed across ranks.

    Accuracy is the loss's own count of correct predictions (:attr:`sharpcli.losses.Loss.correct`):
    argmax for cross-entropy, the logit's sign for binary cross-entropy, per labelled position
    for token-level cross-entropy; None for regression.
    """

    loss = get_loss(session.loss)
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, predictions counted
    data = session.analysis_data()
    for xb, yb, _ in data.batches():
        z = session.model(xb)
        sums[0] += float(loss.per_sample(z, yb).double().sum())
        if loss.correct is not None:
            correct, counted = loss.correct(z, yb)
            sums[1] += float(correct)
            sums[2] += float(counted)
    all_reduce_sum(sums)
    n = data.num_samples
    return {
        "loss": float(sums[0]) / n,
        "accuracy": float(sums[1] / sums[2]) if loss.correct is not None and sums[2] else None,
    }


def analyze(
    session,
    metrics: list[str],
    *,
    top_k: int = 1,
    tol: float = 1e-2,
    eig_tol: float = 1e-3,
    max_matvecs: int = 1000,
    params: str | None = None,
) -> tuple[dict, int]:
    """Run ``metrics`` on one session, each in the catalogue's order; return (results, matvecs)."""

    run = MetricRun(session, top_k, tol, eig_tol, max_matvecs, params)
    run.results = loss_and_accuracy(session)
    run.results["metrics"] = list(metrics)
    for name in METRICS.names():
        if name in metrics:
            METRICS.get(name)(run)
    results = run.results
    if run.hessian:
        results[HESSIAN] = run.hessian
    notes = _notes_of(run.parts)
    if notes:
        results["notes"] = notes
    return results, run.matvecs


@declare(
    "metric",
    EIGEN,
    "the largest Hessian eigenvalues, by Lanczos",
    paper="Lanczos1950",
    info={
        "order": 1,
        "default": True,
        "keys": (
            "hessian.lambda_max",
            "hessian.eigenvalues",
            "hessian.eigenvalues.*",
            "hessian.eigen_residuals",
            "hessian.eigen_residuals.*",
            "hessian.eigen_data_stderr",
            "hessian.eigen_data_stderr.*",
        ),
        "rows": ("hessian.lambda_max",),
    },
)
def eigen_metric(run: MetricRun) -> None:
    """``hessian.lambda_max``, ``eigenvalues``, ``eigen_residuals``, ``eigen_converged``."""
    e = spectrum.eigen(
        run.session, top_k=run.top_k, which="largest", tol=run.eig_tol, params=run.params
    )
    run.hessian.update(
        lambda_max=e["eigenvalues"][0],
        eigenvalues=e["eigenvalues"],
        eigen_residuals=e["residuals"],
        eigen_converged=e["converged"],
        eigen_data_stderr=e.get("data_stderr"),  # batch means (the gate's "at K se")
    )
    run.matvecs += e["matvecs"] + (e.get("data_matvecs") or 0)
    run.parts.append(e)


@declare(
    "metric",
    TRACE,
    "tr(H) by Hutch++, and per layer",
    paper="Hutch++",
    info={
        "order": 2,
        "default": True,
        "keys": (
            "hessian.trace",
            "hessian.trace_stderr",
            "hessian.trace_data_stderr",
            "hessian.trace_by_layer.*",
        ),
        "rows": ("hessian.trace", "hessian.trace_stderr", "hessian.trace_data_stderr"),
    },
)
def trace_metric(run: MetricRun) -> None:
    """``hessian.trace``, ``trace_stderr``, ``trace_data_stderr`` (the data's error, batch
    means: :mod:`sharpcli.curvature.products.batch_forms`), ``trace_by_layer``."""
    t = spectrum.trace(run.session, tol=run.tol, max_matvecs=run.max_matvecs, params=run.params)
    run.hessian.update(
        trace=t["trace"]["estimate"],
        trace_stderr=t["trace"]["stderr"],
        trace_data_stderr=t["trace"]["data_stderr"],
        trace_by_layer={k: v["estimate"] for k, v in t["by_layer"].items()},
    )
    run.matvecs += t["trace"]["matvecs"]
    run.parts.append(t)


@declare(
    "metric",
    FROBENIUS,
    "Tr(H^2) = ||H||_F^2, the flatness of [FA] eq. 1",
    paper="FA",
    info={
        "order": 3,
        "keys": (
            "hessian.frobenius_sq",
            "hessian.frobenius_sq_stderr",
            "hessian.frobenius_sq_data_stderr",
        ),
        "rows": (
            "hessian.frobenius_sq",
            "hessian.frobenius_sq_stderr",
            "hessian.frobenius_sq_data_stderr",
        ),
    },
)
def frobenius_metric(run: MetricRun) -> None:
    """``hessian.frobenius_sq``, ``frobenius_sq_stderr``, ``frobenius_sq_data_stderr`` (the
    data's error to first order, from one more block of products:
    :func:`~sharpcli.curvature.products.batch_forms.square_error`)."""
    f = spectrum.trace(
        run.session, square=True, tol=run.tol, max_matvecs=run.max_matvecs, params=run.params
    )
    run.hessian.update(
        frobenius_sq=f["trace"]["estimate"],
        frobenius_sq_stderr=f["trace"]["stderr"],
        frobenius_sq_data_stderr=f["trace"]["data_stderr"],
    )
    run.matvecs += f["trace"]["matvecs"] + f["trace"]["data_matvecs"]
    run.parts.append(f)


def _split_numbers(part: dict) -> dict:
    """One operator's numbers of the split (``sharp gn-nme``'s results), keyed as
    :data:`_SPLIT_KEYS`."""
    trace = part["trace"]
    numbers = {"trace": trace["estimate"], "trace_stderr": trace["stderr"]}
    numbers["trace_data_stderr"] = trace["data_stderr"]
    return numbers | {key: part[key] for key in _SPLIT_KEYS[3:]}


@declare(
    "metric",
    GN_NME,
    "the split H = G + N: traces, extreme eigenvalues, Tr(A^2) and the NME share",
    paper="NME",
    info={
        "order": 4,
        "keys": (
            *(f"hessian.{k}" for k in _SPLIT_KEYS),
            *(f"ggn.{k}" for k in _SPLIT_KEYS),
            *(f"nme.{k}" for k in _SPLIT_KEYS),
            "nme_share",
            "nme_frobenius_ratio",
        ),
        "rows": (
            *(f"hessian.{k}" for k in _HESSIAN_FILLED),
            "hessian.lambda_min",
            "ggn.*",
            "nme.*",
            "nme_share",
        ),
    },
)
def gn_nme_metric(run: MetricRun) -> None:
    """``ggn.*``, ``nme.*``, ``nme_share``, ``nme_frobenius_ratio``, and the Hessian's numbers
    that eigen and trace did not already give."""
    g = spectrum.gn_nme(
        run.session,
        tol=run.tol,
        eig_tol=run.eig_tol,
        max_matvecs=run.max_matvecs,
        params=run.params,
    )
    for name in (GGN, NME):
        run.results[name] = _split_numbers(g[name])
    h = _split_numbers(g[HESSIAN])
    for key in _HESSIAN_FILLED:
        run.hessian.setdefault(key, h[key])
    run.hessian["lambda_min"] = h["lambda_min"]
    run.results["nme_share"] = g["nme_share"]
    run.results["nme_frobenius_ratio"] = g["nme_frobenius_ratio"]
    run.matvecs += g["matvecs"] + g["data_matvecs"]
    run.parts.append(g)


@declare(
    "metric",
    PAC_BAYES,
    "the PAC-Bayes sigma and flatness 1/sigma^2, plain and magnitude-aware, by bisection",
    paper="Jiang2019",
    info={
        "order": 7,
        "keys": tuple(f"pac_bayes.{noise}.*" for noise in ("plain", "magnitude")),
        "rows": tuple(
            f"pac_bayes.{noise}.{k}"
            for noise in ("plain", "magnitude")
            for k in ("sigma", "flatness", "deviation", "deviation_stderr")
        ),
    },
)
def pac_bayes_metric(run: MetricRun) -> None:
    """``pac_bayes.plain`` and ``pac_bayes.magnitude``: [Jiang2019]'s bisection (first
    derivatives and forward passes only)."""
    run.results["pac_bayes"] = {
        name: pac_bayes_sigma(
            run.session.model,
            run.session.analysis_data(),
            magnitude_aware=aware,
            params=run.params,
            seed=run.session.seed,
        ).to_dict()
        for name, aware in (("plain", False), ("magnitude", True))
    }


@declare(
    "metric",
    FISHER_RAO,
    "the Fisher-Rao norm theta^T F theta, and with the data's labels",
    paper="Liang2019",
    info={
        "order": 8,
        "keys": (
            "fisher_rao.norm_sq",
            "fisher_rao.norm_sq_empirical",
            "fisher_rao.norm_sq_data_stderr",
            "fisher_rao.norm_sq_empirical_data_stderr",
        ),
        "rows": ("fisher_rao.*",),
    },
)
def fisher_rao_metric(run: MetricRun) -> None:
    """``fisher_rao.norm_sq`` and ``norm_sq_empirical`` (forward and backward passes only),
    each with its data error (``_data_stderr``: batch means of the per-batch means)."""
    found = fisher_rao_norm(run.session.model, run.session.analysis_data(), run.params)
    run.results["fisher_rao"] = {
        "norm_sq": found["fisher_rao_norm_sq"],
        "norm_sq_empirical": found["fisher_rao_norm_sq_empirical"],
        "norm_sq_data_stderr": found["fisher_rao_norm_sq_data_stderr"],
        "norm_sq_empirical_data_stderr": found["fisher_rao_norm_sq_empirical_data_stderr"],
    }


def table_rows(results: dict) -> dict:
    """The rows of ``sharp analyze``'s table: ``loss``, ``accuracy``, then the ``rows`` that
    each metric run (``results["metrics"]``) declares, in the catalogue's order, each once.

    A row is a dotted path into ``results``, shown where the run holds it; ``GROUP.*`` stands
    for every value of ``results[GROUP]`` that is not a list or a dict, in its order.

    Args:
        results: what :func:`analyze` returned.

    Returns:
        ``{row: value}``, in the table's order.
    """
    rows = {"loss": results["loss"], "accuracy": results["accuracy"]}
    chosen = results.get("metrics") or ()
    for entry in METRICS.entries():
        for row in entry.info.get("rows", ()) if entry.name in chosen else ():
            group, _, leaf = row.rpartition(".")
            if leaf == "*":
                found = _at(results, group)
                for k, v in (found if isinstance(found, dict) else {}).items():
                    if not isinstance(v, (dict, list)):
                        rows.setdefault(f"{group}.{k}", v)
            elif (value := _at(results, row)) is not _ABSENT:
                rows.setdefault(row, value)
    return rows


# a row's value where the run holds none
_ABSENT = object()


def _at(results: dict, path: str) -> Any:
    """The value at the dotted ``path`` of ``results``, or ``_ABSENT``."""
    node: Any = results
    for part in path.split("."):
        node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
    return node


def _notes_of(parts: list, depth: int = 3) -> list[str]:
    """The ``notes`` of the estimators' results in ``parts`` (at any depth up to ``depth``), each
    once, in order: what eigen, trace and gn-nme say about their own numbers (a residual that
    converged only at the products' rounding level, an exact trace) reaches analyze's report."""
    found: list[str] = []

    def visit(node, level):
        if level > depth or not isinstance(node, dict):
            return
        for note in node.get("notes") or []:
            if isinstance(note, str) and note not in found:
                found.append(note)
        for value in node.values():
            visit(value, level + 1)

    for part in parts:
        visit(part, 0)
    return found


def analyze_report(session, settings: dict, results: dict, matvecs: int, gates=()) -> tuple:
    """The ``analyze`` report of ``results`` and whether a gate tripped: ``(report, tripped)``.

    The one place the report is made, for ``sharp analyze`` and for each run of ``sharp
    sweep``: the session's envelope with ``results.gates``, the verdict of each ``--fail-if``
    gate (an empty list without gates), which the schema requires (docs/json.md).
    """
    report = session.report("analyze", settings, results, matvecs=matvecs)
    verdicts = [gate.evaluate(report) for gate in gates]
    report["results"]["gates"] = verdicts
    return report, any(verdict["tripped"] for verdict in verdicts)
