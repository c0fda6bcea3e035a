"""Weight rescaling and rescale-invariant sharpness ([MAN] Fig. 1; [Dinh2017]; [ASAM]).

Three rescalings of a model's parameters theta, each with a factor ``alpha > 0``:

- ``global``: every trainable parameter (weights and biases) times ``alpha`` -- MAN Fig. 1
  ("after training all weights are scaled x10"). Not function preserving in general; the table
  shows how accuracy, loss and logits move beside lambda_max.
- ``layer`` (Dinh et al.): layer ``l``'s weight and bias times ``alpha`` and the next weighted
  layer's weight times ``1/alpha``. When everything between the two layers is positively
  homogeneous (``phi(a u) = a phi(u)`` for ``a > 0``: ReLU, leaky ReLU, max/avg pooling,
  flatten, eval-mode dropout) the network function is unchanged:
  ``W_{l+1}/alpha . phi(alpha (W_l x + b_l)) + b_{l+1} = W_{l+1} phi(W_l x + b_l) + b_{l+1}``.
  Through a non-homogeneous activation (GELU, ...) it is not, and the plan is refused unless
  forced. The layer may also be a BatchNorm's affine (gamma, beta).
- ``batchnorm`` (chosen automatically in layer mode when layer ``l`` feeds a BatchNorm directly):
  layer ``l``'s weight and bias times ``alpha`` and the BatchNorm's running statistics adjusted so
  that the eval-mode normalisation of ``alpha u`` equals that of ``u`` exactly:
  ``mu' = alpha mu``, ``var' = alpha^2 (var + eps) - eps`` (then
  ``(alpha u - mu') / sqrt(var' + eps) = (u - mu) / sqrt(var + eps)``). Nothing downstream
  changes; this is the scale invariance of batch-normalised layers.

A function-preserving rescaling is a reparametrisation ``theta' = D theta`` with ``D`` diagonal
positive, ``L'(theta') = L(D^{-1} theta')``, so ``H' = D^{-1} H D^{-1}``: lambda_max and the
trace change (by orders of magnitude for alpha = 10) although the function does not. ASAM's
elementwise normalisation ``T_w = diag(|w|)`` gives the invariant
``diag(|theta'|) H' diag(|theta'|) = diag(|theta|) D D^{-1} H D^{-1} D diag(|theta|)
= diag(|theta|) H diag(|theta|)``; its largest eigenvalue is ``invariant_lambda_max``.
Beside it, the worst-case l2 sharpness of [Andriushchenko2023] at radius ``rho``
(:mod:`sharpcli.analyses.sharpness`): adaptive (``c = |theta|``, invariant for the same reason:
``L'(theta' + c' u) = L(theta + c u)``) and standard (``c = 1``, not invariant).

This module measures the rescaled models (:func:`weight_rescale`);
:mod:`sharpcli.analyses.rescale_plan` works out and applies a rescaling.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from sharpcli import progress
from sharpcli.analyses.rescale_plan import (
    MODES,
    RescalePlan,
    apply_rescale,
    check_mode,
    plan_rescale,
)
from sharpcli.analyses.sharpness import SharpnessConfig, sharpness
from sharpcli.curvature.eigen.lanczos import lanczos
from sharpcli.curvature.operators.hessian import CurvatureEngine, CurvatureOperator
from sharpcli.curvature.products.data import (
    AnalysisData,
    all_reduce_sum,
    distributed_rank_and_world,
    to_model_batch,
)
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.hutchpp import hutchpp
from sharpcli.errors import NumericalError, UsageError, check_positive
from sharpcli.losses import get_loss, per_sample_loss

# the mode checks of :func:`weight_rescale` are the plan's (MODES, check_mode)
__all__ = [
    "MODES",
    "ElementwiseScaledOperator",
    "OutputEvaluation",
    "RescaleRow",
    "WeightRescaleResult",
    "check_alphas",
    "check_mode",
    "evaluate_outputs",
    "weight_rescale",
]


class ElementwiseScaledOperator(CurvatureOperator):
    """``v -> diag(s) A diag(s) v`` for a symmetric operator ``A`` and a vector ``s``.

    With ``s = |theta|`` and ``A = H`` this is ASAM's elementwise-normalised Hessian
    ``T_w H T_w`` (``T_w = diag(|w|)``), invariant under function-preserving rescaling
    (module docstring). ``matvecs`` counts the products with this operator; ``base.matvecs``
    the underlying ones.
    """

    name = "normalised Hessian"

    def __init__(self, base: CurvatureOperator, scale: torch.Tensor):
        super().__init__(base.shape[0], base.dtype, base.device)
        if scale.shape != (base.shape[0],):
            raise ValueError(f"scale has shape {tuple(scale.shape)}, expected ({base.shape[0]},)")
        self.base = base
        self.scale = scale.to(dtype=base.dtype, device=base.device)

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        s = self.scale[:, None]
        return s * self.base.matmat(s * V)


def check_alphas(alpha: list[float]) -> None:
    """UsageError on ``alpha`` unless there is at least one and each is finite and > 0.

    :func:`weight_rescale` checks them itself; a caller about to load a model may check first.

    Args:
        alpha: the factors.

    Raises:
        UsageError: none given, or one not finite or not > 0 (source ``alpha``).
    """
    check_positive(alpha, "alpha")


@dataclass
class OutputEvaluation:
    """Logits of the analysis set (this rank's shard), mean loss and accuracy."""

    logits: torch.Tensor
    loss: float
    accuracy: float | None


def evaluate_outputs(model: nn.Module, data: AnalysisData) -> OutputEvaluation:
    """Logits, ``L(theta) = (1/N) sum_i l(z_i, y_i)`` and accuracy (classification) over ``data``.

    Args:
        model: the model, in eval mode.
        data: the analysis set.

    Returns:
        This rank's logits with the loss and accuracy over every rank.

    Raises:
        NumericalError: the logits are not finite.
    """
    params = list(model.parameters())
    dtype, device = params[0].dtype, params[0].device
    logits = []
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, counted
    scorer = get_loss(data.loss).correct  # accuracy as the loss counts it; None for regression
    with torch.no_grad():
        for index, (x_b, y_b, _) in enumerate(data.batches()):
            x_b, y_b = to_model_batch(x_b, y_b, dtype, device)
            z = model(x_b)
            if not torch.isfinite(z).all():
                raise NumericalError(
                    f"logits are not finite on batch {index}",
                    source="weight-rescale",
                )
            logits.append(z)
            sums[0] += per_sample_loss(data.loss, z, y_b).to(torch.float64).sum()
            if scorer is not None:
                correct, counted = scorer(z, y_b)
                sums[1] += correct
                sums[2] += counted
    all_reduce_sum(sums)
    n = data.num_samples
    accuracy = float(sums[1] / sums[2]) if float(sums[2]) else None
    return OutputEvaluation(torch.cat(logits), float(sums[0]) / n, accuracy)


def _global_max(value: float, device) -> float:
    """Maximum of a per-rank number over ranks, through the one sum reduction (one slot per rank)."""
    rank, world = distributed_rank_and_world()
    slots = torch.full((world,), -math.inf, dtype=torch.float64, device=device)
    slots[rank] = value
    if world > 1:
        slots = torch.where(torch.isfinite(slots), slots, torch.zeros_like(slots))
        all_reduce_sum(slots)
    return float(slots.max())


@dataclass
class RescaleRow:
    """One alpha: the function (accuracy, loss, max |logit change|) and the curvature after rescaling."""

    alpha: float
    accuracy: float | None
    loss: float
    max_logit_change: float
    lambda_max: float
    lambda_max_converged: bool
    trace: float
    trace_stderr: float | None
    invariant_lambda_max: float
    invariant_converged: bool
    matvecs: int
    adaptive_sharpness: float | None = None
    standard_sharpness: float | None = None

    def to_dict(self) -> dict:
        """JSON-ready dict (the keys of docs/json.md plus convergence and cost)."""
        return asdict(self)


@dataclass
class WeightRescaleResult:
    """Rows per alpha, the unscaled baseline row, and the plan that was applied."""

    rows: list[RescaleRow]
    baseline: RescaleRow
    plan: RescalePlan
    params: str
    num_params: int

    @property
    def matvecs(self) -> int:
        """Curvature products used over all rows and the baseline."""
        return self.baseline.matvecs + sum(row.matvecs for row in self.rows)

    def to_dict(self) -> dict:
        """JSON-ready dict: ``rows`` (docs/json.md), ``baseline``, ``plan``, scope."""
        return {
            "rows": [row.to_dict() for row in self.rows],
            "baseline": self.baseline.to_dict(),
            "plan": self.plan.to_dict(),
            "params": self.params,
            "num_params": self.num_params,
        }


def _curvature_row(
    model: nn.Module,
    data: AnalysisData,
    params: str | None,
    alpha: float,
    reference: torch.Tensor | None,
    *,
    tol: float,
    max_matvecs: int | None,
    trace_tol: float,
    trace_max_matvecs: int,
    seed: int,
    rho: float | None,
) -> tuple[RescaleRow, int]:
    evaluation = evaluate_outputs(model, data)
    local_change = 0.0 if reference is None else float((evaluation.logits - reference).abs().max())
    change = _global_max(local_change, evaluation.logits.device)
    scope = ParamScope.resolve(model, params)
    engine = CurvatureEngine(model, data, scope)
    hessian = engine.hessian()
    top = lanczos(hessian, 1, "largest", tol=tol, max_matvecs=max_matvecs, seed=seed)
    trace = _trace(hessian, tol=trace_tol, max_matvecs=trace_max_matvecs, seed=seed)
    weights = scope.flatten([p.detach() for p in scope.params]).abs()
    normalised = ElementwiseScaledOperator(hessian, weights)
    invariant = lanczos(normalised, 1, "largest", tol=tol, max_matvecs=max_matvecs, seed=seed)
    row = RescaleRow(
        alpha=float(alpha),
        accuracy=evaluation.accuracy,
        loss=evaluation.loss,
        max_logit_change=change,
        lambda_max=top.eigenvalues[0],
        lambda_max_converged=top.converged[0],
        trace=trace["estimate"],
        trace_stderr=trace["stderr"],
        invariant_lambda_max=invariant.eigenvalues[0],
        invariant_converged=invariant.converged[0],
        matvecs=hessian.matvecs,
    )
    if rho is not None:
        row.adaptive_sharpness, row.standard_sharpness = (
            _worst_case_sharpness(model, data, params, rho, adaptive, seed)
            for adaptive in (True, False)
        )
    return row, scope.numel


def _worst_case_sharpness(
    model: nn.Module, data: AnalysisData, params: str | None, rho: float, adaptive: bool, seed: int
) -> float:
    """Worst-case l2 sharpness at ``rho`` over the whole set ([Andriushchenko2023])."""

    config = SharpnessConfig(rhos=(rho,), adaptive=adaptive, params=params, seed=seed)
    return sharpness(model, data, config).rows[0].sharpness


def _trace(op: CurvatureOperator, *, tol: float, max_matvecs: int, seed: int) -> dict:
    """Hutch++ trace of ``op`` from the curvature engine: ``{"estimate", "stderr"}``."""

    result = hutchpp(op, tol=tol, max_matvecs=max_matvecs, seed=seed)
    stderr = (
        None if result.stderr is None or not math.isfinite(result.stderr) else float(result.stderr)
    )
    return {"estimate": float(result.estimate), "stderr": stderr}


def weight_rescale(
    model: nn.Module,
    data: AnalysisData,
    alpha: list[float],
    *,
    mode: str = "layer",
    layer: str | None = None,
    force: bool = False,
    params: str | None = None,
    tol: float = 1e-3,
    max_matvecs: int | None = None,
    trace_tol: float = 1e-2,
    trace_max_matvecs: int = 200,
    seed: int = 0,
    rho: float | None = 0.05,
) -> WeightRescaleResult:
    """MAN Fig. 1 / Dinh et al.: rescale a copy of ``model`` by each alpha and measure it.

    Per alpha (and for the unscaled model, ``baseline``): accuracy, loss, ``max |z' - z|`` against
    the unscaled logits, lambda_max (Lanczos), trace (Hutch++), the ASAM-normalised
    ``invariant_lambda_max`` = largest eigenvalue of ``diag(|theta|) H diag(|theta|)`` and the
    adaptive and standard worst-case sharpness at ``rho``, all w.r.t. the scope ``params``
    (default all parameters). ``model`` itself is not modified.
    Progress: a ``weight rescale`` run counting the models measured (:mod:`sharpcli.progress`).

    Args:
        model: the model (not changed).
        data: the analysis set.
        alpha: the factors.
        mode: ``"global"`` or ``"layer"``.
        layer: the layer to rescale (``mode="layer"``).
        force: accept a rescaling that changes the function.
        params: the parameter scope of the curvature.
        tol: Lanczos's relative residual tolerance.
        max_matvecs: Lanczos's product budget.
        trace_tol: Hutch++'s relative tolerance.
        trace_max_matvecs: Hutch++'s product budget.
        seed: seeds the estimators.
        rho: the radius of the adaptive and standard worst-case sharpness (l2, the whole set
            as one batch, 20 Auto-PGD steps); None: not measured.

    Returns:
        The rows, the baseline and the plan.

    Raises:
        UsageError: bad alphas, mode or layer, or a plan that changes the function unforced.
    """
    check_alphas(alpha)
    alphas = list(alpha)
    check_mode(mode)
    if rho is not None and not (rho > 0 and math.isfinite(rho)):
        raise UsageError(f"must be a finite number > 0, got {rho:g}", source="rho")
    example = next(iter(data.batches()))[0]
    p0 = next(model.parameters())
    example = example[:8].to(
        device=p0.device, dtype=p0.dtype if example.is_floating_point() else example.dtype
    )
    plan = plan_rescale(model, example, mode, layer, force=force)

    def curvature_row(
        at: nn.Module, factor: float, reference: torch.Tensor | None
    ) -> tuple[RescaleRow, int]:
        return _curvature_row(
            at,
            data,
            params,
            factor,
            reference,
            tol=tol,
            max_matvecs=max_matvecs,
            trace_tol=trace_tol,
            trace_max_matvecs=trace_max_matvecs,
            seed=seed,
            rho=rho,
        )

    total = len(alphas) + 1
    with progress.start("weight rescale", total=total, unit="models", detail="baseline") as run:
        baseline_model = copy.deepcopy(model)
        reference = evaluate_outputs(baseline_model, data).logits
        baseline, numel = curvature_row(baseline_model, 1.0, reference)
        del baseline_model
        rows = []
        for i, factor in enumerate(alphas):
            run.update(i + 1, detail=f"alpha {factor:g}")
            scaled = copy.deepcopy(model)
            apply_rescale(scaled, plan, factor)
            row, _ = curvature_row(scaled, factor, reference)
            rows.append(row)
        run.finish(total)
    return WeightRescaleResult(
        rows=rows, baseline=baseline, plan=plan, params=params or "all", num_params=numel
    )
