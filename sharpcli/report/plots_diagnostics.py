"""PNG plots of the diagnostics: lambda_max against alpha (MAN Fig. 1) and the Corollary 1 bound
against the measured smoothed-Hessian norm over sigma (AD Fig. 1a). matplotlib's Agg backend,
written atomically."""

from __future__ import annotations

import os

from sharpcli.io.atomic import write_atomic


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> None:
    plt = _pyplot()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)


def plot_weight_rescale(rows: list[dict], path: str | os.PathLike, *, title: str = "") -> None:
    """lambda_max, trace and the rescale-invariant lambda_max against alpha, both axes logarithmic.

    ``rows`` are ``weight-rescale`` result rows (``alpha``, ``lambda_max``, ``trace``,
    ``invariant_lambda_max``); non-positive values are left out of the log-scale curves.
    """
    plt = _pyplot()
    rows = sorted(rows, key=lambda r: r["alpha"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label, style in (("lambda_max", "lambda_max(H)", "o-"),
                              ("invariant_lambda_max", "lambda_max(|w| H |w|) (ASAM)", "s--"),
                              ("trace", "tr(H)", "^:")):
        points = [(r["alpha"], r[key]) for r in rows if r.get(key) is not None and r[key] > 0]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("alpha")
    ax.set_ylabel("curvature")
    ax.set_title(title or "weight rescaling")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_bound_check(rows: list[dict], path: str | os.PathLike, *, noise_rows: list[dict] | None = None,
                     title: str = "") -> None:
    """AD Corollary 1 bound and the Monte-Carlo smoothed-Hessian norm (with its interval) against sigma.

    The plain lambda_max at theta is drawn as a horizontal reference. With ``noise_rows``
    (``noise_stability.rows``) a second panel shows the perturbation gap against sigma^2/2 tr(H).
    """
    plt = _pyplot()
    rows = sorted(rows, key=lambda r: r["sigma"])
    panels = 2 if noise_rows else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    sigmas = [r["sigma"] for r in rows]
    ax.plot(sigmas, [r["bound"] for r in rows], "o-", label="bound H erf(eps/(sqrt2 H sigma))")
    empirical = [r["empirical"] for r in rows]
    lower = [r["empirical"] - r["empirical_ci"][0] for r in rows]
    upper = [r["empirical_ci"][1] - r["empirical"] for r in rows]
    ax.errorbar(sigmas, empirical, yerr=[lower, upper], fmt="s--", capsize=3, label="||E H(theta+D)||_2 (MC)")
    if rows:
        ax.axhline(rows[0]["plain_lambda_max"], color="gray", linestyle=":", label="lambda_max at theta")
    ax.set_xscale("log")
    ax.set_xlabel("sigma")
    ax.set_ylabel("spectral norm")
    ax.set_title(title or "AD Corollary 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if noise_rows:
        ax2 = axes[0][1]
        noise_rows = sorted(noise_rows, key=lambda r: r["sigma"])
        s2 = [r["sigma"] for r in noise_rows]
        ax2.plot(s2, [r["predicted"] for r in noise_rows], "o-", label="sigma^2/2 tr(H)")
        ax2.errorbar(s2, [r["gap"] for r in noise_rows], yerr=[r["gap_stderr"] for r in noise_rows], fmt="s--",
                     capsize=3, label="E L(W+U) - L(W)")
        ax2.set_xscale("log")
        values = [r["predicted"] for r in noise_rows] + [r["gap"] for r in noise_rows]
        if all(v > 0 for v in values):
            ax2.set_yscale("log")
        else:  # a Monte-Carlo gap can come out negative: linear near zero
            ax2.set_yscale("symlog", linthresh=min(abs(v) for v in values if v != 0) if any(values) else 1e-12)
        ax2.set_xlabel("sigma")
        ax2.set_title("NSO noise stability")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend()
    _save(fig, path)
