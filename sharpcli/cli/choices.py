"""The values an option takes, where they form a set: ``--help`` lists them, completion offers them.

Closed sets are ``typing.Literal`` types: typer shows them in the help (``<largest|smallest|both>``),
refuses any other value before the command runs (exit 2, one line) and completes them in the
shell. Open sets, whose values a registry can extend (``--operator``), that take parameters
(``--activation beta-gelu:beta=4``) or that are comma lists (``--metrics eigen,trace``), stay
strings checked by the library; their completion offers the built-in values and their metavar or
help lists them.

The named things (regularizers, operators, estimators, activations) are read from
:mod:`sharpcli.catalogue`, which imports no torch, so the help and completion list exactly
what the library accepts, extensions registered in this process included. The other closed
sets are the library's own, spelled out here because ``sharp --help`` must not import torch,
which the library modules do (``tests/test_cli_options.py`` keeps them equal).
"""

from typing import Callable, Literal, Union

from sharpcli import catalogue
from sharpcli.registry import Registry

# ---------------------------------------------------------------------------- closed sets
Split = Literal["train", "test"]  # sharpcli.io.datasets_common.SPLITS
Dtype = Literal["float32", "float64"]  # sharpcli.preflight.DTYPES
Which = Literal["largest", "smallest", "both"]  # sharpcli.curvature.lanczos.WHICH
Method = Literal["lanczos", "power"]  # sharpcli.analyses.spectrum.METHODS
Estimator = Literal[catalogue.ESTIMATORS.builtin_names()]  # type: ignore[valid-type]
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
# the curvature operators (register_operator adds more)
OPERATORS = catalogue.OPERATORS
# sharpcli.analyses.analyze.METRICS: analyze --metrics, sweep --metrics (comma lists)
METRICS = ("eigen", "trace", "frobenius", "gn-nme", "activation-stats")
# sharpcli.analyses.tracking.TRACKABLE: train --track (a comma list)
TRACKABLE = ("eigen", "trace", "gn-nme", "frobenius")
# sharpcli.analyses.bounds.CHECKS: bound-check --check (repeated or a comma list)
CHECKS = ("theorem2", "noise-stability")
# the activations; beta-gelu and augmented-relu take :beta=B
ACTIVATIONS = catalogue.ACTIVATIONS
# torch device types offered by completion; any torch device string is accepted (cuda:1)
DEVICES = ("cpu", "cuda", "mps")
# the regularizers (sharpcli.training.regularizers.register adds more)
REGULARIZERS = catalogue.REGULARIZERS

Values = Union[tuple[str, ...], Registry]


def names_of(values: Values) -> tuple[str, ...]:
    """The values of a set: a tuple as it is, a registry's names as they are now.

    Args:
        values: a tuple or a registry of :mod:`sharpcli.catalogue`.

    Returns:
        The values.
    """
    return values.names() if isinstance(values, Registry) else values


def metavar(values: Values, *, params: bool = False) -> str:
    """An option's placeholder: ``NAME``, or ``NAME[:k=v,...]`` for a kind whose names take
    parameters by the grammar of :func:`sharpcli.registry.parse_spec`; where every entry
    with parameters takes the same one, ``NAME[:k=V]`` spells it (``NAME[:beta=B]``).

    Args:
        values: the set.
        params: whether its names take parameters.

    Returns:
        The placeholder.
    """
    if not params:
        return "NAME"
    keys = (
        {p.name for e in values.entries() for p in e.params}
        if isinstance(values, Registry)
        else set()
    )
    if len(keys) == 1:
        (key,) = keys
        return f"NAME[:{key}={key[0].upper()}]"
    return "NAME[:k=v,...]"


def completer(values: Values) -> Callable[[str], list[str]]:
    """Shell completion of one value out of ``values`` (a registry's names when completing).

    Args:
        values: a tuple or a registry of :mod:`sharpcli.catalogue`.

    Returns:
        The completion function.
    """

    def complete(incomplete: str) -> list[str]:
        return [v for v in names_of(values) if v.startswith(incomplete)]

    return complete


def list_completer(values: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Shell completion of a comma list of ``values``: ``eigen,tr`` -> ``eigen,trace``; a value
    already in the list is not offered again.

    Args:
        values: the values.

    Returns:
        The completion function.
    """

    def complete(incomplete: str) -> list[str]:
        head, _, last = incomplete.rpartition(",")
        taken = set(head.split(",")) if head else set()
        prefix = f"{head}," if head else ""
        return [prefix + v for v in values if v.startswith(last) and v not in taken]

    return complete
