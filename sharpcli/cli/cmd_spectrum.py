"""``sharp eigen``, ``sharp trace``, ``sharp gn-nme``, ``sharp density``: curvature spectra."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table
from typer.models import OptionInfo

from sharpcli.cli import common
from sharpcli.cli.app import app
from sharpcli.report.tables import fmt, key_value_table, records_table


class _OperatorOption(OptionInfo):
    """``--operator``, whose help lists the registered operators.

    Typer reads ``help`` when it builds the command (each time the app runs), not when this
    module is imported, so an operator registered later (an extension) is listed too.
    """

    @property
    def help(self) -> str:
        from sharpcli.curvature.registry import operator_help

        return f"{operator_help()}."

    @help.setter
    def help(self, value) -> None:  # OptionInfo.__init__ assigns one; the registry decides
        pass


OperatorOpt = Annotated[str, _OperatorOption(default="--operator", param_decls=())]
EngineOpt = Annotated[
    str, typer.Option("--engine", help="native, or pyhessian (PyPI pyhessian 0.1, for parity).")
]
MaxMatvecsOpt = Annotated[
    Optional[int], typer.Option("--max-matvecs", help="Budget of operator products.")
]


def _positive(value, option: str, strict: bool = True) -> None:
    common.require(value is None or (value > 0 if strict else value >= 0), "must be > 0", option)


@common.analysis_command(app, "eigen")
def eigen_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    top_k: Annotated[
        int, typer.Option("--top-k", help="Number of eigenvalues (at each end with --which both).")
    ] = 1,
    which: Annotated[str, typer.Option("--which", help="largest, smallest or both.")] = "largest",
    operator: OperatorOpt = "hessian",
    method: Annotated[
        str, typer.Option("--method", help="lanczos (default) or power (PyHessian's method).")
    ] = "lanczos",
    tol: Annotated[
        float, typer.Option("--tol", help="Converged when ||Au - lambda u|| <= tol |lambda|.")
    ] = 1e-3,
    max_matvecs: MaxMatvecsOpt = None,
    params: common.ParamsOpt = None,
    engine: EngineOpt = "native",
) -> common.Outcome:
    """Largest and/or smallest eigenvalues of the Hessian, Gauss-Newton or NME operator."""
    from sharpcli.analyses import spectrum

    common.require(top_k >= 1, "must be at least 1", "--top-k")
    _positive(tol, "--tol")
    _positive(max_matvecs, "--max-matvecs")
    session = common.open_session(checkpoint, opts)
    with common.status(opts.quiet, f"eigenvalues of the {operator}"):
        results = spectrum.eigen(
            session,
            operator=operator,
            top_k=top_k,
            which=which,
            method=method,
            tol=tol,
            max_matvecs=max_matvecs,
            params=params,
            engine=engine,
        )
    settings = opts.report_settings(skip=("checkpoint",))
    report = session.report("eigen", settings, results, matvecs=results["matvecs"])

    def render(console):
        table = Table(
            title=f"{operator} eigenvalues ({results['method']}, engine {results['engine']})"
        )
        for col in ("#", "eigenvalue", "residual", "converged"):
            table.add_column(col, justify="right")
        for i, (v, r, c) in enumerate(
            zip(results["eigenvalues"], results["residuals"], results["converged"]), 1
        ):
            table.add_row(str(i), fmt(v, 8), fmt(r, 3), fmt(c))
        console.print(table)
        console.print(
            f"{results['matvecs']} matvecs over {session.num_samples} samples, "
            f"{results['scope']['numel']} parameters"
        )
        for note in results.get("notes") or []:
            console.print(f"note: {note}")

    return common.Outcome(report, render)


@common.analysis_command(app, "trace")
def trace_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    operator: OperatorOpt = "hessian",
    estimator: Annotated[
        str,
        typer.Option(
            "--estimator",
            help="hutchpp (default), hutchinson, gn-split (Hessian: exact tr(G) + Hutch++ on tr(N)), or exact (Gauss-Newton).",
        ),
    ] = "hutchpp",
    tol: Annotated[
        float, typer.Option("--tol", help="Stop at this relative standard error.")
    ] = 1e-2,
    max_matvecs: Annotated[
        int, typer.Option("--max-matvecs", help="Budget of operator products.")
    ] = 1000,
    square: Annotated[
        bool, typer.Option("--square", help="Estimate Tr(A^2) = E||A v||^2 instead of tr(A).")
    ] = False,
    params: common.ParamsOpt = None,
    engine: EngineOpt = "native",
) -> common.Outcome:
    """Trace of the Hessian, Gauss-Newton or NME operator with standard error and per-layer traces."""
    from sharpcli.analyses import spectrum

    _positive(tol, "--tol")
    common.require(max_matvecs >= 2, "must be at least 2", "--max-matvecs")
    session = common.open_session(checkpoint, opts)
    with common.status(opts.quiet, f"trace of the {operator}"):
        results = spectrum.trace(
            session,
            operator=operator,
            estimator=estimator,
            tol=tol,
            max_matvecs=max_matvecs,
            square=square,
            params=params,
            engine=engine,
        )
    settings = opts.report_settings(skip=("checkpoint",))
    report = session.report("trace", settings, results, matvecs=results["trace"]["matvecs"])

    def render(console):
        t = results["trace"]
        quantity = f"Tr({operator}^2)" if square else f"tr({operator})"
        console.print(
            key_value_table(
                f"{quantity} ({t['estimator']}, engine {t['engine']})",
                {
                    "estimate": t["estimate"],
                    "stderr": t["stderr"],
                    "matvecs": t["matvecs"],
                    "probes": t["samples"],
                    "converged": t["converged"],
                },
            )
        )
        rows = [
            {"layer": k, "estimate": v["estimate"], "stderr": v.get("stderr")}
            for k, v in results["by_layer"].items()
        ]
        if rows:
            console.print(records_table("per layer (diagonal blocks)", rows))
        for note in t.get("notes") or []:
            console.print(f"note: {note}")

    return common.Outcome(report, render)


@common.analysis_command(app, "gn-nme")
def gn_nme_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    tol: Annotated[
        float, typer.Option("--tol", help="Relative standard error of the traces.")
    ] = 1e-2,
    eig_tol: Annotated[
        float, typer.Option("--eig-tol", help="Residual tolerance of the extreme eigenvalues.")
    ] = 1e-3,
    max_matvecs: Annotated[
        int, typer.Option("--max-matvecs", help="Budget per trace estimate.")
    ] = 1000,
    params: common.ParamsOpt = None,
    plot: Annotated[
        Optional[str],
        typer.Option("--plot", help="Write a PNG of the per-layer H, G, N traces to PATH."),
    ] = None,
) -> common.Outcome:
    """The NME paper's split H = G + N: traces, extreme eigenvalues, Tr(A^2), NME share, per layer."""
    from sharpcli.analyses import spectrum

    _positive(tol, "--tol")
    _positive(eig_tol, "--eig-tol")
    common.check_output(plot)
    session = common.open_session(checkpoint, opts)
    with common.status(opts.quiet, "Gauss-Newton / NME split"):
        results = spectrum.gn_nme(
            session, tol=tol, eig_tol=eig_tol, max_matvecs=max_matvecs, params=params
        )
    if plot is not None:
        from sharpcli.report.plots import plot_gn_nme_layers

        plot_gn_nme_layers(results, plot)
        results["plot"] = plot
    settings = opts.report_settings(skip=("checkpoint",))
    report = session.report("gn-nme", settings, results, matvecs=results["matvecs"])

    def render(console):
        from sharpcli.curvature.registry import OPERATORS, SPLIT

        table = Table(title="H = G + N (NME paper, section 2)")
        for col in ("operator", "trace", "± stderr", "lambda_max", "lambda_min", "Tr(A^2)"):
            table.add_column(col, justify="right")
        for name in SPLIT:
            r = results[name]
            table.add_row(
                OPERATORS[name].symbol,
                fmt(r["trace"]["estimate"]),
                fmt(r["trace"]["stderr"], 3),
                fmt(r["lambda_max"]),
                fmt(r["lambda_min"]),
                fmt(r["frobenius_sq"]),
            )
        console.print(table)
        console.print(
            key_value_table(
                "NME share",
                {
                    "tr(N)/tr(H)": results["nme_share"],
                    "||N||_F/||H||_F": results["nme_frobenius_ratio"],
                },
            )
        )
        if results["ggn_trace_check"]:
            console.print(key_value_table("tr(G) by three estimators", results["ggn_trace_check"]))
        console.print(records_table("per layer", results["layers"]))

    return common.Outcome(report, render)


@common.analysis_command(app, "density")
def density_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    operator: OperatorOpt = "hessian",
    probes: Annotated[int, typer.Option("--probes", help="Random start vectors (SLQ runs).")] = 4,
    steps: Annotated[int, typer.Option("--steps", help="Lanczos steps per probe.")] = 64,
    grid_points: Annotated[
        int, typer.Option("--grid-points", help="Points of the density grid.")
    ] = 512,
    broadening: Annotated[
        Optional[float],
        typer.Option(
            "--broadening", help="Gaussian broadening width (default: from the spectrum's range)."
        ),
    ] = None,
    params: common.ParamsOpt = None,
    plot: Annotated[
        Optional[str], typer.Option("--plot", help="Write a PNG plot of the density to PATH.")
    ] = None,
) -> common.Outcome:
    """Spectral density of the Hessian (or G, N) by stochastic Lanczos quadrature, with a PNG plot."""
    from sharpcli.analyses import spectrum

    common.require(probes >= 1, "must be at least 1", "--probes")
    common.require(steps >= 2, "must be at least 2", "--steps")
    common.require(grid_points >= 8, "must be at least 8", "--grid-points")
    _positive(broadening, "--broadening")
    common.check_output(plot)
    session = common.open_session(checkpoint, opts)
    with common.status(opts.quiet, "stochastic Lanczos quadrature"):
        results = spectrum.density(
            session,
            operator=operator,
            probes=probes,
            steps=steps,
            grid_points=grid_points,
            broadening=broadening,
            params=params,
        )
    if plot is not None:
        from sharpcli.report.plots import plot_density

        plot_density(results, plot, title=f"{operator} spectral density")
        results["plot"] = plot
    settings = opts.report_settings(skip=("checkpoint",))
    report = session.report("density", settings, results, matvecs=results.get("matvecs", 0))

    def render(console):
        summary = {
            k: results[k]
            for k in ("lambda_min", "lambda_max", "trace_estimate", "sigma", "matvecs")
            if k in results
        }
        console.print(
            key_value_table(
                f"{operator} spectral density (SLQ, {probes} probes x {steps} steps)", summary
            )
        )

    return common.Outcome(report, render)
