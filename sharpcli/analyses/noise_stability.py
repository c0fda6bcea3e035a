"""[NSO]'s noise stability: the loss gap under Gaussian weight noise against ``sigma^2/2 tr(H)``.

**Noise stability** (NSO section 2.2, eq. 4, Fig. 2): for ``U ~ N(0, sigma^2 I)`` over the scope
(all parameters unless ``params`` is given: NSO perturbs every weight; the result names it),
``E_U L(theta + U) - L(theta) ~ sigma^2/2 tr(H)``. The left side is estimated with antithetic
pairs, ``(L(theta + U_j) + L(theta - U_j))/2 - L(theta)`` (the first-order term cancels exactly),
with common random numbers across sigmas; ``tr(H)`` by [Hutch++] from the curvature engine. Beside
it, with the same ``U_j``, the paired quadratic term ``sigma^2/2 Z_j^T H Z_j`` and the Taylor
residual (gap minus quadratic term, the higher-order part NSO neglects; for ReLU networks it also
holds the effect of pre-activations within ~sigma of a kink, which no Taylor term has). The plain gap's
Monte-Carlo error is large (its variance is ``sigma^4/2 tr(H^2)`` per pair, so a few dozen pairs
leave ~10-20% noise); the quadratic term is a control variate with known mean
``sigma^2/2 tr(H)``, giving ``gap_control_variate = sigma^2/2 tr(H) + mean_j(gap_j - sigma^2/2
Z_j^T H Z_j)``, unbiased for the same expectation with the far smaller variance of the residual.
``relative_error`` is ``(gap_control_variate - sigma^2/2 tr H) / (sigma^2/2 tr H)``, the error of
NSO eq. 4 itself; ``relative_error_plain`` uses the plain gap.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from sharpcli.analyses.bounds import CheckRun
from sharpcli.analyses.perturbation import scope_on, standard_normal_directions
from sharpcli.catalogue.values import TRACE_KEY
from sharpcli.curvature.operators.hessian import CurvatureEngine
from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum, to_model_batch
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.hutchpp import HUTCHPP, hutchpp
from sharpcli.errors import NumericalError, UsageError, check_positive
from sharpcli.losses import loss_fn
from sharpcli.registry import declare

__all__ = [
    "NOISE_STABILITY",
    "NoiseStabilityRow",
    "noise_stability_bound_check",
    "noise_stability_check",
]

# the check of ``sharp bound-check --check`` (and the label of its errors)
NOISE_STABILITY = "noise-stability"


@dataclass
class NoiseStabilityRow:
    """NSO eq. 4 at one sigma: the perturbation gap against ``sigma^2/2 tr(H)``."""

    sigma: float
    gap: float
    gap_stderr: float
    gap_control_variate: float
    gap_control_variate_stderr: float
    predicted: float
    predicted_stderr: float | None
    relative_error: float | None
    relative_error_plain: float | None
    paired_quadratic: float
    taylor_residual: float
    taylor_residual_stderr: float
    pairs: int

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def _mean_loss(model: nn.Module, data: AnalysisData) -> float:
    """``L(theta) = (1/N) sum_i l_i`` over the analysis set (forward passes only)."""
    loss = loss_fn(data.loss)
    params = list(model.parameters())
    dtype, device = params[0].dtype, params[0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for index, (x_b, y_b, weight) in enumerate(data.batches()):
            x_b, y_b = to_model_batch(x_b, y_b, dtype, device)
            value = loss(model(x_b), y_b) * weight
            if not torch.isfinite(value):
                raise NumericalError(f"loss is not finite on batch {index}", source=NOISE_STABILITY)
            total += value.to(torch.float64)
    all_reduce_sum(total)
    return float(total)


def noise_stability_check(
    model: nn.Module,
    data: AnalysisData,
    sigma: list[float],
    scope: ParamScope,
    *,
    noise_pairs: int = 32,
    trace_tol: float = 1e-2,
    trace_max_matvecs: int = 300,
    seed: int = 0,
) -> dict:
    r"""NSO eq. 4 / Fig. 2: ``E_U L(theta + U) - L(theta)`` against ``sigma^2/2 tr(H)`` (module docstring).

    ``U_j = sigma Z_j`` over ``scope`` with fixed ``Z_j ~ N(0, I)`` (j = 1..noise_pairs, shared by all
    sigmas), each used as the antithetic pair ``+-U_j``;
    ``relative_error = (gap - predicted) / predicted``. The standard errors: the pairs' sample
    standard errors for ``gap`` and ``taylor_residual``, Hutch++'s for ``predicted`` (scaled by
    :math:`\sigma^2/2`), and, the probes of ``tr(H)`` being independent of the ``Z_j``,

    .. math::

        \mathrm{se}(\text{gap}_{cv}) = \sqrt{\mathrm{se}(\text{residual})^2
            + \mathrm{se}(\text{predicted})^2}.

    Args:
        model: the model (perturbed on a copy).
        data: the analysis set.
        sigma: the noise scales.
        scope: the perturbed parameters.
        noise_pairs: antithetic pairs per sigma (>= 2).
        trace_tol: the relative standard error of ``tr(H)``.
        trace_max_matvecs: the most Hessian products for ``tr(H)``.
        seed: seeds the probes and the directions.

    Returns:
        ``{"params", "num_params", "trace", "trace_stderr", "trace_estimator", "rows": [...],
        "matvecs"}`` (``params`` the scope's spec, ``rows`` one
        :class:`NoiseStabilityRow` dict per sigma).
    """

    sigmas = list(sigma)
    check_positive(sigmas, "sigma")
    if int(noise_pairs) < 2:
        raise UsageError(f"must be >= 2, got {noise_pairs}", source="noise_pairs")
    engine = CurvatureEngine(model, data, scope)
    hessian = engine.hessian()
    trace = hutchpp(hessian, tol=trace_tol, max_matvecs=trace_max_matvecs, seed=seed)
    trace_stderr = (
        trace.stderr if trace.stderr is not None and math.isfinite(trace.stderr) else None
    )
    Z = standard_normal_directions(scope, int(noise_pairs), int(seed) + 15485863)
    quadratic = (Z * hessian.matmat(Z)).sum(dim=0).to(torch.float64)  # Z_j^T H Z_j
    base = _mean_loss(model, data)
    twin = copy.deepcopy(model)
    twin_scope = scope_on(twin, scope)
    original = [p.detach().clone() for p in twin_scope.params]
    rows = []
    for scale in sigmas:
        gaps = torch.zeros(int(noise_pairs), dtype=torch.float64)
        for j in range(int(noise_pairs)):
            values = []
            for sign in (1.0, -1.0):
                with torch.no_grad():
                    for p, p0, d in zip(twin_scope.params, original, scope.unflatten(Z[:, j])):
                        p.copy_(p0 + sign * scale * d)
                values.append(_mean_loss(twin, data))
            gaps[j] = (values[0] + values[1]) / 2 - base
        quad = scale**2 / 2 * quadratic
        residual = gaps - quad
        gap = float(gaps.mean())
        predicted = scale**2 / 2 * trace.estimate
        predicted_stderr = None if trace_stderr is None else scale**2 / 2 * trace_stderr
        residual_stderr = float(residual.std(unbiased=True)) / math.sqrt(noise_pairs)
        gap_cv = predicted + float(residual.mean())
        rows.append(
            NoiseStabilityRow(
                sigma=float(scale),
                gap=gap,
                gap_stderr=float(gaps.std(unbiased=True)) / math.sqrt(noise_pairs),
                gap_control_variate=gap_cv,
                gap_control_variate_stderr=math.hypot(residual_stderr, predicted_stderr or 0.0),
                predicted=predicted,
                predicted_stderr=predicted_stderr,
                relative_error=(gap_cv - predicted) / predicted if predicted != 0 else None,
                relative_error_plain=(gap - predicted) / predicted if predicted != 0 else None,
                paired_quadratic=float(quad.mean()),
                taylor_residual=float(residual.mean()),
                taylor_residual_stderr=residual_stderr,
                pairs=int(noise_pairs),
            )
        )
    return {
        "params": scope.spec,
        "num_params": scope.numel,
        TRACE_KEY: trace.estimate,
        "trace_stderr": trace_stderr,
        "trace_estimator": HUTCHPP,
        "rows": [row.to_dict() for row in rows],
        "matvecs": trace.matvecs + int(noise_pairs),
    }


@declare(
    "check",
    NOISE_STABILITY,
    "NSO eq. 4: the loss gap under weight noise against s^2/2 tr(H)",
    paper="NSO",
    info={"order": 2, "progress": "noise stability"},
)
def noise_stability_bound_check(run: CheckRun) -> None:
    """``bound-check --check noise-stability``: :func:`noise_stability_check` at the run's
    sigmas, under ``noise_stability``, its products counted.

    Args:
        run: the checks' run, whose findings and products it adds to.
    """
    config = run.config
    # NSO perturbs every weight: all parameters unless --params chose a scope
    scope = run.scope if config.params is not None else ParamScope.resolve(run.model, "all")
    found = noise_stability_check(
        run.model,
        run.data,
        config.sigma,
        scope,
        noise_pairs=config.noise_pairs,
        trace_tol=config.trace_tol,
        trace_max_matvecs=config.trace_max_matvecs,
        seed=config.seed,
    )
    run.found["noise_stability"] = found
    run.matvecs += found["matvecs"]
