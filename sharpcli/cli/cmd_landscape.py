"""``sharp landscape`` (docs/commands/landscape.md).

Thin command: parse and check the options before anything is read, build the session (and
the second checkpoint's model for ``--along CKPT2``), call
:func:`sharpcli.analyses.landscape.loss_landscape`, write the grid (JSON, CSV), the directions and
the plot.
"""

from __future__ import annotations

import csv
import io
import math
from typing import Annotated, Optional

import typer

from sharpcli import catalogue, distributed, ledger
from sharpcli.atomic import write_text_atomic
from sharpcli.catalogue.values import CSV
from sharpcli.cli import choices, common, runner
from sharpcli.cli.group import app
from sharpcli.errors import UsageError
from sharpcli.registry import declare
from sharpcli.report.tables import key_value_table, records_table

LANDSCAPE = "landscape"


@declare(
    "command",
    LANDSCAPE,
    "Loss on a line or plane through the checkpoint, plotted.",
    paper="Li2018",
    info={"order": 11},
)
@common.analysis_command(app, LANDSCAPE)
def landscape_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    along: Annotated[
        str,
        typer.Option(
            "--along",
            metavar="WHAT",
            help="random (filter-normalized directions), eigen (top Hessian eigenvectors) or "
            "the path of a second checkpoint (the line to it).",
        ),
    ] = "random",
    dims: Annotated[
        Optional[int],
        typer.Option(
            "--dims", metavar="N", help="1: a line, 2: a plane (default: 2; 1 along CKPT2)."
        ),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", metavar="N", help="Grid points per axis.")] = 21,
    span: Annotated[
        Optional[float],
        typer.Option(
            "--span",
            metavar="X",
            help="Grid from -X to X (default 1); along CKPT2 from -X to 1+X (default 0.5).",
        ),
    ] = None,
    bias_bn: Annotated[
        choices.LandscapeBiasBN,
        typer.Option(
            "--bias-bn",
            help="Random directions on biases and normalization parameters: zero or the "
            "weights (Li et al.'s code).",
        ),
    ] = "zero",
    params: common.ParamsOpt = None,
    directions: Annotated[
        Optional[str],
        typer.Option(
            "--directions",
            metavar="PATH",
            help="Read the directions from a file --save-directions wrote (redo a figure).",
        ),
    ] = None,
    save_directions: Annotated[
        Optional[str],
        typer.Option(
            "--save-directions", metavar="PATH", help="Write the directions (safetensors)."
        ),
    ] = None,
    csv_path: Annotated[
        Optional[str],
        typer.Option("--csv", metavar="PATH", help="Write the grid as CSV."),
    ] = None,
    eig_tol: Annotated[
        float, typer.Option("--eig-tol", help="Lanczos tolerance of the eigenvectors.")
    ] = 1e-3,
    eig_max_matvecs: Annotated[
        Optional[int],
        typer.Option("--eig-max-matvecs", metavar="N", help="Lanczos steps at most."),
    ] = None,
    plot: common.PlotOpt = None,
) -> runner.Outcome:
    """Loss and accuracy on a line or plane through the checkpoint (Li et al. 2018), a
    contour or line plot."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.landscape import LandscapeConfig, loss_landscape
    from sharpcli.analyses.landscape_directions import load_directions
    from sharpcli.analyses.landscape_directions import save_directions as write_directions

    kind = along if along in ("random", catalogue.ALONG_EIGEN) else "checkpoint"
    if directions is not None:
        kind = "file"
    config = LandscapeConfig(
        along=kind,
        dims=(1 if kind == "checkpoint" else 2) if dims is None else dims,
        steps=steps,
        span=span,
        bias_bn=bias_bn,
        params=params,
        seed=opts.seed,
        eig_tol=eig_tol,
        eig_max_matvecs=eig_max_matvecs,
    )
    config.validate()  # option errors before anything is read
    common.require(eig_tol > 0, f"must be > 0, got {eig_tol:g}", "--eig-tol")
    for path, option in ((save_directions, "--save-directions"), (csv_path, "--csv")):
        common.check_output(path, option)
    common.check_output(plot)
    session = common.open_session(checkpoint, opts, curvature=kind == catalogue.ALONG_EIGEN)
    other = _second_model(along, opts, session) if kind == "checkpoint" else None
    loaded, loaded_info = None, None
    if directions is not None:
        loaded, loaded_info = load_directions(directions, session.model, _names(session, params))
    with common.progress_bar(opts.quiet, opts.json, "landscape"):
        result, used, names = loss_landscape(
            session.model,
            session.analysis_data(),
            config,
            other=other,
            directions=loaded,
            directions_info=loaded_info,
        )
    results = result.to_dict()
    if kind == "checkpoint":
        results["directions"]["second_checkpoint"] = along
    # under torchrun every rank holds the grid and the directions; rank 0 writes the files
    writes = distributed.is_main_process()
    if save_directions is not None and writes:
        write_directions(save_directions, names, used, results["directions"])
    if save_directions is not None:
        results["directions_file"] = save_directions
    if csv_path is not None and writes:
        write_text_atomic(csv_path, _csv_text(result.csv_rows()))
    if csv_path is not None:
        results[CSV] = csv_path
    if plot is not None and writes:
        # imports matplotlib: kept out of sharp's start-up (--help, completion)
        from sharpcli.report.landscape_plot import plot_landscape

        plot_landscape(results, plot, title=f"loss landscape of {checkpoint} ({kind})")
    if plot is not None:
        results["plot"] = plot
    settings = opts.report_settings(along=along, dims=config.dims, span=config.half_width)
    report = session.report(LANDSCAPE, settings, results, matvecs=0)
    return runner.Outcome(report, render=lambda console: _render(console, results))


def _names(session, params: str | None) -> list[str]:
    # imports torch: kept out of start-up
    from sharpcli.curvature.products.scope import ParamScope

    return ParamScope.resolve(session.model, params).names


def _second_model(path: str, opts: common.CommonOptions, session):
    """The model of ``--along CKPT2``, in the session's dtype and device, eval mode."""
    # imports torch: kept out of start-up
    from sharpcli.io.checkpoints import load_checkpoint

    if ledger.same_file(path, session.checkpoint.path):
        raise UsageError("is CKPT itself: give a second checkpoint", source="--along")
    loaded = load_checkpoint(
        path,
        arch=opts.arch,
        arch_args=common.parse_json_option(opts.arch_args, "--arch-args"),
        model_factory=opts.model_factory,
        trust_pickle=opts.trust_pickle,
    )
    return loaded.model.to(device=session.device, dtype=session.dtype).eval()


def _csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else repr(v) for k, v in row.items()})
    return out.getvalue()


def _render(console, results: dict) -> None:
    summary = {
        "along": results["along"],
        "grid": "x".join([str(results["steps"])] * results["dims"]),
        "x from, to": f"{results['x'][0]:g}, {results['x'][-1]:g}",
        "loss at CKPT": results["centre_loss"],
        "loss min": results["loss_min"],
        "loss max": results["loss_max"],
        "direction norms": ", ".join(f"{n:.4g}" for n in results["directions"]["norms"]),
        "params": f"{results['params']} ({results['num_params']} parameters)",
    }
    if "eigenvalues" in results["directions"]:
        summary["eigenvalues"] = ", ".join(f"{v:.4g}" for v in results["directions"]["eigenvalues"])
    console.print(key_value_table("loss landscape", summary))
    if results["dims"] == 1:
        rows = [
            {"x": x, "loss": loss}
            | ({"accuracy": results["accuracy"][i]} if results["accuracy"] else {})
            for i, (x, loss) in enumerate(zip(results["x"], results["loss"]))
        ]
        every = max(1, math.ceil(len(rows) / 11))
        shown = rows[::every] + ([rows[-1]] if (len(rows) - 1) % every else [])
        console.print(records_table("loss along the line", shown))
    for note in results["notes"]:
        runner.print_note(note)
