"""The catalogue: every built-in thing of ``sharp`` that has a name, as torch-free records.

One :class:`~sharpcli.registry.Registry` per kind holds the :class:`~sharpcli.registry.Entry`
of each built-in: name, one-line summary, typed parameters with defaults and ranges, the
paper key of docs/references.md, data-parallel exactness where it applies, and the
implementation as ``"module:attr"``, imported only when it is used. Regularizers, trace
and diagonal estimators, curvature operators, losses, activations, data formats,
built-in datasets, models, commands, metrics, tracked quantities and checks are declared
beside their code (:func:`sharpcli.registry.declare`);
:mod:`sharpcli.catalogue.index` is generated from those
declarations by ``python -m sharpcli.catalogue.generate``. The closed value sets of options
(:mod:`sharpcli.catalogue.values`) are here too, read by the library modules that accept
them. Everything that lists names reads them from here: the CLI's choices, ``--help``, shell
completion and metavars, the docs' tables and the report schema.

Modules: ``regularizers`` (``--reg``), ``curvature`` (operators, estimators), ``data`` (data
formats, built-in datasets), ``names`` (losses, activations, models, commands),
``measures`` (the metrics of ``analyze``), ``values`` (closed value sets). None imports
torch: ``sharp --help`` reads them.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.curvature import (
    DIAGONAL_ESTIMATORS,
    ESTIMATORS,
    GGN,
    HESSIAN,
    NME,
    OPERATORS,
    entries_help,
    operator_help,
    operator_table,
)
from sharpcli.catalogue.data import DATA_FORMATS, DATASETS, DEFAULT_DATASET
from sharpcli.catalogue.measures import CHECKS, DEFAULT_METRICS, METRICS, TRACKABLE
from sharpcli.catalogue.names import (
    ACTIVATIONS,
    COMMANDS,
    DEFAULT_MODEL,
    LOSSES,
    MODEL_NAMES,
    MODELS,
)
from sharpcli.catalogue.regularizers import REGULARIZERS
from sharpcli.catalogue.sharpness import (
    ALONG_EIGEN,
    GAP_KINDS,
    LANDSCAPE_ALONG,
    LANDSCAPE_BIAS_BN,
    NORM_LAYERS,
    SHARPNESS_KINDS,
    SHARPNESS_NORMS,
)
from sharpcli.catalogue.values import (
    ASCENT_SYNCS,
    DEVICES,
    DTYPES,
    ENGINES,
    EPSILON_KINDS,
    EXACT_HVP,
    FINITE_DIFFERENCE,
    GGN_ESTIMATORS,
    GGN_EXACT,
    GGN_HUTCHINSON,
    GGN_SAMPLED,
    HVP_METHODS,
    METHODS,
    OPTIMIZER_DECLARATIONS,
    OPTIMIZERS,
    PRECISIONS,
    RESCALE_MODES,
    SCHEDULES,
    SPLITS,
    TABLE_FORMATS,
    TEST,
    TOKEN_REDUCTIONS,
    TRACK_ON,
    TRAIN,
    WHICH,
)
from sharpcli.registry import Registry

__all__ = [
    "ACTIVATIONS",
    "ALONG_EIGEN",
    "ASCENT_SYNCS",
    "CHECKS",
    "COMMANDS",
    "DATASETS",
    "DATA_FORMATS",
    "DEFAULT_DATASET",
    "DEFAULT_METRICS",
    "DEFAULT_MODEL",
    "DEVICES",
    "DIAGONAL_ESTIMATORS",
    "DTYPES",
    "ENGINES",
    "EPSILON_KINDS",
    "EXACT_HVP",
    "FINITE_DIFFERENCE",
    "GGN_EXACT",
    "GGN_HUTCHINSON",
    "GGN_SAMPLED",
    "ESTIMATORS",
    "GAP_KINDS",
    "GGN_ESTIMATORS",
    "HVP_METHODS",
    "KINDS",
    "LANDSCAPE_ALONG",
    "LANDSCAPE_BIAS_BN",
    "LOSSES",
    "METHODS",
    "METRICS",
    "MODEL_NAMES",
    "MODELS",
    "NORM_LAYERS",
    "OPERATORS",
    "HESSIAN",
    "GGN",
    "NME",
    "OPTIMIZER_DECLARATIONS",
    "OPTIMIZERS",
    "PRECISIONS",
    "REGULARIZERS",
    "RESCALE_MODES",
    "SCHEDULES",
    "SHARPNESS_KINDS",
    "SHARPNESS_NORMS",
    "SPLITS",
    "TABLE_FORMATS",
    "TEST",
    "TOKEN_REDUCTIONS",
    "TRACKABLE",
    "TRACK_ON",
    "TRAIN",
    "WHICH",
    "entries_help",
    "operator_help",
    "operator_table",
]

# every kind, by the name the docs' tables use
KINDS: dict[str, Registry[Any]] = {
    "regularizers": REGULARIZERS,
    "operators": OPERATORS,
    "estimators": ESTIMATORS,
    "losses": LOSSES,
    "data formats": DATA_FORMATS,
    "activations": ACTIVATIONS,
    "datasets": DATASETS,
    "models": MODELS,
    "commands": COMMANDS,
}
