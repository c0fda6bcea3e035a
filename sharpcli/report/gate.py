r"""Gates (``sharp analyze --fail-if``): a condition ``KEY OP NUMBER [at K se]`` over a report's
dotted key paths.

``hessian.lambda_max > 500`` holds when the value at that key is greater than
500; the command then exits 1. OP is one of ``> >= < <= == !=``.

``hessian.lambda_max > 500 at 2 se`` holds only when the value exceeds 500 by more than 2
combined standard errors, :math:`v - 500 > 2\,\mathrm{se}`, with
:math:`\mathrm{se} = \sqrt{\mathrm{se}_{\mathrm{probe}}^2 + \mathrm{se}_{\mathrm{data}}^2}`
from the report's error fields beside the value (:func:`value_errors`): a difference the
noise could make does not trip it. ``<`` and ``<=`` mirror it (:math:`500 - v > 2\,\mathrm{se}`);
``!=`` trips when :math:`|v - 500| > K\,\mathrm{se}` and ``==`` when
:math:`|v - 500| \le K\,\mathrm{se}`. A value without error fields is a UsageError.
"""

from __future__ import annotations

import difflib
import math
import operator
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from sharpcli.errors import UsageError
from sharpcli.report.envelope import lookup

_OPS = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_PATTERN = re.compile(
    rf"^\s*([A-Za-z_][\w.\-]*)\s*(>=|<=|==|!=|>|<)\s*({_NUMBER})"
    rf"(?:\s+at\s+({_NUMBER})\s*se)?\s*$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Gate:
    """A parsed condition (``text`` as given); its errors name the ``fail_if`` parameter of
    :func:`parse_gate` that it came from."""

    key: str
    op: str
    threshold: float
    text: str
    sigmas: float | None = None  # ``at K se``: the margin in combined standard errors

    def evaluate(self, report: dict) -> dict:
        """The gate on ``report``: the value at ``key`` and whether the condition tripped;
        UsageError unless the value is a number."""
        try:
            value = lookup(report, self.key)
        except KeyError:
            raise UsageError(
                f"{self.text!r}: the report has no key {self.key!r}", source="fail_if"
            ) from None
        if isinstance(value, dict) and "estimate" in value:
            value = value["estimate"]
        if isinstance(value, list):
            if not value:
                raise UsageError(f"{self.text!r}: {self.key} is an empty list", source="fail_if")
            value = value[0]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise UsageError(f"{self.text!r}: {self.key} is not a number", source="fail_if")
        verdict = {"expr": self.text, "key": self.key, "value": value}
        if self.sigmas is None:
            return {**verdict, "tripped": bool(_OPS[self.op](value, self.threshold))}
        probe, data = value_errors(report, self.key)
        if probe is None and data is None:
            raise UsageError(
                f"{self.text!r}: the report gives no standard error for {self.key}",
                source="fail_if",
            )
        stderr = math.hypot(probe or 0.0, data or 0.0)
        return {
            **verdict,
            "stderr": stderr,
            "probe_stderr": probe,
            "data_stderr": data,
            "tripped": beyond(value, self.op, self.threshold, self.sigmas * stderr),
        }


def beyond(value: float, op: str, threshold: float, margin: float) -> bool:
    """Whether ``value OP threshold`` holds by more than ``margin`` (module docstring)."""
    gap = value - threshold
    if op in (">", ">="):
        return gap > margin if op == ">" else gap >= margin
    if op in ("<", "<="):
        return -gap > margin if op == "<" else -gap >= margin
    if op == "!=":
        return abs(gap) > margin
    return abs(gap) <= margin


def _first(value):
    """A number, or the first of a list of numbers, else None."""
    if isinstance(value, list):
        value = value[0] if value else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _entry(values, index: int) -> float | None:
    """Entry ``index`` of a list of numbers, None when there is none."""
    if not isinstance(values, list) or not -len(values) <= index < len(values):
        return None
    return _first(values[index])


def value_errors(report: dict, key: str) -> tuple[float | None, float | None]:
    """``(probe error, data error)`` of the value at ``key``, from the fields beside it.

    The probes' error: ``stderr`` of a value ``{"estimate", "stderr", "data_stderr"}``, else
    the sibling ``NAME_stderr``, else the eigenvalue's residual (``residuals`` or
    ``eigen_residuals``, first entry, for ``eigenvalues`` and ``lambda_max``: it bounds the
    distance to an eigenvalue). The data's: ``data_stderr`` of such a value, else the sibling
    ``NAME_data_stderr``, else ``data_stderr`` beside ``eigenvalues`` (first entry).

    Args:
        report: the report.
        key: the dotted key.

    Returns:
        Each error, None where the report has none.
    """
    value = lookup(report, key)
    if isinstance(value, dict):
        return _first(value.get("stderr")), _first(value.get("data_stderr"))
    parent_key, _, name = key.rpartition(".")
    if name.lstrip("-").isdigit() and parent_key.rpartition(".")[2] == "eigenvalues":
        # an eigenvalue by index: its residual and data error by the same index
        owner_key = parent_key.rpartition(".")[0]
        owner = lookup(report, owner_key) if owner_key else report.get("results", report)
        prefix = "eigen_" if "eigen_residuals" in owner else ""
        return (
            _entry(owner.get(f"{prefix}residuals"), int(name)),
            _entry(owner.get(f"{prefix}data_stderr"), int(name)),
        )
    try:
        parent = lookup(report, parent_key) if parent_key else report.get("results", report)
    except KeyError:
        return None, None
    if not isinstance(parent, dict):
        return None, None
    probe = _first(parent.get(f"{name}_stderr"))
    data = _first(parent.get(f"{name}_data_stderr"))
    if name in ("eigenvalues", "lambda_max"):
        if probe is None:
            probe = _first(parent.get("residuals", parent.get("eigen_residuals")))
        if data is None:
            data = _first(
                parent.get("data_stderr" if name == "eigenvalues" else "eigen_data_stderr")
            )
    return probe, data


def parse_gate(fail_if: str) -> Gate:
    """The gate of the condition ``fail_if`` (``"hessian.lambda_max > 500"``, ``"... at 2 se"``);
    a UsageError on ``fail_if`` unless it is ``KEY OP NUMBER [at K se]``."""
    m = _PATTERN.match(fail_if)
    if not m:
        raise UsageError(
            f"{fail_if!r} is not KEY OP NUMBER [at K se] (OP one of > >= < <= == !=)",
            source="fail_if",
        )
    sigmas = None if m.group(4) is None else float(m.group(4))
    if sigmas is not None and not sigmas >= 0:
        raise UsageError(f"{fail_if!r}: K of 'at K se' must be >= 0", source="fail_if")
    return Gate(
        key=m.group(1),
        op=m.group(2),
        threshold=float(m.group(3)),
        text=fail_if.strip(),
        sigmas=sigmas,
    )


def _matches(parts: list[str], pattern: str) -> bool:
    """Whether a dotted key (``parts``) is one of ``pattern``'s ("*": one segment, a final
    "**": any path below)."""
    segments = pattern.split(".")
    for i, segment in enumerate(segments):
        if segment == "**":
            return True
        if i >= len(parts) or (segment != "*" and segment != parts[i]):
            return False
    return len(parts) == len(segments)


def _known(key: str, patterns: Sequence[str]) -> bool:
    parts = key.split(".")
    # lookup() reads results first, then the whole report: "results.X" names the same X
    return any(_matches(parts, p) for p in patterns) or (
        parts[0] == "results" and len(parts) > 1 and any(_matches(parts[1:], p) for p in patterns)
    )


def _suggestion(key: str, available: Sequence[str], elsewhere: Mapping[str, str]) -> str:
    """``; did you mean 'X'?`` for the closest concrete key (same last part first, then the
    closest spelling), preferring keys available in this run; '' when nothing is close."""
    ranked = [(p, "") for p in available] + [(p, f" (with {w})") for p, w in elsewhere.items()]
    concrete = [(p, w) for p, w in ranked if "*" not in p]
    last = key.split(".")[-1]
    for path, where in concrete:
        if path.split(".")[-1] == last and path != key:
            return f"; did you mean {path!r}{where}?"
    close = difflib.get_close_matches(key, [p for p, _ in concrete], n=1, cutoff=0.6)
    if not close:
        return ""
    where = dict(reversed(concrete))[close[0]]
    return f"; did you mean {close[0]!r}{where}?"


def check_keys(
    gates: Sequence[Gate], available: Sequence[str], elsewhere: Mapping[str, str]
) -> None:
    """Refuse, before any work, a gate whose key no run with these options reports.

    ``available``: the key patterns (see :func:`_matches`) this run's report will hold;
    ``elsewhere``: patterns other options would add, each with that option
    (``{"nme_share": "--metrics gn-nme"}``). Raises :class:`UsageError` on ``--fail-if``
    naming the option that would add the key, or the closest key ("did you mean").
    """
    for gate in gates:
        if _known(gate.key, available):
            continue
        needs = [w for p, w in elsewhere.items() if _known(gate.key, [p])]
        if needs:
            raise UsageError(
                f"{gate.text!r}: {gate.key!r} is only reported with {needs[0]}", source="fail_if"
            )
        raise UsageError(
            f"{gate.text!r}: the report has no key {gate.key!r}"
            + _suggestion(gate.key, available, elsewhere),
            source="fail_if",
        )
