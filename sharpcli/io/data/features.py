"""Features as a model takes them: the analysis dtype, or int64 token ids for embeddings.

A model without ``nn.Embedding``/``nn.EmbeddingBag`` gets its features in the analysis dtype
(:func:`to_analysis_dtype`); a model whose embeddings look up the input itself gets int64 ids,
each checked against the embeddings' rows (:func:`prepare_features`). Training and the
analysis session both prepare their data here (through :mod:`sharpcli.preflight`).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    handles = _id_range_hooks(embeddings, seen, [])
    devices = [x.device] if x.device.type == "cuda" else []
    step = max(1, int(batch_size))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for start in range(0, x.shape[0], step):
                model(x[start : start + step])
    except Exception:  # a model that does not fit the data: preflight.check_model_accepts
        pass
    finally:
        for handle in handles:
            handle.remove()
    _raise_out_of_range(embeddings, seen, source)


def _id_range_hooks(embeddings: list, seen: dict[str, list[int]], clamped: list[str]) -> list:
    """Forward pre-hooks of :func:`check_embedding_ids` on ``embeddings``: each records the
    range of the integer ids its embedding receives in ``seen`` and clamps ids out of range
    (naming the embedding in ``clamped``) so that the pass finishes; the handles."""

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
            clamped.append(name)
            within = ids.clamp(0, rows - 1)
            if args:
                return (within, *args[1:]), kwargs
            return args, {**kwargs, "input": within}

        return hook

    return [
        module.register_forward_pre_hook(make_hook(name), with_kwargs=True)
        for name, module in embeddings
    ]


def _raise_out_of_range(embeddings: list, seen: dict[str, list[int]], source: str) -> None:
    """The ``InputError`` of :func:`check_embedding_ids` for the first embedding (in
    ``embeddings``' order) whose ids in ``seen`` fall outside its rows."""
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


def _probe_and_check_ids(
    model: nn.Module, ids: torch.Tensor, batch_size: int, source: str
) -> torch.Tensor | None:
    """The one pass of :func:`prepare_features_and_outputs` over int64 ``ids``: the model's
    outputs on the first batch, or None where the two passes must decide (the first batch
    fed no embedding with ``ids`` themselves, held an id out of range, or failed)."""
    embeddings = embedding_modules(model)
    storage = ids.untyped_storage().data_ptr()
    fed: list[str] = []

    def make_fed_hook(name: str):
        def hook(module, args, kwargs):  # embeddings_fed_by_input's test: the input's storage
            looked_up = _lookup_input(args, kwargs)
            if (
                isinstance(looked_up, torch.Tensor)
                and looked_up.device == ids.device
                and looked_up.untyped_storage().data_ptr() == storage
            ):
                fed.append(name)

        return hook

    # registered before the id hooks, so that each sees the ids the model passes, unclamped
    fed_handles = [
        module.register_forward_pre_hook(make_fed_hook(name), with_kwargs=True)
        for name, module in embeddings
    ]
    seen: dict[str, list[int]] = {}
    clamped: list[str] = []
    handles = _id_range_hooks(embeddings, seen, clamped)
    devices = [ids.device] if ids.device.type == "cuda" else []
    step = max(1, int(batch_size))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            try:
                first = model(ids[:step])
            except Exception:  # the two passes report it as before
                return None
            finally:
                for handle in fed_handles:
                    handle.remove()
            if not fed or clamped:
                return None
            try:
                for start in range(step, ids.shape[0], step):
                    model(ids[start : start + step])
            except Exception:  # as check_embedding_ids: preflight.check_model_accepts
                pass
    finally:
        for handle in handles:
            handle.remove()
    _raise_out_of_range(embeddings, seen, source)
    return first


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
    prepared = prepare_features_and_outputs(model, x, dtype, device, source, batch_size)
    return prepared.x, prepared.notes


@dataclass
class PreparedFeatures:
    """What :func:`prepare_features_and_outputs` returns: the features as the model takes
    them, the notes on their conversion, and the model's outputs on the first batch
    ``x[:batch_size]`` (no gradients, eval mode) where the token-id check computed them,
    else None."""

    x: torch.Tensor
    notes: list[str]
    first_outputs: torch.Tensor | None = None


def prepare_features_and_outputs(
    model: nn.Module,
    x: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    source: str,
    batch_size: int = 256,
) -> PreparedFeatures:
    """:func:`prepare_features`, with the first batch's outputs of the token-id check.

    Integer features (token ids) of a model with embeddings take one pass over the data
    where :func:`prepare_features` describes two: the first batch, as int64, is the probe of
    :func:`embeddings_fed_by_input` and the first batch of :func:`check_embedding_ids` at
    once (the probe's answer does not depend on how many samples it holds: an embedding is
    fed by the input when it receives the input's storage). Where that pass finds an
    embedding fed by the input, every id in range and a forward that completes, its outputs
    on the first batch are returned (``first_outputs``: the loss read takes them as its
    forward pass); anything else (floating features, no embedding fed by the input, an id
    out of range, a forward that fails) takes the two passes, which name the problem as
    before. The features, the notes and any error are those of :func:`prepare_features`.
    """
    if not embedding_modules(model):
        return PreparedFeatures(to_analysis_dtype(x, dtype, device, source, "features"), [])
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # the probes must not touch BatchNorm statistics of a model about to train
    try:
        if not x.is_floating_point() and x.shape[0] > 0:
            ids = x.to(device=device, dtype=torch.int64)
            first_outputs = _probe_and_check_ids(model, ids, batch_size, source)
            if first_outputs is not None:
                return PreparedFeatures(ids, [], first_outputs)
        return PreparedFeatures(
            *_prepare_for_embeddings(model, x, dtype, device, source, batch_size)
        )
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
