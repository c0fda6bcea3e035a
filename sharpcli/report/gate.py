"""Gates (``sharp analyze --fail-if``): a condition ``KEY OP NUMBER`` over a report's dotted key
paths.

``hessian.lambda_max > 500`` holds when the value at that key is greater than
500; the command then exits 1. OP is one of ``> >= < <= == !=``.
"""

from __future__ import annotations

import difflib
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
_PATTERN = re.compile(
    r"^\s*([A-Za-z_][\w.\-]*)\s*(>=|<=|==|!=|>|<)\s*([-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)\s*$"
)


@dataclass(frozen=True)
class Gate:
    """A parsed condition (``text`` as given); its errors name the ``fail_if`` parameter of
    :func:`parse_gate` that it came from."""

    key: str
    op: str
    threshold: float
    text: str

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
        return {
            "expr": self.text,
            "key": self.key,
            "value": value,
            "tripped": bool(_OPS[self.op](value, self.threshold)),
        }


def parse_gate(fail_if: str) -> Gate:
    """The gate of the condition ``fail_if`` (``"hessian.lambda_max > 500"``); a UsageError on
    ``fail_if`` unless it is ``KEY OP NUMBER``."""
    m = _PATTERN.match(fail_if)
    if not m:
        raise UsageError(
            f"{fail_if!r} is not KEY OP NUMBER (OP one of > >= < <= == !=)", source="fail_if"
        )
    return Gate(key=m.group(1), op=m.group(2), threshold=float(m.group(3)), text=fail_if.strip())


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
