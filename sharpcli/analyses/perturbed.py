"""A model evaluated at moved weights: ``w0 + c * u`` over chosen parameters, restored after.

The sharpness and landscape analyses move a model's weights along vectors in a scaled space
(``u`` with the weight ``w = w0 + c * u``, ``c = |w0|`` for the adaptive measures of [ASAM],
``c = 1`` otherwise) and ask for the loss, its gradient with respect to ``u`` and the
accuracy on some samples. :class:`PerturbedModel` does that on the model in place, in the
model's dtype, and puts the weights back when the ``with`` block ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum, to_model_batch
from sharpcli.errors import NumericalError
from sharpcli.losses import get_loss, per_sample_loss

__all__ = [
    "NORMALIZATION_TYPES",
    "Evaluation",
    "PerturbedModel",
    "normalization_parameters",
    "whole_analysis_set",
]

# modules whose parameters are a normalization layer's affine (gamma, beta)
NORMALIZATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def whole_analysis_set(data: AnalysisData) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole analysis set on every rank under torchrun: each rank's shard at its place in
    a zero tensor, summed over the ranks (``v + 0 = v`` exactly); the set itself with one rank.

    The sharpness and landscape analyses split their work (batches, grid points) across the
    ranks instead of the samples, so that each piece is the computation one process makes.

    Args:
        data: the analysis set (this rank's shard).

    Returns:
        The inputs and targets of all ``data.num_samples`` samples.
    """
    if data.world_size == 1:
        return data.x, data.y
    whole = []
    for local in (data.x, data.y):
        padded = local.new_zeros((data.num_samples, *local.shape[1:]))
        padded[data.shard_start : data.shard_start + data.local_num_samples] = local
        whole.append(all_reduce_sum(padded))
    return whole[0], whole[1]


def normalization_parameters(model: nn.Module) -> set[str]:
    """Names of the parameters that belong to normalization layers (BatchNorm, LayerNorm, ...).

    Args:
        model: the model.

    Returns:
        The parameter names, as ``model.named_parameters()`` spells them.
    """
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, NORMALIZATION_TYPES):
            for name, _ in module.named_parameters(recurse=False):
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


@dataclass
class Evaluation:
    """The mean loss over some samples (float64), its gradient w.r.t. ``u`` and the accuracy."""

    loss: float
    gradient: torch.Tensor | None
    accuracy: float | None

    def required_gradient(self) -> torch.Tensor:
        """``gradient``, of an evaluation that asked for it (``evaluate(..., gradient=True)``)."""
        if self.gradient is None:
            raise TypeError("an evaluation made without gradient=True has no gradient")
        return self.gradient


class PerturbedModel:
    """The model with chosen parameters at ``w0 + scale * u`` (``u`` a flat vector).

    Use as a context manager: on exit every parameter is back at ``w0`` exactly (copied).

    Args:
        model: the model (eval mode); its parameters are moved in place.
        names: the parameters that move, in the order of the flat vectors.
        scale: the flat ``c`` (None: ones).
        loss: the loss name (:mod:`sharpcli.losses`).
        batch_size: samples per forward pass.
    """

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        scale: torch.Tensor | None,
        loss: str,
        batch_size: int,
    ):
        named = dict(model.named_parameters())
        self.model = model
        self.names = list(names)
        self.params = [named[n] for n in self.names]
        self.origin = [p.detach().clone() for p in self.params]
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.dim = sum(p.numel() for p in self.params)
        self.scale = (
            torch.ones(self.dim, dtype=self.dtype, device=self.device)
            if scale is None
            else scale.to(dtype=self.dtype, device=self.device)
        )
        self.loss = loss
        self.batch_size = int(batch_size)
        self.scorer = get_loss(loss).correct
        self.evaluations = 0  # forward passes over a set (with or without a backward)
        # the parameter a non-finite loss is blamed on: the size of the move
        self.error_source = "rho"

    def __enter__(self) -> PerturbedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Every moved parameter back at ``w0``."""
        with torch.no_grad():
            for p, w in zip(self.params, self.origin):
                p.copy_(w)

    def move_to(self, u: torch.Tensor) -> None:
        """Set the parameters to ``w0 + c * u``."""
        step = self.scale * u.to(dtype=self.dtype, device=self.device)
        offset = 0
        with torch.no_grad():
            for p, w in zip(self.params, self.origin):
                n = p.numel()
                p.copy_(w + step[offset : offset + n].view_as(p))
                offset += n

    def evaluate(
        self, u: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor, *, gradient: bool = False
    ) -> Evaluation:
        """``L(w0 + c u) = (1/n) sum_i l(f(x_i), y_i)`` over ``(x, y)`` and, when asked, its
        gradient ``c * grad_w L`` w.r.t. ``u``; passes of ``batch_size`` samples.

        Args:
            u: the point (None: ``w0`` itself).
            x: the inputs.
            y: the targets.
            gradient: also the gradient.

        Returns:
            The evaluation.

        Raises:
            NumericalError: the loss is not finite.
        """
        if u is None:
            self.restore()
        else:
            self.move_to(u)
        n = int(x.shape[0])
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros(2, dtype=torch.float64, device=self.device)
        grads = [torch.zeros_like(p) for p in self.params] if gradient else None
        for start in range(0, n, self.batch_size):
            x_b, y_b = to_model_batch(
                x[start : start + self.batch_size],
                y[start : start + self.batch_size],
                self.dtype,
                self.device,
            )
            with torch.set_grad_enabled(gradient):
                z = self.model(x_b)
                batch_loss = per_sample_loss(self.loss, z, y_b).sum() / n
            if grads is not None:
                for acc, g in zip(grads, torch.autograd.grad(batch_loss, self.params)):
                    acc.add_(g)
            total += batch_loss.detach().to(torch.float64)
            if self.scorer is not None:
                with torch.no_grad():
                    hits, counted = self.scorer(z.detach(), y_b)
                correct[0] += hits
                correct[1] += counted
        self.evaluations += 1
        loss = float(total)
        if not math.isfinite(loss):
            raise NumericalError(
                "the loss is not finite at a perturbed point", source=self.error_source
            )
        flat = None
        if grads is not None:
            flat = torch.cat([g.reshape(-1) for g in grads]) * self.scale
        accuracy = float(correct[0] / correct[1]) if float(correct[1]) else None
        return Evaluation(loss, flat, accuracy)
