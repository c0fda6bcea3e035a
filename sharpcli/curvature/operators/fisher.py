r"""Fisher operators: the empirical Fisher (``ef``) and the sampled-label Fisher (``fisher``).

For the analysis loss :math:`L = \frac1N \sum_i l(z_i, y_i)`, :math:`z_i = f(\theta, x_i)`,
:math:`J_i = \partial z_i / \partial \theta` and the per-sample gradient
:math:`g_i = \nabla_\theta l(z_i, y_i) = J_i^\top r_i` with :math:`r_i = \partial l / \partial z_i`:

.. math::

    F_{\mathrm{emp}} = \frac1N \sum_i g_i g_i^\top
        = \frac1N \sum_i J_i^\top r_i r_i^\top J_i,
    \qquad
    F = \frac1N \sum_i \frac1S \sum_{s=1}^S J_i^\top \hat r_{is} \hat r_{is}^\top J_i,

where :math:`\hat r_{is} = \partial l(z_i, \hat y_{is}) / \partial z_i` at labels
:math:`\hat y_{is} \sim p(\cdot \mid z_i)` drawn from the model's predictive distribution
(:meth:`sharpcli.losses.Loss.sample_labels`). The empirical Fisher uses the data's labels
([Kunstner2019] discusses where it differs from the Fisher). Every built-in loss is the
negative log-likelihood of its predictive distribution with :math:`\mathbb{E}[\hat r \hat r^\top]
= H_z` exactly, so :math:`\mathbb{E}_{\hat y} F = G`, the Gauss-Newton matrix
([Martens2020]; [Schraudolph2002]): cross-entropy and token cross-entropy
(``Cat(softmax z)``; each position's gradient weighted by :math:`\sqrt{w_t}`, the square root
of its weight in the loss, so that the weight enters once as it does in :math:`H_z`),
binary cross-entropy (``Bernoulli(sigmoid z)``) and mse, whose
:math:`l = \frac1C \lVert z - y \rVert^2` is, up to a constant, the negative log-likelihood of
:math:`\mathcal N(z, \frac C2 I)`: with that variance (not the unit variance of the usual
Gaussian likelihood, whose Fisher is :math:`J^\top J = \frac C2 G`) the Fisher equals G.

Products reuse the curvature engine's cached first-order graph of each batch
(:mod:`sharpcli.curvature.products.engine`): :math:`J v` comes from the same reverse pass as the
Gauss-Newton product, then :math:`u_i = \sum_s r_{is} (r_{is} \cdot J_i v)` and one
vector-Jacobian product :math:`J^\top u`: the cost of a G product. The empirical Fisher's
:math:`r_i` is the cached :math:`g_z = \partial L_b / \partial z` times N (a batch enters with
weight :math:`B_b / N`, so :math:`g_{z,i} = r_i / N`); the Fisher's labels are drawn once per
operator from random numbers keyed by each sample's global index (as the sampled-label trace of
:mod:`sharpcli.curvature.trace.sampled_ggn`), so the operator is one fixed symmetric matrix whatever
the batch size or the ranks.
"""

from __future__ import annotations

import abc
import math

import torch

from sharpcli.curvature.operators.hessian import CurvatureOperator
from sharpcli.curvature.operators.registry import register_operator
from sharpcli.curvature.products.data import all_reduce_sum, per_sample_draws
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.curvature.products.engine import CurvatureEngine
from sharpcli.curvature.products.graphs import BatchGraph
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss, token_weights
from sharpcli.registry import declare

__all__ = [
    "EMPIRICAL_FISHER",
    "FISHER",
    "EmpiricalFisherOperator",
    "FisherOperator",
    "fisher_residuals",
]

# the operators' names (``--operator``), declared below
EMPIRICAL_FISHER, FISHER = "ef", "fisher"


def fisher_residuals(
    loss_name: str, z: torch.Tensor, labels: torch.Tensor, y: torch.Tensor | None = None
) -> torch.Tensor:
    r"""The output gradients :math:`\hat r = \partial l(z, \hat y) / \partial z` of sampled labels,
    scaled so that :math:`\mathbb{E}_{\hat y}[\hat r \hat r^\top] = H_z` per sample.

    For a per-token loss each position's gradient is divided by :math:`\sqrt{w_t}` (it carries
    the weight :math:`w_t` once, as :math:`H_z` does, instead of twice), positions that ``y``
    leaves unlabelled stay zero.

    Args:
        loss_name: the loss.
        z: the model outputs of a batch, ``(B, ...)``.
        labels: labels drawn from ``p(. | z)`` (:meth:`~sharpcli.losses.Loss.labels_from_noise`).
        y: the data's labels (a per-token loss's weights come from their labelled positions).

    Returns:
        :math:`\hat r`, shaped like ``z``.
    """
    loss = get_loss(loss_name)
    leaf = z.detach().requires_grad_(True)
    with torch.enable_grad():
        (r,) = torch.autograd.grad(loss.per_sample(leaf, labels).sum(), leaf)
    if loss.per_token:
        w = token_weights(z.detach(), labels if y is None else y).unsqueeze(-1)
        r = torch.where(w > 0, r / w.clamp_min(torch.finfo(w.dtype).tiny).sqrt(), 0.0)
    return r


class _OuterProductOperator(CurvatureOperator, abc.ABC):
    """``A v = sum_i J_i^T sum_s r_is (r_is . J_i v)`` for residuals ``r`` given per batch.

    Subclasses supply :meth:`_residuals` (shape ``(S, B, ...)`` like the batch's logits, with
    the 1/N and 1/S of the average folded in as ``1/sqrt(N S)``).
    """

    def __init__(self, engine: CurvatureEngine):
        scope = engine.scope
        super().__init__(scope.numel, scope.dtype, scope.device)
        self.engine = engine
        self.model, self.data, self.scope = engine.model, engine.data, scope

    @abc.abstractmethod
    def _residuals(self, index: int, graph: BatchGraph) -> torch.Tensor:
        """The residuals ``r_is / sqrt(N S)`` of batch ``index`` (shape ``(S, B, ...)``)."""

    def _batch_product(
        self, R: torch.Tensor, graph: BatchGraph, V, batched: bool, out=None
    ) -> tuple:
        """``(A_b V,)`` on one batch: ``J v`` by the engine's reverse pass, then ``J^T u``
        (written into ``out[0]``, a ``(P, k)`` view, when given)."""
        engine = self.engine
        assert engine is not None  # set in __init__
        (jv,) = engine._reverse_through_gradient(graph, V, batched, [graph.gz])
        k = V.shape[1]
        if jv is None:  # the loss does not reach the outputs through theta on this batch
            if out is not None:
                return (out[0].zero_(),)
            return (torch.zeros(self.shape[0], k, dtype=self.dtype, device=self.device),)
        jv = jv if batched else jv[None]  # (k, B, ...)
        tail = (1,) * (jv.dim() - 2)
        overlap = (R[:, None] * jv[None]).flatten(3).sum(3)  # (S, k, B): r_is . J_i v
        u = (R[:, None] * overlap.reshape(*overlap.shape, *tail)).sum(0)  # (k, B, ...)
        params = list(self.scope.params)
        with torch.enable_grad():
            if batched:
                fv = torch.autograd.grad(
                    graph.z,
                    params,
                    grad_outputs=u,
                    allow_unused=True,
                    retain_graph=True,
                    is_grads_batched=True,
                )
            else:
                fv = torch.autograd.grad(
                    (graph.z * u[0]).sum(), params, allow_unused=True, retain_graph=True
                )
        return (engine._flat_block(fv, k, batched, out=None if out is None else out[0]),)

    @twice_differentiable()
    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        engine = self.engine
        assert engine is not None
        total = torch.zeros_like(V)
        for index, graph in engine._graphs():
            if not graph.grads:  # the loss does not depend on theta in scope on this batch
                continue
            R = self._residuals(index, graph)

            def product(graph, V, batched, out=None, R=R):
                return self._batch_product(R, graph, V, batched, out)

            (block,) = engine._batch_blocks(graph, V, product, 1)
            del graph  # freed before the next batch's is built (engine._apply)
            engine._check_finite(block, self.name, self.name, index)
            total += block
            del block  # nor held through the next batch's product
        return all_reduce_sum(total)


@declare(
    "operator",
    EMPIRICAL_FISHER,
    "empirical Fisher, data labels",
    paper="Kunstner2019",
    info={"symbol": "F_emp", "psd": True},
)
class EmpiricalFisherOperator(_OuterProductOperator):
    r"""The empirical Fisher with the data's labels ([Kunstner2019]).

    .. math::

        F_{\mathrm{emp}} v = \frac1N \sum_i g_i (g_i \cdot v), \qquad
        g_i = \nabla_\theta l(f(\theta, x_i), y_i)

    the per-sample gradients of the per-sample loss (for a token loss, of a sequence's
    weighted loss). PSD, rank at most N; ``tr(F_emp) = (1/N) sum_i ||g_i||^2``.

    Args:
        engine: the analysis's engine (its cached graphs are shared).
    """

    name = "empirical Fisher"

    def _residuals(self, index: int, graph: BatchGraph) -> torch.Tensor:
        # g_z,i = (B_b/N) (1/B_b) r_i = r_i / N, so r_i / sqrt(N) = sqrt(N) g_z,i
        return graph.gz.detach()[None] * math.sqrt(self.data.num_samples)


@declare(
    "operator",
    FISHER,
    "Fisher, labels drawn from the model (mean: G)",
    paper="Martens2020",
    info={"symbol": "F", "psd": True},
)
class FisherOperator(_OuterProductOperator):
    r"""The Fisher information with labels sampled from the model ([Martens2020]).

    .. math::

        F v = \frac1N \sum_i \frac1S \sum_s J_i^\top \hat r_{is} (\hat r_{is} \cdot J_i v),
        \qquad \hat y_{is} \sim p(\cdot \mid z_i), \qquad \mathbb{E}_{\hat y} F = G

    (the module docstring gives the expectation per loss). ``samples`` labels are drawn per
    data point, once, from random numbers keyed by its global index and ``seed``, so the
    operator is a fixed PSD matrix of rank at most ``N S``, an unbiased Monte Carlo estimate of
    the Gauss-Newton matrix G.

    Args:
        engine: the analysis's engine (its cached graphs are shared).
        samples: label draws per data point.
        seed: seeds the label draws.

    Raises:
        UsageError: ``samples`` below 1, or a loss without a predictive distribution.
    """

    name = "Fisher"

    def __init__(self, engine: CurvatureEngine, samples: int = 1, seed: int = 0):
        super().__init__(engine)
        if int(samples) < 1:
            raise UsageError(f"samples must be >= 1, got {samples}", source="samples")
        self.loss = get_loss(self.data.loss)
        if self.loss.sampler is None:
            raise UsageError(
                f"the Fisher needs a loss with a predictive distribution, not {self.data.loss!r}",
                source="operator",
            )
        self.samples, self.seed = int(samples), int(seed)

    def _rebuild(self, engine: CurvatureEngine) -> CurvatureOperator:
        return FisherOperator(engine, samples=self.samples, seed=self.seed)

    def _batch_labels(self, index: int, size: int) -> tuple[int, torch.Tensor]:
        """The global index of batch ``index``'s first sample and its data labels."""
        local = index * self.data.batch_size
        return self.data.shard_start + local, self.data.y[local : local + size]

    def labels(self, index: int, z: torch.Tensor) -> torch.Tensor:
        """The drawn labels of batch ``index`` (outputs ``z``), ``(samples, B, ...)``.

        Args:
            index: the batch's position in this rank's pass over the data.
            z: its outputs.

        Returns:
            The labels, one set per draw.
        """
        loss = self.loss
        start, y_b = self._batch_labels(index, z.shape[0])
        tail = tuple(loss.label_noise_shape(z)[1:])
        assert loss.sampler is not None  # checked in __init__
        noise = per_sample_draws(
            self.seed, start, start + z.shape[0], self.samples, loss.sampler.noise, tail
        )
        y_b = y_b.to(z.device)
        return torch.stack([loss.labels_from_noise(z, noise[s], y_b) for s in range(self.samples)])

    def _residuals(self, index: int, graph: BatchGraph) -> torch.Tensor:
        z = graph.z.detach()
        y_b = self._batch_labels(index, z.shape[0])[1].to(z.device)
        R = torch.stack(
            [fisher_residuals(self.data.loss, z, lab, y_b) for lab in self.labels(index, z)]
        )
        return R / math.sqrt(self.data.num_samples * self.samples)


def _rank_bound(num_samples: int, num_outputs: int, loss: str) -> int:
    # one outer product per sample (one label draw per sample for the registry's Fisher)
    return num_samples


register_operator(EMPIRICAL_FISHER, EmpiricalFisherOperator, rank_bound=_rank_bound)
register_operator(FISHER, FisherOperator, rank_bound=_rank_bound)
