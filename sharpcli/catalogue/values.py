"""The closed value sets of options, each set once.

Read by the library module that accepts its values and by the CLI, whose ``Literal`` types
``--help`` lists and completion offers.

This module imports no torch.
"""

from __future__ import annotations

__all__ = [
    "CSV",
    "DENSITY_CURVE",
    "DENSITY_KEY",
    "DEVICES",
    "DTYPES",
    "ENGINES",
    "FROBENIUS_SQ_KEY",
    "EPSILON_KINDS",
    "EXACT_HVP",
    "FINITE_DIFFERENCE",
    "GGN_AUTO",
    "GGN_EXACT",
    "GGN_HUTCHINSON",
    "GGN_SAMPLED",
    "GGN_ESTIMATORS",
    "GRID_KEY",
    "HVP_METHODS",
    "METHODS",
    "OPTIMIZERS",
    "OPTIMIZER_DECLARATIONS",
    "PRECISIONS",
    "QUANTITIES",
    "ASCENT_SYNCS",
    "RESCALE_MODES",
    "SCRATCH_OFF",
    "SCHEDULES",
    "SPLITS",
    "TABLE_FORMATS",
    "TEST",
    "TOKEN_REDUCTIONS",
    "TRACK_ON",
    "TRAIN",
    "TRACE_KEY",
    "WHICH",
    "ALONG_EIGEN",
    "GAP_KINDS",
    "LANDSCAPE_ALONG",
    "LANDSCAPE_BIAS_BN",
    "NORM_LAYERS",
    "SHARPNESS_KINDS",
    "SHARPNESS_NORMS",
]

# data and numbers: sharpcli.io.data.dataset, sharpcli.preflight; TRAIN and TEST also name
# the files and folders that hold a split (CIFAR-100's train/test, a DatasetDict's splits), and
# TRAIN what a training run is called (the train command, its report's command and progress,
# the checkpoint's train block)
TRAIN, TEST = "train", "test"
SPLITS = (TRAIN, TEST)
DTYPES = ("float32", "float64")
# torch device types offered by completion; any torch device string is accepted (cuda:1)
DEVICES = ("cpu", "cuda", "mps")

# curvature and spectra: sharpcli.curvature.eigen.lanczos, sharpcli.analyses.spectrum
WHICH = ("largest", "smallest", "both")
METHODS = ("lanczos", "power")
ENGINES = ("native", "pyhessian")
# SHARP_SCRATCH values that keep every Krylov basis in memory: sharpcli.curvature.eigen.krylov
SCRATCH_OFF = ("", "off", "memory", "none")
# how a Hessian product is taken: sharpcli.curvature.products.finite_difference
HVP_METHODS = ("exact", "finite-difference")
EXACT_HVP, FINITE_DIFFERENCE = HVP_METHODS
# the estimators of tr(G) that `sharp gn-nme` checks the split's against:
# sharpcli.analyses.spectrum.ggn_check_plan
GGN_ESTIMATORS = ("auto", "exact", "sampled", "hutchinson")
GGN_AUTO, GGN_EXACT, GGN_SAMPLED, GGN_HUTCHINSON = GGN_ESTIMATORS
# what a probe pass estimates of an operator A (sharpcli.curvature.trace.probes, split): its trace
# tr(A), or Tr(A^2) = ||A||_F^2 (``trace --square``); each is also the key of reports that hold it
QUANTITIES = ("trace", "frobenius_sq")
TRACE_KEY, FROBENIUS_SQ_KEY = QUANTITIES
# a spectral density as reports hold it (sharpcli.curvature.density): the eigenvalue grid and
# the density on it
DENSITY_CURVE = ("grid", "density")
GRID_KEY, DENSITY_KEY = DENSITY_CURVE

# models and training: sharpcli.losses, sharpcli.training.config (the models: catalogue.MODELS)
TOKEN_REDUCTIONS = ("tokens", "samples")
# each optimizer once: the torch.optim class it is and the hyper-parameters its spec
# ``--optimizer NAME[:k=v,...]`` may set (their types and ranges: sharpcli.training.config)
OPTIMIZER_DECLARATIONS = {
    "sgd": ("SGD", ("nesterov", "weight_decay")),
    "adam": ("Adam", ("beta1", "beta2", "eps", "weight_decay")),
    "adamw": ("AdamW", ("beta1", "beta2", "eps", "weight_decay")),
    "rmsprop": ("RMSprop", ("alpha", "eps", "momentum", "weight_decay")),
}
OPTIMIZERS = tuple(OPTIMIZER_DECLARATIONS)
SCHEDULES = ("constant", "cosine")
# what ``sharp train --track`` measures on: a fixed seeded subset of the training set, or the
# training batch of the step just taken (--track-on)
TRACK_ON = ("subset", "batch")
# sharpcli.training.precision (--precision), sharpcli.training.data_parallel (--ascent-sync)
PRECISIONS = ("fp32", "bf16", "fp16")
# the data-parallel semantics of the ascent oracles' clean gradient (sam, usam, asam): each
# replica's own (m-sharpness, m the local batch) or all-reduced once (sharp train
# --ascent-sync; sharpcli.regularizers.PerturbedOptimizer(ascent_sync=...))
ASCENT_SYNCS = ("per-replica", "global")

# analyses and reports: sharpcli.analyses.rescale, sharpcli.report.compare (analyze's metrics,
# train's tracked quantities, bound-check's checks: sharpcli.catalogue)
RESCALE_MODES = ("global", "layer")
EPSILON_KINDS = ("full", "minibatch")
# CSV: also the key of the landscape report's table file
CSV = "csv"
TABLE_FORMATS = ("table", CSV, "markdown", "json")

# sharp sharpness and sharp landscape (sharpcli.analyses.sharpness, sharpcli.analyses.landscape)
# worst case max_{||delta/c||_p <= rho}, average case E_delta ([Andriushchenko2023])
SHARPNESS_KINDS = ("worst-case", "average")
SHARPNESS_NORMS = ("l2", "linf")
# whether normalization layers' affine parameters are perturbed
NORM_LAYERS = ("include", "exclude")
# the directions of a landscape: filter-normalized random ones, the top Hessian eigenvectors
# (which need the curvature), the line to a second checkpoint, or read from a file
LANDSCAPE_ALONG = ("random", "eigen", "checkpoint", "file")
ALONG_EIGEN = LANDSCAPE_ALONG[1]  # the directions that need the curvature
# what the random landscape directions hold on 1-D parameters (biases, normalization
# parameters): zero (the --xignore biasbn of [Li2018]'s code) or the weights themselves
LANDSCAPE_BIAS_BN = ("zero", "weights")
# the generalization gap of compare's and sweep's Kendall tau: test error - train error, or
# test loss - train loss (sharpcli.report.rank_correlation)
GAP_KINDS = ("error", "loss")
