"""``docs/reproduce.md`` runs as written and every verdict's number relation holds.

Every command of the page runs in order in one folder (the ``sharp`` commands in this
process, the fixture script that writes the digits file as a subprocess), each exits as
documented, every report validates against the schema, and the relation each claim's verdict
states is asserted on the ``--json`` reports, for the built-in ``blobs`` and for the real
``digits`` data (slow). A file of its own, so that ``pytest --dist loadfile`` runs it beside
``tests/docs/test_docs.py``. The page parser is ``docs/reproduce/run_guide.py``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[2]
REPRODUCE = ROOT / "docs" / "reproduce.md"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "reproduce" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


run_guide = _load("run_guide")
examples = _load("examples")


def _schema() -> dict:
    import sharpcli

    return json.loads((Path(sharpcli.__file__).parent / "report" / "schema.json").read_text())


def _rows_by_sigma(rows):
    return {round(row["sigma"], 6): row for row in rows}


def test_the_page_runs_every_claim_on_both_datasets():
    """Fast: the page's commands cover claims 1-8 on blobs and on the digits file."""
    commands = run_guide.extract_commands(REPRODUCE.read_text(encoding="utf-8"))
    targets = {command.option("--json") for command in commands} - {None}
    digits = {
        "digits-theorem2.json",
        "digits-corollary1-1.json",
        "digits-gn-nme-relu.json",
        "digits-nso-relu.json",
        "digits-rescale-layer.json",
        "digits-dead-masked.json",
        "fa-digits.json",
        "digits-gp-augmented-relu-train.json",
        "digits-gn-nme-gp-augmented-relu.json",
        "corollary1-digits-gelu.json",
    }
    assert digits <= targets, digits - targets
    assert {"eos-lr1.json", "eos-lr05.json"} <= targets  # the edge of stability, two rates
    assert {"eos-adam.json", "eos-sgd.json"} <= targets  # Adam's, and mini-batch SGD's
    # the papers' claims on the two datasets; the edge of stability on its own blobs
    data = ("blobs:n=800", "digits.npz", "blobs:n=640,separation=1")
    for command in commands:
        if command.program == "sharp" and command.option("--data"):
            assert command.option("--data") in data, command.text


# ----------------------------------------------------------------------------- the claims
def _theorem2(report, prefix: str, taylor_cap: float):
    """1. AD Theorem 2 for every sample; Taylor (Thm 3) within 2 % at sigma = 0.1 and below
    the smoothed loss (not a bound) at sigma 0.5 and 1, by ``taylor_cap`` at sigma = 1."""
    theorem2 = _rows_by_sigma(report(f"{prefix}theorem2.json")["results"]["theorem2"])
    assert sorted(theorem2) == [0.1, 0.5, 1.0]
    for row in theorem2.values():
        assert row["fraction_holds"] == 1.0 and row["violations"] == 0
        assert row["cross_entropy"] <= row["smoothed_cross_entropy"] <= row["bound"]
    small = theorem2[0.1]
    assert abs(small["taylor"] - small["smoothed_cross_entropy"]) < 0.02 * small["taylor"]
    assert theorem2[0.5]["taylor"] < theorem2[0.5]["smoothed_cross_entropy"]
    assert theorem2[1.0]["taylor"] < taylor_cap * theorem2[1.0]["smoothed_cross_entropy"]


def _corollary_trend(report, prefix: str):
    """2. Models trained with ad:sigma: the region's bound and the smoothed norm fall with
    sigma (holding by construction over the points); read at theta (AD), the bound is about
    lambda_max at theta (erf ~ 1) and the smoothed norm within 30 % of it, either side;
    sigma = 1 underfits. Returns the plain lambda_max."""
    rows = [
        report(f"{prefix}corollary1-{s}.json")["results"]["rows"][0] for s in ("0.1", "0.3", "1")
    ]
    bounds = [row["bound_region"] for row in rows]
    smoothed = [row["empirical"] for row in rows]
    assert bounds[0] > bounds[1] > bounds[2]
    assert smoothed[0] > smoothed[1] > smoothed[2]
    assert all(row["verdict_region"] == "holds by construction" for row in rows)
    for row in rows:
        assert 0.8 * row["plain_lambda_max"] <= row["bound_at_theta"] <= row["H_at_theta"]
        assert 0.7 < row["ratio_at_theta"] < 1.3
        assert row["holds_at_theta"] == (row["verdict_at_theta"] == "holds")
    assert report(f"{prefix}ad-1-train.json")["results"]["final"]["train_accuracy"] < 0.6
    return [row["plain_lambda_max"] for row in rows]


def _gn_nme(report, prefix: str):
    """3. H = G + N; ReLU: tr(N) = 0 within noise, N itself not zero; GELU: tr(N) > 0
    clearly; the Hutchinson tr(G) agrees with the exact tr(G)."""
    split = {k: report(f"{prefix}gn-nme-{k}.json")["results"] for k in ("relu", "gelu")}
    for kind, res in split.items():
        h, g, n = (res[op]["trace"]["estimate"] for op in ("hessian", "ggn", "nme"))
        assert abs(h - (g + n)) <= 1e-5 * abs(h), kind
        check = res["ggn_trace_check"]
        assert abs(check["exact"] - check["hutchinson"]) <= 3 * check["hutchinson_stderr"], kind
    relu_nme, gelu_nme = split["relu"]["nme"]["trace"], split["gelu"]["nme"]["trace"]
    assert abs(relu_nme["estimate"]) <= 3 * relu_nme["stderr"]
    assert split["relu"]["nme_frobenius_ratio"] > 0.1
    assert gelu_nme["estimate"] >= 5 * gelu_nme["stderr"]
    assert split["gelu"]["nme_share"] > 0.03 > abs(split["relu"]["nme_share"])


def _nso(report, prefix: str):
    gelu = _rows_by_sigma(report(f"{prefix}nso-gelu.json")["results"]["noise_stability"]["rows"])
    relu = _rows_by_sigma(report(f"{prefix}nso-relu.json")["results"]["noise_stability"]["rows"])
    assert gelu[0.01]["relative_error"] < 0.02
    assert gelu[0.03]["relative_error"] < 0.10
    assert gelu[0.1]["relative_error"] > 0.10
    return gelu, relu


def _layer_rescale(report, prefix: str):
    """5. Dinh et al. layer rescaling: function identical, lambda_max up > 10x, invariant
    unchanged."""
    layer = report(f"{prefix}rescale-layer.json")["results"]
    base, scaled = layer["baseline"], layer["rows"][0]
    assert scaled["accuracy"] == base["accuracy"]
    assert scaled["max_logit_change"] < 1e-4
    assert scaled["lambda_max"] > 10 * base["lambda_max"]
    assert scaled["invariant_lambda_max"] == pytest.approx(base["invariant_lambda_max"], rel=1e-3)
    glob = report(f"{prefix}rescale-global.json")["results"]
    assert glob["rows"][0]["alpha"] == 10.0
    return glob["baseline"], glob["rows"][0]


def _dead(report, prefix: str):
    """6. Fixed 70 % mask: most units dead; returns the plain and masked Hessian entries."""
    layers = report(f"{prefix}dead-activations.json")["results"]["layers"]
    assert all(layer["death_frequency"] >= 0.6 for layer in layers)
    return (
        report(f"{prefix}dead-relu.json")["results"]["hessian"],
        report(f"{prefix}dead-masked.json")["results"]["hessian"],
    )


def _run_page_in_process(workdir: Path, monkeypatch) -> None:
    """Every command of the page in order in ``workdir``: ``sharp`` commands in this process
    (what a subprocess would add is the ~5 CPU s of importing torch, 50 times over), the fixture
    script as the subprocess the page shows; each must exit as documented."""
    monkeypatch.chdir(workdir)
    with examples.environment():
        for command in run_guide.extract_commands(REPRODUCE.read_text(encoding="utf-8")):
            if command.program == "python":
                result = run_guide.run_command(command, workdir)
                code, out, err = result.code, result.stdout, result.stderr
            else:
                code, out, err = examples.run_in_process(command.args)
            assert code == command.expected_exit, (
                f"reproduce.md:{command.line}: {command.text}\nexit {code}\n"
                f"{out[-2000:]}\n{err[-2000:]}"
            )


@pytest.mark.slow
def test_reproduce_guide_claims(tmp_path, monkeypatch):  # noqa: C901 - one block per claim
    """docs/reproduce.md, every command in order; then each claim's relation."""
    _run_page_in_process(tmp_path, monkeypatch)

    def report(name: str) -> dict:
        return json.loads((tmp_path / name).read_text())

    schema = _schema()
    for path in tmp_path.glob("*.json"):
        jsonschema.validate(json.loads(path.read_text()), schema)

    # 1. AD Theorem 2: holds on both; Taylor well below the smoothed loss at sigma = 1
    _theorem2(report, "", taylor_cap=0.5)
    _theorem2(report, "digits-", taylor_cap=0.8)

    # 2. AD Corollary 1 over ad:sigma. Blobs: the plain lambda_max at theta falls, then
    #    ticks up at sigma = 1. Digits: it falls monotonically, like the bound.
    plain = _corollary_trend(report, "")
    assert plain[0] > plain[1] and plain[2] > plain[1]
    plain = _corollary_trend(report, "digits-")
    assert plain[0] > plain[1] > plain[2]
    assert report("digits-ad-1-train.json")["results"]["final"]["test_accuracy"] < 0.5

    # 3. H = G + N on both datasets, the same relations
    _gn_nme(report, "")
    _gn_nme(report, "digits-")

    # 4. NSO: GELU within 2 % at sigma = 0.01 and 10 % at 0.03, off by > 10 % at 0.1 on
    #    both. ReLU: blobs off by > 20 % at every sigma; digits within 5 % at sigma <= 0.03.
    gelu, relu = _nso(report, "")
    assert all(row["relative_error"] > 0.20 for row in relu.values())
    for rows in (gelu, relu):
        assert all(row["gap_control_variate"] > row["predicted"] > 0 for row in rows.values())
    gelu, relu = _nso(report, "digits-")
    assert relu[0.01]["relative_error"] < 0.05 and relu[0.03]["relative_error"] < 0.05
    assert relu[0.1]["relative_error"] > 0.10
    for rows in (gelu, relu):
        assert rows[0.1]["gap_control_variate"] > rows[0.1]["predicted"] > 0

    # 5. times 10. Blobs global: accuracy within 1 point, loss explodes, lambda_max FALLS.
    #    Digits global: accuracy falls 1-5 points, loss explodes, lambda_max rises < 2x.
    #    Layer rescaling: function identical, lambda_max up > 10x, on both.
    base, scaled = _layer_rescale(report, "")
    assert abs(scaled["accuracy"] - base["accuracy"]) <= 0.01
    assert scaled["loss"] > 100 * base["loss"]
    assert scaled["lambda_max"] < base["lambda_max"]
    base, scaled = _layer_rescale(report, "digits-")
    assert 0.01 < base["accuracy"] - scaled["accuracy"] < 0.05
    assert scaled["loss"] > 100 * base["loss"]
    assert base["lambda_max"] < scaled["lambda_max"] < 2 * base["lambda_max"]

    # 6. Dead units. Blobs: lower trace and lambda_max. Digits: the masked model underfits
    #    and its trace and lambda_max are HIGHER.
    plain_h, masked_h = _dead(report, "")
    margin = 3 * (masked_h["trace_stderr"] + plain_h["trace_stderr"])
    assert masked_h["trace"] + margin < plain_h["trace"]
    assert masked_h["lambda_max"] < plain_h["lambda_max"]
    plain_h, masked_h = _dead(report, "digits-")
    margin = 3 * (masked_h["trace_stderr"] + plain_h["trace_stderr"])
    assert masked_h["trace"] > plain_h["trace"] + margin
    assert masked_h["lambda_max"] > plain_h["lambda_max"]
    assert report("digits-masked-train.json")["results"]["final"]["train_accuracy"] < 0.75
    assert report("digits-relu-train.json")["results"]["final"]["train_accuracy"] > 0.85

    # 7. FA: Tr(H^2) falls as lambda grows, means over 3 seeds, error bars = std over seeds;
    #    blobs (SGD): monotone, lambda = 0.1 clear of the lambda = 0 spread, accuracy within
    #    2 points; digits (Adam): monotone, lambda = 0.01 clear of the spread, accuracy cost.
    for name, top, cost in (("fa-blobs", 0.1, 0.02), ("fa-digits", 0.01, 0.06)):
        sweep = report(f"{name}.json")["results"]
        assert not sweep["diverged"]
        rows = sorted(sweep["summary"], key=lambda row: row["lambda"])
        assert [row["seeds"] for row in rows] == [3, 3, 3]
        means = [row["frobenius_sq_mean"] for row in rows]
        assert means[0] > means[1] > means[2], (name, means)
        base, strongest = rows[0], rows[-1]
        assert strongest["lambda"] == top
        assert (
            strongest["frobenius_sq_mean"] + strongest["frobenius_sq_std"]
            < base["frobenius_sq_mean"] - base["frobenius_sq_std"]
        ), name
        drop = base["test_accuracy_mean"] - strongest["test_accuracy_mean"]
        assert drop < cost, (name, drop)
    assert (tmp_path / "digits.npz").is_file()

    # 8. AD Corollary 1 on the final layer: with eps over the sampled points the check holds
    #    on every row and holds by construction at sigma = 0.01 (erf = 1, bound = H); with eps
    #    at theta it fails at sigma = 1 on every model, where the perturbed gradient norms
    #    are 10 to 130 times the one at theta.
    for name in ("relu", "gelu", "digits-relu", "digits-gelu"):
        rows = _rows_by_sigma(report(f"corollary1-{name}.json")["results"]["rows"])
        assert sorted(rows) == [0.01, 0.1, 1.0], name
        for row in rows.values():
            assert row["holds_region"] and row["points"] == 5, name
            assert row["epsilon_region"] >= row["epsilon_at_theta"]
            assert row["bound_region"] >= row["bound_at_theta"]
            assert row["empirical"] <= row["H_perturbed_mean"] * (1 + 1e-3), name
        small = rows[0.01]
        assert small["verdict_region"] == "holds by construction", name
        assert small["erf_factor_region"] > 0.999, name
        assert not rows[1.0]["holds_at_theta"] and rows[1.0]["verdict_at_theta"] == "fails", name
        assert rows[1.0]["epsilon_region"] > 5 * rows[1.0]["epsilon_at_theta"], name
    for name in ("digits-relu", "digits-gelu"):
        assert report(f"{name}-train.json")["results"]["final"]["test_accuracy"] > 0.85

    # 9. NME 4.4: augmented ReLU trains under GP and puts curvature into N (tr(N) below zero
    #    by more than 3 standard errors, where ReLU's is zero within them); GP with it stays
    #    well below GP with GELU; SAM depends on the activation too
    final = {
        name: report(f"digits-{name}-train.json")["results"]["final"]["test_accuracy"]
        for name in ("gp-relu", "gp-augmented-relu", "gp-gelu", "sam-relu", "sam-gelu")
    }
    assert final["gp-augmented-relu"] < final["gp-gelu"] - 0.03
    relu_n = report("digits-gn-nme-gp-relu.json")["results"]["nme"]["trace"]
    augmented_n = report("digits-gn-nme-gp-augmented-relu.json")["results"]["nme"]["trace"]
    assert abs(relu_n["estimate"]) <= 3 * relu_n["stderr"]
    assert augmented_n["estimate"] < -3 * augmented_n["stderr"]
    assert final["sam-gelu"] - final["sam-relu"] > 0.01  # SAM depends on the activation too

    # The edge of stability [Cohen2021]: full-batch GD at two rates; lambda_max starts below
    # 2/lr, reaches it, and over the last quarter its mean is within 10 % of it
    for name, lr in (("eos-lr1.json", 1.0), ("eos-lr05.json", 0.5)):
        tracked = report(name)["results"]["tracked"]
        assert [row["step"] for row in tracked] == list(range(1, 801)), name
        ratios = [row["lambda_max"] / row["lambda_max_threshold"] for row in tracked]
        assert all(row["lambda_max_threshold"] == 2 / lr for row in tracked), name
        assert ratios[0] < 0.6 and max(ratios) > 1.0, name
        last = ratios[-200:]
        assert abs(sum(last) / len(last) - 1) < 0.10, name

    # [Cohen2022]: full-batch Adam at lr 0.003, tracked every 10 steps; the preconditioned
    # sharpness starts far below 38/lr, reaches it, and its last-quarter mean is within 15 %
    tracked = report("eos-adam.json")["results"]["tracked"]
    assert [row["step"] for row in tracked] == list(range(10, 2401, 10))
    assert all(row["preconditioned_threshold"] == pytest.approx(38 / 0.003) for row in tracked)
    ratios = [row["preconditioned_sharpness"] * 0.003 / 38 for row in tracked]
    last = ratios[-60:]
    assert ratios[0] < 0.2 and max(ratios) > 1.0
    assert abs(sum(last) / len(last) - 1) < 0.15

    # [Andreyev2024]: SGD on batches of 32 at lr 2, tracked every 10 steps; batch sharpness
    # starts near half of 2/lr, and its last-quarter mean is within 25 % (noisy per batch)
    tracked = report("eos-sgd.json")["results"]["tracked"]
    assert [row["step"] for row in tracked] == list(range(10, 3001, 10))
    assert all(row["batch_sharpness_threshold"] == pytest.approx(2 / 2.0) for row in tracked)
    assert all(row["batch_sharpness_batches"] == 15 for row in tracked)
    ratios = [row["batch_sharpness"] * 2.0 / 2 for row in tracked]
    last = ratios[-75:]
    assert sum(ratios[:10]) / 10 < 0.75
    assert abs(sum(last) / len(last) - 1) < 0.25
