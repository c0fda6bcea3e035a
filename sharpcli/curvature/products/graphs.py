"""The first-order graph of a batch and the autograd pieces the curvature engine builds on.

:class:`BatchGraph` holds what one batch's forward and backward pass leave for the products
(:class:`~sharpcli.curvature.products.engine.CurvatureEngine`); :class:`ByteCounter` measures what such a
graph keeps alive; :func:`vjp` is the vector-Jacobian product every product is made of, and :func:`flat_block`
lays its parameter-shaped results out as a block of flat columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sharpcli.errors import NumericalError

if TYPE_CHECKING:
    from sharpcli.curvature.products.scope import ParamScope
    from sharpcli.curvature.products.softmax_chunks import SoftmaxRows

__all__ = ["BatchGraph", "ByteCounter", "check_finite", "flat_block", "vjp"]


@dataclass
class BatchGraph:
    """First-order graph of one batch: logits ``z``, ``g_z = dL_b/dz``, ``g = J^T g_z`` (with graphs)."""

    z: torch.Tensor
    gz: torch.Tensor
    grads: list  # tensors of the scope's gradient that depend on theta (require grad)
    grad_index: list  # their positions in the scope
    nbytes: int = 0
    nme_view: "BatchGraph | None" = (
        None  # g_N = J^T g_z with g_z held constant (built on first N product)
    )
    cached: bool = False  # held in CurvatureEngine._cache (its NME view then counts there too)
    # the cross-entropy by chunks of rows (g_z its LogitGradient node), or None: autograd's
    softmax: "SoftmaxRows | None" = None


@dataclass
class ByteCounter:
    """Saved-tensor hooks that count the bytes a graph keeps (each storage once).

    Attributes:
        seen: the storages counted so far (start it with storages held anyway, such as the
            model's weights, to count only what the graph adds).
        nbytes: their bytes.
    """

    seen: set = field(default_factory=set)
    nbytes: int = 0

    @classmethod
    def beside(cls, model: torch.nn.Module) -> ByteCounter:
        """A counter that leaves out the storages of ``model``'s parameters and buffers: a
        graph that saves a weight (every linear layer does) holds no new memory for it, and
        counting it made a GPT-2-small graph 0.5 GB (its weights) larger than it is.

        Args:
            model: the model whose weights are held anyway.

        Returns:
            A fresh counter.
        """
        held = {cls.key(t) for t in (*model.parameters(), *model.buffers())}
        return cls(seen={key for key in held if key is not None})

    @staticmethod
    def key(tensor: torch.Tensor) -> tuple[int, int] | None:
        """``(data pointer, bytes)`` of ``tensor``'s storage, None when it has none (sparse).

        Args:
            tensor: any tensor.

        Returns:
            The key under which :attr:`seen` records the storage.
        """
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return (storage.data_ptr(), storage.nbytes())

    def pack(self, tensor):
        """Count ``tensor``'s storage (once) and keep a detached view of it.

        Not ``tensor`` itself: a node that saves its own output (softmax, tanh, exp, ...) would
        then hold, through the packed tensor's ``grad_fn``, a strong reference to itself, a
        cycle inside autograd that Python's collector cannot see. A graph kept with
        ``retain_graph=True`` (every product's double backward) was then never freed: each
        rebuilt graph leaked whole, ~0.2 GB a product at GPT-2 small (docs/memory.md). The
        detached view shares the storage and version counter; autograd restores the saved
        tensor's ``grad_fn`` itself on unpacking, so double backward is unchanged."""
        key = self.key(tensor)
        if key is None:  # tensors without storage (e.g. sparse) count by size
            self.nbytes += tensor.numel() * tensor.element_size()
        elif key not in self.seen:
            self.seen.add(key)
            self.nbytes += key[1]
        return tensor.detach()

    @staticmethod
    def unpack(tensor):
        """The tensor as it was saved."""
        return tensor


def flat_block(scope: ParamScope, tensors, k: int, batched: bool, out=None) -> torch.Tensor:
    """Parameter-shaped results (leading k dim when batched) -> ``(P, k)``; None -> zeros.

    Each result is released once copied (when the caller holds no other reference), so the
    results and the block are not both held whole.

    Args:
        scope: the parameters, whose layout the block takes.
        tensors: one result (or None) per parameter in scope, in order (missing ones: None).
        k: the columns.
        batched: the results carry a leading dimension of k columns.
        out: a ``(P, k)`` view to write into (a column of a caller's block: no vector of its
            own, then copied), or None for a new block.

    Returns:
        The block (``out`` when given).
    """
    if out is None:
        # uninitialised: every slice is written below (zeroing the whole block first mapped and
        # wrote P x k entries once more per product)
        out = torch.empty(scope.numel, k, dtype=scope.dtype, device=scope.device)
    tensors = list(tensors)
    tensors += [None] * (len(scope.offsets) - 1 - len(tensors))
    for i in range(len(tensors)):
        t, tensors[i] = tensors[i], None
        a, b = scope.offsets[i], scope.offsets[i + 1]
        if t is None:
            out[a:b].zero_()
            continue
        out[a:b] = t.reshape(k, -1).T if batched else t.reshape(-1, 1)
        del t
    return out


def check_finite(block: torch.Tensor, part: str, operator: str, index: int) -> None:
    """Raise :class:`~sharpcli.errors.NumericalError` naming ``operator``, its ``part`` and the
    batch when a batch's product is not finite, or finite with a norm beyond the dtype's range.

    Args:
        block: one batch's ``(P, k)`` product.
        part: which part of the operator it is (``Hessian``, ``Gauss-Newton``).
        operator: the operator's name.
        index: the batch.
    """
    # One pass: a column's norm is finite only when its entries are and their sum of squares
    # stays in the dtype's range (float32: entries above ~1e19 overflow it). Every estimator
    # normalises or squares the product, so an overflowing norm would turn into Inf/NaN there
    # and the NEXT product would be blamed on its first batch; stop here, naming the batch that
    # did it. Only a failing block is read again, to say which of the two it is.
    # the whole block's norm first: one contiguous pass (a column's norm reads a (P, k) block
    # with stride k: 3.9 CPU s at GPT-2 small, k = 8); finite, it bounds every column's
    if torch.isfinite(torch.linalg.vector_norm(block)):
        return
    if torch.isfinite(torch.linalg.vector_norm(block, dim=0)).all():
        return
    if not torch.isfinite(block).all():
        raise NumericalError(
            f"{operator} product ({part} part) is not finite on batch {index}",
            source=f"{operator} operator",
        )
    raise NumericalError(
        f"{operator} product ({part} part) on batch {index} is too large for "
        f"{str(block.dtype).replace('torch.', '')} (its norm overflows; try "
        "`dtype=float64`)",
        source=f"{operator} operator",
    )


# outputs of this many entries or more take ``grad_outputs`` (see :func:`vjp`)
GRAD_OUTPUTS_FROM = 1 << 22


def grad_with_outputs(
    outputs, inputs, vectors, *, allow_unused: bool = True, retain_graph=None, create_graph=False
) -> tuple:
    """``torch.autograd.grad(outputs, inputs, grad_outputs=vectors, ...)``, the same engine
    call with the same tensors, without the shape check of torch's ``_make_grads``.

    That check imports ``torch.fx``'s symbolic-shape module and with it sympy, about 1 CPU s
    of every process that takes a product (docs/benchmarks.md, "Fixed costs, second pass");
    the shapes and dtypes are compared here instead, and anything else (a tensor subclass
    with its own ``__torch_function__``, a mismatch whose error torch words, a torch without
    the engine entry point) goes through ``torch.autograd.grad`` itself.

    Args:
        outputs: the tensors differentiated.
        inputs: the tensors differentiated with respect to.
        vectors: one tensor per output, shaped like it (``grad_outputs``).
        allow_unused: return ``None`` for an input the outputs do not depend on.
        retain_graph: keep the graph (default: ``create_graph``).
        create_graph: build the graph of the result.

    Returns:
        One tensor (or ``None``) per input.
    """
    outputs, inputs, vectors = tuple(outputs), tuple(inputs), tuple(vectors)
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    plain = (
        run is not None
        and len(vectors) == len(outputs)
        and all(
            type(t) is torch.Tensor or type(t) is torch.nn.Parameter
            for t in (*outputs, *inputs, *vectors)
        )
        and all(
            o.shape == v.shape and o.dtype == v.dtype and o.device == v.device and o.requires_grad
            for o, v in zip(outputs, vectors)
        )
    )
    if not plain:
        return torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs=vectors,
            allow_unused=allow_unused,
            retain_graph=retain_graph,
            create_graph=create_graph,
        )
    if retain_graph is None:
        retain_graph = create_graph
    return run(  # type: ignore[misc]
        outputs, vectors, retain_graph, create_graph, inputs, allow_unused, accumulate_grad=False
    )


def vjp(outputs, inputs, vectors, *, allow_unused: bool = True, **kw) -> tuple:
    """``d/d inputs sum_i <outputs_i, vectors_i>``: the vector-Jacobian product ``J^T v``.

    Taken as the gradient of a scalar dot product, not with ``grad_outputs=vectors``: the
    ``grad_outputs`` path of ``torch.autograd.grad`` imports ``torch.fx``'s symbolic-shape
    module and with it sympy to compare shapes (a part of a command's start-up:
    docs/benchmarks.md, "Start-up"), and the dot product costs one elementwise product and sum
    per output. From :data:`GRAD_OUTPUTS_FROM` entries on (4M: a model where a product takes
    seconds) the outputs are passed as ``grad_outputs`` (:func:`grad_with_outputs`, which
    skips that import too): there the dot product's temporaries cost more every product. The ``vectors`` must not depend on ``inputs`` (they are constants of the
    product).

    Args:
        outputs: the tensors differentiated.
        inputs: the tensors differentiated with respect to.
        vectors: one constant tensor per output, shaped like it.
        allow_unused: return ``None`` for an input the outputs do not depend on.
        **kw: passed to ``torch.autograd.grad`` (``retain_graph``, ``create_graph``).

    Returns:
        ``J^T v``, one tensor (or ``None``) per input.
    """
    if sum(o.numel() for o in outputs) >= GRAD_OUTPUTS_FROM:
        # at this size the dot product's P-sized temporaries cost more per product (0.2-0.5
        # CPU s at GPT-2 small, its strided probe columns the most) than sympy's import once
        # contiguous: a probe block's column is a strided view, and every layer's backward
        # would read it strided (1.4 CPU s more a product at GPT-2 small than one copy)
        vectors = [v.contiguous() for v in vectors]
        return grad_with_outputs(outputs, inputs, vectors, allow_unused=allow_unused, **kw)
    dot = sum((o * v).sum() for o, v in zip(outputs, vectors))
    return torch.autograd.grad(dot, inputs, allow_unused=allow_unused, **kw)
