"""Forward passes that can be differentiated twice, and correctly.

Curvature (Hessian products, gradient penalties, third-order regularizers) differentiates a
model's backward pass. Three kernels of PyTorch get that wrong or cannot do it at all, and
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
  derivative is wrong (torch 2.13, CPU, float32 and float64). On a weight-normed MLP the
  double-backward Hessian was not even symmetric (``max |H - H^T|`` = 0.22 against entries of
  0.3, 0.12-0.26 off central differences of the gradient), so every Hessian product through it
  was silently wrong while first derivatives were right. The block computes
  ``w = g v / ||v||`` (the norm over every dimension but ``dim``, :func:`weight_norm_composite`)
  from differentiable operations instead: the same forward value to rounding, and Hessians
  that agree with central differences to 4e-11.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

__all__ = ["twice_differentiable", "weight_norm_composite"]


def weight_norm_composite(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``w = g * v / ||v||`` with the 2-norm over every dimension of ``v`` but ``dim`` (all of
    them for ``dim=-1``), from differentiable operations: the function of
    ``torch._weight_norm(v, g, dim)`` with a correct second derivative (module docstring)."""
    return v * (g / torch.norm_except_dim(v, 2, dim))


@contextlib.contextmanager
def _composite_weight_norm():
    # the legacy module binds `_weight_norm` at its import; `torch.nn.utils.weight_norm` is
    # also the name of its function, hence import_module
    legacy = importlib.import_module("torch.nn.utils.weight_norm")

    saved = torch._weight_norm, legacy._weight_norm
    torch._weight_norm = legacy._weight_norm = weight_norm_composite
    try:
        yield
    finally:
        torch._weight_norm, legacy._weight_norm = saved


@contextlib.contextmanager
def twice_differentiable():
    """Within the block: SDPA uses the math backend, the MHA fast path is off, and weight
    normalisation is computed by :func:`weight_norm_composite`.

    The user's settings (the enabled SDPA backends, ``torch.backends.mha`` fast path) and
    ``torch._weight_norm`` are restored on exit, also after an exception. Re-entrant.
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
        if mha is not None:
            mha.set_fastpath_enabled(False)
        try:
            yield
        finally:
            if mha is not None:
                mha.set_fastpath_enabled(fastpath)
