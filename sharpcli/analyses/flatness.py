"""Jiang et al.'s PAC-Bayes flatness and the Fisher-Rao norm ([Jiang2019]; [Liang2019]).

**Fisher-Rao norm** ([Liang2019]): ``||theta||_fr^2 = theta^T F theta`` with ``F`` the Fisher
information of the model's own predictive distribution (labels drawn from the model), which for
cross-entropy equals the generalized Gauss-Newton matrix ``G = (1/N) sum_i J_i^T H_z,i J_i``
(``J_i`` the Jacobian of sample i's logits, ``H_z,i`` the loss's Hessian in the logits). So
``theta^T G theta = (1/N) sum_i (J_i theta)^T H_z,i (J_i theta)``: one Jacobian-vector product
per batch (forward mode) and the logit Hessian's product, exact over the set (no sampling).
The **empirical** version puts the data's labels in the Fisher,
``(1/N) sum_i (grad l_i . theta)^2 = (1/N) sum_i (dl_i/dz . J_i theta)^2``. Both are means
over the samples: their data errors are the batch means of the per-batch means
([BatchMeans]; :func:`~sharpcli.curvature.products.batch_forms.batch_means_stderr`).

The PAC-Bayes sigma has none: it is the root of a bisection on a Monte-Carlo mean accuracy,
not a mean over the samples; its data error would take a jackknife over the batches, K
bisections of 10 noise draws each. ``deviation_stderr`` is the noise draws' error.

**PAC-Bayes sigma** ([Jiang2019] section C, the "sharpness/flatness" measures, and the code
that accompanied it): the largest ``sigma`` such that the mean training accuracy under weight
noise ``u ~ N(0, sigma^2 I)`` (plain) or ``u ~ N(0, sigma^2 w^2 + eps^2)`` elementwise
(magnitude-aware, ``eps = 1e-3``) (the mean over the draws) deviates from the accuracy at ``w`` by ``target`` (0.1),
found by bisection on ``[0, upper]`` (upper 2, at most 15 halvings, stopping within
``tolerance`` = 0.01 of the target), each deviation a Monte-Carlo mean over ``samples`` (10)
draws. For a loss without accuracy (regression) the deviation is that of the loss. The measures
derived from it are the flatness ``1 / sigma^2`` of the paper.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from sharpcli import progress
from sharpcli.analyses.perturbed import Evaluation, PerturbedModel
from sharpcli.curvature.products.batch_forms import (
    batch_means_stderr,
    gather_batches,
    local_batch_sizes,
)
from sharpcli.curvature.products.data import AnalysisData, to_model_batch
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss, per_sample_loss

__all__ = ["PacBayesSigma", "fisher_rao_norm", "pac_bayes_sigma"]

MAGNITUDE_EPS = 1e-3  # [Jiang2019]'s epsilon of the magnitude-aware noise


def fisher_rao_norm(model: nn.Module, data: AnalysisData, params: str | None = None) -> dict:
    """``theta^T F theta`` (model-label Fisher = GGN) and its empirical version (module docstring).

    Args:
        model: the model, in eval mode.
        data: the analysis set.
        params: the scope of theta (the other parameters' tangent is zero).

    Returns:
        ``{"fisher_rao_norm_sq", "fisher_rao_norm_sq_empirical", "params"}`` and each one's
        ``_data_stderr`` (batch means; None with one batch).
    """
    from torch.func import functional_call, jvp

    scope = ParamScope.resolve(model, params)
    chosen = dict(zip(scope.names, [p.detach() for p in scope.params]))
    model_sums = torch.zeros((), dtype=torch.float64)
    empirical_sums = torch.zeros((), dtype=torch.float64)
    per_batch: list[torch.Tensor] = []  # per batch: its two sums (the data errors)

    def logits(weights: dict, x):
        return functional_call(model, weights, (x,))

    for x_b, y_b, _ in data.batches():
        x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
        dz = jvp(lambda w: logits(w, x_b), (chosen,), (chosen,))[1]
        z = logits(chosen, x_b).detach().requires_grad_(True)
        dl_dz = torch.autograd.grad(per_sample_loss(data.loss, z, y_b).sum(), z, create_graph=True)[
            0
        ]
        h_dz = torch.autograd.grad((dl_dz * dz.detach()).sum(), z)[0]
        dims = tuple(range(1, dz.dim()))
        model_part = (dz * h_dz).sum(dim=dims).double().sum().cpu()
        empirical_part = ((dl_dz.detach() * dz).sum(dim=dims) ** 2).double().sum().cpu()
        model_sums += model_part
        empirical_sums += empirical_part
        per_batch.append(torch.stack([model_part, empirical_part]))
    n = data.num_samples
    parts, sizes = gather_batches(
        torch.stack(per_batch) / n if per_batch else torch.zeros(0, 2, dtype=torch.float64),
        local_batch_sizes(data),
        data,
    )
    errors = [batch_means_stderr(parts[:, i], sizes) for i in range(2)]
    return {
        "fisher_rao_norm_sq": float(model_sums) / n,
        "fisher_rao_norm_sq_empirical": float(empirical_sums) / n,
        "fisher_rao_norm_sq_data_stderr": errors[0].stderr,
        "fisher_rao_norm_sq_empirical_data_stderr": errors[1].stderr,
        "params": scope.spec,
    }


@dataclass
class PacBayesSigma:
    """The sigma the bisection found and how well it meets the target.

    ``deviation`` is the Monte-Carlo mean deviation at ``sigma``, ``deviation_stderr`` its
    standard error over the draws; ``flatness = 1 / sigma^2``; ``converged``: the deviation
    came within ``tolerance`` of ``target``.
    """

    sigma: float
    flatness: float
    deviation: float
    deviation_stderr: float
    target: float
    tolerance: float
    samples: int
    halvings: int
    converged: bool
    magnitude_aware: bool
    quantity: str  # "accuracy" or "loss"

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def pac_bayes_sigma(
    model: nn.Module,
    data: AnalysisData,
    *,
    magnitude_aware: bool = False,
    target: float = 0.1,
    tolerance: float = 0.01,
    samples: int = 10,
    max_halvings: int = 15,
    upper: float = 2.0,
    params: str | None = None,
    seed: int = 0,
) -> PacBayesSigma:
    """[Jiang2019]'s PAC-Bayes sigma by bisection (module docstring).

    Args:
        model: the model, in eval mode (restored after).
        data: the analysis set (the training set in the paper).
        magnitude_aware: noise ``N(0, sigma^2 w^2 + eps^2)`` rather than ``N(0, sigma^2)``.
        target: the deviation sought (0.1).
        tolerance: stop within this of the target (0.01).
        samples: Monte-Carlo draws per sigma (10).
        max_halvings: bisection steps at most (15).
        upper: the top of the bracket (2).
        params: the parameters that get noise.
        seed: seeds the noise.

    Returns:
        The sigma and its deviation.

    Raises:
        UsageError: a bad setting.
    """
    checks = [
        (0 < target and math.isfinite(target), "target"),
        (0 < tolerance < target, "tolerance"),
        (samples >= 2, "samples"),
        (max_halvings >= 1, "max_halvings"),
        (0 < upper and math.isfinite(upper), "upper"),
    ]
    for ok, source in checks:
        if not ok:
            raise UsageError("is out of range", source=source)
    scope = ParamScope.resolve(model, params)
    weights = torch.cat([p.detach().reshape(-1) for p in scope.params])
    use_accuracy = get_loss(data.loss).correct is not None

    def measured(found: Evaluation) -> float:
        if not use_accuracy:
            return found.loss
        if found.accuracy is None:  # accuracy of no labelled sample
            raise UsageError("has no labelled sample to measure the accuracy on", source="data")
        return found.accuracy

    gen = torch.Generator().manual_seed(int(seed))
    lower, high = 0.0, float(upper)
    sigma, mean, stderr, converged, done = high / 2, 0.0, 0.0, False, 0
    with PerturbedModel(model, scope.names, None, data.loss, data.batch_size) as moved:
        start = moved.evaluate(None, data.x, data.y)
        reference = measured(start)
        with progress.start("pac-bayes sigma", total=max_halvings, unit="halvings") as run:
            for done in range(1, max_halvings + 1):
                sigma = (lower + high) / 2
                values = []
                for _ in range(samples):
                    noise = torch.randn(weights.numel(), generator=gen, dtype=torch.float64)
                    noise = noise.to(weights)
                    if magnitude_aware:
                        scale = (sigma**2 * weights**2 + MAGNITUDE_EPS**2).sqrt()
                    else:
                        scale = torch.full_like(weights, sigma)
                    found = moved.evaluate(scale * noise, data.x, data.y)
                    values.append(measured(found) - reference)
                signed = math.fsum(values) / samples
                var = math.fsum((v - signed) ** 2 for v in values) / (samples - 1)
                mean, stderr = abs(signed), math.sqrt(var / samples)
                run.update(done, detail=f"sigma {sigma:.4g}")
                if abs(mean - target) < tolerance:
                    converged = True
                    break
                if mean > target:
                    high = sigma
                else:
                    lower = sigma
    return PacBayesSigma(
        sigma=sigma,
        flatness=1 / sigma**2,
        deviation=mean,
        deviation_stderr=stderr,
        target=target,
        tolerance=tolerance,
        samples=samples,
        halvings=done,
        converged=converged,
        magnitude_aware=magnitude_aware,
        quantity="accuracy" if use_accuracy else "loss",
    )
