"""Curvature: matrix-free H/G/N products and the estimators built on them, by algorithm.

``products/`` (the analysis set, the parameter scope, the engine and its graphs),
``operators/`` (the operators by ``--operator`` name), ``eigen/`` (Lanczos, power iteration),
``trace/`` (Hutchinson, Hutch++, the Gauss-Newton split, exact traces), ``diagonal`` and
``density`` (stochastic Lanczos quadrature).

Methods, by paper key: the H = G + N split [NME] eq. 2, Gauss-Newton products
[Schraudolph2002], Lanczos [Lanczos1950] with full reorthogonalisation [Parlett1998], traces by
[Hutchinson1989] and [Hutch++], per-sample gradient norms [Goodfellow2015] [Rochette2019],
spectral density [Ubaru2017] [Ghorbani2019]. The commands that use
them: ``sharp eigen``, ``trace``, ``gn-nme`` and ``density``."""

from sharpcli.curvature.density import SpectralDensity, spectral_density
from sharpcli.curvature.eigen.lanczos import lanczos
from sharpcli.curvature.eigen.power import power_iteration
from sharpcli.curvature.eigen.ritz import EigenResult, lanczos_tridiagonal, ritz_residuals
from sharpcli.curvature.operators.hessian import (
    DEFAULT_CACHE_BYTES,
    CurvatureOperator,
    GGNOperator,
    HessianOperator,
    LinearCombination,
    MatrixOperator,
    NMEOperator,
    joint_matmat,
)
from sharpcli.curvature.operators.registry import (
    OPERATORS,
    OperatorSpec,
    build_operator,
    register_operator,
    unregister_operator,
)
from sharpcli.curvature.products.data import (
    AnalysisData,
    all_reduce_sum,
    determinism_check,
    distributed_rank_and_world,
    prepare_model_for_analysis,
    train_mode_modules,
)
from sharpcli.curvature.products.engine import CurvatureEngine
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.ggn import exact_ggn_trace, gn_split_trace
from sharpcli.curvature.trace.hutchinson import frobenius_sq
from sharpcli.curvature.trace.hutchinson import hutchinson as hutchinson
from sharpcli.curvature.trace.hutchpp import hutchpp as hutchpp
from sharpcli.curvature.trace.probes import TraceResult
from sharpcli.curvature.trace.sampled_ggn import sampled_label_ggn_trace

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
    "register_operator",
    "ritz_residuals",
    "sampled_label_ggn_trace",
    "spectral_density",
    "train_mode_modules",
    "unregister_operator",
]
