"""Spectral density by stochastic Lanczos quadrature ([Ubaru2017]; [Ghorbani2019]; [Papyan2020]).

For a unit probe ``v`` (normalised Rademacher), m Lanczos steps give ``T_m = S diag(theta) S^T``;
the Gauss quadrature nodes ``theta_j`` and weights ``tau_j = S_{1j}^2`` (sum 1) satisfy
``v^T f(A) v ~ sum_j tau_j f(theta_j)``. Averaged over probes this approximates the spectral
density ``phi(t) = (1/P) sum_i delta(t - lambda_i)``; broadening each node with a Gaussian
of width ``sigma`` gives the plotted density

    phi_sigma(t) = (1/n_v) sum_v sum_j tau_j^(v) exp(-(t - theta_j^(v))^2 / (2 sigma^2)) / (sigma sqrt(2 pi)),

which integrates to 1. The same quadrature gives a trace estimate ``P * mean_v sum_j tau_j theta_j``.

Its data error (the first moment's, ``trace_data_stderr``): Gauss quadrature is exact for
``f(t) = t``, so each probe's value is ``P v^T A v`` with ``v`` the unit start, and
``v^T A v = sum_b v^T A_b v`` splits over the analysis set's batches. The first Lanczos step
multiplies ``v`` itself, so its per-batch forms (recorded against ``v``,
:mod:`sharpcli.curvature.products.batch_forms`) give the parts at no extra product; their
batch means over the probes' mean give the error [BatchMeans]. The higher moments
(``v^T A^k v``) are not linear in the data and have none.

The probe, the Lanczos basis and the tridiagonal ``T_m`` are float64 whatever the operator's
dtype (only the products run in it; :mod:`sharpcli.curvature.eigen.ritz`), so a float32 model's
nodes and weights carry the products' rounding only. The basis costs ``8 P m`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from sharpcli import progress
from sharpcli.catalogue.values import DENSITY_KEY
from sharpcli.curvature.eigen.ritz import lanczos_tridiagonal, tridiagonal_eigh
from sharpcli.curvature.products.batch_forms import (
    DataError,
    batch_means_stderr,
    can_record,
    recording,
)
from sharpcli.curvature.products.scope import rademacher_like
from sharpcli.errors import UsageError

__all__ = ["SpectralDensity", "broadened_density", "spectral_density"]


@dataclass
class SpectralDensity:
    """SLQ nodes/weights per probe and the Gaussian-broadened density on a grid."""

    nodes: list[list[float]]
    weights: list[list[float]]
    grid: list[float]
    density: list[float]
    sigma: float
    matvecs: int
    lanczos_steps: int
    probes: int
    dimension: int
    engine: str = "native"
    notes: list[str] = field(default_factory=list)
    data: DataError | None = None  # the trace estimate's data error (module docstring)

    def _per_probe_traces(self) -> np.ndarray:
        """``P sum_j tau_j theta_j`` per probe: ``P v^T A v`` for the unit probe ``v``."""
        return self.dimension * np.array(
            [sum(t * w for t, w in zip(n, ws)) for n, ws in zip(self.nodes, self.weights)]
        )

    @property
    def trace_estimate(self) -> float:
        """``P * mean_v sum_j tau_j theta_j`` (the quadrature's trace estimate)."""
        return float(np.mean(self._per_probe_traces()))

    @property
    def trace_stderr(self) -> float | None:
        """Standard error of :attr:`trace_estimate` over the probes (None with one probe).

        Gauss quadrature with ``m`` nodes is exact for polynomials of degree ``<= 2m - 1``, so
        for ``f(t) = t`` each probe's value is ``P v^T A v = z^T A z`` with ``z = sqrt(P) v`` a
        Rademacher vector: a Hutchinson sample ([Hutchinson1989]), and the spread over probes
        is the estimate's error, ``std_v / sqrt(n_v)`` (ddof 1)."""
        values = self._per_probe_traces()
        if values.size < 2:
            return None
        return float(values.std(ddof=1) / math.sqrt(values.size))

    def to_dict(self) -> dict:
        """The density as a JSON-serialisable dict, with its trace estimate.

        Returns:
            ``nodes``, ``weights``, ``grid``, ``density`` and the trace estimate, JSON-ready.
        """
        return {
            "nodes": self.nodes,
            "weights": self.weights,
            "grid": self.grid,
            DENSITY_KEY: self.density,
            "sigma": self.sigma,
            "matvecs": self.matvecs,
            "lanczos_steps": self.lanczos_steps,
            "probes": self.probes,
            "trace_estimate": self.trace_estimate,
            "trace_stderr": self.trace_stderr,
            "trace_data_stderr": None if self.data is None else self.data.stderr,
            "trace_data_method": None if self.data is None else self.data.method,
            "engine": self.engine,
            "notes": list(self.notes),
        }


def spectral_density(
    op,
    *,
    probes: int = 1,
    steps: int = 80,
    grid_points: int = 1000,
    broadening: float | None = None,
    sigma_relative: float = 0.01,
    seed: int = 0,
) -> SpectralDensity:
    r"""The spectral density of symmetric ``op`` by stochastic Lanczos quadrature.

    .. math::

        \phi_\sigma(t) = \frac{1}{n_v} \sum_v \sum_j \tau_j^{(v)}
            \frac{e^{-(t - \theta_j^{(v)})^2 / (2 \sigma^2)}}{\sigma \sqrt{2 \pi}}

    from ``probes`` seeded Rademacher starts of ``steps`` steps each (the module
    docstring). The grid spans the nodes padded by ``5 sigma``. Costs
    ``probes * steps`` products (fewer at a breakdown).

    Args:
        op: a symmetric operator (``shape``, ``dtype``, ``device``, ``matvec``).
        probes: the random starts.
        steps: Lanczos steps (quadrature nodes) per start.
        grid_points: points of the density's grid.
        broadening: the Gaussian broadening :math:`\sigma`; default ``sigma_relative`` times
            the node range.
        sigma_relative: the broadening relative to the node range, when ``broadening`` is
            None.
        seed: seeds the starts.

    Returns:
        A :class:`SpectralDensity` (nodes, weights, grid, density, trace estimate).

    Example:
        >>> import torch
        >>> from sharpcli.curvature import MatrixOperator
        >>> A = MatrixOperator(torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)))
        >>> result = spectral_density(A, steps=3)
        >>> [round(node, 8) for node in result.nodes[0]]  # 3 steps span R^3: the eigenvalues
        [1.0, 2.0, 3.0]
    """
    if int(probes) < 1:
        raise UsageError(f"probes must be >= 1, got {probes}", source="probes")
    if int(steps) < 1:
        raise UsageError(f"Lanczos steps must be >= 1, got {steps}", source="steps")
    dim = op.shape[0]
    generator = torch.Generator().manual_seed(int(seed))
    all_nodes, all_weights = [], []
    notes: list[str] = []
    matvecs = 0
    traces: list[float] = []  # per probe: P sum_j tau_j theta_j
    # per probe: P v^T A_b v per batch, and the batches' sizes (the trace's data error)
    per_batch: list[torch.Tensor] | None = [] if can_record(op) else None
    sizes: list[int] = []
    run = progress.start("slq", total=int(probes) * min(int(steps), dim), quantity="tr", probes=0)
    for probe in range(int(probes)):
        # the recurrence's scalars are float64 (lanczos_tridiagonal); a float32 recurrence
        # would put ~1e-6 relative errors into the nodes and weights. The probe is passed
        # inline so that no float64 copy of it is held through the products.
        start = rademacher_like(dim, generator, torch.float64, op.device)
        recorded = op if per_batch is None else _FirstProductRecorded(op, start / math.sqrt(dim))
        alphas, betas, _ = lanczos_tridiagonal(
            op if per_batch is None else recorded,
            start,
            int(steps),
            run=None if run.finished else run,
            done=matvecs,
        )
        del start
        if per_batch is not None:
            taken = getattr(recorded, "taken", None)
            if taken is None:
                per_batch = None
            else:
                per_batch.append(dim * taken[0].reshape(-1))
                sizes = taken[1]
        matvecs += len(alphas)
        m = len(alphas)
        if m < min(int(steps), dim):
            notes.append(
                f"probe {probe}: Lanczos breakdown (invariant subspace) after {m} of "
                f"{int(steps)} steps; its {m} nodes are exact eigenvalues"
            )
        theta, S = tridiagonal_eigh(alphas, betas)
        all_nodes.append(theta.tolist())
        all_weights.append((S[0, :] ** 2).tolist())
        traces.append(dim * float(np.dot(S[0, :] ** 2, theta)))
        run.update(matvecs, probes=probe + 1, **_trace_numbers(traces))
    flat_nodes = np.concatenate([np.asarray(n) for n in all_nodes])
    lo, hi = float(flat_nodes.min()), float(flat_nodes.max())
    span = hi - lo if hi > lo else max(abs(hi), 1.0)
    sigma = sigma_relative * span if broadening is None else broadening
    if not sigma > 0:
        raise UsageError(f"broadening must be > 0, got {sigma}", source="broadening")
    grid = np.linspace(lo - 5 * sigma, hi + 5 * sigma, int(grid_points))
    density = broadened_density(all_nodes, all_weights, float(sigma), grid)
    run.finish(matvecs, probes=len(traces), **_trace_numbers(traces))
    return SpectralDensity(
        nodes=all_nodes,
        weights=all_weights,
        grid=grid.tolist(),
        density=density.tolist(),
        sigma=float(sigma),
        matvecs=matvecs,
        lanczos_steps=int(steps),
        probes=int(probes),
        dimension=dim,
        notes=notes,
        data=None if not per_batch else batch_means_stderr(torch.stack(per_batch).mean(0), sizes),
    )


class _FirstProductRecorded:
    """``op`` whose first product, of the unit start ``left``, records its per-batch forms
    ``left^T A_b left`` (``taken``: ``((K, 1, 1) forms, sizes)``, None if they could not be
    read); every other product and attribute is ``op``'s."""

    def __init__(self, op, left: torch.Tensor):
        self._op = op
        self._left: torch.Tensor | None = left.reshape(-1, 1)
        self.taken: tuple[torch.Tensor, list[int]] | None = None

    def __getattr__(self, name):
        return getattr(self._op, name)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``A V``, the first time with its per-batch forms recorded."""
        if self._left is None:
            return self._op.matmat(V)
        with recording(self._op, self._left) as forms:
            out = self._op.matmat(V)
        self._left = None
        self.taken = None if forms is None else forms.take()
        return out

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``A v`` (:meth:`matmat` of one column)."""
        return self.matmat(v.reshape(-1, 1)).reshape(-1)


def broadened_density(nodes: list, weights: list, sigma: float, grid) -> np.ndarray:
    r"""The Gaussian-broadened SLQ density ``phi_sigma`` (module docstring) on ``grid``.

    Args:
        nodes: per probe, the Ritz values ``theta_j^(v)``.
        weights: per probe, the weights ``tau_j^(v)`` (squared first components).
        sigma: the Gaussian width.
        grid: the points to evaluate at.

    Returns:
        ``phi_sigma`` at each grid point (integrates to about 1 over a wide enough grid).
    """
    grid = np.asarray(grid, dtype=np.float64)
    density = np.zeros_like(grid)
    for probe_nodes, probe_weights in zip(nodes, weights):
        for t, w in zip(probe_nodes, probe_weights):
            density += w * np.exp(-((grid - t) ** 2) / (2 * sigma**2))
    return density / (len(nodes) * sigma * math.sqrt(2 * math.pi))


def _trace_numbers(traces: list[float]) -> dict:
    """Progress numbers of the quadrature's trace estimate over the probes so far: the mean
    (:attr:`SpectralDensity.trace_estimate`) and its standard error (none for one probe)."""
    values = np.asarray(traces, dtype=np.float64)
    stderr = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None
    return {"estimate": float(values.mean()), "stderr": stderr}
