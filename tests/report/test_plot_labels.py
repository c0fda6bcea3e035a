"""What a reader of each plot sees, checked through matplotlib's objects (titles, axis labels,
legends, error bars), not pixels."""

from __future__ import annotations

import math

import pytest

from sharpcli.errors import UsageError
from sharpcli.report import plots


@pytest.fixture()
def figures(monkeypatch, tmp_path):
    """Every figure a plot function saves, kept open for inspection."""
    saved = []

    def save(plt, fig, path):
        saved.append(fig)
        fig.savefig(path, format="png")
        return path

    monkeypatch.setattr(plots, "_save", save)
    yield saved, tmp_path
    import matplotlib.pyplot as plt

    for fig in saved:
        plt.close(fig)


def _texts(fig):
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        legend = ax.get_legend()
        if legend is not None:
            out += [t.get_text() for t in legend.get_texts()]
    return [t for t in out if t]


def test_sweep_plot_gives_each_measure_its_axis_and_says_what_the_bars_are(figures):
    saved, tmp = figures
    rows = [
        {
            "sigma": s,
            "seeds": 3,
            "test_accuracy_mean": a,
            "test_accuracy_std": 0.01,
            "lambda_max_mean": lam,
            "lambda_max_std": 0.5,
            "trace_mean": tr,
            "trace_std": 2.0,
        }
        for s, a, lam, tr in (
            (0.01, 0.9, 10.0, 100.0),
            (0.1, 0.92, 5.0, 60.0),
            (1.0, 0.8, 1.0, 9.0),
        )
    ]
    plots.plot_sweep(rows, "sigma", tmp / "s.png")
    (fig,) = saved
    assert len(fig.axes) == 3  # accuracy, lambda_max, trace: three scales, three axes
    ylabels = [ax.get_ylabel() for ax in fig.axes]
    assert ylabels == ["test_accuracy", r"$\lambda_{\max}(H)$", r"tr$(H)$"]
    assert "one standard deviation over 3 seed(s)" in fig.texts[0].get_text()
    assert all(ax.get_xscale() == "log" for ax in fig.axes)


def test_bound_plot_writes_math_as_math(figures):
    saved, tmp = figures
    rows = [
        {
            "sigma": s,
            "bound_region": 2.0,
            "bound_at_theta": 1.5,
            "empirical": 1.0,
            "empirical_ci": [0.9, 1.1],
            "plain_lambda_max": 2.5,
        }
        for s in (0.01, 0.1)
    ]
    noise = [{"sigma": 0.1, "predicted": 0.01, "gap": 0.012, "gap_stderr": 0.001}]
    plots.plot_bound_check(rows, tmp / "b.png", noise_rows=noise)
    text = " ".join(_texts(saved[0]))
    assert r"\mathrm{erf}" in text and r"\sqrt{2}" in text and r"\mathbb{E}" in text
    assert "sqrt2" not in text and "||E" not in text
    assert r"$\sigma$" in text


def test_gn_nme_plot_has_error_bars(figures):
    saved, tmp = figures
    rows = [
        {
            "layer": name,
            "hessian_trace": h,
            "ggn_trace": g,
            "nme_trace": h - g,
            "hessian_trace_stderr": 0.1,
            "ggn_trace_stderr": 0.0,
            "nme_trace_stderr": 0.1,
        }
        for name, h, g in (("0", 3.0, 2.5), ("2", 1.0, 1.2))
    ]
    plots.plot_gn_nme_layers({"layers": rows, "nme_share": 0.1}, tmp / "g.png")
    ax = saved[0].axes[0]
    from matplotlib.container import BarContainer, ErrorbarContainer

    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 3 and all(c.errorbar is not None for c in bars)
    assert any(isinstance(c, ErrorbarContainer) for c in ax.containers)
    assert "one standard error" in ax.get_ylabel()


def test_density_plot_draws_no_floor_segments(figures):
    saved, tmp = figures
    grid = [i / 10 for i in range(-50, 51)]
    density = [math.exp(-(x**2) * 8) for x in grid]  # tails far below the peak
    plots.plot_density(
        {"grid": grid, "density": density, "probes": 2, "lanczos_steps": 10}, tmp / "d.png"
    )
    ys = saved[0].axes[0].lines[0].get_ydata()
    shown = [y for y in ys if y == y]
    assert min(shown) >= 1e-8 * max(shown)  # nothing drawn at an arbitrary floor
    assert saved[0].axes[0].get_yscale() == "log"


def test_compare_plot_with_no_point_is_an_error_not_an_empty_png(figures):
    _, tmp = figures
    with pytest.raises(UsageError, match="no run has both"):
        plots.plot_compare_scatter([{"run": "a", "lambda_max": 1.0}], tmp / "c.png")
    assert not (tmp / "c.png").exists()


def test_training_plot_title_names_the_regularizers():
    from sharpcli.cli.cmd_train import _plot_title

    assert _plot_title("cnn", ["none"]) == "cnn, no regularizer"
    assert (
        _plot_title("mlp", ["sam:rho=0.05", "wd:0.01"])
        == "mlp, regularized by sam:rho=0.05 + wd:0.01"
    )
