"""Kendall's tau against scipy, its permutation p-value, Jiang et al.'s granulated tau
([Kendall1945]; [Jiang2019])."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from scipy import stats

from sharpcli.report.rank_correlation import (
    granulated_tau,
    kendall_tau,
    measure_correlations,
    measure_error,
    permutation_p_value,
    tau_noise_sd,
)


@pytest.mark.parametrize("seed", range(6))
def test_kendall_tau_b_equals_scipy_with_and_without_ties(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 25)
    x = [rng.randint(0, 5) if seed % 2 else rng.random() for _ in range(n)]
    y = [rng.randint(0, 4) if seed % 3 == 0 else rng.gauss(0, 1) for _ in range(n)]
    expected = stats.kendalltau(x, y).statistic
    assert kendall_tau(x, y) == pytest.approx(expected, abs=1e-12)


def test_undefined_tau_and_exact_permutation_p_value():
    assert kendall_tau([1, 1, 1], [1, 2, 3]) is None
    x, y = [1.0, 2.0, 3.0, 4.0, 5.0], [0.3, 0.1, 0.4, 0.5, 0.9]
    tau = kendall_tau(x, y)
    taus = [kendall_tau(x, list(p)) for p in itertools.permutations(y)]
    expected = sum(abs(t) >= abs(tau) - 1e-12 for t in taus) / len(taus)
    assert permutation_p_value(x, y) == pytest.approx(expected)
    # scipy's exact test (no ties) gives the same two-sided p-value
    assert permutation_p_value(x, y) == pytest.approx(stats.kendalltau(x, y).pvalue, rel=1e-9)


def test_random_permutation_p_value_is_near_scipys_for_many_runs():
    rng = random.Random(3)
    x = [rng.random() for _ in range(20)]
    y = [xi + rng.gauss(0, 0.5) for xi in x]
    p = permutation_p_value(x, y, seed=1)
    expected = stats.kendalltau(x, y).pvalue
    assert abs(p - expected) < 0.01 + 0.2 * expected


def test_granulated_tau_averages_over_groups_sharing_the_other_axes():
    records = [{"lr": lr, "wd": wd, "m": lr * 10 + wd} for lr in (1, 2, 3) for wd in (0, 1)]
    gap = [r["lr"] - 5 * r["wd"] for r in records]  # lr: same order; wd: opposite
    found = granulated_tau(records, "m", gap, ["lr", "wd"])
    assert found["per_axis"] == {"lr": 1.0, "wd": -1.0}
    assert found["mean"] == 0.0


def test_measure_correlations_skips_the_gap_inputs_and_axes():
    records = [
        {"run": f"r{i}", "lr": i % 2, "train_accuracy": 1.0, "test_accuracy": 1 - 0.1 * i,
         "lambda_max": float(i), "trace": float(-i), "train_loss": 0.1, "test_loss": 0.1 + i}
        for i in range(5)
    ]  # fmt: skip
    found = measure_correlations(records, gap="error", axes=["lr"])
    assert found["runs"] == 5 and [r["measure"] for r in found["rows"]] == ["lambda_max", "trace"]
    assert found["rows"][0]["tau"] == 1.0 and found["rows"][1]["tau"] == -1.0
    assert found["rows"][0]["p_value"] == pytest.approx(2 / 120)
    assert measure_correlations(records, gap="loss")["rows"][0]["tau"] == 1.0


def test_compare_reports_the_tau_table(tmp_path, capsys):
    import json

    from cli_helpers import run_cli

    paths = []
    for i in range(4):
        final = {"train_accuracy": 1.0, "test_accuracy": 0.9 - 0.05 * i, "train_loss": 0.1,
                 "test_loss": 0.2 + i}  # fmt: skip
        report = {"schema": "sharpcli.report/2", "command": "train", "version": "0", "checkpoint": None,
                  "data": None, "settings": {}, "timing": {"seconds": 1.0, "matvecs": 0},
                  "environment": dict.fromkeys(["python", "torch", "device", "dtype", "threads"], "x"),
                  "results": {"final": final, "history": [], "checkpoint": {"path": "m", "sha256": "0" * 64}, "hessian": {"lambda_max": 10.0 - i}}}  # fmt: skip
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(report))
        paths.append(path)
    run = run_cli(
        capsys, "compare", *paths, "--sort", "-lambda_max", "--gap", "loss", "--json", "-"
    )
    assert run.code == 0, run.err
    kendall = run.json()["results"]["kendall"]
    assert kendall["gap"] == "loss" and kendall["runs"] == 4
    (row,) = [r for r in kendall["rows"] if r["measure"] == "lambda_max"]
    assert row["tau"] == -1.0 and row["p_value"] == pytest.approx(2 / 24)
    table = run_cli(capsys, "compare", *paths)
    assert "Kendall's tau against the gap (test error - train error), 4 runs" in table.out


def test_measure_error_combines_the_probes_and_the_datas_errors():
    record = {"trace": 10.0, "trace_stderr": 0.3, "trace_data_stderr": 0.4, "lambda_max": 2.0}
    assert measure_error(record, "trace") == pytest.approx(0.5, rel=1e-12)
    assert measure_error({"trace": 1.0, "trace_data_stderr": 0.25}, "trace") == 0.25
    assert measure_error(record, "lambda_max") is None


def test_tau_noise_sd_is_zero_for_exact_or_far_apart_measures_and_matches_two_runs_closed_form():
    x, y = [1.0, 2.0, 3.0, 4.0], [0.1, 0.3, 0.2, 0.4]
    assert tau_noise_sd(x, [0.0] * 4, y) == pytest.approx(0.0, abs=1e-12)
    assert tau_noise_sd(x, [1e-6] * 4, y) == pytest.approx(
        0.0, abs=1e-12
    )  # errors far below the gaps: the order holds
    # two runs d = e sqrt(2) apart: tau = +1 with probability p = Phi(1), else -1, so its
    # standard deviation is 2 sqrt(p (1 - p)) = 0.7307
    p = 0.5 * (1 + math.erf(1 / math.sqrt(2)))
    expected = 2 * math.sqrt(p * (1 - p))
    found = [tau_noise_sd([0.0, math.sqrt(2)], [1.0, 1.0], [0.0, 1.0], seed=s) for s in range(8)]
    assert sum(found) / len(found) == pytest.approx(expected, abs=0.03)


def test_measure_correlations_give_the_tau_noise_of_measures_with_errors_only():
    rng = random.Random(3)
    records = []
    for i in range(8):
        gap = i / 10
        records.append(
            {
                "train_accuracy": 1.0,
                "test_accuracy": 1.0 - gap,
                "trace": 10 * gap + rng.gauss(0, 0.1),
                "trace_stderr": 0.5,
                "trace_data_stderr": 0.5,
                "lambda_max": gap + rng.gauss(0, 0.01),
            }
        )
    rows = {r["measure"]: r for r in measure_correlations(records)["rows"]}
    assert set(rows) == {"trace", "lambda_max"}  # the errors are not measures
    assert "tau_noise_sd" not in rows["lambda_max"]
    # trace's runs are 1 apart with a combined error of 0.71 each: the ranking moves
    assert 0.02 < rows["trace"]["tau_noise_sd"] < 0.5
    exact = [dict(r, trace_stderr=0.0, trace_data_stderr=0.0) for r in records]
    assert measure_correlations(exact)["rows"][0]["tau_noise_sd"] == pytest.approx(0.0, abs=1e-12)
