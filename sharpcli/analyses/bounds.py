"""Checks of the activation-decay bounds ([AD] Corollary 1, Theorems 2-3) and [NSO] Fig. 2's gap.

**Corollary 1** (AD section 3.1, adapted from [Delattre2024]). If ``grad L`` is H-Lipschitz and
``||grad L(theta)||_2 <= eps``, then for ``Delta ~ N(0, sigma^2 I)`` over the scope

    || grad^2 E_Delta L(theta + Delta) ||_2  <=  H erf( eps / (sqrt(2) H sigma) ).

Both ``H`` and ``eps`` are global assumptions that must hold *wherever the smoothing
reaches* (the proof adapts [Delattre2024] Theorem 2, where the smoothed classifier takes
values in the simplex at every point; here ``||grad L|| <= eps`` takes that role). Measured
here per sigma (default scope: the final layer's weight, as AD Fig. 1a), with ``m``
perturbations ``D_j``, i.e. ``points = m + 1`` points theta, theta + D_1, ..., theta + D_m:

- ``empirical``: a Monte-Carlo estimate of the left side. Since ``grad^2 E L(theta + Delta) =
  E grad^2 L(theta + Delta)``, it is ``|| (1/m) sum_j H(theta + D_j) ||_2`` with fixed
  perturbations ``D_j = sigma Z_j``, ``Z_j ~ N(0, I)`` drawn once from the seed and reused for
  every sigma (common random numbers, so the curve over sigma is smooth), computed by Lanczos on
  the averaged operator ``v -> (1/m) sum_j H(theta + D_j) v``;
- ``empirical_ci``: a percentile bootstrap over the m perturbations. Every product the Lanczos
  run makes is recorded as ``u_a^T H_j u_b`` for all recorded vectors ``u``, so a bootstrap
  replicate (perturbations resampled with replacement) is the Rayleigh-Ritz value
  ``max |eig|`` of ``(1/m) sum_j w_j U^T H_j U`` in the Krylov subspace ``U`` of the full
  average -- no further Hessian products. Within a subspace Ritz values can only underestimate
  a replicate's norm; the subspace holds the dominant directions of the average, which the
  replicates share, so the error is second order in the replicates' spread;
- ``plain_lambda_max``: the largest eigenvalue of ``H(theta)`` (what AD Fig. 1a plots).

Two readings of ``H`` and ``eps``, each with its bound, ratio and verdict (:class:`BoundRow`):

- **at theta** (AD's reading, the default verdict): ``H_at_theta``, the largest ``|eigenvalue|``
  of ``H(theta)``, and ``epsilon_at_theta``, the gradient norm at theta over the whole analysis
  set (``full``) or the mean over minibatches of the minibatch gradient norm (``minibatch``,
  what AD used: "averaging the gradient's norm near the minimum"; both kinds are reported,
  ``epsilon_full``/``epsilon_minibatch``); ``bound_at_theta``, ``ratio_at_theta``,
  ``holds_at_theta``, ``verdict_at_theta``. It fails where the smoothed curvature exceeds
  theta's (at small sigma, where ``erf = 1``) or where the gradient norm near a minimum is
  too small for the smoothing sigma (the bound collapses as sigma grows);
- **over the region** (the corollary's assumptions: ``H`` and ``eps`` bound the Hessian and
  gradient norms wherever the smoothing reaches): ``H_region`` and ``epsilon_region``, the
  largest over the ``points = m + 1`` points theta, theta + D_1, ..., theta + D_m (lower
  estimates of the suprema); ``bound_region``, ``ratio_region``, ``erf_factor_region =
  bound_region / H_region``, ``holds_region``, ``verdict_region``. ``empirical`` can never
  exceed ``H_perturbed_mean = (1/m) sum_j ||H(theta + D_j)||`` (triangle inequality), so where
  ``bound_region >= H_perturbed_mean`` -- always at small sigma, where ``erf = 1`` and the
  bound *is* the estimated ``H_region`` -- this verdict is "holds by construction" and says
  so (:func:`corollary1_verdict`).

The row's ``note`` gives the interval of the left side, both comparisons and the number of
points behind the region's ``H`` and ``eps``. ``empirical_ci`` is widened to contain
``empirical`` when the percentile interval does not.

Theorems 2 and 3 are checked in :mod:`sharpcli.analyses.theorem2`, NSO's noise stability in
:mod:`sharpcli.analyses.noise_stability`: each is a check declared there (kind ``"check"``, a
function of the :class:`CheckRun`), which :func:`bound_check` runs through
:data:`sharpcli.catalogue.CHECKS` on request.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from sharpcli import catalogue, progress
from sharpcli.analyses.perturbation import (
    AveragedOperator,
    perturbed_copy,
    spectral_norm,
    standard_normal_directions,
)
from sharpcli.curvature.operators.hessian import (
    DEFAULT_CACHE_BYTES,
    CurvatureEngine,
    CurvatureOperator,
)
from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum, to_model_batch
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.errors import NumericalError, UsageError, check_positive
from sharpcli.losses import loss_fn
from sharpcli.models.zoo import final_linear

__all__ = [
    "BoundCheckConfig",
    "BoundCheckResult",
    "BoundRow",
    "CheckRun",
    "bound_check",
    "corollary1_bound",
    "corollary1_verdict",
    "default_bound_scope",
    "gradient_norms",
]

CHECKS = catalogue.CHECKS
EPSILON_KINDS = catalogue.EPSILON_KINDS


def corollary1_bound(H: float, epsilon: float, sigma: float) -> float:
    """AD Corollary 1: ``H erf(epsilon / (sqrt(2) H sigma))`` (``0`` when ``H = 0``)."""
    if H <= 0:
        return 0.0
    return H * math.erf(epsilon / (math.sqrt(2.0) * H * sigma))


def default_bound_scope(model: nn.Module) -> str:
    """The final layer's weight (AD Fig. 1a: "Hessian is computed only w.r.t. W^(L)") as a scope spec."""

    name, _ = final_linear(model)
    return f"{name}.weight" if name else "weight"


def gradient_norms(model: nn.Module, data: AnalysisData, scope: ParamScope) -> dict:
    """``||grad L(theta)||`` over the analysis set and the mean minibatch gradient norm.

    ``full``: the norm of the gradient of ``L = (1/N) sum_i l_i`` restricted to the scope.
    ``minibatch``: ``(1/n_b) sum_b ||grad L_b||`` with ``L_b`` the mean loss of batch b
    (batches of ``data.batch_size``, the last one possibly smaller), AD section 4.1's estimate.
    """
    loss = loss_fn(data.loss)
    full = torch.zeros(scope.numel, dtype=scope.dtype, device=scope.device)
    sums = torch.zeros(2, dtype=torch.float64, device=scope.device)
    for index, (x_b, y_b, weight) in enumerate(data.batches()):
        x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
        with torch.enable_grad():
            loss_b = loss(model(x_b), y_b)
            parts = torch.autograd.grad(loss_b, scope.params, allow_unused=True)
        flat = torch.cat(
            [
                torch.zeros(s, dtype=scope.dtype, device=scope.device)
                if g is None
                else g.reshape(-1)
                for g, s in zip(parts, scope.sizes)
            ]
        )
        if not torch.isfinite(flat).all():
            raise NumericalError(
                f"gradient is not finite on batch {index}",
                source="bound-check",
            )
        full += weight * flat
        sums[0] += float(torch.linalg.vector_norm(flat))
        sums[1] += 1.0
    all_reduce_sum([full, sums])
    return {"full": float(torch.linalg.vector_norm(full)), "minibatch": float(sums[0] / sums[1])}


@dataclass
class BoundRow:
    """AD Corollary 1 at one sigma (see the module docstring): the left side and two readings.

    Every verdict key sits beside the quantities it compares, named for them:

    - at theta (AD's reading, the default verdict): ``bound_at_theta = H_at_theta erf(
      epsilon_at_theta / (sqrt(2) H_at_theta sigma))``, ``ratio_at_theta = empirical /
      bound_at_theta``, ``holds_at_theta = empirical <= bound_at_theta``, ``verdict_at_theta``
      (``holds`` or ``fails``). It can fail either way: the smoothed Hessian's norm may exceed
      the curvature measured at theta.
    - over the region (the corollary's H and eps are suprema wherever the smoothing reaches;
      here the largest over the ``points``): ``bound_region``, ``ratio_region``,
      ``holds_region``, ``verdict_region`` (``holds``, ``holds by construction`` where the
      bound is at least ``H_perturbed_mean``, which the left side cannot exceed, or ``fails``).
    """

    sigma: float
    points: int
    empirical: float
    empirical_ci: list[float]
    plain_lambda_max: float
    H_at_theta: float
    epsilon_at_theta: float
    bound_at_theta: float
    ratio_at_theta: float | None
    holds_at_theta: bool
    verdict_at_theta: str
    H_region: float
    H_perturbed_max: float
    H_perturbed_mean: float
    epsilon_region: float
    bound_region: float
    ratio_region: float | None
    erf_factor_region: float
    holds_region: bool
    verdict_region: str
    converged: bool
    matvecs: int
    note: str = ""

    def to_dict(self) -> dict:
        """JSON-ready dict (the keys of docs/json.md plus H's parts, convergence and cost)."""
        return asdict(self)


@dataclass
class BoundCheckResult:
    """Everything ``sharp bound-check`` reports: ``rows`` (docs/json.md) and, in ``checks``, what
    each check of ``--check`` found, under its key of the report's results (JSON-ready)."""

    rows: list[BoundRow]
    params: str
    num_params: int
    epsilon_kind: str
    epsilon_full: float
    epsilon_minibatch: float
    perturbations: int
    ci_level: float
    lambda_max_at_theta: float
    checks: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    matvecs: int = 0

    def to_dict(self) -> dict:
        """JSON-ready dict; the checks' keys (``theorem2``, ``noise_stability``) where they ran."""
        out = {
            "rows": [row.to_dict() for row in self.rows],
            "params": self.params,
            "num_params": self.num_params,
            "epsilon_kind": self.epsilon_kind,
            "epsilon_full": self.epsilon_full,
            "epsilon_minibatch": self.epsilon_minibatch,
            "perturbations": self.perturbations,
            "ci_level": self.ci_level,
            "lambda_max_at_theta": self.lambda_max_at_theta,
            "notes": list(self.notes),
        }
        return out | self.checks


@dataclass
class BoundCheckConfig:
    """The settings of :func:`bound_check`, with the defaults of ``sharp bound-check``.

    ``sigma``: the noise standard deviations. ``params``: a scope spec for every check;
    ``None`` (no ``--params``): the final layer's weight for Corollary 1 (AD Fig. 1a) and all
    parameters for ``noise-stability`` (NSO perturbs every weight). ``perturbations``: m, the fixed perturbations averaged for the Monte-Carlo
    smoothed Hessian. ``epsilon``: ``full`` or ``minibatch`` gradient norm. ``tol`` and
    ``max_matvecs``: Lanczos. ``bootstrap`` replicates give the ``ci_level`` percentile interval.
    ``check``: extra checks, ``theorem2`` (with ``mc_samples`` antithetic pairs per sample) and
    ``noise-stability`` (``noise_pairs`` pairs, Hutch++ ``trace_tol``/``trace_max_matvecs``).
    """

    sigma: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0])
    params: str | None = None
    perturbations: int = 8
    epsilon: str = "full"
    tol: float = 1e-3
    max_matvecs: int | None = None
    bootstrap: int = 1000
    ci_level: float = 0.95
    check: tuple[str, ...] = ()
    mc_samples: int = 256
    noise_pairs: int = 32
    trace_tol: float = 1e-2
    trace_max_matvecs: int = 300
    seed: int = 0

    def validate(self) -> None:
        """UsageError naming the field (``sigma``, ``check``, ...) of the first bad setting."""
        check_positive(self.sigma, "sigma")
        for check in self.check:
            _require(
                check in CHECKS,
                f"unknown check {check!r}; accepted: {', '.join(CHECKS)}",
                "check",
            )
        _require(
            self.epsilon in EPSILON_KINDS,
            f"unknown epsilon {self.epsilon!r}; accepted: {', '.join(EPSILON_KINDS)}",
            "epsilon",
        )
        positive_counts = (
            (self.perturbations, 1, "perturbations"),
            (self.bootstrap, 1, "bootstrap"),
        )
        for value, least, name in positive_counts:
            _require(int(value) >= least, f"must be >= {least}, got {value}", name)
        _require(0 < self.ci_level < 1, f"must be in (0, 1), got {self.ci_level:g}", "ci_level")
        for value, name in ((self.mc_samples, "mc_samples"), (self.noise_pairs, "noise_pairs")):
            _require(int(value) >= 2, f"must be >= 2, got {value}", name)
        _require(self.tol > 0, f"must be > 0, got {self.tol:g}", "tol")


def _require(condition: bool, message: str, parameter: str) -> None:
    if not condition:
        raise UsageError(message, source=parameter)


@dataclass
class _AtTheta:
    """What every sigma's Corollary 1 row shares: measured at theta, drawn once from the seed.

    ``eps``: both gradient norms (:func:`gradient_norms`); ``epsilon`` the configured one.
    ``h_theta``/``plain_lambda_max``: ``max |eig|`` and the largest eigenvalue of ``H(theta)``.
    ``Z``: the m fixed directions (P, m). ``weights``: the bootstrap's resampling weights (B, m).
    """

    eps: dict
    epsilon: float
    h_theta: float
    plain_lambda_max: float
    Z: torch.Tensor
    weights: torch.Tensor
    matvecs: int


def _measure_at_theta(
    model: nn.Module, data: AnalysisData, scope: ParamScope, config: BoundCheckConfig
) -> _AtTheta:
    """Gradient norms and Hessian spectral norm at theta, perturbation directions, bootstrap weights."""
    m = int(config.perturbations)
    eps = gradient_norms(model, data, scope)
    base_h = CurvatureEngine(model, data, scope).hessian()
    h_theta, plain_lambda_max, _ = spectral_norm(
        base_h, tol=config.tol, max_matvecs=config.max_matvecs, seed=config.seed
    )
    Z = standard_normal_directions(scope, m, config.seed)
    generator = torch.Generator().manual_seed(int(config.seed) + 7919)
    draws = torch.randint(0, m, (int(config.bootstrap), m), generator=generator)
    weights = torch.nn.functional.one_hot(draws, m).sum(1).to(torch.float64) / m  # (bootstrap, m)
    return _AtTheta(
        eps=eps,
        epsilon=eps[config.epsilon],
        h_theta=h_theta,
        plain_lambda_max=plain_lambda_max,
        Z=Z,
        weights=weights,
        matvecs=base_h.matvecs,
    )


def _corollary1_row(
    model: nn.Module,
    data: AnalysisData,
    scope: ParamScope,
    config: BoundCheckConfig,
    sigma: float,
    at_theta: _AtTheta,
    notes: list[str],
) -> BoundRow:
    """AD Corollary 1 at ``sigma``: the smoothed Hessian's norm on the m perturbed copies, its
    bootstrap interval and the bound (module docstring); a note when no interval can be had."""
    m = int(config.perturbations)

    def norm_of(op: CurvatureOperator) -> tuple[float, float, bool]:
        return spectral_norm(op, tol=config.tol, max_matvecs=config.max_matvecs, seed=config.seed)

    operators: list[CurvatureOperator] = []
    norms, all_converged, region_eps = [], True, [at_theta.epsilon]
    for j in range(m):
        twin, twin_scope = perturbed_copy(model, scope, sigma * at_theta.Z[:, j])
        region_eps.append(gradient_norms(twin, data, twin_scope)[config.epsilon])
        op = CurvatureEngine(
            twin, data, twin_scope, cache_bytes=DEFAULT_CACHE_BYTES // (m + 1)
        ).hessian()
        norm_j, _, conv_j = norm_of(op)
        norms.append(norm_j)
        all_converged &= conv_j
        operators.append(op)
    averaged = AveragedOperator(operators)
    empirical, _, conv = norm_of(averaged)
    all_converged &= conv
    ci = _bootstrap_interval(averaged, empirical, at_theta.weights, config.ci_level)
    if ci is None:
        ci = [empirical, empirical]
        if m > 1 and f"sigma {sigma:g}" not in notes:
            notes.append(
                f"sigma {sigma:g}: too many Lanczos vectors to record; no bootstrap interval"
            )
    H_region, eps_region = max([at_theta.h_theta] + norms), max(region_eps)
    bound_at_theta = corollary1_bound(at_theta.h_theta, at_theta.epsilon, sigma)
    bound_region = corollary1_bound(H_region, eps_region, sigma)
    row = BoundRow(
        sigma=float(sigma),
        points=m + 1,
        empirical=empirical,
        empirical_ci=ci,
        plain_lambda_max=at_theta.plain_lambda_max,
        H_at_theta=at_theta.h_theta,
        epsilon_at_theta=at_theta.epsilon,
        bound_at_theta=bound_at_theta,
        ratio_at_theta=empirical / bound_at_theta if bound_at_theta > 0 else None,
        holds_at_theta=bool(empirical <= bound_at_theta),
        verdict_at_theta="",
        H_region=H_region,
        H_perturbed_max=max(norms),
        H_perturbed_mean=sum(norms) / m,
        epsilon_region=eps_region,
        bound_region=bound_region,
        ratio_region=empirical / bound_region if bound_region > 0 else None,
        erf_factor_region=bound_region / H_region if H_region > 0 else 0.0,
        holds_region=bool(empirical <= bound_region),
        verdict_region="",
        converged=bool(all_converged),
        matvecs=sum(op.matvecs for op in operators),
    )
    row.verdict_at_theta, row.verdict_region, row.note = corollary1_verdict(row, config.ci_level)
    return row


def corollary1_verdict(row: BoundRow, ci_level: float = 0.95) -> tuple[str, str, str]:
    """``(verdict_at_theta, verdict_region, note)`` of a Corollary 1 row.

    At theta: ``"holds"`` when ``empirical <= bound_at_theta``, else ``"fails"``. Over the
    region: ``"fails"`` when ``empirical > bound_region``; ``"holds by construction"`` when
    the bound is at least ``H_perturbed_mean``: the estimated left side
    ``||(1/m) sum_j H(theta + D_j)||`` cannot exceed ``(1/m) sum_j ||H(theta + D_j)||`` (the
    triangle inequality), which cannot exceed ``H_region``, so the check cannot fail there
    (at small sigma ``erf = 1`` and the bound *is* the estimated ``H_region``); ``"holds"``
    otherwise. The note gives the left side's Monte-Carlo interval, both comparisons and the
    number of points behind the region's ``H`` and ``eps``.
    """
    lo, hi = row.empirical_ci
    left = f"||E H|| = {row.empirical:.4g} ({ci_level:.0%} interval [{lo:.4g}, {hi:.4g}])"
    at_theta = "holds" if row.holds_at_theta else "fails"
    relation = "<=" if row.holds_at_theta else ">"
    theta_text = (
        f"at theta: {left} {relation} bound {row.bound_at_theta:.4g} (H = {row.H_at_theta:.4g}, "
        f"eps = {row.epsilon_at_theta:.4g} at theta)"
    )
    if (lo <= row.bound_at_theta) != (hi <= row.bound_at_theta):
        theta_text += ", the interval straddles the bound"
    sampled = (
        f"H = {row.H_region:.4g}, eps = {row.epsilon_region:.4g}: largest over {row.points} "
        f"points (theta and {row.points - 1} perturbed), lower estimates of the suprema"
    )
    if row.empirical > row.bound_region:
        region, region_text = (
            "fails",
            (
                f"over the region: > bound {row.bound_region:.4g}; {sampled}, so not a counterexample"
            ),
        )
    elif row.bound_region >= row.H_perturbed_mean:
        region, region_text = (
            "holds by construction",
            (
                f"over the region: bound {row.bound_region:.4g} (erf = {row.erf_factor_region:.4f}) "
                f">= mean sampled Hessian norm {row.H_perturbed_mean:.4g}, which ||E H|| cannot "
                f"exceed; {sampled}"
            ),
        )
    else:
        upper = "; the interval's upper end is above it" if hi > row.bound_region else ""
        region, region_text = (
            "holds",
            (
                f"over the region: <= bound {row.bound_region:.4g} "
                f"(erf = {row.erf_factor_region:.4f}){upper}; {sampled}"
            ),
        )
    return at_theta, region, f"{theta_text}; {region_text}"


def _bootstrap_interval(
    averaged: AveragedOperator, empirical: float, weights: torch.Tensor, ci_level: float
) -> list[float] | None:
    """The percentile interval of the bootstrap's Ritz values, widened to hold ``empirical``.

    None with one perturbation, or when the Lanczos vectors were too many to record.
    """
    if weights.shape[1] <= 1 or not averaged.recording:
        return None
    alpha_tail = (1 - ci_level) / 2
    S, M = averaged.projections()
    # drop the directions of S below the products' rounding (sqrt(u): 3.5e-4 in float32)
    rel_tol = max(1e-10, torch.finfo(averaged.dtype).eps ** 0.5)
    replicates = AveragedOperator.ritz_norm(S, M, weights, rel_tol=rel_tol)
    lo = float(torch.quantile(replicates, alpha_tail))
    hi = float(torch.quantile(replicates, 1 - alpha_tail))
    return [min(lo, empirical), max(hi, empirical)]


def _corollary1_notes(rows: list[BoundRow], m: int) -> list[str]:
    """Notes on the rows: a degenerate interval (m = 1), why a failed row is not a
    counterexample to the corollary, and where eps at theta alone (AD's choice) fails."""
    notes = []
    if m == 1:
        notes.append("one perturbation: the confidence interval is degenerate")
    failed = [row.sigma for row in rows if not row.holds_region]
    if failed:
        # not a counterexample to the corollary: its H and eps are suprema, ours are sampled
        notes.append(
            "empirical above bound_region at sigma "
            + ", ".join(f"{s:g}" for s in failed)
            + ": Corollary 1 takes H "
            "and eps as bounds on the Hessian norm and gradient norm everywhere the smoothing looks; here they are "
            f"measured at theta and {m} sampled points (lower estimates of those suprema), so the check can fail "
            "where the corollary does not"
        )
    at_theta = [row.sigma for row in rows if not row.holds_at_theta]
    if at_theta:
        notes.append(
            "with H and eps at theta alone (AD's reading; columns H_at_theta, epsilon_at_theta, "
            "bound_at_theta) the check fails at sigma "
            + ", ".join(f"{s:g}" for s in at_theta)
            + ": the smoothed curvature exceeds what theta's curvature and gradient norm "
            "bound; the corollary's H and eps bound them wherever the smoothing reaches"
        )
    return notes


def bound_check(
    model: nn.Module,
    data: AnalysisData,
    config: BoundCheckConfig | None = None,
) -> BoundCheckResult:
    """AD Corollary 1 per sigma, plus ``config.check`` ``theorem2`` and ``noise-stability``.

    See the module docstring for what is measured and :class:`BoundCheckConfig` for the
    settings (UsageError on a bad one). Progress: a ``bound check`` run counting the sigmas
    and extra checks done (:mod:`sharpcli.progress`). ``model`` is not modified.
    """
    config = config if config is not None else BoundCheckConfig()
    config.validate()
    spec = config.params if config.params is not None else default_bound_scope(model)
    scope = ParamScope.resolve(model, spec)
    m = int(config.perturbations)
    total_steps = len(config.sigma) + len(config.check)
    with progress.start("bound check", total=total_steps, unit="steps", detail="at theta") as run:
        at_theta = _measure_at_theta(model, data, scope, config)
        rows: list[BoundRow] = []
        notes: list[str] = []
        for step, sigma in enumerate(config.sigma):
            run.update(step, detail=f"sigma {sigma:g}")
            rows.append(_corollary1_row(model, data, scope, config, sigma, at_theta, notes))
        notes += _corollary1_notes(rows, m)
        result = BoundCheckResult(
            rows=rows,
            params=scope.spec,
            num_params=scope.numel,
            epsilon_kind=config.epsilon,
            epsilon_full=at_theta.eps["full"],
            epsilon_minibatch=at_theta.eps["minibatch"],
            perturbations=m,
            ci_level=config.ci_level,
            lambda_max_at_theta=at_theta.plain_lambda_max,
            notes=notes,
            matvecs=at_theta.matvecs + sum(row.matvecs for row in rows),
        )
        _run_extra_checks(result, model, data, scope, config, run)
        run.finish(total_steps)
    return result


@dataclass
class CheckRun:
    """One run of the checks of ``bound-check --check``: the model, the analysis set, Corollary
    1's scope and the settings, and what the checks found so far.

    Each check (:data:`sharpcli.catalogue.CHECKS`, declared beside its code as a function of
    the run, its ``info`` giving its place in the list and its ``progress`` text) adds what it
    found to ``found`` under its key of the report's results (JSON-ready) and its curvature
    products to ``matvecs``.
    """

    model: nn.Module
    data: AnalysisData
    scope: ParamScope
    config: BoundCheckConfig
    found: dict = field(default_factory=dict)
    matvecs: int = 0


def _run_extra_checks(
    result: BoundCheckResult,
    model: nn.Module,
    data: AnalysisData,
    scope: ParamScope,
    config: BoundCheckConfig,
    run: progress.Run,
) -> None:
    """Run ``config.check`` into ``result`` in the catalogue's order, counting their products;
    ``run`` reports which is under way."""
    checks = CheckRun(model, data, scope, config)
    done = len(config.sigma)
    for entry in CHECKS.entries():
        if entry.name in config.check:
            run.update(done, detail=entry.info.get("progress", entry.name))
            CHECKS.get(entry.name)(checks)
            done += 1
    result.checks = checks.found
    result.matvecs += checks.matvecs
