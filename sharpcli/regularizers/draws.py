"""Random directions and norms over a list of parameter tensors, drawn for a training step.

Each draw (:func:`rademacher_like`, :func:`gaussian_like`) is ONE flat draw over all
parameters from the step's generator, split into consecutive slices in parameter order: a
step pays one generator call per probe or noise sample, and a test reproduces the draw by
repeating it.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["rademacher_like", "gaussian_like", "global_norm", "dot"]


def _flat_split(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (consecutive slices in order), moved to each
    tensor's device and dtype where they differ from ``flat``'s."""
    # view_as: half the cost of view(t.shape), which builds a Size per tensor
    out = [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    device, dtype = flat.device, flat.dtype
    if all(t.dtype == dtype for t in tensors) and all(t.device == device for t in tensors):
        return out
    return [piece.to(device=t.device, dtype=t.dtype) for piece, t in zip(out, tensors)]


def rademacher_like(
    tensors: Sequence[torch.Tensor], generator: torch.Generator
) -> list[torch.Tensor]:
    """Independent Rademacher (+-1, probability 1/2 each) tensors shaped like ``tensors``.

    One draw per call: ``b = torch.randint(0, 2, (P,), generator=generator, dtype=dtype)``
    on the generator's device, ``P`` the total number of entries, ``dtype`` the first
    tensor's; the entries are ``2 b - 1`` split into consecutive slices in the order of
    ``tensors`` and moved to each tensor's device (so a CPU generator drives a CUDA model
    identically). One flat draw instead of one per tensor: a step pays one generator call.
    """
    total = sum(t.numel() for t in tensors)
    bits = torch.randint(
        0, 2, (total,), generator=generator, device=generator.device, dtype=tensors[0].dtype
    )
    return _flat_split(bits.mul_(2).sub_(1), tensors)


def gaussian_like(
    tensors: Sequence[torch.Tensor], sigma: float, generator: torch.Generator
) -> list[torch.Tensor]:
    """Independent ``N(0, sigma^2)`` tensors shaped like ``tensors``.

    Draw order: one flat ``torch.empty(P, dtype=dtype).normal_(generator=generator)`` on the
    generator's device (``P`` the total number of entries, ``dtype`` the first tensor's),
    multiplied by ``sigma`` in place, split into consecutive slices in the order of
    ``tensors`` and moved to each tensor's device. Tests reproduce a step's noise by
    repeating exactly this draw.
    """
    total = sum(t.numel() for t in tensors)
    flat = torch.empty(total, dtype=tensors[0].dtype, device=generator.device).normal_(
        generator=generator
    )
    return _flat_split(flat.mul_(sigma), tensors)


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Euclidean norm of the concatenation of ``tensors``: ``sqrt(sum_t ||t||^2)``.

    One fused ``torch._foreach_norm`` (the per-tensor norms) and the norm of those norms,
    in the tensors' own dtype (float32 for float32 parameters: the relative rounding error
    of a float32 norm, about 1e-7, is far below what any use of it here resolves), on the
    tensors' device, without a host synchronisation. Returns a 0-dim tensor of the first
    tensor's dtype.
    """
    dtype = tensors[0].dtype
    norms = list(torch._foreach_norm([t.detach() for t in tensors]))
    if any(n.dtype != dtype for n in norms):
        norms = [n.to(dtype) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inner product of two lists of like-shaped tensors (one fused elementwise product).

    .. math:: \\langle a, b \rangle = \\sum_t \\sum_i a_{t,i} b_{t,i}

    Args:
        a: Tensors of the first list.
        b: Tensors of the second list, shaped as ``a``'s.

    Returns:
        A 0-dim tensor of ``a``'s dtype.
    """
    return torch.stack([t.sum() for t in torch._foreach_mul(list(a), list(b))]).sum()
