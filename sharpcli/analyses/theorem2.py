"""Checks of [AD] Theorems 2 and 3: the smoothed cross-entropy under noise on the final layer.

**Theorem 2** (AD section 3.2): for cross-entropy with noise ``Delta ~ N(0, sigma^2 I)`` on the
final layer's weight ``W`` (logits ``z = W h + b``), ``Delta h ~ N(0, sigma^2 ||h||^2 I_c)``, so
the smoothed loss is ``E_g CE(z + t g, y)`` with ``t = sigma ||h||``, ``g ~ N(0, I_c)``, and

    E_g CE(z + t g, y)  <=  CE(z, y) + sigma^2/2 ||h||^2.

**Theorem 3** (AD appendix B.4): ``E CE ~ CE + sigma^2/2 ||h||^2 sum_i p_i (1 - p_i)``.
The smoothed loss per sample is estimated with ``K`` antithetic pairs ``+-g`` (which cancel
every odd-order term, including ``-t g_y``) and a control variate: the quadratic term
``q(g) = t^2/2 g^T (diag p - p p^T) g`` has known mean ``t^2/2 sum_i p_i (1 - p_i)``; the
estimate is ``mean(Y) - beta (mean(q) - E q)`` with ``Y = (lse(z + t g) + lse(z - t g))/2 - z_y``
and the fitted coefficient ``beta = Cov(Y, q)/Var(q)``. The same K draws serve every sample,
so the per-sample errors are correlated, not independent: the dataset mean's standard error
(``smoothed_stderr``) is the sample standard deviation over the K pairs of each pair's
dataset mean (one observation per draw) divided by ``sqrt(K)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from sharpcli.analyses.bounds import CheckRun
from sharpcli.analyses.rescale import _global_max
from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum, to_model_batch
from sharpcli.errors import UsageError, check_positive
from sharpcli.losses import get_loss
from sharpcli.models.zoo import final_linear
from sharpcli.registry import declare

__all__ = [
    "THEOREM2",
    "Theorem2Row",
    "smoothed_cross_entropy",
    "theorem2_bound_check",
    "theorem2_check",
]

# the check of ``sharp bound-check --check``
THEOREM2 = "theorem2"


@dataclass
class Theorem2Row:
    """AD Theorems 2 and 3 at one sigma, means over the analysis set and the per-sample verdict."""

    sigma: float
    cross_entropy: float
    smoothed_cross_entropy: float
    smoothed_stderr: float
    bound: float
    taylor: float
    fraction_holds: float
    violations: int
    min_margin: float
    mean_taylor_abs_error: float
    samples: int
    mc_pairs: int

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def smoothed_cross_entropy(
    z: torch.Tensor, y: torch.Tensor, t: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``E_g CE(z + t g, y)`` for ``g ~ N(0, I_c)``: ``(estimate, stderr)``, shapes ``(B,)``.

    ``z`` (B, c) logits, ``y`` (B,) labels, ``t`` (B,) noise scales (``sigma ||h||``), ``g`` (K, c)
    standard normal draws used as antithetic pairs ``+-g``. Control variate: the quadratic
    term ``q = t^2/2 g^T (diag p - p p^T) g`` with exact mean ``t^2/2 sum_i p_i (1 - p_i)``
    (module docstring); all in float64. ``stderr`` is each sample's own, over its K draws.
    """
    adjusted = _smoothed_draws(z, y, t, g)
    K = g.shape[0]
    estimate = adjusted.mean(dim=1)
    stderr = (
        adjusted.std(dim=1, unbiased=True) / math.sqrt(K)
        if K > 1
        else torch.full_like(estimate, math.inf)
    )
    return estimate, stderr


def _smoothed_draws(
    z: torch.Tensor, y: torch.Tensor, t: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """The control-variate-adjusted value of every antithetic pair, ``(B, K)``: ``Y - beta (q - E q)``
    (:func:`smoothed_cross_entropy` is its mean over the K pairs)."""
    z = z.to(torch.float64)
    g = g.to(torch.float64)
    t = t.to(torch.float64)
    p = torch.softmax(z, dim=-1)
    noise = t[:, None, None] * g[None, :, :]  # (B, K, c)
    lse_plus = torch.logsumexp(z[:, None, :] + noise, dim=-1)
    lse_minus = torch.logsumexp(z[:, None, :] - noise, dim=-1)
    target = z.gather(1, y[:, None].to(torch.long))  # (B, 1)
    Y = (lse_plus + lse_minus) / 2 - target  # (B, K)
    pg = g @ p.T  # (K, B): p . g
    quad_form = (g * g) @ p.T - pg * pg  # (K, B): g^T (diag p - p p^T) g
    q = (t * t / 2)[:, None] * quad_form.T  # (B, K)
    q_mean = t * t / 2 * (p * (1 - p)).sum(dim=-1)
    K = g.shape[0]
    if K > 2:
        qc = q - q.mean(dim=1, keepdim=True)
        Yc = Y - Y.mean(dim=1, keepdim=True)
        var_q = (qc * qc).sum(dim=1)
        beta = torch.where(
            var_q > 0,
            (qc * Yc).sum(dim=1) / torch.where(var_q > 0, var_q, 1.0),
            torch.zeros_like(var_q),
        )
    else:
        beta = torch.zeros(z.shape[0], dtype=torch.float64, device=z.device)
    return Y - beta[:, None] * (q - q_mean[:, None])


def _penultimate_and_logits(model: nn.Module, data: AnalysisData):
    """Yield ``(h, z, y)`` per batch: the classifier head's input (flattened) and the logits."""

    name, head = final_linear(model, source="check")
    captured: dict[str, torch.Tensor] = {}

    def hook(module, inputs, output):
        captured["h"] = inputs[0].detach()
        captured["out"] = output

    handle = head.register_forward_hook(hook)
    params = list(model.parameters())
    dtype, device = params[0].dtype, params[0].device
    try:
        for x_b, y_b, _ in data.batches():
            x_b, y_b = to_model_batch(x_b, y_b, dtype, device)
            captured.clear()
            with torch.no_grad():
                z = model(x_b)
            if "out" not in captured or captured["out"] is not z:
                raise UsageError(
                    f"the classifier head {name!r} is not the model's last operation, so noise on its "
                    "weight does not act on the logits as Theorem 2 assumes",
                    source="check",
                )
            h = captured["h"].reshape(z.shape[0], -1)
            yield h, z, y_b
    finally:
        handle.remove()


def theorem2_check(
    model: nn.Module,
    data: AnalysisData,
    sigma: list[float],
    *,
    mc_samples: int = 256,
    seed: int = 0,
) -> list[Theorem2Row]:
    """AD Theorem 2 (and the Theorem 3 Taylor value) per sample, for each sigma.

    Per sample: ``CE``, the smoothed ``E CE`` (:func:`smoothed_cross_entropy`, the same draws for
    every sample and sigma), the bound ``CE + sigma^2/2 ||h||^2`` and the Taylor value
    ``CE + sigma^2/2 ||h||^2 sum_i p_i (1 - p_i)``; the row gives their means over the analysis set,
    the fraction of samples with ``smoothed <= bound``, the smallest margin ``bound - smoothed``
    and the mean ``|taylor - smoothed|``. Needs cross-entropy. ``sigma``: the noise scales;
    ``mc_samples``: the antithetic pairs per sample.
    """
    sigmas = list(sigma)
    check_positive(sigmas, "sigma")
    if not get_loss(data.loss).softmax_per_sample:
        raise UsageError(
            f"Theorem 2 is about cross-entropy; this model's loss is {data.loss}", source="check"
        )
    if int(mc_samples) < 2:
        raise UsageError(f"must be >= 2, got {mc_samples}", source="mc_samples")

    ns = len(sigmas)
    sums = torch.zeros(
        ns, 7, dtype=torch.float64
    )  # ce, smoothed, (unused), bound, taylor, holds, |taylor-smoothed|
    # per draw k, the sum over samples of that draw's adjusted value: the same K draws serve
    # every sample, so each draw's dataset mean is one observation of the dataset mean
    per_draw = torch.zeros(ns, int(mc_samples), dtype=torch.float64)
    min_margin = torch.full((ns,), math.inf, dtype=torch.float64)
    generator = torch.Generator().manual_seed(int(seed) + 104729)
    g = None
    for h, z, y in _penultimate_and_logits(model, data):
        if g is None:
            g = torch.randn(int(mc_samples), z.shape[1], generator=generator, dtype=torch.float64)
        z64 = z.to(torch.float64).cpu()
        y = y.cpu()
        h_sq = (h.to(torch.float64) ** 2).sum(dim=1).cpu()
        ce = torch.logsumexp(z64, dim=1) - z64.gather(1, y[:, None]).squeeze(1)
        p = torch.softmax(z64, dim=1)
        spread = (p * (1 - p)).sum(dim=1)
        for i, scale in enumerate(sigmas):
            rows_per_chunk = max(1, (1 << 22) // (g.shape[0] * z.shape[1]))
            for start in range(0, z64.shape[0], rows_per_chunk):
                sl = slice(start, start + rows_per_chunk)
                t = scale * h_sq[sl].sqrt()
                draws = _smoothed_draws(z64[sl], y[sl], t, g)
                smoothed = draws.mean(dim=1)
                per_draw[i] += draws.sum(dim=0)
                bound = ce[sl] + scale**2 / 2 * h_sq[sl]
                taylor = ce[sl] + scale**2 / 2 * h_sq[sl] * spread[sl]
                sums[i, 0] += ce[sl].sum()
                sums[i, 1] += smoothed.sum()
                sums[i, 3] += bound.sum()
                sums[i, 4] += taylor.sum()
                sums[i, 5] += (smoothed <= bound).to(torch.float64).sum()
                sums[i, 6] += (taylor - smoothed).abs().sum()
                min_margin[i] = min(float(min_margin[i]), float((bound - smoothed).min()))
    all_reduce_sum([sums, per_draw])
    n = data.num_samples
    draw_means = per_draw / n  # (ns, K): the smoothed dataset mean under each draw
    rows = []
    for i, scale in enumerate(sigmas):
        margin = -_global_max(-float(min_margin[i]), torch.device("cpu"))
        rows.append(
            Theorem2Row(
                sigma=float(scale),
                cross_entropy=float(sums[i, 0]) / n,
                smoothed_cross_entropy=float(sums[i, 1]) / n,
                smoothed_stderr=float(draw_means[i].std(unbiased=True))
                / math.sqrt(int(mc_samples)),
                bound=float(sums[i, 3]) / n,
                taylor=float(sums[i, 4]) / n,
                fraction_holds=float(sums[i, 5]) / n,
                violations=int(round(n - float(sums[i, 5]))),
                min_margin=margin,
                mean_taylor_abs_error=float(sums[i, 6]) / n,
                samples=n,
                mc_pairs=int(mc_samples),
            )
        )
    return rows


@declare(
    "check",
    THEOREM2,
    "AD Theorem 2 per sample: the smoothed cross-entropy under the bound CE + s^2/2 ||h||^2",
    paper="AD",
    info={"order": 1, "progress": "theorem 2"},
)
def theorem2_bound_check(run: CheckRun) -> None:
    """``bound-check --check theorem2``: :func:`theorem2_check` at the run's sigmas, its rows
    under ``theorem2``.

    Args:
        run: the checks' run, whose findings it adds to.
    """
    config = run.config
    rows = theorem2_check(
        run.model, run.data, config.sigma, mc_samples=config.mc_samples, seed=config.seed
    )
    run.found[THEOREM2] = [row.to_dict() for row in rows]
