"""Curvature tracked during training (``sharp train --track``), as the training-dynamics
figures of [MAN] (Fig. 3 and 5) record it.

Every K epochs the model is put in eval mode and, on a fixed seeded subset of
the training set, the chosen quantities are computed with the same curvature
engine as ``sharp eigen/trace/gn-nme``:

- ``eigen``:  ``lambda_max`` of the Hessian (Lanczos, residual tol 1e-3);
- ``trace``:  ``tr(H)`` by [Hutch++] (5% relative standard error, at most 200 matvecs);
- ``gn-nme``: ``tr(G)``, ``tr(N)`` and the NME share from shared probes;
- ``frobenius``: ``Tr(H^2)`` (the flatness of [FA] eq. 1).

Nothing here draws from the global RNG, so tracking does not change the
training trajectory (resume stays bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sharpcli import catalogue
from sharpcli.analyses.analyze import EIGEN, FROBENIUS, GN_NME, TRACE
from sharpcli.analyses.sharpness import SHARPNESS, SharpnessConfig, sharpness
from sharpcli.analyses.stability import scope_threshold
from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    ParamScope,
    frobenius_sq,
    hutchpp,
    lanczos,
)
from sharpcli.curvature.operators.preconditioned import (
    PreconditionedOperator,
    diagonal_preconditioner,
)
from sharpcli.curvature.operators.registry import GGN, HESSIAN, NME
from sharpcli.curvature.trace.split import gn_nme_split
from sharpcli.errors import UsageError
from sharpcli.registry import Entry, declare

TRACKABLE = catalogue.TRACKABLE
# the weight of the Gaussian mixed into a warm start vector (:func:`_top_eigenpair`)
WARM_NOISE = 1e-2
# the preconditioned sharpness of an adaptive optimizer ([Cohen2022]), tracked in training only
PRECONDITIONED = "preconditioned"


def check_tracked(names: list[str]) -> list[str]:
    """``names`` unchanged, or a UsageError on ``track`` naming those not in ``TRACKABLE``."""
    unknown = [n for n in names if n not in TRACKABLE]
    if unknown:
        raise UsageError(
            f"cannot track {', '.join(unknown)}; accepted: {', '.join(TRACKABLE)}", source="track"
        )
    return names


@dataclass
class StepContext:
    """The training step a measurement follows: what the stability quantities read besides
    the model, and what a quantity keeps from one measurement to the next.

    ``optimizer`` is the torch optimizer as it stands after the step (its ``param_groups``
    hold the hyper-parameters in force at that step, schedules included; its ``state`` holds
    Adam's second moments); None outside a training loop (``sharp analyze``, a bare
    :func:`measure`), where the quantities that need it are refused. ``step`` counts
    optimizer steps from 1, ``batch_size`` is the training mini-batch size (batch sharpness
    draws mini-batches of it from the tracked set). ``warm`` is each quantity's state carried
    between measurements, keyed by the quantity's name (the top eigenvector that warm-starts
    the next Lanczos run); one context is kept for a whole run so that it persists.
    """

    optimizer: Any = None
    step: int | None = None
    batch_size: int | None = None
    warm: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Budget:
    """What a tracked quantity may spend: the seed of its probes, the relative standard error
    ``tol`` and the products ``max_matvecs`` of each trace, the products of the eigenvalue
    (``eigen_max_matvecs``, None: ``min(P, 100)``); and ``step``, the training step the
    measurement follows (:class:`StepContext`: the optimizer, the warm starts)."""

    seed: int
    tol: float
    max_matvecs: int
    eigen_max_matvecs: int | None
    step: StepContext = field(default_factory=StepContext)


def _probed(estimator, engine, budget: Budget) -> tuple[float, int]:
    """A probe estimator of the Hessian (``hutchpp``, ``frobenius_sq``) at the budget's
    tolerance, products and seed: its estimate and the products it took."""
    result = estimator(
        engine.hessian(), tol=budget.tol, max_matvecs=budget.max_matvecs, seed=budget.seed
    )
    return result.estimate, result.matvecs


# Each quantity (:data:`sharpcli.catalogue.TRACKABLE`, the names of the metrics of ``sharp
# analyze`` it follows) is a function ``(engine, out, budget) -> products``: ``engine`` the
# curvature engine (model in eval mode, the tracked subset), ``out`` the values so far, which
# it adds its own to, ``budget`` what it may spend (:class:`Budget`); it returns the curvature
# products it took. Each is declared here with the keys it adds and their ``column``: where
# they sit in a history row (its JSON and CSV keep that order, which is not the order
# ``--track`` lists the names in). :func:`measure` runs the chosen ones through the registry.


def _top_eigenpair(op, name: str, budget: Budget):
    """The top eigenpair of ``op`` by Lanczos (residual tol 1e-3, the budget's products and
    seed), warm-started from the eigenvector that the quantity ``name`` kept at the previous
    measurement (``budget.step.warm[name]``), which it then replaces.

    Along a training trajectory the top eigenvector moves little between measurements: the
    Krylov space grown from it certifies the same residual in a few products, where a cold
    Gaussian start needs tens. A stored vector of another size (another scope) is ignored.
    """
    warm = budget.step.warm
    start = warm.get(name)
    if start is not None and (
        start.shape[0] != op.shape[0] or not bool(torch.isfinite(start).all())
    ):
        start = None
    if start is not None:
        # a seeded Gaussian 1% of the start's norm keeps every direction in the Krylov space,
        # so that an eigenvalue that overtook the previous top one is still found; it costs
        # no measurable products (one in a hundred measurements on the tests' MLP)
        generator = torch.Generator().manual_seed(budget.seed)
        noise = torch.randn(start.shape[0], generator=generator, dtype=torch.float64)
        start = start.to(torch.float64) / torch.linalg.vector_norm(start.to(torch.float64))
        start = start + WARM_NOISE * noise.to(start.device) / torch.linalg.vector_norm(noise)
    top = lanczos(
        op,
        top_k=1,
        tol=1e-3,
        max_matvecs=budget.eigen_max_matvecs,
        seed=budget.seed,
        start=start,
        return_eigenvectors=True,
        explicit_residuals=False,
    )
    if top.eigenvectors is not None and top.eigenvectors.shape[1]:
        # kept in the products' dtype: one vector of P numbers per quantity
        warm[name] = top.eigenvectors[:, 0].to(op.dtype).clone()
    return top


def _threshold(budget: Budget, scope, source: str):
    """The optimizer's stability threshold for the scope's parameters
    (:func:`~sharpcli.analyses.stability.scope_threshold`), its refusal on ``source``."""
    optimizer = budget.step.optimizer
    if optimizer is None:
        return None
    try:
        return scope_threshold(optimizer, scope.params)
    except UsageError as error:
        raise UsageError(error.message, source=source) from error


@declare(
    "trackable",
    EIGEN,
    "lambda_max of the Hessian (Lanczos, residual tol 1e-3, warm-started from the previous "
    "measurement) and, in training with SGD, its stability threshold",
    paper="Cohen2021",
    info={"keys": ("lambda_max", "lambda_max_threshold"), "column": 1, "default": True},
)
def track_eigen(engine, out: dict, budget: Budget) -> int:
    """``lambda_max``; only the eigenvalue is recorded: no product spent on an explicit
    residual. Warm-started from the previous measurement's top eigenvector
    (:func:`_top_eigenpair`).

    ``lambda_max_threshold``: when the measurement follows a training step
    (``budget.step.optimizer``) of ``torch.optim.SGD``, the sharpness at which its step loses
    stability, 2/lr, (2 + 2 mu)/lr with momentum, (2 + 2 mu)/((1 + 2 mu) lr) Nesterov
    ([Cohen2021]; :func:`~sharpcli.analyses.stability.stability_threshold`). For an adaptive
    optimizer (Adam, AdamW, RMSprop) the threshold bounds the preconditioned sharpness (the
    ``preconditioned`` quantity), not lambda_max, and the key is left out; so it is for an
    optimizer of unknown threshold and for param groups with different thresholds."""
    top = _top_eigenpair(engine.hessian(), EIGEN, budget)
    out["lambda_max"] = top.eigenvalues[0]
    if budget.step.optimizer is not None:
        try:
            threshold = _threshold(budget, engine.scope, "track")
        except UsageError:  # lambda_max stands without a threshold
            threshold = None
        if threshold is not None and not threshold.preconditioned:
            out["lambda_max_threshold"] = threshold.value
    return top.matvecs


@declare(
    "trackable",
    PRECONDITIONED,
    "lambda_max of P^-1 H, P the adaptive optimizer's diag(sqrt(v_hat) + eps) at that step, "
    "and its threshold (2 + 2 beta1)/((1 - beta1) lr)",
    paper="Cohen2022",
    info={"keys": ("preconditioned_sharpness", "preconditioned_threshold"), "column": 1.5},
)
def track_preconditioned(engine, out: dict, budget: Budget) -> int:
    """``preconditioned_sharpness``: lambda_max of ``P^-1 H`` (Lanczos on the symmetric
    ``P^-1/2 H P^-1/2``, residual tol 1e-3, warm-started from the previous measurement), ``P``
    the diagonal preconditioner of the training optimizer's state after the step (Adam, AdamW:
    ``sqrt(v / (1 - beta2^t)) + eps``; RMSprop: ``sqrt(v) + eps``); and
    ``preconditioned_threshold``, where training holds it ([Cohen2022]): ``(2 + 2 beta1)/((1 -
    beta1) lr)`` (38/lr at beta1 = 0.9), 2/lr for RMSprop ((2 + 2 mu)/lr with momentum).

    Raises:
        UsageError: (``track``) no optimizer (outside a training loop), an optimizer that is
            not adaptive (SGD: track ``eigen``, whose threshold is 2/lr), one that has not
            stepped yet.
    """
    if budget.step.optimizer is None:
        raise UsageError(
            f"{PRECONDITIONED} needs the training optimizer (Adam, AdamW or RMSprop); it is "
            "measured in training only",
            source="track",
        )
    threshold = _threshold(budget, engine.scope, "track")
    if threshold is None or not threshold.preconditioned:
        raise UsageError(
            f"{PRECONDITIONED} needs an adaptive optimizer (Adam, AdamW or RMSprop), not "
            f"{type(budget.step.optimizer).__name__}; its lambda_max and threshold are "
            f"tracked by {EIGEN}",
            source="track",
        )
    try:
        diagonal = diagonal_preconditioner(budget.step.optimizer, engine.scope)
    except UsageError as error:
        raise UsageError(error.message, source="track") from error
    top = _top_eigenpair(PreconditionedOperator(engine.hessian(), diagonal), PRECONDITIONED, budget)
    out["preconditioned_sharpness"] = top.eigenvalues[0]
    out["preconditioned_threshold"] = threshold.value
    return top.matvecs


@declare(
    "trackable", TRACE, "tr(H) by Hutch++", paper="Hutch++", info={"keys": ("trace",), "column": 2}
)
def track_trace(engine, out: dict, budget: Budget) -> int:
    """``trace``: tr(H) ([Hutch++])."""
    out["trace"], products = _probed(hutchpp, engine, budget)
    return products


@declare(
    "trackable",
    GN_NME,
    "tr(G), tr(N) and the NME share, from shared probes",
    paper="NME",
    info={"keys": ("ggn_trace", "nme_trace", "nme_share"), "column": 4},
)
def track_gn_nme(engine, out: dict, budget: Budget) -> int:
    """``ggn_trace``, ``nme_trace``, ``nme_share`` (shared probes)."""
    split = gn_nme_split(engine, tol=budget.tol, max_matvecs=budget.max_matvecs, seed=budget.seed)
    h = split.values[HESSIAN]["trace"]["estimate"]
    out["ggn_trace"] = split.values[GGN]["trace"]["estimate"]
    out["nme_trace"] = split.values[NME]["trace"]["estimate"]
    out["nme_share"] = out["nme_trace"] / h if h else None
    return split.matvecs


@declare(
    "trackable",
    FROBENIUS,
    "Tr(H^2), the flatness of [FA] eq. 1",
    paper="FA",
    info={"keys": ("frobenius_sq",), "column": 3},
)
def track_frobenius(engine, out: dict, budget: Budget) -> int:
    """``frobenius_sq``: Tr(H^2)."""
    out["frobenius_sq"], products = _probed(frobenius_sq, engine, budget)
    return products


@declare(
    "trackable",
    SHARPNESS,
    "adaptive worst-case l2 sharpness at rho 0.05 (10 Auto-PGD steps)",
    paper="Andriushchenko2023",
    info={"keys": ("adaptive_sharpness",), "column": 5},
)
def track_sharpness(engine, out: dict, budget: Budget) -> int:
    """``adaptive_sharpness`` over the whole set (gradients, no curvature products)."""
    config = SharpnessConfig(rhos=(0.05,), steps=10, params=engine.scope.spec, seed=budget.seed)
    out["adaptive_sharpness"] = sharpness(engine.model, engine.data, config).rows[0].sharpness
    return 0


def measure(
    engine,
    names: list[str],
    *,
    seed: int = 0,
    tol: float = 5e-2,
    max_matvecs: int = 200,
    eigen_max_matvecs: int | None = None,
    step: StepContext | None = None,
) -> tuple[dict, int]:
    """``(values, products)``: the quantities ``names`` (:data:`TRACKABLE`) of the curvature
    pass ``engine`` (model already in eval mode) and the curvature products they took.

    Keys: ``lambda_max`` (Lanczos, residual tol 1e-3, at most ``eigen_max_matvecs`` products,
    default ``min(P, 100)``), ``trace`` ([Hutch++]), ``frobenius_sq`` and ``ggn_trace``,
    ``nme_trace``, ``nme_share`` (shared probes), the traces to relative standard error ``tol``
    or ``max_matvecs`` products each; ``adaptive_sharpness``: [Andriushchenko2023]'s adaptive
    worst-case l2 sharpness at rho 0.05 over the whole set (10 Auto-PGD steps; gradients, no
    curvature products). ``step``: the training step the measurement follows
    (:class:`StepContext`; None: none, as outside a training loop).
    """

    check_tracked(names)
    budget = Budget(seed, tol, max_matvecs, eigen_max_matvecs, step or StepContext())
    out: dict = {}
    products = 0
    for entry in sorted(TRACKABLE.entries(), key=_column):
        if entry.name in names:
            products += TRACKABLE.get(entry.name)(engine, out, budget)
    return out, products


def _column(entry: Entry) -> float:
    """Where a quantity's keys sit in a history row (an extension without one: last)."""
    return entry.info.get("column", math.inf)


class RunTracker:
    """The curvature tracked through one training run (``sharp train --track``): one
    :class:`CurvatureEngine` kept for the run and refreshed (its cached graphs dropped) at each
    measurement, and one :class:`StepContext` filled at each tracked step with the optimizer,
    the step count and the training batch size, so that the quantities' warm starts
    (``StepContext.warm``) persist from one measurement to the next. The in-memory tracker for
    one's own loop is :class:`sharpcli.Tracker`.

    ``tracker(model, x, y, loss, optimizer=..., step=..., batch_size=...)`` measures the
    quantities ``names`` of ``model`` (put in eval mode, its mode restored) on ``(x, y)``: the
    same tensors as last time reuse the engine's data, other tensors (the training batch of
    ``--track-on batch``) replace it. Nothing draws from the global RNG.
    """

    def __init__(
        self,
        names: list[str],
        *,
        seed: int = 0,
        batch_size: int = 256,
        tol: float = 5e-2,
        max_matvecs: int = 200,
    ) -> None:
        self.names = check_tracked(names)
        self.seed, self.batch_size, self.tol, self.max_matvecs = seed, batch_size, tol, max_matvecs
        self.context = StepContext()
        self.engine: CurvatureEngine | None = None
        self._probe: tuple[torch.Tensor, torch.Tensor] | None = None  # the engine's (x, y)
        self.products = 0  # the curvature products of the last measurement

    def _engine_for(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str
    ) -> CurvatureEngine:
        """The run's engine, on ``(x, y)``, its cached graphs dropped (the weights moved)."""
        engine = self.engine
        if engine is None or engine.model is not model:
            engine = CurvatureEngine(
                model,
                AnalysisData(x, y, loss=loss, batch_size=self.batch_size),
                ParamScope.resolve(model, None),
            )
            self.engine, self._probe = engine, (x, y)
        elif self._probe is None or self._probe[0] is not x or self._probe[1] is not y:
            engine.data = AnalysisData(x, y, loss=loss, batch_size=self.batch_size)
            self._probe = (x, y)
        engine.clear_cache()
        return engine

    def __call__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        loss: str,
        *,
        optimizer: Any = None,
        step: int | None = None,
        batch_size: int | None = None,
    ) -> dict:
        """The tracked quantities now (:func:`measure`), after optimizer step ``step``."""
        self.context.optimizer = optimizer
        self.context.step = step
        self.context.batch_size = batch_size
        was_training = model.training
        model.eval()
        try:
            engine = self._engine_for(model, x, y, loss)
            values, self.products = measure(
                engine,
                self.names,
                seed=self.seed,
                tol=self.tol,
                max_matvecs=self.max_matvecs,
                step=self.context,
            )
            return values
        finally:
            model.train(was_training)


def make_tracker(
    names: list[str],
    *,
    seed: int = 0,
    batch_size: int = 256,
    tol: float = 5e-2,
    max_matvecs: int = 200,
) -> RunTracker:
    """The :class:`RunTracker` of the quantities ``names`` for one ``sharp train`` run."""
    return RunTracker(names, seed=seed, batch_size=batch_size, tol=tol, max_matvecs=max_matvecs)
