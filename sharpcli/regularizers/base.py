"""The base classes of the regularizers of ``sharp train``: hyper-parameters, modes, kinds.

A :class:`Regularizer` is a name, typed hyper-parameters (:class:`~sharpcli.specs.Param`) and a kind:
``"none"``, ``"model"`` (changes the model's construction), ``"penalty"`` (an additive
:class:`Penalty` declaring its :class:`~sharpcli.regularizers.passes.PenaltyNeeds`) or
``"oracle"`` (an :class:`Oracle` returning the gradient at perturbed weights). A regularizer
whose ``mode`` hyper-parameter selects different computations is a family: one class per mode,
declared by :func:`declare_mode` (``@declare_mode("exact") class Exact(Family)``), picked when
the regularizer is parsed.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterator, Protocol, Sequence, TypeVar, runtime_checkable

import torch

from sharpcli.errors import UsageError
from sharpcli.registry import DECLARATION, Entry
from sharpcli.regularizers.passes import PassContext, PassResult, PenaltyNeeds, StepPasses
from sharpcli.specs import Param, format_value

__all__ = [
    "MODE",
    "Regularizer",
    "Penalty",
    "PenaltyNeeds",
    "Oracle",
    "PerturbationOracle",
    "central_gradients",
    "declare_regularizer",
    "regularizer_entry",
]

R = TypeVar("R", bound="Regularizer")
# the signature of the oracles' perturbations: one tensor per trainable parameter, their names
# (None where unknown), and the points of a step as (displacement, sign)
Tensors = Sequence[torch.Tensor]
ParamNames = Sequence[str] | None
Points = Iterator[tuple[list[torch.Tensor], float]]

# The parameter regularizer errors name: TrainConfig.regs, training_step(regs); the CLI's --reg.
_PARAMETER = "regs"
# the hyper-parameter whose value picks the class of a regularizer with modes
MODE = "mode"


def regularizer_entry(cls: type[Regularizer]) -> Entry:
    """A regularizer class's record, read from its own body (its declaration).

    Args:
        cls: the class (a family, not one of its mode classes).

    Returns:
        The record the catalogue's index holds for it: name, summary, ``HYPERPARAMS``, paper,
        ``data_parallel`` (from the class's own namespace; None if it does not state it) and,
        in ``info``, its ``kind`` and ``needs_penultimate``.
    """
    return Entry(
        cls.name,
        cls.summary,
        f"{cls.__module__}:{cls.__qualname__}",
        tuple(cls.HYPERPARAMS),
        paper=cls.paper,
        data_parallel=vars(cls).get("data_parallel"),
        info={"kind": cls.kind, "needs_penultimate": cls.needs_penultimate},
    )


def declare_regularizer(cls: type[R]) -> type[R]:
    """Declare a built-in regularizer: its class body is its record (a class decorator).

    ``python -m sharpcli.catalogue.generate`` writes the record (:func:`regularizer_entry`)
    into the catalogue's index, from which ``--reg``, ``--help`` and completion list it and
    :data:`sharpcli.catalogue.REGULARIZERS` imports the class on first use.

    Args:
        cls: the class, stating ``name``, ``summary``, ``HYPERPARAMS``, ``paper``,
            ``data_parallel`` and, where not its base's, ``kind`` and ``needs_penultimate``.

    Returns:
        ``cls``, its record in its ``__sharp_declaration__``.
    """
    setattr(cls, DECLARATION, ("regularizer", regularizer_entry(cls)))
    return cls


def declare_mode(mode: str) -> Callable[[type[R]], type[R]]:
    """Declare a class as the computation of ``mode=NAME`` of its family (a class decorator).

    The family is the class's direct base: a regularizer whose ``mode`` hyper-parameter picks,
    when it is parsed, the class that computes it (``gp:mode=exact`` or ``gp:mode=fd``). The
    family lists its modes in ``_modes`` (its own namespace); the mode class states its
    ``mode`` and ``_family``.

    Args:
        mode: the value of the family's ``mode`` hyper-parameter this class computes.
    """

    def decorate(cls: type[R]) -> type[R]:
        family = cls.__bases__[0]
        modes = vars(family).get("_modes")
        if modes is None:
            modes = {}
            setattr(family, "_modes", modes)
        if mode in modes:
            raise TypeError(f"{family.__name__}: mode {mode!r} is declared twice")
        modes[mode] = cls
        cls.mode = mode
        setattr(cls, "_family", family)
        return cls

    return decorate


def modes_of(cls: type) -> dict[str, type]:
    """The mode classes of the family ``cls`` (:func:`declare_mode`), empty for a class that
    is not a family (its subclasses included: each starts its own)."""
    return vars(cls).get("_modes", {})


def family_of(cls: type[Regularizer]) -> type[Regularizer]:
    """The class registered under ``cls``'s name: its family for a mode class, else itself."""
    return vars(cls).get("_family", cls)


# --------------------------------------------------------------------------- base classes
class Regularizer:
    """A regularizer selected by ``--reg``: a name, hyper-parameters in effect, a kind.

    A registered class carries everything about itself in its own body (:func:`register`
    checks it); a built-in is declared by :func:`declare_regularizer` from that body, an
    extension registered with it:

    - ``name``: what ``--reg`` calls it; ``kind``: ``"none"``, ``"model"``, ``"penalty"``
      (subclass :class:`Penalty`) or ``"oracle"`` (subclass :class:`Oracle`);
    - ``HYPERPARAMS``: the hyper-parameters with defaults, in documented positional order;
    - ``summary``: one line for ``--help``; the class docstring: the formula, the paper
      key (NME, NSO, AD, FA, MAN, SAM, ASAM) and the cost in gradient evaluations;
    - ``data_parallel``: ``None`` when the row-weighted average of per-rank gradients
      (``sharpcli.training.data_parallel``) is the gradient of the global batch,
      otherwise the reason it is not, which the refusal under torchrun quotes. Every
      registered class has it in its own namespace (its body, or its record), never by
      inheritance: a new SAM variant that inherited "exact" would silently run as local SAM
      (a mode class has its family's);
    - ``per_replica``: for a regularizer that is not exact, the statement of what each rank
      computes on its own rows when it runs under torchrun anyway (its gradient is then the
      row-weighted average of the ranks' regularised gradients); ``None`` (the default)
      keeps it refused there with its ``data_parallel`` reason;
    - ``paper``: the key of docs/references.md it implements;
    - ``needs_penultimate``: whether it needs the input of the final ``nn.Linear``;
    - :meth:`model_args`: what it changes in the model's construction.

    ``params`` maps each hyper-parameter name to its value (JSON-serialisable); ``spec()``
    is the canonical ``name:k=v,...`` that :func:`parse_reg` accepts again.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # "none", "model", "penalty" or "oracle"
    HYPERPARAMS: ClassVar[tuple[Param, ...]] = ()
    summary: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    needs_penultimate: ClassVar[bool] = False  # needs the input of the final nn.Linear
    # Deliberately no default (see the class docstring); :func:`register` refuses a class
    # whose own body does not set it.
    data_parallel: ClassVar[str | None]
    # what each torchrun rank computes when ``data_parallel`` is a reason: None refuses it
    per_replica: ClassVar[str | None] = None
    # the mode this class computes, for a class declared with ``declare_mode(NAME)``
    mode: ClassVar[str | None] = None

    def __new__(cls, **params: Any) -> Regularizer:
        """An instance of the class of the ``mode`` given in ``params`` (or its default) when
        ``cls`` is a family with modes, else of ``cls`` itself. A ``mode`` that does not
        convert leaves ``cls``, whose ``__init__`` reports it in hyper-parameter order."""
        chosen = cls
        modes = modes_of(cls)
        mode = cls._given_mode(params) if cls.mode is None and modes else None
        if mode is not None:
            chosen = modes.get(mode, cls)
        return super().__new__(chosen)

    @classmethod
    def _given_mode(cls, params: dict[str, Any]) -> str | None:
        """The converted value of the ``mode`` hyper-parameter in ``params``, None if invalid."""
        (spec,) = [h for h in cls.HYPERPARAMS if h.name == MODE]
        value = params.get(MODE, spec.default)
        try:
            return spec.accept(cls.name, value, _PARAMETER)
        except UsageError:
            return None

    def __init__(self, **params: Any):
        known = {h.name: h for h in self.HYPERPARAMS}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise UsageError(
                f"{self.name}: unknown hyper-parameter {unknown[0]!r}; accepted: {_accepted_params(self)}",
                source=_PARAMETER,
            )
        self.params: dict[str, Any] = {}
        for h in self.HYPERPARAMS:
            value = params.get(h.name, h.default)
            self.params[h.name] = h.accept(self.name, value, _PARAMETER)
        if self.mode is None and modes_of(type(self)):
            raise TypeError(f"{self.name}: no class computes mode {self.params[MODE]!r}")
        if self.mode is not None and self.params[MODE] != self.mode:
            raise TypeError(
                f"{type(self).__name__} computes {self.name} mode={self.mode}, "
                f"not mode={self.params[MODE]}"
            )

    def model_args(self) -> dict[str, Any]:
        """Model-construction arguments this regularizer implies (none unless ``kind == "model"``)."""
        return {}

    def describe_mode(self) -> str | None:
        """What the selected ``mode`` computes, for a regularizer whose modes are different
        computations (``gp``, ``hessian-trace``, ``fa``); None for the others."""
        return None

    def run_record(self) -> dict[str, Any]:
        """What ran, for the train report and checkpoint metadata: ``spec`` (canonical),
        ``kind`` and ``computes`` (:meth:`describe_mode`, else the one-line summary)."""
        return {
            "spec": self.spec(),
            "kind": self.kind,
            "computes": self.describe_mode() or self.summary,
        }

    def spec(self) -> str:
        """Canonical text form ``name:k=v,...`` (``name`` alone without hyper-parameters)."""
        if not self.params:
            return self.name
        body = ",".join(f"{k}={format_value(v)}" for k, v in self.params.items())
        return f"{self.name}:{body}"

    def __repr__(self) -> str:
        return f"Regularizer({self.spec()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Regularizer) and self.spec() == other.spec()

    def __hash__(self) -> int:
        return hash(self.spec())


def _accepted_params(reg: type[Regularizer] | Regularizer) -> str:
    if not reg.HYPERPARAMS:
        return "(none)"
    return ", ".join(h.name for h in reg.HYPERPARAMS)


class Penalty(Regularizer):
    """An additive penalty :math:`P(\\theta)`: its value enters the objective and its gradient
    the step's gradient.

    What it needs from the step is its class's :class:`PenaltyNeeds` record ``needs`` (one per
    class: a regularizer whose modes compute differently has one class per mode). The engine
    (:class:`sharpcli.regularizers.passes.StepPasses`) calls :meth:`term` for the value (unless
    ``needs.deferred_value``), differentiates a value returned with a graph, adds
    :meth:`analytic_grad`, and runs :meth:`extra_passes` after the pass when
    ``needs.extra_passes``.
    """

    kind = "penalty"
    needs: ClassVar[PenaltyNeeds] = PenaltyNeeds()

    def term(self, ctx: PassContext) -> torch.Tensor:
        """The penalty's value at the current weights.

        Args:
            ctx: The pass: logits, loss, penultimate activation, ``grad L``, generator.

        Returns:
            A 0-dim tensor, with an autograd graph when its gradient comes from autograd.
        """
        raise TypeError(
            f"{type(self).__name__} is a penalty without a term(); define term() or extra_passes()"
        )

    def analytic_grad(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """A closed-form gradient of a term returned without a graph.

        Args:
            params: The trainable parameters, in the step's order.

        Returns:
            One tensor per parameter, or None when the gradient comes from elsewhere.
        """
        return None

    def extra_passes(
        self, engine: StepPasses, ctx: PassContext, want_grad: bool
    ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """Value and/or gradient from passes run after the pass (``needs.extra_passes``).

        Args:
            engine: The step's engine (``perturbed``, ``loss_gradient``).
            ctx: The pass just closed.
            want_grad: Whether the step differentiates the objective.

        Returns:
            ``(value or None, gradient list or None)``.
        """
        raise TypeError(f"{type(self).__name__} needs extra passes but defines no extra_passes()")


class Oracle(Regularizer):
    """A perturbation oracle: returns the gradient of the objective at perturbed weights.

    ``gradient(engine) -> (clean PassResult at theta, gradient list)``, what ``sharp train``
    runs. With ``perturbations()`` too (:class:`PerturbationOracle`; one point not reading the
    clean gradient unless it overrides the two methods below) it runs in one's own loop.
    """

    kind = "oracle"

    def gradient(self, engine: StepPasses) -> tuple[PassResult, list[torch.Tensor]]:
        """The reported pass and the gradient of the objective at perturbed weights.

        Args:
            engine: The step's engine.

        Returns:
            ``(reported PassResult, one gradient tensor per trainable parameter)``.
        """
        raise TypeError(f"{type(self).__name__} is an oracle without gradient()")

    def reads_clean_gradient(self) -> bool:
        """Whether its points read the clean gradient (:class:`PerturbationOracle`): no."""
        return False

    def perturbed_passes(self) -> int:
        """The points of a step (:class:`PerturbationOracle`): one."""
        return 1


@runtime_checkable
class PerturbationOracle(Protocol):
    """An oracle that one's own loop runs, through :class:`sharpcli.regularizers.PerturbedOptimizer`.

    The wrapper calls these methods and nothing else of the oracle's algorithm: a step moves
    the weights to each point :math:`\\theta + s\\,\\delta` that :meth:`perturbations`
    yields, runs the backward there, restores :math:`\\theta` by copy and steps with the mean of
    those gradients. An oracle that defines them (the ascent family by
    :meth:`~sharpcli.regularizers.perturbed.sam.AscentOracle.perturbation`, ``weight-noise``,
    ``nso``) runs in one's own loop as in ``sharp train``; one that defines only
    :meth:`Oracle.gradient` runs under ``sharp train`` only.
    """

    def reads_clean_gradient(self) -> bool:
        """Whether the points depend on the gradient at :math:`\\theta` (a clean backward first)."""
        ...

    def perturbed_passes(self) -> int:
        """How many points a step averages the gradient over (``first_step`` needs 1)."""
        ...

    def perturbations(
        self, weights: Tensors, grads: Tensors | None, names: ParamNames, generator: torch.Generator
    ) -> Points:
        """The points of one step, as displacements from the weights.

        Args:
            weights: The trainable parameters (detached), in order.
            grads: The clean gradient at :math:`\\theta` when :meth:`reads_clean_gradient`,
                else None.
            names: The parameters' names (``model.named_parameters()``), None where unknown.
            generator: The generator of the oracle's random draws.

        Yields:
            ``(delta, sign)``: the point :math:`\\theta + s\\,\\delta`, one tensor per parameter.
        """
        ...


def central_gradients(
    engine: StepPasses, step: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``grad L`` on both sides of the current weights, for a central finite difference.

    .. math:: g_\\pm = \\nabla L(\\theta \\pm \\delta)

    Each is an extra pass of the step (1 gradient evaluation, at the clean pass's dropout
    masks and BatchNorm state); the weights are restored by copy after each.

    Args:
        engine: The step's engine.
        step: The displacement :math:`\\delta`, one tensor per trainable parameter.

    Returns:
        ``(g_plus, g_minus)``.
    """
    with engine.perturbed(step):
        plus = engine.loss_gradient()
    with engine.perturbed(step, sign=-1.0):
        minus = engine.loss_gradient()
    return plus, minus
