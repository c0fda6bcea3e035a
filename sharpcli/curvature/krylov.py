"""A Krylov basis that grows as it is used, stored in the products' dtype, with float64 arithmetic.

The Lanczos iterations (:mod:`sharpcli.curvature.lanczos`) keep their orthonormal basis
``Q = [q_0 .. q_{m-1}]`` here. Three things make it fit research-scale models:

- **It grows as needed.** Rows are allocated a chunk at a time (at most
  :data:`CHUNK_BYTES` each), so a run that converges after 18 products holds 18 vectors, not
  its whole budget of products.
- **Storage in the products' dtype.** A float32 model multiplies float32 vectors: ``q_j`` is
  rounded to float32 before every product anyway, so storing it in float32 halves the basis
  and the stored vector is exactly the one that was multiplied. Every scalar of the recurrence
  (the reorthogonalisation coefficients ``Q w``, norms, the projected matrix) is computed in
  float64: a float32 chunk is widened a slice of at most :data:`SLICE_BYTES` at a time, so the
  widening costs no more memory than one slice.
- **In-place restarts.** :meth:`KrylovBasis.rotate` replaces the rows by ``k`` combinations
  ``S^T Q`` (the Ritz vectors a thick restart keeps) slice by slice, without a second basis.

Loss of orthogonality from the float32 rounding of stored rows is ~eps(float32), the same
order as the products' own rounding; explicit residuals, not the Ritz estimate, certify
float32 results (:mod:`sharpcli.curvature.lanczos`).
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_BYTES", "SLICE_BYTES", "KrylovBasis"]

_F64 = torch.float64
CHUNK_BYTES = 64 << 20  # rows allocated together (one row at least)
SLICE_BYTES = 32 << 20  # float64 workspace of one widened slice of all rows
_MAX_CHUNK_ROWS = 16


class KrylovBasis:
    """Rows ``q_0 .. q_{m-1}`` (P-vectors) stored in ``dtype`` on ``device``.

    Args:
        dim: the vector length P.
        dtype: the storage dtype (the products' dtype; float64 keeps full precision).
        device: where the rows live.

    Every method takes and returns float64 vectors; only storage is in ``dtype``.
    """

    def __init__(self, dim: int, dtype: torch.dtype, device):
        self.dim = int(dim)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_vector = self.dim * itemsize
        self.chunk_rows = max(1, min(_MAX_CHUNK_ROWS, CHUNK_BYTES // max(1, self.bytes_per_vector)))
        self._chunks: list[torch.Tensor] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @staticmethod
    def bytes_for(dim: int, dtype: torch.dtype, vectors: int) -> int:
        """Bytes that ``vectors`` rows of length ``dim`` take in ``dtype``."""
        return int(dim) * torch.empty((), dtype=dtype).element_size() * int(vectors)

    def _row(self, i: int) -> torch.Tensor:
        return self._chunks[i // self.chunk_rows][i % self.chunk_rows]

    def append(self, q: torch.Tensor) -> None:
        """Store ``q`` (rounded to the storage dtype) as the next row."""
        if self._size == len(self._chunks) * self.chunk_rows:
            self._chunks.append(
                torch.empty(self.chunk_rows, self.dim, dtype=self.dtype, device=self.device)
            )
        self._row(self._size).copy_(q)
        self._size += 1

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` as stored (a view, in the storage dtype: no copy)."""
        if not -self._size <= i < self._size:
            raise IndexError(i)
        return self._row(i % self._size)

    def dot(self, i: int, w: torch.Tensor) -> float:
        """``q_i^T w`` in float64 for a float64 ``w``, widening row ``i`` a slice at a time."""
        row = self.row(i)
        if self.dtype == _F64:
            return float(row @ w)
        return float(sum(row[s].to(_F64) @ w[s] for s in self._slices(1)))

    def axpy(self, w: torch.Tensor, i: int, alpha: float) -> torch.Tensor:
        """``w <- w - alpha q_i`` in place on the float64 ``w`` (no widened copy of the row)."""
        w.sub_(self.row(i), alpha=alpha)
        return w

    def __getitem__(self, i: int) -> torch.Tensor:
        """Row ``i`` as a float64 vector (a copy when stored in another dtype)."""
        if not -self._size <= i < self._size:
            raise IndexError(i)
        return self._row(i % self._size).to(_F64)

    def truncate(self, size: int) -> None:
        """Keep the first ``size`` rows; chunks no longer needed are freed."""
        self._size = int(size)
        needed = -(-self._size // self.chunk_rows)
        del self._chunks[needed:]

    def _filled(self):
        """``(chunk, rows filled)`` for each chunk holding rows."""
        left = self._size
        for chunk in self._chunks:
            if left <= 0:
                break
            rows = min(left, self.chunk_rows)
            yield chunk, rows
            left -= rows

    def _slices(self, rows: int):
        width = max(1, SLICE_BYTES // (8 * max(1, rows)))
        return [slice(a, min(a + width, self.dim)) for a in range(0, self.dim, width)]

    def coefficients(self, w: torch.Tensor) -> torch.Tensor:
        """``Q w`` (float64, one entry per row) for a float64 ``w``."""
        parts = []
        for chunk, rows in self._filled():
            block = chunk[:rows]
            if self.dtype == _F64:
                parts.append(block @ w)
                continue
            h = torch.zeros(rows, dtype=_F64, device=w.device)
            for s in self._slices(rows):
                h += block[:, s].to(_F64) @ w[s]
            parts.append(h)
        if not parts:
            return torch.zeros(0, dtype=_F64, device=w.device)
        return torch.cat(parts)

    def subtract(self, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``w - Q^T h`` (float64), in place on ``w``."""
        start = 0
        for chunk, rows in self._filled():
            block, coef = chunk[:rows], h[start : start + rows]
            start += rows
            if self.dtype == _F64:
                w.sub_(block.T @ coef)
                continue
            for s in self._slices(rows):
                w[s] -= block[:, s].T.to(_F64) @ coef
        return w

    def orthogonalize(self, w: torch.Tensor, passes: int = 2) -> torch.Tensor:
        """``w`` made orthogonal to every row by classical Gram-Schmidt applied ``passes``
        times (CGS2), in place: ``w <- w - Q^T (Q w)``."""
        if self._size == 0:
            return w
        for _ in range(passes):
            self.subtract(w, self.coefficients(w))
        return w

    def combine(self, S: torch.Tensor) -> torch.Tensor:
        """``Q^T S``: the ``(P, k)`` float64 combinations of the rows with coefficients ``S``
        (``(m, k)``, ``m`` = rows), e.g. Ritz vectors."""
        S = S.to(dtype=_F64, device=self.device)
        out = torch.zeros(self.dim, S.shape[1], dtype=_F64, device=self.device)
        start = 0
        for chunk, rows in self._filled():
            block, coef = chunk[:rows], S[start : start + rows]
            start += rows
            for s in self._slices(rows) if self.dtype != _F64 else [slice(None)]:
                out[s] += block[:, s].T.to(_F64) @ coef
        return out

    def rotate(self, S: torch.Tensor) -> None:
        """Replace the rows by the ``k`` rows of ``S^T Q`` (``S``: ``(m, k)``, ``k <= m``), in
        place, a slice of columns at a time; the basis then has ``k`` rows."""
        S = S.to(dtype=_F64, device=self.device)
        k = S.shape[1]
        if k > self._size:
            raise ValueError(f"cannot keep {k} combinations of {self._size} rows")
        filled = list(self._filled())
        for s in self._slices(self._size):
            M = torch.cat([chunk[:rows, s].to(_F64) for chunk, rows in filled])
            R = S.T @ M  # (k, width): computed in full before any row is overwritten
            for i in range(k):
                self._row(i)[s] = R[i]
        self.truncate(k)
