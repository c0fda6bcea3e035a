"""Forward passes that can be differentiated twice, and correctly.

Curvature (Hessian products, gradient penalties, third-order regularizers) differentiates a
model's backward pass. Five constructs of PyTorch get that wrong or cannot do it at all, and
within :func:`twice_differentiable` each is replaced by an equivalent that composes ordinary
differentiable operations:

- Fused scaled-dot-product attention (flash, memory-efficient, the CPU flash kernel) has no
  derivative of its backward, so a Hessian product through ``nn.MultiheadAttention`` /
  ``F.scaled_dot_product_attention`` fails ("derivative for
  aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"): the block
  selects the math backend.
- The transformer encoder's inference fast path (``_transformer_encoder_layer_fwd``, taken in
  eval mode without gradients) has no autograd support: the block turns it off, so that every
  forward pass of an analysis (with or without gradients) computes the same function.
- Weight normalisation (``torch.nn.utils.parametrizations.weight_norm`` and the older
  ``torch.nn.utils.weight_norm``, both ``torch._weight_norm``): its fused kernel's *second*
  derivative is wrong (torch 2.13, CPU, float32 and float64): the double-backward Hessian is
  not even symmetric, so every Hessian product through it is silently wrong while first
  derivatives are right (docs/benchmarks.md, "Second derivatives that torch gets wrong"). The
  block computes ``w = g v / ||v||`` (the norm over every dimension but ``dim``,
  :func:`weight_norm_composite`) from differentiable operations instead: the same forward
  value to rounding, and Hessians that agree with central differences.
- ``nn.EmbeddingBag`` (``F.embedding_bag``): torch implements no derivative of its backward
  ("the derivative for '_embedding_bag_backward' is not implemented"), so a Hessian product
  through a bag of embeddings failed. The block computes the bags from an embedding lookup and
  an ``index_add`` per bag (:func:`embedding_bag_composite`; sum and mean, with offsets,
  per-sample weights and ``padding_idx``); ``mode="max"``, ``max_norm`` (which renormalises the
  weight in place) and sparse gradients keep torch's kernel.
- Reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=True)``, the old default) cannot be differentiated twice, and when the inputs
  of the checkpointed block do not require gradients (data do not) torch drops the gradients
  of the block's parameters with only a warning: a model that checkpoints its first block gets
  a Hessian without that block, silently.
  The block runs such checkpointed functions as plain forward passes (:class:`_PlainForward`):
  the same function, its activations kept. Non-reentrant checkpointing differentiates
  correctly and is left alone.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

__all__ = [
    "embedding_bag_composite",
    "reentrant_checkpoints_as_plain_forward",
    "twice_differentiable",
    "weight_norm_composite",
]


def weight_norm_composite(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``w = g * v / ||v||`` with the 2-norm over every dimension of ``v`` but ``dim`` (all of
    them for ``dim=-1``), from differentiable operations: the function of
    ``torch._weight_norm(v, g, dim)`` with a correct second derivative (module docstring).

    Args:
        v: the direction.
        g: the magnitude.
        dim: the dimension kept (-1: none).

    Returns:
        The weight ``w``.
    """
    return v * (g / torch.norm_except_dim(v, 2, dim))


_EMBEDDING_BAG = torch.nn.functional.embedding_bag  # torch's kernel, for what it alone does


def embedding_bag_composite(
    input,
    weight,
    offsets=None,
    max_norm=None,
    norm_type=2,
    scale_grad_by_freq=False,
    mode="mean",
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=None,
):
    """``F.embedding_bag`` from an embedding lookup and a sum per bag (``index_add``), which
    autograd differentiates twice. Same arguments and result: bags are the rows of a 2-D
    ``input``, or the runs of a 1-D ``input`` that ``offsets`` start (the last one ending at
    ``offsets[-1]`` with ``include_last_offset``); ``sum`` weighs each entry by
    ``per_sample_weights``; ``mean`` divides by the entries that are not ``padding_idx``; an
    empty bag gives zeros. ``mode="max"``, ``max_norm``, ``scale_grad_by_freq`` and ``sparse``
    call torch's kernel (module docstring).

    Args:
        input: as :func:`torch.nn.functional.embedding_bag`, like every other argument.
        weight: the embedding table.
        offsets: the bags' starts (1-D ``input``).
        max_norm: torch's kernel when set.
        norm_type: with ``max_norm``.
        scale_grad_by_freq: torch's kernel when set.
        mode: ``"sum"``, ``"mean"`` or ``"max"`` (torch's kernel).
        sparse: torch's kernel when set.
        per_sample_weights: weights of the entries (``sum``).
        include_last_offset: ``offsets[-1]`` ends the last bag.
        padding_idx: entries left out.

    Returns:
        ``(bags, dim)``, as ``F.embedding_bag`` returns.
    """
    if mode == "max" or max_norm is not None or scale_grad_by_freq or sparse:
        return _EMBEDDING_BAG(
            input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
            per_sample_weights, include_last_offset, padding_idx,
        )  # fmt: skip
    if input.dim() == 2:
        bags, length = input.shape
        ids = input.reshape(-1)
        bag_of = torch.arange(bags, device=input.device).repeat_interleave(length)
    else:
        ends = (
            offsets[1:]
            if include_last_offset
            else torch.cat([offsets[1:], offsets.new_tensor([input.numel()])])
        )
        starts = offsets[:-1] if include_last_offset else offsets
        bags, ids = starts.numel(), input[: int(ends[-1])] if ends.numel() else input[:0]
        bag_of = torch.arange(bags, device=input.device).repeat_interleave(ends - starts)
    rows = torch.nn.functional.embedding(ids, weight)
    kept = (
        torch.ones_like(ids, dtype=weight.dtype)
        if padding_idx is None
        else (ids != padding_idx).to(weight.dtype)
    )
    scale = kept if per_sample_weights is None else kept * per_sample_weights.reshape(-1)
    out = weight.new_zeros(bags, weight.shape[1]).index_add(0, bag_of, rows * scale[:, None])
    if mode == "mean":
        counts = weight.new_zeros(bags).index_add(0, bag_of, kept)
        out = out / counts.clamp_min(1)[:, None]
    return out


@contextlib.contextmanager
def _composite_embedding_bag():
    functional = torch.nn.functional
    saved = functional.embedding_bag
    functional.embedding_bag = embedding_bag_composite
    try:
        yield
    finally:
        functional.embedding_bag = saved


class _PlainForward:
    """Stands in for torch's reentrant ``CheckpointFunction``: ``apply`` runs the checkpointed
    function under ordinary autograd (module docstring)."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        return function(*args)


@contextlib.contextmanager
def _plain_reentrant_checkpoint():
    checkpointing: Any = importlib.import_module("torch.utils.checkpoint")
    saved = checkpointing.CheckpointFunction
    checkpointing.CheckpointFunction = _PlainForward
    try:
        yield
    finally:
        checkpointing.CheckpointFunction = saved


def reentrant_checkpoints_as_plain_forward():
    """Within the block, reentrant checkpointed functions run as plain forward passes (their
    activations kept), so the gradients of their parameters, which torch drops with only a
    warning when the block's inputs do not require gradients (data do not), are computed:
    what first-order products (the finite-difference Hessian products) need of
    :func:`twice_differentiable`, whose other substitutes only second derivatives need.

    Returns:
        The context manager.
    """
    return _plain_reentrant_checkpoint()


@contextlib.contextmanager
def _composite_weight_norm():
    # the legacy module binds `_weight_norm` at its import; `torch.nn.utils.weight_norm` is
    # also the name of its function, hence import_module
    legacy: Any = importlib.import_module("torch.nn.utils.weight_norm")
    torch_module: Any = torch  # `_weight_norm` is private: not in torch's type stubs

    saved = torch_module._weight_norm, legacy._weight_norm
    torch_module._weight_norm = legacy._weight_norm = weight_norm_composite
    try:
        yield
    finally:
        torch_module._weight_norm, legacy._weight_norm = saved


@contextlib.contextmanager
def twice_differentiable():
    """Within the block: SDPA uses the math backend, the MHA fast path is off, weight
    normalisation is computed by :func:`weight_norm_composite`, bags of embeddings by
    :func:`embedding_bag_composite`, and reentrant checkpointed blocks as plain forward passes.

    The user's settings (the enabled SDPA backends, ``torch.backends.mha`` fast path),
    ``torch._weight_norm``, ``F.embedding_bag`` and ``CheckpointFunction`` are restored on
    exit, also after an exception. Re-entrant.
    """
    mha = getattr(torch.backends, "mha", None)
    fastpath = mha.get_fastpath_enabled() if mha is not None else None
    with contextlib.ExitStack() as stack:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:  # torch < 2.3: the CUDA-only switch of that era
            stack.enter_context(
                torch.backends.cuda.sdp_kernel(
                    enable_flash=False, enable_math=True, enable_mem_efficient=False
                )
            )
        else:
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        stack.enter_context(_composite_weight_norm())
        stack.enter_context(_composite_embedding_bag())
        stack.enter_context(_plain_reentrant_checkpoint())
        if mha is not None:
            mha.set_fastpath_enabled(False)
        try:
            yield
        finally:
            if mha is not None:
                mha.set_fastpath_enabled(fastpath)
