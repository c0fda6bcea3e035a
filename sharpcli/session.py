"""Resolve a checkpoint, a data spec and the common options into one analysis session.

Every analysis command starts here: the model is rebuilt (own checkpoint or
foreign state_dict), moved to the device and dtype, put in eval mode
(BatchNorm uses running statistics, dropout off, as PyHessian does); the
analysis set is the chosen split, optionally a fixed seeded subset, checked
against the model (features it accepts, labels within its classes, finite
values). Features take the analysis dtype, except token ids looked up by an
``nn.Embedding``, which reach the model as int64 (:func:`prepare_features`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sharpcli import memory
from sharpcli.errors import InputError, UsageError
from sharpcli.io.checkpoints import LoadedCheckpoint, load_checkpoint
from sharpcli.losses import set_token_reduction
from sharpcli.models.outputs import attach_keyword_inputs, attach_output_selector

DTYPES = {"float32": torch.float32, "float64": torch.float64}
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
        return "mse"
    return "token-cross-entropy" if per_position else "cross-entropy"


def infer_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> str:
    """The loss a model's outputs and labels call for, when the checkpoint names none.

    Regression targets: ``mse``. Class labels: ``token-cross-entropy`` for sequence outputs
    (batch, length, vocabulary) with labels (batch, length); ``binary-cross-entropy`` for one
    logit per sample; ``cross-entropy`` otherwise.
    """
    if task == "regression":
        return "mse"
    if out.ndim == 3 and y.ndim == 2:
        return "token-cross-entropy"
    if out.ndim == 1 or (out.ndim == 2 and out.shape[1] == 1):
        return "binary-cross-entropy"
    return "cross-entropy"


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
    from sharpcli.losses import get_loss

    if x.shape[0] == 0:
        raise InputError("the analysis set is empty", source=source)
    try:
        with torch.no_grad():
            out = model(x[:1])
    except (RuntimeError, ValueError, IndexError) as exc:
        shape = tuple(x.shape[1:])
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"samples of shape {shape} do not fit the model ({first})", source=source
        ) from None
    if not isinstance(out, torch.Tensor):
        raise InputError(
            f"the model returns a {type(out).__name__}, not a tensor of logits", source=source
        )
    loss = loss or infer_loss(task, out, y)
    problem = get_loss(loss).check(out, y)
    if problem:
        raise InputError(problem, source=source)
    return int(out[0].numel()), loss


SECOND_DERIVATIVE_SAMPLES = (
    8  # samples of the self-check of second derivatives (0.1 s on a ResNet-8)
)
SECOND_DERIVATIVE_MAX_PARAMS = 20_000_000  # beyond: no float64 copy for the check
_SECOND_DERIVATIVE_RTOL = 1e-5


SELF_CHECK_VECTORS = 12  # float64 P-vectors the self-check holds at its peak (measured)


def self_check_samples(model: nn.Module) -> int:
    """Samples of the self-check: :data:`SECOND_DERIVATIVE_SAMPLES`, 2 for models above 1M
    parameters (a wrong second derivative shows on any sample; float64 products of a large
    model on 8 samples cost more than a whole float32 Hessian product: 12 s on ResNet-18)."""
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return SECOND_DERIVATIVE_SAMPLES if count <= 1_000_000 else 2


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
    (sharp substitutes the torch kernels found wrong, :mod:`sharpcli.curvature.differentiable`,
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
    import copy

    from sharpcli.losses import get_loss
    from sharpcli.models.activations import intended_derivative_error, replace_altered_activations

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable or sum(p.numel() for p in trainable) > SECOND_DERIVATIVE_MAX_PARAMS:
        return None
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
    params = [p for p in twin.parameters() if p.requires_grad]
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

    generator = torch.Generator().manual_seed(seed)
    v = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]
    norm_v = torch.sqrt(sum((t * t).sum() for t in v))
    v = [(t / norm_v).to(p.device) for t, p in zip(v, params)]
    with torch.enable_grad():
        g = gradient(create_graph=True)
        dot = sum((a * b).sum() for a, b in zip(g, v) if a.requires_grad)
        hv = (
            torch.autograd.grad(dot, params, allow_unused=True)
            if torch.is_tensor(dot) and dot.requires_grad
            else [None] * len(params)
        )
    hv = torch.cat(
        [(torch.zeros_like(p) if t is None else t).reshape(-1) for p, t in zip(params, hv)]
    )
    theta = [p.detach().clone() for p in params]
    norm_theta = float(torch.sqrt(sum((t * t).sum() for t in theta)))

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
    padded = padding_embeddings(model)
    cause = (
        f"nn.Embedding {padded[0][0]!r} has padding_idx={padded[0][1].padding_idx}: torch "
        "zeroes that row's gradient although the pad id reaches the loss (no attention mask?), "
        "so the gradient is not the loss's derivative there; pass the attention mask with the "
        "data (key attention_mask) or build the embedding without padding_idx"
        if padded
        else "A layer's backward is not differentiable (a custom autograd.Function marked "
        "once_differentiable or computing its backward without autograd, an unsupported kernel)"
    )
    raise InputError(
        f"torch computes this model's second derivatives wrongly: a Hessian-vector product "
        f"by double backward differs from central differences of the gradient by "
        f"{error / scale:.2g} (relative) on {x.shape[0]} samples, so every curvature figure "
        f"would be wrong. {cause}",
        source=source,
    )


def padding_embeddings(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every ``nn.Embedding`` with a ``padding_idx``."""
    return [
        (name, module)
        for name, module in _embedding_modules(model)
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
    from sharpcli.models.activations import ALTERED_DERIVATIVE_TYPES

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
    reads like flatness; the note says why. One gradient on the samples ``x`` (parameters
    whose gradient autograd returns as ``None``; a parameter used with a zero gradient is
    reached). Empty when every trainable parameter is reached.
    """
    from sharpcli.losses import get_loss

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named or x.shape[0] == 0:
        return []
    with torch.enable_grad():
        value = get_loss(loss).mean(model(x), y[: x.shape[0]])
        if not value.requires_grad:
            grads = [None] * len(named)
        else:
            grads = torch.autograd.grad(value, [p for _, p in named], allow_unused=True)
    unreached = [n for (n, _), g in zip(named, grads) if g is None]
    if not unreached:
        return []
    shown = ", ".join(unreached[:5]) + (
        f" and {len(unreached) - 5} more" if len(unreached) > 5 else ""
    )
    return [
        f"{len(unreached)} trainable parameter tensor(s) do not reach the loss on the first "
        f"{x.shape[0]} samples ({shown}): their rows of every curvature matrix are zero"
    ]


def check_deterministic_forward(model: nn.Module, x: torch.Tensor, source: str) -> None:
    """Refuse a model that is not deterministic in analysis mode (eval mode, as [PyHessian]).

    The analysis loss ``L(theta)`` must be a function of ``theta``: a module still in training
    mode that behaves differently there (dropout with p > 0, BatchNorm on batch statistics,
    see :func:`sharpcli.curvature.data.train_mode_modules`; possible when a foreign model
    overrides ``train()``), or a forward that draws random numbers whatever the mode (e.g.
    ``F.dropout(x, training=True)``), would make every curvature product random. Checked on the
    first batch: two forward passes must give bit-identical logits (the global RNG state is
    restored afterwards). Raises :class:`UsageError` naming the modules or the difference.
    """
    from sharpcli.curvature.data import train_mode_modules

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


EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def _embedding_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every ``nn.Embedding``/``nn.EmbeddingBag`` in ``model``."""
    return [
        (name or type(model).__name__, module)
        for name, module in model.named_modules()
        if isinstance(module, EMBEDDING_TYPES)
    ]


def _lookup_input(args: tuple, kwargs: dict):
    """The index tensor an embedding's forward receives (positional or ``input=``)."""
    return args[0] if args else kwargs.get("input")


def embeddings_fed_by_input(model: nn.Module, probe: torch.Tensor) -> list[tuple[str, nn.Module]]:
    """The embeddings that look up the model's input itself: ``(name, module)`` in call order.

    ``probe`` (a few samples, already on the model's device, as the model would get them) is
    run through ``model`` with a forward pre-hook on every ``nn.Embedding``/``nn.EmbeddingBag``;
    an embedding counts when the tensor it receives *is* ``probe`` or a view of it (the same
    storage: ``x.view``, ``x[:, :T]``, ``x.flatten(1)``, ``x.long()`` on int64 all qualify),
    i.e. the data's features are its token ids. An embedding that gets ids the model computed
    (``x.long()`` on float features, positions from ``arange``) does not count: the model
    converts those itself. The forward may fail (float ids reaching an embedding, integer
    features reaching an ``nn.Linear``): every pre-hook on the way has run by then, so the
    answer holds, and the failure itself is left to :func:`check_model_accepts`.
    """
    embeddings = _embedding_modules(model)
    if not embeddings:
        return []
    storage = probe.untyped_storage().data_ptr()
    fed: list[tuple[str, nn.Module]] = []

    def make_hook(name: str):
        def hook(module, args, kwargs):
            ids = _lookup_input(args, kwargs)
            if (
                isinstance(ids, torch.Tensor)
                and ids.device == probe.device
                and ids.untyped_storage().data_ptr() == storage
                and all(module is not m for _, m in fed)
            ):
                fed.append((name, module))

        return hook

    handles = [
        module.register_forward_pre_hook(make_hook(name), with_kwargs=True)
        for name, module in embeddings
    ]
    devices = [probe.device] if probe.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model(probe)
    except Exception:  # only the hooks' findings matter here (docstring)
        pass
    finally:
        for handle in handles:
            handle.remove()
    return fed


def check_embedding_ids(model: nn.Module, x: torch.Tensor, batch_size: int, source: str) -> None:
    """Refuse data whose token ids an embedding of ``model`` cannot look up (``InputError``).

    ``nn.Embedding`` raises ``IndexError: index out of range`` for an id outside
    ``[0, num_embeddings)``, and in the middle of a curvature pass that would be an internal
    error. So, for a model with embeddings, the whole of ``x`` (as the model gets it) is run
    through it once, without gradients, in batches of ``batch_size``; a forward pre-hook on
    every embedding records the smallest and largest integer id it receives (from the data or
    computed by the model from it) and clamps out-of-range ids so the pass finishes. Any id
    outside an embedding's rows raises ``InputError(source=source)`` naming the embedding and
    the range seen. Other failures of the forward are left to :func:`check_model_accepts`.
    """
    embeddings = _embedding_modules(model)
    if not embeddings or x.shape[0] == 0:
        return
    seen: dict[str, list[int]] = {}

    def make_hook(name: str):
        def hook(module, args, kwargs):
            ids = _lookup_input(args, kwargs)
            if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.numel() == 0:
                return None
            low, high = int(ids.min()), int(ids.max())
            bounds = seen.setdefault(name, [low, high])
            bounds[0], bounds[1] = min(bounds[0], low), max(bounds[1], high)
            rows = int(module.num_embeddings)
            if low >= 0 and high < rows:
                return None
            clamped = ids.clamp(0, rows - 1)
            if args:
                return (clamped, *args[1:]), kwargs
            return args, {**kwargs, "input": clamped}

        return hook

    handles = [
        module.register_forward_pre_hook(make_hook(name), with_kwargs=True)
        for name, module in embeddings
    ]
    devices = [x.device] if x.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for start in range(0, x.shape[0], max(1, int(batch_size))):
                model(x[start : start + batch_size])
    except Exception:  # a model that does not fit the data: check_model_accepts
        pass
    finally:
        for handle in handles:
            handle.remove()
    for name, module in embeddings:
        if name not in seen:
            continue
        low, high = seen[name]
        rows = int(module.num_embeddings)
        if low < 0 or high >= rows:
            raise InputError(
                f"token ids range over [{low}, {high}] but the model's "
                f"{type(module).__name__} {name!r} has {rows} rows (ids 0..{rows - 1})",
                source=source,
            )


def prepare_features(
    model: nn.Module,
    x: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    source: str,
    batch_size: int = 256,
) -> tuple[torch.Tensor, list[str]]:
    """Features as ``model`` takes them, on ``device``: ``(x, notes)``.

    How the dtype is decided (``model`` already on ``device`` in ``dtype``, in eval mode):

    - a model without ``nn.Embedding``/``nn.EmbeddingBag``: ``x`` in the analysis ``dtype``
      (integer features such as uint8 pixels or counts become floats, as always);
    - otherwise a probe of two samples finds the embeddings that look up the input itself
      (:func:`embeddings_fed_by_input`: the model is *tried*, not guessed from its layer
      order). None: as above. Some, with integer features: int64, never the float dtype.
      Some, with floating features: every value must be a whole number (else
      ``InputError``: an embedding cannot look up 2.5), and they become int64 with a note
      saying so (``notes``, carried into the report and printed by the CLI);
    - for any model with embeddings, :func:`check_embedding_ids` then checks every id of the
      set against the embeddings' rows, so an out-of-range id is an ``InputError`` naming
      ``source`` (exit 2) instead of an ``IndexError`` deep inside an analysis.
    """
    if not _embedding_modules(model):
        return to_analysis_dtype(x, dtype, device, source, "features"), []
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # the probes must not touch BatchNorm statistics of a model about to train
    try:
        return _prepare_for_embeddings(model, x, dtype, device, source, batch_size)
    finally:
        for module, training in modes:
            module.training = training


def to_analysis_dtype(
    values: torch.Tensor, dtype: torch.dtype, device: torch.device, source: str, what: str
) -> torch.Tensor:
    """``values`` (features or regression targets of ``source``) on ``device`` in the analysis
    ``dtype``. A file may store float64 (the loader keeps it, so a float64 analysis sees the
    values unrounded): narrowed to float32, a value beyond the float32 range would become
    Inf, so that is an ``InputError`` naming the file instead."""
    out = values.to(device=device, dtype=dtype)
    narrowed = (
        values.is_floating_point() and torch.finfo(dtype).bits < torch.finfo(values.dtype).bits
    )
    if narrowed and not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        raise InputError(
            f"{what} hold {bad} value(s) beyond the {str(dtype).replace('torch.', '')} range "
            "(the file stores float64); use `dtype` float64",
            source=source,
        )
    return out


def _prepare_for_embeddings(
    model: nn.Module,
    x: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    source: str,
    batch_size: int,
) -> tuple[torch.Tensor, list[str]]:
    """:func:`prepare_features` for a model with embeddings (in eval mode)."""
    floating = x.is_floating_point()
    probe = x[:2].to(device=device, dtype=dtype if floating else torch.int64).clone()
    fed = embeddings_fed_by_input(model, probe)
    notes: list[str] = []
    if not fed:
        x = to_analysis_dtype(x, dtype, device, source, "features")
    elif not floating:
        x = x.to(device=device, dtype=torch.int64)
    else:
        names = ", ".join(f"{type(m).__name__} {n!r}" for n, m in fed)
        fractional = x != torch.round(x)
        if bool(fractional.any()):
            example = float(x[fractional][0])
            raise InputError(
                f"features feed the model's {names}, which looks up integer token ids, but are "
                f"not whole numbers (e.g. {example:g})",
                source=source,
            )
        widest = float(x.abs().max())
        if widest >= 2.0**62:
            raise InputError(
                f"features feed the model's {names} but hold whole numbers as large as "
                f"{widest:.3g}, beyond any token id",
                source=source,
            )
        x = x.to(device=device, dtype=torch.int64)
        notes.append(
            f"{source}: floating-point features, all whole numbers, feed the model's {names}: "
            "converted to int64 token ids"
        )
    check_embedding_ids(model, x, batch_size, source)
    return x, notes


@dataclass
class Session:
    """A model in analysis mode and its analysis set, with what produced them."""

    checkpoint: LoadedCheckpoint
    model: nn.Module
    dataset: object  # sharpcli.io.datasets.Dataset
    x: torch.Tensor
    y: torch.Tensor
    loss: str
    split: str
    batch_size: int
    device: torch.device
    dtype: torch.dtype
    seed: int
    num_outputs: int
    # budget of cached first-order graphs in curvature passes; None: up to what the memory
    # plan leaves (sharpcli.curvature.operators.CurvaturePass.plan_memory)
    cache_bytes: int | None = None
    # token-cross-entropy: "tokens" (mean over all labelled tokens) or "samples", and the mean
    # labelled positions per sample that the token mean divides by
    token_reduction: str | None = None
    mean_positions: float | None = None
    extra: dict = field(default_factory=dict)
    # what was done to the checkpoint and the data (stderr); the report keeps the checkpoint's
    # in checkpoint.notes and the rest in data.notes
    notes: list[str] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        """The number of samples analysed."""
        return int(self.x.shape[0])

    def data_info(self) -> dict:
        """The report's ``data`` section; ``notes`` (e.g. float ids converted) when there are any."""
        info = {
            "spec": self.dataset.spec,
            "split": self.split,
            "samples": self.num_samples,
            "loss": self.loss,
        }
        if self.token_reduction is not None:
            info["token_reduction"] = self.token_reduction
        notes = [note for note in self.notes if note not in self.checkpoint.notes]
        if notes:
            info["notes"] = notes
        return info

    def analysis_data(self):
        """The analysis set as the curvature engine streams it."""
        from sharpcli.curvature import AnalysisData

        return AnalysisData(self.x, self.y, loss=self.loss, batch_size=self.batch_size)

    def scope(self, spec: str | None):
        """The parameter scope of ``spec`` in the model (:meth:`ParamScope.resolve`)."""
        from sharpcli.curvature import ParamScope

        return ParamScope.resolve(self.model, spec)

    def environment(self) -> dict:
        """The report's ``environment`` section for this session's device, dtype and world size."""
        from sharpcli.curvature.data import distributed_rank_and_world
        from sharpcli.report.envelope import environment_info

        _, world = distributed_rank_and_world()
        return environment_info(str(self.device), str(self.dtype).replace("torch.", ""), world)

    def report(self, command: str, settings: dict, results: dict, matvecs: int = 0) -> dict:
        """The full report of ``command`` with this session's checkpoint, data and environment."""
        from sharpcli.report.envelope import make_report

        return make_report(
            command,
            settings=settings,
            results=results,
            checkpoint=self.checkpoint.info(),
            data=self.data_info(),
            timing={"seconds": 0.0, "matvecs": int(matvecs)},
            environment=self.environment(),
        )


def _load_data(spec, label_column: str | None, from_checkpoint: str | None, **options):
    """``load_dataset(spec)``; when the spec is the checkpoint's own (``from_checkpoint``, no
    ``--data`` given), a bad spec is an InputError naming the checkpoint's metadata, not the
    ``--data`` option the user never gave. How a metadata path resolves: docs/checkpoints.md."""
    from sharpcli.io.checkpoints import META_DATA
    from sharpcli.io.datasets import load_dataset

    what = "the `data` file" if from_checkpoint is None else f"the data named in {from_checkpoint}"
    try:
        return load_dataset(spec, label_column=label_column, what=what, **options)
    except UsageError as err:
        if from_checkpoint is None or err.source not in ("data", "spec"):
            raise
        raise InputError(f"metadata {META_DATA}: {err.message}", source=from_checkpoint) from None


def _metadata_loss(ckpt: LoadedCheckpoint, checkpoint: str) -> str | None:
    """The training loss the checkpoint's metadata names (None: infer it from the outputs);
    anything but a registered loss name is an InputError naming the checkpoint."""
    from sharpcli.io.checkpoints import META_TRAIN
    from sharpcli.losses import LOSSES

    loss = (ckpt.train_config or {}).get("loss")
    if loss is not None and (not isinstance(loss, str) or loss not in LOSSES):
        raise InputError(
            f"metadata {META_TRAIN}: 'loss' is not one of {', '.join(LOSSES)}", source=checkpoint
        )
    return loss


def build_session(
    checkpoint: str,
    *,
    data: str | None = None,
    label_column: str | None = None,
    x_key: str | None = None,
    y_key: str | None = None,
    shift_labels: bool | None = None,
    split: str = "train",
    samples: int | None = None,
    batch_size: int = 256,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    arch: str | None = None,
    arch_args: dict | None = None,
    model_factory: str | None = None,
    trust_pickle: bool = False,
    cache_mb: int | None = None,
    output: str | None = None,
    curvature: bool = True,
    max_memory: str | int | None = None,
    token_reduction: str = "tokens",
    **_ignored,
) -> Session:
    """Load everything an analysis needs; every user mistake is an InputError/UsageError.

    ``curvature`` (default): the analysis differentiates the model twice, so torch's second
    derivatives of it are checked first (:func:`check_second_derivatives`); analyses of
    first derivatives and activations only (``activation-stats``) pass False.
    """
    from sharpcli.io.datasets import subset

    if split not in ("train", "test"):
        raise UsageError(f"unknown split {split!r}; accepted: train, test", source="split")
    if batch_size < 1:
        raise UsageError("must be at least 1", source="batch_size")
    if samples is not None and samples < 1:
        raise UsageError("must be at least 1", source="samples")
    if cache_mb is not None and cache_mb < 0:
        raise UsageError("must be >= 0", source="cache_mb")
    check_seed(seed)
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    # the run's memory plan (sharpcli.memory): estimators size themselves from it
    plan = memory.activate(memory.MemoryPlan.for_run(max_memory, str(torch_device)))

    ckpt = load_checkpoint(
        checkpoint,
        arch=arch,
        arch_args=arch_args,
        model_factory=model_factory,
        trust_pickle=trust_pickle,
    )
    data_spec = data if data is not None else ckpt.data_spec
    if data_spec is None:
        raise UsageError(
            f"the checkpoint {checkpoint} names no dataset; pass `data`", source="data"
        )
    dataset = _load_data(
        data_spec,
        label_column,
        checkpoint if data is None else None,
        x_key=x_key,
        y_key=y_key,
        shift_labels=shift_labels,
        trust_pickle=trust_pickle,
    )
    x, y = dataset.split(split)
    x, y = subset(x, y, samples, seed)

    # requires_grad stays as the model sets it: frozen parameters (a fine-tuned backbone) are
    # outside the default scope (sharpcli.curvature.scope.ParamScope.resolve)
    model = ckpt.model.to(device=torch_device, dtype=torch_dtype).eval()
    # a tuple, dict or .logits output becomes one logits tensor (sharpcli.models.outputs);
    # the selector a training run used is recorded in its checkpoint
    if output is None:
        output = (ckpt.train_config or {}).get("output")
    attach_output_selector(model, output)
    attach_keyword_inputs(model, dataset.input_keys)  # model(**batch) (sharpcli.models.outputs)
    x, notes = prepare_features(
        model, x, torch_dtype, torch_device, dataset.source, batch_size=batch_size
    )
    if curvature:  # pad rows' zeroed gradients are no derivative (release_padding_rows)
        notes += release_padding_rows(model)
    y = y.to(device=torch_device)
    if dataset.task == "regression":
        y = to_analysis_dtype(y, torch_dtype, torch_device, dataset.source, "targets")
    n_out, loss = check_model_accepts(
        model, x, y, dataset.task, dataset.source, _metadata_loss(ckpt, checkpoint)
    )
    check_deterministic_forward(model, x[: min(int(batch_size), 64)], source=checkpoint)
    plan.baseline = memory.allocated_bytes(str(torch_device))  # model and data now loaded
    # the token loss's average (sharpcli.losses.set_token_reduction) over this analysis set
    mean_positions = None
    if loss == "token-cross-entropy":
        mean_positions = set_token_reduction(token_reduction, y)
    if curvature:  # the analysis differentiates the model twice
        with plan.hold("second-derivative self-check", self_check_bytes(model)):
            check_second_derivatives(
                model, x[: self_check_samples(model)], y, loss, source=checkpoint
            )
        notes += altered_derivative_notes(model)
    notes += unreached_parameter_notes(model, x[:SECOND_DERIVATIVE_SAMPLES], y, loss)
    return Session(
        checkpoint=ckpt,
        model=model,
        dataset=dataset,
        x=x,
        y=y,
        loss=loss,
        split=split,
        batch_size=batch_size,
        device=torch_device,
        dtype=torch_dtype,
        seed=seed,
        num_outputs=n_out,
        cache_bytes=None if cache_mb is None else int(cache_mb) << 20,
        token_reduction=token_reduction if loss == "token-cross-entropy" else None,
        mean_positions=mean_positions,
        notes=[*ckpt.notes, *notes],
    )
