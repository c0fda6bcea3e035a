"""Gaussian perturbations of a model's weights over a parameter scope, shared by the checks of
[AD] Corollary 1 (:mod:`sharpcli.analyses.bounds`), Theorems 2-3
(:mod:`sharpcli.analyses.theorem2`) and [NSO]'s noise stability
(:mod:`sharpcli.analyses.noise_stability`): fixed ``N(0, I)`` directions drawn from a seed
(common random numbers across sigmas), perturbed copies of the model, the sigmas' check, and
the Hessian averaged over perturbed copies (:class:`AveragedOperator`) with its spectral norm.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from sharpcli.curvature.eigen.lanczos import lanczos
from sharpcli.curvature.operators.hessian import CurvatureOperator
from sharpcli.curvature.products.scope import ParamScope, gaussian_like

__all__ = [
    "AveragedOperator",
    "perturbed_copy",
    "scope_on",
    "spectral_norm",
    "standard_normal_directions",
]


def scope_on(model: nn.Module, scope: ParamScope) -> ParamScope:
    """The parameters of ``model`` with the same names as ``scope`` (for copies of a model)."""
    named = dict(model.named_parameters())
    return ParamScope(list(scope.names), [named[n] for n in scope.names], spec=scope.spec)


def perturbed_copy(
    model: nn.Module, scope: ParamScope, delta: torch.Tensor
) -> tuple[nn.Module, ParamScope]:
    """A deep copy of ``model`` with ``delta`` (flat, over ``scope``) added to the scope's parameters."""
    twin = copy.deepcopy(model)
    twin_scope = scope_on(twin, scope)
    with torch.no_grad():
        for p, d in zip(twin_scope.params, scope.unflatten(delta)):
            p.add_(d)
    return twin, twin_scope


def standard_normal_directions(scope: ParamScope, count: int, seed: int) -> torch.Tensor:
    """``count`` fixed ``N(0, I)`` vectors over the scope, shape ``(P, count)``, from ``seed`` (CPU draw)."""
    generator = torch.Generator().manual_seed(int(seed))
    return gaussian_like(scope.numel, generator, scope.dtype, scope.device, count)


class AveragedOperator(CurvatureOperator):
    """``v -> (1/m) sum_j A_j v`` for symmetric operators ``A_j``, recording projections for a bootstrap.

    Every input vector ``u`` is kept (up to ``record_limit``) together with ``u_a^T A_j u_b`` for all
    recorded pairs, per operator j: ``projections()`` returns ``(U^T U, [U^T A_j U]_j)``, from which
    the Rayleigh-Ritz value of any reweighting ``sum_j w_j A_j`` in ``span(U)`` follows without
    further products (:meth:`ritz_norm`).
    """

    name = "averaged Hessian"

    def __init__(self, operators: list[CurvatureOperator], record_limit: int = 400):
        first = operators[0]
        super().__init__(first.shape[0], first.dtype, first.device)
        self.operators = operators
        self.record_limit = int(record_limit)
        self._inputs = torch.zeros(first.shape[0], 0, dtype=first.dtype, device=first.device)
        self._proj = torch.zeros(len(operators), 0, 0, dtype=torch.float64)
        self.recording = True

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        outs = [op.matmat(V) for op in self.operators]
        if self.recording:
            if self._inputs.shape[1] + V.shape[1] > self.record_limit:
                self.recording = False
            else:
                self._record(V, outs)
        return torch.stack(outs).mean(0)

    def _record(self, V: torch.Tensor, outs: list[torch.Tensor]) -> None:
        old = self._inputs.shape[1]
        U = torch.cat([self._inputs, V], 1)
        r = U.shape[1]
        proj = torch.zeros(len(self.operators), r, r, dtype=torch.float64)
        proj[:, :old, :old] = self._proj
        for j, out in enumerate(outs):
            block = (U.T @ out).to(torch.float64).cpu()  # (r, k): u_a^T A_j v_b
            proj[j, :, old:] = block
            proj[j, old:, :old] = block[:old].T
        self._inputs = U
        self._proj = proj

    def projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S, M)``: Gram matrix ``U^T U`` (r, r) and ``M[j] = U^T A_j U`` symmetrised (m, r, r), float64."""
        S = (self._inputs.T @ self._inputs).to(torch.float64).cpu()
        M = (self._proj + self._proj.transpose(1, 2)) / 2
        return S, M

    @staticmethod
    def ritz_norm(
        S: torch.Tensor, M: torch.Tensor, weights: torch.Tensor, rel_tol: float = 1e-10
    ) -> torch.Tensor:
        """Rayleigh-Ritz ``max |eig|`` of ``sum_j w_j A_j`` in ``span(U)`` for each row of ``weights`` (B, m).

        With ``S = E diag(s) E^T`` and ``W = E_+ diag(s_+)^{-1/2}`` (directions with
        ``s > rel_tol max s``), the Ritz values are the eigenvalues of ``W^T (sum_j w_j M_j) W``.
        ``rel_tol`` must exceed the relative rounding error of ``M``: a direction of ``S`` at
        ``s`` amplifies that error by ``max s / s`` (recorded vectors can repeat, making ``S``
        singular, and float32 products carry errors ~1e-7).
        """
        s, E = torch.linalg.eigh(S)
        keep = s > rel_tol * s.max()
        W = E[:, keep] / s[keep].sqrt()
        reduced = torch.einsum("ra,jrs,sc->jac", W, M, W)  # (m, r', r')
        out = []
        for chunk in torch.split(weights.to(torch.float64), 128):
            combined = torch.einsum("nj,jac->nac", chunk, reduced)
            combined = (combined + combined.transpose(1, 2)) / 2
            out.append(torch.linalg.eigvalsh(combined).abs().max(dim=1).values)
        return torch.cat(out)


def spectral_norm(
    op, *, tol: float, max_matvecs: int | None, seed: int
) -> tuple[float, float, bool]:
    """``(max |eig|, largest eig, converged)`` of a symmetric operator by Lanczos (both ends)."""

    result = lanczos(op, 1, "both", tol=tol, max_matvecs=max_matvecs, seed=seed)
    values = result.eigenvalues
    norm = max(abs(v) for v in values)
    return norm, max(values), all(result.converged)
