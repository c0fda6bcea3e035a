"""``sharp compare``: reports of several runs side by side in one pandas table.

Each report becomes one row. Besides every scalar result (flattened to dotted
column names such as ``results.hessian.lambda_max``), a few *canonical*
columns gather the same quantity from whichever command produced it, so that a
``train`` report, an ``analyze`` report and a ``gn-nme`` report line up:

| column        | taken from (first present)                                                     |
|---------------|--------------------------------------------------------------------------------|
| regularizers  | settings.regs (train), checkpoint.train.regs (analyses)                       |
| train_accuracy| results.final.train_accuracy, results.accuracy (split train)                  |
| test_accuracy | results.final.test_accuracy, results.accuracy (split test)                    |
| loss          | results.loss, results.final.train_loss                                        |
| lambda_max    | results.hessian.lambda_max, results.eigenvalues[0] (eigen of the Hessian)     |
| trace         | results.hessian.trace(.estimate), results.trace.estimate (trace of H)         |
| frobenius_sq  | results.hessian.frobenius_sq, results.trace.estimate (trace --square)         |
| nme_share     | results.nme_share                                                             |

:func:`differences` tests each run's ``lambda_max`` and ``trace`` against the first run's:
the difference against its combined standard error (each run's probe or residual and data
errors, :func:`canonical_errors`, in quadrature over both runs); ``results.differences`` of
``sharp compare`` and its notes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from sharpcli import catalogue, ledger
from sharpcli.bounded import JsonTooDeep, loads_json, read_data_file
from sharpcli.catalogue.values import CSV, TRACE_KEY, TRAIN
from sharpcli.errors import InputError, UsageError
from sharpcli.report.envelope import validate_report

SUPPORTED_SCHEMAS = ("sharpcli.report/2", "sharpcli.report/1")
CANONICAL = (
    "run",
    "command",
    "regularizers",
    "train_accuracy",
    "test_accuracy",
    "loss",
    "lambda_max",
    TRACE_KEY,
    "frobenius_sq",
    "nme_share",
)
FORMATS = catalogue.TABLE_FORMATS


def read_report(path: str | Path) -> dict:
    """The JSON report at ``path``; an InputError on ``path`` when it is missing, a folder
    or not JSON."""
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", source=str(p))
    if p.is_dir():
        raise InputError(f"{p} is a folder, not a report file", source=str(p))
    ledger.record_input(p, "a compared report")
    try:  # a regular file, read up to its size, nested at most MAX_JSON_DEPTH levels
        report = loads_json(read_data_file(p).decode("utf-8"))
    except JsonTooDeep as exc:
        raise InputError(f"not a JSON report ({exc})", source=str(p)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"not a JSON report ({exc})", source=str(p)) from exc
    except ValueError as exc:  # an integer of more than 4300 digits
        raise InputError("not a JSON report (a number too long to read)", source=str(p)) from exc
    if not isinstance(report, dict) or "schema" not in report:
        raise InputError("not a sharp report (no 'schema' key)", source=str(p))
    if report["schema"] not in SUPPORTED_SCHEMAS:
        raise InputError(
            f"report schema {report['schema']!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_SCHEMAS)}",
            source=str(p),
        )
    if "error" in report:
        raise InputError("is the report of a failed run (it holds an error object)", source=str(p))
    # The shipped schema (what every command's JSON obeys): a hand-edited or truncated report
    # with, say, ``"results": "..."`` is bad input, not a crash further down.
    import jsonschema

    try:
        validate_report(report)
    except jsonschema.ValidationError as exc:
        where = ".".join(str(part) for part in exc.absolute_path) or "top level"
        raise InputError(
            f"not a valid {report['schema']} report ({where}: {exc.message})", source=str(p)
        ) from None
    return report


def _get(d, *path):
    for part in path:
        if isinstance(d, dict) and part in d:
            d = d[part]
        elif isinstance(d, list) and isinstance(part, int) and -len(d) <= part < len(d):
            d = d[part]
        else:
            return None
    return d


def _number(value):
    if isinstance(value, dict):
        value = value.get("estimate")
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _joined(regs) -> str | None:
    """``"ad:sigma=0.1 + wd"`` from a list of regularizer specs; None for anything else (the
    schema leaves ``checkpoint.train``, copied from a checkpoint's metadata, free-form)."""
    if isinstance(regs, list) and regs and all(isinstance(r, str) for r in regs):
        return " + ".join(regs)
    return regs if isinstance(regs, str) and regs else None


def _declared(command) -> Mapping:
    """What the declaration of a report's command says of its report (``info``: whether its
    settings hold the regularizers it trained with, its results the operator's eigenvalues or
    trace); nothing for a command that is not built in."""
    known = isinstance(command, str) and command in catalogue.COMMANDS.builtin_names()
    return catalogue.COMMANDS.entry(command).info if known else {}


def canonical_row(report: dict, name: str) -> dict:
    """The canonical columns of one report (None where the report does not say)."""
    res = report.get("results", {})
    settings = report.get("settings", {})
    command = report.get("command")
    declared = _declared(command)
    split = _get(report, "data", "split")
    regs = (
        settings.get("regs")
        if declared.get("reports_regularizers")
        else _get(report, "checkpoint", TRAIN, "regs")
    )
    row = {"run": name, "command": command, "regularizers": _joined(regs)}
    row["train_accuracy"] = _number(_get(res, "final", "train_accuracy"))
    row["test_accuracy"] = _number(_get(res, "final", "test_accuracy"))
    if row["train_accuracy"] is None and split == TRAIN:
        row["train_accuracy"] = _number(res.get("accuracy"))
    if row["test_accuracy"] is None and split == "test":
        row["test_accuracy"] = _number(res.get("accuracy"))
    row["loss"] = (
        _number(res.get("loss"))
        if res.get("loss") is not None
        else _number(_get(res, "final", "train_loss"))
    )
    lam = _number(_get(res, catalogue.HESSIAN, "lambda_max"))
    if (
        lam is None
        and declared.get("reports_eigenvalues")
        and settings.get("operator", catalogue.HESSIAN) == catalogue.HESSIAN
    ):
        lam = _number(_get(res, "eigenvalues", 0))
    row["lambda_max"] = lam
    tr = _number(_get(res, catalogue.HESSIAN, TRACE_KEY))
    fro = _number(_get(res, catalogue.HESSIAN, "frobenius_sq"))
    if (
        declared.get("reports_trace")
        and settings.get("operator", catalogue.HESSIAN) == catalogue.HESSIAN
    ):
        if settings.get("square"):
            fro = _number(_get(res, TRACE_KEY))
        else:
            tr = _number(_get(res, TRACE_KEY))
    row[TRACE_KEY], row["frobenius_sq"] = tr, fro
    row["nme_share"] = _number(res.get("nme_share"))
    return row


def _first_number(value):
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def canonical_errors(report: dict) -> dict:
    """``{"lambda_max": se, "trace": se}``: each canonical number's combined standard error,
    the probes' (or the eigenvalue's residual) and the data's in quadrature (None where the
    report gives neither).

    From ``results.hessian`` (``trace_stderr``, ``trace_data_stderr``, ``eigen_residuals``,
    ``eigen_data_stderr``) or an ``eigen`` / ``trace`` report of the Hessian
    (``residuals`` and ``data_stderr``; ``trace.stderr`` and ``trace.data_stderr``).
    """
    res = report.get("results", {})
    settings = report.get("settings", {})
    declared = _declared(report.get("command"))
    hessian = res.get(catalogue.HESSIAN) if isinstance(res.get(catalogue.HESSIAN), dict) else {}
    lam = [
        _first_number(hessian.get("eigen_residuals")),
        _first_number(hessian.get("eigen_data_stderr")),
    ]
    tr = [
        _first_number(hessian.get("trace_stderr")),
        _first_number(hessian.get("trace_data_stderr")),
    ]
    of_hessian = settings.get("operator", catalogue.HESSIAN) == catalogue.HESSIAN
    if declared.get("reports_eigenvalues") and of_hessian and lam == [None, None]:
        lam = [_first_number(res.get("residuals")), _first_number(res.get("data_stderr"))]
    trace = res.get(TRACE_KEY)
    if declared.get("reports_trace") and of_hessian and isinstance(trace, dict):
        if not settings.get("square"):
            tr = [_first_number(trace.get("stderr")), _first_number(trace.get("data_stderr"))]

    def quadrature(errors):
        known = [e for e in errors if e is not None]
        return math.sqrt(sum(e * e for e in known)) if known else None

    return {"lambda_max": quadrature(lam), TRACE_KEY: quadrature(tr)}


def differences(paths: list[str], sigmas: float = 2.0) -> list[dict]:
    r"""Each later run's ``lambda_max`` and ``trace`` against the first run's, with the noise.

    For values :math:`a` (first run) and :math:`b` with combined standard errors
    :math:`s_a, s_b` (:func:`canonical_errors`), :math:`z = (b - a) / \sqrt{s_a^2 + s_b^2}`;
    ``"differs"`` when :math:`|z|` exceeds ``sigmas``, else ``"within noise"``.

    Args:
        paths: the reports, the first the reference.
        sigmas: the threshold on :math:`|z|`.

    Returns:
        One ``{"run", "against", "quantity", "difference", "stderr", "z", "verdict"}`` per
        pair where both values and at least one error are known.
    """
    names = run_names(paths)
    reports = [read_report(p) for p in paths]
    rows = [canonical_row(r, n) for r, n in zip(reports, names)]
    errors = [canonical_errors(r) for r in reports]
    out = []
    for i in range(1, len(rows)):
        for quantity in ("lambda_max", TRACE_KEY):
            a, b = rows[0][quantity], rows[i][quantity]
            known = [e for e in (errors[0][quantity], errors[i][quantity]) if e is not None]
            if a is None or b is None or not known:
                continue
            stderr = math.sqrt(sum(e * e for e in known))
            z = (b - a) / stderr if stderr > 0 else math.copysign(math.inf, b - a)
            out.append(
                {
                    "run": names[i],
                    "against": names[0],
                    "quantity": quantity,
                    "difference": b - a,
                    "stderr": stderr,
                    "z": z,
                    "verdict": "differs" if abs(z) > sigmas else "within noise",
                }
            )
    return out


def difference_note(row: dict) -> str:
    """One line of :func:`differences`: the difference, its error and the verdict."""
    return (
        f"{row['quantity']}: {row['run']} - {row['against']} = {row['difference']:.4g} "
        f"+- {row['stderr']:.2g} (z = {row['z']:.2g}): {row['verdict']}"
    )


def _flat_scalars(report: dict) -> dict:
    import pandas as pd

    flat = pd.json_normalize(
        {
            "results": report.get("results", {}),
            "settings": report.get("settings", {}),
            "checkpoint": report.get("checkpoint") or {},
        },
        sep=".",
    ).to_dict(orient="records")[0]
    return {k: v for k, v in flat.items() if isinstance(v, (int, float, str, bool)) or v is None}


def run_names(paths: list[str]) -> list[str]:
    """Row names: each file's stem, lengthened by parent folders only where stems collide
    (``a/report.json`` and ``b/report.json`` become ``a/report`` and ``b/report``)."""
    parts = [Path(p).resolve().with_suffix("").parts for p in paths]
    depth = [1] * len(paths)
    while True:
        names = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        clashes = {n for n in names if names.count(n) > 1}
        grow = [i for i, n in enumerate(names) if n in clashes and depth[i] < len(parts[i])]
        if not grow:
            return names
        for i in grow:
            depth[i] += 1


def compare_table(paths: list[str], *, columns: list[str] | None = None, sort: str | None = None):
    """A DataFrame, one row per report: canonical columns, then (without ``columns``) none else.

    ``columns`` picks columns by name: canonical names or dotted keys of the flattened reports
    (``results.hessian.trace_stderr``, ``settings.lr``).
    """
    import pandas as pd

    if not paths:
        raise UsageError("give at least one report", source="paths")
    rows: list[dict] = []
    seen: set[str] = set()
    for path, name in zip(paths, run_names(paths)):
        report = read_report(path)
        row = canonical_row(report, name)
        extra = _flat_scalars(report)
        seen.update(extra)
        for col in columns or []:
            if col not in CANONICAL:
                row[col] = extra.get(col)
        rows.append(row)
    frame = pd.DataFrame(rows)
    if columns:
        unknown = [c for c in columns if c not in CANONICAL and c not in seen]
        if unknown:
            raise UsageError(f"unknown column {', '.join(unknown)}", source="columns")
        frame = frame[["run"] + [c for c in columns if c != "run"]]
    else:
        keep = [c for c in CANONICAL if c in ("run", "command") or frame[c].notna().any()]
        frame = frame[keep]
    if sort:
        descending = sort.startswith("-")
        key = sort.lstrip("-")
        if key not in frame.columns:
            raise UsageError(
                f"cannot sort by {key!r}; columns: {', '.join(frame.columns)}", source="sort"
            )
        frame = frame.sort_values(key, ascending=not descending, kind="stable", na_position="last")
    return frame.reset_index(drop=True)


def render(frame, fmt: str) -> str:
    """The table as CSV, Markdown or JSON text."""
    if fmt == CSV:
        return frame.to_csv(index=False)
    if fmt == "markdown":
        cols = list(frame.columns)
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        for _, row in frame.iterrows():
            lines.append(
                "| "
                + " | ".join(
                    "" if v is None or v != v else (f"{v:.6g}" if isinstance(v, float) else str(v))
                    for v in row.tolist()
                )
                + " |"
            )
        return "\n".join(lines) + "\n"
    if fmt == "json":
        return frame.to_json(orient="records", indent=2) + "\n"
    raise UsageError(f"unknown format {fmt!r}; accepted: {', '.join(FORMATS)}", source="fmt")
