"""``sharp eigen``, ``sharp trace``, ``sharp gn-nme``, ``sharp density``: curvature spectra."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli import catalogue
from sharpcli.cli import choices, common, hvp_option, lazyhelp, runner
from sharpcli.cli.group import app
from sharpcli.registry import declare
from sharpcli.report.tables import key_value_table, records_table

# the commands of this module, each declared beside its function (sharpcli.catalogue.COMMANDS)
EIGEN = "eigen"
TRACE = "trace"
GN_NME = "gn-nme"
DENSITY = "density"


def _operator_help() -> str:
    """``--operator``'s help: the operators of the catalogue, extensions registered in this
    process included (read again when the help is shown)."""
    return f"{catalogue.operator_help()}."


def _estimator_help() -> str:
    """``--estimator``'s help: the trace estimators of the catalogue, the default first,
    extensions registered in this process included (read again when the help is shown)."""
    return catalogue.entries_help(catalogue.ESTIMATORS) + "."


DEFAULT_OPERATOR = catalogue.HESSIAN
OperatorOpt = Annotated[
    str,
    typer.Option(
        "--operator",
        metavar=choices.metavar(catalogue.OPERATORS),
        autocompletion=choices.completer(catalogue.OPERATORS),
        help=lazyhelp.lazy_help(_operator_help),
    ),
]
EngineOpt = Annotated[
    choices.Engine,
    typer.Option("--engine", help="Engine: pyhessian (PyPI pyhessian 0.1) for parity."),
]
# --eig-* bound the eigensolver, --trace-* the trace estimators (common.EigTolOpt)
EigMaxMatvecsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--eig-max-matvecs",
        "--max-matvecs",
        metavar="N",
        help="Eigensolver products at most (default min(P, 100), power 100; --max-matvecs: "
        "former name).",
    ),
]
TraceTolOpt = Annotated[
    float,
    typer.Option(
        "--trace-tol",
        "--tol",
        help="Stop at this relative standard error (--tol: former name).",
    ),
]


BlocksOpt = Annotated[
    Optional[str],
    typer.Option(
        "--blocks",
        metavar="SPEC",
        help="Per block too: params, modules, layers, NAME=GLOB,..",
    ),
]


TopOpt = Annotated[
    Optional[int],
    typer.Option(
        "--top",
        metavar="N",
        help="Show only the N largest blocks (JSON: all).",
    ),
]


def _largest_blocks(blocks: list[dict], top: int | None) -> tuple[list[dict], str | None]:
    """The blocks a table shows, largest first (the ``top`` largest when given), and a line
    saying how many were left out (None when none)."""
    shown = sorted(blocks, key=lambda b: -b["numel"])[: top if top is not None else None]
    left = len(blocks) - len(shown)
    return shown, (
        f"{left} smaller blocks not shown (--top {top}; all in --json)" if left else None
    )


def _positive(value, option: str, strict: bool = True) -> None:
    common.require(value is None or (value > 0 if strict else value >= 0), "must be > 0", option)


@declare(
    "command",
    EIGEN,
    "Largest or smallest curvature eigenvalues (how sharp the minimum is).",
    paper="Lanczos1950",
    info={"order": 2, "reports_eigenvalues": True},
)
@common.analysis_command(app, EIGEN)
def eigen_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    top_k: Annotated[int, typer.Option("--top-k", help="How many eigenvalues (per end).")] = 1,
    which: Annotated[
        choices.Which, typer.Option("--which", help="Which end of the spectrum.")
    ] = "largest",
    operator: OperatorOpt = DEFAULT_OPERATOR,
    method: Annotated[
        choices.Method,
        typer.Option("--method", help="lanczos, or power iteration (PyHessian's method)."),
    ] = "lanczos",
    tol: common.EigTolOpt = 1e-3,
    max_matvecs: EigMaxMatvecsOpt = None,
    no_data_error: Annotated[
        bool,
        typer.Option("--no-data-error", help="No data error (float64: a product per eigenvalue)."),
    ] = False,
    params: common.ParamsOpt = None,
    engine: EngineOpt = "native",
    hvp: hvp_option.HvpOpt = None,
    blocks: BlocksOpt = None,
    top: TopOpt = None,
    plot: Annotated[
        Optional[str],
        typer.Option(
            "--plot",
            metavar="PATH",
            help="With --blocks: PNG heatmap of the blocks by layer.",
        ),
    ] = None,
) -> runner.Outcome:
    """Largest and/or smallest eigenvalues of the Hessian, GGN, NME or a Fisher."""
    # imports torch: kept out of start-up
    from sharpcli.analyses import spectrum

    common.require(top_k >= 1, "must be at least 1", "--top-k")
    _positive(top, "--top")
    _positive(tol, "--eig-tol")
    _positive(max_matvecs, "--eig-max-matvecs")
    common.require(plot is None or blocks is not None, "needs --blocks", "--plot")
    common.check_output(plot)
    hvp, fsdp = hvp_option.check(hvp, operator, engine, blocks)
    session = common.open_session(
        checkpoint, opts, double_backward=hvp != catalogue.FINITE_DIFFERENCE
    )
    with common.progress_bar(opts.quiet, opts.json, f"eigenvalues of the {operator}"):
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
            hvp=hvp,
            fsdp=fsdp,
            data_error=not no_data_error,
        )
        if blocks is not None:
            # imports torch: kept out of start-up
            from sharpcli.analyses.blocks import eigen_blocks, session_block_engines

            common.require(engine == "native", "needs --engine native", "--blocks")
            results["blocks"] = eigen_blocks(
                session_block_engines(session, params, blocks),
                operator=operator,
                top_k=top_k,
                which=which,
                method=method,
                tol=tol,
                max_matvecs=max_matvecs,
                seed=session.seed,
            )
    if plot is not None:
        # kept out of sharp's start-up (--help, completion)
        from sharpcli.report.block_heatmap import plot_block_eigenvalues

        plot_block_eigenvalues(results, plot, operator=operator, which=which)
        results["plot"] = plot
    settings = opts.report_settings(skip=("checkpoint",))
    blocks_run = results.get("blocks", [])
    matvecs = results["matvecs"] + sum(b["matvecs"] + b["data_matvecs"] for b in blocks_run)
    matvecs += results.get("data_matvecs") or 0
    report = session.report(EIGEN, settings, results, matvecs=matvecs)

    def render(console):
        data = results.get("data_stderr") or [None] * len(results["eigenvalues"])
        rows = [
            {"#": i, "eigenvalue": v, "residual": r, "data stderr": d, "converged": c}
            for i, (v, r, d, c) in enumerate(
                zip(results["eigenvalues"], results["residuals"], data, results["converged"]), 1
            )
        ]
        console.print(
            records_table(
                f"{operator} eigenvalues ({results['method']}, engine {results['engine']})",
                rows,
                digits={"eigenvalue": 8, "residual": 3, "data stderr": 3},
            )
        )
        if results.get("data_method"):
            extra = results["data_matvecs"]
            # float32: the residual check's product of the eigenvectors is read batch by batch
            cost = f"{extra} more matvecs" if extra else "from the residual check's products"
            console.print(f"data stderr: {results['data_method']}, {cost}")
        console.print(
            f"{results['matvecs']} matvecs over {session.num_samples} samples, "
            f"{results['scope']['numel']} parameters"
        )
        hvp_option.print_products(console, results, notes=False)
        if "blocks" in results:
            shown, left = _largest_blocks(results["blocks"], top)
            block_rows = [
                {
                    "block": b["name"],
                    "numel": b["numel"],
                    "eigenvalues": ", ".join(f"{v:.6g}" for v in b["eigenvalues"]),
                    "data stderr": ", ".join(f"{d:.3g}" for d in b["data_stderr"] or [] if d),
                    "converged": all(b["converged"]),
                }
                for b in shown
            ]
            console.print(records_table(f"{operator} eigenvalues per block", block_rows))
            if left:
                console.print(left)
        for note in results.get("notes") or []:
            runner.print_note(note)

    return runner.Outcome(report, render)


@declare(
    "command",
    TRACE,
    "Trace of the curvature: the sum of all its eigenvalues.",
    paper="Hutchinson1989",
    info={"order": 3, "reports_trace": True},
)
@common.analysis_command(app, TRACE)
def trace_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    operator: OperatorOpt = DEFAULT_OPERATOR,
    estimator: Annotated[
        str,
        typer.Option(
            "--estimator",
            metavar=choices.metavar(catalogue.ESTIMATORS),
            autocompletion=choices.completer(catalogue.ESTIMATORS),
            help=lazyhelp.lazy_help(_estimator_help),
        ),
    ] = catalogue.ESTIMATORS.names()[0],
    tol: TraceTolOpt = 1e-2,
    max_matvecs: common.TraceMaxMatvecsOpt = 1000,
    square: Annotated[
        bool, typer.Option("--square", help="Estimate Tr(A^2) = E||A v||^2 instead of tr(A).")
    ] = False,
    params: common.ParamsOpt = None,
    engine: EngineOpt = "native",
    hvp: hvp_option.HvpOpt = None,
    blocks: BlocksOpt = None,
    top: TopOpt = None,
) -> runner.Outcome:
    """Trace of H, G, N or a Fisher, with its standard error and per-layer traces."""
    # imports torch: kept out of start-up
    from sharpcli.analyses import spectrum

    _positive(tol, "--trace-tol")
    _positive(top, "--top")
    common.require(max_matvecs >= 2, "must be at least 2", "--trace-max-matvecs")
    hvp, fsdp = hvp_option.check(hvp, operator, engine, blocks, estimator)
    session = common.open_session(
        checkpoint, opts, double_backward=hvp != catalogue.FINITE_DIFFERENCE
    )
    with common.progress_bar(opts.quiet, opts.json, f"trace of the {operator}"):
        results = spectrum.trace(
            session,
            operator=operator,
            estimator=estimator,
            tol=tol,
            max_matvecs=max_matvecs,
            square=square,
            params=params,
            engine=engine,
            hvp=hvp,
            fsdp=fsdp,
        )
        if blocks is not None:
            # imports torch: kept out of start-up
            from sharpcli.analyses.blocks import session_block_engines, trace_blocks

            common.require(engine == "native", "needs --engine native", "--blocks")
            results["blocks"], results["blocks_sum"] = trace_blocks(
                session_block_engines(session, params, blocks),
                operator=operator,
                estimator=estimator,
                tol=tol,
                max_matvecs=max_matvecs,
                square=square,
                seed=session.seed,
            )
    settings = opts.report_settings(skip=("checkpoint",))
    matvecs = results["trace"]["matvecs"] + (results["trace"].get("data_matvecs") or 0)
    matvecs += sum(b["matvecs"] + (b.get("data_matvecs") or 0) for b in results.get("blocks", []))
    report = session.report(TRACE, settings, results, matvecs=matvecs)

    def render(console):
        t = results["trace"]
        quantity = f"Tr({operator}^2)" if square else f"tr({operator})"
        numbers = {
            "estimate": t["estimate"],
            "stderr": t["stderr"],
            "data stderr": t.get("data_stderr"),
            "data method": t.get("data_method"),
            "matvecs": t["matvecs"],
            "probes": t["samples"],
            "converged": t["converged"],
        }
        if t.get("data_matvecs"):  # Tr(A^2)'s data error: one more block of products
            numbers["data matvecs"] = t["data_matvecs"]
        title = f"{quantity} ({t['estimator']}, engine {t['engine']})"
        console.print(key_value_table(title, numbers))
        rows = [
            {"layer": k, "estimate": v["estimate"], "stderr": v.get("stderr")}
            for k, v in results["by_layer"].items()
        ]
        if rows:
            console.print(records_table("per layer (diagonal blocks)", rows))
        hvp_option.print_products(console, results)
        if "blocks" in results:
            shown, left = _largest_blocks(results["blocks"], top)
            block_rows = [
                {
                    "block": b["name"],
                    "numel": b["numel"],
                    "estimate": b["estimate"],
                    "stderr": b["stderr"],
                    "data stderr": b.get("data_stderr"),
                    "converged": b["converged"],
                }
                for b in shown
            ] + [
                {
                    "block": "sum",
                    "numel": results["blocks_sum"]["numel"],
                    "estimate": results["blocks_sum"]["estimate"],
                    "stderr": results["blocks_sum"]["stderr"],
                    "data stderr": results["blocks_sum"].get("data_stderr"),
                    "converged": None,
                }
            ]
            digits = {"data stderr": 3}
            console.print(records_table(f"{quantity} per block", block_rows, digits=digits))
            if left:
                console.print(left)
        for note in t.get("notes") or []:
            runner.print_note(note)

    return runner.Outcome(report, render)


@declare(
    "command",
    GN_NME,
    "Split the Hessian into its Gauss-Newton and nonlinear parts.",
    paper="NME",
    info={"order": 4},
)
@common.analysis_command(app, GN_NME)
def gn_nme_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    tol: TraceTolOpt = 1e-2,
    eig_tol: Annotated[
        float,
        typer.Option(
            "--eig-tol",
            help="Eigenvalue residual tolerance of the extreme eigenvalues: converged when "
            "||A u - lambda u|| <= tol |lambda|.",
        ),
    ] = 1e-3,
    max_matvecs: common.TraceMaxMatvecsOpt = 1000,
    params: common.ParamsOpt = None,
    plot: Annotated[
        Optional[str],
        typer.Option(
            "--plot", metavar="PATH", help="Write a PNG of the per-layer H, G, N traces to PATH."
        ),
    ] = None,
    ggn_estimator: Annotated[
        choices.GGNEstimator,
        typer.Option(
            "--ggn-estimator",
            help="Cross-checks of tr(G): auto runs the exact one only where it is cheap "
            "(<= 128 output directions a sample).",
        ),
    ] = "auto",
) -> runner.Outcome:
    """The NME paper's split H = G + N: traces, extreme eigenvalues, Tr(A^2), NME share, per layer."""
    # imports torch: kept out of start-up
    from sharpcli.analyses import spectrum

    _positive(tol, "--trace-tol")
    _positive(eig_tol, "--eig-tol")
    common.check_output(plot)
    session = common.open_session(checkpoint, opts)
    with common.progress_bar(opts.quiet, opts.json, "Gauss-Newton / NME split"):
        results = spectrum.gn_nme(
            session,
            tol=tol,
            eig_tol=eig_tol,
            max_matvecs=max_matvecs,
            params=params,
            ggn_estimator=ggn_estimator,
        )
    if plot is not None:
        # kept out of sharp's start-up (--help, completion)
        from sharpcli.report.plots import plot_gn_nme_layers

        plot_gn_nme_layers(results, plot)
        results["plot"] = plot
    settings = opts.report_settings(skip=("checkpoint",))
    matvecs = results["matvecs"] + results["data_matvecs"]
    report = session.report(GN_NME, settings, results, matvecs=matvecs)

    def render(console):
        # imports torch: kept out of start-up
        from sharpcli.curvature.operators.registry import OPERATORS, SPLIT

        rows = [
            {
                "operator": OPERATORS[name].symbol,
                "trace": results[name]["trace"]["estimate"],
                "± stderr": results[name]["trace"]["stderr"],
                "± data": results[name]["trace"]["data_stderr"],
                "lambda_max": results[name]["lambda_max"],
                "lambda_min": results[name]["lambda_min"],
                "Tr(A^2)": results[name]["frobenius_sq"],
                "Tr(A^2) ± data": results[name]["frobenius_sq_data_stderr"],
            }
            for name in SPLIT
        ]
        digits = {"± stderr": 3, "± data": 3, "Tr(A^2) ± data": 3}
        console.print(records_table("H = G + N (NME paper, section 2)", rows, digits=digits))
        console.print(
            key_value_table(
                "NME share",
                {
                    "tr(N)/tr(H)": results["nme_share"],
                    "||N||_F/||H||_F": results["nme_frobenius_ratio"],
                },
            )
        )
        check = results["ggn_trace_check"]
        numbers = {k: v for k, v in check.items() if k not in ("estimators", "why")}
        console.print(key_value_table("tr(G) by each estimator", numbers))
        if catalogue.GGN_EXACT not in check["estimators"]:  # say why the exact trace did not run
            runner.print_note(check["why"])
        console.print(records_table("per layer", results["layers"]))

    return runner.Outcome(report, render)


@declare(
    "command",
    DENSITY,
    "The whole eigenvalue spectrum, estimated and plotted.",
    paper="Ghorbani2019",
    info={"order": 5},
)
@common.analysis_command(app, DENSITY)
def density_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    operator: OperatorOpt = DEFAULT_OPERATOR,
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
    hvp: hvp_option.HvpOpt = None,
    plot: Annotated[
        Optional[str],
        typer.Option("--plot", metavar="PATH", help="Write a PNG plot of the density to PATH."),
    ] = None,
    blocks: BlocksOpt = None,
    top: TopOpt = None,
) -> runner.Outcome:
    """Spectral density of the Hessian (or G, N) by stochastic Lanczos quadrature; --plot
    writes it as a PNG."""
    # imports torch: kept out of start-up
    from sharpcli.analyses import spectrum

    common.require(probes >= 1, "must be at least 1", "--probes")
    _positive(top, "--top")
    common.require(steps >= 2, "must be at least 2", "--steps")
    common.require(grid_points >= 8, "must be at least 8", "--grid-points")
    _positive(broadening, "--broadening")
    common.check_output(plot)
    hvp, fsdp = hvp_option.check(hvp, operator, "native", blocks)
    session = common.open_session(
        checkpoint, opts, double_backward=hvp != catalogue.FINITE_DIFFERENCE
    )
    with common.progress_bar(opts.quiet, opts.json, "stochastic Lanczos quadrature"):
        results = spectrum.density(
            session,
            operator=operator,
            probes=probes,
            steps=steps,
            grid_points=grid_points,
            broadening=broadening,
            params=params,
            hvp=hvp,
            fsdp=fsdp,
        )
        if blocks is not None:
            # imports torch: kept out of start-up
            from sharpcli.analyses.blocks import density_blocks, session_block_engines
            from sharpcli.analyses.heterogeneity import block_heterogeneity

            results["blocks"] = density_blocks(
                session_block_engines(session, params, blocks),
                operator=operator,
                probes=probes,
                steps=steps,
                grid_points=grid_points,
                broadening=broadening,
                seed=session.seed,
            )
            results["heterogeneity"], results["block_diagonal"] = block_heterogeneity(
                results, results["blocks"], grid_points
            )
    if plot is not None:
        # kept out of sharp's start-up (--help, completion)
        from sharpcli.report.plots import plot_block_densities, plot_density

        if blocks is not None:
            plot_block_densities(results, plot, operator=operator, top=top)
        else:
            plot_density(results, plot, title=f"{operator} spectral density")
        results["plot"] = plot
    settings = opts.report_settings(skip=("checkpoint",))
    matvecs = results.get("matvecs", 0) + sum(b["matvecs"] for b in results.get("blocks", []))
    report = session.report(DENSITY, settings, results, matvecs=matvecs)

    def render(console):
        summary = {
            k: results[k]
            for k in (
                "lambda_min",
                "lambda_max",
                "trace_estimate",
                "trace_stderr",
                "trace_data_stderr",
                "sigma",
                "matvecs",
            )
            if k in results
        }
        console.print(
            key_value_table(
                f"{operator} spectral density (SLQ, {probes} probes x {steps} steps)", summary
            )
        )
        hvp_option.print_products(console, results)
        if "blocks" in results:
            keys = ("numel", "lambda_min", "lambda_max", "trace_estimate")
            shown, left = _largest_blocks(results["blocks"], top)
            block_rows = [{"block": b["name"], **{k: b[k] for k in keys}} for b in shown]
            console.print(records_table(f"{operator} spectral density per block", block_rows))
            if left:
                console.print(left)
            het, diag = results["heterogeneity"], results["block_diagonal"]
            console.print(
                key_value_table(
                    "block heterogeneity (Jensen-Shannon distance, [Zhang2024])",
                    {
                        "blocks": len(het["names"]),
                        "pairs": het["pairs"],
                        "mean": het["mean"],
                        "max": het["max"],
                        "max pair": " / ".join(het["max_pair"]) if het["max_pair"] else None,
                        "block-diagonal vs full": diag["js_distance_to_full"],
                    },
                )
            )

    return runner.Outcome(report, render)
