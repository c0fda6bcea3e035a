"""Spectrum questions: eigenvalues, traces, Tr(A^2), spectral density, the GN/NME split.

Each function takes a :class:`~sharpcli.session.Session` and returns the
``results`` dict of its command's JSON report (docs/json.md). All products go
through one :class:`~sharpcli.curvature.CurvatureEngine` per call, so H, G and N
share their cached first-order graphs.

Operators ([NME] eq. 2; docs/commands/gn-nme.md), looked up by their ``operator`` name in
:mod:`sharpcli.curvature.operators.registry`: ``H`` the Hessian of the analysis loss, ``G = J^T H_z J``
the Gauss-Newton matrix, ``N = H - G = sum_c (dl/dz_c) d^2 z_c / dtheta^2`` the nonlinear
modeling error, and any operator registered there.
"""

from __future__ import annotations

import math

import torch

from sharpcli import catalogue, memory, phases, progress
from sharpcli.analyses.data_advice import annotate_eigen, annotate_trace
from sharpcli.analyses.hvp import (
    FINITE_DIFFERENCE,
    add_hvp_record,
    finite_difference_engine,
    hvp_and_fallback,
)
from sharpcli.catalogue import EXACT_HVP, GGN_EXACT, GGN_HUTCHINSON, GGN_SAMPLED
from sharpcli.catalogue.values import TRACE_KEY
from sharpcli.curvature import (
    CurvatureEngine,
    exact_ggn_trace,
    lanczos,
    power_iteration,
    sampled_label_ggn_trace,
)
from sharpcli.curvature.density import spectral_density
from sharpcli.curvature.eigen.data_error import eigen_data_error
from sharpcli.curvature.eigen.lanczos import DEFAULT_MAX_MATVECS, WHICH
from sharpcli.curvature.eigen.ritz import EigenResult
from sharpcli.curvature.operators.hessian import DEFAULT_CACHE_BYTES
from sharpcli.curvature.operators.registry import (
    GGN,
    HESSIAN,
    NME,
    OPERATORS,
    SPLIT,
    build_operator,
    operator_spec,
)
from sharpcli.curvature.trace.estimators import DEFAULT_ESTIMATOR, TraceRequest, trace_estimator
from sharpcli.curvature.trace.probes import TraceResult
from sharpcli.curvature.trace.split import gn_nme_split
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss
from sharpcli.parity import pyhessian_eigenvalues, pyhessian_trace

METHODS = catalogue.METHODS
ENGINES = catalogue.ENGINES


def check_choice(value: str, accepted: tuple, parameter: str) -> str:
    """``value`` if it is one of ``accepted``; else a UsageError on ``parameter`` listing them."""
    if value not in accepted:
        raise UsageError(
            f"unknown value {value!r}; accepted: {', '.join(accepted)}", source=parameter
        )
    return value


def curvature_engine(
    session,
    params: str | None,
    hvp: str = EXACT_HVP,
    fsdp: bool = False,
    fallback: bool = False,
):
    """The curvature engine (H and G products with cached graphs) over the session's analysis set;
    with ``hvp="finite-difference"`` Hessian products by differences of gradients instead
    (:mod:`sharpcli.analyses.hvp`). ``fallback``: where the memory budget does not hold the
    exact product's workspace but holds the finite-difference one's, the latter, its engine's
    ``refused_exact`` saying why (the report's ``hvp.by_budget`` and note)."""
    if hvp == FINITE_DIFFERENCE:
        engine = finite_difference_engine(session, params, fsdp)
        phases.mark(phases.FIRST_GRAPH)
        return engine
    scope = session.scope(params)
    auto = session.cache_bytes is None  # no `cache_mb` given: as large as the budget allows
    engine = CurvatureEngine(
        session.model,
        session.analysis_data(),
        scope,
        cache_bytes=DEFAULT_CACHE_BYTES if auto else session.cache_bytes,
    )
    if not fallback:
        engine.plan_memory(memory.current(), auto_cache=auto)  # builds the first graph
        phases.mark(phases.FIRST_GRAPH)
        return engine
    chosen = _exact_or_finite_difference(session, params, engine, auto)
    phases.mark(phases.FIRST_GRAPH)
    return chosen


# the plan item of the exact product's first graph, built to plan it and freed (measured)
EXACT_TRIED = "exact product's first graph, built to plan it and freed"


def _plan_state(plan) -> tuple:
    """What planning an engine changes in ``plan``, to be put back (:func:`_restore_plan`)."""
    return dict(plan.items), dict(plan.held), plan.planned_peak, list(plan.choices)


def _restore_plan(plan, state: tuple) -> None:
    plan.items, plan.held = dict(state[0]), dict(state[1])
    plan.planned_peak, plan.choices = state[2], list(state[3])


def _exact_or_finite_difference(session, params: str | None, exact, auto: bool):
    """``exact`` (a :class:`~sharpcli.curvature.CurvatureEngine`) planned in the run's budget,
    or, where the budget does not hold its product's workspace (its first-order graph and
    about as much again for the double backward) but holds the finite-difference product's
    (four parameter-sized vectors and one batch's forward activations), a
    :class:`~sharpcli.curvature.products.finite_difference.FiniteDifferenceEngine` whose
    ``refused_exact`` says why. The exact product's check leaves out a first graph it keeps
    cached; a workspace that then takes the plan past the budget does not fit either.
    Neither fitting: the exact product's refusal (UsageError on ``max_memory``), or the exact
    engine as planned when only the cached graph's part was past the budget.

    Planning the exact product builds its first graph, freed before the finite-difference
    product is planned; that moment is counted in the plan's peak as measured (the resident
    set's high-water mark where it rose while the graph was built, else the resident set
    with the graph held), as the item :data:`EXACT_TRIED`."""
    plan = memory.current()
    before = _plan_state(plan)
    held_before = plan.in_use
    high_before = memory.peak_rss_bytes()
    refusal: UsageError | None = None
    try:
        exact.plan_memory(plan, auto_cache=auto)  # builds the first graph
    except UsageError as exc:
        if exc.source != "max_memory":
            raise
        refusal = exc
    if refusal is None and plan.in_use <= plan.budget:
        return exact
    workspace = plan.held.get(memory.PRODUCT_WORKSPACE, 0)
    planned = _plan_state(plan)
    high = memory.peak_rss_bytes()
    tried = (high if high > high_before else memory.rss_bytes()) - held_before
    exact.clear_cache()  # its graphs are built again at the first product if it stays
    _restore_plan(plan, before)
    with plan.hold(EXACT_TRIED, max(0, tried)):
        pass
    try:
        fd = finite_difference_engine(session, params)
    except UsageError:
        if refusal is not None:
            raise refusal from None  # neither fits: the refusal of the product asked for
        _restore_plan(plan, planned)
        return exact
    fd.refused_exact = (
        str(refusal).split("; ")[0]
        if refusal is not None
        else f"one batch's Hessian product (its first-order graph and double backward) needs "
        f"{memory.format_bytes(workspace)} but the memory budget "
        f"({memory.format_bytes(plan.budget)}, {plan.stated}) leaves "
        f"{memory.format_bytes(max(plan.budget - held_before, 0))} after "
        f"{memory.format_bytes(held_before)} already held"
    )
    plan.note("exact Hessian products do not fit the budget: central differences of gradients")
    return fd


def operator_of(engine, operator: str):
    """The registered operator ``operator`` on ``engine``; UsageError naming the accepted ones."""
    return build_operator(operator, engine)


def _symbol(operator: str) -> str:
    """The operator's letter (``H``) for progress labels; its name when it is not registered
    (the analysis then fails with the accepted names)."""

    spec = OPERATORS.get(operator)
    return spec.symbol if spec is not None else operator


def scope_info(scope) -> dict:
    """``results.scope``: names, size, layers, and which frozen parameters are in or out."""
    return scope.info()


def eigen(
    session,
    *,
    operator: str = HESSIAN,
    top_k: int = 1,
    which: str = "largest",
    method: str = "lanczos",
    tol: float = 1e-3,
    max_matvecs: int | None = None,
    params: str | None = None,
    engine: str = "native",
    seed: int | None = None,
    hvp: str | None = EXACT_HVP,
    fsdp: bool = False,
    data_error: bool = True,
) -> dict:
    """Top-k (largest, smallest or both ends) eigenvalues with Ritz residuals and converged
    flags; ``hvp``, ``fsdp``: how the products are taken (:mod:`sharpcli.analyses.hvp`;
    None: exact, or finite differences where the budget holds only theirs);
    ``data_error``: each eigenvalue's error over the data's samples (:func:`eigen_result`)."""
    check_choice(method, METHODS, "method")
    check_choice(engine, ENGINES, "engine")
    hvp, fallback = hvp_and_fallback(hvp, operator=operator, fsdp=fsdp, engine=engine)
    seed = session.seed if seed is None else seed
    if engine == "pyhessian":
        if operator != HESSIAN:
            raise UsageError("the pyhessian engine computes only the Hessian", source="engine")
        if which != "largest":
            raise UsageError(
                "the pyhessian engine finds only the largest |eigenvalue|s", source="engine"
            )
        result = pyhessian_eigenvalues(
            session.model,
            session.analysis_data(),
            top_k=top_k,
            tol=tol,
            max_matvecs=max_matvecs or 100,
            seed=seed,
            params=params,
        )
        out = result.to_dict()
        out.update(operator=operator, scope=scope_info(session.scope(params)))
        return out
    # ``engine`` is the implementation's name (``--engine``): this is the native one's engine
    native = curvature_engine(session, params, hvp, fsdp, fallback)
    result = eigen_result(
        native,
        operator,
        top_k=top_k,
        which=which,
        method=method,
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
        data_error=data_error,
    )
    phases.mark(phases.PRODUCTS)
    out = annotate_eigen(result.to_dict(), native.data.num_samples, _symbol(operator))
    out.update(operator=operator, scope=scope_info(native.scope))
    if which != "largest":
        _note_rank_bound(out, operator_spec(operator), session, native.scope.numel)
    return add_hvp_record(out, native)


def eigen_result(
    engine,
    operator: str = HESSIAN,
    *,
    top_k: int = 1,
    which: str = "largest",
    method: str = "lanczos",
    tol: float = 1e-3,
    max_matvecs: int | None = None,
    seed: int = 0,
    return_eigenvectors: bool = False,
    data_error: bool = True,
) -> EigenResult:
    """The ``top_k`` extreme eigenvalues of the registered operator ``operator`` on ``engine``.

    The one dispatch behind ``sharp eigen`` (:func:`eigen`) and
    :meth:`sharpcli.api.Curvature.eigenvalues`: Lanczos ([Lanczos1950]) for the largest,
    smallest or both ends, or power iteration ([PyHessian]) for the largest only.

    Args:
        engine: The :class:`~sharpcli.curvature.CurvatureEngine` whose products to use.
        operator: A registered operator name (:mod:`sharpcli.curvature.operators.registry`).
        top_k: Eigenvalues per end.
        which: ``largest``, ``smallest`` or ``both``.
        method: ``lanczos`` or ``power``.
        tol: The relative residual each Ritz pair must reach.
        max_matvecs: The products allowed (None: the method's default).
        seed: Seed of the start vector.
        return_eigenvectors: Keep the Ritz vectors in the result.
        data_error: Add each eigenvalue's data standard error (one product per eigenvalue,
            :func:`with_data_error`).

    Returns:
        The :class:`~sharpcli.curvature.EigenResult`.
    """

    check_choice(method, METHODS, "method")
    check_choice(which, WHICH, "which")
    op = operator_of(engine, operator)
    if method == "power":
        if which != "largest":
            raise UsageError(
                "power iteration finds the largest |eigenvalue|s only; use `method=lanczos`",
                source="which",
            )
        with progress.phase(f"eigen {_symbol(operator)}"):
            result = power_iteration(
                op,
                top_k=top_k,
                tol=tol,
                max_matvecs=max_matvecs or 100,
                seed=seed,
                return_eigenvectors=return_eigenvectors or data_error,
            )
        return with_data_error(op, result, data_error, return_eigenvectors)
    dim = engine.scope.numel
    budget = min(dim, int(max_matvecs or DEFAULT_MAX_MATVECS))
    wanted = min(int(top_k) * (2 if which == "both" else 1), dim)
    if wanted > budget:
        # a Krylov space of dimension m holds at most m Ritz values: refuse rather than
        # return fewer eigenvalues than asked, none converged
        raise UsageError(
            f"`top_k={top_k}` asks for {wanted} eigenvalues but a Krylov space of {budget} "
            f"products (`max_matvecs`) holds at most {budget}; lower `top_k` or raise "
            "`max_matvecs`",
            source="top_k",
        )
    # the explicit residuals' product of the returned vectors is the data error's product too:
    # its per-batch forms are recorded there, sparing one product per eigenvalue, and the
    # vectors themselves are not needed after it (Lanczos checks its residuals explicitly
    # where the products are narrower than float64: there, returned vectors would be float64
    # copies, two P-vectors of float32 more at the run's end)
    recorded: list = []
    checked = op.dtype != torch.float64  # lanczos's explicit_residuals default
    with progress.phase(f"eigen {_symbol(operator)}"):
        result = lanczos(
            op,
            top_k=top_k,
            which=which,
            tol=tol,
            max_matvecs=max_matvecs,
            seed=seed,
            return_eigenvectors=return_eigenvectors or (data_error and not checked),
            batch_forms=recorded if data_error else None,
        )
    return with_data_error(
        op, result, data_error, return_eigenvectors, recorded[0] if recorded else None
    )


def with_data_error(
    op, result: EigenResult, wanted: bool, keep_vectors: bool, recorded=None
) -> EigenResult:
    """``result`` with each eigenvalue's data standard error (``wanted``), its vectors kept
    only when ``keep_vectors``.

    Batch means of the Rayleigh quotients ``u^T A_b u`` (first order,
    :mod:`sharpcli.curvature.eigen.data_error`): one product of the eigenvectors' block,
    counted in ``data_matvecs``, or none where ``recorded`` holds the per-batch forms of the
    residual check's product of the same vectors. A note where two eigenvalues are closer than twice their
    data errors (the first order is then rough, and their order is not resolved by the data).
    """
    vectors = result.eigenvectors
    if wanted and (recorded is not None or (vectors is not None and vectors.shape[1])):
        error = eigen_data_error(op, vectors, recorded)
        if error is not None:
            result.data_stderr, result.data_method = error.stderr, error.method
            result.data_matvecs = error.matvecs
            values, errors = result.eigenvalues, error.stderr
            for i in range(len(values) - 1):
                e1, e2 = errors[i], errors[i + 1]
                if (
                    e1 is not None
                    and e2 is not None
                    and abs(values[i] - values[i + 1]) < 2 * math.hypot(e1, e2)
                ):
                    result.notes.append(
                        f"eigenvalues {i + 1} and {i + 2} differ by less than twice their data "
                        "error: which is which is not resolved by the data, and their first-order "
                        "errors are rough"
                    )
                    break
    if not keep_vectors:
        result.eigenvectors = None
    return result


def _note_rank_bound(out: dict, spec, session, numel: int) -> None:
    """Note a null space the operator's rank bound proves (e.g. G: rank <= N * rank(H_z)).

    Lanczos counts the repeated 0 among the smallest eigenvalues by deflated restarts
    (:mod:`sharpcli.curvature.eigen.lanczos`); the bound says how many copies there are at least.
    """
    if spec.rank_bound is None:
        return
    rank_bound = spec.rank_bound(session.num_samples, session.num_outputs, session.loss)
    if rank_bound < numel:
        out.setdefault("notes", []).append(
            f"{spec.symbol} has rank <= {rank_bound} < {numel} parameters: 0 is an eigenvalue "
            f"of multiplicity >= {numel - rank_bound}"
        )


def trace(
    session,
    *,
    operator: str = HESSIAN,
    estimator: str = DEFAULT_ESTIMATOR,
    tol: float = 1e-2,
    max_matvecs: int = 1000,
    square: bool = False,
    params: str | None = None,
    engine: str = "native",
    seed: int | None = None,
    hvp: str | None = EXACT_HVP,
    fsdp: bool = False,
) -> dict:
    """``tr(A)`` (or ``Tr(A^2)`` with ``square``) with standard error and per-layer (diagonal
    block) traces; ``hvp``, ``fsdp``: how the products are taken (:mod:`sharpcli.analyses.hvp`;
    None: exact, or finite differences where the budget holds only theirs)."""
    catalogue.ESTIMATORS.entry(estimator, source="estimator")  # an unknown name before any work
    check_choice(engine, ENGINES, "engine")
    hvp, fallback = hvp_and_fallback(
        hvp, operator=operator, fsdp=fsdp, estimator=estimator, engine=engine
    )
    seed = session.seed if seed is None else seed
    if engine == "pyhessian":
        if operator != HESSIAN or square:
            raise UsageError("the pyhessian engine computes only tr(H)", source="engine")
        result = pyhessian_trace(
            session.model,
            session.analysis_data(),
            tol=tol,
            max_matvecs=max_matvecs,
            seed=seed,
            params=params,
        )
        return _trace_report(result, operator, square, session.scope(params), None)
    # ``engine`` is the implementation's name (``--engine``): this is the native one's engine
    native = curvature_engine(session, params, hvp, fsdp, fallback)
    result = trace_result(
        native,
        operator,
        estimator=estimator,
        square=square,
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
    )
    phases.mark(phases.PRODUCTS)
    return _trace_report(result, operator, square, native.scope, native)


def _stderr_of(error) -> float | None:
    """A data error's standard error (None without one)."""
    return None if error is None else error.stderr


def _data_fields(error) -> dict:
    """``data_stderr``, ``data_method``, ``data_batches``, ``data_samples`` of a data error
    (all None without one), as a trace result's dict has them."""
    if error is None:
        return dict.fromkeys(("data_stderr", "data_method", "data_batches", "data_samples"))
    return {
        "data_stderr": error.stderr,
        "data_method": error.method,
        "data_batches": error.batches,
        "data_samples": error.samples,
    }


def _trace_report(result, operator: str, square: bool, scope, engine) -> dict:
    """The ``results`` of :func:`trace`: the estimate, its per-layer traces, the scope and
    (``engine`` not None) the products' ``hvp`` record."""
    d = result.to_dict()
    symbol = _symbol(operator)
    annotate_trace(d, f"Tr({symbol}^2)" if square else f"tr({symbol})", result.tol or 1e-2)
    by_layer = d.pop("by_layer")
    out = {
        TRACE_KEY: d,
        "by_layer": by_layer,
        "operator": operator,
        "square": square,
        "scope": scope_info(scope),
    }
    return add_hvp_record(out, engine)


def trace_result(
    engine,
    operator: str = HESSIAN,
    *,
    estimator: str = DEFAULT_ESTIMATOR,
    square: bool = False,
    tol: float = 1e-2,
    max_matvecs: int = 1000,
    seed: int = 0,
) -> TraceResult:
    """``tr(A)`` of the registered operator ``operator`` on ``engine``, or ``Tr(A^2)``.

    The one dispatch behind ``sharp trace`` (:func:`trace`) and
    :meth:`sharpcli.api.Curvature.trace`: the registered trace estimator ``estimator``
    (:mod:`sharpcli.curvature.trace.estimators`: ``hutchpp`` [Hutch++], ``hutchinson``
    [Hutchinson1989], ``exact`` (every operator by its cheapest exact route,
    :mod:`sharpcli.curvature.trace.exact`), ``gn-split`` (tr(H) as exact tr(G) plus an estimated
    tr(N)), or an extension) on the registered operator ``operator``.

    Args:
        engine: The :class:`~sharpcli.curvature.CurvatureEngine` whose products to use.
        operator: A registered operator name.
        estimator: A registered trace estimator name.
        square: Estimate ``Tr(A^2)`` instead.
        tol: The relative standard error to stop at.
        max_matvecs: The products allowed.
        seed: Seed of the probes.

    Returns:
        The :class:`~sharpcli.curvature.TraceResult`.
    """
    estimate = trace_estimator(estimator)
    symbol = _symbol(operator)
    with progress.phase(f"Tr({symbol}^2)" if square else f"tr({symbol})"):
        return estimate(TraceRequest(engine, operator, square, tol, max_matvecs, seed))


def density(
    session,
    *,
    operator: str = HESSIAN,
    probes: int = 4,
    steps: int = 64,
    grid_points: int = 512,
    broadening: float | None = None,
    params: str | None = None,
    seed: int | None = None,
    hvp: str | None = EXACT_HVP,
    fsdp: bool = False,
) -> dict:
    """Spectral density by stochastic Lanczos quadrature ([Ghorbani2019]), Gaussian-broadened;
    ``hvp``, ``fsdp``: how the products are taken (:mod:`sharpcli.analyses.hvp`; None: exact,
    or finite differences where the budget holds only theirs)."""
    hvp, fallback = hvp_and_fallback(hvp, operator=operator, fsdp=fsdp)
    seed = session.seed if seed is None else seed
    engine = curvature_engine(session, params, hvp, fsdp, fallback)
    op = operator_of(engine, operator)
    with progress.phase(f"density {_symbol(operator)}"):
        result = spectral_density(
            op,
            probes=probes,
            steps=steps,
            grid_points=grid_points,
            broadening=broadening,
            seed=seed,
        )
    phases.mark(phases.PRODUCTS)
    out = result.to_dict()
    nodes = [t for probe in result.nodes for t in probe]
    out.update(lambda_min=min(nodes), lambda_max=max(nodes))
    out.update(operator=operator, scope=scope_info(engine.scope))
    return add_hvp_record(out, engine)


def _extremes(op, tol, max_matvecs, seed) -> dict:
    res = lanczos(op, top_k=1, which="both", tol=tol, max_matvecs=max_matvecs, seed=seed)
    return {
        "lambda_max": res.eigenvalues[0],
        "lambda_min": res.eigenvalues[-1],
        "residuals": [res.residuals[0], res.residuals[-1]],
        "converged": [res.converged[0], res.converged[-1]],
        "matvecs": res.matvecs,
    }


def gn_nme(
    session,
    *,
    tol: float = 1e-2,
    eig_tol: float = 1e-3,
    max_matvecs: int = 1000,
    params: str | None = None,
    seed: int | None = None,
    label_samples: int = 4,
    ggn_estimator: str = "auto",
) -> dict:
    """The NME paper's split (section 2): for H, G and N the trace (+- stderr), the largest and
    smallest eigenvalue and ``Tr(A^2)``; the NME share ``tr(N)/tr(H)`` and ``||N||_F/||H||_F``;
    per-layer traces; G's trace cross-checked by the exact (C backward passes) and the sampled-label
    (NME eq. 20) estimators.

    Traces and ``Tr(A^2)`` come from shared probes and joint H/G products
    (:func:`sharpcli.curvature.trace.split.gn_nme_split`), so ``tr(H) = tr(G) + tr(N)`` holds exactly
    for the estimates. ``ggn_estimator`` picks the cross-checks of tr(G)
    (:func:`ggn_check_plan`)."""
    seed = session.seed if seed is None else seed
    return gn_nme_result(
        curvature_engine(session, params),
        loss=session.loss,
        num_outputs=session.num_outputs,
        labels=session.y,
        tol=tol,
        eig_tol=eig_tol,
        max_matvecs=max_matvecs,
        seed=seed,
        label_samples=label_samples,
        ggn_estimator=ggn_estimator,
    )


def gn_nme_result(
    engine,
    *,
    loss: str,
    num_outputs: int,
    labels: torch.Tensor,
    tol: float = 1e-2,
    eig_tol: float = 1e-3,
    max_matvecs: int = 1000,
    seed: int = 0,
    label_samples: int = 4,
    ggn_estimator: str = "auto",
) -> dict:
    """The split ``H = G + N`` ([NME] eq. 2) on ``engine``: the one computation behind
    ``sharp gn-nme`` (:func:`gn_nme`) and :meth:`sharpcli.api.Curvature.gn_nme`.

    Args:
        engine: The :class:`~sharpcli.curvature.CurvatureEngine` whose products to use.
        loss: The registered loss name of the analysis set.
        num_outputs: Model outputs per sample.
        labels: The analysis set's labels (their shape plans the tr(G) cross-checks).
        tol: Relative standard error of the shared-probe traces.
        eig_tol: Relative residual of the extreme eigenvalues.
        max_matvecs: Products allowed for the traces.
        seed: Seed of the probes, start vectors and label draws.
        label_samples: Label draws per sample of the sampled-label tr(G).
        ggn_estimator: Which cross-checks of tr(G) run (:func:`ggn_check_plan`).

    Returns:
        The ``results`` of ``sharp gn-nme --json``.
    """

    with progress.phase("traces H,G,N"):
        split = gn_nme_split(engine, tol=tol, max_matvecs=max_matvecs, seed=seed)
    out: dict = {}
    total_matvecs = split.matvecs
    for name in SPLIT:
        op = operator_of(engine, name)
        with progress.phase(f"extremes {_symbol(name)}"):
            ext = _extremes(op, eig_tol, None, seed)
        tr = split.values[name][TRACE_KEY]
        fro = split.values[name]["frobenius_sq"]
        out[name] = {
            TRACE_KEY: {
                "estimate": tr["estimate"],
                "stderr": tr["stderr"],
                "matvecs": split.matvecs,
                "samples": split.samples,
                "estimator": "hutchinson (shared probes)",
                "converged": split.converged,
                **_data_fields(split.data.get(name)),
            },
            "by_layer": tr["by_layer"],
            "frobenius_sq": fro["estimate"],
            "frobenius_sq_stderr": fro["stderr"],
            # first order, from one more joint pass of a block (gn_nme_split)
            "frobenius_sq_data_stderr": _stderr_of(split.square_data.get(name)),
            **ext,
        }
        total_matvecs += ext["matvecs"]
    h, n = out[HESSIAN], out[NME]
    out["nme_share"] = (
        (n[TRACE_KEY]["estimate"] / h[TRACE_KEY]["estimate"]) if h[TRACE_KEY]["estimate"] else None
    )
    out["nme_frobenius_ratio"] = (
        math.sqrt(max(n["frobenius_sq"], 0.0) / h["frobenius_sq"]) if h["frobenius_sq"] else None
    )
    # tr(G) up to three ways: exact (every registered loss has a square-root factor of H_z),
    # by label sampling (NME eq. 20; a loss with one predictive distribution per sample), and
    # the shared probes' Hutchinson estimate; which ones run is planned from their cost
    plan = ggn_check_plan(loss, num_outputs, labels, ggn_estimator)
    checks: dict = {"estimators": plan["run"], "why": plan["why"]}
    if GGN_EXACT in plan["run"]:
        checks[GGN_EXACT] = exact_ggn_trace(engine.model, engine.data, engine.scope).estimate
    if "sampled_label" in plan["run"]:
        sampled = sampled_label_ggn_trace(
            engine.model,
            engine.data,
            engine.scope,
            samples=label_samples,
            generator=torch.Generator().manual_seed(seed),
        )
        checks.update(sampled_label=sampled.estimate, sampled_label_stderr=sampled.stderr)
    checks.update(
        hutchinson=out[GGN][TRACE_KEY]["estimate"], hutchinson_stderr=out[GGN][TRACE_KEY]["stderr"]
    )
    out["ggn_trace_check"] = checks
    out["layers"] = _layer_rows(out)
    out["scope"] = scope_info(engine.scope)
    out["matvecs"] = total_matvecs
    out["data_matvecs"] = split.data_matvecs  # Tr(A^2)'s data errors, not in matvecs
    return out


GGN_ESTIMATORS = catalogue.GGN_ESTIMATORS
EXACT_GGN_MAX_DIRECTIONS = 128  # backward passes per sample the exact tr(G) may take in `auto`


def ggn_check_plan(
    loss: str, num_outputs: int, labels: torch.Tensor, ggn_estimator: str = "auto"
) -> dict:
    """Which estimators of tr(G) :func:`gn_nme` runs, and why (``{"run": [...], "why": str}``).

    The exact trace takes one backward pass per output direction of each sample: the C classes
    of a classifier, ``T x V`` for a language model's T positions over a vocabulary of V. With
    ``auto`` it runs only up to :data:`EXACT_GGN_MAX_DIRECTIONS` directions per sample; beyond
    (token-level LMs, 1000-class heads) the sampled-label estimator ([NME] eq. 20, a few
    backward passes per sample whatever C) runs where it applies (a loss with one predictive
    distribution per sample: cross-entropy, mse, binary cross-entropy), and the shared probes'
    Hutchinson estimate of tr(G) always does. ``exact`` forces the exact trace, ``sampled``
    the sampled-label one, ``hutchinson`` neither.

    Args:
        loss: The registered loss name of the analysis set.
        num_outputs: Model outputs per sample.
        labels: The analysis set's labels (the first sample's shape counts its directions).
        ggn_estimator: ``auto``, ``exact``, ``sampled`` or ``hutchinson``.

    Returns:
        ``{"run": [estimator, ...], "why": reason}``.
    """
    check_choice(ggn_estimator, GGN_ESTIMATORS, "ggn_estimator")
    record = get_loss(loss)
    per_sample = max(1, int(labels[0].numel())) if record.softmax_per_sample else 1
    directions = int(num_outputs) * per_sample
    # the loss draws labels from one predictive distribution per sample (Loss.sample_labels)
    sampled_ok = record.sampler is not None and not record.per_token and per_sample == 1
    if ggn_estimator == GGN_EXACT:
        return {"run": [GGN_EXACT, GGN_HUTCHINSON], "why": "`ggn_estimator=exact` asked"}
    if ggn_estimator == GGN_SAMPLED:
        if not sampled_ok:
            raise UsageError(
                "the sampled-label estimator needs one predictive distribution per sample "
                "(cross-entropy, mse, binary-cross-entropy); use `ggn_estimator=hutchinson` or "
                "`exact`",
                source="ggn_estimator",
            )
        return {"run": ["sampled_label", GGN_HUTCHINSON], "why": "`ggn_estimator=sampled` asked"}
    if ggn_estimator == GGN_HUTCHINSON:
        return {"run": [GGN_HUTCHINSON], "why": "`ggn_estimator=hutchinson` asked"}
    if directions <= EXACT_GGN_MAX_DIRECTIONS:
        run = (
            [GGN_EXACT, "sampled_label", GGN_HUTCHINSON]
            if sampled_ok
            else [GGN_EXACT, GGN_HUTCHINSON]
        )
        return {"run": run, "why": f"{directions} output directions per sample: exact is cheap"}
    run = ["sampled_label", GGN_HUTCHINSON] if sampled_ok else [GGN_HUTCHINSON]
    return {
        "run": run,
        "why": (
            f"the exact trace would take {directions:,} backward passes per sample (more than "
            f"{EXACT_GGN_MAX_DIRECTIONS}); "
            + ("sampled labels (NME eq. 20) and " if sampled_ok else "")
            + "the shared probes' Hutchinson estimate ran instead; `ggn_estimator=exact` forces it"
        ),
    }


def _layer_rows(out: dict) -> list[dict]:
    rows = []
    for layer in out[HESSIAN]["by_layer"]:
        h, g, n = (out[name]["by_layer"][layer]["estimate"] for name in SPLIT)
        h_se, g_se, n_se = (out[name]["by_layer"][layer].get("stderr") for name in SPLIT)
        rows.append(
            {
                "layer": layer,
                "hessian_trace": h,
                "ggn_trace": g,
                "nme_trace": n,
                "hessian_trace_stderr": h_se,
                "ggn_trace_stderr": g_se,
                "nme_trace_stderr": n_se,
                "nme_share": n / h if h else None,
            }
        )
    return rows
