"""Rescaling plans: which parameters a rescaling by ``alpha`` touches, and applying it.

A plan follows one forward pass's data flow from the rescaled layer to what compensates it (the
next weighted layer, or a BatchNorm's running statistics) and records every reason the
rescaling would change the network function ([Dinh2017]; the formulas:
:mod:`sharpcli.analyses.rescale`). :func:`apply_rescale` then scales a model in place.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.models.activations import ACTIVATION_TYPES, is_positively_homogeneous

__all__ = ["MODES", "RescalePlan", "apply_rescale", "check_mode", "plan_rescale"]

MODES = catalogue.RESCALE_MODES

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
    """UsageError on ``mode`` unless it is one of :data:`MODES`.

    Args:
        mode: the rescaling mode.

    Raises:
        UsageError: an unknown mode (source ``mode``).
    """
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}; accepted: {', '.join(MODES)}", source="mode")


def plan_rescale(
    model: nn.Module,
    example: torch.Tensor,
    mode: str,
    layer: str | None = None,
    *,
    force: bool = False,
) -> RescalePlan:
    """Work out a rescaling of ``model`` (:class:`RescalePlan`; :mod:`sharpcli.analyses.rescale`).

    ``example`` is a small input batch: one forward pass records the order in which modules run
    and which module consumes which tensor, so the path from ``layer`` to the next weighted layer
    is followed through the actual data flow (a residual addition or a functional activation
    breaks the chain and is reported). ``layer`` defaults to the first hidden layer (the first
    ``nn.Linear``/convolution to run). Raises ``UsageError`` (``mode``/``layer``) for unknown
    modes and layers, layers with nothing to compensate them, and -- unless ``force`` -- layer
    rescalings that would change the function (e.g. through GELU).

    Args:
        model: the model (not changed).
        example: a small input batch.
        mode: ``"global"`` or ``"layer"``.
        layer: the layer to rescale (``mode="layer"``).
        force: accept a rescaling that changes the function.
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
    if isinstance(module, ACTIVATION_TYPES):
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


def _is_positively_homogeneous(module: nn.Module) -> bool:
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
    """Rescale ``model`` in place by ``alpha`` following ``plan`` (the formulas of :mod:`sharpcli.analyses.rescale`).

    Raises ``UsageError(source="alpha")`` for ``alpha <= 0`` or when a BatchNorm adjustment
    would need a negative running variance (``alpha^2 (var + eps) < eps``).

    Args:
        model: the model, rescaled in place.
        plan: from :func:`plan_rescale`.
        alpha: the factor.
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
