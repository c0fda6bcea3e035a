"""How a loss reads a model's outputs and labels: the loss differentiated is the loss handed in.

torch's own losses take more shapes than sharp's registered losses (:mod:`sharpcli.losses`),
which see per-sample outputs ``(batch, outputs)`` or a sequence's ``(batch, length, classes)``.
A :class:`LossReading` maps the model's outputs and the labels onto one of them without
changing the loss:

- ``nn.CrossEntropyLoss`` / ``F.cross_entropy`` on K-dimensional outputs ``(N, C, d1, ..., dk)``
  with labels ``(N, d1, ..., dk)`` (segmentation): the classes are on dim 1 and the mean runs
  over every labelled position of the batch. Moving the classes last and flattening the
  positions, ``z -> (N, d1 ... dk, C)``, ``y -> (N, d1 ... dk)``, makes it
  ``token-cross-entropy`` averaged over all labelled tokens, the same function of the
  parameters (a permutation of the outputs leaves ``J^T H_z J`` and the Hessian unchanged;
  ``H_z`` is ``diag(p) - p p^T`` per position with ``p`` the softmax over dim 1).
- ``nn.MSELoss`` on outputs of any shape ``(N, ...)`` with targets of the same shape: the mean
  over all ``N M`` elements (``M`` per sample); flattened to ``(N, M)``, ``mse`` (the mean over
  the ``M`` outputs, then over samples) is that mean, with ``H_z = (2/M) I`` per sample, so
  ``2/(N M)`` for the batch as torch's module computes it.
- Hugging Face's causal-LM logits ``(N, T, V)`` with labels ``(N, T)``: cross-entropy with the
  classes last, ``loss(logits.view(-1, V), labels.view(-1))``, as those models compute it.

Where both cross-entropy readings fit, ``(N, T, T)`` outputs with ``(N, T)`` labels, nothing
is picked: the loss must be named (``cross-entropy``: classes on dim 1, torch's reading;
``token-cross-entropy``: classes last). :func:`check_loss_value` then guards the whole class
of such mistakes: before any product, sharp's loss on the first batch must equal the loss
module's own value on it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sharpcli.errors import UsageError, first_line
from sharpcli.losses import (
    BCE_PROBABILITIES,
    BINARY_CROSS_ENTROPY,
    CROSS_ENTROPY,
    HUBER,
    IGNORE_INDEX,
    MSE,
    NLL,
    SMOOTH_L1,
    TOKEN_CROSS_ENTROPY,
    get_loss,
    token_reduction,
)

__all__ = [
    "LAYOUTS",
    "LossReading",
    "check_loss_value",
    "read_loss",
    "reference_loss",
]

# "as-is": the registered loss takes the outputs as they are; "flat": (N, ...) -> (N, M);
# "classes-last": (N, C, d1, ..., dk) -> (N, d1 ... dk, C), labels (N, d1, ..., dk) -> (N, d1 ... dk)
LAYOUTS = ("as-is", "flat", "classes-last")

# relative agreement of sharp's loss and the module's on one batch, by the outputs' dtype: the
# two sum the same terms in another order, so they agree to rounding; another loss is off by far more
_AGREEMENT = {torch.float64: 1e-9, torch.float32: 1e-4}


@dataclass(frozen=True)
class LossReading:
    """The registered loss ``name`` and how it sees the model's outputs and the labels."""

    name: str
    layout: str = "as-is"

    def outputs(self, z: torch.Tensor) -> torch.Tensor:
        """The model's outputs ``z`` (batch first) as the registered loss takes them."""
        if self.layout == "flat":
            return z.reshape(z.shape[0], -1)
        if self.layout == "classes-last":
            return z.movedim(1, -1).reshape(z.shape[0], -1, z.shape[1])
        return z

    def labels(self, y: torch.Tensor) -> torch.Tensor:
        """The labels ``y`` (batch first) as the registered loss takes them (probability
        targets ``(N, C, d1, ..., dk)`` with their classes moved last, as the outputs)."""
        if self.layout == "classes-last" and y.is_floating_point() and y.ndim >= 3:
            return y.movedim(1, -1).reshape(y.shape[0], -1, y.shape[1])
        if self.layout in ("flat", "classes-last") and y.ndim != 2:
            return y.reshape(y.shape[0], -1)
        return y

    @property
    def reshapes(self) -> bool:
        """Whether the outputs are reshaped before the loss."""
        return self.layout != "as-is"

    def note(self, shape: tuple) -> str | None:
        """What the reading did to outputs of ``shape`` (batch first), for a report's notes."""
        outputs = "(N, " + ", ".join(str(d) for d in shape[1:]) + ")"
        if self.layout == "classes-last":
            return (
                f"outputs {outputs}: cross-entropy with the classes on dim 1 (as torch's "
                "cross_entropy), analysed per position as token-cross-entropy over the "
                "flattened positions, the mean over every labelled position"
            )
        if self.layout == "flat":
            return f"outputs {outputs}: mse is the mean over all their elements (flattened)"
        return None


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape)).replace(",)", ")")


def _cross_entropy_reading(
    z: torch.Tensor, y: torch.Tensor, named: bool, module: bool = False
) -> LossReading:
    """Cross-entropy on ``z`` with integer labels ``y`` (see the module docstring); a module
    reads the classes on dim 1 wherever that fits, as torch's module does."""
    if z.ndim <= 2:
        return LossReading(CROSS_ENTROPY)
    classes_on_dim_1 = tuple(y.shape) == (z.shape[0], *z.shape[2:])
    classes_last = z.ndim == 3 and y.ndim == 2 and y.shape[1] == z.shape[1]
    if classes_on_dim_1 and classes_last and not (named or module):
        raise UsageError(
            f"outputs {_shape(z)} with labels {_shape(y)} read two ways: classes on dim 1 "
            f"({z.shape[1]} classes at each of {z.shape[2]} positions, as torch's "
            "cross_entropy computes it) or classes last (a language model's (batch, length, "
            f"vocabulary) logits, {z.shape[2]} classes); choose with `loss=cross-entropy` "
            "(dim 1) or `loss=token-cross-entropy` (last)",
            source="loss",
        )
    if classes_on_dim_1:
        return LossReading(TOKEN_CROSS_ENTROPY, "classes-last")
    if classes_last and not named:
        return LossReading(TOKEN_CROSS_ENTROPY)
    last = (
        " (labels per position of (batch, length, vocabulary) logits: `loss=token-cross-entropy`)"
    )
    raise UsageError(
        f"outputs {_shape(z)} with labels {_shape(y)}: cross-entropy takes labels (N, d1, ..., "
        "dk) for outputs (N, C, d1, ..., dk), the classes on dim 1"
        + (last if classes_last else ""),
        source="data",
    )


def read_loss(
    name: str, z: torch.Tensor, y: torch.Tensor, *, named: bool, module: bool = False
) -> LossReading:
    """How the loss ``name`` reads outputs ``z`` and labels ``y`` (module docstring).

    Args:
        name: A registered loss, or ``cross-entropy`` for torch's cross-entropy whatever the
            outputs' rank (``nn.CrossEntropyLoss``).
        z: The model's outputs on a few samples, batch first.
        y: Their labels.
        named: Whether the user named the loss (a name, ``--loss``, a checkpoint's stored loss)
            rather than handing a module or leaving it to sharp: a named ``cross-entropy``
            reads classes on dim 1, where an inferred one would be ambiguous.
        module: Whether a loss module was handed in: ``nn.CrossEntropyLoss`` has one reading,
            the classes on dim 1 (a language model's classes last only where that does not fit).

    Returns:
        The reading: the registered loss and the layout of its outputs.

    Raises:
        UsageError: (``loss``) both cross-entropy readings fit and none was named; (``data``)
            labels or targets that fit no reading of the loss.
    """
    if name in (CROSS_ENTROPY, NLL) and y.is_floating_point():
        # probability targets (N, C, d1, ..., dk), the outputs' shape (cross-entropy only)
        if name == CROSS_ENTROPY and z.ndim > 2 and tuple(y.shape) == tuple(z.shape):
            return LossReading(TOKEN_CROSS_ENTROPY, "classes-last")
        return LossReading(name)
    if name in (CROSS_ENTROPY, NLL):
        reading = _cross_entropy_reading(z, y, named, module)
        return LossReading(NLL) if name == NLL and reading.name == CROSS_ENTROPY else reading
    if name == MSE and z.ndim > 2:
        if tuple(y.shape) != tuple(z.shape):
            raise UsageError(
                f"outputs {_shape(z)} with targets {_shape(y)}: mse takes targets of the "
                "outputs' shape (torch's MSELoss would broadcast them into another loss)",
                source="data",
            )
        return LossReading(MSE, "flat")
    return LossReading(name)


def reference_loss(reading: LossReading) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """torch's own function for the loss a registered name stands for, on the outputs and
    labels as the model and the data give them: ``F.cross_entropy`` (classes on dim 1, labels
    ``-100`` ignored), on a language model's flattened positions for ``token-cross-entropy``
    read as it is; ``F.mse_loss`` and ``F.binary_cross_entropy_with_logits`` with the targets
    shaped as the outputs (sharp's one target per sample of a one-output model).

    Args:
        reading: The reading of a named loss (a name, ``--loss``, a checkpoint's stored loss).

    Returns:
        ``f(z, y)``, the mean loss over a batch as torch computes it.
    """
    elementwise: dict[str, Callable[..., torch.Tensor]] = {
        MSE: F.mse_loss,
        BINARY_CROSS_ENTROPY: F.binary_cross_entropy_with_logits,
        BCE_PROBABILITIES: F.binary_cross_entropy,
        HUBER: F.huber_loss,
        SMOOTH_L1: F.smooth_l1_loss,
    }
    if reading.name == NLL:
        return F.nll_loss
    if reading.name in elementwise:
        torch_loss = elementwise[reading.name]

        def regression(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if reading.name == MSE and _class_labels_of(z, y):
                # sharp's mse regresses class labels on their one-hot rows ([Cohen2021])
                return torch_loss(z, F.one_hot(y.long(), z.shape[1]).to(z.dtype))
            return torch_loss(z, y.to(z.dtype).reshape(z.shape))

        return regression
    if reading == LossReading(TOKEN_CROSS_ENTROPY):
        return lambda z, y: F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1))
    return F.cross_entropy


def _class_labels_of(z: torch.Tensor, y: torch.Tensor) -> bool:
    """One integer class index per sample for outputs of several columns, in range (what
    sharp's mse reads as one-hot rows)."""
    return (
        not y.is_floating_point()
        and y.ndim == 1
        and z.ndim == 2
        and z.shape[1] > 1
        and (y.numel() == 0 or (int(y.min()) >= 0 and int(y.max()) < z.shape[1]))
    )


def _sharp_value(
    reading: LossReading, z: torch.Tensor, y: torch.Tensor, ignore_index: int | None
) -> torch.Tensor | None:
    """sharp's mean loss over one batch, labels ``ignore_index`` left out as the module does
    (None: every label of the batch is ignored)."""
    loss = get_loss(reading.name)
    z, y = reading.outputs(z), reading.labels(y)
    if loss.softmax_per_sample and ignore_index is not None and not y.is_floating_point():
        keep = y != ignore_index
        z, y = z[keep], y[keep]
    if loss.batch_value is not None:  # a loss with options, reduced as torch's module
        if loss.per_token and ignore_index is not None and not y.is_floating_point():
            y = torch.where(y == ignore_index, torch.full_like(y, IGNORE_INDEX), y)
        if not y.is_floating_point() and loss.softmax and not bool((y != IGNORE_INDEX).any()):
            return None
        return loss.batch_value(z, y)
    if not loss.per_token:
        return loss.mean(z, y) if y.shape[0] else None
    if ignore_index is not None and ignore_index != IGNORE_INDEX:
        y = torch.where(y == ignore_index, torch.full_like(y, IGNORE_INDEX), y)
    if not bool((y != IGNORE_INDEX).any()):
        return None
    with token_reduction("tokens", y):
        return loss.mean(z, y)


def _module_value(module, reading: LossReading, z, y) -> torch.Tensor:
    """The module's own loss on the batch, ``module(z, y)``; a language model's (N, T, V)
    logits with (N, T) labels, which torch's module refuses as they are, as such models apply
    it: on the flattened positions."""
    if isinstance(module, nn.Module):  # its weights in the analysis' dtype and device
        module = copy.deepcopy(module).to(device=z.device, dtype=z.dtype)
    if y.is_floating_point() or isinstance(module, nn.BCEWithLogitsLoss):
        y = y.to(z.dtype)  # targets in another float dtype, 0/1 labels as integers: the same loss
    try:
        return module(z, y)
    except (RuntimeError, ValueError, IndexError):
        language_model = isinstance(module, (nn.CrossEntropyLoss, nn.NLLLoss)) and z.ndim == 3
        per_position = reading.layout == "as-is" and get_loss(reading.name).per_token
        if not (language_model and per_position):
            raise
    return module(z.reshape(-1, z.shape[-1]), y.reshape(-1))


def check_loss_value(
    module: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reading: LossReading,
    z: torch.Tensor,
    y: torch.Tensor,
    ignore_index: int | None = None,
    label: str | None = None,
) -> None:
    """Refuse a reading whose loss is not the module's: sharp's loss on the batch ``(z, y)``
    must equal ``module(z, y)`` as torch evaluates it (rounding aside).

    Args:
        module: The loss module handed in, or :func:`reference_loss` of a named loss.
        reading: How sharp reads the outputs and labels.
        z: The model's outputs on the first batch (no graph needed).
        y: Their labels as given, before sharp's own handling of ignored labels.
        ignore_index: The labels the loss ignores (cross-entropy), or None.
        label: What messages call ``module``; default its class, ``CrossEntropyLoss()``.

    Raises:
        UsageError: (``loss``) the two values differ, or torch's module refuses the shapes.
    """
    label = label or f"{type(module).__name__}()"
    with torch.no_grad():
        try:
            expected = _module_value(module, reading, z, y)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise UsageError(
                f"{label} refuses outputs {_shape(z)} with labels {_shape(y)} "
                f"({first_line(exc)}); give the labels the shape the module takes",
                source="loss",
            ) from None
        value = _sharp_value(reading, z, y, ignore_index)
    if value is None or not math.isfinite(float(expected)):
        return  # nothing labelled in the batch, or a non-finite loss (reported elsewhere)
    got, want = float(value), float(expected)
    rtol = _AGREEMENT.get(z.dtype, 1e-2)
    if abs(got - want) > rtol * max(1.0, abs(want)):
        raise UsageError(
            f"sharp's {reading.name} ({reading.layout}) gives {got:.10g} on the first batch "
            f"but {label} gives {want:.10g} on outputs {_shape(z)} and labels {_shape(y)}: "
            "not the loss handed in; name the loss (`loss`) that the module computes",
            source="loss",
        )
