"""Losses ``l(z, y)`` on model outputs, their Hessians with respect to the outputs, one registry.

The analysis loss is ``L(theta) = (1/N) sum_i l(f(theta, x_i), y_i)``, a mean over samples
(a batch of size B contributes with weight B/N; see :mod:`sharpcli.curvature.data`). Each
loss is a :class:`Loss` record in :data:`LOSSES` carrying everything about itself: the batch
mean, the per-sample loss, ``H_z u`` and a square-root factor of ``H_z = d^2 l / dz^2`` for
the exact Gauss-Newton trace ([Schraudolph2002]; ``tr(J^T H_z J) = sum_c ||J^T s_c||^2`` when
``H_z = sum_c s_c s_c^T``), how it counts correct predictions (accuracy is defined by the loss: correct over the
predictions it counts, one per sample or one per labelled position), and which outputs and
labels it accepts.

- ``cross-entropy``: ``l = -log softmax(z)_y``, z (B, C), integer y; ``H_z = diag(p) - p p^T``.
- ``mse``: ``l = (1/C) ||z - y||^2`` (torch's ``mse_loss``, mean over the C outputs);
  ``H_z = (2/C) I``.
- ``binary-cross-entropy``: one logit per sample, y in {0, 1}:
  ``l = softplus(z) - y z`` (``binary_cross_entropy_with_logits``); ``H_z = s(z)(1 - s(z))``.
- ``token-cross-entropy``: sequence outputs z (B, T, V) and token labels y (B, T), positions
  labelled ``-100`` ignored: ``l_i = w_i sum_{t valid} -log softmax(z_it)_{y_it}`` with
  ``w_i = 1/n_i`` (``n_i`` the sample's valid positions; per-sample averaging, training's
  default) or ``w_i = 1/nbar`` (``nbar`` the mean valid positions per sample of the analysis
  set: the mean over all labelled tokens, analyses' default; :func:`set_token_reduction`);
  ``H_z`` is block diagonal over positions, ``w_i (diag p_t - p_t p_t^T)``.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.registry import Entry

__all__ = [
    "IGNORE_INDEX",
    "LOSSES",
    "TOKEN_REDUCTIONS",
    "Loss",
    "clear_token_reduction",
    "get_loss",
    "logit_hessian_matvec",
    "loss_fn",
    "per_sample_loss",
    "register_loss",
    "set_token_reduction",
    "token_weights",
]

IGNORE_INDEX = -100  # token labels to skip (the convention of torch and HuggingFace)


@dataclass(frozen=True)
class Loss:
    """Everything about one loss: value, per-sample value, output Hessian, accuracy, checks."""

    name: str
    description: str
    classification: bool  # labels are classes: accuracy is defined
    mean: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    per_sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (B,)
    # H_z u per sample, f(z, y, u); y matters only where H_z depends on which outputs are labelled
    hessian_matvec: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # columns s shaped like z with H_z = sum_s s s^T per sample, f(z, y)
    ggn_factor: Callable[[torch.Tensor, torch.Tensor], Iterator[torch.Tensor]]
    # (correct predictions, predictions counted): the count of correct predictions a 0-dim
    # tensor on z's device (read back by the caller: a training step reads once per step), the
    # number counted an int where the host knows it (every label) or such a tensor where the
    # device does (labelled positions); None: no accuracy (regression)
    correct: (
        Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | int]] | None
    ) = None
    check: Callable[[torch.Tensor, torch.Tensor], str | None] | None = None  # problem or None


# The losses by name: sharpcli.catalogue.LOSSES, whose records the built-ins below match.
LOSSES = catalogue.LOSSES


def _check_loss(entry: Entry, loss: Loss) -> Loss:
    """A loss is a :class:`Loss` under its own name; a built-in's description and
    ``classification`` are its catalogue record's."""
    if not isinstance(loss, Loss) or loss.name != entry.name:
        raise LOSSES.error(f"loss {entry.name!r}: register a Loss under its own name")
    declared = (entry.summary, entry.info.get("classification", loss.classification))
    if (loss.description, loss.classification) != declared:
        raise LOSSES.error(f"loss {loss.name!r}: differs from its catalogue record {declared!r}")
    return loss


LOSSES.check = _check_loss
LOSSES.make_entry = lambda name, loss: Entry(
    name, loss.description, info={"classification": loss.classification}
)


def register_loss(loss: Loss, *, replace: bool = False) -> Loss:
    """Add ``loss`` to :data:`LOSSES`.

    Args:
        loss: the loss.
        replace: replace a loss registered under the same name.

    Returns:
        ``loss``.

    Raises:
        RegistryError: a name taken (unless ``replace``) or not a CLI value, or a built-in
            that differs from its catalogue record.
    """
    return LOSSES.register(loss.name, loss, replace=replace)


def get_loss(name: str) -> Loss:
    """The registered loss ``name``.

    Args:
        name: the loss.

    Returns:
        Its record.

    Raises:
        RegistryError: (a UsageError, source ``loss``) an unknown name, listing the accepted.
    """
    return LOSSES.get(name)


def loss_fn(name: str):
    """Return ``f(z, y) -> mean loss over the batch`` for a loss name."""
    return get_loss(name).mean


def per_sample_loss(name: str, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss per sample, shape (B,)."""
    return get_loss(name).per_sample(z, y)


def logit_hessian_matvec(
    name: str, z: torch.Tensor, u: torch.Tensor, y: torch.Tensor | None = None
) -> torch.Tensor:
    """``H_z u`` per sample for the *per-sample* loss (no 1/B factor), shaped like ``z``."""
    return get_loss(name).hessian_matvec(z, y, u)


# --------------------------------------------------------------------------- cross-entropy
def _softmax_factor(z: torch.Tensor, y=None) -> Iterator[torch.Tensor]:
    # H_z = diag(p) - p p^T = S S^T with column c: s_c = sqrt(p_c) (e_c - p)
    # (S S^T = diag(p) - 2 p p^T + p (sqrt p . sqrt p) p^T and sum p = 1)
    p = torch.softmax(z.detach(), dim=-1)
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    for c in range(z.shape[-1]):
        yield p[..., c : c + 1].sqrt() * (eye[c] - p)


def _softmax_matvec(z, y, u):
    p = torch.softmax(z, dim=-1)
    return p * u - p * (p * u).sum(dim=-1, keepdim=True)


def _count(z, y):
    # every label counts: a number the host knows, no tensor to fill and read back
    return y.numel()


def _argmax_correct(z, y):
    return (z.argmax(-1) == y).sum(), _count(z, y)


def _class_check(z, y):
    if z.ndim != 2:
        return f"the model returns outputs of shape {tuple(z.shape)}, expected (batch, classes)"
    if y.is_floating_point():
        return (
            "cross-entropy needs integer class labels but the targets are floating point "
            f"(shape {tuple(y.shape)}); for one-hot or probability rows store the class index"
        )
    if y.ndim != 1:
        return (
            f"labels have shape {tuple(y.shape)} but the model returns (batch, classes) logits: "
            "cross-entropy takes one class index per sample (labels per position need "
            "(batch, length, classes) outputs)"
        )
    n = z.shape[1]
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= n):
        return f"labels range over [{int(y.min())}, {int(y.max())}] but the model has {n} classes"
    return None


register_loss(
    Loss(
        "cross-entropy",
        "softmax cross-entropy on (batch, classes) logits and class labels",
        True,
        mean=lambda z, y: F.cross_entropy(z, y),
        per_sample=lambda z, y: F.cross_entropy(z, y, reduction="none"),
        hessian_matvec=_softmax_matvec,
        ggn_factor=_softmax_factor,
        correct=_argmax_correct,
        check=_class_check,
    )
)


# --------------------------------------------------------------------------- mse
def _mse_factor(z, y=None):
    scale = math.sqrt(2.0 / z.shape[-1])
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    for c in range(z.shape[-1]):
        yield scale * eye[c].expand_as(z)


def _mse_check(z, y):
    if z.ndim != 2:
        return f"the model returns outputs of shape {tuple(z.shape)}, expected (batch, outputs)"
    width = 1 if y.ndim == 1 else y.shape[1]
    if width != z.shape[1]:
        return f"targets have {width} columns but the model has {z.shape[1]} outputs"
    return None


register_loss(
    Loss(
        "mse",
        "mean squared error (mean over the outputs) on regression targets",
        False,
        mean=lambda z, y: F.mse_loss(z, y.to(z.dtype).reshape(z.shape)),
        per_sample=lambda z, y: F.mse_loss(
            z, y.to(z.dtype).reshape(z.shape), reduction="none"
        ).mean(dim=1),
        hessian_matvec=lambda z, y, u: (2.0 / z.shape[-1]) * u,
        ggn_factor=_mse_factor,
        check=_mse_check,
    )
)


# --------------------------------------------------------------------------- binary cross-entropy
def _bce(z, y, reduction="mean"):
    return F.binary_cross_entropy_with_logits(
        z.reshape(-1), y.to(z.dtype).reshape(-1), reduction=reduction
    )


def _bce_factor(z, y=None):
    s = torch.sigmoid(z.detach())
    yield (s * (1 - s)).sqrt()


def _bce_check(z, y):
    if z.ndim not in (1, 2) or z[0].numel() != 1:
        return f"the model returns outputs of shape {tuple(z.shape)}, expected one logit per sample"
    if y.ndim != 1:
        return f"labels have shape {tuple(y.shape)}; binary cross-entropy takes one 0/1 label per sample"
    if y.numel() and not bool(((y == 0) | (y == 1)).all()):
        return "binary cross-entropy needs labels 0 and 1"
    return None


register_loss(
    Loss(
        "binary-cross-entropy",
        "binary cross-entropy with logits: one logit per sample, labels 0/1",
        True,
        mean=_bce,
        per_sample=lambda z, y: _bce(z, y, reduction="none"),
        hessian_matvec=lambda z, y, u: torch.sigmoid(z) * (1 - torch.sigmoid(z)) * u,
        ggn_factor=_bce_factor,
        correct=lambda z, y: (
            ((z.reshape(-1) > 0).long() == y.reshape(-1).long()).sum(),
            _count(z, y),
        ),
        check=_bce_check,
    )
)


# --------------------------------------------------------------------------- token cross-entropy
TOKEN_REDUCTIONS = ("tokens", "samples")
_MEAN_POSITIONS: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "sharp_token_mean_positions", default=None
)


def set_token_reduction(reduction: str, y: torch.Tensor | None = None) -> float | None:
    """How the token loss averages, for the analysis set's token labels ``y`` (N, T).

    ``"tokens"``: the mean over every labelled token of the set, ``sum_{i,t} CE_it / T``
    (what Hugging Face's causal-LM loss and most LM training minimise): each labelled position
    weighs ``1 / nbar`` with ``nbar = T / N`` the mean labelled positions per sample, so the
    analysis mean ``(1/N) sum_i l_i`` is the token mean. ``"samples"``: each sample's mean over
    its own labelled positions, then the mean over samples (``w_it = 1 / n_i``). The two agree
    when every sample has the same number of labelled positions. Returns ``nbar`` (None for
    ``samples``); it holds until :func:`clear_token_reduction`.
    """
    if reduction not in TOKEN_REDUCTIONS:
        raise UsageError(
            f"unknown token reduction {reduction!r}; accepted: {', '.join(TOKEN_REDUCTIONS)}",
            source="token_reduction",
        )
    mean_positions = None
    if reduction == "tokens" and y is not None and y.ndim == 2 and y.shape[0]:
        labelled = int((y != IGNORE_INDEX).sum())
        mean_positions = labelled / y.shape[0] if labelled else None
    _MEAN_POSITIONS.set(mean_positions)
    return mean_positions


def clear_token_reduction() -> None:
    """Back to per-sample averaging (a command's run is over)."""
    _MEAN_POSITIONS.set(None)


def token_weights(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, T) weights on the labelled positions, 0 elsewhere, in ``z``'s dtype, so that
    ``l_i = sum_t w_it CE(z_it, y_it)``: ``1/n_i`` (``n_i`` the sample's labelled positions)
    averaging per sample, or ``1/nbar`` for the token mean (:func:`set_token_reduction`)."""
    valid = (y != IGNORE_INDEX).to(z.dtype)
    mean_positions = _MEAN_POSITIONS.get()
    if mean_positions is not None:
        return valid / mean_positions
    return valid / valid.sum(1, keepdim=True).clamp_min(1)


def _token_per_sample(z, y):
    ce = F.cross_entropy(
        z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).reshape(y.shape)
    return (ce * token_weights(z, y)).sum(1)


def _token_factor(z, y):
    # block diagonal H_z: one column per (position t, class c), nonzero at position t only
    w = token_weights(z, y).sqrt().unsqueeze(-1)
    for t in range(z.shape[1]):
        for s in _softmax_factor(z[:, t]):
            column = torch.zeros_like(z)
            column[:, t] = s * w[:, t]
            yield column


def _token_matvec(z, y, u):
    return _softmax_matvec(z, y, u) * token_weights(z, y).unsqueeze(-1)


def _token_check(z, y):
    if z.ndim != 3 or y.ndim != 2 or z.shape[1] != y.shape[1]:
        return (
            f"token cross-entropy needs outputs (batch, length, vocabulary) and labels "
            f"(batch, length); got {tuple(z.shape)} and {tuple(y.shape)}"
        )
    valid = y[y != IGNORE_INDEX]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= z.shape[-1]):
        return (
            f"token labels range over [{int(valid.min())}, {int(valid.max())}] but the model "
            f"has {z.shape[-1]} classes ({IGNORE_INDEX} marks ignored positions)"
        )
    return None


def _token_correct(z, y):
    valid = y != IGNORE_INDEX
    return ((z.argmax(-1) == y) & valid).sum(), valid.sum()


register_loss(
    Loss(
        "token-cross-entropy",
        "cross-entropy per position of (batch, length, vocabulary) outputs, labels -100 ignored",
        True,
        mean=lambda z, y: _token_per_sample(z, y).mean(),
        per_sample=_token_per_sample,
        hessian_matvec=_token_matvec,
        ggn_factor=_token_factor,
        correct=_token_correct,
        check=_token_check,
    )
)
