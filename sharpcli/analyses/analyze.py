"""``sharp analyze``: several metrics of one checkpoint in one report, for CI gates.

Results are keyed so that ``--fail-if`` reads them as dotted paths:
``loss``, ``accuracy``, ``hessian.lambda_max``, ``hessian.lambda_min``,
``hessian.eigenvalues``, ``hessian.trace``, ``hessian.trace_stderr``,
``hessian.frobenius_sq``, ``ggn.*`` and ``nme.*`` and ``nme_share`` (gn-nme),
``activations.*`` (activation-stats), ``sharpness.*`` (adaptive worst-case and average-case
sharpness, [Andriushchenko2023]), ``pac_bayes.*`` (PAC-Bayes sigma and flatness, plain and
magnitude-aware, [Jiang2019]), ``fisher_rao.*`` ([Liang2019]).
"""

from __future__ import annotations

import torch

from sharpcli import catalogue
from sharpcli.analyses import spectrum
from sharpcli.analyses.activations import activation_stats
from sharpcli.analyses.flatness import fisher_rao_norm, pac_bayes_sigma
from sharpcli.analyses.sharpness import SharpnessConfig, sharpness
from sharpcli.curvature.data import all_reduce_sum
from sharpcli.curvature.registry import GGN, HESSIAN, NME
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss

METRICS = catalogue.METRICS
DEFAULT_METRICS = ("eigen", "trace")

_SPLIT_KEYS = ("trace", "trace_stderr", "lambda_max", "lambda_min", "frobenius_sq")
_LAYER_KEYS = (
    "outputs",
    "dead_outputs",
    "death_frequency",
    "activation_frequency",
    "activation_frequency_including_dead",
    "mean_sq_norm",
    "output_shape",
    "output_shape.*",
)
# The numeric result keys of each metric ("" for every run), as ``--fail-if`` reads them:
# "*" is any one key or list index, a list also stands for its first element. ``sharp
# analyze`` checks its gates' keys against these before any work (:mod:`sharpcli.report.gate`);
# a test renders a full report and checks that every number in it matches one.
RESULT_KEYS: dict[str, tuple[str, ...]] = {
    "": ("loss", "accuracy"),
    "eigen": (
        "hessian.lambda_max",
        "hessian.eigenvalues",
        "hessian.eigenvalues.*",
        "hessian.eigen_residuals",
        "hessian.eigen_residuals.*",
    ),
    "trace": ("hessian.trace", "hessian.trace_stderr", "hessian.trace_by_layer.*"),
    "frobenius": ("hessian.frobenius_sq", "hessian.frobenius_sq_stderr"),
    "gn-nme": (
        *(f"hessian.{k}" for k in _SPLIT_KEYS),
        *(f"ggn.{k}" for k in _SPLIT_KEYS),
        *(f"nme.{k}" for k in _SPLIT_KEYS),
        "nme_share",
        "nme_frobenius_ratio",
    ),
    "activation-stats": (
        *(f"activations.layers.*.{k}" for k in _LAYER_KEYS),
        *(
            f"activations.output.{k}"
            for k in ("gini_impurity", "entropy", "confidence", "loss", "accuracy")
        ),
        "activations.penultimate_sq_norm",
        "activations.input_jacobian_fro",
        "activations.input_jacobian_fro_softmax",
        "activations.samples",
    ),
    "sharpness": tuple(
        f"sharpness.{kind}{part}"
        for kind in ("worst_case", "average")
        for part in ("", "_stderr", "_loss_perturbed")
    )
    + ("sharpness.rho",),
    "pac-bayes": tuple(f"pac_bayes.{noise}.*" for noise in ("plain", "magnitude")),
    "fisher-rao": ("fisher_rao.norm_sq", "fisher_rao.norm_sq_empirical"),
}
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
    """Run ``metrics`` on one session; return (results, matvecs)."""

    results: dict = loss_and_accuracy(session)
    results["metrics"] = list(metrics)
    hessian: dict = {}
    matvecs = 0
    e = t = f = g = None  # each estimator's own result, for its notes
    if "eigen" in metrics:
        e = spectrum.eigen(session, top_k=top_k, which="largest", tol=eig_tol, params=params)
        hessian.update(
            lambda_max=e["eigenvalues"][0],
            eigenvalues=e["eigenvalues"],
            eigen_residuals=e["residuals"],
            eigen_converged=e["converged"],
        )
        matvecs += e["matvecs"]
    if "trace" in metrics:
        t = spectrum.trace(session, tol=tol, max_matvecs=max_matvecs, params=params)
        hessian.update(
            trace=t["trace"]["estimate"],
            trace_stderr=t["trace"]["stderr"],
            trace_by_layer={k: v["estimate"] for k, v in t["by_layer"].items()},
        )
        matvecs += t["trace"]["matvecs"]
    if "frobenius" in metrics:
        f = spectrum.trace(session, square=True, tol=tol, max_matvecs=max_matvecs, params=params)
        hessian.update(
            frobenius_sq=f["trace"]["estimate"], frobenius_sq_stderr=f["trace"]["stderr"]
        )
        matvecs += f["trace"]["matvecs"]
    if "gn-nme" in metrics:
        g = spectrum.gn_nme(
            session, tol=tol, eig_tol=eig_tol, max_matvecs=max_matvecs, params=params
        )
        for name in (GGN, NME):
            results[name] = {
                "trace": g[name]["trace"]["estimate"],
                "trace_stderr": g[name]["trace"]["stderr"],
                "lambda_max": g[name]["lambda_max"],
                "lambda_min": g[name]["lambda_min"],
                "frobenius_sq": g[name]["frobenius_sq"],
            }
        h = g[HESSIAN]
        hessian.setdefault("lambda_max", h["lambda_max"])
        hessian.setdefault("trace", h["trace"]["estimate"])
        hessian.setdefault("trace_stderr", h["trace"]["stderr"])
        hessian.setdefault("frobenius_sq", h["frobenius_sq"])
        hessian["lambda_min"] = h["lambda_min"]
        results["nme_share"] = g["nme_share"]
        results["nme_frobenius_ratio"] = g["nme_frobenius_ratio"]
        matvecs += g["matvecs"]
    if "activation-stats" in metrics:
        results["activations"] = activation_stats(session.model, session.analysis_data()).to_dict()
    results.update(_flatness_metrics(session, metrics, params))
    if hessian:
        results[HESSIAN] = hessian
    notes = _notes_of([part for part in (e, t, f, g) if part is not None])
    if notes:
        results["notes"] = notes
    return results, matvecs


def _flatness_metrics(session, metrics: list[str], params: str | None) -> dict:
    """The sharpness, PAC-Bayes and Fisher-Rao metrics (first derivatives and forward passes
    only): adaptive l2 sharpness at rho 0.05 (worst case: 20 Auto-PGD steps; average: 100
    draws) over the whole set, the PAC-Bayes sigma by [Jiang2019]'s bisection, the Fisher-Rao
    norm theta^T F theta and its empirical version."""
    results: dict = {}
    data = session.analysis_data()
    if "sharpness" in metrics:
        found: dict[str, float | None] = {"rho": 0.05}
        for kind, key in (("worst-case", "worst_case"), ("average", "average")):
            config = SharpnessConfig(kind=kind, rhos=(0.05,), params=params, seed=session.seed)
            row = sharpness(session.model, data, config).rows[0]
            found |= {
                key: row.sharpness,
                f"{key}_stderr": row.stderr,
                f"{key}_loss_perturbed": row.loss_perturbed,
            }
        results["sharpness"] = found
    if "pac-bayes" in metrics:
        results["pac_bayes"] = {
            name: pac_bayes_sigma(
                session.model, data, magnitude_aware=aware, params=params, seed=session.seed
            ).to_dict()
            for name, aware in (("plain", False), ("magnitude", True))
        }
    if "fisher-rao" in metrics:
        found = fisher_rao_norm(session.model, data, params)
        results["fisher_rao"] = {
            "norm_sq": found["fisher_rao_norm_sq"],
            "norm_sq_empirical": found["fisher_rao_norm_sq_empirical"],
        }
    return results


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
