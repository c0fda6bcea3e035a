"""Curvature tracked during training (``sharp train --track``), as the training-dynamics
figures of [MAN] (Fig. 3 and 5) record it.

Every K epochs the model is put in eval mode and, on a fixed seeded subset of
the training set, the chosen quantities are computed with the same curvature
engine as ``sharp eigen/trace/gn-nme``:

- ``eigen``:  ``lambda_max`` of the Hessian (Lanczos, residual tol 1e-3);
- ``trace``:  ``tr(H)`` by [Hutch++] (5% relative standard error, at most 200 matvecs);
- ``gn-nme``: ``tr(G)``, ``tr(N)`` and the NME share from shared probes;
- ``frobenius``: ``Tr(H^2)`` (the flatness of [FA] eq. 1).

Nothing here draws from the global RNG, so tracking does not change the
training trajectory (resume stays bit for bit).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from sharpcli import catalogue
from sharpcli.analyses.sharpness import SharpnessConfig, sharpness
from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    ParamScope,
    frobenius_sq,
    hutchpp,
    lanczos,
)
from sharpcli.curvature.registry import GGN, HESSIAN, NME
from sharpcli.curvature.split import gn_nme_split
from sharpcli.errors import UsageError

TRACKABLE = catalogue.TRACKABLE


def check_tracked(names: list[str]) -> list[str]:
    """``names`` unchanged, or a UsageError on ``track`` naming those not in ``TRACKABLE``."""
    unknown = [n for n in names if n not in TRACKABLE]
    if unknown:
        raise UsageError(
            f"cannot track {', '.join(unknown)}; accepted: {', '.join(TRACKABLE)}", source="track"
        )
    return names


def measure(
    cpass,
    names: list[str],
    *,
    seed: int = 0,
    tol: float = 5e-2,
    max_matvecs: int = 200,
    eigen_max_matvecs: int | None = None,
) -> tuple[dict, int]:
    """``(values, products)``: the quantities ``names`` (:data:`TRACKABLE`) of the curvature
    pass ``cpass`` (model already in eval mode) and the curvature products they took.

    Keys: ``lambda_max`` (Lanczos, residual tol 1e-3, at most ``eigen_max_matvecs`` products,
    default ``min(P, 100)``), ``trace`` ([Hutch++]), ``frobenius_sq`` and ``ggn_trace``,
    ``nme_trace``, ``nme_share`` (shared probes), the traces to relative standard error ``tol``
    or ``max_matvecs`` products each; ``adaptive_sharpness``: [Andriushchenko2023]'s adaptive
    worst-case l2 sharpness at rho 0.05 over the whole set (10 Auto-PGD steps; gradients, no
    curvature products).
    """

    check_tracked(names)
    out: dict = {}
    products = 0
    if "eigen" in names:
        # only the eigenvalue is recorded: no product spent on an explicit residual
        top = lanczos(
            cpass.hessian(),
            top_k=1,
            tol=1e-3,
            max_matvecs=eigen_max_matvecs,
            seed=seed,
            explicit_residuals=False,
        )
        out["lambda_max"] = top.eigenvalues[0]
        products += top.matvecs
    if "trace" in names:
        result = hutchpp(cpass.hessian(), tol=tol, max_matvecs=max_matvecs, seed=seed)
        out["trace"] = result.estimate
        products += result.matvecs
    if "frobenius" in names:
        result = frobenius_sq(cpass.hessian(), tol=tol, max_matvecs=max_matvecs, seed=seed)
        out["frobenius_sq"] = result.estimate
        products += result.matvecs
    if "gn-nme" in names:
        split = gn_nme_split(cpass, tol=tol, max_matvecs=max_matvecs, seed=seed)
        h = split.values[HESSIAN]["trace"]["estimate"]
        out["ggn_trace"] = split.values[GGN]["trace"]["estimate"]
        out["nme_trace"] = split.values[NME]["trace"]["estimate"]
        out["nme_share"] = out["nme_trace"] / h if h else None
        products += split.matvecs
    if "sharpness" in names:
        config = SharpnessConfig(rhos=(0.05,), steps=10, params=cpass.scope.spec, seed=seed)
        out["adaptive_sharpness"] = sharpness(cpass.model, cpass.data, config).rows[0].sharpness
    return out, products


def make_tracker(
    names: list[str],
    *,
    seed: int = 0,
    batch_size: int = 256,
    tol: float = 5e-2,
    max_matvecs: int = 200,
) -> Callable:
    """``tracker(model, x, y, loss, epoch) -> dict`` of the tracked quantities (``sharp train
    --track``); the in-memory tracker for one's own loop is :class:`sharpcli.Tracker`."""
    check_tracked(names)

    def tracker(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str, epoch: int) -> dict:

        was_training = model.training
        model.eval()
        try:
            cpass = CurvatureEngine(
                model,
                AnalysisData(x, y, loss=loss, batch_size=batch_size),
                ParamScope.resolve(model, None),
            )
            return measure(cpass, names, seed=seed, tol=tol, max_matvecs=max_matvecs)[0]
        finally:
            model.train(was_training)

    return tracker
