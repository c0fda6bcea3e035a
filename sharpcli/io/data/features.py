"""Features as a model takes them: the analysis dtype, or int64 token ids for embeddings.

A model without ``nn.Embedding``/``nn.EmbeddingBag`` gets its features in the analysis dtype
(:func:`to_analysis_dtype`); a model whose embeddings look up the input itself gets int64 ids,
each checked against the embeddings' rows (:func:`prepare_features`). Training and the
analysis session both prepare their data here (through :mod:`sharpcli.preflight`).
"""

from __future__ import annotations

import torch
from torch import nn

from sharpcli.errors import InputError

EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def embedding_modules(model: nn.Module) -> list[tuple[str, nn.Embedding | nn.EmbeddingBag]]:
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
    answer holds, and the failure itself is left to :func:`sharpcli.preflight.check_model_accepts`.
    """
    embeddings = embedding_modules(model)
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
    the range seen. Other failures of the forward are left to :func:`sharpcli.preflight.check_model_accepts`.
    """
    embeddings = embedding_modules(model)
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
    except Exception:  # a model that does not fit the data: preflight.check_model_accepts
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
    if not embedding_modules(model):
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
