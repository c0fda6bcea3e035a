"""The configuration of a training run: :class:`TrainConfig`, its checks, and its
construction from command-line options shared by ``sharp train`` and ``sharp sweep``."""

from __future__ import annotations

import copy
import functools
import math
import types
import typing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Union

from sharpcli import catalogue
from sharpcli.catalogue import DEFAULT_DATASET, DEFAULT_MODEL
from sharpcli.errors import UsageError
from sharpcli.specs import Param, parse_spec

if TYPE_CHECKING:
    from sharpcli.regularizers.base import Regularizer

# This module imports no torch: the CLI reads TrainConfig's defaults as its options' defaults
# when ``sharp`` starts (sharpcli.cli.train_options), and ``sharp --help`` stays free of torch.
# The regularizers (torch) are imported where they are parsed.

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "TrainConfig",
    "validate_config",
    "config_from_options",
    "parse_optimizer",
    "parse_track_every",
    "batch_size_for",
]

OPTIMIZERS = catalogue.OPTIMIZERS
SCHEDULES = catalogue.SCHEDULES
FULL_BATCH = "full"  # --batch-size full: the whole training set, one step per epoch

# The hyper-parameters an optimizer spec sets (``adamw:weight_decay=0.01,beta2=0.99``); which
# optimizer takes which is declared with the optimizer (catalogue.OPTIMIZER_DECLARATIONS).
# A value not given keeps torch's default for that optimizer (AdamW's weight decay 0.01,
# Adam's 0), so the defaults shown here are torch's for Adam and RMSprop.
OPTIMIZER_PARAMS = {
    p.name: p
    for p in (
        Param("beta1", "float", 0.9, "first-moment decay (Adam, AdamW)", minimum=0.0, below=1.0),
        Param("beta2", "float", 0.999, "second-moment decay (Adam, AdamW)", minimum=0.0, below=1.0),
        Param("eps", "float", 1e-8, "added to the root of the second moment", positive=True),
        Param("weight_decay", "float", 0.0, "weight decay (AdamW: decoupled)", minimum=0.0),
        Param("alpha", "float", 0.99, "RMSprop's squared-gradient decay", minimum=0.0, below=1.0),
        Param("momentum", "float", 0.0, "RMSprop's momentum", minimum=0.0, below=1.0),
        Param("nesterov", "choice", 0, "Nesterov momentum (SGD; 1: on)", choices=(0, 1)),
    )
}


def _unknown_optimizer(name: str) -> UsageError:
    return UsageError(
        f"unknown optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}", source="optimizer"
    )


def parse_optimizer(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:k=v,...]`` of ``--optimizer`` as the optimizer's name and the hyper-parameters
    given, typed and checked (:data:`OPTIMIZER_PARAMS`; those not given keep torch's defaults).

    Args:
        spec: e.g. ``adamw:weight_decay=0.01,beta2=0.99``.

    Returns:
        ``("adamw", {"weight_decay": 0.01, "beta2": 0.99})``.

    Raises:
        UsageError: (source ``optimizer``) an unknown name or key, a value out of range.

    >>> parse_optimizer("AdamW:beta2=0.99")
    ('adamw', {'beta2': 0.99})
    """

    def keys_of(name: str):
        declared = catalogue.OPTIMIZER_DECLARATIONS.get(name)
        return None if declared is None else declared[1]

    name, given = parse_spec(
        spec, keys_of, positional=False, source="optimizer", unknown=_unknown_optimizer
    )
    return name, {k: OPTIMIZER_PARAMS[k].convert(name, v, "optimizer") for k, v in given.items()}


def parse_track_every(value: int | str) -> tuple[int, str]:
    """``--track-every`` as ``(count, unit)``: ``N`` or ``Nepochs`` every N epochs (the
    meaning of a plain number since the option exists), ``Nsteps`` every N optimizer steps.

    Raises:
        UsageError: (source ``track_every``) anything else, or a count below 1.

    >>> parse_track_every("10steps"), parse_track_every(2)
    ((10, 'steps'), (2, 'epochs'))
    """
    text = str(value).strip().lower()
    unit = "epochs"
    for suffix in ("steps", "step", "epochs", "epoch"):
        if text.endswith(suffix):
            text, unit = text[: -len(suffix)].strip(), suffix.rstrip("s") + "s"
            break
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise UsageError(
            f"must be N (epochs) or Nsteps with N >= 1, e.g. 10steps; got {value!r}",
            source="track_every",
        )
    return int(text), unit


def batch_size_for(cfg: TrainConfig, samples: int) -> int:
    """The training batch size over ``samples`` training samples: ``full`` (or any size
    beyond it) is the whole set, one step per epoch."""
    if cfg.batch_size == FULL_BATCH:
        return samples
    return min(int(cfg.batch_size), max(samples, 1))


def _default_regularizers() -> list[Any]:
    """The plain loss (the regularizer ``none``), as a spec that TrainConfig parses."""
    return ["none"]


@dataclass
class TrainConfig:
    """Everything that determines a training run; stored in the checkpoint's ``sharpcli.train``.

    ``regs`` holds parsed regularizers (:class:`~sharpcli.regularizers.base.Regularizer`):
    ``NAME[:k=v,...]`` texts given at construction are parsed and their combination checked
    then, once (:func:`sharpcli.regularizers.registry.parse_regs`); :meth:`to_dict` writes
    them back in their canonical spelling.
    """

    model: str = DEFAULT_MODEL
    model_args: dict[str, Any] = field(default_factory=dict)
    model_factory: str | None = None  # module:function building the user's own model
    output: str | None = None  # which of the model's outputs are the logits
    penultimate: str | None = None  # module whose output activation decay penalises
    data: str | dict = DEFAULT_DATASET
    label_column: str | None = None
    epochs: int = 5
    # a run counted in optimizer steps instead (its last epoch partial); None: epochs
    steps: int | None = None
    batch_size: int | str = 64  # or "full": the whole training set
    optimizer: str = "sgd"  # NAME[:k=v,...] (parse_optimizer)
    lr: float = 0.05
    momentum: float = 0.9
    schedule: str = "constant"
    warmup: int = 0  # steps of linear learning-rate warm-up
    label_noise: float = 0.0
    augment: bool = False
    input_noise: float = 0.0
    repeat_batch: int = 1
    noise_finetune: float = 0.0
    seed: int = 0
    regs: list[Regularizer] = field(default_factory=_default_regularizers)
    dtype: str = "float32"
    # mixed precision (sharpcli.training.precision): fp32 (none), bf16 or fp16 autocast
    precision: str = "fp32"
    # under torchrun, the first gradient of sam/usam/asam: per-replica or global (all-reduced)
    ascent_sync: str = "per-replica"
    device: str = "cpu"
    track: list[str] = field(default_factory=list)
    track_every: int | str = 1  # N epochs, or "Nsteps" (parse_track_every)
    track_samples: int = 512
    track_on: str = "subset"  # catalogue.TRACK_ON
    loss: str | None = None
    # token-cross-entropy: the mean over all labelled tokens ("tokens") or per sample
    token_reduction: str = "tokens"

    def __post_init__(self) -> None:
        # the command line gives these as text: a number stays the integer it always was
        # (the saved configurations of older runs hold integers), the word its lower case
        for name in ("batch_size", "track_every"):
            value = getattr(self, name)
            if isinstance(value, str):
                text = value.strip().lower()
                setattr(self, name, int(text) if text.isdigit() else text)
        if isinstance(self.regs, list):  # another type: validate_config names the option
            # imports torch: kept out of start-up
            from sharpcli.regularizers.registry import parse_regs

            self.regs = parse_regs(self.regs)

    @property
    def chosen_loss(self) -> str:
        """``loss`` once chosen: by the option, the data or the model's outputs (when the
        training data is placed on the model, :func:`sharpcli.training.loop.train`)."""
        if self.loss is None:
            raise RuntimeError("the training loss is chosen when the data is placed")
        return self.loss

    def to_dict(self) -> dict:
        """Every field as JSON-ready values, the regularizers as their canonical specs.

        Returns:
            A new dict in field order (nested values copied).
        """
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "regs" and isinstance(value, list):
                value = [r if isinstance(r, str) else r.spec() for r in value]
            out[f.name] = copy.deepcopy(value)
        return out

    def identity(self) -> dict:
        """The fields a resumed run must share with the run it continues."""
        d = self.to_dict()
        d.pop("epochs")
        return d


# settings added after the resumable state's first version, with the value that older runs
# (which did not record them) ran with (sharpcli.training.resume compares identities)
ADDED_SETTINGS: dict[str, Any] = {"steps": None, "warmup": 0, "track_on": "subset"}


def _shown(value: Any) -> str:
    """``repr(value)`` cut to 40 characters, for a message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@functools.cache
def _field_types() -> dict[str, Any]:
    """Each TrainConfig field's declared type (its annotation, evaluated)."""
    # imports torch: kept out of start-up
    from sharpcli.regularizers.base import Regularizer

    return typing.get_type_hints(TrainConfig, localns={"Regularizer": Regularizer})


def _conforms(value: Any, kind: Any) -> bool:
    """Whether ``value`` is of the declared type ``kind``: unions, ``None``, ``list[T]`` item by
    item, ``dict[K, V]`` as a dict; an integer is a float, a boolean is neither."""
    origin = typing.get_origin(kind)
    if origin in (Union, types.UnionType):
        return any(_conforms(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is not None:
        return isinstance(value, origin)
    if kind in (int, float):
        numbers = (int, float) if kind is float else int
        return isinstance(value, numbers) and not isinstance(value, bool)
    return isinstance(value, kind)


def _described(kind: Any) -> str:
    """``an integer``, ``a number``, ``true or false``, ``a string or a dict``: the values of
    type ``kind`` in words."""
    if typing.get_origin(kind) in (Union, types.UnionType):
        return " or ".join(_described(k) for k in typing.get_args(kind) if k is not type(None))
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return "parsed regularizers" if item is not str else "a list of strings"
    kind = typing.get_origin(kind) or kind
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return words.get(kind, f"a {kind.__name__}")


def _check_types(cfg: TrainConfig) -> None:
    """UsageError naming the first field whose value is not of its declared type.

    ``sweep --set epochs=abc`` stores the string ``"abc"``; comparing it later was exit 4.
    Numbers must be finite (``--input-noise nan``); integers are not booleans.
    """
    for name, kind in _field_types().items():
        value = getattr(cfg, name)
        if not _conforms(value, kind):
            raise UsageError(f"must be {_described(kind)}, got {_shown(value)}", source=name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"must be a finite number, got {value!r}", source=name)


def _check_step_modes(cfg: TrainConfig) -> None:
    """UsageError on ``precision`` (unknown, or mixed with float64) or ``ascent_sync``."""
    # imports torch: kept out of start-up
    from sharpcli.training.precision import check_precision

    check_precision(cfg.precision, cfg.dtype)
    if cfg.ascent_sync not in catalogue.ASCENT_SYNCS:
        raise UsageError(
            f"unknown ascent sync {cfg.ascent_sync!r}; accepted: "
            f"{', '.join(catalogue.ASCENT_SYNCS)}",
            source="ascent_sync",
        )


def validate_config(cfg: TrainConfig) -> None:
    """UsageError naming the option of the first setting out of its type or range."""
    # imports torch: kept out of start-up
    from sharpcli.losses import LOSSES, TOKEN_REDUCTIONS
    from sharpcli.preflight import check_seed

    _check_types(cfg)
    check_seed(cfg.seed)
    _check_step_modes(cfg)
    if not 0.0 <= cfg.momentum < 1.0:
        raise UsageError(f"must be in [0, 1), got {cfg.momentum!r}", source="momentum")
    if cfg.track_samples < 1:
        raise UsageError("must be at least 1", source="track_samples")
    if cfg.loss is not None and cfg.loss not in LOSSES:
        raise UsageError(f"unknown loss {cfg.loss!r}; accepted: {', '.join(LOSSES)}", source="loss")
    if cfg.epochs < 1:
        raise UsageError("must be at least 1", source="epochs")
    if cfg.steps is not None and cfg.steps < 1:
        raise UsageError("must be at least 1", source="steps")
    if cfg.warmup < 0:
        raise UsageError("must be >= 0", source="warmup")
    _check_batch_size(cfg.batch_size)
    _check_optimizer(cfg)
    if cfg.schedule not in SCHEDULES:
        raise UsageError(
            f"unknown schedule {cfg.schedule!r}; accepted: {', '.join(SCHEDULES)}",
            source="schedule",
        )
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise UsageError("must be a positive number", source="lr")
    if not (0.0 <= cfg.label_noise < 1.0):
        raise UsageError("must be in [0, 1)", source="label_noise")
    if cfg.repeat_batch < 1:
        raise UsageError("must be at least 1", source="repeat_batch")
    if cfg.noise_finetune < 0:
        raise UsageError("must be >= 0", source="noise_finetune")
    if cfg.input_noise < 0:
        raise UsageError("must be >= 0", source="input_noise")
    parse_track_every(cfg.track_every)
    if cfg.track_on not in catalogue.TRACK_ON:
        raise UsageError(
            f"unknown probe set {cfg.track_on!r}; accepted: {', '.join(catalogue.TRACK_ON)}",
            source="track_on",
        )
    if cfg.token_reduction not in TOKEN_REDUCTIONS:
        raise UsageError(
            f"unknown token reduction {cfg.token_reduction!r}; accepted: "
            f"{', '.join(TOKEN_REDUCTIONS)}",
            source="token_reduction",
        )


def _check_batch_size(batch_size: int | str) -> None:
    """UsageError (``batch_size``) unless it is a positive integer or ``full``."""
    if isinstance(batch_size, str):
        if batch_size.strip().lower() != FULL_BATCH:
            raise UsageError(
                f"must be a positive integer or {FULL_BATCH!r}, got {batch_size!r}",
                source="batch_size",
            )
    elif batch_size < 1:
        raise UsageError("must be at least 1", source="batch_size")


def _check_optimizer(cfg: TrainConfig) -> None:
    """UsageError (``optimizer``) on a spec that does not parse or an SGD momentum that
    Nesterov's form cannot take (torch refuses Nesterov without momentum)."""
    name, params = parse_optimizer(cfg.optimizer)
    if name == "sgd" and params.get("nesterov") and cfg.momentum <= 0:
        raise UsageError("sgd: nesterov=1 needs a momentum > 0 (`momentum`)", source="optimizer")


# Size options of the command line that go into ``TrainConfig.model_args``, in this order.
MODEL_SIZE_OPTIONS = ("depth", "width", "activation", "mask_ratio")


def config_from_options(*, model_args: dict[str, Any] | None = None, **options: Any) -> TrainConfig:
    """The :class:`TrainConfig` of command-line options: one construction for ``sharp train``
    and ``sharp sweep``.

    The model-size options (:data:`MODEL_SIZE_OPTIONS`) given (not None) are added to
    ``model_args``; every other option is the :class:`TrainConfig` field of its name, the
    regularizer specs parsed and their combination checked there.

    Args:
        model_args: Model arguments given as such (``--model-args``), completed by the size
            options.
        **options: ``depth``, ``width``, ``activation``, ``mask_ratio`` and fields of
            :class:`TrainConfig`.

    Returns:
        The configuration (not yet checked by :func:`validate_config`).

    Raises:
        UsageError: a depth or width below 1 (on that option), or a regularizer spec that
            does not parse or combine (on ``regs``).
        TypeError: an option that is neither a size option nor a field.
    """
    for option in ("depth", "width"):
        value = options.get(option)
        if value is not None and value < 1:
            raise UsageError("must be at least 1", source=option)
    margs = dict(model_args or {})
    for key in MODEL_SIZE_OPTIONS:
        value = options.pop(key, None)
        if value is not None:
            margs[key] = value
    unknown = sorted(set(options) - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise TypeError(f"not a training setting: {', '.join(unknown)}")
    return TrainConfig(model_args=margs, **options)
