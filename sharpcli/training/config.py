"""The configuration of a training run: :class:`TrainConfig`, its checks, and its
construction from command-line options shared by ``sharp train`` and ``sharp sweep``."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.training.penalties.base import Regularizer
from sharpcli.training.regularizers import parse_regs

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "OPTION_OF",
    "TrainConfig",
    "validate_config",
    "config_from_options",
]

OPTIMIZERS = catalogue.OPTIMIZERS
SCHEDULES = catalogue.SCHEDULES


@dataclass
class TrainConfig:
    """Everything that determines a training run; stored in the checkpoint's ``sharpcli.train``.

    ``regs`` holds parsed regularizers (:class:`~sharpcli.training.penalties.base.Regularizer`):
    ``NAME[:k=v,...]`` texts given at construction are parsed and their combination checked
    then, once (:func:`sharpcli.training.regularizers.parse_regs`); :meth:`to_dict` writes
    them back in their canonical spelling.
    """

    model: str = "mlp"
    model_args: dict = field(default_factory=dict)
    model_factory: str | None = None  # module:function building the user's own model
    output: str | None = None  # which of the model's outputs are the logits
    penultimate: str | None = None  # module whose output activation decay penalises
    data: str | dict = "blobs"
    label_column: str | None = None
    epochs: int = 5
    batch_size: int = 64
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    schedule: str = "constant"
    label_noise: float = 0.0
    augment: bool = False
    input_noise: float = 0.0
    repeat_batch: int = 1
    noise_finetune: float = 0.0
    seed: int = 0
    regs: list = field(default_factory=lambda: ["none"])
    dtype: str = "float32"
    # mixed precision (sharpcli.training.precision): fp32 (none), bf16 or fp16 autocast
    precision: str = "fp32"
    # under torchrun, the first gradient of sam/usam/asam: per-replica or global (all-reduced)
    ascent_sync: str = "per-replica"
    device: str = "cpu"
    track: list = field(default_factory=list)
    track_every: int = 1
    track_samples: int = 512
    loss: str | None = None
    # token-cross-entropy: the mean over all labelled tokens ("tokens") or per sample
    token_reduction: str = "tokens"

    def __post_init__(self) -> None:
        if isinstance(self.regs, list):  # another type: validate_config names the option
            self.regs = parse_regs(self.regs)

    def to_dict(self) -> dict:
        """Every field as JSON-ready values, the regularizers as their canonical specs.

        Returns:
            A new dict in field order (nested values copied).
        """
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "regs" and isinstance(value, list):
                value = [r.spec() if isinstance(r, Regularizer) else r for r in value]
            out[f.name] = copy.deepcopy(value)
        return out

    def identity(self) -> dict:
        """The fields a resumed run must share with the run it continues."""
        d = self.to_dict()
        d.pop("epochs")
        return d


OPTION_OF = {name: name for name in TrainConfig.__dataclass_fields__}
"""The parameter that sets each TrainConfig field, named by the errors about it (the CLI spells
it as its own option; sweep's ``set`` option sets any field, and its errors name that option).
``loss`` has none in ``train`` (the data's task picks it)."""

_FIELD_TYPES = {
    int: ("epochs", "batch_size", "repeat_batch", "seed", "track_every", "track_samples"),
    float: ("lr", "momentum", "label_noise", "input_noise", "noise_finetune"),
    bool: ("augment",),
    str: (
        "model",
        "optimizer",
        "schedule",
        "dtype",
        "precision",
        "ascent_sync",
        "device",
        "token_reduction",
    ),
    dict: ("model_args",),
    list: ("regs", "track"),
}


def _shown(value) -> str:
    """``repr(value)`` cut to 40 characters, for a message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_types(cfg: TrainConfig) -> None:
    """UsageError naming the option of the first field whose value has the wrong type.

    ``sweep --set epochs=abc`` stores the string ``"abc"``; comparing it later was exit 4.
    Numbers must be finite (``--input-noise nan``); integers are not booleans.
    """
    for kind, names in _FIELD_TYPES.items():
        for name in names:
            value = getattr(cfg, name)
            wrong = isinstance(value, bool) != (kind is bool) or not isinstance(
                value, (int, float) if kind is float else kind
            )
            if kind is float and not wrong and not math.isfinite(value):
                raise UsageError(f"must be a finite number, got {value!r}", source=OPTION_OF[name])
            if wrong:
                what = {int: "an integer", float: "a number", bool: "true or false"}.get(
                    kind, f"a {kind.__name__}"
                )
                raise UsageError(f"must be {what}, got {_shown(value)}", source=OPTION_OF[name])
    for name in ("loss", "label_column"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, str):
            raise UsageError(f"must be a string, got {_shown(value)}", source=OPTION_OF[name])
    if not isinstance(cfg.data, (str, dict)):
        raise UsageError("must be a data spec string", source="data")
    for reg in cfg.regs:
        if not isinstance(reg, Regularizer):  # set after construction, never parsed
            raise UsageError(f"must be parsed regularizers, got {_shown(reg)}", source="regs")


def _check_step_modes(cfg: TrainConfig) -> None:
    """UsageError on ``precision`` (unknown, or mixed with float64) or ``ascent_sync``."""
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
    if cfg.batch_size < 1:
        raise UsageError("must be at least 1", source="batch_size")
    if cfg.optimizer not in OPTIMIZERS:
        raise UsageError(
            f"unknown optimizer {cfg.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}",
            source="optimizer",
        )
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
    if cfg.track_every < 1:
        raise UsageError("must be at least 1", source="track_every")
    if cfg.token_reduction not in TOKEN_REDUCTIONS:
        raise UsageError(
            f"unknown token reduction {cfg.token_reduction!r}; accepted: "
            f"{', '.join(TOKEN_REDUCTIONS)}",
            source="token_reduction",
        )


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
