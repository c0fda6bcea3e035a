r"""Hutch++'s range sketch: an orthonormal basis of :math:`A S` and the trace it makes exact.

Hutch++ [Hutch++] splits, for any ``Q`` with orthonormal columns, :math:`\Pi = Q Q^\top`,
:math:`P = I - \Pi` and symmetric :math:`A`,

.. math::

    A = (\Pi A + A \Pi - \Pi A \Pi) + P A P, \qquad
    \mathrm{tr}(A) = \mathrm{tr}(Q^\top A Q) + \mathrm{tr}(P A P),

the first term exact, the second left to probes; ``Q`` spans :math:`A S` for a Gaussian
:math:`S`. The identity needs :math:`Q^\top Q = I`:
with a ``Q`` that is not orthonormal, :math:`\mathrm{tr}(Q^\top A Q) + \mathrm{E}[g^\top P A P g]`
is no longer :math:`\mathrm{tr}(A)`, whatever the number of probes. Hence the sketch keeps
its basis orthonormal:

- the new columns of :math:`A S` are orthogonalised against the basis by classical
  Gram-Schmidt applied twice ("twice is enough", [Parlett1998] section 6.9), as a block, then
  against each other one column at a time;
- a column whose norm after the second pass is at most :data:`RANK_RTOL` times the operator's
  scale (the largest column of :math:`A S` seen, not the block's own largest pivot), or that
  the second pass shrank by more than :math:`1/\sqrt 2`, lies in the basis's span to rounding
  and is dropped. Dropping a direction biases nothing: it stays in :math:`P A P`, which the
  probes sample without bias. Fewer columns kept than drawn means :math:`A S` brought nothing
  new: the sketch spans the operator's range (to that tolerance) and stops growing there,
  instead of filling up with rounding noise past the operator's rank;
- every extension's orthogonality is measured (:math:`\lVert [Q\ Q_n]^\top Q_n - [0; I] \rVert`)
  and an extension above :data:`ORTH_TOL` is discarded, never used.
"""

from __future__ import annotations

import math

import torch

from sharpcli.curvature.probes import segment_sums
from sharpcli.curvature.scope import gaussian_like

__all__ = ["ORTH_TOL", "RANK_RTOL", "RangeSketch"]


def _sqrt_eps(dtype: torch.dtype) -> float:
    return math.sqrt(torch.finfo(dtype).eps)


#: Columns whose part outside the basis is below this fraction (times sqrt(eps) of the
#: products' dtype) of the operator's scale are rounding, not range: 1.5e-8 in float64.
RANK_RTOL = 1.0
#: The largest ``|Q^T Q - I|`` entry an extension may leave, times sqrt(eps) of the dtype.
ORTH_TOL = 1.0


class RangeSketch:
    """Orthonormal ``Q`` (P, s) spanning ``A S`` for Gaussian ``S``, with ``AQ``; the exact part
    ``tr(Q^T A Q)`` and its layer split, and the residual's per-probe values (module docstring).

    ``exhausted`` turns true once an extension brings fewer new directions than it drew
    (the range is spanned); ``lost`` holds the orthogonality error of a discarded extension.
    """

    def __init__(self, dim: int, dtype: torch.dtype, device):
        self.Q = torch.zeros(dim, 0, dtype=dtype, device=device)
        self.AQ = torch.zeros(dim, 0, dtype=dtype, device=device)
        self.scale = 0.0
        self.exhausted = False
        self.lost: float | None = None

    @property
    def size(self) -> int:
        """The basis's columns."""
        return self.Q.shape[1]

    def extend(self, op, columns: int, generator) -> int:
        """Draw ``columns`` Gaussian ``S``, add the new directions of ``A S`` to the basis.

        Args:
            op: the symmetric operator (``shape``, ``dtype``, ``device``, ``matmat``).
            columns: the columns of ``S``.
            generator: the random generator of ``S``.

        Returns:
            The products used: ``columns`` for ``A S``, one per kept column for ``A Q_n``.
        """
        # Gaussian, not Rademacher: a Gaussian S has full rank with probability 1, so fewer
        # new directions than columns means the range is spanned (two Rademacher columns of a
        # 2-vector are parallel half the time)
        S = gaussian_like(op.shape[0], generator, op.dtype, op.device, columns)
        Y = op.matmat(S)
        del S
        self.scale = max(self.scale, float(torch.linalg.vector_norm(Y, dim=0).max()))
        new = self._orthonormal_columns(Y)
        del Y
        if new.shape[1] < columns:
            self.exhausted = True
        if new.shape[1] == 0:
            return columns
        error = self._orthogonality_error(new)
        if error > ORTH_TOL * _sqrt_eps(new.dtype):
            self.lost = error
            self.exhausted = True
            return columns
        self.AQ = torch.cat([self.AQ, op.matmat(new)], 1)
        self.Q = torch.cat([self.Q, new], 1)
        return columns + new.shape[1]

    def _orthonormal_columns(self, Y: torch.Tensor) -> torch.Tensor:
        """The columns of ``Y`` that add a direction, orthonormal and orthogonal to ``Q``.

        CGS2 against ``Q`` as a block (two matrix products: the basis is read twice per
        extension, not per column), then CGS2 one column at a time within the block with the
        rank test of the module docstring, and one more block pass against ``Q``: a kept
        column's norm is above ``sqrt(eps)`` of the scale, so what rounding left of ``Q`` in
        it is at most ``sqrt(eps)`` after normalising, and that pass takes it to ``eps``.
        """
        for _ in range(2):
            Y -= self.Q @ (self.Q.T @ Y)
        floor = RANK_RTOL * _sqrt_eps(Y.dtype) * self.scale
        out = torch.empty_like(Y)
        kept = 0
        for j in range(Y.shape[1]):
            y = Y[:, j]
            norms = [float(torch.linalg.vector_norm(y))]
            for _ in range(2):
                if kept:
                    y -= out[:, :kept] @ (out[:, :kept].T @ y)
                norms.append(float(torch.linalg.vector_norm(y)))
            # in the span to rounding: below the operator's scale, or the second pass still
            # cancelled most of what the first left ("twice is enough")
            if norms[2] <= floor or norms[2] < norms[1] / math.sqrt(2):
                continue
            out[:, kept] = y / norms[2]
            kept += 1
        out = out[:, :kept]
        if kept and self.size:
            out -= self.Q @ (self.Q.T @ out)
        return out

    def _orthogonality_error(self, new: torch.Tensor) -> float:
        """``max |[Q new]^T new - [0; I]|``: how far the extended basis is from orthonormal."""
        inner = new.T @ new
        inner.diagonal().sub_(1)
        error = float(inner.abs().max())
        if self.size:
            error = max(error, float((self.Q.T @ new).abs().max()))
        return error

    def exact_part(self, blocks: dict) -> torch.Tensor:
        """``(1 + L,)``: the exact ``tr((Pi A + A Pi - Pi A Pi)_bb)`` per layer b, the total first.

        Per row ``i`` of ``Q``, ``2 <Q_i, (AQ)_i> - <Q_i M, Q_i>`` with ``M = Q^T A Q``
        (symmetrised): summed over all rows this is ``tr M`` for an orthonormal ``Q``. The
        total is the sum over the rows, so the layers sum to it wherever the blocks cover the
        parameters.

        Args:
            blocks: ``{layer: slice}``.

        Returns:
            ``(1 + L,)`` float64.
        """
        if self.size == 0:
            return torch.zeros(1 + len(blocks), dtype=torch.float64)
        M = self.Q.T @ self.AQ
        M = (M + M.T) / 2
        per_row = 2 * (self.Q * self.AQ).sum(1) - ((self.Q @ M) * self.Q).sum(1)
        return segment_sums(per_row[:, None], blocks)[:, 0]

    def rounding_stderr(self) -> float:
        r"""The rounding error that probes cannot see, as a standard error.

        Two parts, in quadrature: the asymmetry :math:`\lVert M - M^\top \rVert_F / \sqrt 2`
        of :math:`M = Q^\top (A Q)` as computed (``A`` is symmetric, so that is the products'
        rounding; with independent entry errors of standard deviation :math:`\sigma` it is
        about :math:`\sigma s`, the trace's :math:`\sigma \sqrt s` to a factor
        :math:`\sqrt s`), and :math:`\epsilon \sqrt P\, c` with :math:`c` the operator's
        scale (the largest :math:`\lVert A s \rVert`, about :math:`\lVert A \rVert_F`): the
        residual ``g^T P A P g`` is a difference of terms of that size, each rounded, and
        what the operator holds below the rank test's floor is of that order. Both matter
        only when the residual ``P A P`` vanishes (the sketch spans the range, or the whole
        space), where the probes' spread is 0 and rounding is the whole error.

        Returns:
            The standard error (0 without a sketch).
        """
        if self.size == 0:
            return 0.0
        M = (self.Q.T @ self.AQ).to(torch.float64)
        asymmetry = float(torch.linalg.matrix_norm(M - M.T)) / math.sqrt(2)
        residual = torch.finfo(self.Q.dtype).eps * math.sqrt(self.Q.shape[0]) * self.scale
        return math.hypot(asymmetry, residual)

    def residual_values(self, G, AG, blocks: dict) -> torch.Tensor:
        """``(k, 1 + L)`` Hutchinson values of ``P A P`` from probes ``G`` and products ``AG``.

        Per probe and layer ``g_b^T (P A P g)_b``, whose mean is ``tr((P A P)_bb)`` exactly,
        from the stored ``A g`` (no new product): ``A P g = A g - AQ (Q^T g)`` and
        ``P A P g = A P g - Q (Q^T A P g)``. Summed over the layers this is
        ``g^T P A P g = (P g)^T A (P g)``, the total's usual value.

        Args:
            G: ``(P, k)`` probes.
            AG: ``(P, k)`` their products.
            blocks: ``{layer: slice}``.

        Returns:
            ``(k, 1 + L)`` float64.
        """
        # (Pg)_b . (APg)_b would be cheaper but has mean tr(P E_b A P) = tr((A P)_bb), which
        # differs from tr((P A P)_bb) by tr((Pi A P)_bb): it sums to the right total but is
        # biased per layer against the exact part's tr((Pi A + A Pi - Pi A Pi)_bb).
        APG = AG - self.AQ @ (self.Q.T @ G)
        PAPG = APG - self.Q @ (self.Q.T @ APG)
        return segment_sums(G * PAPG, blocks).T
