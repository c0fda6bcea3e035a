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
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from sharpcli import progress
from sharpcli.curvature.data import (
    AnalysisData,
    all_reduce_sum,
    distributed_rank_and_world,
    to_model_batch,
)
from sharpcli.curvature.operators import CurvatureOperator, CurvaturePass
from sharpcli.curvature.scope import ParamScope
from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss, per_sample_loss

__all__ = [
    "MODES",
    "ElementwiseScaledOperator",
    "RescalePlan",
    "RescaleRow",
    "WeightRescaleResult",
    "apply_rescale",
    "evaluate_outputs",
    "plan_rescale",
    "weight_rescale",
]

MODES = ("global", "layer")

_WEIGHTED_TYPES = (nn.Linear, nn.modules.conv._ConvNd)
_BATCHNORM_TYPES = (nn.modules.batchnorm._BatchNorm,)
# Modules that commute with multiplication by a positive scalar (in eval mode).
_HOMOGENEOUS_PASS_TYPES = (
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.Flatten,
    nn.Unflatten,
    nn.Identity,
    nn.modules.dropout._DropoutNd,
)


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


@dataclass
class RescalePlan:
    """Which parameters a rescaling touches and whether it preserves the network function.

    ``mode``: ``global``, ``layer`` (Dinh: ``layer`` times alpha, ``next_layer`` weight times
    1/alpha) or ``batchnorm`` (``layer`` times alpha, ``batchnorm`` running statistics adjusted).
    ``path``: the modules the signal passes between ``layer`` and ``next_layer``.
    ``problems``: reasons the rescaling does not preserve the function (empty when it does;
    always non-empty for ``global``).
    """

    mode: str
    layer: str | None = None
    next_layer: str | None = None
    batchnorm: str | None = None
    path: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    forced: bool = False

    @property
    def function_preserving(self) -> bool:
        """True when the rescaling leaves the network function unchanged (up to rounding)."""
        return self.mode != "global" and not self.problems

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        out = asdict(self)
        out["function_preserving"] = self.function_preserving
        return out


@dataclass
class _Call:
    name: str
    module: nn.Module
    input: torch.Tensor | None
    output: torch.Tensor | None


def _execution_trace(model: nn.Module, example: torch.Tensor) -> list[_Call]:
    """Leaf (and weighted) modules in the order a forward pass calls them, with their tensors."""
    calls: list[_Call] = []
    handles = []
    for name, module in model.named_modules():
        leaf = not any(True for _ in module.children())
        if leaf or isinstance(module, _WEIGHTED_TYPES + _BATCHNORM_TYPES):

            def hook(mod, inputs, output, _name=name):
                first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
                out = output if isinstance(output, torch.Tensor) else None
                calls.append(_Call(_name, mod, first, out))

            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _describe(module: nn.Module) -> str:
    spec = getattr(module, "spec", None)
    return spec if isinstance(spec, str) else type(module).__name__


def _layer_candidates(calls: list[_Call]) -> list[str]:
    seen: list[str] = []
    for call in calls:
        if isinstance(call.module, _WEIGHTED_TYPES) and call.name not in seen:
            seen.append(call.name)
    return seen


def check_mode(mode: str) -> None:
    """UsageError on ``mode`` unless it is one of :data:`MODES`."""
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}; accepted: {', '.join(MODES)}", source="mode")


def check_alphas(alphas: list[float]) -> None:
    """UsageError on ``alphas`` unless there is at least one and each is finite and > 0.

    :func:`weight_rescale` checks them itself; a caller about to load a model may check first.
    """
    if not alphas:
        raise UsageError("needs at least one alpha", source="alphas")
    for alpha in alphas:
        if not (alpha > 0 and math.isfinite(alpha)):
            raise UsageError(
                f"every alpha must be a finite number > 0, got {alpha:g}", source="alphas"
            )


def plan_rescale(
    model: nn.Module,
    example: torch.Tensor,
    mode: str,
    layer: str | None = None,
    *,
    force: bool = False,
) -> RescalePlan:
    """Work out a rescaling of ``model`` (see :class:`RescalePlan` and the module docstring).

    ``example`` is a small input batch: one forward pass records the order in which modules run
    and which module consumes which tensor, so the path from ``layer`` to the next weighted layer
    is followed through the actual data flow (a residual addition or a functional activation
    breaks the chain and is reported). ``layer`` defaults to the first hidden layer (the first
    ``nn.Linear``/convolution to run). Raises ``UsageError`` (``mode``/``layer``) for unknown
    modes and layers, layers with nothing to compensate them, and -- unless ``force`` -- layer
    rescalings that would change the function (e.g. through GELU).
    """
    check_mode(mode)
    if mode == "global":
        if layer is not None:
            raise UsageError("`layer` applies to `mode=layer` only", source="layer")
        return RescalePlan(mode="global", problems=["global scaling changes the network function"])
    calls = _execution_trace(model, example)
    layer, position = _resolve_layer(model, calls, layer)
    plan = RescalePlan(mode="layer", layer=layer, forced=force)
    _follow_output(plan, calls, position)
    _check_compensated(plan, force)
    if not plan.problems:
        _verify_function_preserved(model, example, plan, force)
    return plan


def _resolve_layer(model: nn.Module, calls: list[_Call], layer: str | None) -> tuple[str, int]:
    """The layer to rescale (default: the first weighted layer to run) and its index in ``calls``.

    UsageError (``layer``) unless it is a linear, convolution or affine BatchNorm layer called
    exactly once per forward pass.
    """
    candidates = _layer_candidates(calls)
    listed = f"{', '.join(candidates[:12])}{' ...' if len(candidates) > 12 else ''}"
    modules = dict(model.named_modules())
    if layer is None:
        if not candidates:
            raise UsageError(
                "the model has no nn.Linear or convolution layer to rescale", source="layer"
            )
        layer = candidates[0]
    if layer not in modules or layer == "":
        raise UsageError(
            f"no module named {layer!r}; layers with weights: {listed}", source="layer"
        )
    module = modules[layer]
    if isinstance(module, _BATCHNORM_TYPES):
        if not module.affine:
            raise UsageError(
                f"BatchNorm {layer!r} has no affine weight and bias to rescale", source="layer"
            )
    elif not isinstance(module, _WEIGHTED_TYPES):
        raise UsageError(
            f"module {layer!r} is a {type(module).__name__}, not a linear, convolution or BatchNorm layer; "
            f"layers with weights: {', '.join(candidates[:12])}",
            source="layer",
        )
    positions = [i for i, call in enumerate(calls) if call.name == layer]
    if not positions:
        raise UsageError(f"layer {layer!r} is not used in the forward pass", source="layer")
    if len(positions) > 1:
        raise UsageError(
            f"layer {layer!r} is called more than once per forward pass", source="layer"
        )
    return layer, positions[0]


def _follow_output(plan: RescalePlan, calls: list[_Call], position: int) -> None:
    """Follow the output of ``calls[position]`` (``plan.layer``) to what compensates the scaling.

    Fills ``plan.path`` with the modules it passes, stops at the next weighted layer
    (``plan.next_layer``) or, directly after a weighted layer, at a BatchNorm (``batchnorm``
    mode), and records in ``plan.problems`` every module that does not commute with scaling
    and every tensor that feeds more than one module.
    """
    layer_is_batchnorm = isinstance(calls[position].module, _BATCHNORM_TYPES)
    current = calls[position].output
    for call in calls[position + 1 :]:
        if current is None:
            break
        if call.input is not current:
            continue
        consumers = [c.name for c in calls if c.input is current and c.output is not c.input]
        if len(consumers) > 1:
            plan.problems.append(
                f"the output of {plan.path[-1] if plan.path else plan.layer} feeds several modules "
                f"({', '.join(consumers)})"
            )
        mod = call.module
        if isinstance(mod, _BATCHNORM_TYPES) and not plan.path and not layer_is_batchnorm:
            plan.mode = "batchnorm"
            plan.batchnorm = call.name
            return
        if isinstance(mod, _WEIGHTED_TYPES):
            plan.next_layer = call.name
            return
        plan.path.append(call.name)
        problem = _scaling_problem(call.name, mod)
        if problem:
            plan.problems.append(problem)
        current = call.output


def _scaling_problem(name: str, module: nn.Module) -> str | None:
    """Why scaling does not pass through ``module`` unchanged, or None when it does."""
    if _is_positively_homogeneous(module):
        return None
    if _is_activation(module):
        return (
            f"activation {name} ({_describe(module)}) is not positively homogeneous "
            "(phi(a u) != a phi(u))"
        )
    return f"module {name} ({type(module).__name__}) does not commute with scaling"


def _check_compensated(plan: RescalePlan, force: bool) -> None:
    """UsageError (``layer``) when nothing compensates the scaling of ``plan.layer``, or --
    unless ``force`` -- when the path to what does changes the network function."""
    layer = plan.layer
    if plan.mode == "layer" and plan.next_layer is None:
        where = f" after {plan.path[-1]}" if plan.path else ""
        raise UsageError(
            f"no linear or convolution layer consumes the output of {layer!r}{where} directly (it is the "
            "last layer, or a functional operation such as a residual addition follows), so nothing can "
            "compensate the rescaling",
            source="layer",
        )
    if plan.problems and not force:
        target = plan.next_layer or plan.batchnorm
        raise UsageError(
            f"rescaling {layer} by alpha and {target} by 1/alpha changes the network function: "
            f"{'; '.join(plan.problems)}; pass `force` to rescale anyway",
            source="layer",
        )


def _is_activation(module: nn.Module) -> bool:
    from sharpcli.models.activations import ACTIVATION_TYPES

    return isinstance(module, ACTIVATION_TYPES)


def _is_positively_homogeneous(module: nn.Module) -> bool:
    from sharpcli.models.activations import is_positively_homogeneous

    if isinstance(module, _HOMOGENEOUS_PASS_TYPES):
        return True
    return is_positively_homogeneous(module)


def _verify_function_preserved(
    model: nn.Module, example: torch.Tensor, plan: RescalePlan, force: bool
) -> None:
    """Check on ``example`` that the plan with alpha = 2 keeps the logits; record a problem if not.

    Hooks see modules, not functional operations: a tensor consumed both by the next layer and by
    a functional branch (a skip connection) would slip through the structural check.
    """
    trial = copy.deepcopy(model)
    apply_rescale(trial, plan, 2.0)
    with torch.no_grad():
        before = model(example)
        after = trial(example)
    change = float((after - before).abs().max())
    eps = torch.finfo(before.dtype).eps
    allowed = math.sqrt(eps) * max(1.0, float(before.abs().max()))
    if change > allowed:
        plan.problems.append(
            f"the logits moved by {change:.3g} on a trial rescaling (alpha = 2): "
            + _why_not_preserved(model, plan)
        )
        if not force:
            raise UsageError(
                f"rescaling {plan.layer} does not preserve the network function: {plan.problems[-1]}; "
                "pass `force` to rescale anyway",
                source="layer",
            )


def _why_not_preserved(model: nn.Module, plan: RescalePlan) -> str:
    """The likely reason a structurally sound plan moved the logits: a reparametrized layer
    (weight norm, spectral norm: scaling its parameters does not scale its weight), else a
    second route of the layer's output (a functional skip connection hooks cannot see)."""
    from torch.nn.utils import parametrize

    modules = dict(model.named_modules())
    for name in (plan.layer, plan.next_layer):
        module = modules.get(name) if name else None
        if module is not None and parametrize.is_parametrized(module):
            kinds = sorted(
                {type(p).__name__ for ps in module.parametrizations.values() for p in ps}
            )
            return (
                f"{name} is reparametrized ({', '.join(kinds)}): scaling its parameters does "
                "not scale its weight by the same factor"
            )
    return (
        f"the output of {plan.layer} also reaches the output another way (e.g. a skip connection)"
    )


def apply_rescale(model: nn.Module, plan: RescalePlan, alpha: float) -> None:
    """Rescale ``model`` in place by ``alpha`` following ``plan`` (module docstring formulas).

    Raises ``UsageError(source="alpha")`` for ``alpha <= 0`` or when a BatchNorm adjustment
    would need a negative running variance (``alpha^2 (var + eps) < eps``).
    """
    if not (alpha > 0 and math.isfinite(alpha)):
        raise UsageError(f"alpha must be a finite number > 0, got {alpha}", source="alpha")
    modules = dict(model.named_modules())
    with torch.no_grad():
        if plan.mode == "global":
            for p in model.parameters():
                p.mul_(alpha)
            return
        layer = modules[plan.layer]
        layer.weight.mul_(alpha)
        if getattr(layer, "bias", None) is not None:
            layer.bias.mul_(alpha)
        if plan.mode == "layer":
            modules[plan.next_layer].weight.div_(alpha)
            return
        bn = modules[plan.batchnorm]
        if bn.running_mean is None or bn.running_var is None:
            return  # normalised by batch statistics: scale invariant as it is
        new_var = alpha * alpha * (bn.running_var + bn.eps) - bn.eps
        if (new_var < 0).any():
            raise UsageError(
                f"alpha = {alpha:g} is too small for BatchNorm {plan.batchnorm}: the running variance would "
                f"become negative (alpha^2 (var + eps) < eps with eps = {bn.eps:g})",
                source="alpha",
            )
        bn.running_mean.mul_(alpha)
        bn.running_var.copy_(new_var)


@dataclass
class OutputEvaluation:
    """Logits of the analysis set (this rank's shard), mean loss and accuracy."""

    logits: torch.Tensor
    loss: float
    accuracy: float | None


def evaluate_outputs(model: nn.Module, data: AnalysisData) -> OutputEvaluation:
    """Logits, ``L(theta) = (1/N) sum_i l(z_i, y_i)`` and accuracy (classification) over ``data``."""
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
                    f"logits are not finite on batch {index}", source="weight-rescale"
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
) -> tuple[RescaleRow, int]:
    from sharpcli.curvature.lanczos import lanczos

    evaluation = evaluate_outputs(model, data)
    local_change = 0.0 if reference is None else float((evaluation.logits - reference).abs().max())
    change = _global_max(local_change, evaluation.logits.device)
    scope = ParamScope.resolve(model, params)
    curvature_pass = CurvaturePass(model, data, scope)
    hessian = curvature_pass.hessian()
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
    return row, scope.numel


def _trace(op: CurvatureOperator, *, tol: float, max_matvecs: int, seed: int) -> dict:
    """Hutch++ trace of ``op`` from the curvature engine: ``{"estimate", "stderr"}``."""
    from sharpcli.curvature.hutchpp import hutchpp

    result = hutchpp(op, tol=tol, max_matvecs=max_matvecs, seed=seed)
    stderr = (
        None if result.stderr is None or not math.isfinite(result.stderr) else float(result.stderr)
    )
    return {"estimate": float(result.estimate), "stderr": stderr}


def weight_rescale(
    model: nn.Module,
    data: AnalysisData,
    alphas: list[float],
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
) -> WeightRescaleResult:
    """MAN Fig. 1 / Dinh et al.: rescale a copy of ``model`` by each alpha and measure it.

    Per alpha (and for the unscaled model, ``baseline``): accuracy, loss, ``max |z' - z|`` against
    the unscaled logits, lambda_max (Lanczos), trace (Hutch++) and the ASAM-normalised
    ``invariant_lambda_max`` = largest eigenvalue of ``diag(|theta|) H diag(|theta|)``, all w.r.t.
    the scope ``params`` (default all parameters). ``model`` itself is not modified.
    Progress: a ``weight rescale`` run counting the models measured (:mod:`sharpcli.progress`).
    """
    check_alphas(alphas)
    example = next(iter(data.batches()))[0]
    p0 = next(model.parameters())
    example = example[:8].to(
        device=p0.device, dtype=p0.dtype if example.is_floating_point() else example.dtype
    )
    plan = plan_rescale(model, example, mode, layer, force=force)
    kwargs = dict(
        tol=tol,
        max_matvecs=max_matvecs,
        trace_tol=trace_tol,
        trace_max_matvecs=trace_max_matvecs,
        seed=seed,
    )
    total = len(alphas) + 1
    with progress.start("weight rescale", total=total, unit="models", detail="baseline") as run:
        baseline_model = copy.deepcopy(model)
        reference = evaluate_outputs(baseline_model, data).logits
        baseline, numel = _curvature_row(baseline_model, data, params, 1.0, reference, **kwargs)
        del baseline_model
        rows = []
        for i, alpha in enumerate(alphas):
            run.update(i + 1, detail=f"alpha {alpha:g}")
            scaled = copy.deepcopy(model)
            apply_rescale(scaled, plan, alpha)
            row, _ = _curvature_row(scaled, data, params, alpha, reference, **kwargs)
            rows.append(row)
        run.finish(total)
    return WeightRescaleResult(
        rows=rows, baseline=baseline, plan=plan, params=params or "all", num_params=numel
    )
