"""Curvature engine: the analysis set, parameter scopes, matrix-free H/G/N products (the
operators by name: :mod:`sharpcli.curvature.registry`) and the estimators built on them
(Lanczos, power iteration, Hutchinson/Hutch++ traces, Gauss-Newton traces, stochastic Lanczos
quadrature) plus the PyHessian parity engine.

Methods, by paper key: the H = G + N split [NME] eq. 2, Gauss-Newton products
[Schraudolph2002], Lanczos [Lanczos1950] with full reorthogonalisation [Parlett1998], traces by
[Hutchinson1989] and [Hutch++], per-sample gradient norms [Goodfellow2015] [Rochette2019],
spectral density [Ubaru2017] [Ghorbani2019], parity with [PyHessian]. The commands that use
them: ``sharp eigen``, ``trace``, ``gn-nme`` and ``density``."""

from sharpcli.curvature.data import (
    AnalysisData,
    all_reduce_sum,
    determinism_check,
    distributed_rank_and_world,
    prepare_model_for_analysis,
    train_mode_modules,
)
from sharpcli.curvature.density import SpectralDensity, spectral_density
from sharpcli.curvature.engine import CurvatureEngine
from sharpcli.curvature.ggn_trace import exact_ggn_trace, gn_split_trace
from sharpcli.curvature.hutchpp import hutchpp as hutchpp
from sharpcli.curvature.lanczos import lanczos
from sharpcli.curvature.operators import (
    DEFAULT_CACHE_BYTES,
    CurvatureOperator,
    GGNOperator,
    HessianOperator,
    LinearCombination,
    MatrixOperator,
    NMEOperator,
    joint_matmat,
)
from sharpcli.curvature.power import power_iteration
from sharpcli.curvature.probes import TraceResult
from sharpcli.curvature.pyhessian_engine import (
    pyhessian_density,
    pyhessian_eigenvalues,
    pyhessian_trace,
)
from sharpcli.curvature.registry import (
    OPERATORS,
    OperatorSpec,
    build_operator,
    register_operator,
    unregister_operator,
)
from sharpcli.curvature.ritz import EigenResult, ritz_residuals
from sharpcli.curvature.sampled_ggn import sampled_label_ggn_trace
from sharpcli.curvature.scope import ParamScope
from sharpcli.curvature.trace import frobenius_sq
from sharpcli.curvature.trace import hutchinson as hutchinson
from sharpcli.curvature.tridiagonal import lanczos_tridiagonal

# and hutchinson and hutchpp, re-exported above (``x as x``): functions named like the trace
# estimators they implement, whose names are spelled only where they are declared
__all__ = [
    "DEFAULT_CACHE_BYTES",
    "OPERATORS",
    "AnalysisData",
    "CurvatureEngine",
    "CurvatureOperator",
    "EigenResult",
    "GGNOperator",
    "HessianOperator",
    "LinearCombination",
    "MatrixOperator",
    "NMEOperator",
    "OperatorSpec",
    "ParamScope",
    "SpectralDensity",
    "TraceResult",
    "all_reduce_sum",
    "build_operator",
    "determinism_check",
    "distributed_rank_and_world",
    "exact_ggn_trace",
    "gn_split_trace",
    "frobenius_sq",
    "joint_matmat",
    "lanczos",
    "lanczos_tridiagonal",
    "power_iteration",
    "prepare_model_for_analysis",
    "pyhessian_density",
    "pyhessian_eigenvalues",
    "pyhessian_trace",
    "register_operator",
    "ritz_residuals",
    "sampled_label_ggn_trace",
    "spectral_density",
    "train_mode_modules",
    "unregister_operator",
]
