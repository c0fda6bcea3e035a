"""``--fail-if "KEY OP NUMBER at K se"``: a margin of K combined standard errors, the probes'
(or an eigenvalue's residual) and the data's in quadrature, read beside the value."""

from __future__ import annotations

import math

import pytest

from sharpcli.errors import UsageError
from sharpcli.report.gate import parse_gate, value_errors

# se of lambda_max: residual 3 and data 4 -> 5; se of the trace: 1 and 2 -> sqrt(5)
REPORT = {
    "results": {
        "hessian": {
            "lambda_max": 510.0,
            "eigenvalues": [510.0, 20.0],
            "eigen_residuals": [3.0, 1.0],
            "eigen_data_stderr": [4.0, 2.0],
            "trace": 100.0,
            "trace_stderr": 1.0,
            "trace_data_stderr": 2.0,
        },
        "trace": {"estimate": 100.0, "stderr": 1.0, "data_stderr": 2.0},
        "loss": 0.5,
    }
}


@pytest.mark.parametrize(
    "text, tripped",
    [
        ("hessian.lambda_max > 500", True),  # plain: 510 > 500
        ("hessian.lambda_max > 500 at 1 se", True),  # 10 > 1 * 5
        ("hessian.lambda_max > 500 at 2 se", False),  # 10 = 2 * 5: not beyond
        ("hessian.lambda_max >= 500 at 2 se", True),  # 10 >= 10
        ("hessian.lambda_max > 500 at 2.1 se", False),
        ("hessian.lambda_max < 520 at 1.9 SE", True),  # 10 > 9.5
        ("hessian.lambda_max < 520 at 2.1 se", False),
        ("hessian.eigenvalues.1 > 17 at 1 se", True),  # 3 > sqrt(1 + 4)
        ("hessian.eigenvalues.1 > 18 at 1 se", False),  # 2 < sqrt(5)
        ("hessian.trace != 96 at 1.7 se", True),  # 4 > 1.7 sqrt(5) = 3.8
        ("hessian.trace != 96 at 1.8 se", False),  # 4 < 4.02
        ("hessian.trace == 96 at 1.8 se", True),
        ("trace > 96 at 1.7 se", True),  # {"estimate", "stderr", "data_stderr"}
        ("trace > 96 at 1.8 se", False),
        ("hessian.lambda_max > 500 at 0 se", True),
    ],
)
def test_margin_of_k_standard_errors(text, tripped):
    verdict = parse_gate(text).evaluate(REPORT)
    assert verdict["tripped"] is tripped
    if " at " in text:
        assert verdict["stderr"] == pytest.approx(
            5.0 if "lambda" in text or ".0" in text else math.sqrt(5)
        )


def test_errors_found_beside_the_value():
    assert value_errors(REPORT, "hessian.lambda_max") == (3.0, 4.0)
    assert value_errors(REPORT, "hessian.trace") == (1.0, 2.0)
    assert value_errors(REPORT, "trace") == (1.0, 2.0)
    assert value_errors(REPORT, "hessian.eigenvalues.1") == (1.0, 2.0)
    assert value_errors(REPORT, "loss") == (None, None)


def test_a_value_without_errors_is_refused():
    with pytest.raises(UsageError, match="no standard error for loss"):
        parse_gate("loss > 0.1 at 2 se").evaluate(REPORT)


@pytest.mark.parametrize("text", ["x > 1 at se", "x > 1 at -2 se", "x > 1 at 2", "x > 1 2 se"])
def test_bad_margins_are_refused(text):
    with pytest.raises(UsageError):
        parse_gate(text)
