"""PNG plots for people (matplotlib, Agg backend, no display needed).

Every function writes one PNG atomically at a fixed size (``FIGSIZE`` inches at
``DPI``, i.e. 960 x 600 pixels) and returns the path.
"""

from __future__ import annotations

import math
from pathlib import Path

from sharpcli import catalogue
from sharpcli.atomic import write_atomic
from sharpcli.catalogue.values import DENSITY_KEY, TRACE_KEY
from sharpcli.errors import UsageError

FIGSIZE = (8.0, 5.0)
DPI = 120
PIXELS = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def _figure(nrows: int = 1, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=FIGSIZE, dpi=DPI)
    return plt, fig, axes


def _save(plt, fig, path: str | Path) -> Path:
    """Lay ``fig`` out tightly, write it to ``path`` as a PNG (atomically) and close it."""
    fig.tight_layout()
    path = Path(path)
    try:
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=DPI))
    finally:
        plt.close(fig)
    return path


def _finite(values):
    return [
        v if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else float("nan")
        for v in values
    ]


def plot_training_history(
    history: list[dict],
    path: str | Path,
    title: str = "training",
    tracked: list[dict] | None = None,
) -> Path:
    """Loss and accuracy per epoch (train and test); the tracked curvature beside them.

    The tracked values come from ``tracked`` (``results.tracked``: one row per tracked step,
    plotted against the step) when given, else from each history row's ``tracked`` (against
    the epoch). Each quantity that has a threshold in the rows (a key ``NAME_threshold``,
    paired with the key ``NAME`` or ``NAME_...``: ``lambda_max_threshold`` with
    ``lambda_max``, ``preconditioned_threshold`` with ``preconditioned_sharpness``) gets its
    own panel, the value against its threshold line on a linear scale (the edge of stability
    shows as the value hovering at the line); the others share one panel (symlog for
    eigenvalues and traces).
    """
    points, unit = _tracked_points(history, tracked)
    pairs, rest = _tracked_panels(points)
    panels = len(pairs) + (1 if rest else 0)
    # up to two panels side by side; more in two rows
    nrows = 1 if panels <= 1 else 2
    ncols = -(-(1 + panels) // nrows)
    plt, fig, grid = _figure(nrows, ncols)
    axes = list(grid.flat) if panels else [grid]
    for unused in axes[1 + panels :]:
        unused.set_visible(False)
    _plot_losses_and_accuracies(axes[0], history, title)
    for cax, (key, threshold) in zip(axes[1:], pairs):
        _plot_against_threshold(cax, points, key, threshold, unit)
    if rest:
        _plot_tracked(axes[1 + len(pairs)], points, rest, unit)
    return _save(plt, fig, path)


def _tracked_points(history: list[dict], tracked: list[dict] | None) -> tuple[list, str]:
    """``([(x, row), ...], unit)``: the per-step rows against the step when given, else each
    history row's ``tracked`` against the epoch."""
    if tracked:
        return [(row["step"], row) for row in tracked], "step"
    return [(row["epoch"], row["tracked"]) for row in history if row.get("tracked")], "epoch"


def _tracked_panels(points: list) -> tuple[list[tuple[str, str]], list[str]]:
    """``(pairs, rest)``: the quantities with a threshold (:func:`_threshold_pairs`), each on
    its own panel, and the other tracked keys, which share one."""
    keys = list(dict.fromkeys(k for _, row in points for k in row if _is_tracked_key(k, row)))
    pairs = _threshold_pairs(keys)
    paired = {k for pair in pairs for k in pair}
    # a quantity's own companions (batch_sharpness_stderr, ..._batches): not curves of their own
    rest = [k for k in keys if k not in paired and not any(k.startswith(q + "_") for q in keys)]
    return pairs, rest


def _plot_losses_and_accuracies(ax, history: list[dict], title: str) -> None:
    """Train and test loss per epoch, their accuracies on a second axis."""
    epochs = [row["epoch"] for row in history]
    _plot_present(ax, epochs, history, ("train_loss", "test_loss"))
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    acc = ax.twinx()
    _plot_present(acc, epochs, history, ("train_accuracy", "test_accuracy"), color="tab:green")
    acc.set_ylabel("accuracy")
    ax.legend(loc="upper left", fontsize=8)
    acc.legend(loc="lower left", fontsize=8)
    ax.set_title(title)


def _plot_present(ax, epochs: list, history: list[dict], keys: tuple, **style) -> None:
    """One line per key that some row of ``history`` has: the train key solid, the test one
    dashed."""
    for key, line in zip(keys, ("-", "--")):
        if any(row.get(key) is not None for row in history):
            values = _finite([row.get(key) for row in history])
            ax.plot(epochs, values, line, label=key.replace("_", " "), **style)


def _is_tracked_key(key: str, row: dict) -> bool:
    """A tracked quantity's key: a number, not the row's place (step, epoch, lr) or cost."""
    if key in ("step", "epoch", "lr", "matvecs"):
        return False
    value = row.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _threshold_pairs(keys: list[str]) -> list[tuple[str, str]]:
    """``(quantity, its threshold)`` for each key ``NAME_threshold`` whose quantity is among
    ``keys``: ``NAME`` itself, else the first ``NAME_...`` that is not a threshold."""
    pairs = []
    for threshold in keys:
        if not threshold.endswith("_threshold"):
            continue
        base = threshold[: -len("_threshold")]
        match = [
            k
            for k in keys
            if not k.endswith("_threshold") and (k == base or k.startswith(base + "_"))
        ]
        if match:
            pairs.append((base if base in match else match[0], threshold))
    return pairs


def _plot_against_threshold(cax, points: list, key: str, threshold: str, unit: str) -> None:
    """One quantity against its threshold line (dashed), on a linear scale."""
    xs = [x for x, row in points if row.get(key) is not None]
    values = _finite([row.get(key) for _, row in points if row.get(key) is not None])
    limits = _finite([row.get(threshold) for _, row in points if row.get(key) is not None])
    style = "-" if len(xs) > 30 else "o-"
    cax.plot(xs, values, style, color="tab:blue", label=key, markersize=3)
    cax.plot(xs, limits, "--", color="tab:red", label=threshold)
    cax.set_xlabel(unit)
    cax.set_title(f"{key} vs threshold", fontsize=9)
    cax.legend(fontsize=7)


def _plot_tracked(cax, points: list, tracked_keys: list[str], unit: str) -> None:
    """The tracked curvature per step or epoch (symlog for eigenvalues and traces)."""
    style = "-" if len(points) > 30 else "o-"
    for key in tracked_keys:
        cax.plot([p[0] for p in points], _finite([p[1].get(key) for p in points]), style, label=key)
    cax.set_xlabel(unit)
    cax.set_ylabel("curvature")
    cax.set_title("tracked curvature")
    if any(k in tracked_keys for k in ("lambda_max", TRACE_KEY, "frobenius_sq")):
        cax.set_yscale("symlog")
        cax.set_ylabel("curvature (symlog scale)")
    cax.legend(fontsize=8)


def plot_gn_nme_layers(results: dict, path: str | Path) -> Path:
    """Per-layer traces of H, G and N as grouped bars (the NME paper's split, layer by layer)."""
    rows = results["layers"]
    plt, fig, ax = _figure()
    names = [r["layer"] for r in rows]
    width = 0.27
    xs = list(range(len(rows)))
    for offset, key, label in (
        (-width, "hessian_trace", r"tr $H$"),
        (0.0, "ggn_trace", r"tr $G$"),
        (width, "nme_trace", r"tr $N$"),
    ):
        errors = [v if v == v else 0.0 for v in _finite([r.get(f"{key}_stderr") for r in rows])]
        ax.bar(
            [x + offset for x in xs],
            _finite([r[key] for r in rows]),
            width,
            yerr=errors,
            capsize=2,
            label=label,
        )
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(xs, names, rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("layer (module name)")
    ax.set_ylabel("diagonal-block trace (error bars: one standard error)")
    ax.set_title(rf"$H = G + N$ per layer (NME share {results.get('nme_share', float('nan')):.3g})")
    ax.legend()
    return _save(plt, fig, path)


# The columns a compare scatter uses by default, in order of preference.
SHARPNESS_COLUMNS = ("lambda_max", TRACE_KEY, "frobenius_sq", "nme_share", "loss")
ACCURACY_COLUMNS = ("test_accuracy", "train_accuracy")


def scatter_axes(records: list[dict], x: str | None, y: str | None) -> tuple[str, str]:
    """The (x, y) columns of ``compare --plot``: those given, else x the first sharpness column
    that some run has, y the first accuracy column some run has with it, else the next
    sharpness column (analyze reports carry no accuracy: ``trace`` against ``lambda_max``)."""

    def has(a: str, b: str | None = None) -> bool:
        return any(
            isinstance(r.get(a), (int, float)) and (b is None or isinstance(r.get(b), (int, float)))
            for r in records
        )

    if x is None:
        x = next((c for c in SHARPNESS_COLUMNS if has(c)), SHARPNESS_COLUMNS[0])
    if y is None:
        candidates = [*ACCURACY_COLUMNS, *(c for c in SHARPNESS_COLUMNS if c != x)]
        y = next((c for c in candidates if has(x, c)), ACCURACY_COLUMNS[0])
    return x, y


def plot_compare_scatter(
    records: list[dict], path: str | Path, x: str = "lambda_max", y: str = "test_accuracy"
) -> Path:
    """Sharpness against accuracy, one labelled point per run."""
    plt, fig, ax = _figure()
    points = [
        (r[x], r[y], r.get("run"))
        for r in records
        if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))
    ]
    if not points:
        plt.close(fig)
        raise UsageError(
            f"no run has both {x} and {y}: nothing to plot (choose other `plot_x`/`plot_y`)",
            source="plot",
        )
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    for px, py, label in points:
        ax.annotate(str(label), (px, py), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if (
        points
        and min(p[0] for p in points) > 0
        and max(p[0] for p in points) / min(p[0] for p in points) >= 20
    ):
        ax.set_xscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(f"{y} against {x} ({len(points)} runs)")
    return _save(plt, fig, path)


def plot_sweep(
    rows: list[dict],
    param: str,
    path: str | Path,
    accuracy_key: str = "test_accuracy",
    sharpness_keys: tuple = ("lambda_max", TRACE_KEY),
) -> Path:
    """Accuracy and each sharpness measure against a swept hyper-parameter, one panel each
    (their scales differ), as the activation-decay paper's Fig. 2: points are means over
    seeds, error bars one standard deviation over seeds."""
    keys = [accuracy_key] + [
        k
        for k in sharpness_keys
        if any(m == m for m in _finite([r.get(f"{k}_mean") for r in rows]))
    ]
    plt, fig, axes = _figure(1, len(keys))
    axes = list(axes) if len(keys) > 1 else [axes]
    xs = [r[param] for r in rows]
    seeds = sorted({int(r["seeds"]) for r in rows if r.get("seeds")})
    labels = {"lambda_max": r"$\lambda_{\max}(H)$", TRACE_KEY: r"tr$(H)$"}
    for ax, key, color in zip(axes, keys, ("tab:blue", "tab:red", "tab:orange")):
        means = _finite([r.get(f"{key}_mean") for r in rows])
        stds = [v if v == v else 0.0 for v in _finite([r.get(f"{key}_std") for r in rows])]
        ax.errorbar(xs, means, yerr=stds, fmt="o-", color=color, capsize=3)
        ax.set_xlabel(param)
        ax.set_ylabel(labels.get(key, key))
        _sweep_x_axis(ax, xs)
        ax.grid(True, alpha=0.3)
    count = f"{seeds[0]} seed(s)" if len(seeds) == 1 else f"{min(seeds)}-{max(seeds)} seeds"
    fig.suptitle(f"against {param}: mean and one standard deviation over {count}", fontsize=10)
    return _save(plt, fig, path)


def _sweep_x_axis(ax, xs) -> None:
    if xs and min(xs) > 0 and max(xs) / min(xs) >= 20:
        ax.set_xscale("log")
        if len(set(xs)) > 1:  # every swept value on the axis, even one whose runs diverged
            ax.set_xlim(min(xs) / 1.5, max(xs) * 1.5)
    elif len(set(xs)) > 1:
        pad = 0.05 * (max(xs) - min(xs))
        ax.set_xlim(min(xs) - pad, max(xs) + pad)


def plot_weight_rescale(rows: list[dict], path: str | Path, *, title: str = "") -> Path:
    """lambda_max, trace and the rescale-invariant lambda_max against alpha, both axes logarithmic.

    ``rows`` are ``weight-rescale`` result rows (``alpha``, ``lambda_max``, ``trace``,
    ``invariant_lambda_max``); non-positive values are left out of the log-scale curves.
    """
    rows = sorted(rows, key=lambda r: r["alpha"])
    plt, fig, ax = _figure()
    for key, label, style in (
        ("lambda_max", "lambda_max(H)", "o-"),
        ("invariant_lambda_max", "lambda_max(|w| H |w|) (ASAM)", "s--"),
        (TRACE_KEY, "tr(H)", "^:"),
    ):
        points = [(r["alpha"], r[key]) for r in rows if r.get(key) is not None and r[key] > 0]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("alpha")
    ax.set_ylabel("curvature")
    ax.set_title(title or "weight rescaling")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_bound_check(
    rows: list[dict], path: str | Path, *, noise_rows: list[dict] | None = None, title: str = ""
) -> Path:
    """AD Corollary 1 bound and the Monte-Carlo smoothed-Hessian norm (with its interval) against sigma.

    The plain lambda_max at theta is drawn as a horizontal reference. With ``noise_rows``
    (``noise_stability.rows``) a second panel shows the perturbation gap against sigma^2/2 tr(H).
    """
    rows = sorted(rows, key=lambda r: r["sigma"])
    panels = 2 if noise_rows else 1
    plt, fig, axes = _figure(1, panels)
    ax = axes[0] if panels == 2 else axes
    sigmas = [r["sigma"] for r in rows]
    ax.plot(
        sigmas,
        [r["bound_region"] for r in rows],
        "o-",
        label=r"bound $H\,\mathrm{erf}(\epsilon / (\sqrt{2}\,H\sigma))$, $H, \epsilon$ over the sampled points",
    )
    ax.plot(
        sigmas,
        [r["bound_at_theta"] for r in rows],
        "x:",
        label=r"bound with $H, \epsilon$ at $\theta$",
    )
    empirical = [r["empirical"] for r in rows]
    lower = [r["empirical"] - r["empirical_ci"][0] for r in rows]
    upper = [r["empirical_ci"][1] - r["empirical"] for r in rows]
    ax.errorbar(
        sigmas,
        empirical,
        yerr=[lower, upper],
        fmt="s--",
        capsize=3,
        label=r"$\|\mathbb{E}\,H(\theta+\Delta)\|_2$ (Monte Carlo, interval)",
    )
    if rows:
        ax.axhline(
            rows[0]["plain_lambda_max"],
            color="gray",
            linestyle=":",
            label=r"$\lambda_{\max}(H)$ at $\theta$",
        )
    ax.set_xscale("log")
    ax.set_xlabel(r"$\sigma$")
    ax.set_ylabel("spectral norm")
    ax.set_title(title or "AD Corollary 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if noise_rows:
        _plot_noise_stability(axes[1], sorted(noise_rows, key=lambda r: r["sigma"]))
    return _save(plt, fig, path)


def _plot_noise_stability(ax2, noise_rows: list[dict]) -> None:
    """NSO's perturbation gap (with its standard error) against ``sigma^2/2 tr(H)``."""
    s2 = [r["sigma"] for r in noise_rows]
    ax2.plot(
        s2,
        [r["predicted"] for r in noise_rows],
        "o-",
        label=r"$\frac{\sigma^2}{2}\,\mathrm{tr}(H)$",
    )
    ax2.errorbar(
        s2,
        [r["gap"] for r in noise_rows],
        yerr=[r["gap_stderr"] for r in noise_rows],
        fmt="s--",
        capsize=3,
        label=r"$\mathbb{E}\,L(W+U) - L(W)$",
    )
    ax2.set_xscale("log")
    values = [r["predicted"] for r in noise_rows] + [r["gap"] for r in noise_rows]
    if all(v > 0 for v in values):
        ax2.set_yscale("log")
    else:  # a Monte-Carlo gap can come out negative: linear near zero
        ax2.set_yscale(
            "symlog", linthresh=min(abs(v) for v in values if v != 0) if any(values) else 1e-12
        )
    ax2.set_xlabel(r"$\sigma$")
    ax2.set_title("NSO noise stability")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)


def plot_density(
    results: dict, path: str | Path, title: str | None = None, log_scale: bool = True
) -> Path:
    """The Gaussian-broadened SLQ density (``sharp density`` results: ``grid``, ``density``) as a PNG;
    logarithmic y axis by default (as in [Ghorbani2019], Fig. 1), showing 8 decades below the
    peak."""
    plt, fig, ax = _figure()
    density = list(results[DENSITY_KEY])
    # on a log axis, values far below the peak are broadening tails: leave them out (gaps)
    # rather than draw them as flat segments at an arbitrary floor
    floor = max(density, default=0.0) * 1e-8 if log_scale else float("-inf")
    ax.plot(
        results["grid"],
        [v if v > floor else float("nan") for v in density],
        color="tab:blue",
        linewidth=1.2,
    )
    if log_scale:
        ax.set_yscale("log")
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel(DENSITY_KEY)
    ax.set_title(
        title
        or f"spectral density (SLQ, {results.get('probes')} probe(s), "
        f"{results.get('lanczos_steps')} steps)"
    )
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, path)


_MAX_PANELS = 16


def _log_curve(ax, grid, density, **style) -> None:
    """A density on a log axis, values more than 8 decades below its peak left out (gaps)."""
    floor = max(density, default=0.0) * 1e-8
    ax.plot(grid, [v if v > floor else float("nan") for v in density], **style)
    ax.set_yscale("log")


def plot_block_densities(
    results: dict, path: str | Path, *, operator: str = catalogue.HESSIAN, top: int | None = None
) -> Path:
    """Small multiples of the blocks' SLQ densities (``sharp density --blocks``), as
    [Zhang2024]'s figure of block spectra, and a last panel with the full density beside the
    block-diagonal one on the common grid. Shows the largest blocks first: ``top`` of them, at
    most 15 (the JSON has all).
    """
    blocks = sorted(results["blocks"], key=lambda b: -b["numel"])
    blocks = blocks[: min(top or _MAX_PANELS - 1, _MAX_PANELS - 1)]
    panels = len(blocks) + 1
    ncols = math.ceil(math.sqrt(panels))
    nrows = math.ceil(panels / ncols)
    plt, fig, axes = _figure(nrows, ncols)
    flat = list(axes.flat) if hasattr(axes, "flat") else [axes]
    small = max(5, 9 - ncols)
    for ax, block in zip(flat, blocks):
        _log_curve(ax, block["grid"], block[DENSITY_KEY], color="tab:blue", linewidth=1.0)
        name = block["name"] if len(block["name"]) <= 28 else "..." + block["name"][-25:]
        ax.set_title(f"{name} ({block['numel']})", fontsize=small)
    diag = results["block_diagonal"]
    ax = flat[len(blocks)]
    _log_curve(ax, diag["grid"], diag["full_density"], color="black", linewidth=1.0, label="full")
    _log_curve(
        ax, diag["grid"], diag[DENSITY_KEY], color="tab:red", linewidth=1.0, label="block-diag."
    )
    ax.set_title(f"full vs block-diagonal (JS {diag['js_distance_to_full']:.3g})", fontsize=small)
    ax.legend(fontsize=small)
    for ax in flat:
        ax.tick_params(labelsize=small)
        ax.grid(True, alpha=0.3)
    for ax in flat[panels:]:
        ax.set_visible(False)
    het = results["heterogeneity"]
    mean = "n/a" if het["mean"] is None else f"{het['mean']:.3g}"
    fig.suptitle(
        f"{operator} spectral density per block (eigenvalue vs density, log); "
        f"JS distance between blocks: mean {mean}",
        fontsize=9,
    )
    return _save(plt, fig, path)
