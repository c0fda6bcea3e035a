"""Losses ``l(z, y)`` on logits and their Hessians with respect to the logits.

Both are batch means, as the analysis loss ``L(theta) = (1/N) sum_i l(f(theta, x_i), y_i)``
of :mod:`sharpcli.curvature.data` (so a batch of size B contributes with weight B/N).

- cross-entropy: ``l = -log softmax(z)_y``;  ``H_z = diag(p) - p p^T`` per sample.
- mse: ``l = (1/C) ||z - y||^2`` (torch's ``mse_loss`` with mean reduction over
  the C outputs); ``H_z = (2/C) I`` per sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sharpcli.errors import UsageError

LOSSES = ("cross-entropy", "mse")


def loss_fn(name: str):
    """Return ``f(logits, y) -> mean loss`` for a loss name."""
    if name == "cross-entropy":
        return lambda z, y: F.cross_entropy(z, y)
    if name == "mse":
        return lambda z, y: F.mse_loss(z, y.to(z.dtype).reshape(z.shape))
    raise UsageError(f"unknown loss {name!r}; accepted: {', '.join(LOSSES)}", source="--loss")


def per_sample_loss(name: str, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss per sample, shape (B,)."""
    if name == "cross-entropy":
        return F.cross_entropy(z, y, reduction="none")
    if name == "mse":
        return F.mse_loss(z, y.to(z.dtype).reshape(z.shape), reduction="none").mean(dim=1)
    raise UsageError(f"unknown loss {name!r}; accepted: {', '.join(LOSSES)}", source="--loss")


def logit_hessian_matvec(name: str, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``H_z u`` per sample for the *per-sample* loss (no 1/B factor), shapes (B, C).

    cross-entropy: ``p * u - p (p . u)``; mse: ``(2/C) u``.
    """
    if name == "cross-entropy":
        p = torch.softmax(z, dim=-1)
        return p * u - p * (p * u).sum(dim=-1, keepdim=True)
    if name == "mse":
        return (2.0 / z.shape[-1]) * u
    raise UsageError(f"unknown loss {name!r}; accepted: {', '.join(LOSSES)}", source="--loss")
