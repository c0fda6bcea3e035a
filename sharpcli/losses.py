"""Losses ``l(z, y)`` on model outputs, their Hessians with respect to the outputs, one registry.

The analysis loss is ``L(theta) = (1/N) sum_i l(f(theta, x_i), y_i)``, a mean over samples
(a batch of size B contributes with weight B/N; see :mod:`sharpcli.curvature.products.data`). Each
loss is a :class:`Loss` record in :data:`LOSSES` carrying everything about itself: the batch
mean, the per-sample loss, ``H_z u`` and a square-root factor of ``H_z = d^2 l / dz^2`` for
the exact Gauss-Newton trace ([Schraudolph2002]; ``tr(J^T H_z J) = sum_c ||J^T s_c||^2`` when
``H_z = sum_c s_c s_c^T``), how it counts correct predictions (accuracy is defined by the
loss: correct over the predictions it counts, one per sample or one per labelled position),
and which outputs and labels it accepts. Each built-in is declared with its builder below,
whose docstring gives its formula.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.registry import Entry, declaration, declare

__all__ = [
    "BCE_PROBABILITIES",
    "BINARY_CROSS_ENTROPY",
    "CONFIGURED",
    "CROSS_ENTROPY",
    "HUBER",
    "NLL",
    "SMOOTH_L1",
    "IGNORE_INDEX",
    "MSE",
    "TOKEN_CROSS_ENTROPY",
    "LabelSampler",
    "LOSSES",
    "TOKEN_REDUCTIONS",
    "Loss",
    "clear_token_reduction",
    "get_loss",
    "loss_fn",
    "per_sample_loss",
    "register_loss",
    "set_token_reduction",
    "token_reduction",
    "token_weights",
]

IGNORE_INDEX = -100  # token labels to skip (the convention of torch and HuggingFace)

# the built-in losses' names, each declared below with its builder (other modules import them)
CROSS_ENTROPY, MSE = "cross-entropy", "mse"
BINARY_CROSS_ENTROPY, TOKEN_CROSS_ENTROPY = "binary-cross-entropy", "token-cross-entropy"
NLL, HUBER, SMOOTH_L1 = "nll", "huber", "smooth-l1"
BCE_PROBABILITIES = "bce-probabilities"


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
    # the predictive distribution p(y | z) whose negative log-likelihood the loss is (up to
    # constants and scale): draws its labels from standard random numbers (LabelSampler)
    sampler: LabelSampler | None = None
    per_token: bool = False  # one label per position of (batch, length, ...) outputs
    softmax: bool = False  # the outputs are the logits of a softmax over the last axis
    # the loss on one batch reduced as torch's module reduces it (its own normaliser, not the
    # analysis set's; the value guard compares it with the module): None: ``mean``
    batch_value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def softmax_per_sample(self) -> bool:
        """Whether each sample has one softmax over the classes and one class label
        (``cross-entropy``; ``token-cross-entropy`` has one per position)."""
        return self.softmax and not self.per_token

    def problem(self, z: torch.Tensor, y: torch.Tensor) -> str | None:
        """What is wrong with outputs ``z`` against labels ``y`` (the loss's ``check``); None
        when nothing is, or the loss has no check."""
        return None if self.check is None else self.check(z, y)

    def logit_hessian_rank(self, num_outputs: int) -> int:
        """An upper bound on the rank of ``H_z`` for ``num_outputs`` outputs per sample:
        ``C - 1`` for a softmax over ``C`` classes (``H_z`` annihilates the all-ones vector),
        ``C`` otherwise.

        Args:
            num_outputs: The outputs per sample ``C``.

        Returns:
            The rank bound, at least 1.
        """
        return max(1, num_outputs - (1 if self.softmax_per_sample else 0))

    def label_noise_shape(self, z: torch.Tensor) -> torch.Size:
        """The shape of the standard random numbers :meth:`labels_from_noise` takes for ``z``.

        Args:
            z: Model outputs, ``(batch, ...)``.

        Returns:
            ``z.shape[:-1]`` for a categorical distribution (one number per softmax row),
            ``z.shape`` otherwise (one per output).
        """
        return self._sampler().shape(z)

    def labels_from_noise(
        self, z: torch.Tensor, noise: torch.Tensor, y: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Labels ``y^ ~ p(y | z)`` from standard random numbers ``noise``.

        ``noise`` is U[0, 1) or N(0, 1) as :attr:`LabelSampler.noise` says, shaped
        :meth:`label_noise_shape`; the map is deterministic, so random numbers keyed by a
        sample's index give the same labels on every rank and batch size. For a per-token
        loss, positions that ``y`` leaves unlabelled (:data:`IGNORE_INDEX`) stay unlabelled.

        Args:
            z: Model outputs, ``(batch, ...)`` (detached here).
            noise: The random numbers, float64, on any device.
            y: The data's labels, read only for their unlabelled positions (optional).

        Returns:
            Labels shaped as the loss takes them, on ``z``'s device.
        """
        labels = self._sampler().transform(z.detach(), noise)
        if self.per_token and y is not None:
            labels = torch.where(y != IGNORE_INDEX, labels, torch.full_like(labels, IGNORE_INDEX))
        return labels

    def sample_labels(
        self,
        z: torch.Tensor,
        generator: torch.Generator | None = None,
        y: torch.Tensor | None = None,
    ) -> torch.Tensor:
        r"""Labels drawn from the model's predictive distribution at ``z`` ([NME] eq. 20).

        The loss is the negative log-likelihood of a distribution ``p(y | z)`` whose Fisher
        information in ``z`` is the loss's output Hessian, so the gradient ``g`` of the
        loss at a drawn label gives the Gauss-Newton matrix as an expectation
        ([Schraudolph2002]):

        .. math::

            \mathbb{E}_{\hat y \sim p(\cdot \mid z)}
            \left[\nabla_z l(z, \hat y) \nabla_z l(z, \hat y)^\top\right] = H_z,
            \qquad
            \mathbb{E}\left[g g^\top\right] = J^\top H_z J = G.

        ``cross-entropy``: ``Cat(softmax z)``; ``token-cross-entropy``: the same per
        position (``H_z`` then carries the position weight ``w`` once, the squared gradient
        twice: weigh each position's loss by ``sqrt(w)`` for the identity);
        ``binary-cross-entropy``: ``Bernoulli(sigmoid z)``; ``mse``
        (``l = (1/C)||z - y||^2``): ``N(z, (C/2) I)``.

        Args:
            z: Model outputs, ``(batch, ...)``.
            generator: The random stream (its device draws the numbers); None: torch's
                global CPU stream.
            y: The data's labels, for a per-token loss's unlabelled positions (optional).

        Returns:
            Labels shaped as the loss takes them, on ``z``'s device.
        """
        sampler = self._sampler()
        device = generator.device if generator is not None else torch.device("cpu")
        draw = torch.rand if sampler.noise == "uniform" else torch.randn
        noise = draw(sampler.shape(z), generator=generator, dtype=torch.float64, device=device)
        return self.labels_from_noise(z, noise, y)

    def _sampler(self) -> LabelSampler:
        if self.sampler is None:
            raise UsageError(
                f"the loss {self.name!r} has no predictive distribution to draw labels from",
                source="loss",
            )
        return self.sampler


@dataclass(frozen=True)
class LabelSampler:
    """How a loss draws labels from its predictive distribution: a deterministic map of
    standard random numbers (so draws keyed by a sample's index do not depend on batching)."""

    noise: str  # "uniform": U[0, 1); "normal": N(0, 1); float64
    per_output: bool  # one number per output; False: one per softmax row (z.shape[:-1])
    transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (z, noise) -> labels

    def shape(self, z: torch.Tensor) -> torch.Size:
        """The shape of the random numbers for outputs ``z``."""
        return z.shape if self.per_output else z.shape[:-1]


def _categorical_labels(z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # inverse CDF: y^ = #{c : u > P(Y <= c)} ~ Cat(softmax z), in float64 where u lives
    cdf = torch.softmax(z.to(u.device, torch.float64), dim=-1).cumsum(-1)
    drawn = (u.unsqueeze(-1) > cdf).sum(-1).clamp_max(cdf.shape[-1] - 1)
    return drawn.to(z.device)


def _bernoulli_labels(z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # y^ = [u < sigmoid(z)] ~ Bernoulli(sigmoid z), as 0./1. in z's dtype
    p = torch.sigmoid(z.to(u.device, torch.float64))
    return (u < p).to(device=z.device, dtype=z.dtype)


def _gaussian_labels(z: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    # y^ = z + sqrt(C/2) n ~ N(z, (C/2) I): the Fisher information of l = (1/C)||z - y||^2
    # is E[r r^T] with r = (2/C)(z - y^), that is (4/C^2)(C/2) I = (2/C) I = H_z
    return z + math.sqrt(z.shape[-1] / 2.0) * n.to(device=z.device, dtype=z.dtype)


CATEGORICAL = LabelSampler("uniform", False, _categorical_labels)
GAUSSIAN = LabelSampler("normal", True, _gaussian_labels)


LOSSES = catalogue.LOSSES  # the losses by name, the built-ins declared below


def check_loss(entry: Entry, loss: Loss | Callable[[], Loss]) -> Loss:
    """A :class:`Loss` under its own name (a built-in's declared builder makes it), as its
    record: the kind's ``check`` (:data:`sharpcli.catalogue.LOSSES`)."""
    if not isinstance(loss, Loss) and declaration(loss) is not None:
        loss = loss()
    if not isinstance(loss, Loss) or loss.name != entry.name:
        raise LOSSES.error(f"loss {entry.name!r}: register a Loss under its own name")
    declared = (entry.summary, entry.info.get("classification", loss.classification))
    if (loss.description, loss.classification) != declared:
        raise LOSSES.error(f"loss {loss.name!r}: differs from its catalogue record {declared!r}")
    return loss


def loss_entry(name: str, loss: Loss) -> Entry:
    """The record of a :class:`Loss` registered without one (the kind's ``make_entry``)."""
    return Entry(name, loss.description, info={"classification": loss.classification})


def _declared(builder: Callable[[], Loss], **parts) -> Loss:
    """A built-in's Loss: name, description and ``classification`` from its builder's declaration."""
    entry = cast("tuple[str, Entry]", declaration(builder))[1]
    return Loss(entry.name, entry.summary, bool(entry.info["classification"]), **parts)


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


# losses configured with options over one analysis set (sharpcli.io.torch_losses.options), by their
# spec: looked up before the registry, never listed as names
CONFIGURED: dict[str, Loss] = {}


def get_loss(name: str) -> Loss:
    """The registered loss ``name``, or a loss configured with options
    (:func:`sharpcli.io.torch_losses.options.configure_loss`) under its spec.

    Args:
        name: the loss.

    Returns:
        Its record.

    Raises:
        RegistryError: (a UsageError, source ``loss``) an unknown name, listing the accepted.
    """
    configured = CONFIGURED.get(name) if isinstance(name, str) else None
    return configured if configured is not None else LOSSES.get(name)


def loss_fn(name: str):
    """Return ``f(z, y) -> mean loss over the batch`` for a loss name."""
    return get_loss(name).mean


def per_sample_loss(name: str, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss per sample, shape (B,)."""
    return get_loss(name).per_sample(z, y)


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


@declare(
    "loss",
    CROSS_ENTROPY,
    "softmax cross-entropy on (batch, classes) logits and class labels",
    info={"classification": True},
)
def cross_entropy() -> Loss:
    """``l = -log softmax(z)_y``, z (B, C), integer y; ``H_z = diag(p) - p p^T``."""
    return _declared(cross_entropy, check=_class_check, **_softmax_cross_entropy())


def _softmax_cross_entropy() -> dict:
    """The parts of ``-log softmax(z)_y`` that cross-entropy and nll share (all but the check)."""
    return dict(
        mean=lambda z, y: F.cross_entropy(z, y),
        per_sample=lambda z, y: F.cross_entropy(z, y, reduction="none"),
        hessian_matvec=_softmax_matvec,
        ggn_factor=_softmax_factor,
        correct=_argmax_correct,
        sampler=CATEGORICAL,
        softmax=True,
    )


# --------------------------------------------------------------------------- mse
def _mse_factor(z, y=None):
    scale = math.sqrt(2.0 / z.shape[-1])
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    for c in range(z.shape[-1]):
        yield scale * eye[c].expand_as(z)


def _is_class_labels(z, y) -> bool:
    """Whether ``y`` holds one integer class index per sample for outputs ``z`` of several
    columns (MSE then regresses the outputs on the one-hot rows)."""
    return not y.is_floating_point() and y.ndim == 1 and z.ndim == 2 and z.shape[1] > 1


def _mse_targets(z, y):
    """The regression targets of ``y`` in ``z``'s dtype and shape: real targets as they are,
    class labels as one-hot rows ``e_y`` (the MSE on one-hot targets of [Cohen2021]'s
    classification experiments)."""
    if _is_class_labels(z, y):
        return F.one_hot(y.long(), z.shape[1]).to(z.dtype)
    return y.to(z.dtype).reshape(z.shape)


def _mse_correct(z, y):
    """Class labels: the argmax of the outputs against the label; real targets count none."""
    if _is_class_labels(z, y):
        return _argmax_correct(z, y)
    return 0, 0


def _mse_check(z, y):
    if z.ndim != 2:
        return f"the model returns outputs of shape {tuple(z.shape)}, expected (batch, outputs)"
    if _is_class_labels(z, y):
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= z.shape[1]):
            return f"class labels must be in [0, {z.shape[1]}) for the model's {z.shape[1]} outputs"
        return None
    width = 1 if y.ndim == 1 else y.shape[1]
    if width != z.shape[1]:
        return f"targets have {width} columns but the model has {z.shape[1]} outputs"
    return None


@declare(
    "loss",
    MSE,
    "mean squared error (mean over the outputs); class labels as one-hot targets",
    info={"classification": False},
)
def mse() -> Loss:
    """``l = (1/C) ||z - y||^2`` (torch's ``mse_loss``, mean over the C outputs); ``H_z = (2/C) I``.

    Integer class labels (one per sample, ``C > 1`` outputs) are regressed as one-hot rows
    ``y = e_label``, as [Cohen2021] train classifiers under MSE; their accuracy is the
    argmax's.
    """
    return _declared(
        mse,
        mean=lambda z, y: F.mse_loss(z, _mse_targets(z, y)),
        per_sample=lambda z, y: F.mse_loss(z, _mse_targets(z, y), reduction="none").mean(dim=1),
        hessian_matvec=lambda z, y, u: (2.0 / z.shape[-1]) * u,
        ggn_factor=_mse_factor,
        correct=_mse_correct,
        check=_mse_check,
        sampler=GAUSSIAN,
    )


# --------------------------------------------------------------------------- element-wise losses
def outputs_per_sample(z: torch.Tensor) -> int:
    """``M``, the outputs of one sample of ``z`` (batch first): the product of ``z.shape[1:]``."""
    return math.prod(z.shape[1:])


def targets_as_outputs(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Targets in ``z``'s dtype and shape (sharp's one target per sample ``(B,)`` of a
    one-output model ``(B, 1)`` included)."""
    y = y.to(z.dtype)
    return y if y.shape == z.shape else y.reshape(z.shape)


def elementwise_factor(
    curvature: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], Iterator[torch.Tensor]]:
    """The square-root factor of a diagonal ``H_z = diag(h)``, ``h = curvature(z, y) >= 0``
    shaped like ``z``: one column per output ``m``, ``sqrt(h_m) e_m``."""

    def factor(z: torch.Tensor, y: torch.Tensor) -> Iterator[torch.Tensor]:
        h = curvature(z.detach(), y).reshape(z.shape[0], -1).clamp_min(0).sqrt()
        for m in range(h.shape[1]):
            column = torch.zeros_like(h)
            column[:, m] = h[:, m]
            yield column.reshape(z.shape)

    return factor


def _same_shape_check(what: str) -> Callable[[torch.Tensor, torch.Tensor], str | None]:
    def check(z: torch.Tensor, y: torch.Tensor) -> str | None:
        # per sample: a check may see one sample's outputs with the whole set's targets
        if y.shape[1:] == z.shape[1:] or (y.ndim == 1 and outputs_per_sample(z) == 1):
            return None
        outputs = "(N, " + ", ".join(str(d) for d in z.shape[1:]) + ")"
        return (
            f"targets have shape {tuple(y.shape)} but the model returns outputs {outputs}: "
            f"{what} takes targets of the outputs' shape (element-wise, as torch's module)"
        )

    return check


# --------------------------------------------------------------------------- binary cross-entropy
def _bce_elements(z, y):
    return F.binary_cross_entropy_with_logits(z, targets_as_outputs(z, y), reduction="none")


def _bce_curvature(z, y=None):
    s = torch.sigmoid(z)
    return s * (1 - s) / outputs_per_sample(z)


def _bce_check(z, y):
    problem = _same_shape_check("binary cross-entropy")(z, y)
    if problem:
        return problem
    if y.numel() and not bool(((y >= 0) & (y <= 1)).all()):
        return "binary cross-entropy needs labels in [0, 1] (0/1 labels or probabilities)"
    return None


def _bernoulli_outputs_labels(z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # y^ ~ Bernoulli(sigmoid z) per output; with M outputs per sample the loss is the mean over
    # them, l = (1/M) sum_m b_m, H_z = diag(s(1 - s))/M, while the gradient at y^ carries 1/M
    # twice: y~ = s + sqrt(M)(y^ - s) (the gradient s - y is linear in the target, which
    # binary_cross_entropy_with_logits takes as any number) gives E[r r^T] = H_z; y^ for M = 1
    labels = _bernoulli_labels(z, u)
    m = outputs_per_sample(z)
    if m == 1:
        return labels
    s = torch.sigmoid(z)
    return s + math.sqrt(m) * (labels - s)


@declare(
    "loss",
    BINARY_CROSS_ENTROPY,
    "binary cross-entropy with logits, element-wise on outputs of any shape, labels in [0, 1]",
    info={"classification": True},
)
def binary_cross_entropy() -> Loss:
    """Logits of any shape ``(B, ...)``, targets of the same shape in [0, 1] (one logit per
    sample: ``(B,)`` or ``(B, 1)`` with labels ``(B,)``; multi-label ``(B, K)``; per position
    ``(B, T, K)``): the mean over all elements, as ``nn.BCEWithLogitsLoss()``, so
    ``l_i = (1/M) sum_m softplus(z_m) - y_m z_m`` over the sample's ``M`` outputs;
    ``H_z = diag(s(z)(1 - s(z)))/M``, ``s`` the sigmoid."""
    return _declared(
        binary_cross_entropy,
        mean=lambda z, y: _bce_elements(z, y).mean(),
        per_sample=lambda z, y: _bce_elements(z, y).reshape(z.shape[0], -1).mean(1),
        hessian_matvec=lambda z, y, u: _bce_curvature(z) * u,
        ggn_factor=elementwise_factor(_bce_curvature),
        correct=lambda z, y: (
            ((z > 0) == (targets_as_outputs(z, y) > 0.5)).sum(),
            _count(z, y),
        ),
        check=_bce_check,
        sampler=LabelSampler("uniform", True, _bernoulli_outputs_labels),
    )


def bce_probabilities_curvature(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``d^2/dp^2`` of ``-(y log p + (1 - y) log(1 - p))`` per element, ``y/p^2 + (1 - y)/(1 - p)^2``
    (``>= 0`` for targets in [0, 1]), without the mean's ``1/M``."""
    t = targets_as_outputs(z, y)
    return t / z.square() + (1 - t) / (1 - z).square()


def _bce_probabilities_check(z, y):
    problem = _bce_check(z, y)
    if problem:
        return problem.replace("binary cross-entropy", "bce-probabilities")
    if z.numel() and not bool(((z >= 0) & (z <= 1)).all()):
        return (
            "bce-probabilities takes probabilities (a Sigmoid head) but the outputs range over "
            f"[{float(z.min()):.3g}, {float(z.max()):.3g}]; for logits use binary-cross-entropy "
            "(nn.BCEWithLogitsLoss)"
        )
    return None


@declare(
    "loss",
    BCE_PROBABILITIES,
    "binary cross-entropy on probabilities (a Sigmoid head), element-wise, as torch's BCELoss",
    info={"classification": True},
)
def bce_probabilities() -> Loss:
    """Outputs ``p`` in [0, 1] of any shape (a model ending in ``nn.Sigmoid``), targets of the
    same shape in [0, 1]: ``l_i = (1/M) sum_m -(y_m log p_m + (1 - y_m) log(1 - p_m))``, the
    mean over all elements as ``nn.BCELoss()``; ``H_z = diag(y/p^2 + (1 - y)/(1 - p)^2)/M``, the
    curvature in the probabilities (so the Gauss-Newton matrix is the one through ``p``, not
    the logits': the Hessian is the same, the split differs). ``H_z`` depends on the
    observed target, so it draws no labels (no Fisher)."""

    def curvature(z, y):
        return bce_probabilities_curvature(z, y) / outputs_per_sample(z)

    def elements(z, y):
        return F.binary_cross_entropy(z, targets_as_outputs(z, y), reduction="none")

    return _declared(
        bce_probabilities,
        mean=lambda z, y: elements(z, y).mean(),
        per_sample=lambda z, y: elements(z, y).reshape(z.shape[0], -1).mean(1),
        hessian_matvec=lambda z, y, u: curvature(z, y) * u,
        ggn_factor=elementwise_factor(curvature),
        correct=lambda z, y: (
            ((z > 0.5) == (targets_as_outputs(z, y) > 0.5)).sum(),
            _count(z, y),
        ),
        check=_bce_probabilities_check,
    )


# --------------------------------------------------------------------------- Huber, smooth L1
def _huber_curvature(delta: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    # torch's huber_loss: 0.5 r^2 where |r| < delta, delta (|r| - delta/2) elsewhere; its second
    # derivative 1 inside, 0 outside (and at |r| = delta, as torch's double backward)
    def curvature(z, y):
        r = z - targets_as_outputs(z, y)
        return (r.abs() < delta).to(z.dtype) / outputs_per_sample(z)

    return curvature


def _smooth_l1_curvature(beta: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    # torch's smooth_l1_loss: 0.5 r^2 / beta where |r| < beta, |r| - beta/2 elsewhere (beta = 0:
    # the L1 loss, second derivative 0 wherever it is defined)
    def curvature(z, y):
        if beta == 0:
            return torch.zeros_like(z)
        r = z - targets_as_outputs(z, y)
        return (r.abs() < beta).to(z.dtype) / (beta * outputs_per_sample(z))

    return curvature


def robust_regression(
    builder: Callable[[], Loss],
    elements: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    curvature: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    what: str,
) -> Loss:
    """An element-wise regression loss averaged over every output, ``l_i = (1/M) sum_m
    e(z_m, y_m)``, with ``H_z = diag(curvature(z, y))`` (the ``1/M`` included)."""
    return _declared(
        builder,
        mean=lambda z, y: elements(z, targets_as_outputs(z, y)).mean(),
        per_sample=lambda z, y: (
            elements(z, targets_as_outputs(z, y)).reshape(z.shape[0], -1).mean(1)
        ),
        hessian_matvec=lambda z, y, u: curvature(z, y) * u,
        ggn_factor=elementwise_factor(curvature),
        check=_same_shape_check(what),
    )


@declare(
    "loss",
    HUBER,
    "Huber loss (delta 1), element-wise on outputs of any shape, as torch's HuberLoss",
    info={"classification": False},
)
def huber() -> Loss:
    """``e(r) = r^2/2`` for ``|r| < delta``, ``delta (|r| - delta/2)`` elsewhere, ``r = z - y``,
    ``delta = 1`` (``huber:delta=...`` for another), the mean over all outputs
    (``nn.HuberLoss``); ``H_z = diag(1[|r| < delta])/M``: piecewise, the GGN is the Hessian's
    part through the outputs as for MSE, and the NME vanishes where ``z`` is linear."""
    return robust_regression(
        huber,
        lambda z, y: F.huber_loss(z, y, reduction="none"),
        _huber_curvature(1.0),
        "huber",
    )


@declare(
    "loss",
    SMOOTH_L1,
    "smooth L1 loss (beta 1), element-wise on outputs of any shape, as torch's SmoothL1Loss",
    info={"classification": False},
)
def smooth_l1() -> Loss:
    """``e(r) = r^2/(2 beta)`` for ``|r| < beta``, ``|r| - beta/2`` elsewhere, ``r = z - y``,
    ``beta = 1`` (``smooth-l1:beta=...`` for another), the mean over all outputs
    (``nn.SmoothL1Loss``); ``H_z = diag(1[|r| < beta]/beta)/M`` (0 for ``beta = 0``, the L1 loss)."""
    return robust_regression(
        smooth_l1,
        lambda z, y: F.smooth_l1_loss(z, y, reduction="none"),
        _smooth_l1_curvature(1.0),
        "smooth-l1",
    )


# --------------------------------------------------------------------------- negative log-likelihood
def log_probability_problem(z: torch.Tensor, dim: int = -1) -> str | None:
    """Why ``z`` are not normalised log-probabilities over ``dim`` (``logsumexp = 0``), or None.

    The tolerance is the rounding of a log-softmax in ``z``'s dtype (1e-8 in float64, 1e-3
    below), far below what unnormalised logits give."""
    if not z.numel():
        return None
    lse = torch.logsumexp(z.detach().to(torch.float64), dim=dim)
    worst = float(lse.abs().max())
    tol = 1e-8 if z.dtype == torch.float64 else 1e-3
    if math.isfinite(worst) and worst <= tol:
        return None
    return (
        "nll takes log-probabilities (a LogSoftmax head) but the outputs' logsumexp over the "
        f"classes is {worst:.3g} away from 0; for logits use cross-entropy (nn.CrossEntropyLoss)"
    )


def _nll_check(z, y):
    return _class_check(z, y) or log_probability_problem(z)


@declare(
    "loss",
    NLL,
    "negative log-likelihood of log-probability outputs (a LogSoftmax head), as cross-entropy",
    info={"classification": True},
)
def nll() -> Loss:
    """``l = -z_y`` on log-probabilities ``z = log_softmax(a)`` (``nn.NLLLoss`` after
    ``nn.LogSoftmax``), differentiated as the cross-entropy ``-log softmax(z)_y``, which equals
    it wherever ``z`` is normalised (``log_softmax`` is idempotent): the same function of the
    parameters, the same Hessian. ``H_z = diag(p) - p p^T`` with ``p = exp(z)``, so the
    Gauss-Newton matrix is the one through the log-softmax, ``J_a^T (diag p - p p^T) J_a``
    (``(I - 1 p^T)`` of the log-softmax's Jacobian is annihilated), not ``0`` as the
    NLL's own Hessian in ``z`` would give; the outputs must be normalised (checked)."""
    return _declared(nll, check=_nll_check, **_softmax_cross_entropy())


# --------------------------------------------------------------------------- token cross-entropy
TOKEN_REDUCTIONS = catalogue.TOKEN_REDUCTIONS
_MEAN_POSITIONS: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "sharp_token_mean_positions", default=None
)


def _mean_positions(reduction: str, y: torch.Tensor | None) -> float | None:
    """``nbar`` of ``y`` for ``tokens`` (None for ``samples``, or no labelled position)."""
    if reduction not in TOKEN_REDUCTIONS:
        raise UsageError(
            f"unknown token reduction {reduction!r}; accepted: {', '.join(TOKEN_REDUCTIONS)}",
            source="token_reduction",
        )
    if reduction == "tokens" and y is not None and y.ndim == 2 and y.shape[0]:
        labelled = int((y != IGNORE_INDEX).sum())
        return labelled / y.shape[0] if labelled else None
    return None


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
    mean_positions = _mean_positions(reduction, y)
    _MEAN_POSITIONS.set(mean_positions)
    return mean_positions


@contextlib.contextmanager
def token_reduction(reduction: str, y: torch.Tensor | None) -> Iterator[float | None]:
    """:func:`set_token_reduction` for the set ``y`` inside the block, the averaging in force
    before it restored after it (a training run's test set inside its training set's mean).

    Args:
        reduction: ``"tokens"`` or ``"samples"``.
        y: The set's token labels (N, T), ``-100`` marking unlabelled positions.

    Yields:
        ``nbar``, the mean labelled positions per sample (None for ``samples``).

    Raises:
        UsageError: (source ``token_reduction``) an unknown reduction.
    """
    mean_positions = _mean_positions(reduction, y)
    previous = _MEAN_POSITIONS.set(mean_positions)
    try:
        yield mean_positions
    finally:
        _MEAN_POSITIONS.reset(previous)


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


@declare(
    "loss",
    TOKEN_CROSS_ENTROPY,
    "cross-entropy per position of (batch, length, vocabulary) outputs, labels -100 ignored",
    info={"classification": True},
)
def token_cross_entropy() -> Loss:
    """Sequence outputs z (B, T, V) and token labels y (B, T), positions labelled ``-100``
    ignored: ``l_i = w_i sum_{t valid} -log softmax(z_it)_{y_it}`` with ``w_i = 1/n_i``
    (``n_i`` the sample's valid positions; per-sample averaging) or ``w_i = 1/nbar`` (``nbar``
    the mean valid positions per sample of the analysis or training set: the mean over all
    labelled tokens, the default; :func:`set_token_reduction`, :func:`token_reduction`);
    ``H_z`` is block diagonal over positions, ``w_i (diag p_t - p_t p_t^T)``."""
    return _declared(
        token_cross_entropy,
        mean=lambda z, y: _token_per_sample(z, y).mean(),
        per_sample=_token_per_sample,
        hessian_matvec=_token_matvec,
        ggn_factor=_token_factor,
        correct=_token_correct,
        check=_token_check,
        sampler=CATEGORICAL,
        per_token=True,
        softmax=True,
    )
