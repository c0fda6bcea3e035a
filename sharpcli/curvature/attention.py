"""Attention that can be differentiated twice.

PyTorch's fused scaled-dot-product attention kernels (flash, memory-efficient, the CPU flash
kernel) have no derivative of their backward, so a Hessian product through
``nn.MultiheadAttention`` / ``F.scaled_dot_product_attention`` fails ("derivative for
aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"); and the
transformer encoder's inference fast path (``_transformer_encoder_layer_fwd``, taken in eval
mode without gradients) has no autograd support at all. Curvature needs the math backend,
which composes ordinary differentiable operations, and the fast path off, so that every
forward pass of an analysis (with or without gradients) computes the same function.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["differentiable_attention"]


@contextlib.contextmanager
def differentiable_attention():
    """Within the block: SDPA uses the math backend and the MHA fast path is off.

    The user's settings (the enabled SDPA backends, ``torch.backends.mha`` fast path) are
    restored on exit, also after an exception. Re-entrant.
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
        if mha is not None:
            mha.set_fastpath_enabled(False)
        try:
            yield
        finally:
            if mha is not None:
                mha.set_fastpath_enabled(fastpath)
