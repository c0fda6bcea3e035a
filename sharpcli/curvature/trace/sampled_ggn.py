r"""The sampled-label Gauss-Newton trace of [NME] eq. 20.

.. math::

    \mathrm{tr}(G) = \frac1N \sum_i \mathbb{E}_{\hat y \sim p(\cdot \mid z_i)}
        \lVert \nabla_\theta l(z_i, \hat y) \rVert^2,

labels drawn by the loss's own sampler (:meth:`sharpcli.losses.Loss.labels_from_noise`) from
random numbers keyed by each sample's global index, per-sample gradients by ``vmap(grad)``;
the standard error is over the label draws, the data set being fixed.
"""

from __future__ import annotations

import torch
from torch import nn

from sharpcli import progress
from sharpcli.curvature.products.data import (
    AnalysisData,
    all_reduce_sum,
    per_sample_draws,
    to_model_batch,
)
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.ggn import (
    CHUNK_BYTES,
    functional_logits,
    param_to_layer,
    vmapped_or_looped,
)
from sharpcli.curvature.trace.probes import TraceResult
from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss

__all__ = ["sampled_label_ggn_trace"]


@twice_differentiable()
def sampled_label_ggn_trace(
    model: nn.Module,
    data: AnalysisData,
    scope: ParamScope,
    samples: int = 1,
    generator: torch.Generator | None = None,
) -> TraceResult:
    r"""The Gauss-Newton trace by sampled labels, [NME] eq. 20.

    .. math::

        \mathrm{tr}(G) = \frac1N \sum_i \mathbb{E}_{\hat y \sim p(\cdot \mid z_i)}
            \lVert \nabla_\theta l(z_i, \hat y) \rVert^2

    Labels come from the loss's own sampler (:meth:`sharpcli.losses.Loss.labels_from_noise`):
    cross-entropy ``y^ ~ Cat(softmax z_i)``, binary cross-entropy ``y^ ~ Bernoulli(sigmoid z_i)``,
    mse (``l = (1/C)||z - y||^2``) ``y^ ~ N(z_i, (C/2) I)``, for which
    ``E||J^T (2/C)(z - y^)||^2 = (2/C)||J||_F^2`` as well. ``samples`` labels are drawn
    per data point from random numbers keyed by the point's global index in the analysis set
    (:func:`per_sample_draws`, base seed from the CPU ``generator``), so the draws, and the
    result, do not depend on the batch size or on how ranks shard the set; per-sample
    gradients come from ``vmap(grad)``. Standard
    error of the mean over the label draws, the data set being fixed: with ``samples >= 2``,
    ``sqrt(sum_i s_i^2 / samples) / N`` from each point's unbiased variance ``s_i^2``; with one
    draw the pooled variance over points is used (conservative: it includes between-point spread).

    Args:
        model: the model.
        data: the analysis set (a loss with one predictive distribution per sample).
        scope: the parameters.
        samples: label draws per data point.
        generator: the CPU generator of the base seed (default seeded with 0).

    Returns:
        A :class:`~sharpcli.curvature.trace.probes.TraceResult` (``estimator="sampled-label"``)
        with the per-layer traces.
    """
    from torch.func import grad

    if int(samples) < 1:
        raise UsageError(f"samples must be >= 1, got {samples}", source="samples")
    loss = get_loss(data.loss)
    if loss.sampler is None or loss.per_token:
        raise UsageError(
            "sampled-label GGN trace needs one predictive distribution per sample "
            f"(cross-entropy, mse, binary-cross-entropy), not {data.loss!r}",
            source="loss",
        )
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    logits = functional_logits(model, list(scope.names))

    def single_loss(params, x_single, label):
        return loss.per_sample(logits(params, x_single)[None], label[None]).sum()

    per_sample_grad = vmapped_or_looped(grad(single_loss), in_dims=(None, 0, 0))
    params = tuple(p.detach() for p in scope.params)
    layer_of = param_to_layer(scope)
    blocks = scope.blocks()
    L = len(blocks)
    S = int(samples)
    sums = torch.zeros(1 + L, dtype=torch.float64)  # sum_i mean_s v_is
    var_sums = torch.zeros(1 + L, dtype=torch.float64)  # sum_i s_i^2 / S  (S >= 2)
    sq_sums = torch.zeros(1 + L, dtype=torch.float64)  # sum_i v_i^2      (S == 1)
    N = data.num_samples
    base_seed = int(torch.randint(0, 2**40, (1,), generator=generator))
    first = getattr(data, "shard_start", 0)  # global index of this rank's first sample
    run = progress.start(
        "sampled tr(G)", total=data.num_batches, unit="batches", quantity="tr", probes=S
    )
    for batch_index, (x_b, y_b, _) in enumerate(data.batches()):
        run.update(batch_index)
        x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
        with torch.no_grad():
            z_b = model(x_b)
        tail = tuple(loss.label_noise_shape(z_b)[1:])
        batch_draws = per_sample_draws(
            base_seed, first, first + x_b.shape[0], S, loss.sampler.noise, tail
        )
        first += x_b.shape[0]
        rows = max(1, CHUNK_BYTES // max(1, scope.numel * z_b.element_size()))
        for start in range(0, x_b.shape[0], rows):
            x_c, z_c = x_b[start : start + rows], z_b[start : start + rows]
            draws = torch.zeros(S, x_c.shape[0], 1 + L, dtype=torch.float64)
            for s in range(S):
                random_c = batch_draws[s, start : start + x_c.shape[0]]
                labels = loss.labels_from_noise(z_c, random_c)  # y^ ~ p(y | z) (Loss.sample_labels)
                grads = per_sample_grad(params, x_c, labels)
                for i, g in enumerate(grads):
                    sq = (g.reshape(g.shape[0], -1) ** 2).sum(1).to(torch.float64).cpu()
                    draws[s, :, 0] += sq
                    draws[s, :, 1 + layer_of[i]] += sq
            if not torch.isfinite(draws).all():
                raise NumericalError(
                    f"per-sample gradient is not finite on batch {batch_index}",
                    source="Gauss-Newton",
                )
            point_means = draws.mean(0)
            sums += point_means.sum(0)
            if S >= 2:
                var_sums += (draws.var(0, unbiased=True) / S).sum(0)
            else:
                sq_sums += (point_means**2).sum(0)
    all_reduce_sum([sums, var_sums, sq_sums])
    mean = sums / N
    if S >= 2:
        stderr = var_sums.sqrt() / N
    else:
        pooled = (sq_sums - N * mean**2).clamp_min(0) / max(N - 1, 1)
        stderr = (pooled / N).sqrt()
    run.finish(data.num_batches, estimate=float(mean[0]), stderr=float(stderr[0]))
    return TraceResult(
        estimate=float(mean[0]),
        stderr=float(stderr[0]),
        matvecs=0,
        samples=N * S,
        estimator="sampled-label",
        converged=True,
        by_layer={
            name: {"estimate": float(mean[j + 1]), "stderr": float(stderr[j + 1])}
            for j, name in enumerate(blocks)
        },
        notes=[
            f"NME eq. 20 with {S} label draw(s) per sample; per-sample gradients via torch.func"
        ],
    )
