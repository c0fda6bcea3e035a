r"""Curvature along the training step: batch sharpness, critical sharpness, the gradient's share
in the top eigenspace; each a tracked quantity of ``sharp train --track`` and ``Tracker``.

- **Batch sharpness** ([Andreyev2024]): the expected directional curvature of a mini-batch's
  Hessian along its own gradient,

  .. math::

      \mathrm{BS} = \mathbb{E}_B \left[ \frac{g_B^\top H_B\, g_B}{\lVert g_B \rVert^2} \right],

  :math:`g_B, H_B` the gradient and Hessian of the mini-batch loss :math:`L_B` (the mean over
  the batch's samples). Mini-batch SGD at learning rate :math:`\eta` holds it near
  :math:`2/\eta` (the edge of stochastic stability). :func:`batch_sharpness` averages it over
  mini-batches of the training batch size drawn without replacement from the analysis set (a
  seeded permutation cut into ``N // b`` batches; no global RNG), one gradient and ONE Hessian
  product per batch (:math:`H_B g_B`, whose dot with :math:`g_B` is the numerator), with the
  standard error :math:`s / \sqrt{n}` over the ``n`` batches (:math:`s` their sample standard
  deviation; the error of a mean of independent draws, which the draws without replacement
  can only make smaller). It is the mean of the ratios, as the paper's estimator, not the
  ratio of the means :math:`\mathbb{E}[g_B^\top H_B g_B] / \mathbb{E}[\lVert g_B \rVert^2]`
  (each batch's numerator and denominator are kept: :class:`BatchSharpness`).
- **Critical sharpness** ([Kalra2026]): :math:`\lambda_c = 2 / \eta_c`, :math:`\eta_c` the
  smallest learning rate at which one step along the update direction :math:`d` raises the
  loss, :math:`L(\theta + \eta_c d) = L(\theta)`. On a quadratic model of the loss along
  :math:`d`, :math:`L(\theta + \eta d) = L + \eta\, g^\top d + \frac{\eta^2}{2} d^\top H d`, so
  :math:`\eta_c = -2 g^\top d / d^\top H d` and

  .. math::

      \lambda_c = \frac{d^\top H d}{-g^\top d},

  the Rayleigh quotient of H along g for gradient descent (:math:`d = -g`). For any loss,
  exactly, :math:`\lambda_c = \kappa(\eta_c) / (-g^\top d)` with
  :math:`\kappa(\eta) = 2 (L(\theta + \eta d) - L(\theta) - \eta\, g^\top d) / \eta^2 =
  2 \int_0^1 (1 - s)\, d^\top H(\theta + s \eta d)\, d\, ds` the mean curvature along the step
  (the quadratic case's :math:`d^\top H d`). :func:`critical_sharpness` finds :math:`\eta_c` by
  a line search in forward passes (no Hessian product): see :func:`find_critical_rate`.
- **The gradient's share in the top-k eigenspace** ([GurAri2018]):
  :math:`\lVert V_k^\top g \rVert^2 / \lVert g \rVert^2`, :math:`V_k` the top-k Hessian
  eigenvectors (Lanczos), k the number of classes by default as in the paper.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sharpcli.analyses.stability import stability_threshold
from sharpcli.analyses.update_direction import optimizer_learning_rate, update_direction
from sharpcli.curvature import AnalysisData, CurvatureEngine, all_reduce_sum, lanczos
from sharpcli.curvature.products.data import to_model_batch
from sharpcli.curvature.products.finite_difference import FiniteDifferenceEngine
from sharpcli.errors import NumericalError, UsageError
from sharpcli.registry import declare

__all__ = [
    "BATCH_SHARPNESS",
    "CRITICAL_SHARPNESS",
    "GRADIENT_SHARE",
    "BatchSharpness",
    "CriticalSharpness",
    "GradientShare",
    "batch_sharpness",
    "critical_sharpness",
    "find_critical_rate",
    "gradient_share",
    "minibatch_indices",
    "step_direction",
]

BATCH_SHARPNESS, CRITICAL_SHARPNESS, GRADIENT_SHARE = (
    "batch-sharpness",
    "critical-sharpness",
    "gradient-share",
)
# the default k of the gradient share is the number of classes; beyond this many, k is asked for
MAX_DEFAULT_K = 100


# ----------------------------------------------------------------------------- batch sharpness
@dataclass
class BatchSharpness:
    """Batch sharpness ([Andreyev2024]) over ``batches`` mini-batches of ``batch_size``.

    Attributes:
        estimate: the mean of ``values`` (None when every batch had a zero gradient).
        stderr: its standard error over the batches (None with fewer than two).
        batches: the mini-batches measured (those with a nonzero gradient).
        batch_size: the samples of each.
        values: ``g_B^T H_B g_B / ||g_B||^2`` of each batch.
        curvatures: ``g_B^T H_B g_B`` of each batch.
        squared_norms: ``||g_B||^2`` of each batch.
        zero_gradient: batches left out because their gradient was exactly zero.
        matvecs: the Hessian products taken (one per batch).
    """

    estimate: float | None
    stderr: float | None
    batches: int
    batch_size: int
    values: list[float] = field(default_factory=list)
    curvatures: list[float] = field(default_factory=list)
    squared_norms: list[float] = field(default_factory=list)
    zero_gradient: int = 0
    matvecs: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (every attribute)."""
        return dict(self.__dict__)


def minibatch_indices(
    num_samples: int, batch_size: int, *, seed: int = 0, max_batches: int | None = None
) -> list[torch.Tensor]:
    """Mini-batches drawn without replacement: a seeded permutation of ``0..N-1`` cut into
    ``N // b`` batches of ``b = min(batch_size, N)`` samples (the remainder left out), the first
    ``max_batches`` of them.

    Args:
        num_samples: N.
        batch_size: b.
        seed: seeds the permutation (its own generator; the global RNG is untouched).
        max_batches: the most batches (None: all ``N // b``).

    Returns:
        The global sample indices of each batch, sorted.
    """
    b = min(int(batch_size), int(num_samples))
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(int(seed)))
    count = num_samples // b
    if max_batches is not None:
        count = min(count, int(max_batches))
    return [order[j * b : (j + 1) * b].sort().values for j in range(count)]


def batch_data(data: AnalysisData, indices: torch.Tensor) -> AnalysisData:
    """The analysis set restricted to the samples ``indices`` (global), each rank keeping those
    of its shard; the products over it are means over ``len(indices)`` samples.

    Args:
        data: the analysis set.
        indices: global sample indices, sorted.

    Returns:
        A shallow copy of ``data`` over those samples.
    """
    start = data.shard_start
    local = indices[(indices >= start) & (indices < start + data.local_num_samples)] - start
    sub = copy.copy(data)
    sub.x = data.x[local.to(data.x.device)]
    sub.y = data.y[local.to(data.y.device)]
    sub.local_num_samples = int(local.numel())
    sub.num_samples = int(indices.numel())
    return sub


def engine_on(engine: CurvatureEngine, data: AnalysisData) -> CurvatureEngine:
    """An engine of the same kind as ``engine`` (same model and scope) over ``data``, caching
    nothing (each mini-batch is used once).

    Args:
        engine: the engine of the whole analysis set.
        data: the samples of the new one.
    """
    if isinstance(engine, FiniteDifferenceEngine):
        return FiniteDifferenceEngine(engine.model, data, engine.scope)
    return CurvatureEngine(
        engine.model, data, engine.scope, cache_bytes=0, vectorize=engine.vectorize
    )


def batch_sharpness(
    engine: CurvatureEngine,
    batch_size: int,
    *,
    seed: int = 0,
    max_batches: int | None = None,
    batch_context: Callable[[AnalysisData], contextlib.AbstractContextManager[Any]] | None = None,
) -> BatchSharpness:
    r"""Batch sharpness ([Andreyev2024]) of the analysis set of ``engine``: the mean over
    mini-batches B of :math:`g_B^\top H_B g_B / \lVert g_B \rVert^2` (module docstring).

    Args:
        engine: the curvature engine (model in eval mode); its analysis set is what the
            mini-batches are drawn from.
        batch_size: the mini-batch size (the training batch size); larger than the set: the
            whole set, once.
        seed: seeds the draw of the batches.
        max_batches: the most batches (one Hessian product each; None: all ``N // b``).
        batch_context: entered around each batch's products with its analysis set (a token
            loss's averaging over the batch's own tokens); None: nothing.

    Returns:
        A :class:`BatchSharpness`.
    """
    data = engine.data
    values, curvatures, norms = [], [], []
    zero = 0
    batches = minibatch_indices(data.num_samples, batch_size, seed=seed, max_batches=max_batches)
    for indices in batches:
        sub = engine_on(engine, batch_data(data, indices))
        with batch_context(sub.data) if batch_context else contextlib.nullcontext():
            _, g = sub.loss_and_gradient()
            hg = sub.hessian_matmat(g, operator="batch Hessian")
        g64, hg64 = g.to(torch.float64), hg.to(torch.float64)
        norm = float(g64 @ g64)
        if norm == 0.0:
            zero += 1
            continue
        curvature = float(g64 @ hg64)
        if not math.isfinite(curvature):
            raise NumericalError(
                f"g_B^T H_B g_B is {curvature} on a mini-batch", source="batch sharpness"
            )
        values.append(curvature / norm)
        curvatures.append(curvature)
        norms.append(norm)
    n = len(values)
    estimate = sum(values) / n if n else None
    stderr = None
    if n >= 2 and estimate is not None:
        variance = sum((v - estimate) ** 2 for v in values) / (n - 1)
        stderr = math.sqrt(variance / n)
    return BatchSharpness(
        estimate=estimate,
        stderr=stderr,
        batches=n,
        batch_size=min(int(batch_size), data.num_samples),
        values=values,
        curvatures=curvatures,
        squared_norms=norms,
        zero_gradient=zero,
        matvecs=len(batches),
    )


# -------------------------------------------------------------------------- critical sharpness
@dataclass
class CriticalSharpness:
    r"""Critical sharpness ([Kalra2026]) along a direction ``d``.

    Attributes:
        estimate: :math:`\lambda_c = 2 / \eta_c` (None when ``d`` is not a descent direction,
            :math:`g^\top d \ge 0`: the loss rises at any rate, or when the search did not
            find the rate).
        rate: :math:`\eta_c`, the middle of ``bracket``.
        bracket: ``(lo, hi)``: the loss does not rise at ``lo`` and rises at ``hi``
            (``hi <= (1 + tol) lo`` when converged).
        slope: :math:`g^\top d`, the loss's derivative along ``d``.
        forward_passes: the passes over the set (the loss at the current weights included).
        tol: the bracket's relative width asked for.
        converged: whether the bracket reached it.
        direction: where ``d`` came from (``"SGD"``, ``"Adam"``, ...: the optimizer's next
            step per unit learning rate; ``"gradient descent"``: ``-g``; ``"given"``).
        learning_rate: the optimizer's learning rate (None without one): the next step
            raises the loss when it exceeds :math:`\eta_c`, i.e. when
            :math:`\lambda_c > 2 / \mathrm{lr}`.
        note: why ``estimate`` is None, when it is.
    """

    estimate: float | None
    rate: float | None
    bracket: tuple[float, float] | None
    slope: float
    forward_passes: int
    tol: float
    converged: bool
    direction: str
    learning_rate: float | None = None
    note: str | None = None

    @property
    def threshold(self) -> float | None:
        """``2 / lr``: the critical sharpness above which the optimizer's next step raises
        the loss (None without an optimizer)."""
        return None if self.learning_rate is None else 2.0 / self.learning_rate

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (every attribute and ``threshold``)."""
        out = dict(self.__dict__)
        out["bracket"] = None if self.bracket is None else list(self.bracket)
        out["threshold"] = self.threshold
        return out


def set_loss(engine: CurvatureEngine) -> float:
    """The analysis loss at the model's current weights: one forward pass, no gradients.

    Args:
        engine: the curvature engine.

    Returns:
        The mean loss over the set (float64 sum of the batches' weighted means).
    """
    scope = engine.scope
    total = torch.zeros((), dtype=torch.float64, device=scope.device)
    with torch.no_grad():
        for x_b, y_b, weight in engine.data.batches():
            x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
            z = engine.model(x_b)
            rows = engine.chunking.rows(z, y_b, weight)
            loss_b = engine.loss(z, y_b) * weight if rows is None else rows.loss(z)
            total += loss_b.to(torch.float64)
    return float(all_reduce_sum(total))


@contextlib.contextmanager
def moved(engine: CurvatureEngine, step: torch.Tensor):
    """The scope's parameters at ``theta + step`` inside the block, restored bit for bit after.

    Args:
        engine: the curvature engine.
        step: a flat vector in the scope's layout.

    Yields:
        Nothing.
    """
    scope = engine.scope
    saved = [p.detach().clone() for p in scope.params]
    try:
        with torch.no_grad():
            for i, p in enumerate(scope.params):
                part = step[scope.offsets[i] : scope.offsets[i + 1]].view(p.shape)
                p.add_(part.to(dtype=p.dtype, device=p.device))
        yield
    finally:
        with torch.no_grad():
            for p, original in zip(scope.params, saved):
                p.copy_(original)


def find_critical_rate(
    increase: Callable[[float], bool],
    slope: float,
    loss_change: Callable[[float], float],
    start: float,
    *,
    tol: float = 0.05,
    max_passes: int = 30,
) -> tuple[float | None, float | None, int]:
    r"""A bracket ``(lo, hi)`` of the rate :math:`\eta_c` where one step starts to raise the loss.

    The search keeps ``lo`` (the loss did not rise there) and ``hi`` (it rose, or was not
    finite) and stops when ``hi <= (1 + tol) lo``. Its trial points come from a model of the
    change :math:`\phi(\eta) = L(\theta + \eta d) - L(\theta)` that matches the exact slope
    :math:`s = g^\top d` at 0 and the changes measured: :math:`s\eta + b\eta^2` through one
    point (a quadratic loss: :math:`\eta_c = -s/b` exactly), :math:`s\eta + b\eta^2 + c\eta^3`
    through two (the bracket's ends once there is one); the next two trials are its root
    times :math:`1 \mp \mathrm{tol}/4`, which bracket the rate when the model is right (a
    quadratic loss: three passes after the start); a root at an end of the bracket moves that
    end by the tolerance. Where the model has no root, or after six trials, it doubles ``lo``, halves ``hi`` or bisects (geometric mean),
    so the bracket always closes. On a loss that rises and falls more than once along ``d``
    the bracket holds a rate where it rises, not necessarily the first one.

    Args:
        increase: ``eta -> whether the loss at theta + eta d exceeds the loss at theta`` (one
            forward pass each).
        slope: :math:`g^\top d` (< 0).
        loss_change: the :math:`\phi(\eta)` of an ``eta`` already passed to ``increase`` (no
            pass).
        start: the first rate tried (> 0).
        tol: the relative width of the bracket asked for.
        max_passes: the most calls of ``increase``.

    Returns:
        ``(lo, hi, passes)``; ``lo`` or ``hi`` is None when the search ran out of passes
        before finding it.
    """
    lo: float | None = None
    hi: float | None = None
    tried: list[float] = []
    passes = 0
    eta = float(start)
    while passes < max_passes:
        tried.append(eta)
        rose = increase(eta)
        passes += 1
        if rose:
            hi = eta if hi is None else min(hi, eta)
        else:
            lo = eta if lo is None else max(lo, eta)
        if lo is not None and hi is not None and hi <= (1.0 + tol) * lo:
            break
        # the model through the bracket's ends, else through the last two points tried
        points = [lo, hi] if lo is not None and hi is not None else tried[-2:]
        measured = [(t, loss_change(t)) for t in points]
        prediction = _model_root(slope, [(t, p) for t, p in measured if math.isfinite(p)])
        eta = _next_rate(prediction, lo, hi, tol, guided=passes <= 6)
    return lo, hi, passes


def _model_root(slope: float, points: list[tuple[float, float]]) -> float | None:
    """The smallest positive root of the model of :func:`find_critical_rate` through
    ``points`` ``(eta, phi)``, None where it has none."""
    if not points:
        return None
    if len(points) >= 2:
        (t1, p1), (t2, p2) = points[-2:]
        # phi - s t = b t^2 + c t^3 at both points
        a11, a12, a21, a22 = t1 * t1, t1**3, t2 * t2, t2**3
        r1, r2 = p1 - slope * t1, p2 - slope * t2
        det = a11 * a22 - a12 * a21
        if det != 0.0 and math.isfinite(det):
            b = (r1 * a22 - a12 * r2) / det
            c = (a11 * r2 - r1 * a21) / det
            # s + b t + c t^2 = 0
            if c == 0.0:
                roots = [-slope / b] if b > 0 else []
            else:
                disc = b * b - 4.0 * c * slope
                roots = (
                    [(-b + sign * math.sqrt(disc)) / (2.0 * c) for sign in (1.0, -1.0)]
                    if disc >= 0
                    else []
                )
            positive = [r for r in roots if r > 0 and math.isfinite(r)]
            if positive:
                return min(positive)
    t, p = points[-1]
    curvature = (p - slope * t) / (t * t)
    return -slope / curvature if curvature > 0 else None


def _next_rate(
    prediction: float | None, lo: float | None, hi: float | None, tol: float, *, guided: bool
) -> float:
    """The next trial of :func:`find_critical_rate`: beside the model's root where that is
    well inside the open bracket, just past its nearer end where the root is at that end,
    else doubling, halving or the geometric mean."""
    if guided and prediction is not None and math.isfinite(prediction) and prediction > 0:
        q = tol / 4.0
        low = lo * (1.0 + q) if lo is not None else 0.0
        high = hi / (1.0 + q) if hi is not None else math.inf
        for candidate in (prediction * (1.0 - q), prediction * (1.0 + q)):
            if low <= candidate <= high:
                return candidate
        # the root at an end of the bracket: one step of the tolerance past that end closes it
        if lo is not None and prediction * (1.0 + q) < low:
            return lo * (1.0 + tol)
        if hi is not None and prediction * (1.0 - q) > high:
            return hi / (1.0 + tol)
    if hi is None:
        assert lo is not None
        return 2.0 * lo
    if lo is None:
        return hi / 2.0
    return math.sqrt(lo * hi)


def step_direction(
    engine: CurvatureEngine, optimizer: Any, gradient: torch.Tensor
) -> tuple[torch.Tensor, str]:
    """The optimizer's next step per unit learning rate over the engine's scope (flat), by its
    own rule (:func:`~sharpcli.analyses.update_direction.update_direction`), optimizer and
    model unchanged; ``-gradient`` (gradient descent) when ``optimizer`` is None.

    Args:
        engine: the curvature engine.
        optimizer: a ``torch.optim`` optimizer over the model's parameters, or None.
        gradient: the analysis loss's gradient, flat in the scope's layout.

    Returns:
        ``(d, name)``: the direction (the scope's dtype) and where it came from.

    Raises:
        UsageError: (source ``optimizer``) an optimizer not supported, or one that holds none
            of the scope's parameters (a converted copy of the model).
    """
    if optimizer is None:
        return -gradient, "gradient descent"
    scope = engine.scope
    grads = [gradient[scope.offsets[i] : scope.offsets[i + 1]] for i in range(len(scope.params))]
    parts = update_direction(optimizer, list(scope.params), grads)
    if all(part is None for part in parts):
        raise UsageError(
            "the optimizer holds none of the measured parameters (a copy of the model on "
            "another device or dtype?)",
            source="optimizer",
        )
    flat = torch.zeros(scope.numel, dtype=torch.float64, device=scope.device)
    for i, part in enumerate(parts):
        if part is not None:
            flat[scope.offsets[i] : scope.offsets[i + 1]] = part.reshape(-1)
    return flat.to(scope.dtype), type(optimizer).__name__


def critical_sharpness(
    engine: CurvatureEngine,
    optimizer: Any = None,
    *,
    direction: torch.Tensor | None = None,
    start: float | None = None,
    tol: float = 0.05,
    max_passes: int = 30,
) -> CriticalSharpness:
    r"""Critical sharpness ([Kalra2026]) of the analysis loss along the update direction.

    :math:`\lambda_c = 2/\eta_c`, :math:`\eta_c` bracketed by :func:`find_critical_rate` to
    relative width ``tol``, so :math:`\lambda_c` (from the bracket's middle) is within about
    ``tol / 2`` of :math:`2/\eta` at the rate where the loss starts to rise; exactly
    :math:`\lambda_c = \kappa(\eta_c) / (-g^\top d)`, the mean curvature along the step over
    the slope (module docstring), and :math:`d^\top H d / (-g^\top d)` on a quadratic loss.
    Costs one gradient pass and a few forward passes, no Hessian product; the model's weights
    are moved and restored bit for bit, the optimizer is only read.

    Args:
        engine: the curvature engine (model in eval mode).
        optimizer: the ``torch.optim`` optimizer whose next step gives the direction
            (:func:`step_direction`); None: gradient descent, ``d = -g``.
        direction: ``d`` itself (flat, the scope's layout) instead of an optimizer's.
        start: the first rate tried (None: the optimizer's learning rate, else
            :math:`|L| / |g^\top d|`, the rate at which the first-order decrease equals the
            loss).
        tol: the bracket's relative width (0 < tol < 1).
        max_passes: the most forward passes of the search.

    Returns:
        A :class:`CriticalSharpness`.

    Raises:
        UsageError: ``tol``, ``start`` or ``direction`` out of range, both ``optimizer`` and
            ``direction`` given, or an optimizer not supported.
    """
    if not (0.0 < float(tol) < 1.0):
        raise UsageError(f"must be in (0, 1), got {tol}", source="tol")
    if optimizer is not None and direction is not None:
        raise UsageError("give an optimizer or a direction, not both", source="direction")
    scope = engine.scope
    lr = optimizer_learning_rate(optimizer) if optimizer is not None else None
    loss0, gradient = engine.loss_and_gradient()
    if direction is not None:
        if not torch.is_tensor(direction) or direction.shape != (scope.numel,):
            raise UsageError(
                f"expected a flat tensor of {scope.numel} values (the scope's layout)",
                source="direction",
            )
        d, name = direction.to(dtype=scope.dtype, device=scope.device), "given"
    else:
        d, name = step_direction(engine, optimizer, gradient)
    slope = float(gradient.to(torch.float64) @ d.to(torch.float64))

    def result(lo=None, hi=None, passes=0, converged=False, note=None) -> CriticalSharpness:
        rate = None if lo is None or hi is None else 0.5 * (lo + hi)
        return CriticalSharpness(
            estimate=None if rate is None else 2.0 / rate,
            rate=rate,
            bracket=None if rate is None else (lo, hi),
            slope=slope,
            forward_passes=passes,
            tol=float(tol),
            converged=converged,
            direction=name,
            learning_rate=lr,
            note=note,
        )

    if not slope < 0:
        return result(
            note=f"not a descent direction (g.d = {slope:.3g} >= 0): the loss rises at any rate"
        )
    if start is None:
        start = lr if lr is not None else (abs(loss0) / abs(slope) if loss0 else 1.0)
    if not (math.isfinite(start) and start > 0):
        raise UsageError(f"must be a positive number, got {start}", source="start")
    base = set_loss(engine)  # the same forward as the trials: their rounding cancels
    changes: dict[float, float] = {}

    def increase(eta: float) -> bool:
        with moved(engine, eta * d):
            value = set_loss(engine)
        changes[eta] = value - base
        return not math.isfinite(value) or value > base

    lo, hi, passes = find_critical_rate(
        increase, slope, lambda eta: changes[eta], start, tol=tol, max_passes=max_passes
    )
    passes += 1  # the loss at the current weights
    converged = lo is not None and hi is not None and hi <= (1.0 + tol) * lo
    if lo is None or hi is None:
        return result(
            passes=passes,
            note=f"no rate where the loss starts to rise found in {max_passes} passes",
        )
    return result(lo, hi, passes, converged)


# --------------------------------------------------------------------------- gradient share
@dataclass
class GradientShare:
    """The gradient's share in the top-k Hessian eigenspace ([GurAri2018]).

    Attributes:
        share: ``||V_k^T g||^2 / ||g||^2`` (None for a zero gradient).
        k: the eigenvectors.
        eigenvalues: the top-k Ritz values, descending.
        converged: whether each Ritz pair met the Lanczos tolerance.
        matvecs: the Hessian products taken.
    """

    share: float | None
    k: int
    eigenvalues: list[float]
    converged: list[bool]
    matvecs: int
    top_vector: torch.Tensor | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (without the eigenvector)."""
        return {k: v for k, v in self.__dict__.items() if k != "top_vector"}


def number_of_classes(engine: CurvatureEngine) -> int:
    """The model's outputs per sample (the classes of a classifier): ``z.shape[1]`` of its
    ``(batch, classes)`` output on the set's first sample.

    Raises:
        UsageError: (source ``k``) outputs of another shape, or more than 100 classes: the
            default k does not apply; give k.
    """
    scope = engine.scope
    x_b, y_b = to_model_batch(engine.data.x[:1], engine.data.y[:1], scope.dtype, scope.device)
    with torch.no_grad():
        z = engine.model(x_b)
    if z.dim() != 2:
        raise UsageError(
            f"the model's outputs have shape {tuple(z.shape)}, not (batch, classes): give k",
            source="k",
        )
    classes = int(z.shape[1])
    if classes > MAX_DEFAULT_K:
        raise UsageError(
            f"the model has {classes} outputs per sample; k = the number of classes is more "
            f"than {MAX_DEFAULT_K} eigenvectors: give k",
            source="k",
        )
    return classes


def gradient_share(
    engine: CurvatureEngine,
    k: int | None = None,
    *,
    tol: float = 1e-3,
    max_matvecs: int | None = None,
    seed: int = 0,
    start: torch.Tensor | None = None,
) -> GradientShare:
    r"""The share of the analysis loss's gradient in the span of the top-k Hessian eigenvectors,
    :math:`\lVert V_k^\top g \rVert^2 / \lVert g \rVert^2` ([GurAri2018]): near 1 when gradient
    descent moves in the top eigenspace.

    Args:
        engine: the curvature engine (model in eval mode).
        k: the eigenvectors (None: the number of classes, :func:`number_of_classes`); at most
            P.
        tol: the Lanczos relative residual.
        max_matvecs: the most Hessian products (Lanczos default ``min(P, 100)``).
        seed: seeds the Lanczos start vector.
        start: a start vector instead (a warm start: the top eigenvector of a previous
            measurement).

    Returns:
        A :class:`GradientShare` (its ``top_vector``: the top Ritz vector, for the next start).
    """
    k = number_of_classes(engine) if k is None else int(k)
    if k < 1:
        raise UsageError(f"must be >= 1, got {k}", source="k")
    k = min(k, engine.scope.numel)
    top = lanczos(
        engine.hessian(),
        top_k=k,
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
        start=start,
        return_eigenvectors=True,
        explicit_residuals=False,
    )
    _, gradient = engine.loss_and_gradient()
    g = gradient.to(torch.float64)
    assert top.eigenvectors is not None
    vectors = top.eigenvectors.to(device=g.device, dtype=torch.float64)
    basis = torch.linalg.qr(vectors).Q  # Ritz vectors orthonormal to rounding: made exact
    norm = float(g @ g)
    share = float((basis.T @ g).square().sum()) / norm if norm > 0 else None
    return GradientShare(
        share=share,
        k=int(vectors.shape[1]),
        eigenvalues=list(top.eigenvalues),
        converged=list(top.converged),
        matvecs=top.matvecs,
        top_vector=vectors[:, 0].clone(),
    )


# ----------------------------------------------------------------------- the tracked quantities
def _sgd_threshold(optimizer: Any) -> float | None:
    """The stability threshold of lambda_max for a non-adaptive optimizer (2/lr, (2 + 2 mu)/lr
    with momentum: :func:`sharpcli.analyses.stability.stability_threshold`), None for an
    adaptive one, whose threshold is that of its preconditioned sharpness."""
    threshold = stability_threshold(optimizer)
    return None if threshold.preconditioned else float(threshold.value)


@declare(
    "trackable",
    BATCH_SHARPNESS,
    "E_B[g_B^T H_B g_B / ||g_B||^2] over mini-batches of the training batch size, its "
    "standard error; the threshold of lambda_max for SGD",
    paper="Andreyev2024",
    info={
        "keys": (
            "batch_sharpness",
            "batch_sharpness_stderr",
            "batch_sharpness_batches",
            "batch_sharpness_threshold",
        ),
        "column": 7,
    },
)
def track_batch_sharpness(engine, out: dict, budget) -> int:
    """``batch_sharpness`` with ``batch_sharpness_stderr`` and ``batch_sharpness_batches``,
    over mini-batches of ``budget.step.batch_size`` (the analysis batch size when unset), at
    most ``budget.max_matvecs`` of them; ``batch_sharpness_threshold`` (2/lr, (2 + 2 mu)/lr
    with momentum) when the optimizer is known and not adaptive. A token loss keeps the
    tracked set's token averaging here (``Curvature.batch_sharpness`` averages each batch over
    its own labelled tokens). One curvature product per mini-batch."""
    step = budget.step
    size = step.batch_size or engine.data.batch_size
    result = batch_sharpness(engine, size, seed=budget.seed, max_batches=budget.max_matvecs)
    out["batch_sharpness"] = result.estimate
    out["batch_sharpness_stderr"] = result.stderr
    out["batch_sharpness_batches"] = result.batches
    threshold = None if step.optimizer is None else _sgd_threshold(step.optimizer)
    if threshold is not None:
        out["batch_sharpness_threshold"] = threshold
    return result.matvecs


@declare(
    "trackable",
    CRITICAL_SHARPNESS,
    "2/eta_c, eta_c the learning rate at which a step along the update direction starts to "
    "raise the loss (line search in forward passes)",
    paper="Kalra2026",
    info={
        "keys": (
            "critical_sharpness",
            "critical_sharpness_forward_passes",
            "critical_sharpness_threshold",
        ),
        "column": 9,
    },
)
def track_critical_sharpness(engine, out: dict, budget) -> int:
    """``critical_sharpness`` along the optimizer's next step (gradient descent without one),
    to 5% of the rate, with ``critical_sharpness_forward_passes``; ``critical_sharpness_threshold``
    = 2/lr (above it the next step raises the loss) when the optimizer is known. The search
    starts from the previous measurement's rate (kept in ``budget.step.warm``). It runs last
    of the built-ins (its column): moving the weights drops the engine's cached graphs. No curvature product (forward passes only)."""
    step = budget.step
    last = step.warm.get(CRITICAL_SHARPNESS)
    start = float(last) if last is not None and float(last) > 0 else None
    result = critical_sharpness(engine, step.optimizer, start=start)
    if result.rate is not None:
        # a tensor, as every warm start: a resumable run saves the tensors among them
        step.warm[CRITICAL_SHARPNESS] = torch.tensor(result.rate, dtype=torch.float64)
    out["critical_sharpness"] = result.estimate
    out["critical_sharpness_forward_passes"] = result.forward_passes
    if result.threshold is not None:
        out["critical_sharpness_threshold"] = result.threshold
    return 0


def _warm_vector(warm: dict, numel: int) -> torch.Tensor | None:
    """A start vector kept by an earlier measurement: this quantity's own, else the top
    eigenvector that ``eigen`` keeps; None when neither is a vector of the scope's size."""
    for key in (GRADIENT_SHARE, "eigen"):
        value = warm.get(key)
        if torch.is_tensor(value) and value.numel() == numel and bool(value.abs().sum() > 0):
            return value.reshape(-1)
    return None


@declare(
    "trackable",
    GRADIENT_SHARE,
    "||V_k^T g||^2 / ||g||^2, the gradient's share in the top-k Hessian eigenspace (k = "
    "number of classes)",
    paper="GurAri2018",
    info={"keys": ("gradient_share", "gradient_share_k"), "column": 8},
)
def track_gradient_share(engine, out: dict, budget) -> int:
    """``gradient_share`` and ``gradient_share_k`` (k = the number of classes), Lanczos to a
    relative residual of 1e-3 within the budget's eigen products, warm-started from the
    previous measurement's top eigenvector (``budget.step.warm``)."""
    warm = budget.step.warm
    result = gradient_share(
        engine,
        max_matvecs=budget.eigen_max_matvecs,
        seed=budget.seed,
        start=_warm_vector(warm, engine.scope.numel),
    )
    if result.top_vector is not None:
        warm[GRADIENT_SHARE] = result.top_vector
    out["gradient_share"] = result.share
    out["gradient_share_k"] = result.k
    return result.matvecs
