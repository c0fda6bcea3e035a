"""The values an option takes, where they form a set: ``--help`` lists them, completion offers them.

Closed sets are ``typing.Literal`` types: typer shows them in the help (``<largest|smallest|both>``),
refuses any other value before the command runs (exit 2, one line) and completes them in the
shell. Open sets, whose values a registry can extend (``--operator``), that take parameters
(``--activation beta-gelu:beta=4``) or that are comma lists (``--metrics eigen,trace``), stay
strings checked by the library; their completion offers the built-in values and their metavar or
help lists them.

The library keeps its own value sets and checks (a library caller passes strings);
``tests/test_cli_options.py`` keeps these equal to them. They are spelled out here because
``sharp --help`` must not import torch, which the library modules do.
"""

from typing import Callable, Literal

# ---------------------------------------------------------------------------- closed sets
Split = Literal["train", "test"]  # sharpcli.io.datasets_common.SPLITS
Dtype = Literal["float32", "float64"]  # sharpcli.session.DTYPES
Which = Literal["largest", "smallest", "both"]  # sharpcli.curvature.lanczos.WHICH
Method = Literal["lanczos", "power"]  # sharpcli.analyses.spectrum.METHODS
Estimator = Literal["hutchpp", "hutchinson", "gn-split", "exact"]  # spectrum.ESTIMATORS
Engine = Literal["native", "pyhessian"]  # spectrum.ENGINES
TokenReduction = Literal["tokens", "samples"]  # sharpcli.losses.TOKEN_REDUCTIONS
GGNEstimator = Literal["auto", "exact", "sampled", "hutchinson"]  # spectrum.GGN_ESTIMATORS
Model = Literal["mlp", "cnn", "vgg-small", "resnet"]  # sharpcli.models.zoo.MODEL_NAMES
Optimizer = Literal["sgd", "adam"]  # sharpcli.training.loop.OPTIMIZERS
Schedule = Literal["constant", "cosine"]  # sharpcli.training.loop.SCHEDULES
RescaleMode = Literal["global", "layer"]  # sharpcli.analyses.rescale.MODES
EpsilonKind = Literal["full", "minibatch"]  # sharpcli.analyses.bounds.EPSILON_KINDS
TableFormat = Literal["table", "csv", "markdown", "json"]  # sharpcli.report.compare.FORMATS

# ---------------------------------------------------------------------------- open sets
# the built-in curvature operators (sharpcli.curvature.registry; register_operator adds more)
OPERATORS = ("hessian", "ggn", "nme")
# sharpcli.analyses.analyze.METRICS: analyze --metrics, sweep --metrics (comma lists)
METRICS = ("eigen", "trace", "frobenius", "gn-nme", "activation-stats")
# sharpcli.analyses.tracking.TRACKABLE: train --track (a comma list)
TRACKABLE = ("eigen", "trace", "gn-nme", "frobenius")
# sharpcli.analyses.bounds.CHECKS: bound-check --check (repeated or a comma list)
CHECKS = ("theorem2", "noise-stability")
# sharpcli.models.activations: the names; beta-gelu and augmented-relu take :beta=B
ACTIVATIONS = ("relu", "gelu", "beta-gelu", "augmented-relu", "diminished-gelu")
# torch device types offered by completion; any torch device string is accepted (cuda:1)
DEVICES = ("cpu", "cuda", "mps")
# the built-in regularizers (sharpcli.training.regularizers.REGISTRY; register adds more)
REGULARIZERS = (
    "none",
    "wd",
    "dropout",
    "ad",
    "sam",
    "usam",
    "asam",
    "gp",
    "hessian-trace",
    "gn-trace",
    "weight-noise",
    "nso",
    "fa",
)


def completer(values: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Shell completion of one value out of ``values``."""

    def complete(incomplete: str) -> list[str]:
        return [v for v in values if v.startswith(incomplete)]

    return complete


def list_completer(values: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Shell completion of a comma list of ``values``: ``eigen,tr`` -> ``eigen,trace``; a value
    already in the list is not offered again."""

    def complete(incomplete: str) -> list[str]:
        head, _, last = incomplete.rpartition(",")
        taken = set(head.split(",")) if head else set()
        prefix = f"{head}," if head else ""
        return [prefix + v for v in values if v.startswith(last) and v not in taken]

    return complete
