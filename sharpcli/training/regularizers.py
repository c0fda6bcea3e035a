"""Registry of the sharpness regularizers of ``sharp train`` as gradient oracles.

``--reg NAME[:k=v,...]`` (repeatable) selects them; :func:`parse_reg` turns one option
into a :class:`Regularizer`, :func:`validate_combination` checks a list (once, when a
``TrainConfig`` is built), and :func:`sharpcli.training.step.training_step` leaves the
gradient of the regularised objective at theta in ``p.grad`` of every trainable parameter.
The classes live in :mod:`sharpcli.training.penalties`, one module per paper family; this
module registers them. The optimizer and the schedule stay plain: each
regularizer is a gradient oracle. User guide: docs/commands/train.md ("Regularizers").

Sources, by key of docs/references.md: ``wd`` [AD] section 2.3; ``dropout`` [AD] section 4.2;
``ad`` [AD] Theorem 2; ``gp`` [NME] eq. 7 (its update eq. 8; penalty SAM/USAM, App. B
eq. 46-47); ``hessian-trace`` [NME] section 5.2, eq. 19, by Hutchinson's estimator
[Hutchinson1989]; ``gn-trace`` [NME] eq. 20 [Wei2020]; ``sam`` [SAM] as in [NME] App. B
eq. 42; ``usam`` [USAM] as in [NME] App. B eq. 43; ``asam`` [ASAM] (combined with ``ad`` in
[AD] Table 1); ``weight-noise`` WP-SGD of [NSO] section 2.1 ([NME] eq. 17); ``nso`` [NSO]
Algorithm 1, eq. 4; ``fa`` [FA] eq. 1.

Three kinds of regularizer combine:

- *model* (``dropout``): changes how the model is built (:func:`model_overrides`).
- *additive penalties* (``wd``, ``ad``, ``gp``, ``hessian-trace``, ``gn-trace``, ``fa``):
  the objective is ``O(theta) = L(theta) + sum_k P_k(theta)``, ``L`` the batch-mean
  task loss of :func:`sharpcli.losses.loss_fn`.
- at most one *perturbation oracle* (``sam``, ``usam``, ``asam``, ``weight-noise``,
  ``nso``): the gradient it returns is ``grad O`` evaluated at perturbed weights,
  applied at theta. Without an oracle the gradient is ``grad O(theta)``.

Every random draw (weight noise, Hutchinson probes, sampled labels) comes from the
step's ``generator`` so a resumed run reproduces bit-for-bit; dropout masks come from
the global torch RNG and every pass of a step replays the same masks. Extra passes
leave BatchNorm running statistics as the clean pass left them; perturbed weights are
restored by copy. ``StepStats.grad_evals`` counts gradient evaluations as defined in
:mod:`sharpcli.training.step` (plain gradient 1, double-backward 2, triple 4); each
class documents its count.
"""

from __future__ import annotations

from typing import Any, Sequence

from sharpcli.errors import UsageError
from sharpcli.training.penalties.base import (
    _PARAMETER,
    HyperParam,
    Oracle,
    Penalty,
    Regularizer,
    _accepted_params,
)
from sharpcli.training.penalties.decay import ActivationDecay, Dropout, NoRegularizer, WeightDecay
from sharpcli.training.penalties.flatness import FlatnessAware, auto_step_length
from sharpcli.training.penalties.nme import GaussNewtonTrace, GradientPenalty, HessianTrace
from sharpcli.training.penalties.noise import NSO, WeightNoise
from sharpcli.training.penalties.sam import ASAM, SAM, USAM
from sharpcli.training.step import StepStats, training_step

__all__ = [
    "StepStats",
    "HyperParam",
    "Regularizer",
    "Penalty",
    "Oracle",
    "REGISTRY",
    "register",
    "unregister",
    "data_parallel_refusal",
    "parse_reg",
    "parse_regs",
    "validate_combination",
    "model_overrides",
    "training_step",
    "describe_registry",
    "auto_step_length",
    "NoRegularizer",
    "Dropout",
    "WeightDecay",
    "ActivationDecay",
    "GradientPenalty",
    "HessianTrace",
    "GaussNewtonTrace",
    "FlatnessAware",
    "SAM",
    "USAM",
    "ASAM",
    "WeightNoise",
    "NSO",
]


# --------------------------------------------------------------------------- registry and parsing
REGISTRY: dict[str, type[Regularizer]] = {}
_KIND_BASES: dict[str, type[Regularizer]] = {
    "none": Regularizer,
    "model": Regularizer,
    "penalty": Penalty,
    "oracle": Oracle,
}
_NAME_FORBIDDEN = set(":,= ")  # characters that would break NAME:k=v,... parsing


def register(cls: type[Regularizer]) -> type[Regularizer]:
    """Add a regularizer class to :data:`REGISTRY` (usable as a class decorator).

    Checks what every entry must carry (see :class:`Regularizer`): a new lower-case name
    that ``--reg`` can parse, a known ``kind`` with the matching base class, a summary, a
    docstring naming the regularizer, ``data_parallel`` set in the class's own body
    (``None`` or a non-empty reason), and defaults its own hyper-parameters accept.
    Raises TypeError (a programming error, met at import) naming what is missing.
    """
    name = cls.name
    where = f"regularizer class {cls.__name__}"
    if not name or name != name.lower() or _NAME_FORBIDDEN & set(name):
        raise TypeError(
            f"{where}: name {name!r} must be non-empty, lower-case, without :,= or space"
        )
    if name in REGISTRY:
        raise TypeError(
            f"{where}: name {name!r} is already registered by {REGISTRY[name].__name__}"
        )
    base = _KIND_BASES.get(cls.kind)
    if base is None or not issubclass(cls, base):
        raise TypeError(
            f"{where}: kind {cls.kind!r} must be one of {', '.join(_KIND_BASES)}, "
            "a penalty subclassing Penalty and an oracle subclassing Oracle"
        )
    if not cls.summary or not cls.__doc__ or name not in cls.__doc__:
        raise TypeError(f"{where}: needs a summary and a docstring that names {name!r}")
    if "data_parallel" not in vars(cls):
        raise TypeError(
            f"{where}: set data_parallel in the class body: None when averaging per-rank "
            "gradients is exact, else the reason it is not"
        )
    reason = cls.data_parallel
    if reason is not None and not (isinstance(reason, str) and reason.strip()):
        raise TypeError(f"{where}: data_parallel must be None or a non-empty reason")
    cls()  # the defaults must pass the hyper-parameters' own checks
    REGISTRY[name] = cls
    return cls


def unregister(name: str) -> type[Regularizer]:
    """Remove and return the class registered as ``name`` (KeyError when there is none)."""
    return REGISTRY.pop(name)


for _builtin in (
    NoRegularizer,
    WeightDecay,
    Dropout,
    ActivationDecay,
    SAM,
    USAM,
    ASAM,
    GradientPenalty,
    HessianTrace,
    GaussNewtonTrace,
    WeightNoise,
    NSO,
    FlatnessAware,
):
    register(_builtin)
del _builtin


def data_parallel_refusal(reg: Regularizer | type[Regularizer]) -> str | None:
    """Why averaging per-rank gradients is not exact for ``reg``, or None when it is.

    A class that does not state ``data_parallel`` in its own body (one put into
    :data:`REGISTRY` without :func:`register`) is refused rather than assumed exact.
    """
    cls = reg if isinstance(reg, type) else type(reg)
    if "data_parallel" not in vars(cls):
        return "it does not declare whether averaging per-rank gradients is exact (data_parallel)"
    return cls.data_parallel


def describe_registry() -> list[dict[str, Any]]:
    """One row per regularizer (for ``--help`` and reports): name, kind, summary, its
    hyper-parameters with defaults in positional order, ``data_parallel`` (None when exact
    under torchrun, else why not) and ``needs_penultimate``."""
    return [
        {
            "name": name,
            "kind": cls.kind,
            "summary": cls.summary,
            "data_parallel": data_parallel_refusal(cls),
            "needs_penultimate": cls.needs_penultimate,
            "hyperparameters": [
                {
                    "name": h.name,
                    "default": h.default,
                    "doc": h.doc,
                    "choices": list(h.choices) or None,
                }
                for h in cls.HYPERPARAMS
            ],
        }
        for name, cls in REGISTRY.items()
    ]


def parse_reg(text: str) -> Regularizer:
    """Parse one ``--reg`` value: ``NAME``, ``NAME:v1,v2`` (positional in the documented
    order), ``NAME:k=v,...`` or a mix (positional first). Missing hyper-parameters take
    their defaults. Raises UsageError(source="regs") listing the accepted names for an
    unknown regularizer and the accepted hyper-parameters for an unknown or bad one."""
    raw = text.strip()
    name, _, body = raw.partition(":")
    name = name.strip().lower()
    if name not in REGISTRY:
        shown = name or raw
        raise UsageError(
            f"unknown regularizer {shown!r}; accepted: {', '.join(REGISTRY)}",
            source=_PARAMETER,
        )
    cls = REGISTRY[name]
    given: dict[str, str] = {}
    items = [item.strip() for item in body.split(",")] if body.strip() else []
    seen_keyword = False
    for position, item in enumerate(items):
        if not item:
            raise UsageError(
                f"{name}: empty hyper-parameter in {raw!r}; accepted: {_accepted_params(cls)}",
                source=_PARAMETER,
            )
        if "=" in item:
            key, _, value = item.partition("=")
            key = key.strip().lower()
            seen_keyword = True
            if key not in {h.name for h in cls.HYPERPARAMS}:
                raise UsageError(
                    f"{name}: unknown hyper-parameter {key!r}; accepted: {_accepted_params(cls)}",
                    source=_PARAMETER,
                )
        else:
            if seen_keyword:
                raise UsageError(
                    f"{name}: positional value {item!r} after a keyword in {raw!r}",
                    source=_PARAMETER,
                )
            if position >= len(cls.HYPERPARAMS):
                raise UsageError(
                    f"{name} takes at most {len(cls.HYPERPARAMS)} positional hyper-parameter(s) "
                    f"({_accepted_params(cls)}); got {len(items)} in {raw!r}",
                    source=_PARAMETER,
                )
            key, value = cls.HYPERPARAMS[position].name, item
        if key in given:
            raise UsageError(f"{name}: {key} given twice in {raw!r}", source=_PARAMETER)
        given[key] = value.strip()
    return cls(**given)


def validate_combination(regs: Sequence[Regularizer]) -> None:
    """Check that ``--reg`` options combine: each name at most once and at most one
    perturbation oracle (sam, usam, asam, weight-noise, nso). Raises UsageError."""
    seen: set[str] = set()
    for reg in regs:
        if reg.name in seen and reg.name != "none":
            raise UsageError(f"{reg.name} given more than once", source=_PARAMETER)
        seen.add(reg.name)
    oracles = [r.name for r in regs if r.kind == "oracle"]
    if len(oracles) > 1:
        accepted = ", ".join(n for n, c in REGISTRY.items() if c.kind == "oracle")
        raise UsageError(
            f"at most one perturbation regularizer ({accepted}) per run; got {', '.join(oracles)}",
            source=_PARAMETER,
        )


def model_overrides(regs: Sequence[Regularizer]) -> dict[str, Any]:
    """Model-construction arguments implied by the regularizers (each one's
    :meth:`Regularizer.model_args`): ``{"dropout": p}`` for ``dropout:p``."""
    out: dict[str, Any] = {}
    for reg in regs:
        out.update(reg.model_args())
    return out


def parse_regs(specs: Sequence[str | Regularizer]) -> list[Regularizer]:
    """Parse ``--reg`` values (already parsed ones are kept) and check that they combine.

    Args:
        specs: ``NAME[:k=v,...]`` texts or :class:`Regularizer` objects.

    Returns:
        The regularizers, in the given order.

    Raises:
        UsageError: an unknown or malformed spec, or a combination
            :func:`validate_combination` refuses.
    """
    regs = [s if isinstance(s, Regularizer) else parse_reg(s) for s in specs]
    validate_combination(regs)
    return regs
