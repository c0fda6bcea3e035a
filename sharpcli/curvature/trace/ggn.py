r"""Gauss-Newton traces: the exact :math:`\mathrm{tr}(G)` and the split
:math:`\mathrm{tr}(H) = \mathrm{tr}(G) + \mathrm{tr}(N)` ([NME] eq. 2).

With the loss's factor :math:`H_z = \sum_c s_c s_c^\top` per sample
(:attr:`sharpcli.losses.Loss.ggn_factor`),

.. math::

    \mathrm{tr}(G) = \frac1N \sum_i \sum_c \lVert J_i^\top s_{c,i} \rVert^2,

each term a per-sample squared gradient norm, summed per parameter and so per layer
(:func:`exact_ggn_trace`: C backward passes per batch). :func:`gn_split_trace` adds Hutch++
on the NME :math:`N = H - G` to that exact part. The helpers for per-sample functional calls
(:func:`functional_logits`, :func:`vmapped_or_looped`) serve the sampled-label estimator of
:mod:`sharpcli.curvature.trace.sampled_ggn` too. :func:`gn_split` is the trace estimator ``gn-split``
of ``sharp trace --estimator`` (:mod:`sharpcli.curvature.trace.estimators`), declared here; the
estimator ``exact`` (:mod:`sharpcli.curvature.trace.exact`) takes :func:`exact_ggn_trace` for G and
:func:`outer_product_trace` for the Fisher matrices.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from sharpcli import progress
from sharpcli.catalogue import GGN_EXACT
from sharpcli.curvature.operators.registry import HESSIAN
from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum, to_model_batch
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.curvature.products.persample import LayerTaps
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.hutchpp import hutchpp
from sharpcli.curvature.trace.probes import TraceResult
from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss
from sharpcli.registry import declare

if TYPE_CHECKING:
    from sharpcli.curvature.trace.estimators import TraceRequest

__all__ = [
    "CHUNK_BYTES",
    "GN_SPLIT",
    "exact_ggn_trace",
    "gn_split",
    "functional_logits",
    "gn_split_trace",
    "outer_product_trace",
    "param_to_layer",
    "vmapped_or_looped",
]

# the trace estimator's name (``--estimator``), declared by :func:`gn_split`; the label of the
# results of :func:`gn_split_trace`
GN_SPLIT = "gn-split"

CHUNK_BYTES = 64 << 20  # memory for one chunk of per-sample Jacobians / gradients


def functional_logits(model: nn.Module, names: list[str]):
    """``f(params_tuple, x_single) -> z`` for one sample (torch.func); ``params_tuple`` replaces
    the parameters ``names``, the others are the module's own."""
    from torch.func import functional_call

    def logits(params, x_single):
        return functional_call(model, dict(zip(names, params)), (x_single.unsqueeze(0),)).squeeze(0)

    return logits


def param_to_layer(scope: ParamScope) -> list[int]:
    """The layer block of each scope parameter.

    Args:
        scope: the parameters.

    Returns:
        Per parameter, the index of its block in ``scope.blocks()``.
    """
    blocks = scope.blocks()
    index = []
    for start in scope.offsets[:-1]:
        for j, sl in enumerate(blocks.values()):
            if sl.start <= start < sl.stop:
                index.append(j)
                break
    return index


def _ggn_directions(z: torch.Tensor, y: torch.Tensor, loss: str) -> list[torch.Tensor]:
    """Columns ``s`` (each shaped like ``z``) with ``H_z = sum_s s s^T`` per sample.

    The loss's own factor (:attr:`sharpcli.losses.Loss.ggn_factor`): for cross-entropy
    ``s_c = sqrt(p_c) (e_c - p)``, since ``diag(p) - p p^T = S S^T`` (``sum p = 1``); for mse
    ``s_c = sqrt(2/C) e_c``; one column ``sqrt(s(z)(1 - s(z)))`` for binary cross-entropy; one
    per (position, class) for token cross-entropy, whose ``H_z`` is block diagonal.
    """
    return list(get_loss(loss).ggn_factor(z, y))


def _jacobian_sums(model, scope, indices, x_b, columns, per_param) -> None:
    """``per_param[i] += sum_b ||S_b^T J_b,i||_F^2`` for the scope parameters ``indices``, from
    per-sample Jacobians (``vmap(jacrev)``, one backward pass per output entry and sample), in
    memory-bounded chunks; ``columns`` are the batch's output directions (each shaped like its
    outputs), stacked a chunk at a time into ``S`` (``(rows, columns, outputs)``).

    Some layers have no vmap batching rule, or one that fails (``nn.LSTM``/``nn.GRU`` on CPU:
    ``mkldnn_rnn_layer`` breaks in its backward under vmap); a chunk where vmap raises is done
    by :func:`_looped_sums` instead, one sample at a time, and so is the rest of the batch.
    """
    from torch.func import jacrev, vmap

    logits = functional_logits(model, [scope.names[i] for i in indices])
    jac = vmap(jacrev(logits), in_dims=(None, 0))
    params = tuple(scope.params[i].detach() for i in indices)
    outputs = columns[0][0].numel()  # C, or T x V for sequence outputs
    numel = sum(p.numel() for p in params)
    rows = max(1, CHUNK_BYTES // max(1, outputs * numel * columns[0].element_size()))
    vectorised = True
    for start in range(0, x_b.shape[0], rows):
        x_c = x_b[start : start + rows]
        S = torch.stack([s[start : start + rows] for s in columns], dim=1)
        S = S.reshape(S.shape[0], S.shape[1], outputs)  # (rows, columns, outputs)
        if vectorised:
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    # torch.func differentiates anyway; no graph to the other parameters. The
                    # warning of a missing batching rule is ours to act on, not the user's.
                    warnings.filterwarnings("ignore", message=".*batching rule.*")
                    J = jac(params, x_c)
            except RuntimeError:
                vectorised = False
        if not vectorised:
            _looped_sums(model, scope, indices, x_c, S, per_param)
            continue
        for i, Ji in zip(indices, J):  # Ji: (B, C, *shape)
            M = S @ Ji.reshape(Ji.shape[0], outputs, -1)  # rows s^T J
            per_param[i] += (M * M).sum().to(torch.float64)


def vmapped_or_looped(fn, in_dims: tuple):
    """``vmap(fn, in_dims)``, or, once vmap raises (a layer without a working batching rule,
    as ``nn.LSTM``/``nn.GRU`` on CPU), ``fn`` called per sample and its outputs stacked; the
    warning of a missing batching rule is silenced (the fallback is the answer to it)."""
    from torch.func import vmap

    batched = vmap(fn, in_dims=in_dims)
    state = {"vectorised": True}

    def looped(*args):
        n = next(a.shape[0] for a, d in zip(args, in_dims) if d == 0)
        rows = [fn(*(a if d is None else a[i] for a, d in zip(args, in_dims))) for i in range(n)]
        return tuple(torch.stack(parts) for parts in zip(*rows))

    def call(*args):
        if state["vectorised"]:
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*batching rule.*")
                    return batched(*args)
            except RuntimeError:
                state["vectorised"] = False
        return looped(*args)

    return call


def _looped_sums(model, scope, indices, x_c, S, per_param) -> None:
    """:func:`_jacobian_sums` for one chunk without vmap: per sample one forward pass and,
    per column ``s`` of ``S`` (``(B, columns, outputs)``), one backward pass of ``<s, z>``
    giving ``J^T s``, whose squared norm is summed per parameter."""
    params = [scope.params[i] for i in indices]
    for b in range(x_c.shape[0]):
        with torch.enable_grad():
            z = model(x_c[b : b + 1]).reshape(-1)
            for column in S[b]:
                grads = torch.autograd.grad(
                    z, params, column.to(z.dtype), retain_graph=True, allow_unused=True
                )
                for i, g in zip(indices, grads):
                    if g is not None:
                        per_param[i] += (g * g).sum().to(torch.float64)


# ``directions(batch_index, z_b, y_b) -> [s_c]``: output directions of a batch, each shaped like
# its outputs ``z_b``, with the operator's per-sample output factor ``sum_c s_c s_c^T``
Directions = Callable[[int, torch.Tensor, torch.Tensor], Sequence[torch.Tensor]]


def outer_product_trace(
    model: nn.Module,
    data: AnalysisData,
    scope: ParamScope,
    directions: Directions,
    *,
    symbol: str,
    what: str,
    source: str,
    estimator: str,
) -> TraceResult:
    r"""The exact trace of :math:`A = \frac1N \sum_i J_i^\top \big(\sum_c s_{ic}
    s_{ic}^\top\big) J_i`, with per-layer traces:

    .. math::

        \mathrm{tr}(A) = \frac1N \sum_i \sum_c \lVert J_i^\top s_{ic} \rVert^2,

    each term a per-sample squared gradient norm (of :math:`\langle s_{ic}, z_i \rangle`),
    summed per parameter and so per layer. For ``nn.Linear``, ``nn.Conv2d`` and eval-mode
    BatchNorm layers it comes from one backward pass per direction and batch to the layers'
    outputs (:class:`~sharpcli.curvature.products.persample.LayerTaps`, no per-sample gradients
    formed, [Goodfellow2015]); any other parameter (custom layers, shared weights) from
    per-sample Jacobians (``vmap(jacrev)``). The Gauss-Newton matrix, the empirical Fisher and
    the sampled-label Fisher are all of this form (:func:`exact_ggn_trace`,
    :mod:`sharpcli.curvature.trace.exact`).

    Args:
        model: the model.
        data: the analysis set.
        scope: the parameters.
        directions: the output directions ``s_c`` of each batch (``Directions``).
        symbol: the operator's letter in the progress line (``"G"``).
        what: the operator in the progress line and the notes (``"Gauss-Newton"``).
        source: the error's ``source`` if the trace is not finite.
        estimator: the result's label.

    Returns:
        A :class:`TraceResult` with ``stderr`` 0 (exact), ``samples`` N and the per-layer traces.

    Raises:
        NumericalError: a batch's sums are not finite.
    """

    layer_of = param_to_layer(scope)
    blocks = scope.blocks()
    per_param = torch.zeros(len(scope.params), dtype=torch.float64, device=scope.device)
    taps = LayerTaps(model, scope)
    N = data.num_samples
    run = progress.start(
        f"exact tr({symbol})", total=data.num_batches, unit="batches", quantity="tr"
    )
    for batch_index, (x_b, y_b, _) in enumerate(data.batches()):
        run.update(batch_index)
        x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
        with torch.enable_grad(), taps:
            z_b = model(x_b)
        taps.resolve(z_b)
        columns = [s.to(z_b.dtype) for s in directions(batch_index, z_b.detach(), y_b)]
        for direction in columns:
            taps.accumulate(z_b, direction, per_param)
        rest = taps.uncovered
        if rest and columns:
            _jacobian_sums(model, scope, rest, x_b, columns, per_param)
        del z_b, columns
        if not torch.isfinite(per_param).all():
            raise NumericalError(
                f"exact {what} trace is not finite on batch {batch_index}", source=source
            )
    all_reduce_sum(per_param)
    per_param /= N
    per_layer = torch.zeros(len(blocks), dtype=torch.float64)
    for i, j in enumerate(layer_of):
        per_layer[j] += float(per_param[i])
    run.finish(data.num_batches, estimate=float(per_param.sum()), stderr=0.0)
    return TraceResult(
        estimate=float(per_param.sum()),
        stderr=0.0,
        matvecs=0,
        samples=N,
        estimator=estimator,
        converged=True,
        by_layer={
            name: {"estimate": float(per_layer[j]), "stderr": 0.0} for j, name in enumerate(blocks)
        },
        notes=[f"exact {what} trace over {N} samples ({data.loss})"],
    )


@twice_differentiable()
def exact_ggn_trace(model: nn.Module, data: AnalysisData, scope: ParamScope) -> TraceResult:
    r"""The exact Gauss-Newton trace with per-layer traces.

    With :math:`H_z = \sum_c s_c s_c^\top` (:func:`_ggn_directions`),

    .. math::

        \mathrm{tr}(G) = \frac{1}{N} \sum_i \mathrm{tr}(J_i^\top H_{z,i} J_i)
            = \frac{1}{N} \sum_i \sum_c \lVert J_i^\top s_{c,i} \rVert^2,

    and for cross-entropy ``J^T s_c = sqrt(p_c) grad_theta l(z, c)``, so this is
    ``sum_c p_c ||grad_theta l(z, c)||^2``, the exact expectation of NME eq. 20.
    Each ``||J_i^T s_c||^2`` is a per-sample squared gradient norm
    (:func:`outer_product_trace`: one backward pass per class and batch).

    Args:
        model: the model.
        data: the analysis set (cross-entropy, mse and the other losses with a ``ggn_factor``).
        scope: the parameters.

    Returns:
        A :class:`TraceResult` with ``stderr`` 0 (exact) and the per-layer traces, labelled as
        the exact estimator of tr(G) (``sharp gn-nme --ggn-estimator exact``).
    """

    def directions(index: int, z_b: torch.Tensor, y_b: torch.Tensor) -> list[torch.Tensor]:
        return _ggn_directions(z_b, y_b, data.loss)

    return outer_product_trace(
        model,
        data,
        scope,
        directions,
        symbol="G",
        what="Gauss-Newton",
        source="Gauss-Newton",
        estimator=GGN_EXACT,
    )


def gn_split_trace(
    engine,
    *,
    tol: float = 1e-2,
    max_matvecs: int = 1000,
    seed: int = 0,
    block_size: int = 8,
    min_samples: int = 10,
) -> TraceResult:
    """``tr(H) = tr(G) + tr(N)``: the exact Gauss-Newton trace plus Hutch++ on the NME (NME eq. 2).

    The Gauss-Newton term is a control variate known exactly (:func:`exact_ggn_trace`, C
    backward passes per batch), so only ``tr(N)`` is estimated, from probes of
    ``N = H - G`` (one NME product each, about the cost of a Hessian product;
    :class:`~sharpcli.curvature.NMEOperator`).
    Per probe the variance drops from ``2 (||H||_F^2 - sum H_ii^2)`` to
    ``2 (||N||_F^2 - sum N_ii^2)``: large savings wherever the Gauss-Newton part dominates
    the Hessian, as it does near a minimum, where ``dl/dz -> 0`` and ``N -> 0``. Hutch++ starts
    unsketched (``initial_sketch=0``) and sketches N only when its probes say it pays. The
    standard error is that of the ``tr(N)`` estimate; ``tol`` is relative to ``tr(H)``; per
    layer, the exact Gauss-Newton block traces plus N's. ``matvecs`` counts the joint H+G
    products; the exact part's cost is in ``notes``.

    Args:
        engine: the :class:`~sharpcli.curvature.products.engine.CurvatureEngine` (its model,
            data and scope give the exact part, its NME operator the estimated one).
        tol: the standard error relative to ``tr(H)`` the probes are sized for.
        max_matvecs: the most NME products.
        seed: seeds the probes.
        block_size: probes per product block.
        min_samples: the pilot's probes, and the fewest main probes.

    Returns:
        A :class:`TraceResult` of ``tr(H)`` (``estimator="gn-split"``).
    """
    data, scope = engine.data, engine.scope
    ggn = exact_ggn_trace(engine.model, data, scope)
    known = torch.tensor(
        [ggn.estimate] + [v["estimate"] for v in ggn.by_layer.values()], dtype=torch.float64
    )
    nme = hutchpp(
        engine.nme(),
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
        block_size=block_size,
        min_samples=min_samples,
        initial_sketch=0,
        known=known,
    )
    nme.estimator = GN_SPLIT
    nme.notes = [
        f"tr(H) = tr(G) + tr(N): exact tr(G) = {ggn.estimate:.6g} ({data.loss}, one backward pass per class "
        f"and batch), tr(N) estimated from {nme.matvecs} H+G products",
        *nme.notes,
    ]
    return nme


def _require(request: TraceRequest, operator: str, message: str) -> None:
    """A UsageError (``message``) unless ``request`` asks for tr(``operator``), not squared."""
    if request.operator != operator or request.square:
        raise UsageError(f"{message} (`operator={operator}`, no `square`)", source="estimator")


@declare(
    "estimator",
    GN_SPLIT,
    "tr(G) and tr(N) from shared probes, tr(H) their sum",
    paper="NME",
    info={"order": 3},
)
def gn_split(request: TraceRequest) -> TraceResult:
    """``tr(H) = tr(G) + tr(N)``: exact ``tr(G)`` plus Hutch++ on ``N`` ([NME] eq. 2).

    Args:
        request: the operator and the budget (:class:`~sharpcli.curvature.trace.estimators.TraceRequest`).

    Returns:
        The estimate (:func:`gn_split_trace`).

    Raises:
        UsageError: another operator, or ``square``.
    """
    _require(request, HESSIAN, f"the {GN_SPLIT} estimator is for the Hessian trace")
    r = request
    return gn_split_trace(r.engine, tol=r.tol, max_matvecs=r.max_matvecs, seed=r.seed)
