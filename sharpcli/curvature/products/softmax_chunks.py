r"""Softmax cross-entropy over large vocabularies: its logit gradient and Hessian by chunks of rows.

A language model's logits ``z`` are ``(B, T, V)``: at a GPT-2 vocabulary (``V = 50257``) and
8 x 512 tokens one float32 copy is 823 MB. Differentiating ``F.cross_entropy`` twice with
autograd (the curvature engine's first-order graph, :mod:`sharpcli.curvature.products.engine`) keeps
its log-softmax and the gradient of the negative log-likelihood in the graph and makes several
more logit-sized tensors in every product (the exponential, ``H_z u`` and the terms of the
log-softmax's double backward). Here the loss's part is written out instead, one chunk of
rows at a time. With rows ``t`` (the samples of ``cross-entropy``, the positions of
``token-cross-entropy``), row weights ``r_t`` (the batch's weight in the mean, over ``B``,
times the position weight :func:`sharpcli.losses.token_weights`; 0 on ignored positions) and
``p_t = softmax(z_t)``:

.. math::

    L_b = \sum_t r_t \left(\operatorname{logsumexp}(z_t) - z_{t, y_t}\right), \qquad
    g_{z,t} = r_t \left(p_t - e_{y_t}\right), \qquad
    (H_z u)_t = r_t \left(p_t \odot u_t - p_t \langle p_t, u_t \rangle\right)

(``H_z = diag(p) - p p^T`` per row, [Schraudolph2002], [Martens2020]). Each formula reads a
chunk of rows of ``z`` and writes the same rows of its result, so beyond the result the
work holds a chunk's softmax and products. :class:`LogitGradient` makes ``g_z`` an
autograd node whose backward is ``H_z u``: the engine's products then reverse through it as
they did through autograd's cross-entropy, with the same values to rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from sharpcli.curvature.products.graphs import grad_with_outputs
from sharpcli.losses import CROSS_ENTROPY, IGNORE_INDEX, TOKEN_CROSS_ENTROPY, token_weights

__all__ = [
    "CHUNKED_LOSSES",
    "DEFAULT_CHUNK_BYTES",
    "LogitGradient",
    "SoftmaxRows",
    "VocabChunking",
    "rows_per_chunk",
]

# the built-in softmax cross-entropies whose mean is a weighted sum over rows of (.., V) logits
CHUNKED_LOSSES = (CROSS_ENTROPY, TOKEN_CROSS_ENTROPY)
DEFAULT_CHUNK_BYTES = 16 << 20  # one chunk of logit rows (16 MiB: 83 GPT-2 rows in float32)
CHUNK_SHARE = 64  # an automatic chunk is at most 1/64 of what the memory budget leaves
CHUNK_TEMPORARIES = 3  # chunks of rows alive in a chunk's work: p, p * u, the result


def rows_per_chunk(chunk_bytes: int, classes: int, element_size: int) -> int:
    """Rows of ``classes`` logits of ``element_size`` bytes that fit ``chunk_bytes`` (at least 1).

    Args:
        chunk_bytes: the bytes of one chunk of logits.
        classes: the logits per row (the vocabulary).
        element_size: bytes per logit.

    Returns:
        The rows per chunk.
    """
    return max(1, int(chunk_bytes) // max(1, int(classes) * int(element_size)))


def _grid(t: torch.Tensor) -> torch.Tensor:
    """Logits (or a tensor shaped like them) as ``(samples, rows, V)``: ``(B, C)`` is one
    sample of ``B`` rows, ``(B, T, V)`` is itself. A view whatever the strides."""
    return t.unsqueeze(0) if t.dim() == 2 else t


@dataclass(frozen=True)
class SoftmaxRows:
    """The rows of one batch's cross-entropy: labels, weights and how many rows a chunk takes.

    The rows are laid out as the logits' ``(samples, rows, V)`` grid (:func:`_grid`), so a
    chunk is a view of logits of any strides (the K-dimensional reading's are transposed): a
    chunk is whole samples when ``chunk`` holds one, else a range of one sample's rows.

    Attributes:
        labels: ``(S, R)`` class of each row (ignored positions mapped to class 0, weight 0).
        weights: ``(S, R)`` row weights ``r_t`` in the logits' dtype.
        chunk: rows per chunk (at most).
    """

    labels: torch.Tensor
    weights: torch.Tensor
    chunk: int

    @classmethod
    def of_batch(
        cls, loss: str, z: torch.Tensor, y: torch.Tensor, weight: float, chunk: int
    ) -> SoftmaxRows:
        """The rows of ``loss`` on the batch's logits ``z`` and labels ``y``, mean weighted ``weight``.

        Args:
            loss: ``cross-entropy`` (``z`` ``(B, C)``) or ``token-cross-entropy`` (``(B, T, V)``).
            z: the logits.
            y: the labels.
            weight: the batch's weight in the analysis mean (``B_b / N``).
            chunk: rows per chunk.

        Returns:
            The rows; ``sum_t r_t CE_t`` is the batch's mean loss times ``weight``.
        """
        batch = z.shape[0]
        if loss == TOKEN_CROSS_ENTROPY:
            rows = token_weights(z.detach(), y) * (weight / batch)
        else:
            rows = torch.full(y.shape, weight / batch, dtype=z.dtype, device=z.device)
        labels = torch.where(y == IGNORE_INDEX, torch.zeros_like(y), y)
        shape = _grid(z).shape[:-1]
        return cls(labels.reshape(shape), rows.reshape(shape), max(1, int(chunk)))

    @property
    def count(self) -> int:
        """The number of rows."""
        return self.labels.numel()

    @property
    def block_rows(self) -> int:
        """The most rows one chunk takes (whole samples, or a range of one sample's rows)."""
        samples, length = self.labels.shape
        if self.chunk >= length:
            return min(samples, self.chunk // length) * length
        return self.chunk

    def spans(self) -> Iterator[tuple[slice, slice]]:
        """The chunks, in order: ``(samples, rows)`` index pairs into the grid."""
        samples, length = self.labels.shape
        if self.chunk >= length:  # whole samples
            step = self.chunk // length
            for start in range(0, samples, step):
                yield slice(start, min(samples, start + step)), slice(None)
            return
        for sample in range(samples):
            for start in range(0, length, self.chunk):
                yield slice(sample, sample + 1), slice(start, min(length, start + self.chunk))

    def loss(self, z: torch.Tensor) -> torch.Tensor:
        """``L_b = sum_t r_t (logsumexp z_t - z_{t,y_t})``, summed in float64 (no graph).

        Args:
            z: the logits.

        Returns:
            A 0-dim float64 tensor.
        """
        grid = _grid(z.detach())
        total = torch.zeros((), dtype=torch.float64, device=z.device)
        for span in self.spans():
            block = grid[span]
            picked = block.gather(-1, self.labels[span].unsqueeze(-1)).squeeze(-1)
            nll = torch.logsumexp(block, dim=-1) - picked
            total += (nll * self.weights[span]).sum(dtype=torch.float64)
        return total

    def gradient(self, z: torch.Tensor) -> torch.Tensor:
        """``g_z = r_t (p_t - e_{y_t})`` row by row, shaped like ``z`` (no graph).

        Args:
            z: the logits.

        Returns:
            ``dL_b/dz``.
        """
        grid = _grid(z.detach())
        out = torch.empty_like(z, memory_format=torch.contiguous_format)
        out_grid = _grid(out)
        for span in self.spans():
            p = torch.softmax(grid[span], dim=-1)
            p.scatter_add_(-1, self.labels[span].unsqueeze(-1), torch.full_like(p[..., :1], -1))
            out_grid[span] = p * self.weights[span].unsqueeze(-1)
        return out

    def hessian_matvec(
        self, z: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``H_z u = r_t (p_t u_t - p_t <p_t, u_t>)`` row by row.

        Args:
            z: the logits.
            u: one or more directions, shaped like ``z`` or ``(k, *z.shape)``.
            out: where to write the result, shaped like ``u`` (``u`` itself may be given: each
                chunk is read before it is written); None: a new tensor.

        Returns:
            ``H_z u``, shaped like ``u``.
        """
        grid = _grid(z.detach())
        if out is None:
            out = torch.empty_like(u)
        batched = u.dim() > z.dim()
        directions = [_grid(d) for d in (u.unbind(0) if batched else [u])]
        results = [_grid(o) for o in (out.unbind(0) if batched else [out])]
        for span in self.spans():
            p = torch.softmax(grid[span], dim=-1)
            weights = self.weights[span].unsqueeze(-1)
            for direction, result in zip(directions, results):
                pu = p * direction[span]
                result[span] = (pu - p * pu.sum(-1, keepdim=True)) * weights
        return out

    def first_order(self, z: torch.Tensor, params) -> tuple[torch.Tensor, tuple]:
        """The first-order graph: ``g_z`` (a :class:`LogitGradient` node of ``z``) and
        ``g = J^T g_z`` with ``g_z`` fed to the network's backward as it is, both with graphs
        (so ``d<g, v>/dg_z = J v``, and reversing through ``g_z`` applies ``H_z``). It holds
        ``z`` and ``g_z``; no log-softmax.

        Args:
            z: the logits, with their graph.
            params: the parameters differentiated.

        Returns:
            ``(g_z, g)``, ``g`` one tensor (or None) per parameter.
        """
        gz = LogitGradient.apply(z, self)
        return gz, self.vjp(z, params, gz, create_graph=True)

    @staticmethod
    def vjp(z: torch.Tensor, params, u: torch.Tensor, *, batched: bool = False, **kw) -> tuple:
        """``J^T u`` from the logits' graph with ``u`` as the gradient fed in (no logits-sized
        ``<z, u>`` to differentiate, unlike :func:`sharpcli.curvature.products.graphs.vjp`).

        Args:
            z: the logits.
            params: the parameters.
            u: shaped like ``z``, or ``(k, *z.shape)`` when ``batched``.
            batched: ``k`` directions in one vmapped pass.
            **kw: ``retain_graph``, ``create_graph``.

        Returns:
            One tensor (or None) per parameter.
        """
        with torch.enable_grad():
            if not batched:  # without the import of sympy (graphs.grad_with_outputs)
                return grad_with_outputs([z], params, [u], allow_unused=True, **kw)
            return torch.autograd.grad(
                z, params, grad_outputs=u, allow_unused=True, is_grads_batched=batched, **kw
            )

    def hessian_matvec_differentiable(self, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """:meth:`hessian_matvec` on the whole tensors, for a backward that is differentiated
        again (``create_graph``): the same formula, with its graph in ``z`` and ``u``.

        Args:
            z: the logits.
            u: a direction shaped like ``z``.

        Returns:
            ``H_z u``.
        """
        p = torch.softmax(z, dim=-1)
        pu = p * u
        weights = self.weights.reshape(z.shape[:-1]).unsqueeze(-1)
        return (pu - p * pu.sum(-1, keepdim=True)) * weights


class LogitGradient(torch.autograd.Function):
    """``g_z = dL_b/dz`` of :class:`SoftmaxRows` as an autograd node of ``z``: forward
    :meth:`SoftmaxRows.gradient`, backward :meth:`SoftmaxRows.hessian_matvec` (``H_z`` is
    symmetric), both by chunks; it saves only ``z``, which the engine holds anyway."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, rows: SoftmaxRows) -> torch.Tensor:
        """``g_z`` of the logits ``z``."""
        ctx.save_for_backward(z)
        ctx.rows = rows
        return rows.gradient(z)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """``H_z grad`` (by chunks unless this backward is itself differentiated)."""
        (z,) = ctx.saved_tensors
        rows: SoftmaxRows = ctx.rows
        if torch.is_grad_enabled():
            return rows.hessian_matvec_differentiable(z, grad), None
        return rows.hessian_matvec(z, grad), None


@dataclass
class VocabChunking:
    """When a batch's cross-entropy goes by chunks of rows, and how many rows a chunk takes.

    Attributes:
        loss: the analysis loss's name (only :data:`CHUNKED_LOSSES` are chunked).
        vocab_chunk: rows per chunk; None: chunk a batch whose logits exceed ``chunk_bytes``
            (rows of ``chunk_bytes``); 0: never (autograd's cross-entropy).
        chunk_bytes: the bytes of one automatic chunk (None: :data:`DEFAULT_CHUNK_BYTES`;
            :meth:`fit_budget` lowers it to what a memory budget leaves).
    """

    loss: str
    vocab_chunk: int | None = None
    chunk_bytes: int | None = None

    def __post_init__(self):
        if self.vocab_chunk is not None and int(self.vocab_chunk) < 0:
            raise ValueError(f"vocab_chunk must be 0 or more, got {self.vocab_chunk}")

    def rows(self, z: torch.Tensor, y: torch.Tensor, weight: float) -> SoftmaxRows | None:
        """The batch's rows by chunks, or None for autograd's cross-entropy (another loss,
        ``vocab_chunk`` 0, or automatic and within one chunk).

        Args:
            z: the batch's logits.
            y: its labels.
            weight: its weight in the analysis mean.

        Returns:
            The rows, or None.
        """
        if self.vocab_chunk == 0 or self.loss not in CHUNKED_LOSSES or z.dim() not in (2, 3):
            return None
        chunk = self.vocab_chunk or self.automatic_rows(z.shape[-1], z.element_size())
        if self.vocab_chunk is None and chunk * z.shape[-1] >= z.numel():
            return None
        return SoftmaxRows.of_batch(self.loss, z, y, weight, chunk)

    def automatic_rows(self, classes: int, element_size: int) -> int:
        """Rows of ``chunk_bytes`` (:func:`rows_per_chunk`)."""
        chunk_bytes = DEFAULT_CHUNK_BYTES if self.chunk_bytes is None else self.chunk_bytes
        return rows_per_chunk(chunk_bytes, classes, element_size)

    def fit_budget(self, room: int) -> None:
        """The automatic chunk: :data:`DEFAULT_CHUNK_BYTES`, or ``1 / CHUNK_SHARE`` of what
        the budget leaves (``room``) when that is less: a chunk's work holds a few chunks of
        logits (:data:`CHUNK_TEMPORARIES`), a small part of the budget.

        Args:
            room: the bytes the memory budget leaves.
        """
        self.chunk_bytes = max(1, min(DEFAULT_CHUNK_BYTES, int(room) // CHUNK_SHARE))

    def workspace(self, rows: SoftmaxRows, z: torch.Tensor) -> int:
        """The bytes a chunk's work holds: :data:`CHUNK_TEMPORARIES` chunks of rows of ``z``
        (the softmax, ``p u`` and the result written).

        Args:
            rows: the batch's rows.
            z: its logits.

        Returns:
            The bytes.
        """
        return CHUNK_TEMPORARIES * rows.block_rows * z.shape[-1] * z.element_size()

    @staticmethod
    def describe(rows: SoftmaxRows, z: torch.Tensor) -> str:
        """The report's note: the logits and the chunk (``rows``' of the batch ``z``)."""
        total, classes = rows.count, z.shape[-1]
        return (
            f"cross-entropy over {total} x {classes} logits by chunks of "
            f"{rows.block_rows} rows (its gradient and Hessian products)"
        )
