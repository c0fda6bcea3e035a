r"""The curvature engine: a cache of first-order graphs and the H, G, N products through it.

For the analysis loss :math:`L(\theta) = \frac{1}{N} \sum_i \ell(z_i, y_i)`,
:math:`z_i = f(\theta, x_i)`, the matrices H, G and N = H - G of
:mod:`sharpcli.curvature.operators.hessian` ([NME] eq. 2; the matrix-free Gauss-Newton product
:math:`J^\top H_z J v` follows [Schraudolph2002], see also [Martens2020]).

How the products are computed (one pass over the data per product or block of products).
Per batch the first-order graph is built once,

.. math::

    g_z = \partial L_b / \partial z, \qquad g = J^\top g_z \qquad \text{(both with their graphs)},

and kept in a cache bounded by a memory budget (``cache_bytes``; batches beyond the budget
are rebuilt for every product). Differentiating :math:`\langle g, v \rangle` back through that
graph (through :math:`J^\top` and through :math:`g_z(z(\theta))`; g is linear in
:math:`g_z`) gives

.. math::

    \frac{\partial \langle g, v \rangle}{\partial \theta} = H v, \qquad
    \frac{\partial \langle g, v \rangle}{\partial g_z} = J v

in ONE reverse pass, so the Gauss-Newton product only adds ``u = H_z (J v)`` (a backward
through the tiny ``g_z(z)`` graph) and one vector-Jacobian product ``J^T u``; the NME is
``N v = H v - G v`` from the same pass, so ``H = G + N`` holds per vector to rounding.
The NME operator on its own differentiates a second graph, ``g_N = J^T g_z`` with ``g_z``
held constant, whose ``d<g_N, v>/dtheta = N v`` costs about one Hessian product.
The batch loss carries the weight ``B_b/N`` (see :mod:`sharpcli.curvature.products.data`), so every
product is the mean over samples; results are summed over ranks with ``all_reduce_sum``.
The operators by ``--operator`` name: :mod:`sharpcli.curvature.operators.registry`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from sharpcli import catalogue, memory
from sharpcli.curvature.products.batch_forms import BatchForms
from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum, to_model_batch
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.curvature.products.graphs import (
    BatchGraph,
    ByteCounter,
    check_finite,
    flat_block,
    vjp,
)
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.products.softmax_chunks import VocabChunking
from sharpcli.errors import NumericalError
from sharpcli.losses import loss_fn

if TYPE_CHECKING:
    from sharpcli.curvature.operators.hessian import GGNOperator, HessianOperator, NMEOperator

__all__ = ["DEFAULT_CACHE_BYTES", "CurvatureEngine"]

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB of retained first-order graphs


class CurvatureEngine:
    """The cache of first-order graphs behind the curvature operators, and their products.

    ``hessian_matmat``, ``ggn_matmat``, ``nme_matmat`` and ``hessian_and_ggn_matmat`` (both
    from the same reverse pass; see the module docstring) multiply a block ``V`` of shape
    ``(P, k)`` in ONE pass over the data (each batch's first-order graph serves all k columns).
    The per-batch graphs are cached while their retained bytes fit ``cache_bytes``
    (0 disables caching); the cache is dropped automatically when any parameter or buffer
    of the model changes in place (its version counter moves). Blocks are multiplied
    ``vectorize`` columns at a time in one vmapped reverse pass (``is_grads_batched``), with
    a per-column fallback for layers lacking a batched backward rule. The default is 32 on
    accelerators and 1 (column by column) on CPU, where the vmapped double backward is slower
    per product than the same products one at a time.

    Args:
        model: the model.
        data: the analysis set.
        scope: the parameters differentiated.
        cache_bytes: the budget of cached graphs (0: no cache).
        vectorize: columns per vmapped reverse pass (default 1 on CPU, 32 elsewhere).
        vocab_chunk: rows of logits per chunk of the cross-entropy's gradient and Hessian
            (:mod:`sharpcli.curvature.products.softmax_chunks`): None (default) chunks a batch whose
            logits exceed ``chunk_bytes`` (16 MiB, lowered by :meth:`plan_memory` to what
            the budget leaves), 0 never chunks (autograd's cross-entropy, differentiated
            twice), a positive count chunks every batch by that many rows.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from sharpcli.curvature import AnalysisData, ParamScope
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
        >>> engine = CurvatureEngine(model, AnalysisData(x, y, "cross-entropy", 5), ParamScope.resolve(model))
        >>> V = torch.randn(engine.scope.numel, 3, dtype=torch.float64)
        >>> HV, GV = engine.hessian_and_ggn_matmat(V)  # one pass over the data for both
        >>> torch.allclose(HV - GV, engine.nme_matmat(V)), engine.cached_batches
        (True, 2)
    """

    # whether the products go through the batch sum of ``_apply`` (per-batch forms recorded)
    records_batch_forms = True

    def __init__(
        self,
        model: nn.Module,
        data: AnalysisData,
        scope: ParamScope,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        vectorize: int | None = None,
        vocab_chunk: int | None = None,
    ):
        self.model = model
        self.data = data
        self.scope = scope
        self.loss = loss_fn(data.loss)
        self.cache_bytes = int(cache_bytes)
        self._cache: dict[int, BatchGraph] = {}
        self._cached_bytes = 0
        self._versions = None
        if vectorize is None:
            vectorize = 1 if scope.device.type == "cpu" else 32
        self.vectorize = int(vectorize)
        self._batched_ok = self.vectorize > 1
        self.matvecs = 0  # joint (H, G) products computed through hessian_and_ggn_matvec/matmat
        self.chunking = VocabChunking(data.loss, vocab_chunk)
        self.forms: BatchForms | None = None  # per-batch forms while recording_forms is on

    @contextmanager
    def recording_forms(self, left: torch.Tensor) -> Iterator[BatchForms]:
        """Keep ``left^T (A_b V)`` per batch of the products made inside the block.

        The per-batch parts of a quantity linear in the operator, for its data error
        (:mod:`sharpcli.curvature.products.batch_forms`): no extra product, one small matrix
        product per batch.

        Args:
            left: a ``(P, m)`` block.

        Yields:
            The :class:`~sharpcli.curvature.products.batch_forms.BatchForms` recorder.
        """
        scope = self.scope  # the products' dtype and device, once (not a copy per batch)
        left = left.to(dtype=scope.dtype, device=scope.device)
        outer, self.forms = self.forms, BatchForms(left, self.data)
        try:
            yield self.forms
        finally:
            self.forms = outer

    # ----------------------------------------------------------------- cache management
    def _state_versions(self):
        return tuple(t._version for t in self.model.parameters()) + tuple(
            t._version for t in self.model.buffers()
        )

    def clear_cache(self) -> None:
        """Drop every cached first-order graph (call after changing the model's weights)."""
        self._cache.clear()
        self._cached_bytes = 0
        self._versions = None

    @property
    def cached_batches(self) -> int:
        """Number of batches whose first-order graph is currently cached."""
        return len(self._cache)

    def _build_graph(self, x_b, y_b, weight: float, batch_index: int) -> BatchGraph:
        counter = ByteCounter.beside(self.model)
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack),
        ):
            z = self.model(x_b)
            # large logits: the cross-entropy's part by chunks of rows (softmax_chunks)
            rows = self.chunking.rows(z, y_b, weight)
            loss_b = self.loss(z, y_b) * weight if rows is None else rows.loss(z)
            if not torch.isfinite(loss_b):
                raise NumericalError(
                    f"loss is {loss_b.item()} on batch {batch_index}", source="curvature pass"
                )
            if rows is None:
                # g_z and g = J^T g_z from one reverse sweep: the g_z returned is the tensor
                # that sweep fed into the network's backward, so g's graph holds it
                # (J v = d<g, v>/dg_z)
                gz, *grads = torch.autograd.grad(
                    loss_b, [z, *self.scope.params], create_graph=True, allow_unused=True
                )
            else:
                gz, first = rows.first_order(z, self.scope.params)
                grads = list(first)
        kept = [(i, g) for i, g in enumerate(grads) if g is not None and g.requires_grad]
        nbytes = counter.nbytes + sum(g.numel() * g.element_size() for _, g in kept)
        if rows is None:
            nbytes += 2 * z.numel() * z.element_size()
        return BatchGraph(z, gz, [g for _, g in kept], [i for i, _ in kept], nbytes, softmax=rows)

    def _nme_graph(self, graph: BatchGraph) -> BatchGraph:
        """The first-order graph of ``<z, g_z>`` with ``g_z`` held constant: ``g_N = J^T g_z``.

        Differentiating ``<g_N, v>`` gives ``sum_c (dl/dz_c) d^2 z_c/dtheta^2 v = N v`` directly
        ([NME] eq. 2, second term), without the path through ``g_z(z(theta))`` that makes ``G v``:
        about the cost of one Hessian product instead of a joint H+G one. Built once per batch
        on the first N product and cached with the batch's graph.
        """
        if graph.nme_view is None:
            counter = ByteCounter.beside(self.model)
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack),
            ):
                params, gz = list(self.scope.params), graph.gz.detach()
                grads = (  # chunked: no logits-sized z * g_z to differentiate and keep
                    vjp([graph.z], params, [gz], create_graph=True)
                    if graph.softmax is None
                    else graph.softmax.vjp(graph.z, params, gz, create_graph=True)
                )
            kept = [(i, g) for i, g in enumerate(grads) if g is not None and g.requires_grad]
            nbytes = counter.nbytes + sum(g.numel() * g.element_size() for _, g in kept)
            graph.nme_view = BatchGraph(
                graph.z,
                graph.gz,
                [g for _, g in kept],
                [i for i, _ in kept],
                nbytes,
                softmax=graph.softmax,
            )
            if graph.cached:
                graph.nbytes += nbytes
                self._cached_bytes += nbytes
        return graph.nme_view

    def _graphs(self):
        """Yield ``(batch_index, graph)`` over this rank's batches, from the cache when possible."""
        versions = self._state_versions()
        if self._versions is not None and versions != self._versions:
            self.clear_cache()
        self._versions = versions
        dtype, device = self.scope.dtype, self.scope.device
        for index, (x_b, y_b, weight) in enumerate(self.data.batches()):
            graph = self._cache.get(index)
            if graph is None:
                x_b, y_b = to_model_batch(x_b, y_b, dtype, device)
                graph = self._build_graph(x_b, y_b, weight, index)
                if self._cached_bytes + graph.nbytes <= self.cache_bytes:
                    self._cache[index] = graph
                    self._cached_bytes += graph.nbytes
                    graph.cached = True
            yield index, graph

    def plan_memory(self, plan, *, auto_cache: bool = False) -> None:
        """Count this engine in the run's memory plan (:mod:`sharpcli.memory`) before any product.

        Builds the first batch's first-order graph (kept in the cache when it fits, so it is
        not wasted) and measures its bytes ``b``, of which ``g`` are the gradient ``J^T g_z``
        it keeps (one parameter-sized vector); a product holds that graph and about as much
        again, less ``g``, for the double backward, ``2 b - g``: the double backward's
        temporaries are activation-sized, and its parameter-sized results are counted by the
        caller beside the vectors it multiplies (``krylov_work_bytes``, a probe block's
        columns). Counting ``g`` twice planned 2.9 GiB too many at GPT-2 large (774M
        parameters), which refused a 20G budget that holds the run. The cache holds up to
        ``min(cache_bytes, batches * b)``. A cache larger than half of what the budget leaves
        is shrunk (products then rebuild the graphs they cannot keep), counting only the graphs
        beyond the first, which the workspace holds already; a budget that does not hold one
        batch's product is a UsageError on ``max_memory``. ``auto_cache``: the cache
        may also grow beyond ``cache_bytes`` to hold every batch's graph when that fits in
        half of what the budget leaves (each cached graph saves a forward and a backward pass
        per product). A cross-entropy over large logits goes by chunks of rows
        (:mod:`~sharpcli.curvature.products.softmax_chunks`; the automatic chunk at most 1/64 of what
        the budget leaves): the product adds a chunk's work. The double backward also holds
        the largest parameter's size once more, and with several batches the batch's block
        beside the running sum (:meth:`_double_backward_extra_bytes`).

        Args:
            plan: the run's :class:`~sharpcli.memory.MemoryPlan`.
            auto_cache: let the cache grow to every batch's graph when the budget holds it.
        """
        batches = max(1, -(-int(self.data.local_num_samples) // max(1, int(self.data.batch_size))))
        self.chunking.fit_budget(plan.room())
        graph_bytes = gradient_bytes = chunk_bytes = 0
        for _, graph in self._graphs():
            graph_bytes = graph.nbytes
            gradient_bytes = sum(g.numel() * g.element_size() for g in graph.grads)
            if graph.softmax is not None:
                chunk_bytes = self.chunking.workspace(graph.softmax, graph.z)
                plan.note(self.chunking.describe(graph.softmax, graph.z))
            break
        workspace = (
            2 * graph_bytes
            - min(gradient_bytes, graph_bytes)
            + chunk_bytes
            + self._double_backward_extra_bytes(batches)
        )
        plan.require(
            "one batch's Hessian product (its first-order graph and double backward)",
            workspace - (graph_bytes if self._cache else 0),
            "lower `batch_size`",
        )
        plan.reserve(memory.PRODUCT_WORKSPACE, workspace)
        # the first batch's graph is inside the workspace, held for the whole run: keeping it
        # between products costs the plan nothing, and only the other batches' graphs take
        # room (a budget that dropped it rebuilt the graph for every product, +1 forward and
        # backward each, for no byte saved)
        room = max(0, plan.room() // 2)
        if auto_cache:
            self.cache_bytes = max(self.cache_bytes, min(batches * graph_bytes, graph_bytes + room))
        wanted = min(self.cache_bytes, batches * graph_bytes)
        if wanted - graph_bytes > room:
            self.cache_bytes = int(graph_bytes + room)
            if self._cached_bytes > self.cache_bytes:
                self.clear_cache()
            plan.note(f"graph cache lowered to {self.cache_bytes >> 20} MiB by the memory budget")
            wanted = self.cache_bytes
        kept = min(batches, wanted // max(1, graph_bytes))
        # whole graphs only are kept; the first is counted in the workspace
        plan.reserve("cached first-order graphs", max(0, kept - 1) * graph_bytes)
        # built before any product and never freed: no blocks for the heap to keep
        plan.first_graph_bytes = graph_bytes if kept else 0
        plan.note(
            f"first-order graphs kept between products: {kept} of {batches} batches"
            + ("" if kept == batches else " (the others rebuilt for every product)")
        )

    def _double_backward_extra_bytes(self, batches: int) -> int:
        """What a product holds beyond its graph, its activation-sized temporaries and the
        P-vectors its caller counts (:meth:`plan_memory`): the largest parameter's
        gradient-of-gradient, summed by autograd from the paths through that parameter (a
        parameter-sized temporary beside its result), and with more than one batch the batch's
        block of one column beside the running sum (a block of probes counts its columns
        itself). Measured on a 21.5M-parameter MLP whose one 4600 x 4600 weight is most of P:
        each was about one such tensor beyond the plan (tests/test_memory_plan.py)."""
        scope = self.scope
        itemsize = torch.empty((), dtype=scope.dtype).element_size()
        largest = max((p.numel() for p in scope.params), default=0) * itemsize
        return int(largest + (scope.numel * itemsize if batches > 1 else 0))

    # ----------------------------------------------------------------- products
    def _flat(self, tensors, like_index=None) -> torch.Tensor:
        scope = self.scope
        out = torch.zeros(scope.numel, dtype=scope.dtype, device=scope.device)
        for i, t in enumerate(tensors):
            if t is None:
                continue
            j = i if like_index is None else like_index[i]
            out[scope.offsets[j] : scope.offsets[j + 1]] = t.reshape(-1)
        return out

    # One batch's products. Each takes the batch's first-order graph, a block ``V`` of columns
    # and ``batched`` (multiply all columns in one vmapped reverse pass, ``is_grads_batched``;
    # otherwise ``V`` has one column) and returns a tuple of ``(P, k)`` blocks.
    def _param_shaped(self, V: torch.Tensor, batched: bool) -> list[torch.Tensor]:
        """The columns of ``V`` as parameter-shaped tensors (with a leading k dim when batched)."""
        scope = self.scope
        if not batched:
            return scope.unflatten(V[:, 0])
        return [
            V[a:b].T.reshape(V.shape[1], *shape)
            for a, b, shape in zip(scope.offsets[:-1], scope.offsets[1:], scope.shapes)
        ]

    def _reverse_through_gradient(self, graph: BatchGraph, V, batched: bool, inputs) -> tuple:
        """``d<g, v>/d inputs`` for the batch's ``g = J^T g_z`` and each column ``v`` of ``V``.

        With respect to the parameters this is ``H v``, with respect to ``g_z`` it is ``J v``
        (``g`` is linear in ``g_z``); asking for both costs one reverse pass. The graph is
        retained: it serves every block of every product while it is cached.
        """
        parts = self._param_shaped(V, batched)
        vectors = [parts[i] for i in graph.grad_index]
        with torch.enable_grad():
            if not batched:
                return vjp(graph.grads, inputs, vectors, retain_graph=True)
            return torch.autograd.grad(
                graph.grads,
                inputs,
                grad_outputs=vectors,
                allow_unused=True,
                retain_graph=True,
                is_grads_batched=True,
            )

    def _ggn_from_jv(self, graph: BatchGraph, jv, k: int, batched: bool, into=None) -> torch.Tensor:
        """``G v = J^T H_z (J v)`` [Schraudolph2002] from ``J v``: a backward through the tiny ``g_z(z)``
        graph gives ``H_z J v``, one vector-Jacobian product of the logits maps it to theta
        (written into ``into``, a ``(P, k)`` view, when given)."""
        if jv is None:  # g does not depend on g_z here: no Gauss-Newton part on this batch
            return self._flat_block([], k, batched, into)  # zeros
        params = list(self.scope.params)
        if graph.softmax is not None:  # H_z by chunks of rows, written over J v (ours alone)
            out = jv if jv.is_contiguous() else None  # not over a broadcast gradient
            hz_jv = graph.softmax.hessian_matvec(graph.z, jv, out=out)
            gv = graph.softmax.vjp(graph.z, params, hz_jv, retain_graph=True, batched=batched)
            return self._flat_block(gv, k, batched, out=into)
        with torch.enable_grad():
            if batched:
                kw = {"retain_graph": True, "is_grads_batched": True}
                (hz_jv,) = torch.autograd.grad(graph.gz, graph.z, grad_outputs=jv, **kw)
                gv = torch.autograd.grad(
                    graph.z, params, grad_outputs=hz_jv, allow_unused=True, **kw
                )
            else:
                (hz_jv,) = vjp([graph.gz], [graph.z], [jv], allow_unused=False, retain_graph=True)
                gv = vjp([graph.z], params, [hz_jv], retain_graph=True)
        return self._flat_block(gv, k, batched, out=into)

    def _hessian_batch(self, graph: BatchGraph, V, batched: bool, out=None) -> tuple[torch.Tensor]:
        """``(H_b V,)``: ``<g, v>`` differentiated w.r.t. theta (through ``J^T`` and ``g_z(z)``)."""
        params, (into,) = list(self.scope.params), out or (None,)
        return (  # no local name for the results: _flat_block releases them as it copies
            self._flat_block(
                self._reverse_through_gradient(graph, V, batched, params), V.shape[1], batched, into
            ),
        )

    def _ggn_batch(self, graph: BatchGraph, V, batched: bool, out=None) -> tuple[torch.Tensor]:
        """``(G_b V,)``: ``J v`` from a reverse pass w.r.t. ``g_z`` alone, then ``J^T H_z J v``."""
        (jv,) = self._reverse_through_gradient(graph, V, batched, [graph.gz])
        (into,) = out or (None,)
        return (self._ggn_from_jv(graph, jv, V.shape[1], batched, into),)

    def _joint_batch(self, graph: BatchGraph, V, batched: bool, out=None) -> tuple:
        """``(H_b V, G_b V)`` from ONE reverse pass w.r.t. the parameters and ``g_z`` together."""
        params = list(self.scope.params)
        outs = self._reverse_through_gradient(graph, V, batched, params + [graph.gz])
        k = V.shape[1]
        h_out, g_out = out or (None, None)
        return (
            self._flat_block(outs[: len(params)], k, batched, out=h_out),
            self._ggn_from_jv(graph, outs[-1], k, batched, g_out),
        )

    def _flat_block(self, tensors, k, batched, out=None) -> torch.Tensor:
        """:func:`~sharpcli.curvature.products.graphs.flat_block` over this engine's scope."""
        return flat_block(self.scope, tensors, k, batched, out)

    # ----------------------------------------------------------------- the pass over the data
    def _batch_blocks(self, graph: BatchGraph, V, batch_product, count: int) -> list:
        """``batch_product`` of one batch for every column of ``V``, as ``count`` blocks.

        ``batch_product(graph, V, batched, out)`` writes its results into ``out``, one
        ``(P, k)`` view of the blocks each (None: new blocks).

        ``vectorize`` columns go through one vmapped reverse pass; column by column when
        ``vectorize`` is 1 (the CPU default) or once a layer without a batched backward rule
        has raised (then for the rest of this pass's life).
        """
        k = V.shape[1]
        if k == 1:  # one column: its products are the blocks (no zeroed copies to fill)
            return list(batch_product(graph, V, False))
        # column-major (P, k) views: each product fills a contiguous column (a row-major
        # block took a strided write of P entries, 0.5 CPU s a product at GPT-2 small), written
        # straight into it (its own vector then a copy: 0.26 s more), and every column is
        # written, so nothing is zeroed first
        blocks = [
            torch.empty(k, V.shape[0], dtype=V.dtype, device=V.device).T for _ in range(count)
        ]
        for start in range(0, k, self.vectorize):
            cols = slice(start, min(k, start + self.vectorize))
            if self._batched_ok and cols.stop - cols.start > 1:
                try:
                    batch_product(graph, V[:, cols], True, out=[b[:, cols] for b in blocks])
                    continue
                except RuntimeError:  # an op without a batched (vmap) backward rule
                    self._batched_ok = False
            for j in range(cols.start, cols.stop):
                column = slice(j, j + 1)
                batch_product(graph, V[:, column], False, out=[b[:, column] for b in blocks])
        return blocks

    _check_finite = staticmethod(check_finite)

    def _as_block(self, V: torch.Tensor) -> torch.Tensor:
        """``V`` as a ``(P, k)`` block in the scope's dtype and device (a vector is one column)."""
        if V.dim() == 1:
            V = V[:, None]
        scope = self.scope
        if V.shape[0] != scope.numel:
            raise ValueError(f"vector length {V.shape[0]} does not match scope size {scope.numel}")
        return V.to(dtype=scope.dtype, device=scope.device)

    @twice_differentiable()
    def _apply(self, V, batch_product, parts: tuple[str, ...], operator: str, view=None) -> tuple:
        """The sum of ``batch_product`` over this rank's batches and over all ranks.

        One ``(P, k)`` block per name in ``parts`` (the names the NaN/Inf errors give them),
        ``(P,)`` for a vector ``V``. ``view`` maps a batch's first-order graph to the graph the
        product differentiates (the NME's ``g_N``). Every batch's blocks are checked before they
        are added, so an error names the batch that produced it (and ``operator``).
        """
        squeeze = V.dim() == 1
        V = self._as_block(V)
        memory.settle_heap()  # the run's first product: reuse freed memory when the budget holds it
        totals: list[torch.Tensor] | None = None  # the first batch's blocks, then the sums
        for index, graph in self._graphs():
            if view is not None:
                graph = view(graph)
            if not graph.grads:  # the loss does not depend on theta in scope on this batch
                del graph
                continue
            blocks = self._batch_blocks(graph, V, batch_product, len(parts))
            # a graph not cached is freed before the next batch's is built: the loop variable
            # kept it through that build, two graphs (two gradients) at once beyond the plan
            del graph
            for part, block in zip(parts, blocks):
                self._check_finite(block, part, operator, index)
            if self.forms is not None:
                self.forms.add(index, blocks)
            if totals is None:
                totals = blocks
                continue
            for total, block in zip(totals, blocks):
                total += block
            # at 124M parameters each block is 0.5 GB: none is held (the loop variables kept
            # the last) through the next batch's graph and double backward
            del blocks, block
        memory.trim_heap()  # what the product freed leaves the resident set (sharpcli.memory)
        if self.forms is not None:
            self.forms.close_product(self.data.num_batches, len(parts), V.shape[1])
        if totals is None:
            totals = [torch.zeros_like(V) for _ in parts]
        for total in totals:
            all_reduce_sum(total)
        return tuple(total[:, 0] if squeeze else total for total in totals)

    # ----------------------------------------------------------------- products over the data
    def hessian_matmat(self, V: torch.Tensor, *, operator: str = "Hessian") -> torch.Tensor:
        """The Hessian product, in one pass over the data.

        Args:
            V: a ``(P, k)`` block or a ``(P,)`` vector.
            operator: names the product in NaN/Inf errors (which also name the batch).

        Returns:
            :math:`H V`, shaped like ``V``.
        """
        (HV,) = self._apply(V, self._hessian_batch, ("Hessian",), operator)
        return HV

    def ggn_matmat(self, V: torch.Tensor, *, operator: str = "Gauss-Newton") -> torch.Tensor:
        r"""The Gauss-Newton product ([NME] eq. 2, [Schraudolph2002]), in one pass over the data.

        .. math::

            G V = \frac{1}{N} \sum_i J_i^\top H_{z,i} J_i V

        Args:
            V: a ``(P, k)`` block or a ``(P,)`` vector.
            operator: names the product in NaN/Inf errors.

        Returns:
            :math:`G V`, shaped like ``V``.
        """
        (GV,) = self._apply(V, self._ggn_batch, ("Gauss-Newton",), operator)
        return GV

    def nme_matmat(self, V: torch.Tensor, *, operator: str = "NME") -> torch.Tensor:
        """The NME product :math:`N V = (H - G) V` ([NME] eq. 2), in one pass over the data.

        Straight from the graph of :meth:`_nme_graph` (about the cost of :math:`H V`; equal to
        :math:`H V - G V` of the joint pass to rounding).

        Args:
            V: a ``(P, k)`` block or a ``(P,)`` vector.
            operator: names the product in NaN/Inf errors.

        Returns:
            :math:`N V`, shaped like ``V``.
        """
        (NV,) = self._apply(V, self._hessian_batch, ("NME",), operator, view=self._nme_graph)
        return NV

    def hessian_and_ggn_matvec(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Hessian and Gauss-Newton products from ONE pass over the data (counted in ``matvecs``).

        Args:
            v: a ``(P,)`` vector or a ``(P, k)`` block.

        Returns:
            ``(H v, G v)``; ``N v = H v - G v`` ([NME] eq. 2).
        """
        HV, GV = self._apply(
            v, self._joint_batch, ("Hessian", "Gauss-Newton"), "Hessian+Gauss-Newton"
        )
        self.matvecs += 1 if v.dim() == 1 else v.shape[1]
        return HV, GV

    def hessian_and_ggn_matmat(self, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block version of :meth:`hessian_and_ggn_matvec`.

        Args:
            V: a ``(P, k)`` block.

        Returns:
            ``(H V, G V)``.
        """
        return self.hessian_and_ggn_matvec(V)

    @twice_differentiable()
    def loss_and_gradient(self) -> tuple[float, torch.Tensor]:
        """The analysis loss and its gradient (plain backward, no graph kept).

        Returns:
            ``(L(theta), grad L(theta))``, the gradient flat in the scope's layout.
        """
        scope = self.scope
        total_loss = torch.zeros((), dtype=torch.float64, device=scope.device)
        grad = torch.zeros(scope.numel, dtype=scope.dtype, device=scope.device)
        for index, (x_b, y_b, weight) in enumerate(self.data.batches()):
            x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
            with torch.enable_grad():
                z = self.model(x_b)
                rows = self.chunking.rows(z, y_b, weight)
                if rows is None:
                    loss_b = self.loss(z, y_b) * weight
                    parts = torch.autograd.grad(loss_b, scope.params, allow_unused=True)
                else:  # by chunks of rows: no log-softmax, no logits-sized temporaries
                    loss_b = rows.loss(z)
                    parts = rows.vjp(z, scope.params, rows.gradient(z))
                del z
            flat = self._flat(parts)
            if not torch.isfinite(flat).all() or not torch.isfinite(loss_b):
                raise NumericalError(f"gradient is not finite on batch {index}", source="gradient")
            grad += flat
            total_loss += loss_b.detach().to(torch.float64)
        all_reduce_sum([total_loss, grad])
        return float(total_loss), grad

    # ----------------------------------------------------------------- operator views
    def require_gauss_newton(self, operator: str) -> None:
        """Nothing: this engine multiplies G (and N = H - G) through its first-order graphs.

        Every operator with a G part calls it when built on an engine (the registry builds
        ``ggn`` and ``nme`` so); an engine without those graphs refuses there (the
        finite-difference one: a UsageError on ``hvp``).

        Args:
            operator: the operator's name, for the refusal.
        """

    def hessian(self) -> HessianOperator:
        """The Hessian operator sharing this engine (and its cache).

        Returns:
            A :class:`~sharpcli.curvature.operators.hessian.HessianOperator` on this engine, as the operator
            registry builds ``hessian`` (:mod:`sharpcli.curvature.operators.registry`).
        """
        return catalogue.OPERATORS.get(catalogue.HESSIAN).build(self)

    def ggn(self) -> GGNOperator:
        """The Gauss-Newton operator sharing this engine (and its cache).

        Returns:
            A :class:`~sharpcli.curvature.operators.hessian.GGNOperator` on this engine, as the operator
            registry builds ``ggn`` (:mod:`sharpcli.curvature.operators.registry`).
        """
        return catalogue.OPERATORS.get(catalogue.GGN).build(self)

    def nme(self) -> NMEOperator:
        """The NME operator sharing this engine (and its cache).

        Returns:
            A :class:`~sharpcli.curvature.operators.hessian.NMEOperator` on this engine, as the operator
            registry builds ``nme`` (:mod:`sharpcli.curvature.operators.registry`).
        """
        return catalogue.OPERATORS.get(catalogue.NME).build(self)
