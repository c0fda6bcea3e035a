"""Lanczos with full reorthogonalisation for extreme eigenvalues of a symmetric operator.

The method is [Lanczos1950]; the reorthogonalisation and the Ritz residual below follow
[Parlett1998]. User guide: docs/commands/eigen.md.

After m steps from a unit start vector q_1 the Lanczos relation reads

    A Q_m = Q_m T_m + beta_m q_{m+1} e_m^T,

with ``T_m`` tridiagonal (alphas on the diagonal, betas beside it). For an eigenpair
``T_m s = theta s`` the Ritz pair ``(theta, u = Q_m s)`` has residual

    ||A u - theta u|| = beta_m |e_m^T s|,

which costs nothing to evaluate and is exact as long as Q_m stays orthonormal and the products
``A q_j`` are exact; full reorthogonalisation (classical Gram-Schmidt applied twice, "CGS2")
keeps Q_m orthonormal.

Precision. Every scalar of the recurrence (alpha, beta, the reorthogonalisation
coefficients, the norms) is a float64 sum whatever the operator's dtype; the products
``A q_j`` are computed in the operator's dtype, and the basis and the work vector are stored
in it (float32 for a float32 model: ``q_j`` is rounded to float32 before its product anyway,
and each update of ``w`` adds a rounding of the order of the product's own). A float32
*recurrence* is not good enough: a float32 dot product or norm over P ~ 1e5-1e6 entries has a
relative error of a few 1e-6, which moved the Ritz values by that much and broke the Lanczos
relation, so the free residual estimate above came out 1e3 times smaller than the true one.
With float64 scalars the relation holds up to the products' own rounding,

    A Q_m = Q_m T_m + beta_m q_{m+1} e_m^T + F_m,   ||F_m e_j|| ~ eps(dtype) ||A||,

so Ritz values are accurate to ~eps(dtype) ||A||, but the estimate ``beta_m |e_m^T s|`` cannot
see ``F_m`` and keeps falling below that floor. It is what the iteration stops on; the
*reported* residual is the explicit ``||A u - theta u||`` (one more product per returned Ritz
pair, in one block) whenever the operator multiplies in less than float64
(``explicit_residuals=None``, the default) or when asked (``explicit_residuals=True``). For a
float64 operator the estimate agrees with the explicit residual to rounding (pinned by the
tests), so no product is spent on it unless asked.

A Ritz value is *converged* when its reported residual satisfies
``||A u - theta u|| <= tol * |theta|`` (default tol 1e-3, docs/commands/eigen.md), or is at the products'
rounding level (``100 eps(dtype) ||T_m||``), which covers zero eigenvalues. The iteration
stops when the estimates of all requested Ritz values have converged or the matvec budget is
spent; a pair whose explicit residual then fails the test is reported as not converged.
A breakdown (``beta_m`` at rounding level) means an invariant subspace was found: its Ritz
values are exact eigenvalues. When the whole space fits the budget (P <= max_matvecs, tiny
problems) the iteration restarts with a fresh random vector orthogonal to Q and runs to
dimension P, so multiplicities are found and every eigenvalue is exact; otherwise it stops
and says so in ``breakdown``.

Memory: the basis (:class:`~sharpcli.curvature.krylov.KrylovBasis`) grows one P-vector per
step, stored in the products' dtype (4 P bytes a vector for a float32 model). A basis that
could grow past :data:`IN_MEMORY_BASIS_BYTES` on the CPU lives in an anonymous scratch file
(:func:`scratch_directory`), read a slice at a time: a run then holds two P-vectors of memory
beside the product itself, which is what a power iteration holds. Otherwise the rows stay in
memory up to what the run's memory plan allows (:mod:`sharpcli.memory`). When the basis is
full (memory plan, disk space or ``max_basis``) the iteration is thick-restarted [Wu2000]: it
keeps the wanted Ritz vectors (about half the basis), continues from the last residual
direction, and its Lanczos relation, Ritz estimates and explicit residuals keep their meaning,
so a restarted result carries the same certificate as an unrestarted one.

Warm start (``warm_start``). How fast the top Ritz value converges depends on the start
vector q_1 through its angle phi_0 with the top eigenvector u_1; the Kaniel-Paige-Saad bound
(as in [Parlett1998]) reads

    0 <= lambda_1 - theta_1^(m) <= (lambda_1 - lambda_n) (tan phi_0 / T_{m-1}(1 + 2 gamma))^2,
    gamma = (lambda_1 - lambda_2) / (lambda_2 - lambda_n),

with T_{m-1} the Chebyshev polynomial of degree m - 1. A Gaussian start has tan phi_0 ~ sqrt(P),
which the first few steps only work off; a start closer to u_1 saves them. Sources:

- ``"subsample"``: the same curvature on a seeded random fraction ``f`` of the analysis set,
  ``A_S = (1/|S|) sum_{i in S} A_i`` (:func:`subsample_operator`). ``warm_steps`` Lanczos steps
  on ``A_S`` (each about ``f`` of a full product) give its Ritz vectors; the start is the sum of
  the wanted ones (top k, bottom k, or both). Its angle with u_1 is then set by the sampling
  perturbation, about ``||(A_S - A) u_1|| / (lambda_1 - lambda_2)``, not by the step count: it
  saves a product or so where the top eigenvalue is well separated and nothing where the top
  is a cluster that the subsample orders differently (docs/benchmarks.md, "Time to accuracy").
- ``"gradient"``: the gradient of the analysis loss (one gradient pass, no second-order graph;
  ``which="largest"`` only). Gradients of trained networks lie mostly in the span of the top
  Hessian eigenvectors [GurAri2018], so its Rayleigh quotient is already near lambda_1.
- any operator of the same shape (a cheaper approximation the caller has): as ``"subsample"``.

Only q_1 changes: the recurrence, the residuals and the convergence test run on the full
operator, so the returned values carry the same certificate (residual <= tol |theta|, explicit
for float32 products) as from a cold start. As for any start, the certificate says the values
are eigenvalues, not that no larger one was missed: a Gaussian start makes that improbable by
giving every eigenvector a comparable share; a warm start gives the top directions most of its
weight, which is the point, and could in principle give u_1 a much smaller share than a close
lambda_2 (a tight cluster mis-ordered by the subsample). Summing the k wanted Ritz vectors, not
taking the first alone, limits that; ``sharp eigen`` starts cold.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch

from sharpcli import catalogue, memory, progress
from sharpcli.curvature.data import subsample_data
from sharpcli.curvature.krylov import SLICE_BYTES, KrylovBasis, norm64
from sharpcli.curvature.operators import CurvatureOperator
from sharpcli.curvature.scope import gaussian_like
from sharpcli.errors import NumericalError, UsageError

__all__ = [
    "DEFAULT_MAX_MATVECS",
    "DEFAULT_WARM_FRACTION",
    "DEFAULT_WARM_STEPS",
    "WARM_STARTS",
    "EigenResult",
    "apply_operator",
    "lanczos",
    "lanczos_tridiagonal",
    "ritz_residuals",
    "subsample_data",
    "subsample_operator",
    "tridiagonal_eigh",
]

DEFAULT_MAX_MATVECS = 100
BASIS_FLOOR_BYTES = 1 << 30  # a Krylov basis may always take this much (budget permitting)
IN_MEMORY_BASIS_BYTES = 256 << 20  # a larger basis on the CPU is kept in a scratch file
WARM_STARTS = ("subsample", "gradient")
DEFAULT_WARM_FRACTION = 0.1
DEFAULT_WARM_STEPS = 4
WARM_TOL = 1e-2  # the warm phase's own stop: beyond this the sampling error dominates
WHICH = catalogue.WHICH
_F64 = torch.float64


@dataclass
class EigenResult:
    """Eigenvalues (descending) of a curvature operator with their Ritz residuals.

    ``residuals[i] = ||A u_i - lambda_i u_i||`` (2-norm, ``u_i`` unit); ``converged[i]`` is
    ``residuals[i] <= tol * |lambda_i|`` (or at rounding level). ``eigenvectors`` is a
    float64 ``(P, m)`` tensor whose columns match ``eigenvalues`` when asked for.
    ``warm_start`` describes the warm-start phase when there was one (its products are not in
    ``matvecs``, which counts full-operator products only).
    """

    eigenvalues: list[float]
    residuals: list[float | None]
    converged: list[bool]
    matvecs: int
    method: str
    which: str
    tol: float
    engine: str = "native"
    krylov_dim: int | None = None
    breakdown: str | None = None
    notes: list[str] = field(default_factory=list)
    eigenvectors: torch.Tensor | None = None
    warm_start: dict | None = None
    restarts: int = 0
    max_basis: int | None = None

    def to_dict(self) -> dict:
        """JSON-ready dict (eigenvectors left out; ``warm_start`` only when there was one)."""
        out = {
            "eigenvalues": list(self.eigenvalues),
            "residuals": list(self.residuals),
            "converged": list(self.converged),
            "matvecs": self.matvecs,
            "method": self.method,
            "which": self.which,
            "tol": self.tol,
            "engine": self.engine,
            "krylov_dim": self.krylov_dim,
            "breakdown": self.breakdown,
            "notes": list(self.notes),
            "restarts": self.restarts,
            "max_basis": self.max_basis,
        }
        if self.warm_start is not None:
            out["warm_start"] = dict(self.warm_start)
        return out


def _check_args(op, k: int, which: str, tol: float):
    if which not in WHICH:
        raise UsageError(f"which must be one of {', '.join(WHICH)}, got {which!r}", source="which")
    if int(k) < 1:
        raise UsageError(f"top-k must be >= 1, got {k}", source="k")
    if not tol > 0:
        raise UsageError(f"tolerance must be > 0, got {tol}", source="tol")
    if op.shape[0] < 1:
        raise UsageError("the operator has no parameters in scope", source="params")


def _select(theta: np.ndarray, which: str, count: int) -> np.ndarray:
    """Indices (into ascending ``theta``) of the wanted Ritz values, ordered by descending value."""
    m = len(theta)
    count = min(count, m)
    if which == "largest":
        idx = np.arange(m - count, m)
    elif which == "smallest":
        idx = np.arange(0, count)
    else:
        idx = np.union1d(np.arange(0, count), np.arange(m - count, m))
    return idx[::-1].copy()


def tridiagonal_eigh(alphas, betas) -> tuple[np.ndarray, np.ndarray]:
    """``(theta, S)`` with ``T = S diag(theta) S^T`` ascending, ``T = tridiag(betas[:m-1], alphas,
    betas[:m-1])`` (m = len(alphas)); float64, torch LAPACK on CPU (T is tiny)."""
    m = len(alphas)
    T = np.diag(np.asarray(alphas, dtype=np.float64))
    if m > 1:
        off = np.asarray(betas[: m - 1], dtype=np.float64)
        T += np.diag(off, 1) + np.diag(off, -1)
    theta, S = torch.linalg.eigh(torch.from_numpy(T))
    return theta.numpy(), S.numpy()


def apply_operator(
    op, V: torch.Tensor, *, source: str, where: str = "", widen: bool = True
) -> torch.Tensor:
    """``A V`` for ``V`` (a P-vector or a ``(P, k)`` block), returned in float64 (``widen``) or
    in the operator's dtype.

    The product itself runs in the operator's dtype (``V`` is rounded to it), as the model
    computes it. A block goes through ``matmat`` (one pass over the data for all columns).
    Raises :class:`NumericalError` naming ``source`` when the product is not finite.
    """
    X = V.to(dtype=op.dtype, device=op.device)
    out = op.matvec(X) if X.dim() == 1 else op.matmat(X)
    del X
    # a float64 norm is finite exactly when every entry is (no P-sized mask at 124M params)
    if not math.isfinite(norm64(out)):
        raise NumericalError(
            f"{getattr(op, 'name', 'operator')} product is not finite{where}", source=source
        )
    return out.to(_F64) if widen else out


def _unit_random(dim, generator, device, basis: KrylovBasis | None = None):
    """Seeded Gaussian unit vector (float64), orthogonal (CGS2) to the rows of ``basis``."""
    q = gaussian_like(dim, generator, _F64, device)
    if basis is not None and len(basis) > 0:
        basis.orthogonalize(q)
    return q / torch.linalg.vector_norm(q)


def _lanczos_step(op, basis: KrylovBasis, coupling: list[tuple[int, float]], step: int):
    """One step of the recurrence from the basis's last row ``q_j``.

    ``w = A q_j - alpha_j q_j - sum_i T_ij q_i`` with ``alpha_j = q_j^T A q_j`` and the
    couplings ``T_ij`` (``i < j``) of ``q_j`` to earlier rows (``beta_{j-1}`` alone in plain
    Lanczos; every kept Ritz vector right after a thick restart), then
    ``w <- w - Q (Q^T w)`` twice (CGS2) and ``beta_j = ||w||``; the next vector is
    ``w / beta_j``. Returns ``(alpha_j, beta_j, w)``: the scalars float64, ``w`` in the
    basis's storage dtype (the product's own: updating it in place rounds each term to the
    products' precision, the order of their own rounding, while every coefficient is a float64
    sum, so no float64 P-vector is ever made; at 124M parameters one is 1 GB).
    """
    j = len(basis) - 1
    w = apply_operator(
        op, basis.row(j), source="lanczos", where=f" at Lanczos step {step}", widen=False
    ).to(basis.dtype)
    alpha = basis.dot(j, w)
    basis.axpy(w, j, alpha)
    for i, value in coupling:
        if value != 0.0:
            basis.axpy(w, i, value)
    basis.orthogonalize(w)
    return alpha, norm64(w), w


def storage_dtype(op_dtype: torch.dtype) -> torch.dtype:
    """The dtype a Krylov basis is stored in: the products' own (float32 or float64), float32
    for half-precision products (their rounding is too coarse to keep a basis orthonormal)."""
    return op_dtype if op_dtype in (torch.float32, _F64) else torch.float32


def krylov_work_bytes(dim: int, dtype: torch.dtype, returned: int = 0) -> int:
    """Bytes a Lanczos run holds beside its basis's rows for ``dim`` parameters multiplied in
    ``dtype``: a step holds ``w = A q`` (in the storage dtype, the product's own for float32
    and float64) and, with the basis in a scratch file, the newest row kept for its product,
    plus the float64 slice buffers of :mod:`~sharpcli.curvature.krylov`; the end, after the
    basis is released, each of the ``returned`` Ritz vectors with its explicit residual's
    product. The larger of the two."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    stored = torch.empty((), dtype=storage_dtype(dtype)).element_size()
    step = dim * (2 * stored + (itemsize if dtype != storage_dtype(dtype) else 0))
    end = int(returned) * dim * (stored + itemsize)
    return int(max(step, end) + 2 * SLICE_BYTES)


def scratch_directory() -> str | None:
    """Where a large Krylov basis is kept out of core: ``SHARP_SCRATCH`` (``off`` keeps every
    basis in memory), else the system's temporary folder (``TMPDIR``)."""
    value = os.environ.get("SHARP_SCRATCH")
    if value is None:
        return tempfile.gettempdir()
    if value.strip().lower() in ("", "off", "memory", "none"):
        return None
    return value


def _basis_room(op, steps: int, *, extra_vectors: int = 0, minimum: int = 1, lower: str):
    """``(vectors, bytes held in memory, scratch)``: how many basis rows (at most ``steps``)
    the run keeps and where.

    A basis whose ``steps`` rows would take more than :data:`IN_MEMORY_BASIS_BYTES` goes to a
    scratch file (:func:`scratch_directory`) when the operator runs on the CPU: it then holds
    two P-vectors of memory whatever its length (the newest row and ``w``), and its length is
    bounded by half the free disk space there. Otherwise the rows are held in memory, as many
    as the memory plan allows beside :func:`krylov_work_bytes` for ``extra_vectors`` returned
    Ritz vectors (and no more than one product's workspace or :data:`BASIS_FLOOR_BYTES`).
    UsageError on ``max_memory`` when not even ``minimum`` rows fit.
    """
    dim = op.shape[0]
    per_vector = KrylovBasis.bytes_for(dim, storage_dtype(op.dtype), 1)
    work = krylov_work_bytes(dim, op.dtype, extra_vectors)
    plan = memory.current()
    scratch = scratch_directory()
    on_cpu = torch.device(op.device if op.device is not None else "cpu").type == "cpu"
    if on_cpu and scratch is not None and steps * per_vector > IN_MEMORY_BASIS_BYTES:
        plan.require(f"Lanczos vectors of {dim:,} parameters", work, lower)
        try:
            free = shutil.disk_usage(scratch).free
        except OSError:
            free = 0
        fit = int(free // 2 // per_vector)
        if fit < minimum:
            raise UsageError(
                f"a Krylov basis of {minimum} vectors of {dim:,} parameters needs "
                f"{memory.format_bytes(minimum * per_vector)} of disk in {scratch} (it is kept "
                f"out of memory), which has {memory.format_bytes(free)} free; point "
                "SHARP_SCRATCH (or TMPDIR) elsewhere or lower `max_matvecs`",
                source="scratch",
            )
        vectors = min(int(steps), fit)
        plan.note(
            f"Krylov basis in a scratch file in {scratch} (up to {vectors} vectors, "
            f"{memory.format_bytes(vectors * per_vector)} of disk), not in memory"
        )
        return vectors, work, scratch
    fit = plan.count_that_fit(per_vector, reserve=work)
    # The basis may take as much memory as one product needs (its graph, cached or not, and
    # the double backward), and at least BASIS_FLOOR_BYTES: a run then holds at most about
    # twice what any Hessian-product method holds, and a larger basis than that buys fewer
    # products than the memory it costs (thick restarts keep the wanted Ritz vectors).
    product = plan.items.get(memory.PRODUCT_WORKSPACE, 0)
    lean = max(minimum, max(BASIS_FLOOR_BYTES, product) // per_vector)
    if lean < fit:
        fit = lean
    if fit < minimum:
        plan.require(
            f"a Krylov basis of {minimum} vectors of {dim:,} parameters",
            minimum * per_vector + work,
            lower,
        )
    vectors = min(int(steps), fit)
    return vectors, vectors * per_vector + work, None


def lanczos_tridiagonal(
    op,
    start: torch.Tensor,
    steps: int,
    *,
    keep_basis: bool = False,
    run: progress.Run | None = None,
    done: int = 0,
    window: int | None = None,
):
    """``steps`` Lanczos steps with full reorthogonalisation from ``start`` (normalised here).

    Returns ``(alphas, betas, basis)``: ``T = tridiag(betas[:-1], alphas, betas[:-1])`` and
    ``basis`` (float64 ``(P, m)`` or ``None``). The recurrence is float64 whatever
    ``op.dtype`` (module docstring). Stops early at a breakdown (invariant subspace).
    Used by stochastic Lanczos quadrature (:mod:`sharpcli.curvature.density`), which passes
    its progress ``run``: each step reports ``done`` + the steps so far as its matvecs.

    ``window``: reorthogonalise against the last ``window`` vectors only (default: as many as
    the memory plan allows, all ``steps`` when they fit). The quadrature's nodes and weights
    stay accurate without full orthogonality ([GolubMeurant2010] on Gauss
    quadrature from the Lanczos recurrence); copies of converged Ritz values appear as nodes
    that share their weight. ``keep_basis`` needs the whole basis.
    """
    dim = op.shape[0]
    steps = min(steps, dim)
    lower = "lower `steps` (Lanczos steps per probe)"
    scratch = None
    if window is None:
        window, held, scratch = _basis_room(
            op, steps, minimum=1 if not keep_basis else steps, lower=lower
        )
    else:
        window = max(1, min(int(window), steps))
        held = KrylovBasis.bytes_for(dim, storage_dtype(op.dtype), window)
        held += krylov_work_bytes(dim, op.dtype)
    # the start in the basis's dtype, normalised there: no float64 copy of a P-vector is held
    # through the products (a caller passing its probe inline holds none either)
    norm = norm64(start)
    q = start.reshape(-1).to(dtype=storage_dtype(op.dtype), device=op.device) / norm
    del start
    alphas: list[float] = []
    betas: list[float] = []
    scale = 0.0
    eps = torch.finfo(op.dtype).eps  # breakdown is judged at the products' rounding level
    basis = KrylovBasis(dim, storage_dtype(op.dtype), op.device, scratch=scratch)
    with memory.current().hold("lanczos basis", held):
        for j in range(steps):
            if len(basis) == window:  # keep the newest window - 1 rows, in order
                keep = torch.eye(window, dtype=_F64)[:, 1:]
                basis.rotate(keep)
            basis.append(q)
            coupling = [(len(basis) - 2, betas[-1])] if j and len(basis) > 1 else []
            alpha, beta, w = _lanczos_step(op, basis, coupling, j)
            alphas.append(alpha)
            betas.append(beta)
            if run is not None:
                run.update(done + j + 1)
            scale = max(scale, abs(alpha), beta)
            if beta <= 100 * eps * scale:
                break
            q = w / beta
        kept = None
        if keep_basis:
            kept = basis.combine(torch.eye(len(basis), dtype=_F64))
        basis.close()
    return alphas, betas, kept


def _explicit_residuals(op, values, vectors, estimated, tol, exact_level, notes):
    """``(||A u - theta u||, converged)`` measured with one product per pair; notes say so."""
    reported = np.asarray(ritz_residuals(op, values.tolist(), vectors))
    converged = (reported <= tol * np.abs(values)) | (reported <= exact_level)
    notes.append(
        f"residuals are explicit: ||A u - lambda u|| measured with {len(values)} more "
        f"product{'s' if len(values) != 1 else ''}, since the model multiplies in "
        f"{str(op.dtype).replace('torch.', '')} (Lanczos keeps its scalars in float64)"
    )
    lost = int((estimated & ~converged).sum())
    if lost:
        notes.append(
            f"{lost} eigenvalue(s) converged by the Ritz estimate but not by the explicit "
            "residual: the products' own errors (rounding) bound the attainable residual; "
            "raise `tol` or use `dtype=float64`"
        )
    return reported, converged


def _curvature_operator(op, what: str) -> CurvatureOperator:
    """``op`` when it is a :class:`CurvatureOperator`; UsageError on ``warm_start`` otherwise."""
    if isinstance(op, CurvatureOperator):
        return op
    raise UsageError(
        f"warm_start={what!r} needs a curvature operator over an analysis set; "
        f"{type(op).__name__} has none: pass an approximating operator as warm_start instead",
        source="warm_start",
    )


def subsample_operator(op, fraction: float = DEFAULT_WARM_FRACTION, seed: int = 0):
    """The same curvature operator as ``op`` over a seeded ``fraction`` of its analysis set.

    Args:
        op: a :class:`~sharpcli.curvature.operators.CurvatureOperator` over an analysis set.
        fraction: the fraction of samples kept (:func:`~sharpcli.curvature.data.subsample_data`).
        seed: seeds the choice of samples.

    Returns:
        ``op.on_subsample(fraction, seed)``'s operator, on its own engine.
    """
    return _subsample(op, fraction, seed)[0]


def _subsample(op, fraction, seed) -> tuple[CurvatureOperator, int, int]:
    """``(operator on the subsample, samples kept, samples of the whole set)``."""
    op = _curvature_operator(op, "subsample")
    try:
        return op.on_subsample(fraction, seed)
    except UsageError as error:
        if error.source != "operator":
            raise
        raise UsageError(
            f"warm_start='subsample': {error}; pass an approximating operator as warm_start instead",
            source="warm_start",
        ) from error


def _gradient_start(op, which: str):
    """The loss gradient over the analysis set (one gradient pass) as a start vector."""
    if which != "largest":
        raise UsageError(
            f"warm_start='gradient' finds the top of the spectrum; use 'subsample' for "
            f"which={which!r}",
            source="warm_start",
        )
    try:
        _, grad = _curvature_operator(op, "gradient").loss_and_gradient()
    except UsageError as error:
        if error.source != "operator":
            raise
        raise UsageError(
            f"warm_start='gradient': {error}; pass an approximating operator as warm_start instead",
            source="warm_start",
        ) from error
    info = {"method": "gradient", "gradient_passes": 1, "full_product_equivalents": None}
    return grad.to(dtype=_F64, device=op.device).reshape(-1), info


def _warm_operator(op, warm_start, fraction, seed):
    """``(operator for the warm phase, info, its cost per product in full products or None)``."""
    if isinstance(warm_start, str):
        warm_op, samples, of_samples = _subsample(op, fraction, seed)
        info = {
            "method": "subsample",
            "fraction": float(fraction),
            "samples": samples,
            "of_samples": of_samples,
        }
        return warm_op, info, samples / of_samples
    if tuple(warm_start.shape) != tuple(op.shape):
        raise UsageError(
            f"the warm-start operator has shape {tuple(warm_start.shape)}, the operator "
            f"{tuple(op.shape)}",
            source="warm_start",
        )
    name = getattr(warm_start, "name", type(warm_start).__name__)
    return warm_start, {"method": "operator", "name": name}, None


def _warm_start_vector(op, warm_start, k: int, which: str, *, fraction, steps, seed):
    """``(q_1, info)``: the float64 start vector of a warm start (module docstring) and what it
    cost. ``"subsample"`` and operators: the sum of the warm phase's wanted Ritz vectors."""
    if isinstance(warm_start, str) and warm_start not in WARM_STARTS:
        raise UsageError(
            f"warm start must be one of {', '.join(WARM_STARTS)} or an operator, got "
            f"{warm_start!r}",
            source="warm_start",
        )
    if warm_start == "gradient":
        return _gradient_start(op, which)
    if steps is None:
        steps = max(DEFAULT_WARM_STEPS, k * (2 if which == "both" else 1) + 2)
    if int(steps) < 1:
        raise UsageError(f"warm-start steps must be >= 1, got {steps}", source="warm_steps")
    warm_op, info, relative_cost = _warm_operator(op, warm_start, fraction, seed)
    with progress.phase("warm start"):
        warm = lanczos(
            warm_op,
            k,
            which,
            tol=WARM_TOL,
            max_matvecs=int(steps),
            seed=seed,
            return_eigenvectors=True,
            explicit_residuals=False,
        )
    info.update(
        matvecs=int(warm.matvecs),
        ritz_values=list(warm.eigenvalues),
        full_product_equivalents=None if relative_cost is None else warm.matvecs * relative_cost,
    )
    assert warm.eigenvectors is not None  # return_eigenvectors=True
    q = warm.eigenvectors.sum(dim=1)  # orthonormal Ritz vectors: each gets weight 1
    return q.to(device=op.device), info


def _start_vector(op, start, warm_start, k, which, generator, fraction, steps, seed):
    """``(q_1, warm_info)``: the unit float64 start vector (given, warm or seeded Gaussian)."""
    warm_info = None
    if warm_start is not None:
        if start is not None:
            raise UsageError("give a start vector or a warm start, not both", source="warm_start")
        start, warm_info = _warm_start_vector(
            op, warm_start, k, which, fraction=fraction, steps=steps, seed=seed
        )
        norm = float(torch.linalg.vector_norm(start))
        if not (math.isfinite(norm) and norm > 0):  # a zero gradient, say: start cold
            start = None
            warm_info["fallback"] = "the warm start vector was zero or not finite: started cold"
    if start is None:
        return _unit_random(op.shape[0], generator, op.device), warm_info
    q = start.to(dtype=_F64, device=op.device).reshape(-1)
    return q / torch.linalg.vector_norm(q), warm_info


def _plan_basis(op, wanted: int, returned: int, max_matvecs, max_basis):
    """``(room, held, scratch, limit)`` of a :func:`lanczos` run: the basis rows it may keep,
    the bytes it holds in memory, its scratch folder (None: in memory) and its product budget.

    A thick restart keeps the ``wanted`` Ritz vectors and needs room for two more; UsageError
    on ``max_matvecs`` / ``max_basis`` below 1 or a ``max_basis`` too small to restart.
    """
    dim = op.shape[0]
    if max_matvecs is not None and int(max_matvecs) < 1:
        raise UsageError(f"max matvecs must be >= 1, got {max_matvecs}", source="max_matvecs")
    if max_basis is not None and int(max_basis) < 1:
        raise UsageError(f"max basis must be >= 1, got {max_basis}", source="max_basis")
    budget = int(max_matvecs) if max_matvecs is not None else DEFAULT_MAX_MATVECS
    room, held, scratch = _basis_room(
        op,
        min(dim, budget),
        extra_vectors=returned,
        minimum=min(dim, budget, wanted + 2),
        lower="lower `top_k`, `batch_size` or `cache_mb`",
    )
    if max_basis is not None:
        room = min(room, int(max_basis))
    restarting = room < min(dim, budget)
    limit = budget if restarting else min(dim, budget)  # products; restarts may pass dim
    if restarting and room < wanted + 2:
        raise UsageError(
            f"a thick restart keeps the {wanted} wanted Ritz vectors and needs room for two "
            f"more, but `max_basis` is {room}; raise it or lower `top_k`",
            source="max_basis",
        )
    if restarting and max_basis is None:
        memory.current().note(
            f"Krylov basis limited to {room} vectors by the memory plan: thick-restarted Lanczos"
        )
    return room, held, scratch, limit


def _stop_notes(state: dict, limit: int, room: int) -> list[str]:
    """The notes on how a run stopped: its product budget spent, its restarts."""
    notes = []
    if not state["converged"].all() and state["matvecs"] >= limit and not state["complete"]:
        notes.append(
            f"stopped at the matvec budget ({limit}) before all requested eigenvalues converged"
        )
    if state["restarts"]:
        notes.append(
            f"thick-restarted Lanczos: a basis of at most {room} vectors (memory plan), "
            f"{state['restarts']} restart(s)"
        )
    return notes


def lanczos(
    op,
    k: int = 1,
    which: str = "largest",
    *,
    tol: float = 1e-3,
    max_matvecs: int | None = None,
    seed: int = 0,
    start: torch.Tensor | None = None,
    return_eigenvectors: bool = False,
    explicit_residuals: bool | None = None,
    warm_start=None,
    warm_fraction: float = DEFAULT_WARM_FRACTION,
    warm_steps: int | None = None,
    max_basis: int | None = None,
) -> EigenResult:
    """Top-``k`` ``largest``, ``smallest`` or ``both`` (k of each end) eigenvalues of symmetric ``op``.

    ``op`` needs ``shape``, ``dtype``, ``device``, ``matvec`` (and ``matmat`` for explicit
    residuals). The start vector is a seeded Gaussian (``seed``) unless ``start`` is given.
    ``max_matvecs`` (default 100) bounds the products. The basis grows one vector per product
    in the products' dtype (:class:`~sharpcli.curvature.krylov.KrylovBasis`) up to what the
    run's memory plan (:mod:`sharpcli.memory`) allows, or ``max_basis`` when given; a basis
    that reaches that size is thick-restarted ([Wu2000]) keeping the wanted Ritz vectors, with
    the same residual certificate. When P < k all P eigenvalues are returned.

    ``explicit_residuals``: report ``||A u - theta u||`` computed with one more product per
    returned pair (counted in ``matvecs``, beyond ``max_matvecs``; ``krylov_dim`` stays the
    Krylov dimension) instead of the Ritz estimate ``beta_m |e_m^T s|``; ``None`` does so
    when ``op.dtype`` is not float64, where the estimate cannot see the products' rounding.

    ``warm_start`` (module docstring, "Warm start"): ``None`` (a seeded Gaussian start),
    ``"subsample"`` (``warm_steps`` Lanczos steps on the same curvature over a seeded
    ``warm_fraction`` of the analysis set; default steps ``max(4, wanted + 2)``),
    ``"gradient"`` (the loss gradient, ``which="largest"``) or an operator approximating ``op``.
    The warm phase's products are reported in ``result.warm_start``, not in ``matvecs``;
    everything that certifies the result runs on ``op``.
    """
    _check_args(op, k, which, tol)
    dim = op.shape[0]
    if explicit_residuals is None:
        explicit_residuals = op.dtype != _F64
    want = min(int(k), dim)
    wanted = min(dim, want * (2 if which == "both" else 1))
    returned = wanted if (return_eigenvectors or explicit_residuals) else 0
    room, held, scratch, limit = _plan_basis(op, wanted, returned, max_matvecs, max_basis)
    plan = memory.current()
    generator = torch.Generator().manual_seed(int(seed))
    eps = torch.finfo(op.dtype).eps  # rounding level of the products, not of the recurrence
    q, warm_info = _start_vector(
        op, start, warm_start, want, which, generator, warm_fraction, warm_steps, seed
    )
    run = progress.start("lanczos", total=limit, quantity=_QUANTITY[which])
    with plan.hold("krylov basis", held):
        basis = KrylovBasis(dim, storage_dtype(op.dtype), op.device, scratch=scratch)
        basis.append(q)
        del q  # the basis holds it (in the products' dtype)
        state = _run_lanczos(op, basis, want, which, tol, limit, room, generator, eps, run)
    breakdown = state["breakdown"]
    notes: list[str] = []
    theta, S, idx, converged, residuals = (
        state["theta"],
        state["S"],
        state["idx"],
        state["converged"],
        state["residuals"],
    )
    exact_level, matvecs, basis = state["exact_level"], state["matvecs"], state["basis"]
    m = len(basis)
    notes += _stop_notes(state, limit, room)
    values = theta[idx]
    vectors = None
    if return_eigenvectors or explicit_residuals:
        # the residual is checked on the vector the operator multiplies (rounded to its
        # dtype); float64 copies only when the caller asked for the eigenvectors
        keep = _F64 if return_eigenvectors else storage_dtype(op.dtype)
        vectors = basis.combine(torch.as_tensor(S[:, idx].copy(), dtype=_F64), dtype=keep)
    restarts = state["restarts"]
    basis.close()
    del basis, state
    reported = residuals[idx]
    if explicit_residuals:
        reported, converged = _explicit_residuals(
            op, values, vectors, converged, tol, exact_level, notes
        )
        matvecs += len(idx)
    at_rounding = int((converged & (reported > tol * np.abs(values))).sum())
    if at_rounding:
        notes.append(
            f"{at_rounding} eigenvalue(s) converged at the products' rounding level "
            f"(residual <= 100 eps ||T|| = {exact_level:.3g}), not at tol |eigenvalue|"
        )
    notes += [_warm_note(warm_info)] if warm_info is not None else []
    result = EigenResult(
        eigenvalues=[float(t) for t in values],
        residuals=[float(r) for r in reported],
        converged=[bool(c) for c in converged],
        matvecs=matvecs,
        method="lanczos",
        which=which,
        tol=float(tol),
        krylov_dim=m,
        breakdown=breakdown,
        restarts=int(restarts),
        max_basis=int(room),
        notes=notes,
        warm_start=warm_info,
    )
    if return_eigenvectors:
        result.eigenvectors = vectors
    run.finish(matvecs, **_reported_numbers(result.eigenvalues, result.residuals, which))
    return result


def _keep_after_restart(theta: np.ndarray, which: str, want: int, size: int) -> np.ndarray:
    """Indices (into ascending ``theta``) of the Ritz vectors a thick restart keeps: the wanted
    end(s) of the spectrum, about half the basis and at least the wanted ones, leaving room
    for two new vectors ([Wu2000] keep about half)."""
    keep = min(size - 2, max(want * (2 if which == "both" else 1), size // 2))
    if which == "largest":
        return np.arange(size - keep, size)
    if which == "smallest":
        return np.arange(0, keep)
    low = max(want, keep // 2)
    high = max(want, keep - low)
    return np.union1d(np.arange(0, low), np.arange(size - high, size))


def _extend_projection(T: np.ndarray, alpha: float, coupling) -> np.ndarray:
    """The projected matrix with a new last row/column: ``alpha`` on the diagonal and the
    couplings ``T_ij`` of the new vector to earlier rows."""
    m = T.shape[0]
    out = np.zeros((m + 1, m + 1))
    out[:m, :m] = T
    out[m, m] = alpha
    for i, value in coupling:
        out[i, m] = out[m, i] = value
    return out


def _run_lanczos(op, basis, want, which, tol, limit, room, generator, eps, run) -> dict:
    """The Lanczos iteration of :func:`lanczos` with full reorthogonalisation, thick-restarted
    whenever the basis reaches ``room`` rows ([Wu2000]).

    Plain steps keep ``T`` tridiagonal. A restart keeps the Ritz pairs
    ``(theta_i, y_i = Q s_i)`` of the wanted end(s) (:func:`_keep_after_restart`), continues
    from ``q_{m+1} = w / beta_m`` and couples it to each kept vector by ``beta_m s_{m,i}``:
    ``A Y = Y diag(theta) + beta_m q_{m+1} s_m^T`` holds exactly as the Lanczos relation did,
    so the Ritz estimate ``beta |e_m^T s|`` and the explicit residuals mean the same after a
    restart. The projected matrix is then arrowhead plus tridiagonal, kept dense (it is tiny).
    """
    dim = op.shape[0]
    T = np.zeros((0, 0))
    coupling: list[tuple[int, float]] = []
    history: list[float] = []  # worst residual / (tol |theta|) of each step, for the projection
    matvecs = restarts = 0
    breakdown = None
    exhaust = False  # after a breakdown on a problem that fits: run to dimension P
    complete = False
    scale = 0.0
    while True:
        alpha, beta, w = _lanczos_step(op, basis, coupling, matvecs)
        matvecs += 1
        T = _extend_projection(T, alpha, coupling)
        theta, S = torch.linalg.eigh(torch.from_numpy(T))
        theta, S = theta.numpy(), S.numpy()
        scale = max(scale, float(np.abs(theta).max()), abs(alpha))
        exact_level = 100 * eps * max(scale, np.finfo(np.float64).tiny)
        residuals = beta * np.abs(S[-1, :])
        idx = _select(theta, which, want)
        converged = (residuals[idx] <= tol * np.abs(theta[idx])) | (residuals[idx] <= exact_level)
        m = len(basis)
        if not run.finished:
            _report_step(run, matvecs, theta[idx], residuals[idx], which, tol, history, limit)
        if m == dim:
            complete = True
            break
        if beta <= exact_level:
            if room >= dim and limit == dim:
                exhaust = True
                if breakdown is None:
                    breakdown = (
                        f"invariant subspace after {m} steps; restarted to reach dimension {dim}"
                    )
                coupling = []
                basis.append(_unit_random(dim, generator, op.device, basis))
                continue
            breakdown = (
                f"invariant subspace after {m} steps: Ritz values are exact eigenvalues, "
                "repeated eigenvalues may appear once"
            )
            break
        if (converged.all() and not exhaust) or matvecs >= limit:
            break
        w.div_(beta)
        if m == room:  # thick restart: keep the wanted Ritz vectors, continue from w / beta
            keep = _keep_after_restart(theta, which, want, m)
            basis.rotate(torch.from_numpy(S[:, keep].copy()))
            T = np.diag(theta[keep])
            coupling = [(i, float(beta * S[-1, j])) for i, j in enumerate(keep)]
            restarts += 1
        else:
            coupling = [(m - 1, beta)]
        basis.append(w)
    return {
        "theta": theta,
        "S": S,
        "idx": idx,
        "converged": converged,
        "residuals": residuals,
        "exact_level": exact_level,
        "matvecs": matvecs,
        "basis": basis,
        "restarts": restarts,
        "breakdown": breakdown,
        "complete": complete,
    }


_QUANTITY = {"largest": "lambda_max", "smallest": "lambda_min", "both": "lambda_max"}


def _reported_numbers(values, residuals, which: str) -> dict:
    """The progress numbers of wanted Ritz values (descending): the extreme one the run is
    named after (``_QUANTITY``) and the worst residual."""
    return {
        "estimate": float(values[-1] if which == "smallest" else values[0]),
        "residual": float(max(residuals)),
    }


def _report_step(run, matvecs, values, residuals, which, tol, history, limit) -> None:
    """Report a step: the Ritz estimates and the step at which they project to converge.

    The worst ratio ``r_j = max_i residual_i / (tol |theta_i|)`` falls roughly geometrically
    (the Kaniel-Paige-Saad bound of the module docstring); with its rate over the last two steps
    ``rho = (r_j / r_{j-2})^(1/2) < 1`` the run projects ``log(r_j) / -log(rho)`` more steps
    (capped by the budget ``limit``); none while it is not falling.
    """
    ratio = float(np.max(residuals / (tol * np.maximum(np.abs(values), 1e-300))))
    history.append(ratio)
    expected = None
    if len(history) >= 3 and ratio > 1 and 0 < ratio < history[-3]:
        rate = math.sqrt(ratio / history[-3])
        expected = min(limit, matvecs + math.ceil(math.log(ratio) / -math.log(rate)))
    run.update(matvecs, expected=expected, **_reported_numbers(values, residuals, which))


def _warm_note(info: dict) -> str:
    if info["method"] == "gradient":
        text = "warm start: the loss gradient (one gradient pass)"
    elif info["method"] == "subsample":
        cost = info["full_product_equivalents"]
        text = (
            f"warm start: {info['matvecs']} products on a subsample of {info['samples']} of "
            f"{info['of_samples']} samples (about {cost:.2g} full products), not in matvecs"
        )
    else:
        text = f"warm start: {info['matvecs']} products of {info['name']}, not in matvecs"
    return text + (f"; {info['fallback']}" if "fallback" in info else "")


def ritz_residuals(op, eigenvalues, eigenvectors: torch.Tensor) -> list[float]:
    """Explicit ``||A u_i - lambda_i u_i|| / ||u_i||`` for the columns ``u_i`` of ``eigenvectors``.

    One product per pair, all in one ``matmat`` block, in the operator's dtype; the
    subtraction and the norms are float64 (a slice of rows widened at a time), so the result
    is the residual of the vector the operator actually multiplied (``u_i`` rounded to
    ``op.dtype``) up to float64 rounding.
    """
    if eigenvectors.dim() == 1:
        eigenvectors = eigenvectors[:, None]
    U = eigenvectors.to(dtype=op.dtype, device=op.device)
    R = apply_operator(op, U, source="lanczos", where=" in the residual check", widen=False)
    lam = torch.as_tensor(list(eigenvalues), dtype=_F64, device=U.device)
    R = R.reshape(U.shape)
    squares = torch.zeros(U.shape[1], dtype=_F64, device=U.device)
    norms = torch.zeros_like(squares)
    rows = max(1, SLICE_BYTES // (16 * max(1, squares.numel())))
    for a in range(0, U.shape[0], rows):
        u = U[a : a + rows].to(_F64).reshape(-1, squares.numel())
        r = R[a : a + rows].to(_F64).reshape(-1, squares.numel())
        squares += ((r - u * lam).square()).sum(dim=0)
        norms += u.square().sum(dim=0)
    return (squares.sqrt() / norms.sqrt()).tolist()
