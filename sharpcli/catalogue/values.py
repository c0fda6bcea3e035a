"""The closed value sets of options, each set once.

Read by the library module that accepts its values and by the CLI, whose ``Literal`` types
``--help`` lists and completion offers.

This module imports no torch.
"""

from __future__ import annotations

__all__ = [
    "ASCENT_SYNC",
    "CHECKS",
    "CSV",
    "DEVICES",
    "DTYPES",
    "ENGINES",
    "EPSILON_KINDS",
    "GGN_ESTIMATORS",
    "HVP_METHODS",
    "METHODS",
    "METRICS",
    "NONE",
    "OPTIMIZERS",
    "PRECISIONS",
    "ASCENT_SYNCS",
    "RESCALE_MODES",
    "SCHEDULES",
    "SPLITS",
    "TABLE_FORMATS",
    "TEST",
    "TORCH_REDUCTIONS",
    "TOKEN_REDUCTIONS",
    "TRAIN",
    "TRACKABLE",
    "WHICH",
]

# data and numbers: sharpcli.io.datasets_common, sharpcli.preflight; TRAIN and TEST also name
# the files and folders that hold a split (CIFAR-100's train/test, a DatasetDict's splits), and
# TRAIN what a training run is called (the train command, its report's command and progress,
# the checkpoint's train block)
TRAIN, TEST = "train", "test"
SPLITS = (TRAIN, TEST)
DTYPES = ("float32", "float64")
# torch device types offered by completion; any torch device string is accepted (cuda:1)
DEVICES = ("cpu", "cuda", "mps")

# curvature and spectra: sharpcli.curvature.lanczos, sharpcli.analyses.spectrum
WHICH = ("largest", "smallest", "both")
METHODS = ("lanczos", "power")
ENGINES = ("native", "pyhessian")
# how a Hessian product is taken: sharpcli.curvature.finite_difference
HVP_METHODS = ("exact", "finite-difference")
GGN_ESTIMATORS = ("auto", "exact", "sampled", "hutchinson")

# "none": torch's per-element reduction of a loss (a loss module given to sharp must take the
# mean: sharpcli.io.in_memory; the per-sample losses are made from the per-element ones:
# sharpcli.losses), and what a message says for an empty list
NONE = "none"
TORCH_REDUCTIONS = ("mean", "sum", NONE)

# models and training: sharpcli.losses, sharpcli.training.config (the models: catalogue.MODELS)
TOKEN_REDUCTIONS = ("tokens", "samples")
OPTIMIZERS = ("sgd", "adam")
# the data-parallel semantics of the ascent oracles' clean gradient (sam, usam, asam):
# each replica's own (m-sharpness, m the local batch) or all-reduced once;
# sharpcli.regularizers.PerturbedOptimizer(ascent_sync=...)
ASCENT_SYNC = ("per-replica", "global")
SCHEDULES = ("constant", "cosine")
# sharpcli.training.precision (--precision), sharpcli.training.data_parallel (--ascent-sync)
PRECISIONS = ("fp32", "bf16", "fp16")
ASCENT_SYNCS = ("per-replica", "global")

# analyses and reports: sharpcli.analyses.{analyze,tracking,rescale,bounds},
# sharpcli.report.compare; METRICS, TRACKABLE and CHECKS are comma lists
METRICS = (
    "eigen",
    "trace",
    "frobenius",
    "gn-nme",
    "activation-stats",
    "sharpness",
    "pac-bayes",
    "fisher-rao",
)
TRACKABLE = ("eigen", "trace", "gn-nme", "frobenius", "sharpness")
CHECKS = ("theorem2", "noise-stability")
RESCALE_MODES = ("global", "layer")
EPSILON_KINDS = ("full", "minibatch")
# CSV: also the key of the landscape report's table file
CSV = "csv"
TABLE_FORMATS = ("table", CSV, "markdown", "json")
