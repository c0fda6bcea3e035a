r"""The diagonal of a curvature matrix: exact, Hutchinson, Gauss-Newton-Bartlett, per sample.

Four estimators of :math:`\mathrm{diag}(A)` for a P x P curvature matrix of the analysis loss
:math:`L = \frac1N \sum_i l(z_i, y_i)`:

- :func:`exact_diagonal`: :math:`A_{jj} = e_j^\top A e_j`, one product per coordinate (P
  products: small scopes only).
- :func:`hutchinson_diagonal`: with Rademacher probes :math:`v`,
  :math:`\mathbb{E}[v \odot A v] = \mathrm{diag}(A)` ([Bekas2007]); the per-entry standard
  error is the sample standard deviation of :math:`v_j (A v)_j` over the probes over
  :math:`\sqrt S` (its variance is :math:`\sum_{k \ne j} A_{jk}^2` per probe).
- :func:`gnb_diagonal`: Sophia's Gauss-Newton-Bartlett estimator ([Sophia] Algorithm 2): for a
  batch of B samples, labels :math:`\hat y_i \sim p(\cdot \mid z_i)` and
  :math:`\hat g = \nabla_\theta \frac1B \sum_i l(z_i, \hat y_i)`, the estimate
  :math:`B \, \hat g \odot \hat g`. Since :math:`\mathbb{E}_{\hat y} \nabla_\theta l(z_i, \hat y) = 0`
  the cross terms vanish and :math:`\mathbb{E}[B \hat g^{\odot 2}] = \frac1B \sum_i
  \mathrm{diag}(J_i^\top H_{z,i} J_i)`; batches weighted :math:`B_b / N` give
  :math:`\mathrm{diag}(G)` in expectation (unbiased whatever the batch size, whose choice
  changes only the variance). Labels are drawn as the sampled-label trace draws them (keyed by
  each sample's global index); a per-token loss's positions are weighted by :math:`\sqrt{w_t}`
  (:func:`~sharpcli.curvature.operators.fisher.fisher_residuals`).
- :func:`per_sample_diagonal`: exact :math:`\mathrm{diag}(G) = \frac1N \sum_i \sum_c
  (J_i^\top s_{ic})^{\odot 2}` from the loss's factor :math:`H_z = \sum_c s_c s_c^\top`
  (BackPACK's DiagGGN, [BackPACK]), C per-sample backward passes; the empirical Fisher's
  :math:`\mathrm{diag}(F_{\mathrm{emp}}) = \frac1N \sum_i g_i^{\odot 2}`, one; and the
  sampled-label Fisher's :math:`\frac1{NS} \sum_i \sum_s (J_i^\top \hat r_{is})^{\odot 2}`
  at the operator's own label draws, S.

Each is declared here as a diagonal estimator of ``sharp diagonal --estimator NAME``
(:func:`sharpcli.registry.declare`, kind ``"diagonal estimator"``): a function of a
:class:`DiagonalRequest`, reached through :data:`sharpcli.catalogue.DIAGONAL_ESTIMATORS`. Its
record's ``info`` holds the operator it computes by default and, where it computes only some,
those it accepts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from sharpcli import progress
from sharpcli.curvature.operators.fisher import (
    EMPIRICAL_FISHER,
    FISHER,
    FisherOperator,
    fisher_residuals,
)
from sharpcli.curvature.operators.registry import GGN, HESSIAN, OperatorRequest
from sharpcli.curvature.products.data import (
    AnalysisData,
    all_reduce_sum,
    per_sample_draws,
    to_model_batch,
)
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.exact import EXACT_MAX_PARAMS
from sharpcli.curvature.trace.ggn import CHUNK_BYTES, functional_logits, vmapped_or_looped
from sharpcli.curvature.trace.probes import mean_stderr, segment_sums
from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss
from sharpcli.registry import declare

__all__ = [
    "DEFAULT_DIAGONAL_ESTIMATOR",
    "EXACT",
    "GNB",
    "HUTCHINSON",
    "PER_SAMPLE",
    "DiagonalRequest",
    "DiagonalResult",
    "exact_diagonal",
    "exact_estimate",
    "gnb_diagonal",
    "gnb_estimate",
    "hutchinson_diagonal",
    "hutchinson_estimate",
    "per_sample_diagonal",
    "per_sample_estimate",
]

# the diagonal estimators' names (``sharp diagonal --estimator``), declared below in this
# order (the help's); the labels of their results
HUTCHINSON, EXACT, GNB, PER_SAMPLE = "hutchinson", "exact", "gnb", "per-sample"
DEFAULT_DIAGONAL_ESTIMATOR = HUTCHINSON


@dataclass
class DiagonalResult:
    """A diagonal estimate over a scope's flat layout.

    Attributes:
        diagonal: ``(P,)`` float64 on the CPU.
        stderr: ``(P,)`` per-entry standard errors (None: exact).
        sum_stderr: standard error of each parameter tensor's sum, then of the total
            (``len(params) + 1`` numbers; None: exact).
        estimator: its name.
        samples: probes or label draws (0 for the exact estimators).
        matvecs: products of the operator (0 for the estimators without one).
        notes: what the estimate is.
        scope: the scope whose layout ``diagonal`` follows (set by the analyses).
    """

    diagonal: torch.Tensor
    stderr: torch.Tensor | None
    sum_stderr: list[float] | None
    estimator: str
    samples: int = 0
    matvecs: int = 0
    notes: list[str] = field(default_factory=list)
    scope: ParamScope | None = None

    def tensors(self, scope: ParamScope | None = None) -> dict[str, torch.Tensor]:
        """The diagonal shaped as the scope's parameters.

        Args:
            scope: the scope it was computed on (default :attr:`scope`).

        Returns:
            ``{parameter name: tensor of its shape}`` (float64).

        Raises:
            ValueError: no scope given or known.
        """
        scope = self.scope if scope is None else scope
        if scope is None:
            raise ValueError("give the scope the diagonal was computed on")
        return {
            name: self.diagonal[a:b].reshape(shape).contiguous()
            for name, a, b, shape in zip(
                scope.names, scope.offsets[:-1], scope.offsets[1:], scope.shapes
            )
        }


def _param_blocks(scope: ParamScope) -> dict[str, slice]:
    return {n: slice(a, b) for n, a, b in zip(scope.names, scope.offsets[:-1], scope.offsets[1:])}


def _check_finite(values: torch.Tensor, what: str) -> None:
    if not torch.isfinite(values).all():
        # `what` names the diagonal: the error's source, as every numerical error has one
        raise NumericalError(f"{what} is not finite", source=what.removeprefix("the "))


def exact_diagonal(
    op, *, max_products: int, block: int = 32, instead: str = f"`estimator={HUTCHINSON}`"
) -> DiagonalResult:
    """:math:`A_{jj} = (A e_j)_j`, one product per coordinate, ``block`` columns per pass.

    Args:
        op: a P x P curvature operator.
        max_products: the products allowed; P above it is refused.
        block: identity columns per product pass.
        instead: the estimators the refusal names.

    Returns:
        The exact diagonal.

    Raises:
        UsageError: P products exceed ``max_products`` (source ``max_products``).
    """
    dim = op.shape[0]
    if dim > max_products:
        raise UsageError(
            f"the exact diagonal needs {dim} products (one per parameter in scope) but "
            f"`max_products` is {max_products}: raise it, narrow `params`, or use {instead}",
            source="max_products",
        )
    out = torch.zeros(dim, dtype=torch.float64)
    run = progress.start("exact diagonal", total=dim, unit="products", quantity="diag")
    for start in range(0, dim, block):
        stop = min(dim, start + block)
        E = torch.zeros(dim, stop - start, dtype=op.dtype, device=op.device)
        E[torch.arange(start, stop), torch.arange(stop - start)] = 1
        AE = op @ E
        out[start:stop] = AE[torch.arange(start, stop), torch.arange(stop - start)].double().cpu()
        run.update(stop)
    _check_finite(out, "the exact diagonal")
    run.finish(dim)
    return DiagonalResult(out, None, None, EXACT, matvecs=dim, notes=[f"{dim} products"])


def hutchinson_diagonal(
    op, scope: ParamScope, *, probes: int, seed: int = 0, block: int = 16
) -> DiagonalResult:
    r"""``diag(A) ~ (1/S) sum_s v_s * (A v_s)`` over S Rademacher probes ([Bekas2007]).

    Args:
        op: a P x P curvature operator on ``scope``'s layout.
        scope: the parameters (probes are drawn by its :meth:`~ParamScope.rademacher`).
        probes: S, at least 2 (the standard errors need two).
        seed: seeds the probes.
        block: probes per product pass.

    Returns:
        The estimate with per-entry standard errors and those of each parameter's sum.

    Raises:
        UsageError: fewer than 2 probes (source ``probes``).
    """
    if int(probes) < 2:
        raise UsageError(f"probes must be >= 2 for standard errors, got {probes}", source="probes")
    generator = torch.Generator().manual_seed(int(seed))
    blocks = _param_blocks(scope)
    first = torch.zeros(op.shape[0], dtype=torch.float64)
    second = torch.zeros_like(first)
    sums = []  # per probe: the total and each parameter's sum
    run = progress.start("Hutchinson diagonal", total=probes, unit="probes", quantity="diag")
    done = 0
    while done < probes:
        k = min(block, probes - done)
        V = scope.rademacher(generator, columns=k)
        values = (V * (op @ V)).double().cpu()  # (P, k): v_j (A v)_j per probe
        first += values.sum(1)
        second += values.square().sum(1)
        sums.append(segment_sums(values, blocks))
        done += k
        run.update(done)
    S = float(probes)
    mean = first / S
    stderr = ((second - S * mean.square()).clamp_min(0) / (S - 1) / S).sqrt()
    _check_finite(mean, "the Hutchinson diagonal")
    _, sum_err = mean_stderr(torch.cat(sums, dim=1).T)
    run.finish(probes)
    return DiagonalResult(
        mean,
        stderr,
        [float(e) for e in sum_err[1:]] + [float(sum_err[0])],
        HUTCHINSON,
        samples=int(probes),
        matvecs=int(probes),
        notes=[f"{probes} Rademacher probes"],
    )


def _sums_result(draws: torch.Tensor, scope: ParamScope, estimator: str, note: str):
    """A :class:`DiagonalResult` from ``(S, P)`` independent draws of the diagonal."""
    S = draws.shape[0]
    mean, stderr = mean_stderr(draws)
    _check_finite(mean, f"the {estimator} diagonal")
    _, sum_err = mean_stderr(segment_sums(draws.T, _param_blocks(scope)).T)
    return DiagonalResult(
        mean,
        stderr,
        [float(e) for e in sum_err[1:]] + [float(sum_err[0])],
        estimator,
        samples=S,
        notes=[note],
    )


@twice_differentiable()
def gnb_diagonal(
    model: nn.Module, data: AnalysisData, scope: ParamScope, *, samples: int, seed: int = 0
) -> DiagonalResult:
    r"""Sophia's Gauss-Newton-Bartlett estimate of ``diag(G)`` ([Sophia] Algorithm 2).

    Per batch and draw, one backward pass of :math:`\sum_i \langle z_i, \hat r_i \rangle`
    (:math:`\hat r_i = \partial l(z_i, \hat y_i) / \partial z_i`) gives
    :math:`u_b = B_b \hat g`, and the draw's estimate is :math:`\frac1N \sum_b u_b^{\odot 2}`,
    i.e. Sophia's :math:`B \hat g^{\odot 2}` with the batch weight :math:`B_b / N`.

    Args:
        model: the model.
        data: the analysis set (a loss with a predictive distribution).
        scope: the parameters.
        samples: label draws, at least 2 (standard errors over the draws).
        seed: seeds the draws.

    Returns:
        The mean over the draws, with standard errors over them.

    Raises:
        UsageError: fewer than 2 draws, or a loss without a predictive distribution.
    """
    S = int(samples)
    if S < 2:
        raise UsageError(f"probes must be >= 2 for standard errors, got {samples}", source="probes")
    loss = get_loss(data.loss)
    if loss.sampler is None:
        raise UsageError(
            f"the GNB estimator draws labels; the loss {data.loss!r} has no predictive distribution",
            source="estimator",
        )
    draws = torch.zeros(S, scope.numel, dtype=torch.float64, device=scope.device)
    first = data.shard_start
    run = progress.start("GNB diagonal", total=data.num_batches, unit="batches", quantity="diag")
    for index, (x_b, y_b, _) in enumerate(data.batches()):
        run.update(index)
        x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
        with torch.enable_grad():
            z = model(x_b)
            tail = tuple(loss.label_noise_shape(z)[1:])
            assert loss.sampler is not None
            noise = per_sample_draws(seed, first, first + z.shape[0], S, loss.sampler.noise, tail)
            for s in range(S):
                labels = loss.labels_from_noise(z, noise[s], y_b)
                r = fisher_residuals(data.loss, z, labels, y_b)
                grads = torch.autograd.grad(
                    (z * r).sum(), scope.params, retain_graph=s < S - 1, allow_unused=True
                )
                flat = scope.flatten(
                    [torch.zeros_like(p) if g is None else g for p, g in zip(scope.params, grads)]
                )
                draws[s] += flat.to(torch.float64).square()
        first += z.shape[0]
    all_reduce_sum(draws)
    draws = draws.cpu() / data.num_samples
    run.finish(data.num_batches)
    note = f"Sophia's GNB estimator, {S} label draws, batches of {data.batch_size}"
    return _sums_result(draws, scope, GNB, note)


@twice_differentiable()
def per_sample_diagonal(
    model: nn.Module,
    data: AnalysisData,
    scope: ParamScope,
    *,
    operator: str,
    max_products: int,
    fisher: FisherOperator | None = None,
) -> DiagonalResult:
    r"""Exact ``diag(G)`` (BackPACK's DiagGGN, [BackPACK]), ``diag(F_emp)`` or ``diag(F)`` from
    per-sample gradients.

    .. math::

        \mathrm{diag}(G) = \frac1N \sum_i \sum_c (J_i^\top s_{ic})^{\odot 2}, \qquad
        \mathrm{diag}(F_{\mathrm{emp}}) = \frac1N \sum_i (J_i^\top r_i)^{\odot 2}

    with :math:`H_{z,i} = \sum_c s_{ic} s_{ic}^\top` the loss's factor and :math:`r_i` the
    per-sample loss's output gradient; for the sampled-label Fisher ``fisher`` the directions
    are :math:`\hat r_{is} / \sqrt S`, the output gradients at its S label draws per sample
    (:meth:`~sharpcli.curvature.operators.fisher.FisherOperator.labels`), so the diagonal is that of the
    matrix whose products the operator takes. Each :math:`J_i^\top s` is a per-sample gradient
    (``vmap(grad)``, per sample when vmap fails).

    Args:
        model: the model.
        data: the analysis set.
        scope: the parameters.
        operator: ``ggn``, ``ef`` or ``fisher``.
        max_products: the factor's columns per sample allowed (backward passes per sample).
        fisher: the Fisher operator whose label draws to use (``operator="fisher"``).

    Returns:
        The exact diagonal.

    Raises:
        UsageError: another operator, or more factor columns than ``max_products``.
    """
    from torch.func import grad

    if operator not in (GGN, EMPIRICAL_FISHER, FISHER) or (operator == FISHER) != (
        fisher is not None
    ):
        raise UsageError(
            f"the per-sample estimator gives the ggn, ef and fisher diagonals, not {operator!r}",
            source="operator",
        )
    loss = get_loss(data.loss)
    logits = functional_logits(model, list(scope.names))

    def along(params, x_single, s_single):
        return (logits(params, x_single) * s_single).sum()

    per_sample_grad = vmapped_or_looped(grad(along), in_dims=(None, 0, 0))
    params = tuple(p.detach() for p in scope.params)
    total = torch.zeros(scope.numel, dtype=torch.float64, device=scope.device)
    columns_seen = 0
    run = progress.start("per-sample diagonal", total=data.num_batches, unit="batches")
    for index, (x_b, y_b, _) in enumerate(data.batches()):
        run.update(index)
        x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
        with torch.no_grad():
            z = model(x_b)
        if operator == EMPIRICAL_FISHER:
            leaf = z.detach().requires_grad_(True)
            with torch.enable_grad():
                columns = list(torch.autograd.grad(loss.per_sample(leaf, y_b).sum(), leaf))
        elif fisher is not None:
            scale = 1.0 / math.sqrt(fisher.samples)
            columns = [
                fisher_residuals(data.loss, z, labels, y_b) * scale
                for labels in fisher.labels(index, z)
            ]
        else:
            columns = list(loss.ggn_factor(z, y_b))
        columns_seen = max(columns_seen, len(columns))
        if len(columns) > max_products:
            raise UsageError(
                f"the per-sample {operator} diagonal needs {len(columns)} backward passes per "
                f"sample (the loss's output directions) but `max_products` is {max_products}: "
                "raise it or use `estimator=gnb`",
                source="max_products",
            )
        rows = max(1, CHUNK_BYTES // max(1, scope.numel * z.element_size()))
        for s in columns:
            for start in range(0, x_b.shape[0], rows):
                stop = start + rows
                g = per_sample_grad(params, x_b[start:stop], s[start:stop].to(z.dtype))
                total += (
                    torch.cat([t.reshape(t.shape[0], -1) for t in g], dim=1)
                    .square()
                    .sum(0)
                    .to(torch.float64)
                )
    all_reduce_sum(total)
    diagonal = total.cpu() / data.num_samples
    _check_finite(diagonal, f"the per-sample {operator} diagonal")
    run.finish(data.num_batches)
    what = {GGN: "DiagGGN", FISHER: f"{fisher.samples if fisher else 0} label draw(s)"}.get(
        operator, "squared per-sample gradients"
    )
    note = f"exact {operator} diagonal ({what}), {columns_seen} backward pass(es) per sample"
    return DiagonalResult(diagonal, None, None, PER_SAMPLE, notes=[note])


@dataclass(frozen=True)
class DiagonalRequest(OperatorRequest):
    """What ``sharp diagonal --estimator NAME`` is asked: ``diag(A)`` of a registered operator.

    Attributes:
        probes: Rademacher probes (hutchinson) or label draws (gnb).
        max_products: the products the exact estimator may spend, or the backward passes per
            sample the per-sample one may.
        seed: seeds the probes or draws.
    """

    probes: int = 100
    max_products: int = EXACT_MAX_PARAMS
    seed: int = 0


@declare(
    "diagonal estimator",
    HUTCHINSON,
    "mean of v * (A v) over Rademacher probes, per-entry standard errors",
    paper="Bekas2007",
    info={"default": True, "operator": HESSIAN},
)
def hutchinson_estimate(request: DiagonalRequest) -> DiagonalResult:
    """:func:`hutchinson_diagonal` of any operator.

    Args:
        request: the operator, the probes and their seed.

    Returns:
        The estimate with its standard errors.
    """
    scope = request.engine.scope
    return hutchinson_diagonal(request.build(), scope, probes=request.probes, seed=request.seed)


@declare(
    "diagonal estimator",
    EXACT,
    "(A e_j)_j, one product per parameter (small scopes)",
    info={"operator": HESSIAN},
)
def exact_estimate(request: DiagonalRequest) -> DiagonalResult:
    """:func:`exact_diagonal` of any operator; its refusal names ``per-sample`` too where that
    gives the same diagonal without products (``ggn``, ``ef``, ``fisher``).

    Args:
        request: the operator and the products allowed.
    """
    instead = f"`estimator={HUTCHINSON}`"
    if request.operator in (GGN, EMPIRICAL_FISHER, FISHER):
        instead += f" (or `estimator={PER_SAMPLE}`, exact without products)"
    return exact_diagonal(request.build(), max_products=request.max_products, instead=instead)


@declare(
    "diagonal estimator",
    GNB,
    "Sophia's Gauss-Newton-Bartlett B g^2 at sampled labels (ggn)",
    paper="Sophia",
    info={"operator": GGN, "accepts": (GGN,)},
)
def gnb_estimate(request: DiagonalRequest) -> DiagonalResult:
    """:func:`gnb_diagonal`: ``diag(G)`` from label draws.

    Args:
        request: the pass, the draws and their seed.

    Returns:
        The estimate with its standard errors.
    """
    engine = request.engine
    return gnb_diagonal(
        engine.model, engine.data, engine.scope, samples=request.probes, seed=request.seed
    )


@declare(
    "diagonal estimator",
    PER_SAMPLE,
    "squared per-sample gradients: exact ggn (DiagGGN), ef or fisher diagonal",
    paper="BackPACK",
    info={"operator": GGN, "accepts": (GGN, EMPIRICAL_FISHER, FISHER)},
)
def per_sample_estimate(request: DiagonalRequest) -> DiagonalResult:
    """:func:`per_sample_diagonal`: the exact ``diag(G)``, ``diag(F_emp)`` or ``diag(F)`` (the
    sampled-label Fisher at the operator's own draws).

    Args:
        request: the pass, the operator and the backward passes allowed per sample.
    """
    engine, r = request.engine, request
    fisher = None
    if r.operator == FISHER:
        op = r.build()
        if not isinstance(op, FisherOperator):
            raise UsageError(
                f"the per-sample estimator needs sharp's own {FISHER} operator, not an extension "
                "registered under its name",
                source="operator",
            )
        fisher = op
    return per_sample_diagonal(
        engine.model,
        engine.data,
        engine.scope,
        operator=r.operator,
        max_products=r.max_products,
        fisher=fisher,
    )
