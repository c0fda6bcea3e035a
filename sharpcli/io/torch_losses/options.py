r"""torch's loss options on sharp's losses: ``reduction``, class ``weight``, ``label_smoothing``,
probability targets, ``pos_weight``, ``delta`` and ``beta``, each as torch defines it.

A loss is given as a module (``nn.CrossEntropyLoss(label_smoothing=0.1)``), read by
:func:`module_spec`, or as a spec ``NAME[:k=v,...]`` (the grammar of ``--reg``, the library's
``loss="cross-entropy:reduction=sum"`` and the CLI's ``--loss``), read by :func:`parse_loss_spec`.
Where the options are torch's defaults the registered loss is used as it is; otherwise
:func:`configure_loss` builds a :class:`~sharpcli.losses.Loss` for them over the analysis set
and files it under its spec in :data:`sharpcli.losses.CONFIGURED`.

The analysis loss stays ``L = (1/N) sum_i l_i`` over the ``N`` samples of the set, with
``l_i = c sum_r u_ir``: ``u_ir`` torch's unreduced loss of sample ``i``'s rows (the sample
itself, its positions or its output elements) and ``c`` the constant that makes ``L`` torch's
reduction over the whole set:

- ``reduction="mean"``: ``L = sum u / D`` with torch's normaliser ``D``: the labelled rows'
  class weights ``sum w_{y}`` for cross-entropy on class indices (their number without
  ``weight``; ``ignore_index`` rows count 0), the rows for probability targets, the elements
  ``N M`` for the element-wise losses. ``c = N / D``; where ``D`` depends on the labels
  (class weights, ignored rows) it is the whole set's, like the token mean
  (:func:`sharpcli.losses.set_token_reduction`), and the loss's name carries ``@c``.
- ``reduction="sum"``: ``L = sum u``, ``c = N``: Hessians are those of the mean times the
  number of terms.

The output Hessians ([Schraudolph2002]):

- cross-entropy with weights ``w``, smoothing ``eps`` over ``C`` classes and target ``q``
  (one-hot for a class index): ``u = -sum_c w_c q'_c log p_c`` with
  ``q' = (1 - eps) q + eps / C``, so ``H_z = a (diag(p) - p p^T)`` with ``a = sum_c w_c q'_c``:
  the target only scales the softmax Hessian. NLL on log-probabilities is this with
  ``eps = 0`` on ``z`` itself (:func:`sharpcli.losses.nll`).
- binary cross-entropy with logits, ``pos_weight`` ``pw`` and ``weight`` ``w``:
  ``u = -w (pw y log s + (1 - y) log(1 - s))``, ``s = sigmoid(z)``, so
  ``du/dz = w (s (pw y + 1 - y) - pw y)`` and ``H_z = diag(w s (1 - s) (pw y + 1 - y))``;
  on probabilities (``nn.BCELoss``) ``H_z = diag(w (y / p^2 + (1 - y) / (1 - p)^2))``.
- MSE ``(z - y)^2``: ``2``; Huber: ``1[|r| < delta]``; smooth L1: ``1[|r| < beta] / beta``;
  each times ``c`` on the diagonal.

Losses with options draw no labels (the Fisher's sampled labels are the NLL's, which the
options change): their Fisher-based estimators are refused; the Gauss-Newton matrix is exact.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sharpcli.errors import UsageError
from sharpcli.losses import (
    BCE_PROBABILITIES,
    BINARY_CROSS_ENTROPY,
    CONFIGURED,
    CROSS_ENTROPY,
    HUBER,
    IGNORE_INDEX,
    LOSSES,
    MSE,
    NLL,
    SMOOTH_L1,
    TOKEN_CROSS_ENTROPY,
    Loss,
    bce_probabilities_curvature,
    elementwise_factor,
    get_loss,
    log_probability_problem,
    outputs_per_sample,
    targets_as_outputs,
)
from sharpcli.specs import Param, RegistryError, parse_spec

__all__ = [
    "LOSS_MODULES",
    "LOSS_OPTIONS",
    "LossSpec",
    "configure_loss",
    "module_spec",
    "parse_loss_spec",
    "torch_module",
]

# the modules a loss may be handed as, for messages
LOSS_MODULES = (
    "nn.CrossEntropyLoss, nn.NLLLoss, nn.BCEWithLogitsLoss, nn.BCELoss, nn.MSELoss, "
    "nn.HuberLoss, nn.SmoothL1Loss"
)
REDUCTIONS = ("mean", "sum")
LISTS = ("weight", "pos_weight")  # options holding one number per class: `;`-separated in a spec

_PARAMS = {
    "reduction": Param(
        "reduction", "choice", "mean", "the mean or the sum over the set", choices=REDUCTIONS
    ),
    "label_smoothing": Param(
        "label_smoothing", "float", 0.0, "torch's label smoothing", minimum=0.0
    ),
    "ignore_index": Param("ignore_index", "int", IGNORE_INDEX, "the class label to skip"),
    "delta": Param("delta", "float", 1.0, "Huber's threshold", positive=True),
    "beta": Param("beta", "float", 1.0, "smooth L1's threshold", minimum=0.0),
}
# the options each loss takes, in the order a spec is written
LOSS_OPTIONS: dict[str, tuple[str, ...]] = {
    CROSS_ENTROPY: ("reduction", "weight", "label_smoothing", "ignore_index"),
    NLL: ("reduction", "weight", "ignore_index"),
    BINARY_CROSS_ENTROPY: ("reduction", "weight", "pos_weight"),
    BCE_PROBABILITIES: ("reduction", "weight"),
    MSE: ("reduction",),
    HUBER: ("reduction", "delta"),
    SMOOTH_L1: ("reduction", "beta"),
}
_DEFAULTS = {"weight": None, "pos_weight": None} | {k: p.default for k, p in _PARAMS.items()}


@dataclass(frozen=True)
class LossSpec:
    """A loss and the options that differ from torch's defaults, ``(key, value)`` in order
    (``weight`` and ``pos_weight`` as tuples of floats)."""

    name: str
    options: tuple[tuple[str, object], ...] = ()

    def get(self, key: str):
        """The option ``key``, or torch's default."""
        return dict(self.options).get(key, _DEFAULTS.get(key))

    @property
    def text(self) -> str:
        """The canonical spec, ``name`` or ``name:k=v,...``."""
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_text(v)}" for k, v in self.options)

    def without(self, *keys: str) -> LossSpec:
        """The spec without the options ``keys``."""
        return LossSpec(self.name, tuple((k, v) for k, v in self.options if k not in keys))


def _text(value) -> str:
    if isinstance(value, torch.Tensor):  # a module's weight: its numbers, or its shape
        if value.numel() > 16:
            return f"<tensor {tuple(value.shape)}>"
        value = tuple(value.detach().reshape(-1).tolist())
    if isinstance(value, tuple):
        return ";".join(repr(float(v)) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def _spec(name: str, given: dict) -> LossSpec:
    """The spec of ``given`` options, defaults left out, in the loss's order."""
    keys = LOSS_OPTIONS.get(name, ())
    kept = tuple((k, given[k]) for k in keys if k in given and given[k] != _DEFAULTS[k])
    return LossSpec(name, kept)


def _numbers(owner: str, key: str, text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(";"))
    except ValueError:
        raise RegistryError(
            f"{owner}: {key} must be numbers separated by ';' (one per class); got {text!r}",
            source="loss",
        ) from None
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise RegistryError(f"{owner}: {key} must be finite and >= 0; got {text!r}", source="loss")
    return values


def parse_loss_spec(text: str) -> LossSpec:
    """``NAME[:k=v,...]`` (``--loss``, a library ``loss`` string) as a :class:`LossSpec`.

    Args:
        text: e.g. ``cross-entropy:label_smoothing=0.1,reduction=sum`` or
            ``binary-cross-entropy:pos_weight=3`` (lists: ``weight=1;2;0.5``).

    Returns:
        The spec, defaults left out.

    Raises:
        RegistryError: (``loss``) an unknown loss (listing the accepted), an unknown option
            (listing the loss's), a value of the wrong type or range.
    """

    def keys_of(name: str):
        return LOSS_OPTIONS.get(name, ()) if name in LOSSES else None

    name, given = parse_spec(
        text, keys_of, positional=False, source="loss", unknown=lambda n: LOSSES.unknown(n)
    )
    values: dict[str, object] = {}
    for key, raw in given.items():
        if key in LISTS:
            values[key] = _numbers(name, key, raw)
        else:
            values[key] = _PARAMS[key].convert(name, raw, source="loss")
    if float(values.get("label_smoothing", 0.0)) > 1:  # type: ignore[arg-type]
        raise RegistryError(f"{name}: label_smoothing must be <= 1", source="loss")
    return _spec(name, values)


# --------------------------------------------------------------------------- modules
def _floats(tensor) -> tuple[float, ...] | None:
    if tensor is None:
        return None
    return tuple(float(v) for v in tensor.detach().reshape(-1).tolist())


def _weight_tensor(module: nn.Module, key: str):
    tensor = getattr(module, key, None)
    if tensor is not None and bool((tensor < 0).any()):
        raise UsageError(
            f"{type(module).__name__}({key}=...) has negative entries: the loss's output "
            "Hessian is then indefinite (no Gauss-Newton matrix)",
            source="loss",
        )
    return tensor


def module_spec(loss: nn.Module) -> LossSpec:
    """The spec of a torch loss module: its kind and the options it was built with.

    ``nn.CrossEntropyLoss`` (``weight``, ``ignore_index``, ``label_smoothing``, ``reduction``),
    ``nn.NLLLoss`` (after a ``LogSoftmax`` head), ``nn.BCEWithLogitsLoss`` (``weight``,
    ``pos_weight``), ``nn.BCELoss`` (``weight``; on probabilities), ``nn.MSELoss``, ``nn.HuberLoss`` (``delta``), ``nn.SmoothL1Loss``
    (``beta``), each with ``reduction`` ``"mean"`` or ``"sum"``.

    Raises:
        UsageError: (``loss``) ``reduction="none"``, ``nn.GaussianNLLLoss`` (a variance
            argument), any other module; one line naming what is supported.
    """
    reduction = getattr(loss, "reduction", "mean")
    kind = type(loss).__name__
    if isinstance(loss, nn.GaussianNLLLoss):
        raise UsageError(
            "nn.GaussianNLLLoss takes a variance besides the outputs and targets, which sharp's "
            f"loss (outputs, labels) has no place for; supported: {LOSS_MODULES}",
            source="loss",
        )
    names: dict[type, str] = {
        nn.CrossEntropyLoss: CROSS_ENTROPY,
        nn.NLLLoss: NLL,
        nn.BCEWithLogitsLoss: BINARY_CROSS_ENTROPY,
        nn.BCELoss: BCE_PROBABILITIES,
        nn.MSELoss: MSE,
        nn.HuberLoss: HUBER,
        nn.SmoothL1Loss: SMOOTH_L1,
    }
    name = next((n for cls, n in names.items() if isinstance(loss, cls)), None)
    if name is None:
        raise UsageError(
            f"{kind} is not a supported loss; pass one of {LOSS_MODULES} or a name: "
            f"{', '.join(LOSSES)}",
            source="loss",
        )
    if reduction not in REDUCTIONS:
        raise UsageError(
            f"{kind}(reduction={reduction!r}) is not supported: curvature is taken of one "
            "number, the loss over the set; use reduction='mean' or 'sum'",
            source="loss",
        )
    given: dict[str, object] = {"reduction": reduction}
    if name in (CROSS_ENTROPY, NLL):
        given["weight"] = _floats(_weight_tensor(loss, "weight"))
        given["ignore_index"] = int(loss.ignore_index)  # type: ignore[arg-type]
    if name == CROSS_ENTROPY:
        given["label_smoothing"] = float(loss.label_smoothing)  # type: ignore[arg-type]
    if name in (BINARY_CROSS_ENTROPY, BCE_PROBABILITIES):
        given["weight"] = _weight_tensor(loss, "weight")
    if name == BINARY_CROSS_ENTROPY:
        given["pos_weight"] = _weight_tensor(loss, "pos_weight")
    if name == HUBER:
        given["delta"] = float(loss.delta)  # type: ignore[arg-type]
    if name == SMOOTH_L1:
        given["beta"] = float(loss.beta)  # type: ignore[arg-type]
    spec = _spec(name, {k: v for k, v in given.items() if not isinstance(v, torch.Tensor)})
    tensors = tuple((k, v) for k, v in given.items() if isinstance(v, torch.Tensor))
    return LossSpec(name, spec.options + tensors) if tensors else spec


def torch_module(spec: LossSpec) -> nn.Module:
    """torch's loss module for ``spec`` (the value guard's reference for a named loss).

    Args:
        spec: A spec whose loss is one of :data:`LOSS_OPTIONS`.
    """
    reduction = spec.get("reduction")

    def tensor(key: str):
        value = spec.get(key)
        if value is None or isinstance(value, torch.Tensor):
            return value
        return torch.tensor(value, dtype=torch.float64)

    if spec.name == CROSS_ENTROPY:
        return nn.CrossEntropyLoss(
            weight=tensor("weight"),
            ignore_index=spec.get("ignore_index"),
            reduction=reduction,
            label_smoothing=spec.get("label_smoothing"),
        )
    if spec.name == NLL:
        return nn.NLLLoss(
            weight=tensor("weight"), ignore_index=spec.get("ignore_index"), reduction=reduction
        )
    if spec.name == BINARY_CROSS_ENTROPY:
        return nn.BCEWithLogitsLoss(
            weight=tensor("weight"), pos_weight=tensor("pos_weight"), reduction=reduction
        )
    if spec.name == BCE_PROBABILITIES:
        return nn.BCELoss(weight=tensor("weight"), reduction=reduction)
    if spec.name == HUBER:
        return nn.HuberLoss(reduction=reduction, delta=spec.get("delta"))
    if spec.name == SMOOTH_L1:
        return nn.SmoothL1Loss(reduction=reduction, beta=spec.get("beta"))
    return nn.MSELoss(reduction=reduction)


# --------------------------------------------------------------------------- configured losses
def _on(value, z: torch.Tensor) -> torch.Tensor | None:
    """An option's numbers as a tensor on ``z``'s device and dtype."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=z.device, dtype=z.dtype)
    return torch.tensor(value, device=z.device, dtype=z.dtype)


def _rows(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Logits as ``(B, R, C)`` rows and their targets ``(B, R)`` (class indices) or
    ``(B, R, C)`` (probabilities), and whether the targets are probabilities."""
    soft = y.is_floating_point()
    if z.ndim == 2:
        return z.unsqueeze(1), y.unsqueeze(1), soft
    return z, y, soft


class _SoftmaxOptions:
    """Cross-entropy (or NLL on log-probabilities) with ``spec``'s options over the set's
    labels ``y_set`` (module docstring): ``l_i = c sum_r u_ir``, ``H_z = c a_r (diag p_r -
    p_r p_r^T)`` per row, ``a_r = sum_c w_c q'_c``."""

    def __init__(self, spec: LossSpec, y_set: torch.Tensor):
        self.eps = float(spec.get("label_smoothing"))
        self.weight = spec.get("weight")
        self.reduction = spec.get("reduction")
        self.log_probabilities = spec.name == NLL
        samples = int(y_set.shape[0])
        total = self.normaliser(y_set)
        self.scale = float(samples) if self.reduction == "sum" else samples / max(total, 1e-300)

    def unreduced(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """torch's ``u`` per row, ``(B, R)`` (0 on ignored rows)."""
        rows, targets, soft = _rows(z, y)
        classes = rows.shape[-1]
        flat = targets.reshape(-1, classes).to(z.dtype) if soft else targets.reshape(-1)
        u = F.cross_entropy(
            rows.reshape(-1, classes),
            flat,
            weight=_on(self.weight, z),
            ignore_index=IGNORE_INDEX,
            label_smoothing=self.eps,
            reduction="none",
        )
        return u.reshape(rows.shape[:2])

    def target_weights(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``a_r = sum_c w_c q'_c`` per row, ``(B, R)``, 0 on ignored rows."""
        rows, targets, soft = _rows(z, y)
        classes = rows.shape[-1]
        if soft:  # torch smooths probabilities as (1 - eps) q + eps / C, whatever sum q
            smoothed = (1 - self.eps) * targets.to(z.dtype) + self.eps / classes
        else:  # a class index: its one-hot row; an ignored row 0
            labelled = targets != IGNORE_INDEX
            q = F.one_hot(torch.where(labelled, targets, 0), classes).to(z.dtype)
            q = q * labelled.unsqueeze(-1)
            smoothed = (1 - self.eps) * q + (self.eps / classes) * q.sum(-1, keepdim=True)
        w = _on(self.weight, z)
        return (smoothed if w is None else smoothed * w).sum(-1)

    def normaliser(self, y: torch.Tensor) -> float:
        """torch's ``D`` of the mean over the labels ``y`` (rows laid out as :func:`_rows`'s)."""
        if y.is_floating_point():
            return float(math.prod(y.shape[:-1]))
        labelled = y != IGNORE_INDEX
        if self.weight is None:
            return float(labelled.sum())
        w = _on(self.weight, torch.empty(0, dtype=torch.float64, device=y.device))
        return float(w[torch.where(labelled, y, 0)][labelled].sum())  # type: ignore[index]

    def hessian_matvec(self, z: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``H_z u`` of ``l_i``, shaped like ``z``."""
        rows, _, _ = _rows(z, y)
        v = u.reshape(rows.shape)
        p = torch.softmax(rows, dim=-1)
        hv = p * v - p * (p * v).sum(-1, keepdim=True)
        return (self.scale * self.target_weights(z, y).unsqueeze(-1) * hv).reshape(z.shape)

    def ggn_factor(self, z: torch.Tensor, y: torch.Tensor) -> Iterator[torch.Tensor]:
        """Columns ``sqrt(c a_r p_rc) (e_c - p_r)`` at row ``r``, one per (row, class)."""
        rows, _, _ = _rows(z.detach(), y)
        a = self.target_weights(rows, y if z.ndim == 3 else y.unsqueeze(1))
        root = (self.scale * a).clamp_min(0).sqrt().unsqueeze(-1)
        p = torch.softmax(rows, dim=-1)
        eye = torch.eye(rows.shape[-1], dtype=z.dtype, device=z.device)
        for r in range(rows.shape[1]):
            for c in range(rows.shape[-1]):
                column = torch.zeros_like(rows)
                column[:, r] = root[:, r] * p[:, r, c : c + 1].sqrt() * (eye[c] - p[:, r])
                yield column.reshape(z.shape)

    def check(self, z: torch.Tensor, y: torch.Tensor) -> str | None:
        """Labels or targets that do not fit (a check may see fewer outputs than labels)."""
        classes = z.shape[-1]
        if y.is_floating_point():
            if y.shape[1:] != z.shape[1:]:
                return (
                    f"probability targets have shape {tuple(y.shape)} but the outputs "
                    f"{tuple(z.shape)}: give one probability per class"
                )
            if bool((y < 0).any()):
                return "probability targets must be >= 0"
        else:
            labelled = y[y != IGNORE_INDEX]
            if labelled.numel() and (int(labelled.min()) < 0 or int(labelled.max()) >= classes):
                return (
                    f"labels range over [{int(labelled.min())}, {int(labelled.max())}] but the "
                    f"model has {classes} classes"
                )
        if self.weight is not None and len(self.weight) != classes:
            return f"weight has {len(self.weight)} entries but the model has {classes} classes"
        return log_probability_problem(z) if self.log_probabilities else None

    @staticmethod
    def correct(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Argmax hits over the labelled rows (a probability target's argmax as its class)."""
        rows, targets, soft = _rows(z, y)
        if soft:
            return (rows.argmax(-1) == targets.argmax(-1)).sum(), targets.shape[0] * rows.shape[1]
        labelled = targets != IGNORE_INDEX
        return ((rows.argmax(-1) == targets) & labelled).sum(), labelled.sum()

    def batch_value(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss on one batch as torch's module reduces it (its own ``D``)."""
        d = self.normaliser(_rows(z, y)[1]) if self.reduction == "mean" else 1.0
        return self.unreduced(z, y).sum() / d


def _softmax_loss(spec: LossSpec, base: str, y_set: torch.Tensor) -> Loss:
    """The :class:`~sharpcli.losses.Loss` of :class:`_SoftmaxOptions`."""
    rows = _SoftmaxOptions(spec, y_set)
    scale = rows.scale
    base_loss = get_loss(base)
    targets = "probability targets" if y_set.is_floating_point() else ""
    return Loss(
        _configured_name(spec, scale, base_loss.per_token, targets),
        f"{base_loss.description} ({spec.text})",
        True,
        mean=lambda z, y: scale * rows.unreduced(z, y).sum() / z.shape[0],
        per_sample=lambda z, y: scale * rows.unreduced(z, y).sum(1),
        hessian_matvec=rows.hessian_matvec,
        ggn_factor=rows.ggn_factor,
        correct=rows.correct,
        check=rows.check,
        per_token=base_loss.per_token,
        softmax=True,
        batch_value=rows.batch_value,
    )


class _ElementwiseOptions:
    """An element-wise loss with ``spec``'s options (module docstring): ``l_i = c sum_m u_im``
    with ``c = 1/M`` (the mean over all elements) or ``N`` (the sum over the set)."""

    def __init__(self, spec: LossSpec, base: str, samples: int):
        self.base, self.samples = base, samples
        self.reduction = spec.get("reduction")
        self.weight, self.pos_weight = spec.get("weight"), spec.get("pos_weight")
        self.delta, self.beta = float(spec.get("delta")), float(spec.get("beta"))

    def elements(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """torch's unreduced loss, shaped like ``z``."""
        t, w = targets_as_outputs(z, y), _on(self.weight, z)
        if self.base == BINARY_CROSS_ENTROPY:
            pw = _on(self.pos_weight, z)
            return F.binary_cross_entropy_with_logits(
                z, t, weight=w, pos_weight=pw, reduction="none"
            )
        if self.base == BCE_PROBABILITIES:
            return F.binary_cross_entropy(z, t, weight=w, reduction="none")
        if self.base == HUBER:
            return F.huber_loss(z, t, reduction="none", delta=self.delta)
        if self.base == SMOOTH_L1:
            return F.smooth_l1_loss(z, t, reduction="none", beta=self.beta)
        return F.mse_loss(z, t, reduction="none")

    def second_derivative(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``d^2 u / dz^2`` per element (module docstring)."""
        t, w = targets_as_outputs(z, y), _on(self.weight, z)
        if self.base in (BINARY_CROSS_ENTROPY, BCE_PROBABILITIES):
            if self.base == BCE_PROBABILITIES:
                h = bce_probabilities_curvature(z, t)
            else:
                s, pw = torch.sigmoid(z), _on(self.pos_weight, z)
                h = s * (1 - s) if pw is None else s * (1 - s) * (pw * t + 1 - t)
            return torch.broadcast_to(h if w is None else h * w, z.shape)
        r = z - t
        if self.base == HUBER:
            return (r.abs() < self.delta).to(z.dtype)
        if self.base == SMOOTH_L1:
            if self.beta == 0:
                return torch.zeros_like(z)
            return (r.abs() < self.beta).to(z.dtype) / self.beta
        return torch.full_like(z, 2.0)

    def factor(self, z: torch.Tensor) -> float:
        """``c``: ``1/M`` for the mean over elements, ``N`` for the sum over the set."""
        return float(self.samples) if self.reduction == "sum" else 1.0 / outputs_per_sample(z)

    def curvature(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The diagonal of ``H_z`` of ``l_i``."""
        return self.factor(z) * self.second_derivative(z, y)

    def per_sample(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``l_i = c sum_m u_im``, ``(B,)``."""
        return self.factor(z) * self.elements(z, y).reshape(z.shape[0], -1).sum(1)

    def check(self, z: torch.Tensor, y: torch.Tensor) -> str | None:
        """The registered loss's check, and a weight that would weigh a batch's samples."""
        own = get_loss(self.base).check
        found = own(z, y) if own is not None else None
        if found:
            return found
        weight = self.weight
        if isinstance(weight, torch.Tensor) and weight.ndim >= z.ndim and weight.shape[0] > 1:
            return (
                f"weight of shape {tuple(weight.shape)} weighs the samples of one batch; "
                "sharp batches the set its own way: give a weight that broadcasts over "
                "one sample's outputs"
            )
        return None

    def batch_value(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss on one batch as torch's module reduces it."""
        u = self.elements(z, y)
        return u.sum() if self.reduction == "sum" else u.mean()


def _elementwise_loss(spec: LossSpec, base: str, y_set: torch.Tensor) -> Loss:
    """The :class:`~sharpcli.losses.Loss` of :class:`_ElementwiseOptions`."""
    parts = _ElementwiseOptions(spec, base, int(y_set.shape[0]))
    base_loss = get_loss(base)
    scale = float(parts.samples) if parts.reduction == "sum" else 1.0
    return Loss(
        _configured_name(spec, scale, False),
        f"{base_loss.description} ({spec.text})",
        base_loss.classification,
        mean=lambda z, y: parts.per_sample(z, y).mean(),
        per_sample=parts.per_sample,
        hessian_matvec=lambda z, y, u: parts.curvature(z, y) * u,
        ggn_factor=elementwise_factor(parts.curvature),
        correct=base_loss.correct,
        check=parts.check,
        batch_value=parts.batch_value,
    )


def _configured_name(spec: LossSpec, scale: float, per_position: bool, targets: str = "") -> str:
    """The name a configured loss is filed under: its spec (a weight given as a tensor by its
    digest), ``@c`` for the constant ``c`` the per-sample losses carry where it is not 1 (it
    may depend on the analysis set, whose records must not be shared), `` per position``
    for cross-entropy over the positions of each sample, `` probability targets`` for
    cross-entropy's soft targets; never a registered loss's name (which it would shadow)."""
    options = []
    for key, value in spec.options:
        if isinstance(value, torch.Tensor):
            digest = hashlib.sha1(value.detach().cpu().double().numpy().tobytes()).hexdigest()
            value = f"<tensor {tuple(value.shape)} {digest[:8]}>"
        options.append(f"{key}={_text(value)}")
    text = spec.name + (":" + ",".join(options) if options else "")
    text += "" if scale == 1.0 else f"@{scale!r}"
    text += " per position" if per_position else ""
    text += f" {targets}" if targets else ""
    return text if text not in LOSSES else f"{text} (configured)"


def configure_loss(spec: LossSpec, reading_name: str, y: torch.Tensor) -> str:
    """The name of the loss that ``spec`` is on the analysis set's labels ``y`` (laid out as
    the reading ``reading_name`` takes them; ignored labels already ``-100`` or left out).

    torch's defaults on the registered loss's own targets: the registered loss. Otherwise a
    :class:`~sharpcli.losses.Loss` for the options (module docstring), filed in
    :data:`~sharpcli.losses.CONFIGURED` under its name.

    Args:
        spec: The loss and its options.
        reading_name: The registered loss that reads the outputs (``cross-entropy``,
            ``token-cross-entropy`` for per-position cross-entropy, ``nll``, ...).
        y: The whole analysis set's labels.

    Returns:
        A name :func:`sharpcli.losses.get_loss` finds.
    """
    options = spec.without("ignore_index")  # applied to the labels already
    softmax = reading_name in (CROSS_ENTROPY, TOKEN_CROSS_ENTROPY, NLL)
    soft = softmax and y.is_floating_point()
    nll_per_position = spec.name == NLL and reading_name == TOKEN_CROSS_ENTROPY
    # per-sample labels -100 (a data file's ignored samples): the mean over the others
    ignored = softmax and not soft and reading_name != TOKEN_CROSS_ENTROPY
    ignored = ignored and bool((y == IGNORE_INDEX).any())
    if not options.options and not (soft or nll_per_position or ignored):
        return reading_name
    base = reading_name
    if softmax:
        loss = _softmax_loss(LossSpec(spec.name, options.options), base, y)
    else:
        loss = _elementwise_loss(LossSpec(spec.name, options.options), base, y)
    CONFIGURED[loss.name] = loss
    return loss.name


def reference(spec: LossSpec | None) -> nn.Module | None:
    """torch's module for a named loss with options (None without: the registered loss's own
    reference, :func:`sharpcli.io.torch_losses.readings.reference_loss`)."""
    if spec is None or not spec.without("ignore_index").options:
        return None
    return torch_module(spec)
