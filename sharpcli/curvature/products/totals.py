"""Float64 totals of long sums over P entries, at about the speed of the storage dtype.

Lanczos's ``alpha`` and ``beta``, every finite check of a product and the per-layer sums of
the probe estimators are sums over P entries. Accumulated in float32 they are wrong at
research scale: float32 ``torch.linalg.vector_norm`` on one thread is 1e-2 off at 1e8 entries
(a plain float32 accumulator), and even float32 BLAS dot products of 32K entries summed in
float64 are 2.4e-6 off on a vector of equal entries (``1 * 0.1`` summed 1e5 times), where the
rounding of every partial sum has the same sign. Two kernels:

- :func:`dot64` and :func:`norm64` (the recurrence's scalars): each chunk of
  :data:`DOT_CHUNK` entries is widened to float64 in a buffer that stays in cache, where a
  product of two float32 numbers is exact, and summed there: float64 accuracy at about
  0.1 CPU s a norm and 0.2 s a dot product at 124M entries; a buffer reused in cache, not a
  fresh block per slice, is what keeps it near the storage dtype's speed.
- :func:`chunked_dots` (the probe estimators' per-layer sums of ``v * Av``, whose probes'
  spread dwarfs any rounding): float32 BLAS dot products of :data:`DOT_CHUNK` entries, their
  results summed in float64 by the caller: within 1e-9 of ``sum |v_i (Av)_i|`` on
  Rademacher probes, at memory speed.

Each chunk's result is written into a tensor, so a GPU synchronises once per total, not once
per chunk.
"""

from __future__ import annotations

import torch

__all__ = ["DOT_CHUNK", "chunk_bounds", "chunked_dots", "dot64", "norm64", "widened_parts"]

_F64 = torch.float64
DOT_CHUNK = 1 << 15  # entries of one chunk (256 KiB widened: both operands stay in cache)


def chunk_bounds(cuts: list[int], chunk: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the chunks of at most ``chunk`` entries that tile each segment
    between consecutive ``cuts`` (a chunk never crosses a cut).

    Args:
        cuts: ascending offsets, the first 0 and the last the length.
        chunk: the most entries of a chunk.

    Returns:
        The chunks' bounds, in order.

    Example:
        >>> chunk_bounds([0, 5, 7], 3)
        [(0, 3), (3, 5), (5, 7)]
    """
    return [
        (first, min(first + chunk, stop))
        for start, stop in zip(cuts[:-1], cuts[1:])
        for first in range(start, stop, chunk)
    ]


def chunked_dots(a: torch.Tensor, b: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    r"""The dot products :math:`\sum_{i=s}^{e-1} a_i b_i` of the chunks ``bounds``, each in the
    inputs' dtype (BLAS; float64 for half-precision inputs), with no P-sized temporary and no
    widened copy; on the inputs' device (no synchronisation per chunk).

    Args:
        a: a vector (contiguous or strided).
        b: a vector like ``a``.
        bounds: ``(start, stop)`` of each chunk.

    Returns:
        ``(len(bounds),)`` in float64.
    """
    # half-precision inputs: each chunk widened to float64 (a float16/bfloat16 dot product
    # of 2^15 entries may round in its own dtype, and a float32 one drifts by 50 ulps with
    # some BLAS kernels, OpenBLAS's Haswell sdot among them); the chunk is in cache, so the
    # wider dot costs no extra pass over memory
    dtype = a.dtype if a.element_size() >= 4 else _F64
    dots = torch.empty(len(bounds), dtype=dtype, device=a.device)
    for i, (start, stop) in enumerate(bounds):
        torch.dot(a[start:stop].to(dtype), b[start:stop].to(dtype), out=dots[i])
    return dots.to(_F64)


def widened_parts(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Each :data:`DOT_CHUNK`-entry chunk's ``sum a_i b_i`` (``b = a``: squares) in float64,
    the chunks of ``a`` and ``b`` widened into two buffers of that size (in cache).

    Args:
        a: a flat tensor.
        b: a flat tensor of ``a``'s length, or ``None`` for ``a`` itself.

    Returns:
        ``(ceil(len / DOT_CHUNK),)`` float64 partial sums on ``a``'s device.
    """
    n = a.numel()
    starts = range(0, n, DOT_CHUNK)
    parts = torch.empty(len(starts), dtype=_F64, device=a.device)
    wide_a = torch.empty(min(n, DOT_CHUNK), dtype=_F64, device=a.device)
    wide_b = wide_a if b is None else torch.empty_like(wide_a)
    for i, start in enumerate(starts):
        stop = min(start + DOT_CHUNK, n)
        x = wide_a[: stop - start].copy_(a[start:stop])
        y = x if b is None else wide_b[: stop - start].copy_(b[start:stop])
        torch.dot(x, y, out=parts[i])
    return parts


def dot64(x: torch.Tensor, y: torch.Tensor) -> float:
    """``x^T y`` to float64 accuracy: float64 operands directly, others widened a chunk at a
    time (:func:`widened_parts`).

    Args:
        x: a tensor of any shape and floating dtype.
        y: a tensor of ``x``'s size.

    Returns:
        The inner product of the flattened tensors; NaN or Inf when an entry is.

    Example:
        >>> dot64(torch.ones(100_000), torch.full((100_000,), 0.1))  # float32 0.1 summed
        10000.000149011612
    """
    a, b = x.reshape(-1), y.reshape(-1)
    if a.dtype == _F64 and b.dtype == _F64:
        return float(a @ b)
    return float(widened_parts(a, b).sum())


def norm64(x: torch.Tensor) -> float:
    """``||x||`` to float64 accuracy (:func:`widened_parts` of ``x`` with itself): Inf or NaN
    only when an entry is. ``torch.linalg.vector_norm(x, dtype=float64)`` would make a whole
    float64 copy of ``x`` first (1 GB at 124M parameters).

    Args:
        x: a tensor of any shape and floating dtype.

    Returns:
        The 2-norm of ``x``'s entries.
    """
    flat = x.reshape(-1)
    if flat.dtype == _F64:
        return float(torch.linalg.vector_norm(flat))
    return float(widened_parts(flat).sum()) ** 0.5
