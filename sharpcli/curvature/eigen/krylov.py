"""A Krylov basis that grows as it is used, stored in the products' dtype, with float64 arithmetic.

The Lanczos iterations (:mod:`sharpcli.curvature.eigen.lanczos`) keep their orthonormal basis
``Q = [q_0 .. q_{m-1}]`` here. Four things make it fit research-scale models:

- **It grows as needed.** Rows are allocated a chunk at a time (at most
  :data:`CHUNK_BYTES` each), so a run that converges after 18 products holds 18 vectors, not
  its whole budget of products.
- **Storage in the products' dtype.** A float32 model multiplies float32 vectors: ``q_j`` is
  rounded to float32 before every product anyway, so storing it in float32 halves the basis
  and the stored vector is exactly the one that was multiplied. Every scalar of the recurrence
  (the reorthogonalisation coefficients ``Q w``, norms, the projected matrix) is a float64
  sum. The Gram-Schmidt products ``Q w`` and ``Q^T h`` of a float32 ``w`` run as float32
  matrix-vector products over column slices of at most :data:`GEMV_COLUMNS` entries whose
  results are summed in float64: the error of a coefficient is that of a ``2^20``-term float32
  dot product, about 3e-9 of ``||q|| ||w||`` at 11M parameters (below the products' own
  rounding), at a quarter of the cost of widening the rows to float64 first, which would
  read and write every stored entry three more times. Other operations (Ritz vectors, restarts) widen the rows a slice
  of at most :data:`SLICE_BYTES` at a time, so the widening costs no more memory than one
  slice.
- **Out of core.** With ``scratch`` (a directory) the rows live in an anonymous temporary file
  there (unlinked when created: nothing is left behind, whatever ends the process) and only the
  newest row, the one about to be multiplied, stays in memory. Every operation reads the rows a
  column slice at a time into one buffer of at most :data:`SLICE_BYTES`, so the basis costs
  disk (or page cache), not resident memory: at 124M parameters a 20-vector float32 basis is
  10 GB of file and 2 vectors of memory. Classical Gram-Schmidt reads the basis twice per pass
  whether it is in memory or in a file; the file only adds the copy out of the page cache.
- **In-place restarts.** :meth:`KrylovBasis.rotate` replaces the rows by ``k`` combinations
  ``S^T Q`` (the Ritz vectors a thick restart keeps) slice by slice, without a second basis.

Loss of orthogonality from the float32 rounding of stored rows is ~eps(float32), the same
order as the products' own rounding; explicit residuals, not the Ritz estimate, certify
float32 results (:mod:`sharpcli.curvature.eigen.lanczos`).

Where a Lanczos basis lives and how large it may grow: the memory plan of a Krylov run.

The basis (:class:`~sharpcli.curvature.eigen.krylov.KrylovBasis`) grows one P-vector per step,
stored in the products' dtype (4 P bytes a vector for a float32 model). Memory buys speed: a
basis whose rows all fit in what the run's memory plan (:mod:`sharpcli.memory`) leaves stays
in memory; one that does not is thick-restarted in memory [Wu2000] when enough rows for a
restart fit, and otherwise, on the CPU, lives in an anonymous scratch file
(:func:`scratch_directory`) read a slice at a time, where it costs two P-vectors of memory
whatever its length (:func:`basis_room`). The choice, and why, is one of the report's
``timing.memory.choices``.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import typing
import weakref

import torch

from sharpcli import memory
from sharpcli.catalogue.values import SCRATCH_OFF
from sharpcli.curvature.products.totals import DOT_CHUNK, dot64, norm64
from sharpcli.errors import UsageError

__all__ = [
    "BASIS_FLOOR_BYTES",
    "CHUNK_BYTES",
    "GEMV_COLUMNS",
    "IN_MEMORY_BASIS_BYTES",
    "MAX_IN_MEMORY_BYTES",
    "RESTART_ROWS",
    "SLICE_BYTES",
    "basis_room",
    "krylov_work_bytes",
    "ritz_end_bytes",
    "KrylovBasis",
    "plan_basis",
    "scratch_directory",
    "storage_dtype",
]

_F64 = torch.float64
CHUNK_BYTES = 64 << 20  # rows allocated together (one row at least)
SLICE_BYTES = 32 << 20  # float64 workspace of one widened slice of all rows
GEMV_COLUMNS = 1 << 20  # columns of one storage-dtype matrix-vector product (module docstring)
_MAX_CHUNK_ROWS = 16
REPEAT_BELOW = 0.5**0.5  # a Gram-Schmidt pass that keeps less of the norm is repeated
_IO_BYTES = 1 << 30  # one read or write call at most (Linux caps one call near 2 GiB)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == _F64 else t.to(_F64)


def _transfer(call, fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Read into (``os.preadv``) or write from (``os.pwrite``) a contiguous CPU ``tensor`` at
    byte ``offset`` of ``fd``, in calls of at most :data:`_IO_BYTES`, until done."""
    view = memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
    done = 0
    while done < len(view):
        part = view[done : done + _IO_BYTES]
        count = call(fd, part, offset + done)
        if count <= 0:
            raise OSError(errno.EIO, "short transfer on the Krylov scratch file")
        done += count


def _read(fd, buffer, offset):
    return os.preadv(fd, [buffer], offset)


class KrylovBasis:
    """Rows ``q_0 .. q_{m-1}`` (P-vectors) stored in ``dtype`` on ``device`` or in a file.

    Args:
        dim: the vector length P.
        dtype: the storage dtype (the products' dtype; float64 keeps full precision).
        device: where the rows are used (and live, without ``scratch``).
        scratch: a directory for an anonymous temporary file holding the rows (module
            docstring, "Out of core"); ``None`` keeps them in memory.

    Every method computes its scalars in float64. Vectors passed in (``w``) may be float64 or
    the storage dtype; methods that update ``w`` do so in place in ``w``'s own dtype.
    """

    def __init__(self, dim: int, dtype: torch.dtype, device, scratch: str | None = None):
        self.dim = int(dim)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_vector = self.dim * self.itemsize
        self.chunk_rows = max(1, min(_MAX_CHUNK_ROWS, CHUNK_BYTES // max(1, self.bytes_per_vector)))
        self._chunks: list[torch.Tensor] = []
        self._size = 0
        self.scratch = None if scratch is None else str(scratch)
        self._file: typing.BinaryIO | None = None
        self._last: tuple[int, torch.Tensor] | None = None  # the newest row, kept for its product
        self._buffer: torch.Tensor | None = None  # rows read from the scratch file
        # float64 workspaces reused by every operation (at most SLICE_BYTES each): the widened
        # rows of one column slice, and the slice of the vector (or of the result) beside them.
        # Allocating them afresh per slice made the kernel map and zero ~8 P m bytes per
        # Gram-Schmidt pass: most of a GPT-2-small step's time, as system time.
        self._wide: torch.Tensor | None = None
        self._side: torch.Tensor | None = None
        if self.scratch is not None:
            try:
                self._file = tempfile.TemporaryFile(dir=self.scratch, prefix="sharp-krylov-")
            except OSError as exc:
                raise UsageError(
                    f"cannot create the Krylov basis's scratch file in {self.scratch}: "
                    f"{exc.strerror or exc}; point SHARP_SCRATCH (or TMPDIR) to a writable "
                    "folder",
                    source="scratch",
                ) from None
            self._finalizer = weakref.finalize(self, self._file.close)

    def __len__(self) -> int:
        return self._size

    @property
    def on_disk(self) -> bool:
        """Whether the rows live in a scratch file."""
        return self._file is not None

    @staticmethod
    def bytes_for(dim: int, dtype: torch.dtype, vectors: int) -> int:
        """Bytes that ``vectors`` rows of length ``dim`` take in ``dtype``.

        Args:
            dim: the row length P.
            dtype: the storage dtype.
            vectors: the number of rows.

        Returns:
            ``dim * vectors`` times the item size of ``dtype``.
        """
        return int(dim) * torch.empty((), dtype=dtype).element_size() * int(vectors)

    def close(self) -> None:
        """Release the rows (the scratch file is closed and, being unlinked, gone)."""
        if self._file is not None:
            self._finalizer()
            self._file = None
        self._chunks = []
        self._last = self._buffer = self._wide = self._side = None
        self._size = 0

    # ------------------------------------------------------------------ storage primitives
    def _row(self, i: int) -> torch.Tensor:
        return self._chunks[i // self.chunk_rows][i % self.chunk_rows]

    def _offset(self, row: int, column: int = 0) -> int:
        return (row * self.dim + column) * self.itemsize

    def _fd(self) -> int:
        assert self._file is not None  # only called on a basis in a scratch file
        return self._file.fileno()

    def _write(self, row: int, values: torch.Tensor, column: int = 0) -> None:
        data = values.detach().to(device="cpu", dtype=self.dtype).contiguous()
        try:
            _transfer(os.pwrite, self._fd(), data, self._offset(row, column))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UsageError(
                    f"no space left in {self.scratch} for the Krylov basis "
                    f"({self._size + 1} vectors of {self.bytes_per_vector:,} bytes); free "
                    "space there, point SHARP_SCRATCH (or TMPDIR) elsewhere, or lower "
                    "`max_matvecs`",
                    source="scratch",
                ) from None
            raise

    def _read_into(self, target: torch.Tensor, row: int, column: int = 0) -> None:
        _transfer(_read, self._fd(), target, self._offset(row, column))

    def _slices(self, rows: int) -> list[slice]:
        """Column slices whose widened ``rows x width`` float64 block is at most
        :data:`SLICE_BYTES`."""
        width = max(1, SLICE_BYTES // (8 * max(1, rows)))
        return [slice(a, min(a + width, self.dim)) for a in range(0, self.dim, width)]

    def _gemv_slices(self, rows: int) -> list[slice]:
        """Column slices of at most :data:`GEMV_COLUMNS` whose ``rows x width`` block in the
        storage dtype is at most :data:`SLICE_BYTES` (the read buffer of a basis on disk)."""
        width = max(1, min(GEMV_COLUMNS, SLICE_BYTES // (self.itemsize * max(1, rows))))
        return [slice(a, min(a + width, self.dim)) for a in range(0, self.dim, width)]

    def _blocks(self, s: slice, rows: int | None = None):
        """``(first row, block)`` pieces of rows ``0 .. rows-1`` (default all) restricted to the
        columns ``s``, in the storage dtype: views of the chunks, or one block read from the
        scratch file into the reused buffer."""
        rows = self._size if rows is None else rows
        if self._file is None:
            start = 0
            for chunk in self._chunks:
                if start >= rows:
                    break
                count = min(self.chunk_rows, rows - start)
                yield start, chunk[:count, s]
                start += count
            return
        width = s.stop - s.start
        if self._buffer is None or self._buffer.numel() < rows * width:
            self._buffer = torch.empty(rows * width, dtype=self.dtype)
        block = self._buffer[: rows * width].view(rows, width)
        for i in range(rows):
            self._read_into(block[i], i, s.start)
        yield 0, block if self.device.type == "cpu" else block.to(self.device)

    def _row_pieces(self, i: int):
        """``(columns, values)`` pieces of row ``i`` in the storage dtype: the whole row in
        memory (or the kept newest row), else slices read from the scratch file."""
        if self._file is None:
            yield slice(0, self.dim), self._row(i)
            return
        if self._last is not None and self._last[0] == i:
            yield slice(0, self.dim), self._last[1]
            return
        for s in self._slices(1):
            width = s.stop - s.start
            if self._buffer is None or self._buffer.numel() < width:
                self._buffer = torch.empty(width, dtype=self.dtype)
            piece = self._buffer[:width]
            self._read_into(piece, i, s.start)
            yield s, piece if self.device.type == "cpu" else piece.to(self.device)

    def _workspace(self, which: str, count: int) -> torch.Tensor:
        """The first ``count`` entries of the float64 workspace ``which`` (``"_wide"`` or
        ``"_side"``), grown (never shrunk) when too small."""
        buffer = getattr(self, which)
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(count, dtype=_F64, device=self.device)
            setattr(self, which, buffer)
        return buffer[:count]

    def _widened(self, s: slice, rows: int | None = None) -> torch.Tensor:
        """Rows ``0 .. rows-1`` (default all) restricted to the columns ``s`` as one float64
        ``(rows, width)`` block in the reused workspace (valid until the next call)."""
        rows = self._size if rows is None else rows
        out = self._workspace("_wide", rows * (s.stop - s.start)).view(rows, -1)
        for start, block in self._blocks(s, rows):
            out[start : start + block.shape[0]].copy_(block)
        return out

    def _side_slice(self, values: torch.Tensor, s: slice) -> torch.Tensor:
        """``values[s]`` in float64: a view when it is float64, else a copy in the reused
        side workspace."""
        if values.dtype == _F64:
            return values[s]
        return self._workspace("_side", s.stop - s.start).copy_(values[s])

    # ------------------------------------------------------------------ rows
    def append(self, q: torch.Tensor, divisor: float = 1.0) -> None:
        """Store ``q / divisor`` (rounded to the storage dtype) as the next row. In a scratch
        file the rounded row is also kept in memory until the next append (it is multiplied
        next): ``q`` must not be modified afterwards when it already has the storage dtype (it
        is divided in place there).

        Args:
            q: a P-vector of any floating dtype.
            divisor: divides ``q`` as it is stored (Lanczos's ``beta``): one pass over ``q``
                instead of a division in place and a copy.
        """
        if self._file is not None:
            if divisor != 1.0:
                q = q.div_(divisor) if q.dtype == self.dtype else q / divisor
            row = q.detach().reshape(-1).to(dtype=self.dtype, device=self.device)
            self._write(self._size, row)
            self._last = (self._size, row)
            self._size += 1
            return
        if self._size == len(self._chunks) * self.chunk_rows:
            self._chunks.append(
                torch.empty(self.chunk_rows, self.dim, dtype=self.dtype, device=self.device)
            )
        row = self._row(self._size)
        if divisor != 1.0 and q.dtype == self.dtype:
            torch.div(q.reshape(-1), divisor, out=row)
        else:
            row.copy_(q.reshape(-1) / divisor if divisor != 1.0 else q.reshape(-1))
        self._size += 1

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` in the storage dtype: a view in memory (no copy), the kept newest row or a
        fresh copy read from the scratch file.

        Args:
            i: the row's index.

        Returns:
            A P-vector in the storage dtype.
        """
        if not -self._size <= i < self._size:
            raise IndexError(i)
        i %= self._size
        if self._file is None:
            return self._row(i)
        if self._last is not None and self._last[0] == i:
            return self._last[1]
        out = torch.empty(self.dim, dtype=self.dtype)
        self._read_into(out, i)
        return out.to(self.device)

    def __getitem__(self, i: int) -> torch.Tensor:
        """Row ``i`` as a float64 vector (a copy when stored in another dtype)."""
        return _f64(self.row(i))

    def truncate(self, size: int) -> None:
        """Keep the first ``size`` rows; memory (chunks) or file space no longer needed is freed.

        Args:
            size: the rows kept.
        """
        self._size = int(size)
        if self._file is not None:
            if self._last is not None and self._last[0] >= self._size:
                self._last = None
            os.ftruncate(self._file.fileno(), self._offset(self._size))
            return
        needed = -(-self._size // self.chunk_rows)
        del self._chunks[needed:]

    # ------------------------------------------------------------------ float64 arithmetic
    def dot(self, i: int, w: torch.Tensor) -> float:
        """``q_i^T w`` with a float64 total (:func:`dot64` over the row's pieces).

        Not a storage-dtype matrix-vector product like the Gram-Schmidt coefficients: this is
        Lanczos's ``alpha_j = q_j^T A q_j``, an entry of the projected matrix whose rounding goes
        straight into the eigenvalues (float32 GEMVs over 2^20 columns made them 3e-6 off on a
        400,000-entry test operator, against 1e-7 with a float64 total).

        Args:
            i: the row's index.
            w: a P-vector.

        Returns:
            The float64 inner product.
        """
        if not -self._size <= i < self._size:
            raise IndexError(i)
        total = 0.0
        for s, values in self._row_pieces(i % self._size):
            total += dot64(values, w[s])
        return total

    def dots(self, rows: list[int], w: torch.Tensor) -> tuple[list[float], float]:
        """``q_i^T w`` for each of ``rows`` and ``w^T w``, float64 totals (:func:`dot64`), in
        one pass over ``w`` when the rows are in memory.

        Args:
            rows: the rows' indices.
            w: a P-vector.

        Returns:
            ``([q_i^T w for i in rows], w^T w)``; the last is NaN or Inf exactly when an
            entry of ``w`` is.
        """
        flat = w.reshape(-1)
        if self._file is not None or flat.dtype != self.dtype or flat.dtype != torch.float32:
            return [self.dot(i, flat) for i in rows], dot64(flat, flat)
        views = [self._row(i % self._size) for i in rows]
        starts = range(0, self.dim, DOT_CHUNK)
        # each chunk of w widened once, each row's beside it (float64 products are exact);
        # each chunk's sums written into a tensor: no synchronisation per chunk
        parts = torch.empty(len(rows) + 1, len(starts), dtype=_F64, device=flat.device)
        wide_w = torch.empty(min(self.dim, DOT_CHUNK), dtype=_F64, device=flat.device)
        wide_row = torch.empty_like(wide_w)
        for c, start in enumerate(starts):
            stop = min(start + DOT_CHUNK, self.dim)
            x = wide_w[: stop - start].copy_(flat[start:stop])
            for k, view in enumerate(views):
                y = wide_row[: stop - start].copy_(view[start:stop])
                torch.dot(y, x, out=parts[k, c])
            torch.dot(x, x, out=parts[-1, c])
        totals = parts.sum(dim=1).tolist()
        return totals[:-1], totals[-1]

    def axpy(self, w: torch.Tensor, i: int, alpha: float) -> torch.Tensor:
        """``w <- w - alpha q_i`` in place, in ``w``'s dtype (no widened copy of the row).

        Args:
            w: the P-vector updated in place.
            i: the row's index.
            alpha: the coefficient.

        Returns:
            ``w``.
        """
        for s, values in self._row_pieces(i % self._size):
            w[s].sub_(values, alpha=alpha)
        return w

    def subtract_rows(self, w: torch.Tensor, pairs: list[tuple[int, float]]) -> float:
        """``w <- w - sum_i c_i q_i`` in place for the ``(i, c_i)`` in ``pairs`` (the
        three-term recurrence), then ``||w||`` to float64 accuracy: one pass over ``w`` when
        the rows are in memory and ``w`` has the storage dtype (each piece of
        :data:`DOT_CHUNK` entries updated, widened and summed while it is in cache).

        Args:
            w: the P-vector updated in place.
            pairs: ``(row, coefficient)`` pairs.

        Returns:
            ``||w||`` afterwards (:func:`norm64`).
        """
        flat = w.reshape(-1)
        if self._file is not None or flat.dtype != self.dtype or flat.dtype != torch.float32:
            for i, c in pairs:
                self.axpy(w, i, c)
            return norm64(w)
        views = [(self._row(i % self._size), c) for i, c in pairs]
        starts = range(0, self.dim, DOT_CHUNK)
        parts = torch.empty(len(starts), dtype=_F64, device=flat.device)
        wide = torch.empty(min(self.dim, DOT_CHUNK), dtype=_F64, device=flat.device)
        for n, start in enumerate(starts):
            stop = min(start + DOT_CHUNK, self.dim)
            piece = flat[start:stop]
            for view, c in views:
                piece.sub_(view[start:stop], alpha=c)
            x = wide[: stop - start].copy_(piece)
            torch.dot(x, x, out=parts[n])
        return float(parts.sum()) ** 0.5

    def coefficients(self, w: torch.Tensor) -> torch.Tensor:
        """``Q w`` (float64, one entry per row).

        Args:
            w: a P-vector.

        Returns:
            A float64 vector of one coefficient per row.
        """
        h = torch.zeros(self._size, dtype=_F64, device=w.device)
        if self._size == 0:
            return h
        if w.dtype == _F64 and self.dtype == _F64 and self._file is None:
            for start, block in self._blocks(slice(0, self.dim)):
                h[start : start + block.shape[0]] += block @ w
            return h
        if w.dtype == self.dtype:  # storage-dtype GEMVs, their results summed in float64
            for s in self._gemv_slices(self._size):
                for start, block in self._blocks(s):
                    h[start : start + block.shape[0]] += (block @ w[s]).to(_F64)
            return h
        for s in self._slices(self._size):
            h.addmv_(self._widened(s), self._side_slice(w, s))
        return h

    def subtract(self, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``w - Q^T h`` in place on ``w`` (the combination summed in float64).

        Args:
            w: the P-vector updated in place.
            h: one float64 coefficient per row.

        Returns:
            ``w``.
        """
        if self._size == 0:
            return w
        h = h.to(dtype=_F64, device=self.device)
        if w.dtype == _F64 and self.dtype == _F64 and self._file is None:
            for start, block in self._blocks(slice(0, self.dim)):
                w.sub_(block.T @ h[start : start + block.shape[0]])
            return w
        if w.dtype == self.dtype:  # storage-dtype GEMVs (coefficients rounded to it)
            coefficients = h.to(self.dtype)
            for s in self._gemv_slices(self._size):
                for start, block in self._blocks(s):
                    w[s].addmv_(block.T, coefficients[start : start + block.shape[0]], alpha=-1)
            return w
        for s in self._slices(self._size):
            wide = self._widened(s)
            acc = self._workspace("_side", s.stop - s.start)
            torch.mv(wide.T, h, out=acc)
            w[s] -= acc
        return w

    def orthogonalize(self, w: torch.Tensor, passes: int = 2, norm: float | None = None) -> float:
        """``w`` made orthogonal to every row by classical Gram-Schmidt, in place:
        ``w <- w - Q^T (Q w)``, repeated (up to ``passes`` times) only while a pass removes
        more than :data:`REPEAT_BELOW` of ``w``'s norm.

        This is the Daniel-Gragg-Kaufman-Stewart criterion ("twice is enough", [Parlett1998]):
        a pass that cancels little leaves ``w`` orthogonal to the rows to rounding, and one
        that cancels much is repeated once, which restores that. In Lanczos the three-term
        recurrence has already removed ``w``'s components along the newest rows, so a second
        pass is rarely needed: it would read the whole basis twice more.

        Args:
            w: the P-vector made orthogonal in place.
            passes: Gram-Schmidt passes (two: CGS2).
            norm: ``||w||`` when the caller has it (saves a pass over ``w``).

        Returns:
            ``||w||`` afterwards, summed in float64 (the criterion computes it: Lanczos's
            ``beta_j`` without another pass over ``w``).
        """
        norm = norm64(w) if norm is None else float(norm)
        if self._size == 0:
            return norm
        for _ in range(passes):
            self.subtract(w, self.coefficients(w))
            after = norm64(w)
            if after >= REPEAT_BELOW * norm:
                return after
            norm = after
        return norm

    def combine(self, S: torch.Tensor, dtype: torch.dtype = _F64) -> torch.Tensor:
        """``Q^T S``: the ``(P, k)`` combinations of the rows with coefficients ``S`` (``(m, k)``,
        ``m`` = rows), e.g. Ritz vectors; summed in float64, returned in ``dtype``.

        Asked for in a storage dtype narrower than float64 (a Ritz vector about to be
        multiplied, which rounds it to that dtype anyway), the sums over the ``m`` rows run in
        that dtype, storage-dtype matrix products over column slices: ``m`` roundings of the
        dtype per entry (no P-long sum), where widening every row to float64 first cost a
        fifth of a product per row at GPT-2 small.

        Args:
            S: the ``(m, k)`` coefficients.
            dtype: the result's dtype.

        Returns:
            The ``(P, k)`` combinations.
        """
        k = S.shape[1]
        if dtype == self.dtype and dtype != _F64:
            return self._combine_narrow(S.tolist(), k)
        out = torch.empty(self.dim, k, dtype=dtype, device=self.device)
        S = S.to(dtype=_F64, device=self.device)
        for s in self._slices(max(self._size, k)):
            acc = self._workspace("_side", (s.stop - s.start) * k).view(-1, k)
            torch.mm(self._widened(s).T, S, out=acc)
            out[s] = acc
        return out

    def _combine_narrow(self, S: list[list[float]], k: int) -> torch.Tensor:
        """:meth:`combine` in the storage dtype, column-major ``(P, k)``: each piece of
        :data:`DOT_CHUNK` x 2 entries of a column is summed over the rows while it stays in
        cache, so every row is read once and the result written once."""
        out = torch.empty(k, self.dim, dtype=self.dtype, device=self.device).T
        width = 2 * DOT_CHUNK
        for s in self._gemv_slices(self._size):
            blocks = list(self._blocks(s))
            for a in range(0, s.stop - s.start, width):
                for c in range(k):
                    target = out[s.start + a : min(s.start + a + width, s.stop), c]
                    target.zero_()
                    for start, block in blocks:
                        for r in range(block.shape[0]):
                            target.add_(block[r, a : a + width], alpha=S[start + r][c])
        return out

    def rotate(self, S: torch.Tensor) -> None:
        """Replace the rows by the ``k`` rows of ``S^T Q`` (``S``: ``(m, k)``, ``k <= m``), in
        place, a slice of columns at a time; the basis then has ``k`` rows.

        Args:
            S: the ``(m, k)`` coefficients, ``k <= m``.
        """
        S = S.to(dtype=_F64, device=self.device)
        k = S.shape[1]
        if k > self._size:
            raise ValueError(f"cannot keep {k} combinations of {self._size} rows")
        self._last = None
        for s in self._slices(self._size):
            # (k, width), computed in full before any row is overwritten
            R = self._workspace("_side", k * (s.stop - s.start)).view(k, -1)
            torch.mm(S.T, self._widened(s), out=R)
            for i in range(k):
                if self._file is None:
                    self._row(i)[s] = R[i]
                else:
                    self._write(i, R[i], column=s.start)
        self.truncate(k)


BASIS_FLOOR_BYTES = 1 << 30  # a Krylov basis may always take this much (budget permitting)
IN_MEMORY_BASIS_BYTES = 256 << 20  # a larger basis kept in memory is a reported choice
MAX_IN_MEMORY_BYTES: int | None = None  # a cap on the rows kept in memory (tests: 0, disk)
RESTART_ROWS = 20  # a basis restarted in memory keeps at least this many rows; fewer: disk


def storage_dtype(op_dtype: torch.dtype) -> torch.dtype:
    """The dtype a Krylov basis is stored in.

    Args:
        op_dtype: the dtype the operator's products run in.

    Returns:
        The products' own dtype (float32 or float64); float32 for half-precision products,
        whose rounding is too coarse to keep a basis orthonormal.

    Example:
        >>> storage_dtype(torch.bfloat16)
        torch.float32
    """
    return op_dtype if op_dtype in (torch.float32, _F64) else torch.float32


def ritz_end_bytes(dim: int, dtype: torch.dtype, returned: int, widened: bool = False) -> int:
    """Bytes the end of a Lanczos run holds, after its basis is released: each of the
    ``returned`` Ritz vectors (in the storage dtype, the vector the operator multiplies) with
    its explicit residual's product and that product's per-parameter pieces; then, where the
    vectors are returned ``widened`` to float64, the float64 copies beside the storage ones
    (the product freed).

    Args:
        dim: the number of parameters P.
        dtype: the dtype the products run in.
        returned: Ritz vectors returned or checked explicitly.
        widened: the vectors are returned as float64 copies.

    Returns:
        The larger of the residual product's and the widening's bytes (0 without vectors).
    """
    if not returned:
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    stored = torch.empty((), dtype=storage_dtype(dtype)).element_size()
    product = int(returned) * dim * (stored + itemsize) + dim * itemsize
    widening = int(returned) * dim * (stored + 8) if widened and stored != 8 else 0
    return int(max(product, widening))


def krylov_work_bytes(
    dim: int, dtype: torch.dtype, returned: int = 0, widened: bool = False
) -> int:
    """Bytes a Lanczos run holds beside its basis's rows.

    A step holds the vector multiplied (the newest row, kept in memory also when the basis is
    in a scratch file), the product ``w = A q`` being assembled and, until each is copied
    into it, the product's per-parameter pieces (one more P-vector in the product's dtype at
    the end of the double backward), plus the three slice buffers of
    :mod:`~sharpcli.curvature.eigen.krylov` (rows read from the file, the widened rows and the
    vector's slice); the end, after the basis is released, holds each of the ``returned``
    Ritz vectors with its explicit residual's product, assembled the same way, and their
    float64 copies where they are returned ``widened`` (:func:`ritz_end_bytes`).

    Args:
        dim: the number of parameters P.
        dtype: the dtype the products run in.
        returned: Ritz vectors returned or checked explicitly at the end.
        widened: the returned vectors are float64 copies of storage-dtype ones.

    Returns:
        The larger of the step's and the end's bytes.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    stored = torch.empty((), dtype=storage_dtype(dtype)).element_size()
    pieces = dim * itemsize  # the product's per-parameter results before they are copied
    step = dim * (2 * stored + (itemsize if dtype != storage_dtype(dtype) else 0)) + pieces
    end = ritz_end_bytes(dim, dtype, returned, widened)
    return int(max(step, end) + 3 * SLICE_BYTES)


def scratch_directory() -> str | None:
    """Where a large Krylov basis is kept out of core.

    Returns:
        ``SHARP_SCRATCH`` when set, else the system's temporary folder (``TMPDIR``); ``None``
        when ``SHARP_SCRATCH`` is ``off`` (or empty, ``memory``, ``none``): every basis stays
        in memory.
    """
    value = os.environ.get("SHARP_SCRATCH")
    if value is None:
        return tempfile.gettempdir()
    if value.strip().lower() in SCRATCH_OFF:
        return None
    return value


def basis_room(
    op, steps: int, *, extra_vectors: int = 0, widened: bool = False, minimum: int = 1, lower: str
):
    """How many basis rows a run keeps, and where: memory buys speed, disk only as needed.

    In the order tried:

    1. All ``steps`` rows fit in what the memory plan leaves (beside
       :func:`krylov_work_bytes` for ``extra_vectors`` returned Ritz vectors): in memory, no
       restart. Every Gram-Schmidt pass then reads the rows from memory, not from a file.
    2. At least :data:`RESTART_ROWS` rows (and ``minimum``) fit: in memory, thick-restarted
       at that many rows (at most :data:`BASIS_FLOOR_BYTES` or one product's workspace,
       whichever is larger: a longer basis buys fewer products than its reads cost).
    3. On the CPU with a scratch folder (:func:`scratch_directory`): every row in an
       anonymous scratch file, read back a slice at a time, two P-vectors in memory whatever
       the length; bounded by half the free disk space there.
    4. Otherwise in memory, restarted at as many rows as fit.

    Args:
        op: the operator (``shape``, ``dtype``, ``device``).
        steps: the most rows the run could use.
        extra_vectors: Ritz vectors returned at the end.
        widened: they are returned as float64 copies (:func:`ritz_end_bytes`).
        minimum: the fewest rows the run can work with.
        lower: what the user may lower, for the error message.

    Returns:
        ``(vectors, bytes held in memory, scratch folder or None)``.

    Raises:
        UsageError: not even ``minimum`` rows fit (``max_memory``, or ``scratch`` for disk).
    """
    dim = op.shape[0]
    steps = int(steps)
    per_vector = KrylovBasis.bytes_for(dim, storage_dtype(op.dtype), 1)
    work = krylov_work_bytes(dim, op.dtype, extra_vectors, widened)
    plan = memory.current()
    # the heap's reuse slack first, where the budget can hold it at all: it saves more time a
    # byte than rows kept in memory rather than in a scratch file
    slack = memory.heap_slack(plan, beside=work)
    slack = slack if work + slack <= plan.room() else 0
    fit = plan.count_that_fit(per_vector, reserve=work + slack)
    if MAX_IN_MEMORY_BYTES is not None:
        fit = min(fit, MAX_IN_MEMORY_BYTES // per_vector)
    if fit >= steps:
        if steps * per_vector > IN_MEMORY_BASIS_BYTES:
            plan.note(
                f"Krylov basis in memory ({steps} vectors, "
                f"{memory.format_bytes(steps * per_vector)}): the memory budget holds it"
            )
        return steps, steps * per_vector + work, None
    product = plan.items.get(memory.PRODUCT_WORKSPACE, 0)
    lean = min(fit, max(RESTART_ROWS, minimum, max(BASIS_FLOOR_BYTES, product) // per_vector))
    if lean >= max(RESTART_ROWS, minimum):
        return lean, lean * per_vector + work, None
    scratch = scratch_directory()
    on_cpu = torch.device(op.device if op.device is not None else "cpu").type == "cpu"
    if on_cpu and scratch is not None:
        return _scratch_basis(plan, dim, steps, per_vector, work, minimum, scratch, lower)
    if fit < minimum:
        plan.require(
            f"a Krylov basis of {minimum} vectors of {dim:,} parameters",
            minimum * per_vector + work,
            lower,
        )
    vectors = min(steps, fit)
    return vectors, vectors * per_vector + work, None


def _scratch_basis(plan, dim, steps, per_vector, work, minimum, scratch, lower):
    """:func:`basis_room`'s out-of-core case: ``(vectors, bytes in memory, scratch)``."""
    plan.require(f"Lanczos vectors of {dim:,} parameters", work, lower)
    try:
        free = shutil.disk_usage(scratch).free
    except OSError:
        free = 0
    fit = int(free // 2 // per_vector)
    if fit < minimum:
        raise UsageError(
            f"a Krylov basis of {minimum} vectors of {dim:,} parameters needs "
            f"{memory.format_bytes(minimum * per_vector)} of disk in {scratch} (it is kept "
            f"out of memory), which has {memory.format_bytes(free)} free; point "
            "SHARP_SCRATCH (or TMPDIR) elsewhere or lower `max_matvecs`",
            source="scratch",
        )
    vectors = min(steps, fit)
    plan.note(
        f"Krylov basis in a scratch file in {scratch} (up to {vectors} vectors, "
        f"{memory.format_bytes(vectors * per_vector)} of disk), not in memory: the memory "
        "budget does not hold it"
    )
    return vectors, work, scratch


def plan_basis(
    op, wanted: int, returned: int, budget: int, max_basis: int | None, widened: bool = False
):
    """The basis and product budget of a :func:`~sharpcli.curvature.eigen.lanczos.lanczos` run.

    A thick restart keeps the ``wanted`` Ritz vectors and needs room for two more.

    Args:
        op: the operator.
        wanted: the Ritz values asked for (both ends counted).
        returned: Ritz vectors returned or checked explicitly at the end.
        budget: the most products (``max_matvecs``).
        max_basis: the user's bound on the basis rows, if any.
        widened: the returned vectors are float64 copies (:func:`ritz_end_bytes`).

    Returns:
        ``(room, held, scratch, limit)``: the basis rows the run may keep, the bytes it holds
        in memory, its scratch folder (``None``: in memory) and its product budget (past the
        dimension when the run restarts).

    Raises:
        UsageError: ``max_basis`` below 1 or too small to restart, or the basis does not fit.
    """
    dim = op.shape[0]
    if max_basis is not None and int(max_basis) < 1:
        raise UsageError(f"max basis must be >= 1, got {max_basis}", source="max_basis")
    room, held, scratch = basis_room(
        op,
        min(dim, budget),
        extra_vectors=returned,
        widened=widened,
        minimum=min(dim, budget, wanted + 2),
        lower="lower `top_k`, `batch_size` or `cache_mb`",
    )
    if max_basis is not None:
        room = min(room, int(max_basis))
    restarting = room < min(dim, budget)
    limit = budget if restarting else min(dim, budget)  # products; restarts may pass dim
    if restarting and room < wanted + 2:
        raise UsageError(
            f"a thick restart keeps the {wanted} wanted Ritz vectors and needs room for two "
            f"more, but `max_basis` is {room}; raise it or lower `top_k`",
            source="max_basis",
        )
    if restarting and max_basis is None:
        memory.current().note(
            f"Krylov basis limited to {room} vectors by the memory plan: thick-restarted Lanczos"
        )
    return room, held, scratch, limit
