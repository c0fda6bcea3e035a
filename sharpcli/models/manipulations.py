"""The manipulation paper's architectural interventions ([MAN] sections 4 and 5.1).

- **Fixed feature-map masking** ([MAN] Table 1): a fixed random fraction ``mask_ratio`` of every
  activation layer's outputs (each channel-position of a feature map, each unit of a dense layer)
  is zeroed for the whole of training, which forces dead outputs. Implemented as a
  :class:`FeatureMask` (a persistent 0/1 buffer, seeded by ``mask_seed``) applied to the
  pre-activation, so ``relu(m * z) = m * relu(z)`` and the masked units are dead in the sense
  of ``sharp activation-stats`` (pre-activation never > 0).
- **Strict per-sample mean-variance normalisation** ([MAN] section 5.1): every activation layer's
  input is normalised per sample (over all its features) to mean 0 and variance 1
  (:class:`PerSampleNorm`, unlike BatchNorm independent of the batch), and every weight matrix
  is constrained to mean 0 and variance ``2 / n_in`` (He initialisation) through the
  parametrisation :class:`HeStandardizedWeight`, ``W = sqrt(2/n_in) (V - mean V) / std V``,
  so ``E ||W||_F^2 = 2 n_out``: the network's norms are fixed and sharpness becomes comparable.

Both are model arguments (``mask_ratio``, ``mask_seed``, ``per_sample_norm``), so a
checkpoint rebuilds the manipulated model exactly and every analysis sees it.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from sharpcli.models.activations import activation_modules


class FeatureMask(nn.Module):
    """``x -> m * x`` with a fixed 0/1 mask ``m`` over one sample's features (a persistent buffer)."""

    mask: torch.Tensor

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x * m``, the mask cast to ``x``'s dtype."""
        return x * self.mask.to(x.dtype)

    def extra_repr(self) -> str:
        """The mask's shape and the fraction of features it zeroes, in the module's repr."""
        return f"shape={tuple(self.mask.shape)}, zeroed={1.0 - float(self.mask.float().mean()):.3f}"


class PerSampleNorm(nn.Module):
    """``x_i -> (x_i - mean(x_i)) / sqrt(var(x_i) + eps)`` per sample, over all non-batch dimensions."""

    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each sample standardised over its non-batch dimensions."""
        dims = tuple(range(1, x.dim()))
        mean = x.mean(dim=dims, keepdim=True)
        var = x.var(dim=dims, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + self.eps)


class HeStandardizedWeight(nn.Module):
    """Parametrisation ``V -> sqrt(2/n_in) (V - mean V) / std V``: mean 0, variance 2/n_in."""

    def __init__(self, fan_in: int, eps: float = 1e-8):
        super().__init__()
        self.scale = math.sqrt(2.0 / fan_in)
        self.eps = eps

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        """The standardised, He-scaled weight."""
        centred = weight - weight.mean()
        return self.scale * centred / torch.sqrt(centred.pow(2).mean() + self.eps)


def _parent_and_name(model: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    parent = model
    parts = qualified.split(".")
    for part in parts[:-1]:
        parent = getattr(parent, part)
    return parent, parts[-1]


def _pre_activation_shapes(
    model: nn.Module, names: list[str], input_shape: tuple
) -> dict[str, tuple]:
    shapes: dict[str, tuple] = {}
    modules = dict(model.named_modules())

    def record(name):
        def hook(module, args):  # a pre-hook must return None, or it replaces the input
            shapes.setdefault(name, tuple(args[0].shape[1:]))

        return hook

    hooks = [modules[n].register_forward_pre_hook(record(n)) for n in names]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros((1, *input_shape)))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return shapes


def apply_manipulations(model: nn.Module, args: dict, input_shape: tuple) -> nn.Module:
    """Insert masks / per-sample normalisation before each activation and standardise weights.

    Args:
        model: the model, changed in place.
        args: its complete model args (``mask_ratio``, ``mask_seed``, ``per_sample_norm``).
        input_shape: one example's shape (the masks take the pre-activations' shapes).

    Returns:
        ``model``.
    """
    ratio = float(args.get("mask_ratio") or 0.0)
    normalise = bool(args.get("per_sample_norm"))
    if ratio <= 0.0 and not normalise:
        return model
    acts = [name for name, _ in activation_modules(model)]
    shapes = _pre_activation_shapes(model, acts, tuple(input_shape)) if ratio > 0 else {}
    generator = torch.Generator().manual_seed(int(args.get("mask_seed") or 0))
    for name in acts:
        parent, attr = _parent_and_name(model, name)
        act = getattr(parent, attr)
        stages: list[nn.Module] = []
        if normalise:
            stages.append(PerSampleNorm())
        if ratio > 0:
            shape = shapes[name]
            keep = torch.rand(shape, generator=generator) >= ratio
            stages.append(FeatureMask(keep.to(torch.float32)))
        setattr(parent, attr, nn.Sequential(*stages, act))
    if normalise:
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                fan_in = module.weight[0].numel()
                parametrize.register_parametrization(module, "weight", HeStandardizedWeight(fan_in))
    return model
