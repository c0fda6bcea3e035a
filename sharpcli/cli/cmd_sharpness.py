"""``sharp sharpness`` (docs/commands/sharpness.md).

Thin command: parse the options, check them before the checkpoint is read, build a
:class:`sharpcli.session.Session`, call :func:`sharpcli.analyses.sharpness.sharpness`, render
the table or write the JSON.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli.cli import choices, common, runner
from sharpcli.cli.group import app
from sharpcli.registry import declare
from sharpcli.report.tables import key_value_table, records_table

SHARPNESS = "sharpness"


@declare(
    "command",
    SHARPNESS,
    "Worst-case and average-case sharpness, invariant to rescaling when adaptive.",
    paper="Andriushchenko2023",
    info={"order": 10},
)
@common.analysis_command(app, SHARPNESS)
def sharpness_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    kind: Annotated[
        choices.SharpnessKind,
        typer.Option(
            "--kind",
            help="worst-case: max of L(w + delta) - L(w) over the ball; average: its mean "
            "under noise.",
        ),
    ] = "worst-case",
    norm: Annotated[
        choices.SharpnessNorm,
        typer.Option(
            "--norm", help="Ball (worst case) or noise (average: l2 Gaussian, linf uniform)."
        ),
    ] = "l2",
    rho: Annotated[
        str,
        typer.Option(
            "--rho",
            metavar="R,...",
            help="Radii (worst case) or noise scales (average), comma-separated, e.g. "
            "--rho 0.01,0.05.",
        ),
    ] = "0.05",
    adaptive: Annotated[
        bool,
        typer.Option(
            "--adaptive/--no-adaptive",
            help="Scale delta by |w| (ASAM; invariant under rescaling) or not.",
        ),
    ] = True,
    m: Annotated[
        Optional[int],
        typer.Option(
            "--m",
            metavar="N",
            help="Samples per sharpness batch (m-sharpness; default: the whole set).",
        ),
    ] = None,
    params: common.ParamsOpt = None,
    norm_layers: Annotated[
        choices.NormLayers,
        typer.Option(
            "--norm-layers",
            help="Perturb normalization layers' gamma and beta (include) or not (exclude).",
        ),
    ] = "include",
    steps: Annotated[
        int, typer.Option("--steps", metavar="N", help="Auto-PGD steps per restart.")
    ] = 20,
    restarts: Annotated[
        int,
        typer.Option("--restarts", metavar="N", help="Auto-PGD restarts (the first from w)."),
    ] = 1,
    step_size: Annotated[
        float,
        typer.Option("--step-size", metavar="X", help="First Auto-PGD step, in units of rho."),
    ] = 2.0,
    noise_draws: Annotated[
        int,
        typer.Option("--noise-draws", metavar="N", help="Noise draws per batch (average)."),
    ] = 100,
) -> runner.Outcome:
    """Worst-case or average-case sharpness, adaptive or standard, per rho
    (Andriushchenko et al. 2023)."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.sharpness import SharpnessConfig, sharpness

    config = SharpnessConfig(
        kind=kind,
        norm=norm,
        rhos=tuple(common.parse_float_list(rho, "--rho")),
        adaptive=adaptive,
        m=m,
        params=params,
        norm_layers=norm_layers,
        steps=steps,
        restarts=restarts,
        step_size=step_size,
        noise_draws=noise_draws,
        seed=opts.seed,
    )
    config.validate()  # before the checkpoint is read: option errors first
    session = common.open_session(checkpoint, opts, curvature=False)  # gradients only
    with common.progress_bar(opts.quiet, opts.json, "sharpness"):
        result = sharpness(session.model, session.analysis_data(), config)
    settings = opts.report_settings(rho=list(config.rhos))
    report = session.report(SHARPNESS, settings, result.to_dict(), matvecs=0)
    return runner.Outcome(report, render=lambda console: _render(console, result))


def _render(console, result) -> None:
    definition = result.to_dict()
    rows = definition.pop("rows")
    notes = definition.pop("notes")
    worst = result.config.kind == "worst-case"
    geometry = f"||delta / c||_{'2' if result.config.norm == 'l2' else 'inf'}"
    console.print(
        records_table(
            f"{result.config.kind} sharpness, c = {definition['scale']}, {geometry}"
            + (" <= rho" if worst else " noise of scale rho")
            + f", {result.batches} batches of m = {result.m}",
            rows,
            ["rho", "sharpness", "stderr", "loss", "loss_perturbed", "accuracy"]
            + ["accuracy_perturbed"]
            + (["perturbation_norm"] if worst else ["stderr_noise"]),
        )
    )
    if worst:
        for row in result.rows:
            marks = sorted({0, len(row.history) // 4, len(row.history) // 2, len(row.history) - 1})
            steps = "/".join(str(i) for i in marks)
            values = ", ".join(f"{row.history[i]:.4g}" for i in marks)
            console.print(f"rho {row.rho:g}, best after step {steps}: {values}", markup=False)
    console.print(key_value_table("definition", definition))
    for note in notes:
        runner.print_note(note)
