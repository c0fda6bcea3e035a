"""Hugging Face causal language models: their labels and their own loss, as they define them.

A Hugging Face causal LM takes ``labels`` aligned with its inputs (``labels = input_ids``,
``-100`` where nothing is predicted) and shifts them inside: its ``forward(..., labels=y)``
returns ``loss`` = transformers' ``ForCausalLMLoss``,

    loss = (1/|V|) sum_{(i, t) in V} CE(logits[i, t], y[i, t + 1]),
    V = {(i, t): t < T - 1, y[i, t + 1] != -100},

the mean over every labelled (shifted) token of the batch (with ``num_items_in_batch`` given,
as the Trainer does under gradient accumulation, the sum over the batch divided by the
tokens of all accumulated batches: the mean over the whole set, which is sharp's
``token_reduction="tokens"``). sharp's ``token-cross-entropy`` compares output ``t`` with label
``t``, so the model's own loss is ``token-cross-entropy`` over the labels shifted once
(:func:`shift_token_labels`: label ``t + 1`` at ``t``, ``-100`` at the last position).

Whether a model is a causal LM is read from the model, never from the values of a batch
(:func:`causal_lm_name`): a ``transformers.PreTrainedModel`` whose class, or a class it
derives from, is one of transformers' causal-LM classes (its ``AutoModelForCausalLM``
registry, ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) or is named ``*ForCausalLM`` (transformers'
naming rule, which also picks ``ForCausalLMLoss`` as the model's ``loss_function``).

Labels already shifted by hand (label ``t`` is input ``t + 1`` wherever labelled, the last
position ``-100``: :func:`labels_shifted_by_hand`) give the same loss read as they are, so
they keep working unchanged. Other labels are shifted by the library, as the model's
``loss`` does (:func:`sharpcli.io.data.in_memory.own_loss_labels`); a data file's are refused naming
``shift_labels`` and ``loss``, where sharp read them as given before
(:func:`sharpcli.io.data.loading.apply_label_convention`). Whatever the reading, the value on the first batch is compared
with the model's own ``loss`` before anything is computed (:func:`check_model_own_loss`).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from sharpcli.errors import UsageError, first_line
from sharpcli.losses import IGNORE_INDEX, TOKEN_CROSS_ENTROPY, get_loss, token_reduction
from sharpcli.models.outputs import keyword_batch

__all__ = [
    "causal_lm_name",
    "check_model_own_loss",
    "check_own_loss_of_batch",
    "input_ids_of",
    "labels_shifted_by_hand",
    "model_labels",
    "own_loss_note",
    "shift_token_labels",
]

# relative agreement of sharp's loss and the model's: transformers computes its loss in float32
# (``logits.float()``), so the agreement is float32 rounding whatever the analysis dtype
_AGREEMENT = {torch.float64: 1e-9, torch.float32: 1e-4}


def causal_lm_name(model: nn.Module) -> str | None:
    """The class name of a Hugging Face causal LM (module docstring), or None for any other
    model. transformers is not imported here: a model of it means it is loaded already."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # a transformers without the registry: the naming rule alone
        registered: set[str] = set()
    else:
        registered = set()
        for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            registered.update((value,) if isinstance(value, str) else value)
    for cls in type(model).__mro__:
        if cls.__name__ in registered or cls.__name__.endswith("ForCausalLM"):
            return type(model).__name__
    return None


def input_ids_of(x: torch.Tensor, input_keys, input_shapes=None) -> torch.Tensor | None:
    """The input token ids of ``x`` (``input_ids`` of keyword inputs stacked on axis 1, or
    concatenated as ``input_shapes`` say, as a data file's
    :attr:`~sharpcli.io.data.dataset.Dataset.input_keys` name them), or None (float inputs,
    or keyword inputs without ``input_ids``)."""
    if x.is_floating_point():
        return None
    if input_keys is None:
        return x
    if "input_ids" not in input_keys:
        return None
    return keyword_batch(x, input_keys, input_shapes)["input_ids"]


def shift_token_labels(y: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction from labels aligned with the inputs: position ``t``
    gets label ``t + 1``, the last position ``-100`` (what a Hugging Face causal LM does with
    ``labels=input_ids``: ``logits[:, :-1]`` against ``labels[:, 1:]``)."""
    shifted = torch.full_like(y, IGNORE_INDEX)
    shifted[:, :-1] = y[:, 1:]
    return shifted


def model_labels(shifted: torch.Tensor) -> torch.Tensor:
    """The labels a Hugging Face causal LM takes for sharp's shifted labels ``shifted``: the
    inverse of :func:`shift_token_labels` (label ``t - 1`` at ``t``; position 0, which the
    model never predicts, ``-100``)."""
    labels = torch.full_like(shifted, IGNORE_INDEX)
    labels[:, 1:] = shifted[:, :-1]
    return labels


def labels_shifted_by_hand(ids: torch.Tensor | None, y: torch.Tensor) -> bool:
    """Whether token labels ``y`` (N, T) were shifted for next-token prediction already: the
    last position unlabelled (``-100``) and label ``t`` equal to input id ``t + 1`` wherever
    labelled. Read as they are, they give the causal LM's own loss of the unshifted labels."""
    if ids is None or ids.is_floating_point() or y.is_floating_point():
        return False
    if y.ndim != 2 or tuple(ids.shape) != tuple(y.shape) or y.shape[1] < 2:
        return False
    if not bool((y[:, -1] == IGNORE_INDEX).all()):
        return False
    head = y[:, :-1]
    labelled = head != IGNORE_INDEX
    following = ids[:, 1:].to(y.device)
    return bool(labelled.any()) and bool((head[labelled] == following[labelled]).all())


def own_loss_note(name: str, shifted_here: bool) -> str:
    """Where the loss came from when it is the model's own loss of the causal LM ``name``
    (the report's ``data.loss_reason``)."""
    how = (
        "the labels shifted as the model shifts them (label t + 1 at position t)"
        if shifted_here
        else "the labels as given, already shifted (label t is input t + 1)"
    )
    return (
        f"the model's own ({name}: token cross-entropy over {how}, -100 ignored, the mean over "
        "every labelled token), equal to the loss the model returns on the first batch"
    )


def _model_loss(model: nn.Module, inputs, labels: torch.Tensor) -> torch.Tensor:
    """``model(**inputs, labels=labels).loss`` (``inputs`` a dict, else the first positional
    input) in eval mode, without gradients and without the model's hooks."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            if isinstance(inputs, dict):
                out = model.forward(**inputs, labels=labels)
            else:
                out = model.forward(inputs, labels=labels)
    finally:
        for module, mode in modes:
            module.training = mode
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise UsageError(
            f"{type(model).__name__} returns no `loss` for labels; name the loss with `loss`",
            source="loss",
        )
    return loss


def check_model_own_loss(
    model: nn.Module, inputs, logits: torch.Tensor, shifted: torch.Tensor
) -> float:
    """Refuse unless sharp's ``token-cross-entropy`` of ``logits`` (N, T, V) against its shifted
    labels ``shifted`` (N, T) equals the causal LM's own ``loss`` on the same batch, called with
    the labels it takes (:func:`model_labels`); returns that loss.

    Args:
        model: The causal LM (its class's ``forward``, without the hooks sharp attaches).
        inputs: The batch's inputs: a dict of keyword inputs, or the input ids.
        logits: The model's logits on the batch.
        shifted: The labels sharp differentiates, one per output position.

    Raises:
        UsageError: (``loss``) the model cannot take the labels, returns no loss, or computes
            another loss (a ``loss_function`` of its own, another reduction).
    """
    try:
        own = _model_loss(model, inputs, model_labels(shifted).to(logits.device))
    except UsageError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise UsageError(
            f"{type(model).__name__} cannot compute its own loss on the first batch "
            f"({first_line(exc)}); name the loss with `loss`",
            source="loss",
        ) from None
    want = float(own)
    with torch.no_grad(), token_reduction("tokens", shifted):
        got = float(get_loss(TOKEN_CROSS_ENTROPY).mean(logits, shifted))
    if not math.isfinite(want):
        return want  # a non-finite loss is reported where it is met
    # the coarser of the two precisions (half-precision logits, transformers' float32 loss)
    rtol = max(_AGREEMENT.get(own.dtype, 1e-2), _AGREEMENT.get(logits.dtype, 1e-2))
    if abs(got - want) > rtol * max(1.0, abs(want)):
        raise UsageError(
            f"{type(model).__name__}'s own loss is {want:.10g} on the first batch but "
            f"{TOKEN_CROSS_ENTROPY} over its labels shifted as Hugging Face causal LMs shift "
            f"them is {got:.10g}: the model computes another loss; name it with `loss`",
            source="loss",
        )
    return want


def check_own_loss_of_batch(
    model: nn.Module, x: torch.Tensor, input_keys, shifted: torch.Tensor, reduction: str
) -> None:
    """:func:`check_model_own_loss` on a data file's first batch ``x`` (keyword inputs stacked
    on axis 1 as ``input_keys`` name them, or the ids), ``model(x)`` giving the logits through
    the hooks sharp attached; ``reduction`` ``"samples"`` is refused (UsageError on
    ``token_reduction``): the model's own loss is the mean over every labelled token."""
    if reduction == "samples":
        raise UsageError(
            f"{type(model).__name__}'s own loss is the mean over every labelled token; for the "
            f"mean of per-sample means name the loss: `loss={TOKEN_CROSS_ENTROPY}`",
            source="token_reduction",
        )
    inputs = keyword_batch(x, input_keys) if input_keys else x
    with torch.no_grad():
        logits = model(x)
    check_model_own_loss(model, inputs, logits, shifted[: x.shape[0]])
