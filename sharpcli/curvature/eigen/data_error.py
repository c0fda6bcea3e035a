r"""The data's standard error of eigenvalues: batch means of their Rayleigh quotients.

An eigenvalue of the analysis set's operator :math:`A = \sum_b A_b` (the batches' weighted
parts, :mod:`sharpcli.curvature.products.batch_forms`) moves, to first order, as its Rayleigh
quotient with the eigenvector held fixed: for a simple eigenvalue with unit eigenvector
:math:`u`, :math:`d\lambda = u^\top dA\, u` (the Hellmann-Feynman derivative; its influence
function, in the delta method's terms [BatchMeans]). So :math:`\lambda \approx \sum_b
u^\top A_b u` is linear in the data near the analysis set, and the batch-means standard error
of those per-batch parts is the data error of :math:`\lambda`:

.. math::

    t_b = u^\top A_b u, \qquad \widehat{\mathrm{se}}^2 = \frac{1}{K - 1} \sum_b w_b
    (t_b / w_b - \textstyle\sum_c t_c)^2 .

Cost: one product of the block of returned eigenvectors (one product per eigenvalue, one pass
over the data), recorded batch by batch; none where Lanczos's explicit residual check already
multiplied the same vectors (its product is recorded instead). A jackknife over batches (K eigen solves) measures
the same spread without the linearisation, at about K times the solve's products; the first
order misses the eigenvector's own movement, which matters where eigenvalues are close
(a gap comparable to their data error), and is noted there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharpcli.curvature.products.batch_forms import batch_means_stderr, can_record, recording

__all__ = ["EigenDataError", "eigen_data_error"]


@dataclass
class EigenDataError:
    """Per eigenvalue, its data standard error; the method; the products it took."""

    stderr: list[float | None]
    method: str
    matvecs: int
    rayleigh: list[float]


def eigen_data_error(
    op,
    eigenvectors: torch.Tensor | None,
    recorded: tuple[torch.Tensor, list[int]] | None = None,
) -> EigenDataError | None:
    """The batch-means data error of each eigenvalue from its eigenvector (module docstring).

    Args:
        op: the operator (``a H + b G`` of one engine; other operators have no batches).
        eigenvectors: ``(P, m)`` unit columns (may be None with ``recorded``).
        recorded: the per-batch forms ``(values, sizes)`` of a product of these same
            vectors (rounded to the operator's dtype) already taken: Lanczos's explicit
            residuals record them (:func:`~sharpcli.curvature.eigen.ritz.ritz_residuals`), and
            then no product is spent here (``matvecs`` 0).

    Returns:
        The :class:`EigenDataError`, or None for an operator without batches.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 2)).double()
        >>> x, y = torch.randn(12, 3, dtype=torch.float64), torch.randint(0, 2, (12,))
        >>> engine = CurvatureEngine(model, AnalysisData(x, y, "cross-entropy", 4), ParamScope.resolve(model))
        >>> u = torch.nn.functional.normalize(torch.ones(8, 1, dtype=torch.float64), dim=0)
        >>> eigen_data_error(engine.hessian(), u).method
        'batch means of u^T A_b u over 3 batches (first order)'
    """
    if not can_record(op):  # no batches: spend no product
        return None
    matvecs = 0
    taken = recorded
    if taken is None:
        if eigenvectors is None:
            raise ValueError("eigen_data_error needs the eigenvectors or their recorded forms")
        U = eigenvectors if eigenvectors.dim() == 2 else eigenvectors[:, None]
        U = U.to(dtype=op.dtype, device=op.device)
        with recording(op, U) as forms:
            op.matmat(U)
        taken = None if forms is None else forms.take()
        matvecs = U.shape[1]
    if taken is None:
        return None
    values, sizes = taken
    per_batch = values.diagonal(dim1=1, dim2=2)  # (K, m): u_i^T A_b u_i
    errors = [batch_means_stderr(per_batch[:, i], sizes) for i in range(per_batch.shape[1])]
    batches = errors[0].batches if errors else 0
    return EigenDataError(
        stderr=[e.stderr for e in errors],
        method=f"batch means of u^T A_b u over {batches} batches (first order)",
        matvecs=matvecs,
        rayleigh=per_batch.sum(0).tolist(),
    )
