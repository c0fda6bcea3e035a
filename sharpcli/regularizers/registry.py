"""Registry of the sharpness regularizers of ``sharp train`` as gradient oracles.

``--reg NAME[:k=v,...]`` (repeatable) selects them; :func:`parse_reg` turns one option
into a :class:`Regularizer`, :func:`validate_combination` checks a list (once, when a
``TrainConfig`` is built), and :func:`sharpcli.regularizers.step.training_step` leaves the
gradient of the regularised objective at theta in ``p.grad`` of every trainable parameter.
The classes live in :mod:`sharpcli.regularizers.penalties` and
:mod:`sharpcli.regularizers.perturbed`, one module per paper family; this module checks and
parses them. The optimizer and the schedule stay plain: each
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
step's ``generator``, so a resumed run reproduces bit-for-bit. How a step runs the passes
(dropout masks, BatchNorm statistics, perturbed weights) and counts their cost
(``StepStats.grad_evals``, each class documenting its own): :mod:`sharpcli.regularizers.step`.
"""

from __future__ import annotations

from typing import Any, Sequence

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.registry import Entry
from sharpcli.regularizers.base import (
    _PARAMETER,
    Oracle,
    Penalty,
    Regularizer,
    family_of,
    regularizer_entry,
)
from sharpcli.regularizers.penalties.decay import NoRegularizer

__all__ = [
    "REGISTRY",
    "register",
    "unregister",
    "data_parallel_refusal",
    "parse_reg",
    "parse_regs",
    "validate_combination",
    "model_overrides",
]


# --------------------------------------------------------------------------- registry and parsing
# The regularizers by name: sharpcli.catalogue.REGULARIZERS, whose records the built-in classes
# declare in their bodies (declare_regularizer; the index is generated from them).
REGISTRY = catalogue.REGULARIZERS
_KIND_BASES: dict[str, type[Regularizer]] = {
    NoRegularizer.kind: Regularizer,
    "model": Regularizer,
    "penalty": Penalty,
    "oracle": Oracle,
}


def check_regularizer_class(entry: Entry, cls: type[Regularizer]) -> type[Regularizer]:
    """The registry's check of a regularizer class (see :func:`register`): the kind's ``check``
    (:data:`sharpcli.catalogue.REGULARIZERS`)."""
    where = f"regularizer class {getattr(cls, '__name__', cls)!r}"
    if not (isinstance(cls, type) and issubclass(cls, Regularizer)):
        raise REGISTRY.error(f"{where}: a regularizer is a subclass of Regularizer")
    if cls.name != entry.name:
        raise REGISTRY.error(f"{where}: its name {cls.name!r} is not {entry.name!r}")
    name = entry.name
    base = _KIND_BASES.get(cls.kind)
    if base is None or not issubclass(cls, base):
        raise REGISTRY.error(
            f"{where}: kind {cls.kind!r} must be one of {', '.join(_KIND_BASES)}, "
            "a penalty subclassing Penalty and an oracle subclassing Oracle"
        )
    if not cls.summary or not cls.__doc__ or name not in cls.__doc__:
        raise REGISTRY.error(f"{where}: needs a summary and a docstring that names {name!r}")
    if "data_parallel" not in vars(cls):
        raise REGISTRY.error(
            f"{where}: set data_parallel in the class body: None when averaging per-rank "
            "gradients is exact, else the reason it is not"
        )
    reason = cls.data_parallel
    if reason is not None and not (isinstance(reason, str) and reason.strip()):
        raise REGISTRY.error(f"{where}: data_parallel must be None or a non-empty reason")
    cls()  # the defaults must pass the hyper-parameters' own checks
    return cls


def regularizer_class_entry(name: str, cls: type[Regularizer]) -> Entry:
    """The record of a regularizer class registered without one: its class body's
    (:func:`~sharpcli.regularizers.base.regularizer_entry`); the kind's ``make_entry``."""
    return regularizer_entry(cls)


def register(cls: type[Regularizer], *, replace: bool = False) -> type[Regularizer]:
    """Add a regularizer class to :data:`REGISTRY` as ``cls.name`` (usable as a class decorator).

    A built-in's class is declared by
    :func:`~sharpcli.regularizers.base.declare_regularizer` and found in the catalogue's
    index; an extension is registered here. Both state their record in the class body (see
    :class:`Regularizer`): the class must carry a name ``--reg`` can parse, a known ``kind`` with the matching base class, a
    summary, a docstring naming the regularizer, ``data_parallel`` (``None`` or a non-empty
    reason) and defaults its own hyper-parameters accept.

    Args:
        cls: the class.
        replace: replace a class registered under the same name.

    Returns:
        ``cls``.

    Raises:
        RegistryError: a malformed or taken name, or a class missing part of its record.
    """
    return REGISTRY.register(cls.name, cls, replace=replace)


def unregister(name: str) -> type[Regularizer]:
    """Remove and return the class registered as ``name``.

    Args:
        name: the name.

    Returns:
        The class.

    Raises:
        RegistryError: nothing is registered as ``name``.
    """
    return REGISTRY.unregister(name)


def data_parallel_refusal(reg: Regularizer | type[Regularizer]) -> str | None:
    """Why averaging per-rank gradients is not exact for ``reg``, or None when it is.

    A class that does not state ``data_parallel`` in its own body (one put into
    :data:`REGISTRY` without :func:`register`) is refused rather than assumed exact.
    """
    cls = family_of(reg if isinstance(reg, type) else type(reg))
    if "data_parallel" not in vars(cls):
        return "it does not declare whether averaging per-rank gradients is exact (data_parallel)"
    return cls.data_parallel


def parse_reg(text: str) -> Regularizer:
    """Parse one ``--reg`` value: ``NAME``, ``NAME:v1,v2`` (positional in the documented
    order), ``NAME:k=v,...`` or a mix (positional first), by the one grammar of
    :func:`sharpcli.specs.parse_spec`. Missing hyper-parameters take their defaults.

    Args:
        text: the value.

    Returns:
        The regularizer.

    Raises:
        RegistryError: (a UsageError, source ``regs``) an unknown regularizer, listing the
            accepted names, or an unknown or bad hyper-parameter, listing the accepted ones.
    """
    entry, values = REGISTRY.parse(text)
    return REGISTRY[entry.name](**values)


def validate_combination(regs: Sequence[Regularizer]) -> None:
    """Check that ``--reg`` options combine: each name at most once and at most one
    perturbation oracle (sam, usam, asam, weight-noise, nso). Raises UsageError."""
    seen: set[str] = set()
    for reg in regs:
        if reg.name in seen and reg.name != NoRegularizer.name:
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
