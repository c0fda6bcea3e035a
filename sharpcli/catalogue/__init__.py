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

The registries of the curvature (operators, trace and diagonal estimators) are in
:mod:`sharpcli.catalogue.curvature`, every other one below. None of these modules imports
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
from sharpcli.catalogue.index import DECLARED
from sharpcli.catalogue.values import (
    ALONG_EIGEN,
    ASCENT_SYNCS,
    DEVICES,
    DTYPES,
    ENGINES,
    EPSILON_KINDS,
    EXACT_HVP,
    FINITE_DIFFERENCE,
    GAP_KINDS,
    GGN_ESTIMATORS,
    GGN_EXACT,
    GGN_HUTCHINSON,
    GGN_SAMPLED,
    HVP_METHODS,
    LANDSCAPE_ALONG,
    LANDSCAPE_BIAS_BN,
    METHODS,
    NORM_LAYERS,
    OPTIMIZER_DECLARATIONS,
    OPTIMIZERS,
    PRECISIONS,
    RESCALE_MODES,
    SCHEDULES,
    SHARPNESS_KINDS,
    SHARPNESS_NORMS,
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


def _declared(kind: str, source: str, check: str = "", make_entry: str = "") -> Registry[Any]:
    """The registry of ``kind`` over its built-ins' declarations in the generated index.

    An unknown name is reported on ``source``; ``check`` and ``make_entry`` as
    :class:`~sharpcli.registry.Registry` takes them.
    """
    entries = DECLARED.get(kind, ())
    return Registry(kind, source=source, entries=entries, check=check, make_entry=make_entry)


# ``--reg NAME[:k=v,...]`` (sharpcli.regularizers): each built-in's record is its class body
# in sharpcli.regularizers.penalties or .perturbed (declare_regularizer): its summary, its
# hyper-parameters in positional order with defaults and ranges, its paper key, whether
# averaging its gradient over torchrun ranks is exact (``data_parallel``: None, else the reason
# it is not) and, in ``info``, its ``kind`` (none, model, penalty or oracle) and whether it
# needs the input of the final ``nn.Linear``.
REGULARIZERS: Registry[Any] = _declared(
    "regularizer",
    "regs",
    check="sharpcli.regularizers.registry:check_regularizer_class",
    make_entry="sharpcli.regularizers.registry:regularizer_class_entry",
)

# the losses of the analyses and of training (sharpcli.losses, declared there); ``info``:
# whether the labels are classes (accuracy is defined)
LOSSES: Registry[Any] = _declared(
    "loss",
    "loss",
    check="sharpcli.losses:check_loss",
    make_entry="sharpcli.losses:loss_entry",
)


# ``--activation NAME[:beta=B]`` (sharpcli.models.activations, declared there), [NME]
# sections 4.3-4.4
ACTIVATIONS: Registry[Any] = _declared("activation", "activation")

# ``--model NAME`` (sharpcli.models.zoo: each architecture declared on its class, whose ``ARGS``
# are its spec's arguments)
MODELS: Registry[Any] = _declared("model", "model")
MODEL_NAMES: tuple[str, ...] = MODELS.builtin_names()
# the default of ``--model`` (torch-free: TrainConfig's default); "" only while the index holds
# no model (the generator remakes it)
DEFAULT_MODEL = next((e.name for e in MODELS.entries() if e.info.get("default")), "")

# the ``sharp`` commands (sharpcli.cli.cmd_*, each declared beside its function), in the order
# a person uses them (the order of ``sharp --help``). ``info``: its place in that order and the
# --help panel of its own options where not the default
COMMANDS: Registry[Any] = _declared("command", "command")

# ``--data PATH`` (sharpcli.io.data.formats): each format declared on its probe
# (sharpcli.io.data: tensor_files, tables, arrow, vision). ``info["order"]`` matters twice:
# it is the order of the lists in messages, and folder layouts are probed in it (CIFAR-10
# batches win over a CIFAR-100 train/test pair in the same folder).
DATA_FORMATS: Registry[Any] = Registry(
    "data format",
    source="data",
    entries=sorted(DECLARED.get("data format", ()), key=lambda e: int(e.info["order"])),
    check="sharpcli.io.data.formats:check_format",
    make_entry="sharpcli.io.data.formats:format_entry",
)

# ``--data NAME[:k=v,...]``: the built-in synthetic datasets, declared on their generators in
# sharpcli.io.data.builtin, which types and checks their parameters
DATASETS: Registry[Any] = _declared("built-in dataset", "data")
# the default of ``--data`` (torch-free: TrainConfig's default); "" only while the index
# holds no dataset (the generator remakes it)
DEFAULT_DATASET = next((e.name for e in DATASETS.entries() if e.info.get("default")), "")

# The measures of a checkpoint by name: each declared beside its code
# (:func:`sharpcli.registry.declare`) as a function of its command's run. A metric (kind
# "metric": sharpcli.analyses.analyze, .activations, .sharpness) gives in ``info`` its place
# in the list (``order``), whether ``--metrics`` runs it by default (``default``), the result
# keys ``--fail-if`` may read (``keys``) and the rows of the command's table (``rows``). A
# tracked quantity (kind "trackable": sharpcli.analyses.tracking) is declared under the name of
# the metric it follows, with the keys it records and their place in a history row
# (``column``); a check of bound-check (kind "check": sharpcli.analyses.theorem2,
# .noise_stability) as a function of its run. Each command runs the chosen ones through these
# registries.
# ``sharp analyze --metrics`` and ``sharp sweep --metrics``: a comma list of these
METRICS: Registry[Any] = _declared("metric", "metrics")
# what ``--metrics`` runs when not given: the metrics declared as defaults, in order
DEFAULT_METRICS = tuple(e.name for e in METRICS.entries() if e.info.get("default"))

# ``sharp train --track`` and sharpcli.Tracker's ``metrics``: a comma list of these
TRACKABLE: Registry[Any] = _declared("trackable", "track")

# ``sharp bound-check --check``: a comma list of these, run after the bound of AD Corollary 1
CHECKS: Registry[Any] = _declared("check", "check")

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
