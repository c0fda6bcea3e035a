"""In-memory data for :class:`sharpcli.api.Curvature`: batches read into one analysis set,
the model seen through a view that indexes it, and loss modules resolved to loss records.

``data`` is read once: ``(x, y)`` tensors, a ``dict`` of tensors (one batch: its label under
``labels`` or ``y``, every other key a keyword argument of ``model.forward``, or the keys
together one dict argument when ``forward(self, batch)`` takes them so), a
``DataLoader`` or any iterable of such batches; batches are concatenated in order
(:func:`collect_data`). The analysis set streamed by the curvature engine is the sample
*indices* ``0..N-1``, and :func:`model_on_data` gives the model a ``forward(index)`` that
runs its own ``forward`` on the indexed rows of the stored inputs.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from sharpcli.errors import UsageError
from sharpcli.io.torch_losses.causal_lm import (
    causal_lm_name,
    input_ids_of,
    labels_shifted_by_hand,
    own_loss_note,
    shift_token_labels,
)
from sharpcli.io.torch_losses.options import LOSS_MODULES, LossSpec, module_spec, parse_loss_spec
from sharpcli.io.torch_losses.readings import LossReading, read_loss
from sharpcli.losses import (
    CROSS_ENTROPY,
    IGNORE_INDEX,
    LOSSES,
    NLL,
    TOKEN_CROSS_ENTROPY,
    TOKEN_REDUCTIONS,
    get_loss,
)
from sharpcli.models.outputs import ONE_DICT, input_call_style, select_output

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "LABEL_KEYS",
    "LOSS_MODULES",
    "CollectedData",
    "apply_ignore_index",
    "collect_data",
    "loss_name",
    "loss_spec",
    "model_on_data",
    "own_loss_labels",
    "refuse_unshifted_labels",
    "resolve_loss",
    "to_device",
    "token_reduction_of",
]

LABEL_KEYS = ("labels", "y")  # where a dict batch keeps its labels
DEFAULT_BATCH_SIZE = 256  # tensors given whole: products batch them by this many samples


# --------------------------------------------------------------------------- data
class CollectedData:
    """The analysis set read from ``data``: positional inputs or keyword inputs, and labels."""

    def __init__(self, x, keywords: dict, y: torch.Tensor, batch_size: int):
        self.x = x  # a tensor, or None when the model takes keyword inputs
        self.keywords = keywords  # name -> tensor
        self.y = y
        self.batch_size = batch_size

    @property
    def num_samples(self) -> int:
        """N, the samples of the analysis set."""
        return int(self.y.shape[0])

    def select(self, keep: torch.Tensor) -> "CollectedData":
        """The samples where ``keep`` (bool, (N,)) is true."""
        x = None if self.x is None else self.x[keep]
        return CollectedData(
            x, {k: v[keep] for k, v in self.keywords.items()}, self.y[keep], self.batch_size
        )


def _batch_parts(batch, index: int) -> tuple:
    """``(x or None, keywords, y)`` of one batch; UsageError on ``data`` for any other shape."""
    where = "`data`" if index < 0 else f"batch {index} of `data`"
    if isinstance(batch, Mapping):
        found = [key for key in LABEL_KEYS if key in batch]
        if len(found) != 1:
            keys = ", ".join(map(str, batch)) or "none"
            problem = "both" if found else "neither"
            raise UsageError(
                f"{where} is a dict with {problem} of the label keys `labels` and `y` (keys: "
                f"{keys}); put the labels under exactly one of them",
                source="data",
            )
        inputs = {k: v for k, v in batch.items() if k != found[0]}
        return None, _tensor_inputs(inputs, where), _tensor(batch[found[0]], where, found[0])
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        if isinstance(x, Mapping):
            return None, _tensor_inputs(x, where), _tensor(y, where, "y")
        return _tensor(x, where, "x"), {}, _tensor(y, where, "y")
    raise UsageError(
        f"{where} is a {type(batch).__name__}; expected (x, y) tensors, (dict of inputs, y) or a "
        "dict of inputs with its labels under `labels` or `y`",
        source="data",
    )


def _tensor(value, where: str, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise UsageError(
            f"{where}: `{name}` is a {type(value).__name__}, not a tensor", source="data"
        )
    if value.ndim == 0:
        raise UsageError(
            f"{where}: `{name}` is a scalar; a batch holds one row per sample (a Dataset of "
            "single samples goes through DataLoader(dataset, batch_size=...))",
            source="data",
        )
    return value


def _tensor_inputs(inputs: Mapping, where: str) -> dict:
    if not inputs:
        raise UsageError(f"{where} has labels but no inputs", source="data")
    return {str(k): _tensor(v, where, str(k)) for k, v in inputs.items()}


def _batches(data) -> tuple[list, bool]:
    """The batches of ``data`` as a list, and whether ``data`` was one batch given whole."""
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    if isinstance(data, torch.Tensor):
        raise UsageError(
            "`data` is one tensor; pass the inputs with their labels, (x, y)", source="data"
        )
    columns = _hugging_face_columns(data)
    if columns is not None:
        return [columns], True
    if isinstance(data, Mapping):
        return [data], True
    if isinstance(data, (tuple, list)) and len(data) == 2:
        if isinstance(data[1], torch.Tensor) and isinstance(data[0], (torch.Tensor, Mapping)):
            return [tuple(data)], True
    if isinstance(data, Dataset) and not isinstance(data, (DataLoader, IterableDataset)):
        raise UsageError(
            f"`data` is a {type(data).__name__} of single samples; batch it: "
            "DataLoader(dataset, batch_size=64)",
            source="data",
        )
    try:
        iterator = iter(data)
    except TypeError:
        raise UsageError(
            f"`data` is a {type(data).__name__}; expected (x, y) tensors, a dict of tensors, a "
            "DataLoader or an iterable of batches",
            source="data",
        ) from None
    batches = list(iterator)
    if not batches:
        raise UsageError("`data` holds no batches", source="data")
    return batches, False


def _hugging_face_columns(data) -> dict | None:
    """A Hugging Face ``datasets.Dataset`` as one dict batch, its columns as tensors (the
    rows a ``DataLoader`` over it would collate; its labels under ``labels`` or ``y``), or None
    for any other ``data``. Iterating it would give single rows, which are not batches."""
    datasets = sys.modules.get("datasets")
    if datasets is None:
        return None
    # the classes by name: a module of that name without them is not Hugging Face's
    dataset_dict, dataset = (
        getattr(datasets, "DatasetDict", None),
        getattr(datasets, "Dataset", None),
    )
    if dataset_dict is not None and isinstance(data, dataset_dict):
        raise UsageError(
            f"`data` is a DatasetDict with the splits {', '.join(data)}; pass one split, "
            "data['train']",
            source="data",
        )
    if dataset is None or not isinstance(data, dataset):
        return None
    if len(data) == 0:
        raise UsageError("`data` holds no samples", source="data")
    columns = data.with_format("torch")[:]
    for name, column in columns.items():
        if not isinstance(column, torch.Tensor):
            raise UsageError(
                f"`data` column {name!r} is not one tensor (strings, or rows of unequal length); "
                "keep the model's columns (dataset.select_columns) padded to one length",
                source="data",
            )
    return dict(columns)


def _concatenate(parts: list, name: str) -> torch.Tensor:
    """``torch.cat`` of one input over the batches; UsageError naming the first mismatch."""
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if part.shape[1:] != first.shape[1:] or part.dtype != first.dtype:
            raise UsageError(
                f"batch {i} of `data` has `{name}` of shape {tuple(part.shape)} "
                f"({part.dtype}) but batch 0 {tuple(first.shape)} ({first.dtype}); the batches "
                "are concatenated, so pad every batch to one length (with an attention mask)",
                source="data",
            )
    return torch.cat([p.to(first.device) for p in parts]) if len(parts) > 1 else first


def _check_parts_agree(parts: list, whole: bool) -> None:
    """UsageError on ``data`` unless every batch gives its inputs the same way (one tensor or
    by name), with the same names, and as many samples in each input as in its labels."""
    positional = [p[0] is not None for p in parts]
    if any(positional) and not all(positional):
        raise UsageError(
            f"batch {positional.index(not positional[0])} of `data` gives the inputs "
            f"{'as one tensor' if not positional[0] else 'by name'} but batch 0 "
            f"{'as one tensor' if positional[0] else 'by name'}",
            source="data",
        )
    names = list(parts[0][1])
    for i, (x, keywords, y) in enumerate(parts):
        if set(keywords) != set(names):
            raise UsageError(
                f"batch {i} of `data` has the inputs {', '.join(keywords)} but batch 0 "
                f"{', '.join(names)}",
                source="data",
            )
        tensors = [*keywords.values(), y] + ([] if x is None else [x])
        sizes = {int(t.shape[0]) for t in tensors}
        if len(sizes) > 1:
            where = "`data`" if whole else f"batch {i} of `data`"
            raise UsageError(
                f"{where}: inputs and labels hold different numbers of samples "
                f"({', '.join(str(s) for s in sorted(sizes))})",
                source="data",
            )


def collect_data(data, batch_size: int | None = None) -> CollectedData:
    """Read ``data`` (module docstring) into one analysis set.

    Args:
        data: ``(x, y)``, a dict batch, a DataLoader or an iterable of batches.
        batch_size: Samples per product batch; None: a loader's largest batch, or
            :data:`DEFAULT_BATCH_SIZE` for data given whole.

    Returns:
        The analysis set, batches concatenated in order.

    Raises:
        UsageError: On ``data`` if it cannot be one set (an unknown batch shape, inputs that
            differ between batches, sample counts that disagree, no samples).
    """
    batches, whole = _batches(data)
    parts = [_batch_parts(b, -1 if whole else i) for i, b in enumerate(batches)]
    _check_parts_agree(parts, whole)
    positional = [p[0] is not None for p in parts]
    names = list(parts[0][1])
    x = _concatenate([p[0] for p in parts], "x") if positional[0] else None
    keywords = {n: _concatenate([p[1][n] for p in parts], n) for n in names}
    y = _concatenate([p[2] for p in parts], "labels")
    if y.shape[0] == 0:
        raise UsageError("`data` holds no samples", source="data")
    if batch_size is None:
        largest = max(int(p[2].shape[0]) for p in parts)
        batch_size = min(int(y.shape[0]), DEFAULT_BATCH_SIZE) if whole else largest
    return CollectedData(x, keywords, y, batch_size)


# --------------------------------------------------------------------------- the model view
if TYPE_CHECKING:  # the mixin's methods see the model's (it comes before an nn.Module's class)
    _MixedIntoModule = nn.Module
else:
    _MixedIntoModule = object


class _IndexedInputs(_MixedIntoModule):
    """Mixed in before the model's class: ``forward(index)`` runs the model's own ``forward``
    on rows ``index`` of the stored inputs and returns the logits tensor."""

    # set on each view by model_on_data
    _sharp_positional: torch.Tensor | None
    _sharp_keywords: dict[str, torch.Tensor]
    _sharp_call_style: str
    _sharp_layout: LossReading | None

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        """The model's logits on the samples ``index`` of the analysis set."""
        # floating inputs follow the parameters (a float64 copy of the view gets float64 rows)
        dtype = next(iter(self.parameters())).dtype

        def rows(tensor: torch.Tensor) -> torch.Tensor:
            taken = tensor[index]
            return taken.to(dtype) if taken.is_floating_point() else taken

        args: tuple = () if self._sharp_positional is None else (rows(self._sharp_positional),)
        kwargs = {name: rows(tensor) for name, tensor in self._sharp_keywords.items()}
        if self._sharp_call_style == ONE_DICT:  # forward(self, batch): the dict as one argument
            args, kwargs = (kwargs,), {}
        logits = select_output(super().forward(*args, **kwargs))
        return logits if self._sharp_layout is None else self._sharp_layout.outputs(logits)


_VIEW_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _view_class(cls: type[nn.Module]) -> type[nn.Module]:
    view = _VIEW_CLASSES.get(cls)
    if view is None:
        view = type(f"{cls.__name__}OnData", (_IndexedInputs, cls), {"__module__": __name__})
        _VIEW_CLASSES[cls] = view
    return view


def model_on_data(
    model: nn.Module, x, keywords: dict, layout: LossReading | None = None
) -> nn.Module:
    """A view of ``model`` (its modules, parameters and buffers, not copies) whose
    ``forward(index)`` is ``logits(model(x[index], **{k: v[index]}))``, laid out as the loss
    ``layout`` reads them (:meth:`LossReading.outputs`; None: as they are). Keyword inputs
    reach a ``forward`` that takes the batch dict as its one argument as that dict,
    ``model({k: v[index]})``, as its signature says (:func:`sharpcli.models.outputs.input_call_style`).

    The view is an instance of a subclass of ``type(model)`` sharing ``model``'s attributes
    (shallow), so parameter names, ``functional_call`` and ``torch.func`` see the model's own;
    its ``training`` flag is its own (the root's, as :func:`eval_mode` on the view sets it)."""
    view_class = _view_class(type(model))
    view = view_class.__new__(view_class)
    view.__dict__.update(model.__dict__)
    # a forward patched onto the instance (accelerate's mixed-precision wrapper in a Hugging
    # Face Trainer) would shadow the view's; the view calls the class's own forward
    view.__dict__.pop("forward", None)
    object.__setattr__(view, "_sharp_positional", x)
    object.__setattr__(view, "_sharp_keywords", dict(keywords))
    style = None
    if x is None and keywords:  # the view runs the class's forward: its signature decides
        style = input_call_style(type(model).forward.__get__(model), tuple(keywords))
    object.__setattr__(view, "_sharp_call_style", style)
    object.__setattr__(view, "_sharp_layout", layout if layout and layout.reshapes else None)
    return view


def to_device(tensor: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """On ``device``; floating tensors in ``dtype``, integer and bool ones unchanged."""
    if tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


# --------------------------------------------------------------------------- losses
def loss_spec(loss) -> LossSpec:
    """The loss and its options: a module's (:func:`sharpcli.io.torch_losses.options.module_spec`) or
    a spec's ``NAME[:k=v,...]`` (:func:`sharpcli.io.torch_losses.options.parse_loss_spec`).

    Raises:
        UsageError: (``loss``) an unsupported module or option, an unknown name.
    """
    if isinstance(loss, str):
        return parse_loss_spec(loss)
    return module_spec(loss)


def loss_name(loss) -> tuple[str, int | None]:
    """``(loss name, ignore_index or None)`` for a loss module or a spec.

    ``nn.CrossEntropyLoss`` is ``cross-entropy`` (whose reading of the outputs' shape,
    classes on dim 1 or a language model's classes last, is
    :func:`sharpcli.io.torch_losses.readings.read_loss`'s), ``nn.NLLLoss`` ``nll``,
    ``nn.BCEWithLogitsLoss`` ``binary-cross-entropy``, ``nn.MSELoss`` ``mse``,
    ``nn.HuberLoss`` ``huber``, ``nn.SmoothL1Loss`` ``smooth-l1``; their options are
    :func:`loss_spec`'s. Refused clearly: ``reduction="none"``, other modules.
    """
    spec = loss_spec(loss)
    if spec.name not in (CROSS_ENTROPY, NLL):
        return spec.name, None
    if isinstance(loss, str) and "ignore_index" not in dict(spec.options):
        return spec.name, None  # a name: labels -100 are the token loss's own marker
    return spec.name, int(spec.get("ignore_index"))


def resolve_loss(loss, logits: torch.Tensor, y: torch.Tensor) -> tuple[LossReading, int | None]:
    """How sharp reads the loss ``loss`` (a module or a name) on outputs ``logits`` and labels
    ``y`` (:func:`sharpcli.io.torch_losses.readings.read_loss`; a name is one the user chose), and the
    module's ``ignore_index``.

    Args:
        loss: A loss module or a registered name.
        logits: The model's outputs on the first rows of the set.
        y: Their labels.

    Returns:
        The reading and the ``ignore_index`` (None but for ``nn.CrossEntropyLoss``).
    """
    name, ignore_index = loss_name(loss)
    regression = (nn.MSELoss, nn.HuberLoss, nn.SmoothL1Loss)
    if isinstance(loss, regression) and tuple(y.shape) != tuple(logits.shape):
        raise UsageError(
            f"targets of shape {tuple(y.shape)} for outputs {tuple(logits.shape)}: "
            f"nn.{type(loss).__name__} would broadcast them into another loss; give the "
            f"targets the outputs' shape (or pass `loss={name}`, which takes one target per "
            "sample of one output)",
            source="data",
        )
    module = isinstance(loss, nn.Module)
    return read_loss(name, logits, y, named=not module, module=module), ignore_index


def apply_ignore_index(collected: CollectedData, name: str, ignore_index: int | None):
    """Honour ``nn.CrossEntropyLoss(ignore_index=i)``: ``(1/|V|) sum_{j in V} l_j`` over the
    labelled entries ``V``.

    Per sample (``cross-entropy``) the samples labelled ``i`` are left out of the set, so the
    analysis mean is over the others. Per position (``token-cross-entropy``) the positions
    labelled ``i`` are the ones the loss ignores (relabelled ``-100``, the loss's marker); the
    module's mean over every labelled token of the set is the token loss averaged over tokens
    (:func:`sharpcli.losses.set_token_reduction`), whatever each sample's count.
    """
    y = collected.y
    if ignore_index is None or y.is_floating_point():
        return collected
    loss = get_loss(name)
    if loss.softmax_per_sample and y.ndim == 1:
        keep = y != ignore_index
        if not bool(keep.any()):
            raise UsageError(
                f"every label of `data` is the loss's ignore_index {ignore_index}", source="data"
            )
        return collected if bool(keep.all()) else collected.select(keep)
    if loss.per_token and y.ndim == 2:
        if ignore_index != IGNORE_INDEX:
            y = torch.where(y == ignore_index, torch.full_like(y, IGNORE_INDEX), y)
            collected = CollectedData(collected.x, collected.keywords, y, collected.batch_size)
        if not bool((y != IGNORE_INDEX).any()):
            raise UsageError(
                f"every label of `data` is the loss's ignore_index {ignore_index}", source="data"
            )
    return collected


def refuse_unshifted_labels(collected: CollectedData, name: str) -> None:
    """Token labels equal to the token inputs: a causal LM's labels before the shift that
    Hugging Face models make inside (their loss compares output t with label t + 1); sharp
    compares output t with label t, so the curvature would be that of copying the input."""
    if not get_loss(name).per_token:
        return
    y = collected.y
    inputs = [collected.x] if collected.x is not None else list(collected.keywords.values())
    labelled = y != IGNORE_INDEX
    for tensor in inputs:
        if tensor.shape == y.shape and not tensor.is_floating_point():
            if bool(labelled.any()) and bool((tensor.to(y.device) == y)[labelled].all()):
                raise UsageError(
                    "the labels of `data` equal its token inputs (a causal LM's labels before "
                    "the shift Hugging Face models make inside); sharp compares output t with "
                    "label t: pass labels = input_ids[:, 1:] with -100 appended, or "
                    "labels[:, :-1] = input_ids[:, 1:] and labels[:, -1] = -100 (a Hugging "
                    "Face causal LM's own loss, which shifts them, is used when `loss` is left "
                    "out)",
                    source="data",
                )


def token_reduction_of(loss, name: str, reduction: str | None) -> str | None:
    """How a token loss averages (None for the other losses): ``reduction``, by default
    ``"tokens"``; a loss module's mean is the mean over all labelled tokens, so ``"samples"``
    with a module is refused (UsageError on ``token_reduction``)."""
    if reduction is not None and reduction not in TOKEN_REDUCTIONS:
        raise UsageError(
            f"unknown token reduction {reduction!r}; accepted: {', '.join(TOKEN_REDUCTIONS)}",
            source="token_reduction",
        )
    if not get_loss(name).per_token:
        return None
    named = isinstance(loss, str) and get_loss(loss_spec(loss).name).per_token
    if reduction == "samples" and not named:
        what = f"{type(loss).__name__}()" if isinstance(loss, nn.Module) else repr(loss)
        raise UsageError(
            f"{what} averages over every labelled position of the set; for the "
            "mean of per-sample means pass loss='token-cross-entropy' with "
            "token_reduction='samples'",
            source="token_reduction",
        )
    return reduction or "tokens"


def own_loss_labels(
    model: nn.Module, collected: CollectedData, reduction: str | None
) -> tuple[str, CollectedData, str]:
    """No loss given: a Hugging Face causal LM's own loss (:mod:`sharpcli.io.torch_losses.causal_lm`).

    The labels of ``data`` are Hugging Face's, aligned with the inputs and shifted by the model;
    sharp's ``token-cross-entropy`` over them shifted once is the model's ``loss``. Labels
    already shifted by hand (label ``t`` is input ``t + 1``, the last position ``-100``) give
    that loss as they are and are kept.

    Args:
        model: The model handed in.
        collected: The analysis set, its labels as given.
        reduction: The ``token_reduction`` argument: the model's loss is the mean over every
            labelled token, so ``"samples"`` is refused.

    Returns:
        ``token-cross-entropy``, the set with the labels the loss compares output ``t`` with,
        and the note saying the loss is the model's own.

    Raises:
        UsageError: (``loss``) the model is not a causal LM; (``token_reduction``)
            ``"samples"``; (``data``) labels that are not one token per position, or none
            labelled once shifted.
    """
    name = causal_lm_name(model)
    if name is None:
        raise UsageError(
            f"no loss given, and {type(model).__name__} is not a Hugging Face causal LM whose own "
            f"loss sharp reads; pass `loss`: a loss module ({LOSS_MODULES}) or a name "
            f"({', '.join(LOSSES)})",
            source="loss",
        )
    if reduction == "samples":
        raise UsageError(
            f"{name}'s own loss is the mean over every labelled token; for the mean of "
            "per-sample means pass loss='token-cross-entropy' with token_reduction='samples'",
            source="token_reduction",
        )
    y = collected.y
    if y.is_floating_point() or y.ndim != 2:
        raise UsageError(
            f"labels of shape {tuple(y.shape)} ({y.dtype}): {name}'s own loss takes token labels "
            "(N, T), one per input position; pass `loss` for other labels",
            source="data",
        )
    ids = collected.x if collected.x is not None else collected.keywords.get("input_ids")
    ids = None if ids is None else input_ids_of(ids, None)
    if labels_shifted_by_hand(ids, y):
        return TOKEN_CROSS_ENTROPY, collected, own_loss_note(name, shifted_here=False)
    shifted = shift_token_labels(y)
    if not bool((shifted != IGNORE_INDEX).any()):
        raise UsageError(
            f"no label of `data` is left once shifted as {name} shifts them (every label but "
            "the first of each row is -100)",
            source="data",
        )
    labelled = CollectedData(collected.x, collected.keywords, shifted, collected.batch_size)
    return TOKEN_CROSS_ENTROPY, labelled, own_loss_note(name, shifted_here=True)
