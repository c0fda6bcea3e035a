"""``--engine pyhessian``: eigenvalues and trace through PyPI ``pyhessian`` 0.1 [PyHessian].

Runs ``pyhessian.hessian`` on the same model, loss and batches as the native engine (CPU,
``cuda=False``; a single ``data=(x, y)`` batch when the analysis set is one batch, otherwise
its ``dataloader`` mode, which weights batches by size so it is also a mean over samples)
and returns its numbers in the native result types with ``engine="pyhessian"``.

Known limitations of pyhessian 0.1, kept visible in the results' ``notes``:
- ``eigenvalues()`` is power iteration with deflation: it finds the largest *|eigenvalue|*
  (not the largest algebraic one) and stops when the Rayleigh quotient changes by less than
  ``tol`` relative (default 1e-3), which can end several percent low when the gap is small.
  It reports no residual: sharpcli computes ``||H u - lambda u||`` for its eigenvectors with
  one native Hessian product each.
- ``trace()`` is Hutchinson stopping when the running mean changes by less than ``tol``
  relative to the previous mean *without absolute value*: once the running mean is negative
  it stops at once (seen after 2 samples on a tiny GELU net). It reports no standard error
  (sharpcli computes one from its samples, with that caveat). ``run_all=True`` passes
  ``tol=-inf`` so it takes exactly ``max_matvecs`` samples.
- ``density()`` calls ``torch.eig``, removed from torch: refused here.
- It always uses every parameter with ``requires_grad``: a scope other than ``all`` is refused.
- In dataloader mode every product redoes forward, backward and double backward per batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from sharpcli.curvature.eigen.ritz import EigenResult, ritz_residuals
from sharpcli.curvature.operators.hessian import HessianOperator
from sharpcli.curvature.products.data import (
    AnalysisData,
    prepare_model_for_analysis,
    to_model_batch,
)
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.hutchinson import HUTCHINSON
from sharpcli.curvature.trace.probes import TraceResult
from sharpcli.errors import UsageError
from sharpcli.losses import loss_fn

__all__ = ["pyhessian_density", "pyhessian_eigenvalues", "pyhessian_trace"]

ENGINE = "pyhessian"


def _check_scope(params: str | None):
    """Raise UsageError unless ``params`` is the whole model (PyHessian knows no scopes)."""
    if params not in (None, "", "all"):
        raise UsageError(
            f"pyhessian computes over all trainable parameters; scope {params!r} needs `engine=native`",
            source="params",
        )


@contextlib.contextmanager
def _pyhessian_session(model: nn.Module, data: AnalysisData, seed: int):
    """Build a ``pyhessian.hessian`` for (model, data); default dtype = model dtype, seeded RNG.

    Yields ``(hessian_object, counter)`` where ``counter["matvecs"]`` counts Hessian products.
    Parameter ``.grad`` fields (pyhessian leaves graph-carrying gradients) are cleared after.
    """
    import importlib

    try:
        pyhessian_module: Any = importlib.import_module("pyhessian.hessian")
    except ImportError:
        raise UsageError(
            "the pyhessian engine needs the PyHessian package, an optional extra: "
            "pip install 'sharpcli[pyhessian]'",
            source="engine",
        ) from None
    pyhessian_hessian_module_class = pyhessian_module.hessian

    if data.world_size > 1:
        raise UsageError("pyhessian cannot run data-parallel; use `engine=native`", source="engine")
    prepare_model_for_analysis(model)
    params = [p for p in model.parameters() if p.requires_grad]
    dtype, device = params[0].dtype, params[0].device
    if device.type != "cpu":
        raise UsageError("the pyhessian engine runs on CPU here (cuda=False)", source="device")
    batches = [to_model_batch(x_b, y_b, dtype, device) for x_b, y_b, _ in data.batches()]
    criterion = loss_fn(data.loss)
    counter = {"matvecs": 0}
    original_hvp = pyhessian_module.hessian_vector_product
    # pyhessian calls backward(create_graph=True) (its memory leak, issue #25); torch warns on every
    # call. The cycle is broken by clearing .grad below; keep the user's terminal clean.
    import warnings

    warning_filter = warnings.catch_warnings()
    warning_filter.__enter__()
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")

    def counting_hvp(*args, **kwargs):
        counter["matvecs"] += 1
        return original_hvp(*args, **kwargs)

    old_dtype = torch.get_default_dtype()
    model.zero_grad(set_to_none=True)
    try:
        torch.set_default_dtype(dtype)
        pyhessian_module.hessian_vector_product = counting_hvp
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            if len(batches) == 1:
                h = pyhessian_hessian_module_class(model, criterion, data=batches[0], cuda=False)
            else:
                h = pyhessian_hessian_module_class(model, criterion, dataloader=batches, cuda=False)
                original_loader_hvp = h.dataloader_hv_product

                def counting_loader_hvp(v):
                    counter["matvecs"] += 1
                    return original_loader_hvp(v)

                h.dataloader_hv_product = counting_loader_hvp
            yield h, counter
    except (RuntimeError, TypeError, AttributeError) as error:
        raise UsageError(
            f"pyhessian 0.1 failed ({type(error).__name__}: {str(error).splitlines()[0]}); "
            "use `engine=native`",
            source="engine",
        ) from error
    finally:
        warning_filter.__exit__(None, None, None)
        pyhessian_module.hessian_vector_product = original_hvp
        torch.set_default_dtype(old_dtype)
        model.zero_grad(set_to_none=True)


def pyhessian_eigenvalues(
    model: nn.Module,
    data: AnalysisData,
    *,
    top_k: int = 1,
    tol: float = 1e-3,
    max_matvecs: int = 100,
    seed: int = 0,
    params: str | None = None,
    verify_residuals: bool = True,
) -> EigenResult:
    """Top-``top_k`` eigenvalues by pyhessian's power iteration (largest |eigenvalue| first).

    Returned descending. With ``verify_residuals`` the Ritz residual of each returned
    eigenvector is computed by the native Hessian operator (one product each, counted in
    ``matvecs`` separately in the notes); ``converged`` is then ``residual <= tol |lambda|``.

    Args:
        model: the model.
        data: the analysis set.
        top_k: how many eigenvalues.
        tol: pyhessian's relative-change tolerance.
        max_matvecs: pyhessian's most iterations per eigenvalue.
        seed: seeds torch's generator for pyhessian's start vectors.
        params: the parameter scope spec (see :meth:`~sharpcli.curvature.products.scope.ParamScope.resolve`).
        verify_residuals: measure each eigenvector's residual with the native operator.

    Returns:
        An :class:`~sharpcli.curvature.eigen.ritz.EigenResult` with ``engine="pyhessian"`` notes.
    """
    _check_scope(params)
    if int(top_k) < 1:
        raise UsageError(f"top-k must be >= 1, got {top_k}", source="top_k")
    with _pyhessian_session(model, data, seed) as (h, counter):
        values, vectors = h.eigenvalues(maxIter=int(max_matvecs), tol=float(tol), top_n=int(top_k))
        vectors = [[t.detach() for t in vec] for vec in vectors]
        matvecs = counter["matvecs"]
    scope = ParamScope.resolve(model, "all")
    residuals: list[float | None] = [None] * len(values)
    converged = [False] * len(values)
    notes = [
        "pyhessian 0.1 power iteration: largest |eigenvalue| first, relative-change stop "
        f"rule (tol {tol}), no residuals of its own"
    ]
    if verify_residuals:
        op = HessianOperator(model, data, scope)
        for i, (lam, vec) in enumerate(zip(values, vectors)):
            u = scope.flatten(vec).to(dtype=scope.dtype)
            # float64 subtraction and norm around the product (see ritz_residuals)
            residuals[i] = ritz_residuals(op, [lam], u[:, None])[0]
            converged[i] = residuals[i] <= tol * abs(lam)
        notes.append(
            f"residuals computed by sharpcli's native Hessian ({op.matvecs} extra products)"
        )
    order = sorted(range(len(values)), key=lambda i: -values[i])
    return EigenResult(
        eigenvalues=[float(values[i]) for i in order],
        residuals=[residuals[i] for i in order],
        converged=[converged[i] for i in order],
        matvecs=matvecs,
        method="power",
        which="largest-magnitude",
        tol=float(tol),
        engine=ENGINE,
        notes=notes,
    )


def pyhessian_trace(
    model: nn.Module,
    data: AnalysisData,
    *,
    tol: float = 1e-3,
    max_matvecs: int = 100,
    seed: int = 0,
    params: str | None = None,
    run_all: bool = False,
) -> TraceResult:
    """Hessian trace by pyhessian's Hutchinson (running-mean stop rule, no per-layer split).

    ``estimate`` is the mean of its samples ``v^T H v``; ``stderr`` is computed here from those
    samples (sample std / sqrt(n), ``None`` with one sample) since pyhessian gives none; its
    stop rule is not a standard-error rule, so ``converged`` only says it stopped before
    ``max_matvecs``. ``run_all`` disables its stop rule (``tol=-inf``): exactly ``max_matvecs`` samples.

    Args:
        model: the model.
        data: the analysis set.
        tol: pyhessian's running-mean tolerance.
        max_matvecs: the most samples.
        seed: seeds torch's generator for pyhessian's probes.
        params: the parameter scope spec.
        run_all: take exactly ``max_matvecs`` samples.

    Returns:
        A :class:`~sharpcli.curvature.trace.probes.TraceResult` with ``engine="pyhessian"``.
    """
    _check_scope(params)
    rule_tol = float("-inf") if run_all else float(tol)
    with _pyhessian_session(model, data, seed) as (h, counter):
        samples = [float(s) for s in h.trace(maxIter=int(max_matvecs), tol=rule_tol)]
        matvecs = counter["matvecs"]
    n = len(samples)
    mean = sum(samples) / n
    stderr = None
    if n >= 2:
        variance = sum((s - mean) ** 2 for s in samples) / (n - 1)
        stderr = math.sqrt(variance / n)
    return TraceResult(
        estimate=mean,
        stderr=stderr,
        matvecs=matvecs,
        samples=n,
        estimator=HUTCHINSON,
        converged=n < int(max_matvecs),
        tol=float(tol),
        by_layer={},
        engine=ENGINE,
        notes=[
            f"pyhessian 0.1 Hutchinson: {n} samples, "
            + (
                "stop rule disabled"
                if run_all
                else f"running-mean change < {tol} stop rule (signed denominator)"
            )
            + "; it reports no standard error (computed here from its samples); no per-layer traces"
        ],
    )


def pyhessian_density(*_args, **_kwargs):
    """Refused: pyhessian 0.1 ``density()`` calls ``torch.eig``, which torch removed."""
    raise UsageError(
        "pyhessian 0.1 density() calls the removed torch.eig; use `engine=native` for the spectral density",
        source="engine",
    )
