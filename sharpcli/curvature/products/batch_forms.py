r"""The data's standard error of a curvature number, from the products it already takes.

Every curvature quantity of ``sharp`` is a mean over the analysis set's samples. The engine
sums a product over the batches, :math:`A V = \sum_b A_b V` with :math:`A_b` carrying the
batch's weight :math:`w_b = B_b / N` (:mod:`sharpcli.curvature.products.data`). While a
:class:`BatchForms` recorder is active (:meth:`CurvatureEngine.recording_forms
<sharpcli.curvature.products.engine.CurvatureEngine.recording_forms>`), the engine also keeps,
per batch, the small matrix :math:`L^\top (A_b V)` for a ``left`` block ``L`` the estimator
chooses (its probes, its sketch): a ``(m, k)`` matrix per batch, at no extra product (one
``m x P`` by ``P x k`` multiplication per batch). Any quantity linear in the operator given
its probes (a Hutchinson or Hutch++ trace, a Rayleigh quotient :math:`u^\top A u`) is then a
sum of per-batch contributions :math:`t = \sum_b t_b`.

The batch-means standard error [BatchMeans]. With :math:`x_b = t_b / w_b` the batch's mean
per sample, :math:`t = \sum_b w_b x_b` and, batches being independent draws of
:math:`B_b` samples each (:math:`\mathrm{Var}\, x_b = \sigma^2 / B_b`),

.. math::

    \widehat{\mathrm{se}}^2_{\mathrm{data}}
      = \frac{1}{K - 1} \sum_{b=1}^K w_b \,(x_b - t)^2, \qquad
    \mathbb{E} \sum_b B_b (x_b - t)^2 = (K - 1)\, \sigma^2,

unbiased for :math:`\mathrm{Var}\, t = \sigma^2 / N`; with equal batches it is the textbook
:math:`\sum_b (x_b - \bar x)^2 / (K (K - 1))` of K batch means. It is the error *given the
probes*: each :math:`x_b` also carries the probes' noise on that batch, so with few probes it
includes part of the probes' error (it errs large, not small). Its own relative uncertainty is
about :math:`1/\sqrt{2 (K - 1)}`: a handful of batches gives a rough error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sharpcli.curvature.products.data import all_reduce_sum, distributed_rank_and_world

__all__ = [
    "BatchForms",
    "can_record",
    "DataError",
    "batch_means_stderr",
    "combined_stderr",
    "method_name",
    "recording",
    "square_error",
    "square_method_name",
    "summed_error",
]


def method_name(batches: int) -> str:
    """The method's name in the reports: ``"batch means over K batches"``."""
    return f"batch means over {batches} batches"


@dataclass
class DataError:
    """A number's standard error over the analysis set's samples.

    Attributes:
        stderr: the standard error (None with a single batch).
        method: how it was computed (``"batch means over K batches"``).
        batches: the batches K.
        samples: the samples N.
        per_batch: the batch means :math:`x_b` (per sample), for the advisor and the tests.
        sizes: the batches' sample counts :math:`B_b`, in the order of ``per_batch`` (the
            parts of a sum over blocks are summed batch by batch: :func:`summed_error`).
    """

    stderr: float | None
    method: str
    batches: int
    samples: int
    per_batch: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


def combined_stderr(*errors: float | None) -> float | None:
    """The errors in quadrature, ``sqrt(sum e^2)`` (None when all are None)."""
    known = [float(e) for e in errors if e is not None]
    return math.sqrt(sum(e * e for e in known)) if known else None


def can_record(op) -> bool:
    """Whether :func:`recording` gives ``op``'s per-batch forms (before any product)."""
    coordinates = getattr(op, "_coordinates", lambda: None)()
    return coordinates is not None and bool(coordinates[0].records_batch_forms)


@contextmanager
def recording(op, left: torch.Tensor) -> Iterator[BatchForms | None]:
    """Record per-batch forms ``left^T (A_b V)`` of ``op``'s products inside the block.

    Yields None for an operator that is not ``a H + b G`` of one engine (a dense matrix, terms
    of several engines) and on an engine whose products are not sums over batches (finite
    differences of whole-set gradients): there are no batches to split.

    Args:
        op: the operator.
        left: the ``(P, m)`` block.

    Yields:
        The recorder, or None.
    """
    if not can_record(op):
        yield None
        return
    with op._coordinates()[0].recording_forms(left) as forms:
        yield forms


def batch_means_stderr(contributions, sizes) -> DataError:
    r"""The batch-means standard error of :math:`t = \sum_b t_b` (module docstring).

    .. math::

        \widehat{\mathrm{se}}^2 = \frac{1}{K - 1} \sum_b w_b (t_b / w_b - t)^2,
        \qquad w_b = B_b / N

    Args:
        contributions: the per-batch contributions :math:`t_b` (already weighted by
            :math:`w_b`, as the engine's batch products are).
        sizes: the batches' sample counts :math:`B_b`.

    Returns:
        The :class:`DataError` (``stderr`` None for fewer than two batches).

    Example:
        >>> error = batch_means_stderr([0.5, 1.5], [2, 2])  # batch means 1 and 3, t = 2
        >>> error.stderr, error.method  # sqrt(((1 - 2)^2 + (3 - 2)^2) / (2 * 1))
        (1.0, 'batch means over 2 batches')
    """
    t = torch.as_tensor(contributions, dtype=torch.float64).reshape(-1)
    B = torch.as_tensor(sizes, dtype=torch.float64).reshape(-1)
    keep = B > 0
    t, B = t[keep], B[keep]
    K, N = int(t.numel()), float(B.sum())
    w = B / N
    x = t / w
    total = float(t.sum())
    stderr = None
    if K >= 2:
        stderr = math.sqrt(float((w * (x - total) ** 2).sum()) / (K - 1))
    return DataError(stderr, method_name(K), K, int(N), x.tolist(), [int(b) for b in B])


def square_method_name(batches: int) -> str:
    """The method of ``Tr(A^2)``'s data error (:func:`square_error`) in the reports."""
    return f"batch means of 2 (A v)^T A_b v over {batches} batches (first order)"


def square_error(cross: torch.Tensor, sizes: list[int]) -> DataError:
    r"""The data error of :math:`\mathrm{Tr}(A^2)` to first order (the delta method).

    With :math:`A = \sum_b A_b`, a change :math:`dA` of the data moves
    :math:`\mathrm{Tr}(A^2)` by :math:`2\,\mathrm{Tr}(A\, dA)`, so near the analysis set
    :math:`\mathrm{Tr}(A^2) \approx \sum_b 2\, \mathrm{Tr}(A A_b) - \mathrm{Tr}(A^2)`, linear
    in the batches, and :math:`\mathrm{Tr}(A A_b) = \mathbb{E}_v [(A v)^\top A_b v]` for
    Rademacher :math:`v`. The batch-means error of the parts
    :math:`t_b = 2\, \overline{(A v)^\top A_b v}` (mean over the probes) is the data error
    ([BatchMeans]); the constant :math:`-\mathrm{Tr}(A^2)` moves nothing. The parts need the
    product :math:`A v` before the per-batch forms: one more product of a block of probes
    whose :math:`A v` is known, recorded with ``left`` :math:`= A V`.

    Args:
        cross: ``(K, k)``: per batch and probe, :math:`(A v_j)^\top A_b v_j` (weighted by
            :math:`w_b` as the engine's batch products are).
        sizes: the batches' sample counts.

    Returns:
        The :class:`DataError` (``method`` named by :func:`square_method_name`).

    Example:
        >>> error = square_error(torch.tensor([[0.5], [1.5]]), [2, 2])  # 2 x (1, 3) per sample
        >>> error.stderr  # sqrt(((2 - 4)^2 + (6 - 4)^2) / (2 * 1))
        2.0
    """
    error = batch_means_stderr(2 * cross.to(torch.float64).mean(1), sizes)
    error.method = square_method_name(error.batches)
    return error


def summed_error(errors: list[DataError | None]) -> DataError | None:
    r"""The batch-means error of a sum of numbers over the same batches (blocks' traces).

    The numbers share the batches, so their data errors are correlated: the sum's per-batch
    mean is the sum of theirs, :math:`x_b = \sum_i x_{i,b}`, and its error the batch means of
    those (not the errors in quadrature).

    Args:
        errors: the numbers' errors (None: the sum has none).

    Returns:
        The sum's :class:`DataError`, or None when one is missing or the batches differ.

    Example:
        >>> a = batch_means_stderr([0.5, 1.5], [2, 2])  # batch means 1 and 3
        >>> b = batch_means_stderr([1.5, 0.5], [2, 2])  # 3 and 1: the sum is 4 on both
        >>> summed_error([a, b]).stderr
        0.0
    """
    if not errors or any(e is None or not e.sizes for e in errors):
        return None
    known = [e for e in errors if e is not None]
    sizes = known[0].sizes
    if any(e.sizes != sizes for e in known):
        return None
    x = torch.tensor([e.per_batch for e in known], dtype=torch.float64).sum(0)
    w = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    return batch_means_stderr(x * w, sizes)


class BatchForms:
    r"""Per-batch forms :math:`L^\top (A_b V)` recorded while the engine multiplies.

    The engine calls :meth:`add` once per batch and part of a product (its parts: ``H``;
    ``G``; ``H`` and ``G`` of a joint pass), then the operator :meth:`combine` s the parts
    with its coefficients (``a H + b G``). :meth:`take` returns the forms of the one product
    recorded, or None when the recording cannot be read as one operator's (several products,
    parts never combined).

    Args:
        left: the ``(P, m)`` block ``L``.
        data: the engine's :class:`~sharpcli.curvature.products.data.AnalysisData`.
    """

    def __init__(self, left: torch.Tensor, data):
        self.left, self.data = left, data
        self._batches: list[list[torch.Tensor]] = []  # per batch: one (m, k) per part
        self._calls: list[torch.Tensor] = []  # per product: (K, parts, m, k)
        self._combined: list[bool] = []  # whether the operator weighed each product's parts
        self._indices: list[int] = []

    def add(self, index: int, blocks) -> None:
        """Record batch ``index``'s product blocks (one ``(P, k)`` per part).

        Args:
            index: the batch (its place in the data's order).
            blocks: the batch's products.
        """
        left = self.left if self.left.dtype == blocks[0].dtype else self.left.to(blocks[0].dtype)
        self._indices.append(index)
        self._batches.append([(left.T @ b).to(torch.float64) for b in blocks])

    def close_product(self, batches: int, parts: int, columns: int) -> None:
        """End one product of ``columns`` columns and ``parts`` parts over ``batches`` local
        batches (a batch that gave no blocks, its loss not depending on the scope: zeros)."""
        shape = (batches, parts, self.left.shape[1], columns)
        out = torch.zeros(shape, dtype=torch.float64)
        for index, blocks in zip(self._indices, self._batches):
            out[index] = torch.stack(blocks).cpu()
        self._calls.append(out)
        self._combined.append(False)
        self._batches, self._indices = [], []

    def combine(self, coefficients: tuple[float, ...]) -> None:
        """Weigh the last product's parts: ``sum_p c_p forms_p`` (the operator's ``a H + b G``).

        Args:
            coefficients: one per part.
        """
        if not self._calls or self._combined[-1] or self._calls[-1].shape[1] != len(coefficients):
            return
        last = self._calls[-1]
        c = torch.tensor(coefficients, dtype=torch.float64)[None, :, None, None]
        self._calls[-1] = (last * c).sum(1, keepdim=True)
        self._combined[-1] = True

    def take(self) -> tuple[torch.Tensor, list[int]] | None:
        """The ``(K, m, k)`` forms of the one product recorded, over all ranks' batches.

        Returns:
            ``(forms, sizes)`` with the batches' sample counts, or None when the recording is
            not one combined product.
        """
        if len(self._calls) != 1 or not self._combined[0]:
            return None
        forms = self._calls[0][:, 0]
        sizes = local_batch_sizes(self.data)
        return gather_batches(forms, sizes, self.data)

    def take_parts(self) -> tuple[torch.Tensor, list[int]] | None:
        """The ``(K, parts, m, k)`` forms of the one product recorded, its parts apart (a joint
        H and G pass read as both), over all ranks' batches; None unless one product."""
        if len(self._calls) != 1:
            return None
        return gather_batches(self._calls[0], local_batch_sizes(self.data), self.data)


def local_batch_sizes(data) -> list[int]:
    """This rank's batch sizes ``B_b`` in the order of ``data.batches()``."""
    n, b = int(data.local_num_samples), int(data.batch_size)
    return [min(b, n - start) for start in range(0, n, b)]


def gather_batches(forms: torch.Tensor, sizes: list[int], data) -> tuple[torch.Tensor, list[int]]:
    """Every rank's per-batch rows, rank by rank (the identity on one process).

    Each rank's rows go to its slot of a zero ``(W, K_max, ...)`` tensor summed over ranks
    (:func:`~sharpcli.curvature.products.data.all_reduce_sum`); empty slots have size 0.
    """
    rank, world = distributed_rank_and_world()
    if world == 1:
        return forms, sizes
    per_rank = -(-int(data.num_samples) // world)
    slots = -(-per_rank // int(data.batch_size))
    rows = torch.zeros((world, slots, *forms.shape[1:]), dtype=torch.float64)
    counts = torch.zeros(world, slots, dtype=torch.float64)
    rows[rank, : forms.shape[0]] = forms
    counts[rank, : len(sizes)] = torch.tensor(sizes, dtype=torch.float64)
    all_reduce_sum([rows, counts])
    keep = counts.reshape(-1) > 0
    return rows.reshape(world * slots, *forms.shape[1:])[keep], [
        int(c) for c in counts.reshape(-1)[keep]
    ]
