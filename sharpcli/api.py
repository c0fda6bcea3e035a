"""``Curvature``: the in-memory entry, a model, a loss and data in, the library's results out.

The one object a notebook needs (docs/api.md; docs/from-pyhessian.md maps PyHessian's calls)::

    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    curvature.eigenvalues(k=3).eigenvalues      # top-3 Hessian eigenvalues
    curvature.trace().estimate                  # tr(H) by [Hutch++]

Everything is about the mean loss over the samples of ``data``,
``L(theta) = (1/N) sum_i l(f(theta, x_i), y_i)`` (the analysis loss of
:mod:`sharpcli.curvature.data`), at the model's current weights, in eval mode (dropout off,
BatchNorm on running statistics, as [PyHessian] does): every method switches the model to
eval mode for its products and restores each module's mode afterwards.

``data`` is read once and kept on the analysis device: ``(x, y)`` tensors, a ``dict`` of
tensors (one batch: its label under ``labels`` or ``y``, every other key a keyword argument
of ``model.forward``, as Hugging Face models take ``input_ids`` and ``attention_mask``), a
``DataLoader`` or any iterable of such batches (``(x, y)``, ``(dict, y)`` or dicts). Batches
are concatenated in order, so the result does not depend on how they were batched; a
shuffling loader gives the same numbers.

How the inputs reach the model: the analysis set streamed by
:class:`~sharpcli.curvature.AnalysisData` is the sample *indices* ``0..N-1``, and the model is
seen through a view of itself (the same modules and parameters, the same parameter names)
whose ``forward(index)`` calls the model's own ``forward`` on the indexed rows of the stored
inputs, positional or keyword, and returns its logits (``.logits`` of an output object, the
first tensor of a tuple: :func:`sharpcli.models.outputs.select_output`). The curvature
engine, its sharding under ``torch.distributed`` and every estimator work unchanged on it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import torch
from torch import nn

from sharpcli.curvature import CurvatureOperator
from sharpcli.errors import UsageError

__all__ = ["Curvature", "LABEL_KEYS", "Tracker"]

LABEL_KEYS = ("labels", "y")  # where a dict batch keeps its labels
DEFAULT_BATCH_SIZE = 256  # tensors given whole: products batch them by this many samples
_LOSS_MODULES = "nn.CrossEntropyLoss, nn.BCEWithLogitsLoss, nn.MSELoss"


# --------------------------------------------------------------------------- data
class _Collected:
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

    def select(self, keep: torch.Tensor) -> "_Collected":
        """The samples where ``keep`` (bool, (N,)) is true."""
        x = None if self.x is None else self.x[keep]
        return _Collected(
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


def collect_data(data, batch_size: int | None = None) -> _Collected:
    """Read ``data`` (module docstring) into one analysis set; UsageError on ``data`` if it
    cannot be one (an unknown batch shape, inputs that differ between batches, sample counts
    that disagree)."""
    batches, whole = _batches(data)
    parts = [_batch_parts(b, -1 if whole else i) for i, b in enumerate(batches)]
    positional = [p[0] is not None for p in parts]
    if any(positional) and not all(positional):
        raise UsageError(
            f"batch {positional.index(not positional[0])} of `data` gives the inputs "
            f"{'as one tensor' if not positional[0] else 'by name'} but batch 0 "
            f"{'as one tensor' if positional[0] else 'by name'}",
            source="data",
        )
    names = list(parts[0][1])
    for i, p in enumerate(parts):
        if set(p[1]) != set(names):
            raise UsageError(
                f"batch {i} of `data` has the inputs {', '.join(p[1])} but batch 0 "
                f"{', '.join(names)}",
                source="data",
            )
        sizes = {tuple(t.shape[:1]) for t in p[1].values()} | {tuple(p[2].shape[:1])}
        if p[0] is not None:
            sizes.add(tuple(p[0].shape[:1]))
        if len(sizes) > 1:
            where = "`data`" if whole else f"batch {i} of `data`"
            raise UsageError(
                f"{where}: inputs and labels hold different numbers of samples "
                f"({', '.join(str(s[0]) for s in sorted(sizes))})",
                source="data",
            )
    x = _concatenate([p[0] for p in parts], "x") if positional[0] else None
    keywords = {n: _concatenate([p[1][n] for p in parts], n) for n in names}
    y = _concatenate([p[2] for p in parts], "labels")
    if y.shape[0] == 0:
        raise UsageError("`data` holds no samples", source="data")
    if batch_size is None:
        largest = max(int(p[2].shape[0]) for p in parts)
        batch_size = min(int(y.shape[0]), DEFAULT_BATCH_SIZE) if whole else largest
    return _Collected(x, keywords, y, batch_size)


# --------------------------------------------------------------------------- the model view
class _IndexedInputs:
    """Mixed in before the model's class: ``forward(index)`` runs the model's own ``forward``
    on rows ``index`` of the stored inputs and returns the logits tensor."""

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        """The model's logits on the samples ``index`` of the analysis set."""
        from sharpcli.models.outputs import select_output

        # floating inputs follow the parameters (a float64 copy of the view gets float64 rows)
        dtype = next(iter(self.parameters())).dtype

        def rows(tensor: torch.Tensor) -> torch.Tensor:
            taken = tensor[index]
            return taken.to(dtype) if taken.is_floating_point() else taken

        args = () if self._sharp_positional is None else (rows(self._sharp_positional),)
        kwargs = {name: rows(tensor) for name, tensor in self._sharp_keywords.items()}
        return select_output(super().forward(*args, **kwargs))


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(cls: type) -> type:
    view = _VIEW_CLASSES.get(cls)
    if view is None:
        view = type(f"{cls.__name__}OnData", (_IndexedInputs, cls), {"__module__": __name__})
        _VIEW_CLASSES[cls] = view
    return view


def model_on_data(model: nn.Module, x, keywords: dict) -> nn.Module:
    """A view of ``model`` (its modules, parameters and buffers, not copies) whose
    ``forward(index)`` is ``logits(model(x[index], **{k: v[index]}))``.

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
    return view


def _to_device(tensor: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """On ``device``; floating tensors in ``dtype``, integer and bool ones unchanged."""
    if tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


@contextlib.contextmanager
def analysis_mode(model: nn.Module):
    """:func:`eval_mode` and :func:`~sharpcli.curvature.differentiable.twice_differentiable`
    (SDPA on its math kernel, the MHA fast path off, ...: the layers' double backward),
    as the ``sharp`` commands run."""
    from sharpcli.curvature.differentiable import twice_differentiable

    with eval_mode(model), twice_differentiable():
        yield model


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """``model`` in eval mode inside the block; every module's own mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``nn.DataParallel``, ``DistributedDataParallel`` and ``torch.compile``
    wrappers (their parameter names carry ``module.`` or ``_orig_mod.``; curvature is taken
    through the plain module, whose forward is twice differentiable)."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


# --------------------------------------------------------------------------- losses
def _check_reduction(loss: nn.Module) -> None:
    reduction = getattr(loss, "reduction", "mean")
    if reduction != "mean":
        raise UsageError(
            f"{type(loss).__name__}(reduction={reduction!r}): curvature is taken of the mean "
            "loss over samples; use reduction='mean' (multiply the results by N for the sum)",
            source="loss",
        )


def _refuse_attribute(loss: nn.Module, name: str, default) -> None:
    value = getattr(loss, name, default)
    if value is not default and not (isinstance(value, float) and value == default):
        raise UsageError(
            f"{type(loss).__name__}({name}=...) is not supported: sharp's losses have no "
            f"`{name}`; leave it at its default",
            source="loss",
        )


def loss_name(loss, logits: torch.Tensor) -> tuple[str, int | None]:
    """``(registered loss name, ignore_index or None)`` for a loss module or name.

    ``nn.CrossEntropyLoss`` is ``cross-entropy`` on (batch, classes) logits and
    ``token-cross-entropy`` on (batch, length, vocabulary) logits (classes on the last axis,
    as ``loss(logits.view(-1, V), labels.view(-1))``); ``nn.BCEWithLogitsLoss`` is
    ``binary-cross-entropy``, ``nn.MSELoss`` ``mse``. Refused clearly: another reduction than
    the mean, class weights, ``pos_weight``, label smoothing, other modules.
    """
    from sharpcli.losses import LOSSES, get_loss

    if isinstance(loss, str):
        return get_loss(loss).name, None
    if isinstance(loss, nn.CrossEntropyLoss):
        _check_reduction(loss)
        _refuse_attribute(loss, "weight", None)
        _refuse_attribute(loss, "label_smoothing", 0.0)
        name = "token-cross-entropy" if logits.ndim == 3 else "cross-entropy"
        return name, int(loss.ignore_index)
    if isinstance(loss, nn.BCEWithLogitsLoss):
        _check_reduction(loss)
        _refuse_attribute(loss, "weight", None)
        _refuse_attribute(loss, "pos_weight", None)
        return "binary-cross-entropy", None
    if isinstance(loss, nn.MSELoss):
        _check_reduction(loss)
        return "mse", None
    raise UsageError(
        f"{type(loss).__name__} is not a supported loss; pass one of {_LOSS_MODULES} or a name: "
        f"{', '.join(LOSSES)}",
        source="loss",
    )


def _apply_ignore_index(collected: _Collected, name: str, ignore_index: int | None):
    """Honour ``nn.CrossEntropyLoss(ignore_index=i)``: ``(1/|V|) sum_{j in V} l_j`` over the
    labelled entries ``V``.

    Per sample (``cross-entropy``) the samples labelled ``i`` are left out of the set, so the
    analysis mean is over the others. Per position (``token-cross-entropy``) the positions
    labelled ``i`` are the ones the loss ignores (relabelled ``-100``, the loss's marker); the
    loss module averages over every labelled token of the set while ``token-cross-entropy``
    averages each sample over its positions, then over samples, which agree when every sample
    has as many labelled positions, and the data is refused otherwise.
    """
    from sharpcli.losses import IGNORE_INDEX

    y = collected.y
    if ignore_index is None or y.is_floating_point():
        return collected
    if name == "cross-entropy" and y.ndim == 1:
        keep = y != ignore_index
        if not bool(keep.any()):
            raise UsageError(
                f"every label of `data` is the loss's ignore_index {ignore_index}", source="data"
            )
        return collected if bool(keep.all()) else collected.select(keep)
    if name == "token-cross-entropy" and y.ndim == 2:
        if ignore_index != IGNORE_INDEX:
            y = torch.where(y == ignore_index, torch.full_like(y, IGNORE_INDEX), y)
            collected = _Collected(collected.x, collected.keywords, y, collected.batch_size)
        counts = (y != IGNORE_INDEX).sum(1)
        if int(counts.min()) != int(counts.max()):
            raise UsageError(
                "nn.CrossEntropyLoss averages over every labelled position of the set, but the "
                f"samples of `data` have between {int(counts.min())} and {int(counts.max())} "
                "labelled positions, and sharp's token loss (each sample's mean over its "
                "positions, then the mean over samples) would not be that loss; pass "
                "`loss=token-cross-entropy` to analyse the per-sample mean",
                source="loss",
            )
    return collected


def _refuse_unshifted_labels(collected: _Collected, name: str) -> None:
    """Token labels equal to the token inputs: a causal LM's labels before the shift that
    Hugging Face models make inside (their loss compares output t with label t + 1); sharp
    compares output t with label t, so the curvature would be that of copying the input."""
    from sharpcli.losses import IGNORE_INDEX

    if name != "token-cross-entropy":
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
                    "labels[:, :-1] = input_ids[:, 1:] and labels[:, -1] = -100",
                    source="data",
                )


def _resolve_dtype(dtype, model_dtype: torch.dtype) -> torch.dtype:
    if dtype is None:
        return model_dtype
    if isinstance(dtype, str):
        from sharpcli.preflight import resolve_dtype

        return resolve_dtype(dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UsageError(
            f"expected a floating torch dtype or 'float32'/'float64', got {dtype!r}",
            source="dtype",
        )
    return dtype


def _resolve_device(device, model_device: torch.device) -> torch.device:
    if device is None:
        return model_device
    from sharpcli.preflight import resolve_device

    return resolve_device(str(device))


# --------------------------------------------------------------------------- Curvature
class Curvature:
    """Curvature of ``loss`` over ``data`` at ``model``'s weights: eigenvalues, traces, density,
    the Gauss-Newton/NME split and the matrix-free products themselves.

    - ``model``: an ``nn.Module``; its output is the logits tensor, an output object with
      ``.logits`` or a tuple whose first tensor is the logits. Used as it is (its parameters
      are the ones differentiated), except that ``device``/``dtype`` other than its own make a
      converted copy (``copy.deepcopy(model).to(device, dtype)``) taken here, leaving ``model``
      untouched (and later changes to its weights unseen).
    - ``loss``: ``nn.CrossEntropyLoss()`` (``ignore_index`` honoured), ``nn.BCEWithLogitsLoss()``,
      ``nn.MSELoss()``, all with ``reduction='mean'``, or a registered loss name
      (``"cross-entropy"``, ``"mse"``, ``"binary-cross-entropy"``, ``"token-cross-entropy"``).
    - ``data``: ``(x, y)``, a dict of tensors with ``labels`` (or ``y``), a DataLoader or an
      iterable of batches (module docstring).
    - ``params``: ``None`` (every trainable parameter), ``"last"`` (the last ``nn.Linear``) or
      comma-separated globs on parameter names (``"fc.*,head.weight"``).
    - ``batch_size``: samples per product batch (memory only: the results are means over
      samples); default a DataLoader's batch size, or 256 for tensors.

    Before anything is computed, a forward pass over the set (no gradients) checks that the
    model takes every input and that the loss fits its outputs and the labels, and one
    Hessian-vector product is compared with a difference of gradients in float64 on 8
    samples (the model's layers differentiate twice correctly;
    :func:`sharpcli.preflight.check_second_derivatives`). Errors are
    :class:`~sharpcli.errors.UsageError` naming the argument (``error.source``).

    >>> import torch
    >>> from torch import nn
    >>> from sharpcli import Curvature
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    >>> x, y = torch.randn(32, 4, dtype=torch.float64), torch.randint(0, 3, (32,))
    >>> curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    >>> H = curvature.operator().to_dense()          # 67 x 67, product by product
    >>> top = curvature.eigenvalues(k=2, tol=1e-8)
    >>> exact = torch.linalg.eigvalsh(H)              # ascending
    >>> torch.allclose(torch.tensor(top.eigenvalues, dtype=H.dtype), exact[-2:].flip(0))
    True
    >>> abs(curvature.trace(estimator="hutchpp", tol=1e-3).estimate - H.trace().item()) < 0.05
    True
    """

    def __init__(
        self,
        model: nn.Module,
        loss,
        data,
        *,
        params: str | None = None,
        device=None,
        dtype=None,
        batch_size: int | None = None,
    ):
        from sharpcli.curvature import AnalysisData, CurvaturePass, ParamScope

        if not isinstance(model, nn.Module):
            raise UsageError(f"expected an nn.Module, got {type(model).__name__}", source="model")
        model = unwrap(model)
        first = next(iter(model.parameters()), None)
        if first is None:
            raise UsageError("the model has no parameters", source="model")
        if batch_size is not None:
            _integer(batch_size, "batch_size")
        self.dtype = _resolve_dtype(dtype, first.dtype)
        self.device = _resolve_device(device, first.device)
        if self.dtype != first.dtype or self.device != first.device:
            import copy

            model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype)
        self.model = model
        collected = collect_data(data, batch_size)
        self.loss, collected = self._loss_and_data(loss, collected)
        self.num_samples = collected.num_samples
        self.batch_size = collected.batch_size
        self._view = self._on_data(collected)
        self._check_forward()
        self._self_check(collected)
        index = torch.arange(self.num_samples)
        self.data = AnalysisData(index, collected.y, self.loss, self.batch_size)
        self.scope = ParamScope.resolve(self._view, params)
        self.curvature_pass = CurvaturePass(self._view, self.data, self.scope)

    # ----------------------------------------------------------------- set-up
    def _on_data(self, collected: _Collected, rows: int | None = None) -> nn.Module:
        """The model view on (the first ``rows`` of) the analysis set, on the analysis device."""
        take = slice(None) if rows is None else slice(0, rows)
        x = None
        if collected.x is not None:
            x = _to_device(collected.x[take], self.dtype, self.device)
        keywords = {
            k: _to_device(v[take], self.dtype, self.device) for k, v in collected.keywords.items()
        }
        return model_on_data(self.model, x, keywords)

    def _loss_and_data(self, loss, collected: _Collected) -> tuple[str, _Collected]:
        """The loss name for the model's outputs, and the data with ignored labels applied."""
        from sharpcli.losses import get_loss

        if not isinstance(loss, (str, nn.Module)):
            raise UsageError(
                f"expected a loss module ({_LOSS_MODULES}) or a name, got {type(loss).__name__}",
                source="loss",
            )
        probe = self._on_data(collected, rows=min(2, collected.num_samples))
        rows = torch.arange(min(2, collected.num_samples), device=self.device)
        try:
            with torch.no_grad(), eval_mode(probe):
                logits = probe(rows)
        except UsageError:
            raise
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            text = str(exc).strip()
            first = text.splitlines()[0][:200] if text else type(exc).__name__
            raise UsageError(
                f"the model cannot run on the inputs of `data` ({first})", source="data"
            ) from None
        name, ignore_index = loss_name(loss, logits)
        collected = _apply_ignore_index(collected, name, ignore_index)
        _refuse_unshifted_labels(collected, name)
        head = collected.y[: logits.shape[0]].to(logits.device)
        probe = self._on_data(collected, rows=min(2, collected.num_samples))
        with torch.no_grad(), eval_mode(probe):
            logits = probe(torch.arange(head.shape[0], device=self.device))
        problem = get_loss(name).check(logits, head)
        if problem:
            raise UsageError(f"{problem} (loss {name})", source="data")
        self.num_outputs = int(logits[0].numel())  # model outputs per sample
        return name, collected

    def _check_forward(self) -> None:
        """One forward pass over the whole set without gradients, batch by batch: an input the
        model cannot take (a token id beyond its embedding, say) is a UsageError on ``data``
        here rather than an error in the middle of a curvature product."""
        index = torch.arange(self.num_samples, device=self.device)
        with torch.no_grad(), eval_mode(self._view):
            for start in range(0, self.num_samples, self.batch_size):
                rows = index[start : start + self.batch_size]
                try:
                    self._view(rows)
                except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                    text = str(exc).strip()
                    first = text.splitlines()[0][:200] if text else type(exc).__name__
                    raise UsageError(
                        f"the model cannot run on samples {start}..{start + len(rows) - 1} of "
                        f"`data` ({first})",
                        source="data",
                    ) from None

    def _self_check(self, collected: _Collected) -> None:
        """Refuse a model whose layers torch differentiates twice wrongly (8 samples)."""
        from sharpcli.preflight import SECOND_DERIVATIVE_SAMPLES, check_second_derivatives

        rows = min(SECOND_DERIVATIVE_SAMPLES, self.num_samples)
        view = self._on_data(collected, rows=rows)
        from sharpcli.errors import InputError

        try:
            with analysis_mode(view):
                check_second_derivatives(
                    view, torch.arange(rows), collected.y[:rows], self.loss, source="model"
                )
        except InputError as exc:  # about the argument `model`, not a file
            raise UsageError(exc.message, source="model") from None

    # ----------------------------------------------------------------- products
    @property
    def num_params(self) -> int:
        """P, the number of parameters in scope (the operators are P x P)."""
        return self.scope.numel

    def operator(self, operator: str = "hessian"):
        """The curvature operator ``operator`` (``hessian``, ``ggn``, ``nme`` or any registered
        one) as a matrix-free P x P :class:`~sharpcli.curvature.CurvatureOperator`: ``A @ v``
        for a flat vector of length P (laid out parameter by parameter, ``curvature.scope``),
        ``A @ V`` for a (P, k) block, ``A.to_dense()`` for tiny P. Its products run with the
        model in eval mode. It shares this object's cache of first-order graphs.

        >>> import torch
        >>> from torch import nn
        >>> from sharpcli import Curvature
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
        >>> curvature = Curvature(model, "cross-entropy", (x, y))
        >>> H, G, N = (curvature.operator(name) for name in ("hessian", "ggn", "nme"))
        >>> v = torch.randn(curvature.num_params, dtype=torch.float64)
        >>> torch.allclose(H @ v, G @ v + N @ v)     # H = G + N ([NME] eq. 2)
        True
        """
        from sharpcli.curvature import build_operator

        op = _EvalModeOperator(build_operator(operator, self.curvature_pass), self._view)
        self.refresh()
        return op

    def refresh(self) -> None:
        """Drop the cached first-order graphs, so the next product sees the current weights.

        Every method starts with it: the cache is also dropped when a parameter's version
        counter moves, but a fused optimizer step (``torch.optim.AdamW(fused=True)``, the
        Hugging Face Trainer's default) updates weights in place without moving it."""
        self.curvature_pass.clear_cache()

    def eigenvalues(
        self,
        k: int = 1,
        which: str = "largest",
        operator: str = "hessian",
        *,
        method: str = "lanczos",
        tol: float = 1e-3,
        max_matvecs: int | None = None,
        seed: int = 0,
        return_eigenvectors: bool = False,
    ):
        """The ``k`` largest (``which="largest"``), smallest or both ends' eigenvalues of
        ``operator``, descending, with Ritz residuals and converged flags: an
        :class:`~sharpcli.curvature.EigenResult`. ``method="lanczos"`` ([Lanczos1950], full
        reorthogonalisation [Parlett1998]) or ``"power"`` (largest |eigenvalue| only, as
        [PyHessian]). ``tol`` is the relative residual each pair must reach; ``max_matvecs``
        bounds the products (Lanczos default ``min(P, 100)``).
        """
        from sharpcli.analyses.spectrum import METHODS, check_choice
        from sharpcli.curvature import lanczos, power_iteration
        from sharpcli.curvature.lanczos import DEFAULT_MAX_MATVECS

        check_choice(method, METHODS, "method")
        check_choice(which, ("largest", "smallest", "both"), "which")
        _integer(k, "k")
        _seed(seed)
        op = self.operator(operator)
        if method == "lanczos":
            budget = min(self.num_params, int(max_matvecs or DEFAULT_MAX_MATVECS))
            wanted = min(int(k) * (2 if which == "both" else 1), self.num_params)
            if wanted > budget:  # a Krylov space of m products holds at most m Ritz values
                raise UsageError(
                    f"`k={k}` asks for {wanted} eigenvalues but a Krylov space of {budget} "
                    f"products (`max_matvecs`) holds at most {budget}; lower `k` or raise "
                    "`max_matvecs`",
                    source="k",
                )
        with analysis_mode(self._view):
            if method == "power":
                if which != "largest":
                    raise UsageError(
                        "power iteration finds the largest |eigenvalue|s only; use "
                        "`method=lanczos`",
                        source="which",
                    )
                return power_iteration(
                    op,
                    k=k,
                    tol=tol,
                    max_iter=max_matvecs or 100,
                    seed=seed,
                    return_eigenvectors=return_eigenvectors,
                )
            return lanczos(
                op,
                k=k,
                which=which,
                tol=tol,
                max_matvecs=max_matvecs,
                seed=seed,
                return_eigenvectors=return_eigenvectors,
            )

    def trace(
        self,
        operator: str = "hessian",
        *,
        estimator: str = "hutchpp",
        square: bool = False,
        tol: float = 1e-2,
        max_matvecs: int = 1000,
        seed: int = 0,
    ):
        """``tr(A)`` of ``operator`` (or ``Tr(A^2)`` with ``square``) with standard error and
        per-layer traces: a :class:`~sharpcli.curvature.TraceResult`. Estimators:
        ``"hutchpp"`` ([Hutch++]), ``"hutchinson"`` ([Hutchinson1989]), ``"exact"`` (the
        Gauss-Newton trace, ``operator="ggn"``, C backward passes per batch) and ``"gn-split"``
        (tr(H) as exact tr(G) plus an estimated tr(N)). Stops at relative standard error ``tol``
        or ``max_matvecs`` products.
        """
        from sharpcli.analyses.spectrum import ESTIMATORS, check_choice
        from sharpcli.curvature import (
            exact_ggn_trace,
            frobenius_sq,
            gn_split_trace,
            hutchinson,
            hutchpp,
        )
        from sharpcli.curvature.registry import GGN, HESSIAN

        check_choice(estimator, ESTIMATORS, "estimator")
        _seed(seed)
        op = self.operator(operator)
        with analysis_mode(self._view):
            if estimator == "exact":
                if operator != GGN or square:
                    raise UsageError(
                        "the exact estimator is for the Gauss-Newton trace (`operator=ggn`, "
                        "no `square`)",
                        source="estimator",
                    )
                return exact_ggn_trace(self._view, self.data, self.scope)
            if estimator == "gn-split":
                if operator != HESSIAN or square:
                    raise UsageError(
                        "the gn-split estimator is for the Hessian trace (`operator=hessian`, "
                        "no `square`)",
                        source="estimator",
                    )
                return gn_split_trace(
                    self.curvature_pass, tol=tol, max_matvecs=max_matvecs, seed=seed
                )
            if square:
                return frobenius_sq(op, tol=tol, max_matvecs=max_matvecs, seed=seed)
            estimate = hutchinson if estimator == "hutchinson" else hutchpp
            return estimate(op, tol=tol, max_matvecs=max_matvecs, seed=seed)

    def density(
        self,
        operator: str = "hessian",
        *,
        probes: int = 4,
        steps: int = 64,
        grid_points: int = 512,
        broadening: float | None = None,
        seed: int = 0,
    ):
        """Spectral density of ``operator`` by stochastic Lanczos quadrature ([Ubaru2017],
        [Ghorbani2019]): ``probes`` Rademacher probes of ``steps`` Lanczos steps each,
        Gaussian-broadened by ``broadening`` (default 1% of the node range) on ``grid_points``:
        a :class:`~sharpcli.curvature.SpectralDensity` (``grid``, ``density``, ``nodes``,
        ``weights``)."""
        from sharpcli.curvature import spectral_density

        _integer(probes, "probes")
        _integer(steps, "steps")
        _integer(grid_points, "grid_points", minimum=2)
        _seed(seed)
        op = self.operator(operator)
        with analysis_mode(self._view):
            return spectral_density(
                op,
                probes=probes,
                lanczos_steps=steps,
                grid_points=grid_points,
                sigma=broadening,
                seed=seed,
            )

    def gn_nme(
        self,
        *,
        tol: float = 1e-2,
        eig_tol: float = 1e-3,
        max_matvecs: int = 1000,
        seed: int = 0,
        label_samples: int = 4,
        ggn_estimator: str = "auto",
    ) -> dict:
        """The split ``H = G + N`` of [NME] (eq. 2): for each of ``hessian``, ``ggn`` and
        ``nme`` the trace (+- stderr, shared probes, so the identity holds for the estimates),
        ``frobenius_sq``, ``lambda_max`` and ``lambda_min``; ``nme_share = tr(N)/tr(H)``,
        ``nme_frobenius_ratio``, per-layer rows (``layers``) and tr(G) cross-checked by the
        estimators ``ggn_estimator`` picks (``ggn_trace_check``; ``auto``, ``exact``,
        ``sampled``, ``hutchinson``: :func:`sharpcli.analyses.spectrum.ggn_check_plan`). The
        dict is the ``results`` of ``sharp gn-nme --json``."""
        from sharpcli.analyses.spectrum import gn_nme

        _seed(seed)
        self.refresh()
        with analysis_mode(self._view):
            return gn_nme(
                _SessionView(self, seed),
                tol=tol,
                eig_tol=eig_tol,
                max_matvecs=max_matvecs,
                label_samples=label_samples,
                ggn_estimator=ggn_estimator,
            )

    def __repr__(self) -> str:
        return (
            f"Curvature({type(self.model).__name__}, loss={self.loss!r}, "
            f"samples={self.num_samples}, params={self.num_params}, dtype={self.dtype}, "
            f"device={self.device})"
        )


def _integer(value, name: str, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum``; a UsageError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"must be an integer >= {minimum}, got {value!r}", source=name)
    return value


def _seed(seed) -> int:
    """``seed`` if it is an integer in ``0..MAX_SEED`` (:func:`sharpcli.preflight.check_seed`)."""
    from sharpcli.preflight import check_seed

    return check_seed(seed, "seed")


class _SessionView:
    """What :mod:`sharpcli.analyses.spectrum` reads of a session, from a :class:`Curvature`."""

    def __init__(self, curvature: Curvature, seed: int):
        self._curvature = curvature
        self.model = curvature._view
        self.loss = curvature.loss
        self.seed = seed
        self.cache_bytes = curvature.curvature_pass.cache_bytes
        self.num_samples = curvature.num_samples
        self.num_outputs = curvature.num_outputs
        self.y = curvature.data.y  # the labels (this rank's shard)

    def analysis_data(self):
        """The analysis set of the Curvature."""
        return self._curvature.data

    def scope(self, spec):
        """The Curvature's parameter scope (``spec`` is always its own, None)."""
        return self._curvature.scope


class _EvalModeOperator(CurvatureOperator):
    """``inner`` (a registered operator) with every product run in eval mode; ``inner`` keeps
    the count of products it made."""

    def __init__(self, inner: CurvatureOperator, model: nn.Module):
        super().__init__(inner.shape[0], inner.dtype, inner.device)
        self.name = inner.name
        self.inner = inner
        self.model = model
        self.curvature_pass = getattr(inner, "curvature_pass", None)
        self.scope = getattr(inner, "scope", None)

    def _matmat(self, V):
        with analysis_mode(self.model):
            return self.inner.matmat(V)

    def clear_cache(self) -> None:
        """Drop the cached first-order graphs of the underlying pass."""
        self.inner.clear_cache()


# --------------------------------------------------------------------------- Tracker
class Tracker:
    """Sharpness measured inside a training loop every ``every`` steps, on a fixed probe set.

    ``tracker.step(model)`` after each optimizer step counts the step and, every ``every``
    steps, measures ``metrics`` on ``data`` with the model in eval mode (each module's mode
    restored after) and returns them (else ``None``); ``tracker.measure(model)`` measures now.
    Metrics (:data:`sharpcli.analyses.tracking.TRACKABLE`): ``eigen`` (``lambda_max`` of the
    Hessian, Lanczos), ``trace`` (``tr(H)``, [Hutch++]), ``gn-nme`` (``tr(G)``, ``tr(N)`` and
    the NME share from shared probes, [NME] eq. 2) and ``frobenius`` (``Tr(H^2)``, [FA] eq. 1).
    The cost budget: ``max_matvecs`` Hessian-vector products per metric (each about two
    backward passes over ``data``; ``tol`` may stop a trace sooner), so one measurement costs
    at most ``len(metrics) * max_matvecs`` products over the probe set; keep ``data`` small
    (a few hundred samples). Returned keys carry ``prefix`` (``sharpness/lambda_max``), with
    ``{prefix}matvecs`` and ``{prefix}seconds`` of the measurement. Nothing draws from the
    global RNG, so tracking does not change the training trajectory.

    >>> import torch
    >>> from torch import nn
    >>> from sharpcli import Tracker
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    >>> x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    >>> tracker = Tracker(nn.CrossEntropyLoss(), (x[:32], y[:32]), every=2, metrics=["eigen"])
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> logged = []
    >>> for step in range(4):
    ...     optimizer.zero_grad()
    ...     nn.functional.cross_entropy(model(x), y).backward()
    ...     optimizer.step()
    ...     metrics = tracker.step(model)
    ...     if metrics is not None:
    ...         logged.append((tracker.steps, sorted(metrics)))
    >>> logged[0]
    (2, ['sharpness/lambda_max', 'sharpness/matvecs', 'sharpness/seconds'])
    >>> len(logged)
    2
    """

    def __init__(
        self,
        loss,
        data,
        *,
        every: int = 100,
        metrics=("eigen",),
        max_matvecs: int = 100,
        tol: float = 5e-2,
        params: str | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        prefix: str = "sharpness/",
    ):
        from sharpcli.analyses.tracking import check_tracked

        _integer(every, "every")
        _integer(max_matvecs, "max_matvecs")
        _seed(seed)
        if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
            raise UsageError(f"must be a positive number, got {tol!r}", source="tol")
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        if not metrics:
            raise UsageError("name at least one metric", source="metrics")
        try:
            check_tracked(metrics)
        except UsageError as exc:
            raise UsageError(exc.message, source="metrics") from None
        self.loss, self.data, self.every = loss, data, every
        self.metrics, self.max_matvecs, self.tol = metrics, max_matvecs, float(tol)
        self.params, self.batch_size, self.seed, self.prefix = params, batch_size, seed, prefix
        self.steps = 0
        self.history: list[dict] = []  # every measurement, with its "step"
        self._curvature: Curvature | None = None

    def _curvature_for(self, model: nn.Module) -> Curvature:
        """One Curvature per model (data read and checked once); rebuilt for another model."""
        if self._curvature is None or self._curvature.model is not model:
            self._curvature = Curvature(
                model, self.loss, self.data, params=self.params, batch_size=self.batch_size
            )
        return self._curvature

    def due(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) is one to measure at."""
        return step >= 1 and step % self.every == 0

    def step(self, model: nn.Module, step: int | None = None) -> dict | None:
        """Count one training step (or set the count to ``step``); measure when it is due."""
        self.steps = self.steps + 1 if step is None else int(step)
        return self.measure(model) if self.due(self.steps) else None

    def measure(self, model: nn.Module) -> dict:
        """The metrics now, keyed ``{prefix}name``, recorded in ``history``."""
        import time

        from sharpcli.analyses.tracking import measure

        start = time.perf_counter()
        curvature = self._curvature_for(model)
        curvature.refresh()  # the weights moved since the last measurement
        with analysis_mode(curvature._view):
            values, matvecs = measure(
                curvature.curvature_pass,
                self.metrics,
                seed=self.seed,
                tol=self.tol,
                max_matvecs=self.max_matvecs,
                eigen_max_matvecs=self.max_matvecs,
            )
        values.update(matvecs=matvecs, seconds=time.perf_counter() - start)
        out = {f"{self.prefix}{k}": v for k, v in values.items() if v is not None}
        self.history.append({"step": self.steps, **out})
        return out
