"""The model zoo: ``mlp``, ``cnn``, ``vgg-small`` ([MAN] Table 6) and CIFAR ``resnet`` ([He2016]).

A model is described by a JSON-serialisable spec ``{"name": NAME, "args": {...}}`` whose args are
complete (input size and number of classes included), so a checkpoint's metadata rebuilds the
exact architecture with :func:`build_model`. :func:`default_model_args` fills the args from the
data's input shape and class count plus defaults and user overrides.

Conventions every zoo model honours (the analyses rely on them):

- every activation is its own ``nn.Module`` instance (built by
  :func:`sharpcli.models.activations.make_activation`, never shared, never functional), so a
  forward hook on it sees that layer's pre-activation (input) and activation (output);
- the last ``nn.Linear`` in ``named_modules()`` order is the classifier head, and its input is the
  penultimate representation ``h^(L-1)`` that activation decay penalises (AD Theorem 2);
- every model takes ``dropout`` (default 0): dropout on the hidden representation(s), active only
  in train mode;
- parameters are created in float32 (callers convert with ``.to(dtype)``); initialisation draws
  from torch's global RNG, so seed it first for reproducible weights;
- the built model carries ``model.model_spec`` (the complete spec) and ``model.input_shape``
  (one example's shape) as plain attributes (not in the state_dict).
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.models.activations import ACTIVATION_TYPES, canonical_activation_spec, make_activation

# --------------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------------


class MLP(nn.Sequential):
    """Fully connected network ``x -> W_1 -> phi -> ... -> W_{depth+1} -> logits``.

    Layout (an ``nn.Sequential``; indices are the state_dict prefixes):
    ``[Linear(in, width), act, (Dropout), Linear(width, width), act, (Dropout), ...,
    Linear(width, num_classes)]``. Without dropout the Linear layers are at ``0, 2, 4, ...``
    (``0.weight``, ``0.bias``, ``2.weight``, ...); with ``dropout > 0`` a Dropout follows every
    activation and the Linear layers are at ``0, 3, 6, ...``. ``depth`` counts hidden layers;
    ``depth = 0`` is multinomial logistic regression (one Linear). Inputs of any shape
    ``(N, *input_shape)`` are flattened to ``(N, in_features)`` inside ``forward`` (no Flatten
    module, so indices stay as above).
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        depth: int = 2,
        width: int = 64,
        activation: str = "relu",
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        layers: list[nn.Module] = []
        fan_in = in_features
        for _ in range(depth):
            layers.append(nn.Linear(fan_in, width, bias=bias))
            layers.append(make_activation(activation))
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            fan_in = width
        layers.append(nn.Linear(fan_in, num_classes, bias=bias))
        super().__init__(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``z = f(theta, x)`` of the flattened input."""
        return super().forward(x.flatten(1))

    def __getitem__(self, index):
        """``mlp[i]`` is layer i; a slice ``mlp[a:b]`` is a plain ``nn.Sequential`` of those layers
        (sharing them; it does not flatten its input)."""
        if isinstance(index, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[index]))
        return super().__getitem__(index)


def _pooled(size: tuple[int, int]) -> tuple[int, int]:
    """Spatial size after ``MaxPool2d(2)`` (floor division, as torch)."""
    return size[0] // 2, size[1] // 2


def _conv_act(
    in_channels: int, out_channels: int, activation: str, batch_norm: bool
) -> list[nn.Module]:
    """The start of a SmallCNN / VGG-small block: ``Conv2d(k=3, pad=1) -> (BatchNorm2d) -> act``
    (created in this order, so a seed gives the same initial weights)."""
    layers: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(out_channels))
    layers.append(make_activation(activation))
    return layers


def _classifier(
    pool: list[nn.Module], features: int, num_classes: int, dropout: float, bias: bool = True
) -> nn.Sequential:
    """``[*pool, Flatten, (Dropout), Linear(features, num_classes)]``: a conv net's head, whose
    ``Linear`` input is the penultimate representation."""
    head: list[nn.Module] = [*pool, nn.Flatten()]
    if dropout > 0:
        head.append(nn.Dropout(dropout))
    head.append(nn.Linear(features, num_classes, bias=bias))
    return nn.Sequential(*head)


class _FeaturesThenClassifier(nn.Module):
    """A conv net made of ``features`` and ``classifier`` (SmallCNN, VGG-small)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of an image batch ``(N, C, H, W)``."""
        return self.classifier(self.features(x))


class SmallCNN(_FeaturesThenClassifier):
    """A small conv net: ``features`` blocks ``Conv3x3 -> (BatchNorm) -> act -> MaxPool2d(2)``,
    then ``classifier = [Flatten, (Dropout), Linear(c_last * h * w, num_classes)]``.

    With ``channels = [16, 32]`` and no batch norm the state_dict names are ``features.0``,
    ``features.4`` (convs) and ``classifier.1`` (head; ``classifier.2`` with dropout). The head's
    input (flattened last pooled feature map) is the penultimate representation.
    """

    def __init__(
        self,
        in_channels: int,
        image_size: tuple[int, int],
        num_classes: int,
        channels: Sequence[int] = (16, 32),
        activation: str = "relu",
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        prev = in_channels
        size = tuple(image_size)
        for width in channels:
            blocks += _conv_act(prev, width, activation, batch_norm)
            blocks.append(nn.MaxPool2d(2))
            size = _pooled(size)
            prev = width
        self.features = nn.Sequential(*blocks)
        self.classifier = _classifier([], prev * size[0] * size[1], num_classes, dropout)


VGG_SMALL_CHANNELS = (64, 128, 256, 512)


class VGGSmall(_FeaturesThenClassifier):
    """The custom VGG-small of MAN Appendix B.2, Table 6 (no batch norm, no residuals).

    ``features``: four blocks ``Conv2d(k=3, pad=1) -> (BatchNorm2d) -> act -> MaxPool2d(2)`` with
    ``64, 128, 256, 512`` channels times ``width_multiplier`` (rounded, at least 1). Without batch
    norm the indices are Table 6's layer numbers (``features.0`` conv, ``features.1`` act,
    ``features.2`` pool, ``features.3`` conv, ...). For small images a pool that would shrink a
    side below 1 pixel is replaced by ``nn.Identity`` (indices unchanged), so 8x8 inputs work.
    ``classifier = [AdaptiveAvgPool2d(2x2), Flatten, (Dropout), Linear(4 c_last, classes, bias=False)]``
    as the table's global pooling and bias-free classifier.
    """

    def __init__(
        self,
        in_channels: int,
        image_size: tuple[int, int],
        num_classes: int,
        width_multiplier: float = 1.0,
        activation: str = "relu",
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        prev = in_channels
        size = tuple(image_size)
        for base in VGG_SMALL_CHANNELS:
            width = vgg_small_width(base, width_multiplier)
            blocks += _conv_act(prev, width, activation, batch_norm)
            if min(size) >= 2:
                blocks.append(nn.MaxPool2d(2))
                size = _pooled(size)
            else:
                blocks.append(nn.Identity())
            prev = width
        self.features = nn.Sequential(*blocks)
        pool = [nn.AdaptiveAvgPool2d((2, 2))]
        self.classifier = _classifier(pool, prev * 4, num_classes, dropout, bias=False)


def vgg_small_width(base: int, width_multiplier: float) -> int:
    """Channel count of a VGG-small block: ``max(1, round(base * width_multiplier))``."""
    return max(1, int(round(base * width_multiplier)))


class ChannelPadShortcut(nn.Module):
    """Parameter-free CIFAR ResNet shortcut (He et al. 2016, option A).

    ``x -> x[:, :, ::stride, ::stride]`` zero-padded from ``in_channels`` to ``out_channels``
    (padding split evenly on both sides of the channel axis); the identity when both are equal
    and ``stride = 1``.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Subsample by ``stride`` and zero-pad the channel axis."""
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        extra = self.out_channels - self.in_channels
        if extra:
            x = F.pad(x, (0, 0, 0, 0, extra // 2, extra - extra // 2))
        return x

    def extra_repr(self) -> str:
        """``in->out, stride=S`` in the module's repr."""
        return f"{self.in_channels}->{self.out_channels}, stride={self.stride}"


class BasicBlock(nn.Module):
    """CIFAR ResNet basic block: ``act2(BN(conv3x3(act1(BN(conv3x3(x))))) + shortcut(x))``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, activation: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.act1 = make_activation(activation)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = ChannelPadShortcut(in_channels, out_channels, stride)
        self.act2 = make_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The residual block's output for a feature map ``(N, C, H, W)``."""
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act2(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """CIFAR ResNet of He et al. 2016 (section 4.2): depth ``6n + 2``.

    ``conv3x3(in, w) -> BN -> act``, then three stages of ``n`` basic blocks with ``w, 2w, 4w``
    channels (the first block of stages 2 and 3 has stride 2 and a parameter-free zero-padding
    shortcut, option A), global average pooling, ``(Dropout)``, ``fc = Linear(4w, classes)``.
    Depth 20 with ``w = 16`` and 10 classes has 269,722 parameters (the paper's 0.27M).
    Convolutions have no bias; conv and linear weights use Kaiming-normal initialisation.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        depth: int = 20,
        width: int = 16,
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        blocks_per_stage = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.act1 = make_activation(activation)
        stages = []
        prev = width
        for stage, out_channels in enumerate((width, 2 * width, 4 * width)):
            blocks = []
            for index in range(blocks_per_stage):
                stride = 2 if (stage > 0 and index == 0) else 1
                blocks.append(BasicBlock(prev, out_channels, stride, activation))
                prev = out_channels
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc = nn.Linear(prev, num_classes)
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of an image batch ``(N, C, H, W)``."""
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.fc(self.dropout(self.flatten(self.pool(out))))


# --------------------------------------------------------------------------------------------
# Argument schemas
# --------------------------------------------------------------------------------------------

_ARGS_PARAMETER = "model_args"  # the args of a model spec, as TrainConfig.model_args


@dataclass(frozen=True)
class _Arg:
    """One architecture argument: how to check and canonicalise it, and its default."""

    kind: str  # "int", "float", "bool", "activation", "int_list", "image_size"
    default: Any = None
    required: bool = False
    minimum: float | None = None  # inclusive lower bound
    above: float | None = None  # exclusive lower bound
    below: float | None = None  # exclusive upper bound
    help: str = ""


# Arguments several architectures share, declared once. Order matters: a model spec's ``args``
# (and so a checkpoint's metadata) lists them in schema order.
_NUM_CLASSES_ARG = _Arg("int", required=True, minimum=1, help="number of logits")
_IMAGE_INPUT_ARGS = {
    "in_channels": _Arg("int", required=True, minimum=1, help="image channels"),
    "image_size": _Arg("image_size", required=True, help="H (square) or [H, W]"),
    "num_classes": _NUM_CLASSES_ARG,
}
_ACTIVATION_ARG = _Arg("activation", "relu", help="activation spec")
# The manipulations of sharpcli.models.manipulations (MAN), available on every architecture.
_MANIPULATION_ARGS = {
    "mask_ratio": _Arg(
        "float",
        0.0,
        minimum=0.0,
        below=1.0,
        help="fixed fraction of activation outputs zeroed (MAN Table 1)",
    ),
    "mask_seed": _Arg("int", 0, minimum=0, help="seed of the fixed masks"),
    "per_sample_norm": _Arg(
        "bool",
        False,
        help="per-sample mean-variance normalisation of activations and He-standardised weights (MAN 5.1)",
    ),
}


def _dropout_arg(where: str) -> _Arg:
    """The dropout probability in [0, 1), applied ``where``."""
    return _Arg("float", 0.0, minimum=0.0, below=1.0, help=f"dropout {where}")


_MODEL_ARGS: dict[str, dict[str, _Arg]] = {
    "mlp": {
        "in_features": _Arg("int", required=True, minimum=1, help="flattened input size"),
        "num_classes": _NUM_CLASSES_ARG,
        "depth": _Arg("int", 2, minimum=0, help="number of hidden layers"),
        "width": _Arg("int", 64, minimum=1, help="hidden units per layer"),
        "activation": _ACTIVATION_ARG,
        "bias": _Arg("bool", True, help="Linear layers have biases"),
        "dropout": _dropout_arg("after each activation"),
        **_MANIPULATION_ARGS,
    },
    "cnn": {
        **_IMAGE_INPUT_ARGS,
        "channels": _Arg("int_list", [16, 32], help="conv channels per block"),
        "activation": _ACTIVATION_ARG,
        "batch_norm": _Arg("bool", False, help="BatchNorm2d after each conv"),
        "dropout": _dropout_arg("before the head"),
        **_MANIPULATION_ARGS,
    },
    "vgg-small": {
        **_IMAGE_INPUT_ARGS,
        "width_multiplier": _Arg("float", 1.0, above=0.0, help="scales 64-128-256-512 channels"),
        "activation": _ACTIVATION_ARG,
        "batch_norm": _Arg("bool", False, help="BatchNorm2d after each conv (MAN uses none)"),
        "dropout": _dropout_arg("before the head"),
        **_MANIPULATION_ARGS,
    },
    "resnet": {
        **_IMAGE_INPUT_ARGS,
        "depth": _Arg("int", 20, minimum=8, help="6n+2: 20, 32, 44, 56, 110"),
        "width": _Arg("int", 16, minimum=1, help="channels of the first stage"),
        "activation": _ACTIVATION_ARG,
        "dropout": _dropout_arg("before fc"),
        **_MANIPULATION_ARGS,
    },
}

MODEL_NAMES: tuple[str, ...] = catalogue.MODEL_NAMES

_IMAGE_MODELS = frozenset({"cnn", "vgg-small", "resnet"})


def _bad(message: str) -> UsageError:
    return UsageError(message, source=_ARGS_PARAMETER)


def _show_number(value: float) -> str:
    """``value`` for an error message; an int too large for a float (JSON allows 4300 digits,
    ``f"{value:g}"`` would raise OverflowError) is shown by its number of digits."""
    if isinstance(value, int) and abs(value) >= 10**16:
        return f"a {len(str(abs(value)))}-digit integer"
    return f"{value:g}"


def _check_number(model: str, key: str, spec: _Arg, value: float) -> None:
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


def _int_value(model: str, key: str, spec: _Arg, value: Any) -> int:
    number = _as_int(model, key, value)
    _check_number(model, key, spec, number)
    return number


def _float_value(model: str, key: str, spec: _Arg, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{model}: {key} must be a number, got {value!r}")
    number = float(value)
    _check_number(model, key, spec, number)
    return number


def _bool_value(model: str, key: str, spec: _Arg, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(f"{model}: {key} must be true or false, got {value!r}")
    return value


def _activation_value(model: str, key: str, spec: _Arg, value: Any) -> Any:
    return canonical_activation_spec(value)


def _int_list_value(model: str, key: str, spec: _Arg, value: Any) -> list[int]:
    problem = f"{model}: {key} must be a non-empty list of positive integers, got {value!r}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise _bad(problem)
    items = [_as_int(model, key, item) for item in value]
    if any(item < 1 for item in items):
        raise _bad(problem)
    return items


def _image_size_value(model: str, key: str, spec: _Arg, value: Any) -> int | list[int]:
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


def _canonical_value(model: str, key: str, spec: _Arg, value: Any) -> Any:
    """Check one argument's type and range; return its canonical JSON-serialisable form."""
    check = _CANONICAL.get(spec.kind)
    if check is None:
        raise AssertionError(f"unknown argument kind {spec.kind}")  # schema bug, not user error
    return check(model, key, spec, value)


def _image_hw(image_size: int | list[int]) -> tuple[int, int]:
    if isinstance(image_size, int):
        return image_size, image_size
    return int(image_size[0]), int(image_size[1])


def _check_architecture(name: str, args: dict[str, Any]) -> None:
    """Cross-argument checks (the network must fit the input)."""
    if name == "cnn":
        height, width = _image_hw(args["image_size"])
        blocks = len(args["channels"])
        if min(height, width) >> blocks < 1:
            raise _bad(
                f"cnn: {blocks} pooling blocks need images of at least "
                f"{2**blocks if blocks < 50 else f'2**{blocks}'} pixels a side, "
                f"got {height}x{width}; use fewer channels entries"
            )
    if name == "resnet":
        depth = args["depth"]
        if (depth - 2) % 6 != 0:
            raise _bad(f"resnet: depth must be 6n+2 (20, 32, 44, 56, 110), got {depth}")


def _unknown_model(name: Any) -> UsageError:
    return UsageError(f"unknown model {name!r}; accepted: {', '.join(MODEL_NAMES)}", source="model")


def validate_model_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Check a model spec and return its canonical complete form ``{"name", "args"}``.

    Missing optional args take their defaults; required args (input size, classes) must be
    present. Unknown model -> ``UsageError(source="model")``; unknown, missing or out-of-range
    args -> ``UsageError(source="model_args")``; a bad activation ->
    ``UsageError(source="activation")``. Callers reading a checkpoint may re-raise as
    ``InputError`` naming the file.
    """
    if not isinstance(spec, dict) or "name" not in spec:
        raise UsageError(
            f"a model spec is a JSON object {{'name': ..., 'args': {{...}}}}, got {spec!r}",
            source="model",
        )
    name = spec["name"]
    if not isinstance(name, str) or name not in _MODEL_ARGS:
        raise _unknown_model(name)
    args = spec.get("args") or {}
    if not isinstance(args, dict):
        raise _bad(f"{name}: args must be a JSON object, got {args!r}")
    schema = _MODEL_ARGS[name]
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
    _check_architecture(name, complete)
    return {"name": name, "args": complete}


def default_model_args(
    name: str, input_shape: Sequence[int], num_classes: int, **overrides: Any
) -> dict:
    """Complete args for model ``name`` on inputs of shape ``input_shape`` with ``num_classes`` logits.

    ``mlp`` takes ``in_features = prod(input_shape)``; image models need ``input_shape = (C, H, W)``
    and take ``in_channels = C``, ``image_size = H`` (or ``[H, W]``). ``overrides`` set any other
    argument (``None`` values are ignored); overriding a data-derived argument with a different
    value raises ``UsageError(source="model_args")``, as do unknown or bad arguments.
    """
    if not isinstance(name, str) or name not in _MODEL_ARGS:
        raise _unknown_model(name)
    shape = tuple(int(side) for side in input_shape)
    derived: dict[str, Any] = {"num_classes": int(num_classes)}
    if name in _IMAGE_MODELS:
        if len(shape) != 3:
            raise UsageError(
                f"model {name!r} needs image inputs of shape (channels, height, width); the data's "
                f"examples have shape {shape}; use `model=mlp`",
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
            canonical = _canonical_value(name, key, _MODEL_ARGS[name][key], value)
            if canonical != derived[key]:
                raise _bad(
                    f"{name}: {key}={value!r} contradicts the data (input shape {shape}, "
                    f"{num_classes} classes), which gives {key}={derived[key]!r}"
                )
            continue
        args[key] = value
    return validate_model_spec({"name": name, "args": args})["args"]


def model_input_shape(spec: dict[str, Any]) -> tuple[int, ...]:
    """The shape of one input example a model spec expects: ``(in_features,)`` or ``(C, H, W)``."""
    complete = validate_model_spec(spec)
    args = complete["args"]
    if complete["name"] in _IMAGE_MODELS:
        return (args["in_channels"], *_image_hw(args["image_size"]))
    return (args["in_features"],)


class StateSize(NamedTuple):
    """How big a model's state_dict is: its number of tensors and of values (elements)."""

    tensors: int
    values: int


def _linear(fan_in: int, fan_out: int, bias: bool) -> StateSize:
    return StateSize(1 + bias, fan_in * fan_out + bias * fan_out)


def _conv3x3(in_channels: int, out_channels: int, bias: bool) -> StateSize:
    return StateSize(1 + bias, 9 * in_channels * out_channels + bias * out_channels)


def _batch_norm(channels: int, present: bool = True) -> StateSize:
    # weight, bias, running_mean, running_var (channels each) and num_batches_tracked (one value)
    return StateSize(5, 4 * channels + 1) if present else StateSize(0, 0)


def _mask(values: int, present: bool) -> StateSize:
    """A :class:`~sharpcli.models.manipulations.FeatureMask` buffer over one pre-activation."""
    return StateSize(1, values) if present else StateSize(0, 0)


def _total(*parts: StateSize, times: int = 1) -> StateSize:
    return StateSize(times * sum(p.tensors for p in parts), times * sum(p.values for p in parts))


def estimate_state_size(spec: dict[str, Any]) -> StateSize:
    """The size of the state_dict ``build_model(spec)`` would return, from the arguments alone.

    Exact (parameters, BatchNorm buffers and ``mask_ratio`` masks; ``per_sample_norm`` renames
    weights but adds no tensor), computed with Python integers in time independent of
    ``depth`` and ``width``: nothing is built or allocated. Why: a checkpoint's metadata (or
    ``--arch-args``) decides what :func:`build_model` allocates, so a file can ask for
    ``width = 10**9`` (64 GB) or ``depth = 200000`` (minutes and gigabytes of modules before
    any weight is compared); :func:`sharpcli.io.checkpoints.load_checkpoint` compares this
    estimate with what the file stores and refuses absurd models before building them.
    Raises what :func:`validate_model_spec` raises for a bad spec.
    """
    complete = validate_model_spec(spec)
    name, a = complete["name"], complete["args"]
    masked = a.get("mask_ratio", 0.0) > 0.0
    if name == "mlp":
        depth, width, bias = a["depth"], a["width"], a["bias"]
        head_in = width if depth > 0 else a["in_features"]
        parts = [_linear(head_in, a["num_classes"], bias)]
        if depth > 0:
            parts.append(_total(_linear(a["in_features"], width, bias), _mask(width, masked)))
            parts.append(_total(_linear(width, width, bias), _mask(width, masked), times=depth - 1))
        return _total(*parts)
    height, width_px = _image_hw(a["image_size"])
    if name in ("cnn", "vgg-small"):
        if name == "cnn":
            channels = a["channels"]
        else:
            channels = [vgg_small_width(base, a["width_multiplier"]) for base in VGG_SMALL_CHANNELS]
        parts, prev = [], a["in_channels"]
        for out in channels:
            pixels = out * height * width_px  # the mask covers the pre-activation before pooling
            parts += [_conv3x3(prev, out, True), _batch_norm(out, a["batch_norm"])]
            parts.append(_mask(pixels, masked))
            if name == "cnn" or min(height, width_px) >= 2:  # vgg-small skips a too-small pool
                height, width_px = height // 2, width_px // 2
            prev = out
        if name == "cnn":
            parts.append(_linear(prev * height * width_px, a["num_classes"], True))
        else:
            parts.append(_linear(prev * 4, a["num_classes"], False))
        return _total(*parts)
    # resnet: conv1, bn1, act1; three stages of n basic blocks; fc
    blocks, base = (a["depth"] - 2) // 6, a["width"]
    parts = [
        _conv3x3(a["in_channels"], base, False),
        _batch_norm(base),
        _mask(base * height * width_px, masked),
    ]
    prev = base
    for stage, out in enumerate((base, 2 * base, 4 * base)):
        if stage > 0:  # stride 2 in the stage's first block: padding 1, kernel 3
            height, width_px = (height - 1) // 2 + 1, (width_px - 1) // 2 + 1
        mask = _mask(out * height * width_px, masked)
        tail = _total(_conv3x3(out, out, False), _batch_norm(out), mask)
        parts.append(_total(_conv3x3(prev, out, False), _batch_norm(out), mask, tail))
        parts.append(
            _total(_conv3x3(out, out, False), _batch_norm(out), mask, tail, times=blocks - 1)
        )
        prev = out
    parts.append(_linear(prev, a["num_classes"], True))
    return _total(*parts)


_BUILDERS: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    "mlp": lambda a: MLP(
        a["in_features"],
        a["num_classes"],
        a["depth"],
        a["width"],
        a["activation"],
        a["bias"],
        a["dropout"],
    ),
    "cnn": lambda a: SmallCNN(
        a["in_channels"],
        _image_hw(a["image_size"]),
        a["num_classes"],
        a["channels"],
        a["activation"],
        a["batch_norm"],
        a["dropout"],
    ),
    "vgg-small": lambda a: VGGSmall(
        a["in_channels"],
        _image_hw(a["image_size"]),
        a["num_classes"],
        a["width_multiplier"],
        a["activation"],
        a["batch_norm"],
        a["dropout"],
    ),
    "resnet": lambda a: CifarResNet(
        a["in_channels"], a["num_classes"], a["depth"], a["width"], a["activation"], a["dropout"]
    ),
}


def build_model(spec: dict[str, Any]) -> nn.Module:
    """Build a float32 model from ``{"name": NAME, "args": {...}}`` (see :func:`validate_model_spec`).

    The returned module carries ``model_spec`` (canonical complete spec, JSON-serialisable) and
    ``input_shape`` (one example's shape) attributes.
    """
    complete = validate_model_spec(spec)
    model = _BUILDERS[complete["name"]](complete["args"])
    from sharpcli.models.manipulations import apply_manipulations

    model = apply_manipulations(model, complete["args"], model_input_shape(complete))
    model = model.to(torch.float32)
    model.model_spec = complete
    model.input_shape = model_input_shape(complete)
    return model


# --------------------------------------------------------------------------------------------
# Introspection (works on any nn.Module, zoo or foreign)
# --------------------------------------------------------------------------------------------


def final_linear(
    model: nn.Module, *, source: str = "params", missing: str | None = None
) -> tuple[str, nn.Linear]:
    """The classifier head: the last ``nn.Linear`` in ``named_modules()`` order, as ``(name, module)``.

    Its input is the penultimate representation ``h^(L-1)`` (AD Theorem 2, the activation-decay
    penalty) and its parameters are the scope ``params="last"`` (AD Corollary 1 bound on the
    final layer). The one place that finds the head: analyses, scopes and training steps call it.
    Raises ``UsageError(source=source)`` when the model has no ``nn.Linear``, with the message
    ``missing`` when given (what the caller needed the head for).
    """
    found: tuple[str, nn.Linear] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            found = (name, module)
    if found is None:
        raise UsageError(
            missing
            or f"the model ({type(model).__name__}) has no nn.Linear layer, so it has no final "
            "linear classifier head",
            source=source,
        )
    return found


def activation_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every activation layer ``(name, module)`` in ``named_modules()`` order.

    An activation layer is an instance of :data:`sharpcli.models.activations.ACTIVATION_TYPES`
    (ours and torch's common ones). Its forward hook sees the pre-activation (input) and the
    activation (output) used by activation statistics (MAN section 2).
    """
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, ACTIVATION_TYPES)
    ]
