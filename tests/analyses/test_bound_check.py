"""sharp bound-check: AD Corollary 1 (recomputable, sigma -> 0 limit, exact MC operator),
AD Theorem 2 on every sample, NSO's noise-stability gap."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cli_helpers import assert_one_line_error, run_cli
from torch.func import functional_call, hessian

from sharpcli.analyses.bounds import BoundCheckConfig, bound_check, corollary1_bound
from sharpcli.analyses.noise_stability import noise_stability_check
from sharpcli.analyses.perturbation import AveragedOperator, standard_normal_directions
from sharpcli.analyses.theorem2 import smoothed_cross_entropy, theorem2_check
from sharpcli.cli import cmd_diagnostics  # noqa: F401  (registers the commands)
from sharpcli.curvature.products.data import AnalysisData
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.errors import UsageError
from sharpcli.io.checkpoints import save_checkpoint
from sharpcli.models.zoo import build_model
from sharpcli.report.envelope import validate_report

MLP = {
    "name": "mlp",
    "args": {"in_features": 3, "num_classes": 3, "depth": 2, "width": 4, "activation": "relu"},
}


def _trained(steps=200, seed=0, activation="relu"):
    """The tiny MLP after full-batch Adam on a learnable labelling of 40 Gaussian points."""
    torch.manual_seed(seed)
    model = build_model({"name": "mlp", "args": dict(MLP["args"], activation=activation)}).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, dtype=torch.float64, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), x, y


def _dense_hessian(model, x, y, names, delta=None):
    params = dict(model.named_parameters())
    flat0 = torch.cat([params[n].detach().reshape(-1) for n in names])
    if delta is not None:
        flat0 = flat0 + delta

    def loss(flat):
        parts, start = dict(params), 0
        for n in names:
            parts[n] = flat[start : start + params[n].numel()].view(params[n].shape)
            start += params[n].numel()
        return F.cross_entropy(functional_call(model, parts, (x,)), y)

    return hessian(loss)(flat0).detach()


def test_corollary1_rows_recompute_and_match_exact_smoothed_hessian():
    model, x, y = _trained()
    data = AnalysisData(x, y, "cross-entropy", 16)
    sigmas = [0.05, 0.5]
    config = BoundCheckConfig(sigmas, perturbations=4, tol=1e-10, bootstrap=200, seed=3)
    result = bound_check(model, data, config)
    assert (
        result.params == "4.weight" and result.num_params == 12
    )  # default: the final layer's weight
    names = ["4.weight"]
    H0 = _dense_hessian(model, x, y, names)
    eig0 = torch.linalg.eigvalsh(H0)
    # epsilon: full-data gradient norm, and the mean minibatch norm (batches of 16, 16, 8)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert result.epsilon_full == pytest.approx(float(model[4].weight.grad.norm()), rel=1e-10)
    norms = []
    for start in range(0, 40, 16):
        model.zero_grad()
        F.cross_entropy(model(x[start : start + 16]), y[start : start + 16]).backward()
        norms.append(float(model[4].weight.grad.norm()))
    assert result.epsilon_minibatch == pytest.approx(sum(norms) / len(norms), rel=1e-10)
    scope = ParamScope.resolve(model, "4.weight")
    Z = standard_normal_directions(scope, 4, 3)
    for row, sigma in zip(result.rows, sigmas):
        assert row.plain_lambda_max == pytest.approx(float(eig0[-1]), rel=1e-9)
        assert row.H_at_theta == pytest.approx(float(eig0.abs().max()), rel=1e-9)
        # AD's reading: H and eps at theta; the bound recomputes from the keys beside it
        assert row.epsilon_at_theta == result.epsilon_full
        h, eps = row.H_at_theta, row.epsilon_at_theta
        assert row.bound_at_theta == pytest.approx(
            h * math.erf(eps / (math.sqrt(2) * h * sigma)), rel=1e-12
        )
        assert row.holds_at_theta == (row.empirical <= row.bound_at_theta)
        assert row.verdict_at_theta == ("holds" if row.holds_at_theta else "fails")
        assert row.ratio_at_theta == pytest.approx(row.empirical / row.bound_at_theta, rel=1e-12)
        assert row.points == 5  # theta and the 4 perturbed points
        # the Monte-Carlo smoothed Hessian, densely, on the same fixed perturbations
        perturbed = [_dense_hessian(model, x, y, names, sigma * Z[:, j]) for j in range(4)]
        mean_h = torch.stack(perturbed).mean(0)
        assert row.empirical == pytest.approx(
            float(torch.linalg.matrix_norm(mean_h, ord=2)), rel=1e-8
        )
        assert row.H_region == pytest.approx(
            max(float(torch.linalg.eigvalsh(h).abs().max()) for h in perturbed + [H0]), rel=1e-8
        )
        lo, hi = row.empirical_ci
        assert lo <= row.empirical <= hi
        # epsilon over the region: the largest full-data gradient norm at theta and theta + D_j
        region = [result.epsilon_full]
        for j in range(4):
            twin = build_model(MLP).double().eval()
            twin.load_state_dict(model.state_dict())
            with torch.no_grad():
                twin[4].weight.add_(sigma * Z[:, j].view(3, 4))
            F.cross_entropy(twin(x), y).backward()
            region.append(float(twin[4].weight.grad.norm()))
        assert row.epsilon_region == pytest.approx(max(region), rel=1e-10)
        assert row.bound_region == pytest.approx(
            corollary1_bound(row.H_region, row.epsilon_region, sigma), rel=1e-12
        )
        assert row.holds_region == (row.empirical <= row.bound_region)
        assert row.ratio_region == pytest.approx(row.empirical / row.bound_region, rel=1e-12)
        assert row.erf_factor_region == pytest.approx(row.bound_region / row.H_region, rel=1e-12)
        # the estimated left side never exceeds the mean sampled norm, which never exceeds H
        mean_norm = sum(float(torch.linalg.matrix_norm(h, ord=2)) for h in perturbed) / 4
        assert row.H_perturbed_mean == pytest.approx(mean_norm, rel=1e-8)
        assert row.empirical <= row.H_perturbed_mean * (1 + 1e-9) <= row.H_region * (1 + 1e-9)
        assert row.verdict_region == (
            "fails"
            if not row.holds_region
            else "holds by construction"
            if row.bound_region >= row.H_perturbed_mean
            else "holds"
        )
        assert "5 points" in row.note and f"{lo:.4g}, {hi:.4g}" in row.note
    assert any(n.startswith("empirical above bound_region") for n in result.notes) == (
        not all(r.holds_region for r in result.rows)
    )


def test_smoothed_estimate_tends_to_plain_lambda_max_as_sigma_vanishes():
    model, x, y = _trained()
    result = bound_check(
        model,
        AnalysisData(x, y, "cross-entropy", 40),
        BoundCheckConfig([1e-6, 1e-3, 1.0], perturbations=3, tol=1e-10, bootstrap=100),
    )
    tiny, small, large = result.rows
    # a failed row is explained (sampled H and eps are lower estimates of the corollary's suprema)
    failed = [r.sigma for r in result.rows if not r.holds_region]
    explained = [n for n in result.notes if n.startswith("empirical above bound_region")]
    assert bool(explained) == bool(failed)
    assert all(f"{s:g}" in explained[0] for s in failed)
    deviation = [abs(r.empirical / r.plain_lambda_max - 1) for r in result.rows]
    assert deviation[0] < 1e-4 and deviation[1] < 1e-1
    assert deviation[0] < deviation[1] / 100 < deviation[2]  # first order in sigma near 0
    assert tiny.empirical_ci[0] <= tiny.plain_lambda_max <= tiny.empirical_ci[1]
    assert tiny.empirical_ci[1] - tiny.empirical_ci[0] <= 1e-4 * tiny.empirical


def test_bootstrap_ritz_values_reproduce_the_average():
    a = torch.diag(torch.tensor([3.0, 1.0, -0.5], dtype=torch.float64))
    b = torch.diag(torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64))
    from sharpcli.curvature.operators.hessian import MatrixOperator

    avg = AveragedOperator([MatrixOperator(a), MatrixOperator(b)])
    for v in torch.eye(3, dtype=torch.float64):
        avg.matvec(v)
    S, M = avg.projections()
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    norms = AveragedOperator.ritz_norm(S, M, weights)
    assert norms.tolist() == pytest.approx([2.25, 3.0, 4.0], rel=1e-14)


def test_config_validation_names_the_field_of_the_first_bad_setting():
    """The library names its own parameter (the config field); the CLI spells it as a flag."""
    BoundCheckConfig().validate()  # the CLI defaults are valid
    cases = [
        (dict(sigma=[]), "sigma"),
        (dict(sigma=[0.1, float("nan")]), "sigma"),
        (dict(check=("theorem9",)), "check"),
        (dict(epsilon="max"), "epsilon"),
        (dict(perturbations=0), "perturbations"),
        (dict(bootstrap=0), "bootstrap"),
        (dict(ci_level=1.0), "ci_level"),
        (dict(mc_samples=1), "mc_samples"),
        (dict(noise_pairs=1), "noise_pairs"),
        (dict(tol=0.0), "tol"),
        (dict(epsilon="max", perturbations=0), "epsilon"),
    ]
    for changes, field_name in cases:
        with pytest.raises(UsageError) as info:
            BoundCheckConfig(**changes).validate()
        assert info.value.source == field_name, (changes, info.value.source)


def test_corollary1_bound_formula():
    assert corollary1_bound(2.0, 0.3, 0.1) == pytest.approx(
        2.0 * math.erf(0.3 / (math.sqrt(2) * 0.2)), rel=1e-15
    )
    assert corollary1_bound(2.0, 1.0, 1e-9) == pytest.approx(2.0)  # sigma -> 0: the bound is H
    assert corollary1_bound(0.0, 1.0, 0.1) == 0.0


def test_smoothed_cross_entropy_matches_quadrature_for_two_classes():
    # for c = 2, CE(z + t g, y) = softplus(d + t (g_o - g_y)), d = z_o - z_y, g_o - g_y ~ N(0, 2)
    z = torch.tensor([[2.0, -1.0], [0.3, 0.1], [-1.0, 4.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0])
    t = torch.tensor([0.5, 1.5, 3.0], dtype=torch.float64)
    g = torch.randn(4000, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    estimate, stderr = smoothed_cross_entropy(z, y, t, g)
    nodes, weights = np.polynomial.hermite_e.hermegauss(120)
    for i in range(3):
        d = float(z[i, 1 - y[i]] - z[i, y[i]])
        values = np.logaddexp(0.0, d + float(t[i]) * math.sqrt(2) * nodes)
        exact = float((weights * values).sum() / math.sqrt(2 * math.pi))
        assert abs(float(estimate[i]) - exact) <= max(4 * float(stderr[i]), 1e-12), (
            i,
            estimate[i],
            exact,
        )
        assert float(stderr[i]) < 2e-3


def test_theorem2_holds_on_every_sample_with_the_taylor_value_beside_it():
    model, x, y = _trained()
    data = AnalysisData(x, y, "cross-entropy", 16)
    sigmas = [0.01, 0.3, 1.0]
    rows = theorem2_check(model, data, sigmas, mc_samples=256)
    with torch.no_grad():
        h = model[:4](x)
        z = model(x)
    ce = F.cross_entropy(z, y, reduction="none")
    p = torch.softmax(z, 1)
    h_sq = (h * h).sum(1)
    for row, sigma in zip(rows, sigmas):
        assert row.fraction_holds == 1.0 and row.violations == 0 and row.min_margin > 0
        assert row.cross_entropy == pytest.approx(float(ce.mean()), rel=1e-12)
        assert row.bound == pytest.approx(float((ce + sigma**2 / 2 * h_sq).mean()), rel=1e-12)
        taylor = ce + sigma**2 / 2 * h_sq * (p * (1 - p)).sum(1)
        assert row.taylor == pytest.approx(float(taylor.mean()), rel=1e-12)
        assert row.cross_entropy <= row.smoothed_cross_entropy <= row.bound  # Jensen both ways
    # the Taylor value is the tighter approximation for small sigma
    assert rows[0].mean_taylor_abs_error < 1e-6
    assert rows[0].mean_taylor_abs_error < (rows[0].bound - rows[0].smoothed_cross_entropy)
    # and on every sample of held-out test data the model never saw
    gen = torch.Generator().manual_seed(2)
    x_test = torch.randn(300, 3, dtype=torch.float64, generator=gen)
    y_test = (x_test[:, 0] > 0).long() + (x_test[:, 1] > 0).long()
    for row in theorem2_check(
        model, AnalysisData(x_test, y_test, "cross-entropy", 64), sigmas, mc_samples=256
    ):
        assert (
            row.samples == 300
            and row.violations == 0
            and row.fraction_holds == 1.0
            and row.min_margin > 0
        )


def test_noise_stability_gap_matches_half_sigma_squared_trace():
    # a smooth (GELU) network: with ReLU, perturbing every weight crosses kinks of pre-activations
    # lying within ~sigma of 0, which adds a non-Taylor term NSO eq. 4 does not have
    model, x, y = _trained(steps=300, activation="gelu")
    data = AnalysisData(x, y, "cross-entropy", 40)
    scope = ParamScope.resolve(model, "all")
    out = noise_stability_check(
        model, data, [1e-3, 0.3], scope, noise_pairs=600, trace_max_matvecs=400
    )
    names = [n for n, _ in model.named_parameters()]
    trace = float(_dense_hessian(model, x, y, names).trace())
    assert (
        abs(out["trace"] - trace) <= 4 * out["trace_stderr"] + 1e-12 * trace
    )  # Hutch++ from the engine
    assert abs(out["trace"] / trace - 1) < 1e-2
    small, large = out["rows"]
    assert small["predicted"] == pytest.approx(1e-6 / 2 * out["trace"], rel=1e-12)
    assert abs(small["relative_error"]) < 0.1
    assert (
        abs(small["relative_error_plain"]) < 0.1
    )  # the plain antithetic Monte-Carlo gap, 600 pairs
    assert abs(small["gap"] - small["predicted"]) < 4 * small["gap_stderr"]
    # higher-order terms: the Taylor residual is negligible at sigma = 1e-3, not at sigma = 0.3
    assert abs(small["taylor_residual"]) < 1e-2 * small["predicted"]
    assert abs(large["relative_error"]) > 1.0


def _write_fixture(tmp_path, model, x, y):
    data_path = tmp_path / "data.pt"
    torch.save({"x": x.float(), "y": y}, data_path)
    ckpt = tmp_path / "model.safetensors"
    save_checkpoint(ckpt, model, MLP, data_spec=str(data_path))
    return ckpt


def test_cli_json_checks_plot_and_errors(tmp_path, capsys):
    model, x, y = _trained()
    ckpt = _write_fixture(tmp_path, model, x, y)
    plot = tmp_path / "bound.png"
    run = run_cli(
        capsys,
        "bound-check",
        ckpt,
        "--sigma",
        "0.01,0.1",
        "--perturbations",
        "3",
        "--dtype",
        "float64",
        "--check",
        "theorem2,noise-stability",
        "--noise-pairs",
        "8",
        "--bootstrap",
        "50",
        "--plot",
        plot,
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    results = report["results"]
    assert [r["sigma"] for r in results["rows"]] == [0.01, 0.1]
    for row in results["rows"]:
        assert row["bound_at_theta"] == pytest.approx(
            corollary1_bound(row["H_at_theta"], row["epsilon_at_theta"], row["sigma"]), rel=1e-12
        )
        assert row["bound_region"] == pytest.approx(
            corollary1_bound(row["H_region"], row["epsilon_region"], row["sigma"]), rel=1e-12
        )
        # every verdict agrees with the quantities beside it
        assert row["holds_at_theta"] == (row["empirical"] <= row["bound_at_theta"])
        assert row["holds_region"] == (row["empirical"] <= row["bound_region"])
        assert (row["verdict_at_theta"] == "fails") == (not row["holds_at_theta"])
        assert (row["verdict_region"] == "fails") == (not row["holds_region"])
        for key in ("H", "epsilon", "bound", "ratio", "holds", "verdict", "erf_factor"):
            assert key not in row  # version 1 keys that did not say what they compared
        assert len(row["empirical_ci"]) == 2
    assert all(r["fraction_holds"] == 1.0 for r in results["theorem2"])
    assert len(results["noise_stability"]["rows"]) == 2
    # NSO perturbs every weight: noise stability runs on all parameters without --params
    assert results["noise_stability"]["params"] == "all"
    assert results["noise_stability"]["num_params"] == sum(p.numel() for p in model.parameters())
    assert report["settings"]["params"] == "4.weight" and report["timing"]["matvecs"] > 0
    from png_helpers import png_size

    from sharpcli.report.plots import PIXELS

    assert png_size(plot) == PIXELS
    minibatch = run_cli(
        capsys,
        "bound-check",
        ckpt,
        "--sigma",
        "0.1",
        "--epsilon",
        "minibatch",
        "--batch-size",
        "16",
        "--perturbations",
        "2",
        "--dtype",
        "float64",
        "--json",
        "-",
    )
    assert minibatch.code == 0, minibatch.err
    mb = minibatch.json()["results"]
    assert mb["rows"][0]["epsilon_at_theta"] == mb["epsilon_minibatch"] != mb["epsilon_full"]
    table = run_cli(capsys, "bound-check", ckpt, "--sigma", "0.1", "--perturbations", "2")
    assert table.code == 0 and "Corollary 1" in table.out and "sigma 0.1: " in table.out
    scoped = run_cli(
        capsys,
        "bound-check",
        ckpt,
        "--sigma",
        "0.1",
        "--perturbations",
        "2",
        "--params",
        "4.*",
        "--check",
        "noise-stability",
        "--noise-pairs",
        "2",
        "--json",
        "-",
    )
    assert scoped.code == 0, scoped.err
    assert scoped.json()["results"]["noise_stability"]["params"] == "4.*"

    assert_one_line_error(run_cli(capsys, "bound-check", ckpt, "--sigma", "0"), 2, "--sigma")
    assert_one_line_error(run_cli(capsys, "bound-check", ckpt, "--sigma", "0.1,-2"), 2, "--sigma")
    assert_one_line_error(run_cli(capsys, "bound-check", ckpt, "--sigma", "abc"), 2, "--sigma")
    assert_one_line_error(run_cli(capsys, "bound-check", ckpt, "--check", "theorem9"), 2, "--check")
    assert_one_line_error(run_cli(capsys, "bound-check", ckpt, "--params", "nope.*"), 2, "--params")
    assert_one_line_error(run_cli(capsys, "bound-check", ckpt, "--epsilon", "max"), 2, "--epsilon")


def _builtin_briefly_trained(name: str):
    """A tiny built-in model (mlp, or cnn with channels 4, 8) after 2 epochs on built-in data,
    and 128 of its training samples."""
    from sharpcli.training.loop import TrainConfig, train

    data = "blobs:n=400" if name == "mlp" else "images:n=400"
    model_args = {"width": 16} if name == "mlp" else {"channels": [4, 8]}
    return TrainConfig(model=name, model_args=model_args, data=data, epochs=2, seed=0), train


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_corollary1_holds_with_eps_over_the_sampled_points_on_builtin_models(tmp_path, name):
    """AD Corollary 1 with eps estimated like H (largest gradient norm over theta and the
    perturbed points) holds at sigma 0.01, 0.1 and 1; at 0.01 it holds by construction."""
    from sharpcli.io.checkpoints import load_checkpoint
    from sharpcli.io.data.loading import load_dataset

    cfg, train = _builtin_briefly_trained(name)
    train(cfg, tmp_path / "m.safetensors")
    model = load_checkpoint(tmp_path / "m.safetensors").model
    x, y = load_dataset(cfg.data).split("train")
    data = AnalysisData(x[:128], y[:128], "cross-entropy", 128)
    config = BoundCheckConfig([0.01, 0.1, 1.0], perturbations=4, bootstrap=200, seed=1)
    result = bound_check(model.eval(), data, config)
    for row in result.rows:
        assert row.holds_region, (row.sigma, row.note)
        assert row.epsilon_region >= row.epsilon_at_theta and row.H_region >= row.H_at_theta
        assert row.verdict_region in ("holds", "holds by construction") and row.points == 5
        assert row.empirical_ci[0] <= row.empirical <= row.empirical_ci[1] <= row.H_region
    small = result.rows[0]
    assert small.verdict_region == "holds by construction" and small.erf_factor_region > 0.999
    assert "which ||E H||" in small.note and "5 points" in small.note
    # AD's reading (H and eps at theta) is a verdict that can fail: at sigma = 1 the gradient
    # norm near the minimum is too small for the noise, and the bound collapses below ||E H||
    large = result.rows[-1]
    assert not large.holds_at_theta and large.verdict_at_theta == "fails"
    assert large.empirical > large.bound_at_theta and "at theta: ||E H||" in large.note


def test_a_check_registered_beside_the_builtins_is_run_through_the_registry():
    """``bound_check`` runs what CHECKS lists: an extension declared as a function of the
    CheckRun reaches the results under its key, its products counted; its number is the
    dense float64 gradient's norm over the whole set."""
    from sharpcli import catalogue
    from sharpcli.analyses.bounds import CheckRun
    from sharpcli.registry import declare

    @declare("check", "gradient-norm", "the full gradient's norm over the scope")
    def gradient_norm_check(run: CheckRun) -> None:
        with torch.enable_grad():
            x, y = run.data.x, run.data.y
            loss = F.cross_entropy(run.model(x), y)
            grads = torch.autograd.grad(loss, run.scope.params)
        run.found["gradient_norm"] = float(torch.cat([g.reshape(-1) for g in grads]).norm())
        run.matvecs += 7

    model, x, y = _trained(steps=50)
    data = AnalysisData(x, y, loss="cross-entropy", batch_size=40)
    config = BoundCheckConfig(sigma=[0.1], perturbations=2, bootstrap=20, check=("gradient-norm",))
    catalogue.CHECKS.add(gradient_norm_check)
    try:
        plain = bound_check(
            model, data, BoundCheckConfig(sigma=[0.1], perturbations=2, bootstrap=20)
        )
        result = bound_check(model, data, config)
    finally:
        catalogue.CHECKS.unregister("gradient-norm")
    report = result.to_dict()
    assert list(report)[-1] == "gradient_norm"
    weight = dict(model.named_parameters())[result.params]
    (reference,) = torch.autograd.grad(F.cross_entropy(model(x), y), [weight])
    assert report["gradient_norm"] == pytest.approx(float(reference.norm()), rel=1e-12)
    assert result.matvecs == plain.matvecs + 7
    assert "gradient-norm" not in catalogue.CHECKS
