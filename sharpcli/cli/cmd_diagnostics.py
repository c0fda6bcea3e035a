"""``sharp activation-stats``, ``sharp weight-rescale`` and ``sharp bound-check`` (docs/commands/).

Thin commands: parse the options, build a :class:`sharpcli.session.Session`, call the analysis
in :mod:`sharpcli.analyses` (activations, rescale, bounds), render tables or write the JSON.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli import catalogue
from sharpcli.catalogue.values import TRACE_KEY
from sharpcli.cli import choices, common, runner
from sharpcli.cli.group import app
from sharpcli.registry import declare
from sharpcli.report.tables import key_value_table, records_table

# the commands of this module, each declared beside its function (sharpcli.catalogue.COMMANDS)
ACTIVATION_STATS = "activation-stats"
WEIGHT_RESCALE = "weight-rescale"
BOUND_CHECK = "bound-check"

ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Rescale even when the rescaling changes the network function (e.g. through GELU).",
    ),
]
PlotOpt = common.PlotOpt
# --eig-* bound Lanczos, --trace-* the Hutch++ traces (common.EigTolOpt)
MaxMatvecsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--eig-max-matvecs",
        "--max-matvecs",
        metavar="N",
        help="Lanczos steps at most (default: min(P, 100); --max-matvecs: former name).",
    ),
]
TraceTolOpt = Annotated[
    float, typer.Option("--trace-tol", help="Relative standard error of the traces.")
]
TraceMaxOpt = Annotated[
    int,
    typer.Option("--trace-max-matvecs", metavar="N", help="Hutch++ matvec budget per trace."),
]


# --------------------------------------------------------------------------------------- activation-stats
@declare(
    "command",
    ACTIVATION_STATS,
    "How often activations are active or dead, per layer.",
    info={"order": 8, "panel": "Statistics"},
)
@common.analysis_command(app, ACTIVATION_STATS)
def activation_stats_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    jacobian: Annotated[
        bool,
        typer.Option(
            "--jacobian/--no-jacobian",
            help="Compute the input-output Jacobian norm (C+1 backward passes per batch).",
        ),
    ] = True,
) -> runner.Outcome:
    """How often each activation layer's units are active or dead, the output's Gini impurity
    and entropy, the AD penalty and the input-output Jacobian norm (MAN sections 2, 5)."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.activations import activation_stats

    session = common.open_session(checkpoint, opts, curvature=False)  # first derivatives only
    result = activation_stats(session.model, session.analysis_data(), jacobian=jacobian)
    settings = opts.report_settings()
    report = session.report(ACTIVATION_STATS, settings, result.to_dict(), matvecs=0)
    return runner.Outcome(report, render=lambda console: _render_activation_stats(console, result))


def _render_activation_stats(console, result) -> None:
    layers = [
        {
            "layer": layer.name,
            "kind": layer.kind,
            "shape": "x".join(str(s) for s in layer.output_shape),
            "N": layer.outputs,
            "eta": layer.activation_frequency,
            "eta_all": layer.activation_frequency_including_dead,
            "xi": layer.death_frequency,
            "dead": layer.dead_outputs,
            "mean ||a||^2": layer.mean_sq_norm,
        }
        for layer in result.layers
    ]
    console.print(
        records_table(
            f"activation layers ({result.samples} samples): eta = activation frequency over alive outputs, "
            "eta_all = over all outputs, xi = death frequency",
            layers,
            ["layer", "kind", "shape", "N", "eta", "eta_all", "xi", "dead", "mean ||a||^2"],
        )
    )
    summary = dict(result.output.to_dict())
    summary[f"penultimate ||h||^2 (input of {result.penultimate_layer})"] = (
        result.penultimate_sq_norm
    )
    summary["input-output Jacobian ||dz/dx||_F"] = result.input_jacobian_fro
    summary["input-output Jacobian ||dp/dx||_F"] = result.input_jacobian_fro_softmax
    console.print(key_value_table("output", summary))
    for note in result.notes:
        runner.print_note(note)


# --------------------------------------------------------------------------------------- weight-rescale
@declare(
    "command",
    WEIGHT_RESCALE,
    "Show which sharpness measures change when weights are rescaled.",
    paper="MAN",
    info={"order": 9, "panel": "Rescaling"},
)
@common.analysis_command(app, WEIGHT_RESCALE)
def weight_rescale_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    alpha: Annotated[
        str,
        typer.Option(
            "--alpha", metavar="A,...", help="Scale factors, comma-separated, e.g. --alpha 0.1,10."
        ),
    ] = "0.1,10",
    mode: Annotated[
        choices.RescaleMode,
        typer.Option(
            "--mode",
            help="global (all parameters times alpha) or layer (Dinh et al.: layer times alpha, next layer's weight times 1/alpha).",
        ),
    ] = "layer",
    layer: Annotated[
        Optional[str],
        typer.Option(
            "--layer",
            metavar="NAME",
            help="Module name of the layer to rescale (e.g. 0, features.3); default the first hidden layer.",
        ),
    ] = None,
    force: ForceOpt = False,
    params: common.ParamsOpt = None,
    tol: common.EigTolOpt = 1e-3,
    max_matvecs: MaxMatvecsOpt = None,
    trace_tol: TraceTolOpt = 1e-2,
    trace_max_matvecs: TraceMaxOpt = 200,
    rho: Annotated[
        float,
        typer.Option(
            "--rho",
            metavar="R",
            help="Radius of the adaptive and standard worst-case sharpness (l2).",
        ),
    ] = 0.05,
    sharpness: Annotated[
        bool,
        typer.Option(
            "--sharpness/--no-sharpness",
            help="Also the worst-case sharpness, adaptive and standard (20 ascent steps each).",
        ),
    ] = True,
    plot: PlotOpt = None,
) -> runner.Outcome:
    """Rescale weights, keeping the function (MAN Fig. 1): lambda_max moves, adaptive sharpness not."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.rescale import check_alphas, check_mode, weight_rescale

    alphas = common.parse_float_list(alpha, "--alpha")
    check_alphas(alphas)  # the library's checks, before the checkpoint is read
    check_mode(mode)
    common.require(tol > 0, f"must be > 0, got {tol:g}", "--eig-tol")
    common.require(rho > 0, f"must be > 0, got {rho:g}", "--rho")
    common.check_output(plot)
    session = common.open_session(checkpoint, opts)
    with common.progress_bar(opts.quiet, opts.json, "rescaling"):
        result = weight_rescale(
            session.model,
            session.analysis_data(),
            alphas,
            mode=mode,
            layer=layer,
            force=force,
            params=params,
            tol=tol,
            max_matvecs=max_matvecs,
            trace_tol=trace_tol,
            trace_max_matvecs=trace_max_matvecs,
            seed=opts.seed,
            rho=rho if sharpness else None,
        )
    results = result.to_dict()
    if plot is not None:
        # kept out of sharp's start-up (--help, completion)
        from sharpcli.report.plots import plot_weight_rescale

        plot_weight_rescale(
            results["rows"] + [results["baseline"]],
            plot,
            title=f"weight rescaling ({result.plan.mode} mode)",
        )
        results["plot"] = plot
    settings = opts.report_settings(alpha=alphas)
    report = session.report(WEIGHT_RESCALE, settings, results, matvecs=result.matvecs)
    return runner.Outcome(report, render=lambda console: _render_weight_rescale(console, result))


def _render_weight_rescale(console, result) -> None:
    plan = result.plan
    if plan.mode == "global":
        what = "every parameter times alpha (not function preserving)"
    elif plan.mode == "batchnorm":
        what = f"layer {plan.layer} (weight, bias) times alpha, BatchNorm {plan.batchnorm} running statistics adjusted"
    else:
        what = f"layer {plan.layer} (weight, bias) times alpha, layer {plan.next_layer} weight times 1/alpha"
    if plan.problems:
        what += f" (forced: {'; '.join(plan.problems)})"
    rows = [result.baseline.to_dict()] + [row.to_dict() for row in result.rows]
    console.print(
        records_table(
            f"weight rescaling: {what}; curvature w.r.t. {result.params} ({result.num_params} parameters)",
            rows,
            [
                "alpha",
                "accuracy",
                "loss",
                "max_logit_change",
                "lambda_max",
                TRACE_KEY,
                "trace_stderr",
                "invariant_lambda_max",
            ]
            + (
                ["adaptive_sharpness", "standard_sharpness"]
                if rows[0]["adaptive_sharpness"] is not None
                else []
            ),
        )
    )


# --------------------------------------------------------------------------------------- bound-check
@declare(
    "command",
    BOUND_CHECK,
    "Check the papers' curvature bounds on a trained model.",
    paper="AD",
    info={"order": 12, "panel": "Bounds"},
)
@common.analysis_command(app, BOUND_CHECK)
def bound_check_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    sigma: Annotated[
        str,
        typer.Option(
            "--sigma",
            metavar="S,...",
            help="Noise standard deviations, e.g. --sigma 0.01,0.1,1.",
        ),
    ] = "0.01,0.1,1",
    params: Annotated[
        Optional[str],
        typer.Option(
            "--params",
            metavar="SCOPE",
            help="all, last or a glob (default: last layer's weight, as AD Fig. 1a; all for NSO).",
        ),
    ] = None,
    perturbations: Annotated[
        int,
        typer.Option(
            "--perturbations",
            help="Perturbations for the smoothed Hessian.",
        ),
    ] = 8,
    epsilon: Annotated[
        choices.EpsilonKind,
        typer.Option(
            "--epsilon",
            help="Gradient norm: whole set or minibatch mean (AD).",
        ),
    ] = "full",
    check: Annotated[
        Optional[list[str]],
        typer.Option(
            "--check",
            metavar="NAME,...",
            autocompletion=choices.list_completer(catalogue.CHECKS.names()),
            help="Extra checks, repeated or comma-separated, e.g. --check theorem2.",
        ),
    ] = None,
    bootstrap: Annotated[
        int,
        typer.Option(
            "--bootstrap",
            help="Bootstrap replicates of the interval.",
        ),
    ] = 1000,
    ci_level: Annotated[
        float, typer.Option("--ci-level", help="Confidence level of the interval.")
    ] = 0.95,
    mc_samples: Annotated[
        int,
        typer.Option(
            "--mc-samples",
            help="Antithetic noise pairs per sample (Theorem 2).",
        ),
    ] = 256,
    noise_pairs: Annotated[
        int,
        typer.Option("--noise-pairs", help="Antithetic weight-noise pairs (noise-stability)."),
    ] = 32,
    tol: common.EigTolOpt = 1e-3,
    max_matvecs: MaxMatvecsOpt = None,
    trace_tol: TraceTolOpt = 1e-2,
    trace_max_matvecs: TraceMaxOpt = 300,
    plot: PlotOpt = None,
) -> runner.Outcome:
    """Check AD Corollary 1's bound on the Hessian smoothed by weight noise, for each sigma;
    optionally AD Theorem 2 and NSO's noise-stability gap."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.bounds import BoundCheckConfig, bound_check

    sigmas = common.parse_float_list(sigma, "--sigma")
    checks = [c.strip() for item in (check or []) for c in item.split(",") if c.strip()]
    config = BoundCheckConfig(
        sigma=sigmas,
        params=params,
        perturbations=perturbations,
        epsilon=epsilon,
        tol=tol,
        max_matvecs=max_matvecs,
        bootstrap=bootstrap,
        ci_level=ci_level,
        check=tuple(dict.fromkeys(checks)),
        mc_samples=mc_samples,
        noise_pairs=noise_pairs,
        trace_tol=trace_tol,
        trace_max_matvecs=trace_max_matvecs,
        seed=opts.seed,
    )
    config.validate()  # before the checkpoint is read: option errors first
    common.check_output(plot)
    session = common.open_session(checkpoint, opts)
    with common.progress_bar(opts.quiet, opts.json, "bound check"):
        result = bound_check(session.model, session.analysis_data(), config)
    results = result.to_dict()
    if plot is not None:
        # kept out of sharp's start-up (--help, completion)
        from sharpcli.report.plots import plot_bound_check

        noise_rows = results["noise_stability"]["rows"] if "noise_stability" in results else None
        plot_bound_check(
            results["rows"], plot, noise_rows=noise_rows, title=f"AD Corollary 1 on {result.params}"
        )
        results["plot"] = plot
    settings = opts.report_settings(sigma=sigmas, params=result.params, check=checks)
    report = session.report(BOUND_CHECK, settings, results, matvecs=result.matvecs)
    return runner.Outcome(report, render=lambda console: _render_bound_check(console, result))


def _render_bound_check(console, result) -> None:
    # imports torch: kept out of start-up
    from sharpcli.analyses.theorem2 import THEOREM2

    rows = []
    for row in result.rows:
        d = row.to_dict()
        d["empirical_ci"] = f"[{d['empirical_ci'][0]:.6g}, {d['empirical_ci'][1]:.6g}]"
        rows.append(d)
    console.print(
        records_table(
            f"AD Corollary 1 at theta on {result.params}: {result.num_params} parameters, "
            f"epsilon {result.epsilon_kind}",
            rows,
            [
                "sigma",
                "empirical",
                "H_at_theta",
                "epsilon_at_theta",
                "bound_at_theta",
                "ratio_at_theta",
                "verdict_at_theta",
            ],
        )
    )
    console.print(
        records_table(
            f"over the region: H, epsilon the largest of {result.perturbations} perturbations and "
            "theta",
            rows,
            [
                "sigma",
                "points",
                "H_region",
                "epsilon_region",
                "bound_region",
                "ratio_region",
                "verdict_region",
            ],
        )
    )
    for row in result.rows:
        console.print(f"sigma {row.sigma:g}: {row.note}", markup=False)
    if THEOREM2 in result.checks:
        console.print(
            records_table(
                "AD Theorem 2: smoothed CE <= CE + sigma^2/2 ||h||^2 (sample means)",
                result.checks[THEOREM2],
                [
                    "sigma",
                    "cross_entropy",
                    "smoothed_cross_entropy",
                    "bound",
                    "taylor",
                    "fraction_holds",
                    "violations",
                    "min_margin",
                ],
            )
        )
    if "noise_stability" in result.checks:
        ns = result.checks["noise_stability"]
        console.print(
            records_table(
                f"NSO: E L(W+U) - L(W) vs sigma^2/2 tr(H) on {ns['params']}, "
                f"tr(H) = {ns[TRACE_KEY]:.6g}",
                ns["rows"],
                [
                    "sigma",
                    "gap",
                    "gap_stderr",
                    "gap_control_variate",
                    "predicted",
                    "relative_error",
                    "relative_error_plain",
                    "taylor_residual",
                ],
            )
        )
    for note in result.notes:
        runner.print_note(note)
