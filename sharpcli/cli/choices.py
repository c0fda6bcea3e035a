"""The values an option takes, where they form a set: ``--help`` lists them, completion offers them.

Closed sets are ``typing.Literal`` types: typer shows them in the help (``<largest|smallest|both>``),
refuses any other value before the command runs (exit 2, one line) and completes them in the
shell. Open sets, whose values a registry can extend (``--operator``), that take parameters
(``--activation beta-gelu:beta=4``) or that are comma lists (``--metrics eigen,trace``), stay
strings checked by the library; their completion offers the built-in values and their metavar or
help lists them.

Every set is read from :mod:`sharpcli.catalogue`, which imports no torch, the one place it is
spelled: the closed sets are its value tuples, which the library modules that accept the
values read too, and the named things (regularizers, operators, estimators, activations) are
its registries, so the help and completion list exactly what the library accepts, extensions
registered in this process included.
"""

from typing import Callable, Literal, TypeAlias, Union

from sharpcli import catalogue
from sharpcli.registry import Registry

# ---------------------------------------------------------------------------- closed sets
# Literal[("a", "b")] is Literal["a", "b"]: typer reads the values from the catalogue's tuples
Split = Literal[catalogue.SPLITS]  # type: ignore[valid-type]
Dtype = Literal[catalogue.DTYPES]  # type: ignore[valid-type]
Which = Literal[catalogue.WHICH]  # type: ignore[valid-type]
Method = Literal[catalogue.METHODS]  # type: ignore[valid-type]
Engine = Literal[catalogue.ENGINES]  # type: ignore[valid-type]
TokenReduction = Literal[catalogue.TOKEN_REDUCTIONS]  # type: ignore[valid-type]
GGNEstimator = Literal[catalogue.GGN_ESTIMATORS]  # type: ignore[valid-type]
Model = Literal[catalogue.MODEL_NAMES]  # type: ignore[valid-type]
Optimizer = Literal[catalogue.OPTIMIZERS]  # type: ignore[valid-type]
Schedule = Literal[catalogue.SCHEDULES]  # type: ignore[valid-type]
TrackOn = Literal[catalogue.TRACK_ON]  # type: ignore[valid-type]
Precision = Literal[catalogue.PRECISIONS]  # type: ignore[valid-type]
AscentSync = Literal[catalogue.ASCENT_SYNCS]  # type: ignore[valid-type]
RescaleMode = Literal[catalogue.RESCALE_MODES]  # type: ignore[valid-type]
EpsilonKind = Literal[catalogue.EPSILON_KINDS]  # type: ignore[valid-type]
TableFormat = Literal[catalogue.TABLE_FORMATS]  # type: ignore[valid-type]
SharpnessKind = Literal[catalogue.SHARPNESS_KINDS]  # type: ignore[valid-type]
SharpnessNorm = Literal[catalogue.SHARPNESS_NORMS]  # type: ignore[valid-type]
NormLayers = Literal[catalogue.NORM_LAYERS]  # type: ignore[valid-type]
LandscapeBiasBN = Literal[catalogue.LANDSCAPE_BIAS_BN]  # type: ignore[valid-type]
GapKind = Literal[catalogue.GAP_KINDS]  # type: ignore[valid-type]
DiagonalEstimator: TypeAlias = Literal[catalogue.DIAGONAL_ESTIMATORS.builtin_names()]  # type: ignore[valid-type]

Values = Union[tuple[str, ...], Registry]


def names_of(values: Values) -> tuple[str, ...]:
    """The values of a set: a tuple as it is, a registry's names as they are now.

    Args:
        values: a tuple or a registry of :mod:`sharpcli.catalogue`.
    """
    return values.names() if isinstance(values, Registry) else values


def metavar(values: Values, *, params: bool = False) -> str:
    """An option's placeholder: ``NAME``, or ``NAME[:k=v,...]`` for a kind whose names take
    parameters by the grammar of :func:`sharpcli.specs.parse_spec`; where every entry
    with parameters takes the same one, ``NAME[:k=V]`` spells it (``NAME[:beta=B]``).

    Args:
        values: the set.
        params: whether its names take parameters.
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
    """

    def complete(incomplete: str) -> list[str]:
        return [v for v in names_of(values) if v.startswith(incomplete)]

    return complete


def list_completer(values: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Shell completion of a comma list of ``values``: ``eigen,tr`` -> ``eigen,trace``; a value
    already in the list is not offered again.

    Args:
        values: the values.
    """

    def complete(incomplete: str) -> list[str]:
        head, _, last = incomplete.rpartition(",")
        taken = set(head.split(",")) if head else set()
        prefix = f"{head}," if head else ""
        return [prefix + v for v in values if v.startswith(last) and v not in taken]

    return complete
