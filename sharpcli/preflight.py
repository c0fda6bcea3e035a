"""Preflight checks of a run: options, model, data, device, dtype and seed, before any work.

Both the analysis session (:mod:`sharpcli.session`) and training (:mod:`sharpcli.training`)
run these before they compute anything, so that every mistake a user can make is a
:class:`~sharpcli.errors.UsageError` or :class:`~sharpcli.errors.InputError` naming its
source: a seed, dtype or device that cannot be used (:func:`check_seed`,
:func:`resolve_dtype`, :func:`resolve_device`), a model that does not fit the data or is not
deterministic in eval mode (:func:`check_model_accepts`, :func:`check_deterministic_forward`),
a model whose second derivatives torch computes wrongly (:func:`check_second_derivatives`),
and the features as the model takes them (:func:`prepare_features`, from
:mod:`sharpcli.io.data.features`).
"""

from __future__ import annotations

import copy
import functools
import operator

import torch
from torch import nn

from sharpcli import catalogue
from sharpcli.curvature.products.data import train_mode_modules
from sharpcli.errors import InputError, UsageError
from sharpcli.io.data.features import (  # noqa: F401  (re-exported: preflight is where callers look)
    check_embedding_ids,
    embedding_modules,
    embeddings_fed_by_input,
    prepare_features,
    prepare_features_and_outputs,
    to_analysis_dtype,
)
from sharpcli.losses import BINARY_CROSS_ENTROPY, CROSS_ENTROPY, MSE, TOKEN_CROSS_ENTROPY, get_loss
from sharpcli.models.activations import (
    ALTERED_DERIVATIVE_TYPES,
    intended_derivative_error,
    replace_altered_activations,
)

DTYPES = {name: getattr(torch, name) for name in catalogue.DTYPES}
MAX_SEED = 2**32 - 1
"""Largest ``seed``: seeds are offset and multiplied (probe blocks, ranks) within int64."""


def check_seed(seed, option: str = "seed") -> int:
    """``seed`` if it is an integer in ``0..MAX_SEED``; a UsageError naming ``option`` otherwise
    (``torch.manual_seed(10**23)`` is an OverflowError deep inside a run)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        shown = repr(seed) if len(repr(seed)) <= 40 else repr(seed)[:37] + "..."
        raise UsageError(f"must be an integer in 0..{MAX_SEED}, got {shown}", source=option)
    return seed


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name``; a UsageError unless float32 or float64."""
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; accepted: float32, float64", source="dtype")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """The torch device named ``name``; a UsageError unless it is known and available."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r}", source="device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "CUDA was asked for but this torch build sees no CUDA device", source="device"
        )
    if device.type == "mps" and not (
        hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    ):
        raise UsageError("MPS was asked for but is not available", source="device")
    # torch.device() accepts every device type torch knows of (meta, xpu, hpu, ...), available or
    # not; a value that holds and returns a number is one the analyses and training can run on.
    # 'meta' tensors have shapes but no data, so nothing could be computed there.
    try:
        usable = torch.ones(1, device=device).add(1).item() == 2.0
    except (
        Exception
    ) as exc:  # RuntimeError, NotImplementedError, AssertionError: not built/available
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"device {name!r} cannot hold data here ({first})", source="device"
        ) from None
    if not usable:
        raise UsageError(f"device {name!r} does not compute correctly", source="device")
    return device


def loss_for_task(task: str, per_position: bool = False) -> str:
    """The default loss of ``task``: ``mse`` for regression, ``cross-entropy`` otherwise, and
    ``token-cross-entropy`` for class labels ``per_position`` (``(N, T)``, a sequence model's)."""
    if task == "regression":
        return MSE
    return TOKEN_CROSS_ENTROPY if per_position else CROSS_ENTROPY


def _binary_values(y: torch.Tensor) -> bool:
    """Whether every label or target in ``y`` is 0 or 1 (and there is at least one)."""
    return y.numel() > 0 and bool(((y == 0) | (y == 1)).all())


def infer_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> tuple[str, str]:
    """The loss a model's outputs and labels call for when nothing names one, and why.

    Only a reading that no other loss shares is taken; where two losses fit the same outputs
    and labels, the caller must name one (``loss``), and a UsageError says so:

    - one output per sample with labels 0 and 1 (integers or floats), or integer labels:
      ``binary-cross-entropy`` (a logit per sample; an ``mse`` regression on 0/1 targets is a
      rare choice that must be named; integer labels beyond 0/1 are refused by its check);
    - class labels ``(batch, length)`` for outputs ``(batch, length, vocabulary)``:
      ``token-cross-entropy``;
    - integer class labels one per sample and several outputs: ``cross-entropy``;
    - floating targets that are not all 0/1: ``mse``, the one loss of real-valued targets;
    - floating 0/1 targets shaped as several outputs per sample (one-hot or multi-label): three
      losses fit (``mse``, ``binary-cross-entropy`` element-wise, cross-entropy with
      probability targets), so none is picked.

    Args:
        task: ``"classification"`` (integer labels) or ``"regression"`` (floating targets).
        out: The model's outputs on the first rows, batch first.
        y: Their labels or targets (the same rows).

    Returns:
        ``(loss name, the reason in words)`` for the report.

    Raises:
        UsageError: (``loss``) two losses fit equally.
    """
    one_output = out.ndim == 1 or out[0].numel() == 1
    binary = _binary_values(y)
    if one_output and (binary or task != "regression"):
        kind = "float" if y.is_floating_point() else "integer"
        return BINARY_CROSS_ENTROPY, f"inferred: one output per sample, {kind} labels 0/1"
    if task == "regression":
        if binary and not one_output:
            raise UsageError(
                f"targets 0/1 for {out[0].numel()} outputs per sample fit several losses "
                "(mse, binary-cross-entropy element-wise, cross-entropy on probability "
                "targets); name it with `loss`",
                source="loss",
            )
        return MSE, "inferred: real-valued targets"
    if out.ndim == 3 and y.ndim == 2:
        return (
            TOKEN_CROSS_ENTROPY,
            "inferred: labels per position of (batch, length, classes) outputs",
        )
    return CROSS_ENTROPY, f"inferred: integer class labels, {out[0].numel()} outputs per sample"


def check_model_accepts(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    task: str,
    source: str,
    loss: str | None = None,
) -> tuple[int, str]:
    """Run one sample through the model; return its outputs per sample and the loss.

    Catches what a user can get wrong: features of the wrong shape, labels out of the
    model's range, targets of the wrong width (each loss's own check,
    :attr:`sharpcli.losses.Loss.check`). ``loss`` (from the checkpoint) or, if absent, the
    loss :func:`infer_loss` picks.
    """
    out = model_outputs(model, x[:1], source)
    loss = loss or infer_loss(task, out, y)[0]
    problem = get_loss(loss).problem(out, y)
    if problem:
        raise InputError(problem, source=source)
    return int(out[0].numel()), loss


def model_outputs(model: nn.Module, x: torch.Tensor, source: str) -> torch.Tensor:
    """The model's outputs on the samples ``x`` (no gradients): features it cannot take, or
    outputs that are not one tensor, are an InputError on ``source`` (the data).

    The pass runs in eval mode (the model's mode restored after it): a model about to train
    keeps its BatchNorm running statistics and ``num_batches_tracked`` untouched by this check,
    and a BatchNorm1d layer accepts the one sample :func:`check_model_accepts` sends.

    Args:
        model: The model (its output selector attached).
        x: A few samples.
        source: The data, for messages.

    Returns:
        The outputs, batch first.
    """
    if x.shape[0] == 0:
        raise InputError("the analysis set is empty", source=source)
    was_training = model.training
    try:
        with torch.no_grad():
            out = model.eval()(x)
    # TypeError/KeyError: a forward that indexes or calls what the data does not hold (a
    # missing key of a dict batch, an argument the inputs do not give) is the data's misfit
    except (RuntimeError, ValueError, IndexError, TypeError, KeyError) as exc:
        shape = tuple(x.shape[1:])
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"samples of shape {shape} do not fit the model ({first})" + _images_hint(model, x),
            source=source,
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise InputError(
            f"the model returns a {type(out).__name__}, not a tensor of logits", source=source
        )
    return out


def _images_hint(model: nn.Module, x: torch.Tensor) -> str:
    """For inputs ``(N, H, W)`` the model refused: the option that reads them as one-channel
    images ``(N, 1, H, W)``, when the model takes that shape (a refusal's hint, never a
    reshape: a 3-D array is a Conv1d's ``(N, C, L)`` as much as images, so the data's shape is
    not changed without ``x_shape``)."""
    if x.ndim != 3 or not x.is_floating_point():
        return ""
    try:
        with torch.no_grad():
            model(x[:1].unsqueeze(1))
    except Exception:  # the hint only: the refusal above stands either way
        return ""
    height, width = x.shape[1:]
    return (
        f"; as one-channel images (1, {height}, {width}) it fits: pass `x_shape=1,{height},{width}`"
    )


SECOND_DERIVATIVE_SAMPLES = (
    8  # samples of the self-check of second derivatives (0.1 s on a ResNet-8)
)
SECOND_DERIVATIVE_MAX_PARAMS = 20_000_000  # beyond: no float64 copy for the check
_SECOND_DERIVATIVE_RTOL = 1e-5


SELF_CHECK_VECTORS = 12  # float64 P-vectors the self-check holds at its peak (measured)


def self_check_samples(model: nn.Module) -> int:
    """Samples of the self-check: :data:`SECOND_DERIVATIVE_SAMPLES`, 1 for models above 1M
    parameters (a wrong second derivative shows on any sample; float64 products of a large
    model on 8 samples cost more than a whole float32 Hessian product: 12 s on ResNet-18, and
    2.7 CPU s on 2 samples against 1.7 on 1, measured 2026-12-07)."""
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return SECOND_DERIVATIVE_SAMPLES if count <= 1_000_000 else 1


def self_check_bytes(model: nn.Module) -> int:
    """Bytes :func:`check_second_derivatives` holds at its peak: a float64 copy of the model,
    its gradients, the direction, the product and the difference quotients' gradients, about
    :data:`SELF_CHECK_VECTORS` float64 copies of the trainable parameters (nothing beyond
    :data:`SECOND_DERIVATIVE_MAX_PARAMS`, where the check does not run)."""
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 0 if count > SECOND_DERIVATIVE_MAX_PARAMS else SELF_CHECK_VECTORS * 8 * count


def check_second_derivatives(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str, source: str, seed: int = 0
) -> float | None:
    """Refuse a model whose second derivatives torch computes wrongly, before any analysis.

    Every curvature figure rests on torch's double backward through each layer of the model,
    and some layers get it wrong without an error: a custom ``autograd.Function`` whose
    backward is not itself differentiable (``@once_differentiable``, a backward under
    ``no_grad``) simply contributes nothing to it, so Hessian products come out silently wrong
    (sharp substitutes the torch kernels found wrong, :mod:`sharpcli.curvature.products.differentiable`,
    but cannot know a user's own). Check, on a float64 copy of the model and the first
    ``len(x)`` samples: one Hessian-vector product ``H v`` by double backward (``v`` a seeded
    unit Gaussian over the trainable parameters) against the central difference of the
    gradient ``(g(theta + h v) - g(theta - h v)) / 2h`` with ``h = 1e-6 max(1, ||theta||)``,
    which needs first derivatives only. In float64 the difference is exact to about 1e-9
    relative (truncation ``O(h^2)``, rounding ``u ||g|| / h``, kinks of ReLU nets almost never
    crossed by so small a step); a layer with a wrong second derivative is off by percent.
    Raises :class:`InputError` (``source``, the checkpoint) when the relative difference
    exceeds 1e-5 beyond the rounding allowance and a difference quotient with ten times the
    step agrees with the first (the gradient is smooth along ``v``: no kink crossed, where a
    quotient has a jump term instead of the curvature). Returns the relative difference, or
    None where nothing was concluded: models above :data:`SECOND_DERIVATIVE_MAX_PARAMS`
    trainable parameters, models that cannot be copied to float64, kinks crossed.

    Layers whose autograd second derivative is altered by design, sharp's ``augmented-relu``
    and ``diminished-gelu`` ([NME] eq. 15-16, :data:`~sharpcli.models.activations.ALTERED_DERIVATIVE_TYPES`),
    are checked against their intended derivatives instead
    (:func:`~sharpcli.models.activations.intended_derivative_error`, on a grid of inputs); in
    the float64 copy they are then replaced by ReLU / GELU, which have the same forward pass and
    gradient, so the comparison above checks every other layer of the model
    (:func:`altered_derivative_notes` says so in the report).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable or sum(p.numel() for p in trainable) > SECOND_DERIVATIVE_MAX_PARAMS:
        return None
    twin = _float64_twin(model, source)
    if twin is None:
        return None
    params: list[torch.Tensor] = [p for p in twin.parameters() if p.requires_grad]
    x = x.to(torch.float64) if x.is_floating_point() else x
    y = y[: x.shape[0]]
    y = y.to(torch.float64) if y.is_floating_point() else y
    mean_loss = get_loss(loss).mean

    def gradient(create_graph: bool) -> list[torch.Tensor]:
        with torch.enable_grad():
            grads = torch.autograd.grad(
                mean_loss(twin(x), y), params, create_graph=create_graph, allow_unused=True
            )
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    v = _unit_direction(params, seed)
    g, hv = _double_backward_product(gradient, params, v)
    theta = [p.detach().clone() for p in params]
    norm_theta = float(torch.sqrt(_squared_norm(theta)))

    def central_difference(h: float) -> torch.Tensor:
        sides = []
        with torch.no_grad():
            for sign in (1.0, -1.0):
                torch._foreach_copy_(params, theta)
                torch._foreach_add_(params, v, alpha=sign * h)
                sides.append(torch.cat([t.reshape(-1) for t in gradient(create_graph=False)]))
            torch._foreach_copy_(params, theta)
        return (sides[0] - sides[1]) / (2 * h)

    g_norm = float(torch.cat([t.detach().reshape(-1) for t in g]).norm())
    eps = torch.finfo(torch.float64).eps

    def within(a: torch.Tensor, b: torch.Tensor, h: float) -> bool:
        scale = max(float(a.norm()), float(b.norm()))
        return float((a - b).norm()) <= _SECOND_DERIVATIVE_RTOL * scale + 1e3 * eps * g_norm / h

    h = 1e-6 * max(1.0, norm_theta)
    fd = central_difference(h)
    if within(hv, fd, h):
        return float((hv - fd).norm()) / max(float(hv.norm()), float(fd.norm()), 1e-300)
    # A mismatch is conclusive only where the gradient is smooth along v: across a kink (a
    # ReLU pre-activation or max-pool tie at exactly 0, as in hand-built nets) a difference
    # quotient has a jump term ~1/h, and one ten times the step then disagrees with it.
    if not within(fd, central_difference(10 * h), 10 * h):
        return None
    error, scale = float((hv - fd).norm()), max(float(hv.norm()), float(fd.norm()))
    raise InputError(
        f"torch computes this model's second derivatives wrongly: a Hessian-vector product "
        f"by double backward differs from central differences of the gradient by "
        f"{error / scale:.2g} (relative) on {x.shape[0]} samples, so every curvature figure "
        f"would be wrong. {_wrong_derivative_cause(model)}",
        source=source,
    )


def _float64_twin(model: nn.Module, source: str) -> nn.Module | None:
    """A float64 copy of ``model`` in eval mode with sharp's altered activations checked
    against their intended derivatives and replaced by ReLU / GELU
    (:func:`check_second_derivatives`); None for a model that cannot be copied or widened."""
    try:
        twin = copy.deepcopy(model).to(torch.float64).eval()
    except (RuntimeError, TypeError, copy.Error):  # a model that cannot be copied or widened
        return None
    # sharp's augmented ReLU / diminished GELU change the second derivative on purpose ([NME]
    # 4.4): each is checked against its intended closed form, and the model's Hessian product
    # against central differences with a twin of the same gradient and true second derivatives
    for layer in replace_altered_activations(twin):
        deviation = intended_derivative_error(layer)
        if deviation > _SECOND_DERIVATIVE_RTOL:
            raise InputError(
                f"torch computes the second derivative of the {layer.spec} layers wrongly: "
                f"double backward differs from the intended closed form by {deviation:.2g} "
                "(relative), so every curvature figure would be wrong",
                source=source,
            )
    return twin


def _unit_direction(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """A seeded unit Gaussian direction over ``params`` (drawn on the CPU in float64)."""
    generator = torch.Generator().manual_seed(seed)
    v = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]
    norm_v = torch.sqrt(_squared_norm(v))
    return [(t / norm_v).to(p.device) for t, p in zip(v, params)]


def _squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``sum_t ||t||^2`` over a non-empty list, added in the list's order (0-dim)."""
    return functools.reduce(operator.add, [(t * t).sum() for t in tensors])


def _double_backward_product(gradient, params: list[torch.Tensor], v: list[torch.Tensor]):
    """``(g, H v)``: the gradient (with its graph) and the Hessian-vector product by double
    backward, flat; parameters the gradient does not depend on give zeros."""
    with torch.enable_grad():
        g = gradient(create_graph=True)
        dot = sum((a * b).sum() for a, b in zip(g, v) if a.requires_grad)
        hv = (
            torch.autograd.grad(dot, params, allow_unused=True)
            if torch.is_tensor(dot) and dot.requires_grad
            else [None] * len(params)
        )
    flat = torch.cat(
        [(torch.zeros_like(p) if t is None else t).reshape(-1) for p, t in zip(params, hv)]
    )
    return g, flat


def _wrong_derivative_cause(model: nn.Module) -> str:
    """The likely cause of a wrong second derivative: a padding row, else a layer's backward."""
    padded = padding_embeddings(model)
    if padded:
        return (
            f"nn.Embedding {padded[0][0]!r} has padding_idx={padded[0][1].padding_idx}: torch "
            "zeroes that row's gradient although the pad id reaches the loss (no attention "
            "mask?), so the gradient is not the loss's derivative there; pass the attention "
            "mask with the data (key attention_mask) or build the embedding without padding_idx"
        )
    return (
        "A layer's backward is not differentiable (a custom autograd.Function marked "
        "once_differentiable or computing its backward without autograd, an unsupported kernel)"
    )


def padding_embeddings(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """``(name, module)`` of every ``nn.Embedding`` with a ``padding_idx``."""
    return [
        (name, module)
        for name, module in embedding_modules(model)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None
    ]


def release_padding_rows(model: nn.Module) -> list[str]:
    """Set ``padding_idx`` to None on the analysed model's embeddings; a note for each.

    ``nn.Embedding(padding_idx=k)`` only changes the backward pass: torch zeroes row ``k``'s
    gradient (the row is never trained), whatever the loss. Where pad ids reach the loss (no
    attention mask hides them) that gradient is not the loss's derivative, and its double
    backward is not a symmetric Hessian: the self-check would refuse the model and Lanczos
    would be wrong. Without it the analysis differentiates the loss itself, the pad row
    included; where pad ids do not reach the loss, nothing changes (the row's derivatives are
    zero either way). The forward pass is the same.
    """
    notes = []
    for name, module in padding_embeddings(model):
        notes.append(
            f"{type(module).__name__} {name!r}: padding_idx={module.padding_idx} released for the "
            "analysis (torch zeroes the pad row's gradient; curvature is of the loss itself)"
        )
        module.padding_idx = None
    return notes


def altered_derivative_notes(model: nn.Module) -> list[str]:
    """A note per kind of layer whose autograd second derivative is altered by design.

    Curvature figures of such a model use the altered derivative ([NME] 4.4: augmented ReLU's
    Gaussian ``beta phi(beta x)`` in place of ReLU's 0, diminished GELU's 0 in place of GELU's
    ``phi'' ``); the self-check compared those layers with that intended derivative
    (:func:`check_second_derivatives`). Empty for every other model.
    """
    specs = sorted({m.spec for m in model.modules() if isinstance(m, ALTERED_DERIVATIVE_TYPES)})
    return [
        f"{spec} layers have an autograd second derivative altered by design (NME 4.4): "
        "curvature figures use it; the self-check compared it with its intended closed form"
        for spec in specs
    ]


def unreached_parameter_notes(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str
) -> list[str]:
    """A note naming the trainable parameters the loss does not depend on, on ``x``.

    A parameter that no path of the forward pass reaches (an auxiliary head left unused in
    eval mode, a branch behind ``.detach()``) has zero rows in every curvature matrix, which
    reads like flatness; the note says why. One forward pass on the samples ``x`` with its
    autograd graph, walked from the loss to its leaves: a parameter is reached when the graph
    accumulates a gradient into it (the parameters ``torch.autograd.grad(...,
    allow_unused=True)`` would not return as ``None``; a parameter used with a zero gradient is
    reached), found without running the backward pass (on GPT-2 small the backward was two
    thirds of this check's cost). Empty when every trainable parameter is reached.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named or x.shape[0] == 0:
        return []
    with torch.enable_grad():
        value = get_loss(loss).mean(model(x), y[: x.shape[0]])
    reached = _graph_leaves(value.grad_fn) if value.requires_grad else set()
    del value  # the graph and its activations
    unreached = [n for n, p in named if id(p) not in reached]
    if not unreached:
        return []
    shown = ", ".join(unreached[:5]) + (
        f" and {len(unreached) - 5} more" if len(unreached) > 5 else ""
    )
    return [
        f"{len(unreached)} trainable parameter tensor(s) do not reach the loss on the first "
        f"{x.shape[0]} samples ({shown}): their rows of every curvature matrix are zero"
    ]


def _graph_leaves(root) -> set[int]:
    """``id`` of every leaf tensor the autograd graph below ``root`` accumulates a gradient
    into (its ``AccumulateGrad`` nodes), by an iterative walk over ``next_functions``."""
    leaves: set[int] = set()
    seen: set[int] = set()
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return leaves


def check_deterministic_forward(
    model: nn.Module, x: torch.Tensor, source: str, first: torch.Tensor | None = None
) -> None:
    """Refuse a model that is not deterministic in analysis mode (eval mode, as [PyHessian]).

    The analysis loss ``L(theta)`` must be a function of ``theta``: a module still in training
    mode that behaves differently there (dropout with p > 0, BatchNorm on batch statistics,
    see :func:`sharpcli.curvature.products.data.train_mode_modules`; possible when a foreign model
    overrides ``train()``), or a forward that draws random numbers whatever the mode (e.g.
    ``F.dropout(x, training=True)``), would make every curvature product random. Checked on the
    first batch: two forward passes must give bit-identical logits (the global RNG state is
    restored afterwards). Raises :class:`UsageError` naming the modules or the difference.
    ``first``: the outputs of an earlier forward pass on the same ``x`` (without gradients, in
    the same mode), which then stands for the first of the two passes.
    """

    offenders = train_mode_modules(model)
    if offenders:
        shown = ", ".join(offenders[:5]) + (" ..." if len(offenders) > 5 else "")
        raise InputError(
            f"the model stays in training mode after eval() in {shown} (dropout/BatchNorm active): "
            "curvature would be random",
            source=source,
        )
    if x.shape[0] == 0:
        return
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        if first is None:
            first = model(x)
        second = model(x)
    if not torch.equal(first, second):
        both_nan = torch.isnan(first) & torch.isnan(second)
        if not torch.equal(first[~both_nan], second[~both_nan]):
            diff = float((first - second)[~both_nan].abs().max())
            raise InputError(
                f"the model is not deterministic in eval mode: two forward passes on the same inputs differ "
                f"by up to {diff:.3g} (a layer draws random numbers, e.g. dropout with training=True): "
                "curvature would be random",
                source=source,
            )
