"""``sharp diagonal``: the diagonal of the Hessian, the Gauss-Newton matrix or a Fisher, per
parameter, written as a ``.safetensors`` file with the model's parameter names and shapes.

:func:`diagonal_result` is the one dispatch (the CLI's :func:`diagonal` and
:meth:`sharpcli.api.Curvature.diagonal`): ``exact`` (one product per parameter),
``hutchinson`` ([Bekas2007]), ``gnb`` (Sophia's Gauss-Newton-Bartlett estimator, [Sophia]) and
``per-sample`` (the exact Gauss-Newton diagonal as BackPACK's DiagGGN, [BackPACK], or the
empirical Fisher's), estimators in :mod:`sharpcli.curvature.diagonal`. :func:`block_summary`
gives each parameter tensor's sum (its block's trace), sum of squares and extremes.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from sharpcli import catalogue
from sharpcli.analyses.spectrum import check_choice, curvature_engine, scope_info
from sharpcli.atomic import write_bytes_atomic
from sharpcli.catalogue.values import TRACE_KEY
from sharpcli.curvature.diagonal import DEFAULT_DIAGONAL_ESTIMATOR, DiagonalRequest, DiagonalResult
from sharpcli.curvature.operators.registry import HESSIAN
from sharpcli.curvature.trace.exact import EXACT_MAX_PARAMS
from sharpcli.errors import UsageError

# the diagonal estimators, declared in sharpcli.curvature.diagonal (extensions too)
ESTIMATORS = catalogue.DIAGONAL_ESTIMATORS


def diagonal_result(
    engine,
    operator: str | None = None,
    *,
    estimator: str = DEFAULT_DIAGONAL_ESTIMATOR,
    probes: int = 100,
    max_products: int = EXACT_MAX_PARAMS,
    seed: int = 0,
) -> tuple[str, DiagonalResult]:
    """``diag(A)`` of the registered operator ``operator`` on ``engine`` by ``estimator``.

    Args:
        engine: the :class:`~sharpcli.curvature.CurvatureEngine`.
        operator: a registered operator; None: ``hessian`` for ``exact`` and ``hutchinson``,
            ``ggn`` for ``gnb`` and ``per-sample``.
        estimator: ``exact``, ``hutchinson``, ``gnb`` (``ggn`` only) or ``per-sample``
            (``ggn``, ``ef`` and ``fisher``).
        probes: Rademacher probes (``hutchinson``) or label draws (``gnb``).
        max_products: the products ``exact`` may spend (P of them), or the backward passes per
            sample ``per-sample`` may (the loss's output directions).
        seed: seeds the probes or draws.

    Returns:
        ``(operator name, DiagonalResult)``.

    Raises:
        UsageError: an unknown estimator or operator, or one the estimator does not compute.
    """

    check_choice(estimator, ESTIMATORS.names(), "estimator")
    info = ESTIMATORS.entry(estimator).info
    # the operator it computes by default as declared (an extension's default: the Hessian)
    operator = info.get("operator", HESSIAN) if operator is None else operator
    accepted = info.get("accepts")
    if accepted is not None and operator not in accepted:
        raise UsageError(
            f"the {estimator} estimator gives the diagonal of "
            f"{' or '.join(f'`operator={a}`' for a in accepted)}, not {operator!r}",
            source="operator",
        )
    request = DiagonalRequest(engine, operator, probes, max_products, seed)
    result = ESTIMATORS.get(estimator)(request)
    result.scope = engine.scope
    return operator, result


def block_summary(result, scope) -> tuple[list[dict], dict]:
    """Per parameter tensor and in total: the sum (= the block's trace), the sum of squares,
    the smallest and largest entry, and the standard error of the sum (stochastic estimators).

    Args:
        result: a :class:`~sharpcli.curvature.diagonal.DiagonalResult`.
        scope: its scope.

    Returns:
        ``(blocks, total)``: one dict per parameter in scope order, and the total's dict.
    """

    def stats(values: torch.Tensor, stderr: float | None) -> dict:
        return {
            "numel": int(values.numel()),
            "sum": float(values.sum()),
            "sum_stderr": stderr,
            "sum_sq": float(values.square().sum()),
            "min": float(values.min()),
            "max": float(values.max()),
        }

    errors = result.sum_stderr or [None] * (len(scope.names) + 1)
    blocks = [
        {"name": name, "shape": list(shape), **stats(result.diagonal[a:b], err)}
        for name, shape, a, b, err in zip(
            scope.names, scope.shapes, scope.offsets[:-1], scope.offsets[1:], errors
        )
    ]
    return blocks, stats(result.diagonal, errors[-1])


def diagonal(
    session,
    *,
    operator: str | None = None,
    estimator: str = DEFAULT_DIAGONAL_ESTIMATOR,
    probes: int = 100,
    max_products: int = EXACT_MAX_PARAMS,
    params: str | None = None,
    seed: int | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """``sharp diagonal``'s results and the diagonal as the scope's parameter tensors.

    Args:
        session: the analysis session.
        operator: see :func:`diagonal_result`.
        estimator: see :func:`diagonal_result`.
        probes: see :func:`diagonal_result`.
        max_products: see :func:`diagonal_result`.
        params: the parameter scope.
        seed: the probes' seed (default the session's).

    Returns:
        ``(results, {name: tensor})``.
    """
    seed = session.seed if seed is None else seed
    engine = curvature_engine(session, params)
    operator, result = diagonal_result(
        engine,
        operator,
        estimator=estimator,
        probes=probes,
        max_products=max_products,
        seed=seed,
    )
    blocks, total = block_summary(result, engine.scope)
    results = {
        "operator": operator,
        "estimator": result.estimator,
        "probes": result.samples,
        "matvecs": result.matvecs,
        TRACE_KEY: total,
        "blocks": blocks,
        "notes": list(result.notes),
        "scope": scope_info(engine.scope),
    }
    if result.stderr is not None:
        finite = result.stderr[torch.isfinite(result.stderr)]
        results["stderr_max"] = float(finite.max()) if finite.numel() else math.inf
    return results, result.tensors()


def save_diagonal(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``{name: tensor}`` as a ``.safetensors`` file, atomically (:mod:`sharpcli.atomic`).

    Args:
        path: the file.
        tensors: the diagonal, by parameter name.
        metadata: strings stored in the file's header (operator, estimator, ...).
    """
    from safetensors.torch import save

    data = save({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, metadata=metadata)
    write_bytes_atomic(path, data)


OTHER_FORMATS = (".npy", ".pt", ".pth", ".bin", ".pkl", ".pickle", ".json", ".csv", ".txt")
"""Extensions of formats the diagonal is not written in: refused, never written as another."""


def diagonal_writer(path: str) -> Callable[[str, dict[str, torch.Tensor], dict[str, str]], None]:
    """The writer ``path``'s extension asks for: :func:`save_diagonal_npz` for ``.npz``,
    else :func:`save_diagonal` (``.safetensors``, or a name without another format's).

    Raises:
        UsageError: (source ``out``) an extension of another format (``.pt``, ``.npy``, ...),
            which a safetensors file under that name would contradict.
    """
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix in OTHER_FORMATS:
        raise UsageError(
            f"{str(path)!r} asks for {suffix} but the diagonal is written as .safetensors "
            "or .npz: name the file so",
            source="out",
        )
    return save_diagonal_npz if suffix == ".npz" else save_diagonal


def save_diagonal_npz(
    path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write ``{name: tensor}`` as a NumPy ``.npz`` file, atomically (:mod:`sharpcli.atomic`).

    One array per parameter name (float64, the parameter's shape) and ``__metadata__``, a
    0-d string array holding the metadata as JSON: the file loads with ``numpy.load``
    without ``allow_pickle``.

    Args:
        path: the file.
        tensors: the diagonal, by parameter name.
        metadata: strings stored under ``__metadata__`` (operator, estimator, ...).
    """
    import io
    import json

    import numpy as np

    arrays: dict[str, Any] = {n: t.detach().cpu().contiguous().numpy() for n, t in tensors.items()}
    arrays["__metadata__"] = np.array(json.dumps(metadata, sort_keys=True))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_bytes_atomic(path, buffer.getvalue())
