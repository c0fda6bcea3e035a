"""The closed value sets of the sharpness and landscape options.

They are the values of ``sharp sharpness`` and ``sharp landscape``, read by
:mod:`sharpcli.analyses.sharpness`, :mod:`sharpcli.analyses.landscape` and the CLI's
``Literal`` types.

This module imports no torch.
"""

from __future__ import annotations

__all__ = [
    "ALONG_EIGEN",
    "GAP_KINDS",
    "LANDSCAPE_ALONG",
    "LANDSCAPE_BIAS_BN",
    "NORM_LAYERS",
    "SHARPNESS_KINDS",
    "SHARPNESS_NORMS",
]

# worst case max_{||delta/c||_p <= rho}, average case E_delta ([Andriushchenko2023])
SHARPNESS_KINDS = ("worst-case", "average")
SHARPNESS_NORMS = ("l2", "linf")
# whether normalization layers' affine parameters are perturbed
NORM_LAYERS = ("include", "exclude")
# the directions of a landscape: filter-normalized random ones, the top Hessian eigenvectors
# (which need the curvature), the line to a second checkpoint, or read from a file
LANDSCAPE_ALONG = ("random", "eigen", "checkpoint", "file")
ALONG_RANDOM, ALONG_EIGEN, ALONG_CHECKPOINT, ALONG_FILE = LANDSCAPE_ALONG
# what the random landscape directions hold on 1-D parameters (biases, normalization
# parameters): zero (the --xignore biasbn of [Li2018]'s code) or the weights themselves
LANDSCAPE_BIAS_BN = ("zero", "weights")
# the generalization gap of compare's and sweep's Kendall tau: test error - train error, or
# test loss - train loss (sharpcli.report.rank_correlation)
GAP_KINDS = ("error", "loss")
