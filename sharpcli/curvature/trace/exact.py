r"""Exact traces of every curvature operator: the trace estimator ``exact`` of ``sharp trace``.

Each operator by its cheapest exact route, for the analysis loss
:math:`L = \frac1N \sum_i l(z_i, y_i)` with :math:`z_i = f(\theta, x_i)`:

- ``ggn``: :math:`\mathrm{tr}(G) = \frac1N \sum_i \sum_c \lVert J_i^\top s_{ic} \rVert^2` from the
  loss's factor :math:`H_z = \sum_c s_c s_c^\top`, C backward passes per batch
  (:func:`~sharpcli.curvature.trace.ggn.exact_ggn_trace`);
- ``ef``: :math:`\mathrm{tr}(F_{\mathrm{emp}}) = \frac1N \sum_i \lVert g_i \rVert^2`, the
  per-sample gradients' squared norms, one backward pass per batch ([Kunstner2019]);
- ``fisher``: the operator as its products define it, the Monte Carlo Fisher of its fixed
  label draws :math:`\hat y_{is} \sim p(\cdot \mid z_i)`:
  :math:`\mathrm{tr}(F) = \frac1{NS} \sum_i \sum_s \lVert J_i^\top \hat r_{is} \rVert^2`, S
  backward passes per batch. Its expectation over the draws is G for every built-in loss
  (:mod:`sharpcli.curvature.operators.fisher`); the exact trace of that expectation is ``ggn``'s;
- ``hessian`` and any other operator: :math:`\mathrm{tr}(A) = \sum_j (A e_j)_j`, one product
  per parameter in scope, the identity's columns taken in blocks (a dense block of A's
  columns per pass), per layer the sums over its coordinates; :math:`\mathrm{Tr}(A^2) =
  \lVert A \rVert_F^2 = \sum_j \lVert A e_j \rVert^2` likewise (``square``, any operator);
- ``nme``: :math:`\mathrm{tr}(N) = \mathrm{tr}(H) - \mathrm{tr}(G)` ([NME] eq. 2), both exact:
  P Hessian products and the Gauss-Newton route above (a product of N costs an H and a G
  product).

The three outer-product operators (G, the empirical and the sampled Fisher) are
:math:`\frac1N \sum_i J_i^\top (\sum_c s_{ic} s_{ic}^\top) J_i` for their own output directions
:math:`s_{ic}`, whose trace is a sum of per-sample squared gradient norms
(:func:`~sharpcli.curvature.trace.ggn.outer_product_trace`): exact whatever P. The routes that
take P products are refused above :data:`EXACT_MAX_PARAMS` parameters in scope, naming the
stochastic estimators to use instead.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from sharpcli import progress
from sharpcli.catalogue.values import TRACE_KEY
from sharpcli.curvature.operators.fisher import (
    EMPIRICAL_FISHER,
    FISHER,
    FisherOperator,
    fisher_residuals,
)
from sharpcli.curvature.operators.registry import GGN, HESSIAN, NME, build_operator, operator_spec
from sharpcli.curvature.trace.ggn import exact_ggn_trace, outer_product_trace
from sharpcli.curvature.trace.hutchinson import HUTCHINSON
from sharpcli.curvature.trace.hutchpp import HUTCHPP
from sharpcli.curvature.trace.probes import TraceResult, blocks_of, layer_dict, product_segment_sums
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss
from sharpcli.registry import declare

if TYPE_CHECKING:
    from sharpcli.curvature.products.engine import CurvatureEngine
    from sharpcli.curvature.trace.estimators import TraceRequest

__all__ = [
    "EXACT",
    "EXACT_MAX_PARAMS",
    "UNIT_BLOCK",
    "check_exact_size",
    "exact_ef_trace",
    "exact_fisher_trace",
    "exact_nme_trace",
    "exact_trace",
    "unit_vector_trace",
]

# the trace estimator's name (``--estimator``), declared by :func:`exact_trace`; the label of
# its results
EXACT = "exact"

# The most parameters in scope for the exact routes that take one product per parameter (the
# Hessian, the NME, Tr(A^2), extensions). Each product costs about two gradients over the
# analysis set, so 10,000 of them are ten times the default budget of the stochastic
# estimators (1000 products), which reach a 1% standard error well within it on most models.
# The outer-product operators (ggn, ef, fisher) have exact routes without this limit.
EXACT_MAX_PARAMS = 10_000
UNIT_BLOCK = 32  # identity columns per product pass of the unit-vector route


def check_exact_size(numel: int, operator: str, *, square: bool = False) -> None:
    """Refuse a unit-vector route above :data:`EXACT_MAX_PARAMS` parameters.

    Args:
        numel: the parameters in scope (P, the products the route takes).
        operator: the operator (for the message).
        square: ``Tr(A^2)`` asked.

    Raises:
        UsageError: P above the limit (source ``estimator``), naming the stochastic estimators.
    """
    if numel > EXACT_MAX_PARAMS:
        quantity = f"Tr({operator}^2)" if square else f"tr({operator})"
        raise UsageError(
            f"the exact {quantity} takes one product per parameter in scope: {numel:,} "
            f"parameters, more than the exact route's limit of {EXACT_MAX_PARAMS:,}; use "
            f"`estimator={HUTCHPP}` or `estimator={HUTCHINSON}`, or narrow `params`",
            source="estimator",
        )


def unit_vector_trace(
    op, *, square: bool = False, block: int = UNIT_BLOCK, blocks: dict | None = None
) -> TraceResult:
    r"""``tr(A) = sum_j (A e_j)_j`` (or ``Tr(A^2) = sum_j ||A e_j||^2``), one product per
    coordinate, with per-layer traces.

    .. math::

        \mathrm{tr}(A_{bb}) = \sum_{j \in b} (A e_j)_j, \qquad
        \mathrm{Tr}((A^2)_{bb}) = \sum_{j} \lVert (A e_j)_b \rVert^2

    The identity's columns are taken ``block`` at a time (one block product each); the sums
    are float64.

    Args:
        op: a symmetric P x P operator (``shape``, ``dtype``, ``device``, ``matmat``).
        square: ``Tr(A^2)`` instead of ``tr(A)``.
        block: identity columns per product.
        blocks: ``{layer: slice}``; default the operator's own.

    Returns:
        A :class:`TraceResult` with ``stderr`` 0, ``matvecs`` and ``samples`` P.

    Example:
        >>> import torch
        >>> from sharpcli.curvature import MatrixOperator
        >>> A = MatrixOperator(torch.tensor([[2.0, 1.0], [1.0, 3.0]], dtype=torch.float64))
        >>> unit_vector_trace(A).estimate, unit_vector_trace(A, square=True).estimate
        (5.0, 15.0)
    """
    layers = blocks_of(op, blocks)
    dim = op.shape[0]
    sums = torch.zeros(1 + len(layers), dtype=torch.float64)
    label = "Tr(A^2)" if square else "tr"
    run = progress.start("exact unit vectors", total=dim, unit="products", quantity=label)
    for start in range(0, dim, block):
        stop = min(dim, start + block)
        E = torch.zeros(dim, stop - start, dtype=op.dtype, device=op.device)
        E[torch.arange(start, stop), torch.arange(stop - start)] = 1
        AE = op.matmat(E)
        sums += product_segment_sums(AE if square else E, AE, layers).sum(1).cpu()
        del E, AE
        run.update(stop, estimate=float(sums[0]))
    run.finish(dim, estimate=float(sums[0]), stderr=0.0)
    return TraceResult(
        estimate=float(sums[0]),
        stderr=0.0,
        matvecs=dim,
        samples=dim,
        estimator=EXACT,
        quantity="trace_of_square" if square else TRACE_KEY,
        converged=True,
        by_layer=layer_dict(list(layers), sums, torch.zeros_like(sums)),
        notes=[f"exact: {dim} products, one per unit vector"],
    )


def exact_ef_trace(engine: CurvatureEngine) -> TraceResult:
    r"""``tr(F_emp) = (1/N) sum_i ||g_i||^2``, the per-sample gradients' squared norms.

    :math:`g_i = J_i^\top r_i` with :math:`r_i = \partial l(z_i, y_i) / \partial z_i`, one
    output direction per sample (:func:`~sharpcli.curvature.trace.ggn.outer_product_trace`):
    the trace of :class:`~sharpcli.curvature.operators.fisher.EmpiricalFisherOperator`, one backward
    pass per batch ([Kunstner2019]).

    Args:
        engine: the analysis's engine (model, data, scope).

    Returns:
        The exact trace with its per-layer parts.
    """
    data = engine.data
    loss = get_loss(data.loss)

    def directions(index: int, z_b: torch.Tensor, y_b: torch.Tensor) -> list[torch.Tensor]:
        leaf = z_b.detach().requires_grad_(True)
        with torch.enable_grad():
            (r,) = torch.autograd.grad(loss.per_sample(leaf, y_b).sum(), leaf)
        return [r]

    result = outer_product_trace(
        engine.model,
        data,
        engine.scope,
        directions,
        symbol="F_emp",
        what="empirical Fisher",
        source=EMPIRICAL_FISHER,
        estimator=EXACT,
    )
    result.notes.append("tr(F_emp) = (1/N) sum_i ||g_i||^2, one backward pass per batch")
    return result


def exact_fisher_trace(op: FisherOperator) -> TraceResult:
    r"""The exact trace of the sampled-label Fisher operator ``op``, its own label draws.

    .. math::

        \mathrm{tr}(F) = \frac1{NS} \sum_i \sum_{s=1}^S \lVert J_i^\top \hat r_{is} \rVert^2

    with the operator's labels :math:`\hat y_{is}` (drawn keyed by each sample's global index
    and the operator's seed, :meth:`~sharpcli.curvature.operators.fisher.FisherOperator.labels`) and
    :math:`\hat r_{is}` their output gradients (:func:`~sharpcli.curvature.operators.fisher.fisher_residuals`):
    the sum of the diagonal of the matrix whose products ``op`` takes, S backward passes per
    batch. Its expectation over the draws is ``tr(G)`` ([Martens2020]).

    Args:
        op: the Fisher operator (its engine's model, data and scope).

    Returns:
        The exact trace with its per-layer parts.
    """
    engine = op.engine
    assert engine is not None  # a FisherOperator is built on an engine
    data, S = engine.data, op.samples

    def directions(index: int, z_b: torch.Tensor, y_b: torch.Tensor) -> list[torch.Tensor]:
        scale = 1.0 / math.sqrt(S)
        return [
            fisher_residuals(data.loss, z_b, labels, y_b) * scale
            for labels in op.labels(index, z_b)
        ]

    result = outer_product_trace(
        engine.model,
        data,
        engine.scope,
        directions,
        symbol="F",
        what="Fisher",
        source=FISHER,
        estimator=EXACT,
    )
    result.notes.append(
        f"the Fisher of the operator's {S} label draw(s) per sample (seed {op.seed}); "
        "its expectation is tr(G), exact with `operator=ggn`"
    )
    return result


def exact_nme_trace(engine: CurvatureEngine) -> TraceResult:
    """``tr(N) = tr(H) - tr(G)`` ([NME] eq. 2): P Hessian products and the exact tr(G).

    Args:
        engine: the analysis's engine.

    Returns:
        The exact trace with its per-layer parts (each layer's H part less its G part).

    Raises:
        UsageError: more parameters than :data:`EXACT_MAX_PARAMS`.
    """
    check_exact_size(engine.scope.numel, NME)
    hessian = unit_vector_trace(build_operator(HESSIAN, engine))
    ggn = exact_ggn_trace(engine.model, engine.data, engine.scope)
    by_layer = {
        name: {"estimate": part["estimate"] - ggn.by_layer[name]["estimate"], "stderr": 0.0}
        for name, part in hessian.by_layer.items()
    }
    return TraceResult(
        estimate=hessian.estimate - ggn.estimate,
        stderr=0.0,
        matvecs=hessian.matvecs,
        samples=hessian.samples,
        estimator=EXACT,
        converged=True,
        by_layer=by_layer,
        notes=[
            f"tr(N) = tr(H) - tr(G): exact tr(H) = {hessian.estimate:.6g} ({hessian.matvecs} "
            f"products), exact tr(G) = {ggn.estimate:.6g} ({engine.data.loss})"
        ],
    )


@declare(
    "estimator",
    EXACT,
    "every operator exactly (small models)",
    info={"order": 4},
)
def exact_trace(request: TraceRequest) -> TraceResult:
    """The exact trace of any operator by its cheapest exact route (module docstring).

    ``ggn``, ``ef`` and ``fisher`` from per-sample squared gradient norms, whatever P; ``nme``
    as ``tr(H) - tr(G)``; the Hessian, any other operator and every ``Tr(A^2)`` by one product
    per parameter, refused above :data:`EXACT_MAX_PARAMS` parameters.

    Args:
        request: the operator (:class:`~sharpcli.curvature.trace.estimators.TraceRequest`).

    Returns:
        The trace, with zero standard error.

    Raises:
        UsageError: a route of P products on more than :data:`EXACT_MAX_PARAMS` parameters.
    """
    engine, operator = request.engine, request.operator
    operator_spec(operator)  # an unknown operator: the accepted names, before any work
    if not request.square:
        if operator == GGN:
            return exact_ggn_trace(engine.model, engine.data, engine.scope)
        if operator == EMPIRICAL_FISHER:
            return exact_ef_trace(engine)
        if operator == NME:
            return exact_nme_trace(engine)
        if operator == FISHER:
            op = request.build()
            if isinstance(op, FisherOperator):  # not an extension registered under the name
                return exact_fisher_trace(op)
    check_exact_size(engine.scope.numel, operator, square=request.square)
    return unit_vector_trace(request.build(), square=request.square)
