"""How a spectrum analysis takes its Hessian products: ``hvp`` and ``fsdp`` of eigen, trace, density.

``exact`` (the default): double backward through each batch's first-order graph
(:class:`~sharpcli.curvature.CurvatureEngine`). ``finite-difference``: central differences of
gradients (:class:`~sharpcli.curvature.products.finite_difference.FiniteDifferenceEngine`,
[GranziolJuarev2026], [NocedalWright2006] section 8.1), for models without a double backward
and for models sharded by FSDP2 (``fsdp``: the session's model sharded across the torchrun
ranks with ``fully_shard`` first). It gives the Hessian only.

``None`` (not asked, as the commands leave it): exact products where the memory budget holds
their workspace, finite differences where it holds only theirs (four parameter-sized vectors
beside one batch's forward activations, against the exact product's first-order graph kept
and about as much again for its double backward, :mod:`sharpcli.memory`), when finite
differences can give what is asked (the Hessian, the native engine, no Gauss-Newton
products): the report's ``hvp`` record then says so (``by_budget``) with the error bound.
"""

from __future__ import annotations

from sharpcli import catalogue, memory
from sharpcli.curvature.operators.registry import HESSIAN
from sharpcli.curvature.products.finite_difference import FiniteDifferenceEngine, shard_model
from sharpcli.curvature.trace.exact import EXACT
from sharpcli.curvature.trace.ggn import GN_SPLIT
from sharpcli.errors import UsageError

__all__ = [
    "FINITE_DIFFERENCE",
    "HVP_METHODS",
    "add_hvp_record",
    "check_hvp",
    "hvp_and_fallback",
    "finite_difference_engine",
]

HVP_METHODS = catalogue.HVP_METHODS
FINITE_DIFFERENCE = catalogue.FINITE_DIFFERENCE
EXACT_HVP = catalogue.EXACT_HVP
# an error bound above this fraction of the largest product says the products are not H
ROUGH = 1e-2
# estimators that need the exact products: gn-split the Gauss-Newton ones (tr(G) exact, then
# tr(N) by probes), exact double-backward ones (a finite-difference product is not exact)
_GGN_ESTIMATORS = (GN_SPLIT, EXACT)


def check_hvp(
    hvp: str,
    *,
    operator: str = HESSIAN,
    fsdp: bool = False,
    estimator: str | None = None,
    engine: str = "native",
) -> None:
    """Refuse what the chosen product cannot give, before any work (UsageError, exit 2).

    Args:
        hvp: ``exact`` or ``finite-difference``.
        operator: the operator asked for; the finite-difference product gives ``hessian`` only.
        fsdp: shard the model with FSDP2 (needs ``finite-difference``: a sharded model has
            no double backward).
        estimator: the trace estimator, if any (``gn-split`` and ``exact`` need G products).
        engine: ``native`` (``pyhessian`` has its own exact products).

    Raises:
        UsageError: on ``hvp`` or ``fsdp``.
    """
    if hvp not in HVP_METHODS:
        raise UsageError(f"unknown value {hvp!r}; accepted: {', '.join(HVP_METHODS)}", source="hvp")
    if hvp != FINITE_DIFFERENCE:
        if fsdp:
            raise UsageError(
                "a model sharded by FSDP has no double backward: use `hvp=finite-difference`",
                source="fsdp",
            )
        return
    if operator != HESSIAN:
        raise UsageError(
            f"the finite-difference product gives the Hessian only, not `operator={operator}`; "
            "use `hvp=exact`",
            source="hvp",
        )
    if estimator in _GGN_ESTIMATORS:
        raise UsageError(
            f"`estimator={estimator}` needs the double-backward and Gauss-Newton products of "
            "`hvp=exact`",
            source="hvp",
        )
    if engine != "native":
        raise UsageError(
            f"`engine={engine}` takes its own products; the finite-difference product needs "
            "`engine=native`",
            source="hvp",
        )


def hvp_and_fallback(
    hvp: str | None,
    *,
    operator: str = HESSIAN,
    fsdp: bool = False,
    estimator: str | None = None,
    engine: str = "native",
) -> tuple[str, bool]:
    """``hvp`` checked (:func:`check_hvp`), as the product asked and whether finite differences
    stand in where the budget does not hold the exact product's workspace.

    Args:
        hvp: ``exact``, ``finite-difference`` or None (not asked: exact, with the fallback
            when finite differences can give what is asked).
        operator, fsdp, estimator, engine: as :func:`check_hvp`.

    Returns:
        ``(hvp, fallback)``.

    Raises:
        UsageError: on ``hvp`` or ``fsdp``.
    """
    if hvp is not None:
        check_hvp(hvp, operator=operator, fsdp=fsdp, estimator=estimator, engine=engine)
        return hvp, False
    check_hvp(EXACT_HVP, operator=operator, fsdp=fsdp, estimator=estimator, engine=engine)
    try:
        check_hvp(FINITE_DIFFERENCE, operator=operator, estimator=estimator, engine=engine)
    except UsageError:
        return EXACT_HVP, False
    return EXACT_HVP, True


def finite_difference_engine(session, params: str | None, fsdp: bool = False):
    """The finite-difference engine over the session's analysis set (the model sharded by
    FSDP2 first when ``fsdp``), counted in the run's memory plan.

    Args:
        session: the analysis :class:`~sharpcli.session.Session`.
        params: the parameter scope's spec.
        fsdp: shard the model across the process group first.
    """
    if fsdp:
        shard_model(session.model)
    engine = FiniteDifferenceEngine(session.model, session.analysis_data(), session.scope(params))
    engine.plan_memory(memory.current())
    return engine


def add_hvp_record(results: dict, engine) -> dict:
    """``results`` with the ``hvp`` record of a finite-difference engine (unchanged for the
    exact one): the steps, the measured error bound and whether the model was sharded.

    Args:
        results: an analysis's results.
        engine: its engine (None: none was built).
    """
    record = getattr(engine, "bound_record", None)
    if record is None:
        return results
    by_budget = getattr(engine, "refused_exact", None)
    results["hvp"] = {
        **record(),
        "sharded": bool(engine.sharded),
        "by_budget": by_budget is not None,
    }
    relative = results["hvp"]["error_bound_relative"]
    if by_budget is not None:
        results.setdefault("notes", []).append(
            f"exact products do not fit the memory budget ({by_budget}): the Hessian "
            "products are central differences of gradients, |D v - H v| <= "
            f"{results['hvp']['error_bound']:.3g} |v|"
            + ("" if relative is None else f" ({relative:.2g} of the largest product)")
        )
    if relative is not None and relative > ROUGH:
        results.setdefault("notes", []).append(
            f"the finite-difference error bound is {relative:.2g} of the largest product "
            "measured: the gradient is not smooth at the step (kinks such as ReLU's), so "
            "these products are not the Hessian; use `hvp=exact`"
        )
    return results
