"""Model specs: the arguments of each zoo architecture, their checks and their defaults.

A model is described by a JSON-serialisable spec ``{"name": NAME, "args": {...}}`` whose args are
complete (input size and number of classes included), so a checkpoint's metadata rebuilds the
exact architecture (:func:`sharpcli.models.zoo.build_model`). :func:`validate_model_spec` checks
a spec and completes it with defaults; :func:`default_model_args` fills the args from the data's
input shape and class count plus defaults and user overrides. Every bad argument is a
``UsageError`` naming ``model_args`` (``model`` for an unknown architecture).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.models.activations import DEFAULT_ACTIVATION, canonical_activation_spec

__all__ = [
    "ACTIVATION_ARG",
    "IMAGE_INPUT_ARGS",
    "MANIPULATION_ARGS",
    "NUM_CLASSES_ARG",
    "ModelArg",
    "default_model_args",
    "dropout_arg",
    "image_hw",
    "model_input_shape",
    "validate_model_spec",
]


_ARGS_PARAMETER = "model_args"  # the args of a model spec, as TrainConfig.model_args


@dataclass(frozen=True)
class ModelArg:
    """One architecture argument: how to check and canonicalise it, and its default.

    A zoo model states its arguments as its class's ``ARGS`` (name -> ModelArg, in schema
    order) and may check them together in its ``check_args(args)``
    (:mod:`sharpcli.models.zoo`).
    """

    kind: str  # "int", "float", "bool", "activation", "int_list", "image_size"
    default: Any = None
    required: bool = False
    minimum: float | None = None  # inclusive lower bound
    above: float | None = None  # exclusive lower bound
    below: float | None = None  # exclusive upper bound
    help: str = ""


# Arguments several architectures share, declared once. Order matters: a model spec's ``args``
# (and so a checkpoint's metadata) lists them in schema order.
NUM_CLASSES_ARG = ModelArg("int", required=True, minimum=1, help="number of logits")
IMAGE_INPUT_ARGS = {
    "in_channels": ModelArg("int", required=True, minimum=1, help="image channels"),
    "image_size": ModelArg("image_size", required=True, help="H (square) or [H, W]"),
    "num_classes": NUM_CLASSES_ARG,
}
ACTIVATION_ARG = ModelArg("activation", DEFAULT_ACTIVATION, help="activation spec")
# The manipulations of sharpcli.models.manipulations (MAN), available on every architecture.
MANIPULATION_ARGS = {
    "mask_ratio": ModelArg(
        "float",
        0.0,
        minimum=0.0,
        below=1.0,
        help="fixed fraction of activation outputs zeroed (MAN Table 1)",
    ),
    "mask_seed": ModelArg("int", 0, minimum=0, help="seed of the fixed masks"),
    "per_sample_norm": ModelArg(
        "bool",
        False,
        help="per-sample mean-variance normalisation of activations and He-standardised weights (MAN 5.1)",
    ),
}


def dropout_arg(where: str) -> ModelArg:
    """The dropout probability in [0, 1), applied ``where``."""
    return ModelArg("float", 0.0, minimum=0.0, below=1.0, help=f"dropout {where}")


def _model(name: Any) -> Any:
    """The zoo class of model ``name`` (:data:`sharpcli.catalogue.MODELS`, declared in
    :mod:`sharpcli.models.zoo`): its ``ARGS`` and ``check_args``."""
    if not isinstance(name, str) or name not in catalogue.MODELS:
        raise _unknown_model(name)
    return catalogue.MODELS.get(name)


def _is_image_model(name: str) -> bool:
    """Whether model ``name`` takes images (its arguments include the image size)."""
    return "image_size" in _model(name).ARGS


def _bad(message: str) -> UsageError:
    return UsageError(message, source=_ARGS_PARAMETER)


def _show_number(value: float) -> str:
    """``value`` for an error message; an int too large for a float (JSON allows 4300 digits,
    ``f"{value:g}"`` would raise OverflowError) is shown by its number of digits."""
    if isinstance(value, int) and abs(value) >= 10**16:
        return f"a {len(str(abs(value)))}-digit integer"
    return f"{value:g}"


def _check_number(model: str, key: str, spec: ModelArg, value: float) -> None:
    # math.isfinite(int) converts to float and overflows beyond 1e308; an int is always finite
    if not isinstance(value, int) and not math.isfinite(value):
        raise _bad(f"{model}: {key} must be finite, got {value}")
    shown = _show_number(value)
    if spec.minimum is not None and value < spec.minimum:
        raise _bad(f"{model}: {key} must be >= {spec.minimum:g}, got {shown}")
    if spec.above is not None and value <= spec.above:
        raise _bad(f"{model}: {key} must be > {spec.above:g}, got {shown}")
    if spec.below is not None and value >= spec.below:
        raise _bad(f"{model}: {key} must be < {spec.below:g}, got {shown}")


def _as_int(model: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{model}: {key} must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise _bad(f"{model}: {key} must be an integer, got {value!r}")
    return int(value)


def _int_value(model: str, key: str, spec: ModelArg, value: Any) -> int:
    number = _as_int(model, key, value)
    _check_number(model, key, spec, number)
    return number


def _float_value(model: str, key: str, spec: ModelArg, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{model}: {key} must be a number, got {value!r}")
    number = float(value)
    _check_number(model, key, spec, number)
    return number


def _bool_value(model: str, key: str, spec: ModelArg, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(f"{model}: {key} must be true or false, got {value!r}")
    return value


def _activation_value(model: str, key: str, spec: ModelArg, value: Any) -> Any:
    return canonical_activation_spec(value)


def _int_list_value(model: str, key: str, spec: ModelArg, value: Any) -> list[int]:
    problem = f"{model}: {key} must be a non-empty list of positive integers, got {value!r}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise _bad(problem)
    items = [_as_int(model, key, item) for item in value]
    if any(item < 1 for item in items):
        raise _bad(problem)
    return items


def _image_size_value(model: str, key: str, spec: ModelArg, value: Any) -> int | list[int]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        sides = [_as_int(model, key, value)] * 2
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 2:
        sides = [_as_int(model, key, side) for side in value]
    else:
        raise _bad(f"{model}: {key} must be an integer or [height, width], got {value!r}")
    if min(sides) < 1:
        raise _bad(f"{model}: {key} must be positive, got {value!r}")
    return sides[0] if sides[0] == sides[1] else sides


_CANONICAL = {
    "int": _int_value,
    "float": _float_value,
    "bool": _bool_value,
    "activation": _activation_value,
    "int_list": _int_list_value,
    "image_size": _image_size_value,
}
"""Each argument kind's check: ``f(model, key, spec, value)`` -> the canonical value."""


def _canonical_value(model: str, key: str, spec: ModelArg, value: Any) -> Any:
    """Check one argument's type and range; return its canonical JSON-serialisable form."""
    check = _CANONICAL.get(spec.kind)
    if check is None:
        raise AssertionError(f"unknown argument kind {spec.kind}")  # schema bug, not user error
    return check(model, key, spec, value)


def image_hw(image_size: int | Sequence[int]) -> tuple[int, int]:
    """An ``image_size`` argument as ``(height, width)``.

    Args:
        image_size: a side (square images) or ``[height, width]``.

    Returns:
        ``(height, width)``.

    Example:
        >>> image_hw(32), image_hw([28, 14])
        ((32, 32), (28, 14))
    """
    if isinstance(image_size, int):
        return image_size, image_size
    return int(image_size[0]), int(image_size[1])


def _unknown_model(name: Any) -> UsageError:
    accepted = ", ".join(catalogue.MODELS.names())
    return UsageError(f"unknown model {name!r}; accepted: {accepted}", source="model")


def validate_model_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Check a model spec and return its canonical complete form ``{"name", "args"}``.

    Missing optional args take their defaults; required args (input size, classes) must be
    present. Unknown model -> ``UsageError(source="model")``; unknown, missing or out-of-range
    args -> ``UsageError(source="model_args")``; a bad activation ->
    ``UsageError(source="activation")``. Callers reading a checkpoint may re-raise as
    ``InputError`` naming the file.

    Args:
        spec: ``{"name": NAME, "args": {...}}``.

    Returns:
        The canonical complete spec.

    Raises:
        UsageError: as above.
    """
    if not isinstance(spec, dict) or "name" not in spec:
        raise UsageError(
            f"a model spec is a JSON object {{'name': ..., 'args': {{...}}}}, got {spec!r}",
            source="model",
        )
    name = spec["name"]
    model = _model(name)
    args = spec.get("args") or {}
    if not isinstance(args, dict):
        raise _bad(f"{name}: args must be a JSON object, got {args!r}")
    schema = model.ARGS
    unknown = sorted(set(args) - set(schema))
    if unknown:
        raise _bad(
            f"{name}: unknown argument(s) {', '.join(unknown)}; accepted: {', '.join(schema)}"
        )
    complete: dict[str, Any] = {}
    for key, arg in schema.items():
        if key in args and args[key] is not None:
            complete[key] = _canonical_value(name, key, arg, args[key])
        elif arg.required:
            raise _bad(f"{name}: missing required argument {key} ({arg.help})")
        else:
            complete[key] = copy.deepcopy(arg.default)
    check_args = getattr(model, "check_args", None)
    if check_args is not None:
        problem = check_args(complete)
        if problem is not None:
            raise _bad(f"{name}: {problem}")
    return {"name": name, "args": complete}


def default_model_args(
    name: str, input_shape: Sequence[int], num_classes: int, **overrides: Any
) -> dict:
    """Complete args for model ``name`` on inputs of shape ``input_shape`` with ``num_classes`` logits.

    ``mlp`` takes ``in_features = prod(input_shape)``; image models need ``input_shape = (C, H, W)``
    and take ``in_channels = C``, ``image_size = H`` (or ``[H, W]``). ``overrides`` set any other
    argument (``None`` values are ignored); overriding a data-derived argument with a different
    value raises ``UsageError(source="model_args")``, as do unknown or bad arguments.

    Args:
        name: the architecture.
        input_shape: one example's shape.
        num_classes: the number of logits.
        **overrides: any other argument.

    Returns:
        The complete args.

    Raises:
        UsageError: as above, or ``source="model"`` for an unknown architecture or non-image
            inputs to an image model.

    Example:
        >>> default_model_args("mlp", (2, 3), 4)["in_features"]
        6
    """
    schema = _model(name).ARGS
    shape = tuple(int(side) for side in input_shape)
    derived: dict[str, Any] = {"num_classes": int(num_classes)}
    if _is_image_model(name):
        if len(shape) != 3:
            images = (
                f" (or `x_shape=1,{shape[0]},{shape[1]}` for one-channel images)"
                if len(shape) == 2
                else ""
            )
            raise UsageError(
                f"model {name!r} needs image inputs of shape (channels, height, width); the data's "
                f"examples have shape {shape}; use `model=mlp`{images}",
                source="model",
            )
        channels, height, width = shape
        derived["in_channels"] = channels
        derived["image_size"] = height if height == width else [height, width]
    else:
        derived["in_features"] = math.prod(shape) if shape else 1
    args: dict[str, Any] = dict(derived)
    for key, value in overrides.items():
        if value is None:
            continue
        if key in derived:
            canonical = _canonical_value(name, key, schema[key], value)
            if canonical != derived[key]:
                raise _bad(
                    f"{name}: {key}={value!r} contradicts the data (input shape {shape}, "
                    f"{num_classes} classes), which gives {key}={derived[key]!r}"
                )
            continue
        args[key] = value
    return validate_model_spec({"name": name, "args": args})["args"]


def model_input_shape(spec: dict[str, Any]) -> tuple[int, ...]:
    """The shape of one input example a model spec expects: ``(in_features,)`` or ``(C, H, W)``.

    Args:
        spec: a model spec.

    Returns:
        ``(in_features,)`` or ``(C, H, W)``.

    Raises:
        UsageError: a bad spec.
    """
    complete = validate_model_spec(spec)
    args = complete["args"]
    if _is_image_model(complete["name"]):
        return (args["in_channels"], *image_hw(args["image_size"]))
    return (args["in_features"],)
