"""Gates (``sharp analyze --fail-if``): a condition ``KEY OP NUMBER`` over a report's dotted key
paths.

``hessian.lambda_max > 500`` holds when the value at that key is greater than
500; the command then exits 1. OP is one of ``> >= < <= == !=``.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

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
    """A parsed condition (``text`` as given); its errors name the ``condition`` parameter of
    :func:`parse_gate` that it came from."""

    key: str
    op: str
    threshold: float
    text: str

    def evaluate(self, report: dict) -> dict:
        try:
            value = lookup(report, self.key)
        except KeyError:
            raise UsageError(
                f"{self.text!r}: the report has no key {self.key!r}", source="condition"
            ) from None
        if isinstance(value, dict) and "estimate" in value:
            value = value["estimate"]
        if isinstance(value, list):
            if not value:
                raise UsageError(f"{self.text!r}: {self.key} is an empty list", source="condition")
            value = value[0]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise UsageError(f"{self.text!r}: {self.key} is not a number", source="condition")
        return {
            "expr": self.text,
            "key": self.key,
            "value": value,
            "tripped": bool(_OPS[self.op](value, self.threshold)),
        }


def parse_gate(condition: str) -> Gate:
    """The gate of ``condition`` (``"hessian.lambda_max > 500"``); a UsageError on ``condition``
    unless it is ``KEY OP NUMBER``."""
    m = _PATTERN.match(condition)
    if not m:
        raise UsageError(
            f"{condition!r} is not KEY OP NUMBER (OP one of > >= < <= == !=)", source="condition"
        )
    return Gate(key=m.group(1), op=m.group(2), threshold=float(m.group(3)), text=condition.strip())
