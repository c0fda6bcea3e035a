"""The model zoo: ``mlp``, ``cnn``, ``vgg-small`` ([MAN] Table 6) and CIFAR ``resnet`` ([He2016]).

A model is built from a JSON-serialisable spec ``{"name": NAME, "args": {...}}``
(:mod:`sharpcli.models.specs`: the arguments, their checks and defaults) by :func:`build_model`;
:func:`final_linear` finds the head the analyses need in any module, zoo or foreign
(:func:`sharpcli.models.activations.activation_modules` the activation layers).

Conventions every zoo model honours (the analyses rely on them):

- every activation is its own ``nn.Module`` instance (built by
  :func:`sharpcli.models.activations.make_activation`, never shared, never functional), so a
  forward hook on it sees that layer's pre-activation (input) and activation (output);
- the last ``nn.Linear`` in ``named_modules()`` order is the classifier head, and its input is the
  penultimate representation ``h^(L-1)`` that activation decay penalises ([AD] Theorem 2);
- every model takes ``dropout`` (default 0): dropout on the hidden representation(s), active only
  in train mode;
- parameters are created in float32 (callers convert with ``.to(dtype)``); initialisation draws
  from torch's global RNG, so seed it first for reproducible weights;
- the built model carries ``model.model_spec`` (the complete spec) and ``model.input_shape``
  (one example's shape) as plain attributes (not in the state_dict).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.models.activations import DEFAULT_ACTIVATION, make_activation
from sharpcli.models.manipulations import apply_manipulations
from sharpcli.models.specs import (
    ACTIVATION_ARG,
    IMAGE_INPUT_ARGS,
    MANIPULATION_ARGS,
    NUM_CLASSES_ARG,
    ModelArg,
    dropout_arg,
    image_hw,
    model_input_shape,
    validate_model_spec,
)
from sharpcli.registry import declare

# ----------------------------------------------------------------------------------- Architectures


@declare(
    "model",
    "mlp",
    "fully connected: depth hidden layers of width units, inputs flattened",
    info={"default": True},
)
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

    # the spec's arguments (sharpcli.models.specs), in schema order
    ARGS = dict(
        in_features=ModelArg("int", required=True, minimum=1, help="flattened input size"),
        num_classes=NUM_CLASSES_ARG,
        depth=ModelArg("int", 2, minimum=0, help="number of hidden layers"),
        width=ModelArg("int", 64, minimum=1, help="hidden units per layer"),
        activation=ACTIVATION_ARG,
        bias=ModelArg("bool", True, help="Linear layers have biases"),
        dropout=dropout_arg("after each activation"),
        **MANIPULATION_ARGS,
    )

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        depth: int = 2,
        width: int = 64,
        activation: str = DEFAULT_ACTIVATION,
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
    pool: Sequence[nn.Module], features: int, num_classes: int, dropout: float, bias: bool = True
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

    features: nn.Module
    classifier: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of an image batch ``(N, C, H, W)``."""
        return self.classifier(self.features(x))


@declare("model", "cnn", "conv blocks with 2x2 max pooling, then a linear head")
class SmallCNN(_FeaturesThenClassifier):
    """A small conv net: ``features`` blocks ``Conv3x3 -> (BatchNorm) -> act -> MaxPool2d(2)``,
    then ``classifier = [Flatten, (Dropout), Linear(c_last * h * w, num_classes)]``.

    With ``channels = [16, 32]`` and no batch norm the state_dict names are ``features.0``,
    ``features.4`` (convs) and ``classifier.1`` (head; ``classifier.2`` with dropout). The head's
    input (flattened last pooled feature map) is the penultimate representation.
    """

    ARGS = dict(
        **IMAGE_INPUT_ARGS,
        channels=ModelArg("int_list", [16, 32], help="conv channels per block"),
        activation=ACTIVATION_ARG,
        batch_norm=ModelArg("bool", False, help="BatchNorm2d after each conv"),
        dropout=dropout_arg("before the head"),
        **MANIPULATION_ARGS,
    )

    @staticmethod
    def check_args(args: dict[str, Any]) -> str | None:
        """Whether the images survive the pooling blocks: a problem, or None."""
        height, width = image_hw(args["image_size"])
        blocks = len(args["channels"])
        if min(height, width) >> blocks < 1:
            return (
                f"{blocks} pooling blocks need images of at least "
                f"{2**blocks if blocks < 50 else f'2**{blocks}'} pixels a side, "
                f"got {height}x{width}; use fewer channels entries"
            )
        return None

    def __init__(
        self,
        in_channels: int,
        image_size: int | Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (16, 32),
        activation: str = DEFAULT_ACTIVATION,
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        prev = in_channels
        size = image_hw(image_size)
        for width in channels:
            blocks += _conv_act(prev, width, activation, batch_norm)
            blocks.append(nn.MaxPool2d(2))
            size = _pooled(size)
            prev = width
        self.features = nn.Sequential(*blocks)
        self.classifier = _classifier([], prev * size[0] * size[1], num_classes, dropout)


VGG_SMALL_CHANNELS = (64, 128, 256, 512)


@declare(
    "model",
    "vgg-small",
    "VGG-small: four conv blocks of 64-128-256-512 channels times width_multiplier",
    paper="MAN",
)
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

    ARGS = dict(
        **IMAGE_INPUT_ARGS,
        width_multiplier=ModelArg("float", 1.0, above=0.0, help="scales 64-128-256-512 channels"),
        activation=ACTIVATION_ARG,
        batch_norm=ModelArg("bool", False, help="BatchNorm2d after each conv (MAN uses none)"),
        dropout=dropout_arg("before the head"),
        **MANIPULATION_ARGS,
    )

    def __init__(
        self,
        in_channels: int,
        image_size: int | Sequence[int],
        num_classes: int,
        width_multiplier: float = 1.0,
        activation: str = DEFAULT_ACTIVATION,
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        prev = in_channels
        size = image_hw(image_size)
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
    """Channel count of a VGG-small block: ``max(1, round(base * width_multiplier))``.

    Args:
        base: the base channel count (64, 128, 256 or 512).
        width_multiplier: the architecture's multiplier.

    Returns:
        The scaled channel count, at least 1.
    """
    return max(1, int(round(base * width_multiplier)))


class ChannelPadShortcut(nn.Module):
    """Parameter-free CIFAR ResNet shortcut ([He2016], option A).

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


@declare("model", "resnet", "CIFAR ResNet of depth 6n+2, option-A shortcuts", paper="He2016")
class CifarResNet(nn.Module):
    """CIFAR ResNet of [He2016] (section 4.2): depth ``6n + 2``.

    ``conv3x3(in, w) -> BN -> act``, then three stages of ``n`` basic blocks with ``w, 2w, 4w``
    channels (the first block of stages 2 and 3 has stride 2 and a parameter-free zero-padding
    shortcut, option A), global average pooling, ``(Dropout)``, ``fc = Linear(4w, classes)``.
    Depth 20 with ``w = 16`` and 10 classes has 269,722 parameters (the paper's 0.27M).
    Convolutions have no bias; conv and linear weights use Kaiming-normal initialisation.
    """

    ARGS = dict(
        **IMAGE_INPUT_ARGS,
        depth=ModelArg("int", 20, minimum=8, help="6n+2: 20, 32, 44, 56, 110"),
        width=ModelArg("int", 16, minimum=1, help="channels of the first stage"),
        activation=ACTIVATION_ARG,
        dropout=dropout_arg("before fc"),
        **MANIPULATION_ARGS,
    )

    @staticmethod
    def check_args(args: dict[str, Any]) -> str | None:
        """Whether the depth is 6n+2: a problem, or None."""
        if (args["depth"] - 2) % 6 != 0:
            return f"depth must be 6n+2 (20, 32, 44, 56, 110), got {args['depth']}"
        return None

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        depth: int = 20,
        width: int = 16,
        activation: str = DEFAULT_ACTIVATION,
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


MODEL_NAMES: tuple[str, ...] = catalogue.MODEL_NAMES


def build_model(spec: dict[str, Any]) -> nn.Module:
    """Build a float32 model from ``{"name": NAME, "args": {...}}`` (see :func:`validate_model_spec`).

    The returned module carries ``model_spec`` (canonical complete spec, JSON-serialisable) and
    ``input_shape`` (one example's shape) attributes.

    Args:
        spec: the model spec.

    Returns:
        The float32 model, ``model_spec`` and ``input_shape`` attached.

    Raises:
        UsageError: a bad spec (as :func:`~sharpcli.models.specs.validate_model_spec`).

    Example:
        >>> build_model({"name": "mlp", "args": {"in_features": 4, "num_classes": 2}}).input_shape
        (4,)
    """
    complete = validate_model_spec(spec)
    architecture = catalogue.MODELS.get(complete["name"])
    taken = inspect.signature(architecture).parameters  # the rest are manipulations
    model = architecture(**{k: v for k, v in complete["args"].items() if k in taken})
    model = apply_manipulations(model, complete["args"], model_input_shape(complete))
    model = model.to(torch.float32)
    # torch's Module.__setattr__ is typed for tensors and modules; any attribute is allowed
    model.model_spec = complete  # type: ignore[assignment]
    model.input_shape = model_input_shape(complete)  # type: ignore[assignment]
    return model


# ------------------------------------------ Introspection (works on any nn.Module, zoo or foreign)


def final_linear(
    model: nn.Module, *, source: str = "params", missing: str | None = None
) -> tuple[str, nn.Linear]:
    """The classifier head: the last ``nn.Linear`` in ``named_modules()`` order, as ``(name, module)``.

    Its input is the penultimate representation ``h^(L-1)`` ([AD] Theorem 2, the activation-decay
    penalty) and its parameters are the scope ``params="last"`` ([AD] Corollary 1 bound on the
    final layer). The one place that finds the head: analyses, scopes and training steps call it.
    Raises ``UsageError(source=source)`` when the model has no ``nn.Linear``, with the message
    ``missing`` when given (what the caller needed the head for).

    Args:
        model: any module.
        source: the parameter an error is blamed on.
        missing: the error message when there is no head.

    Returns:
        ``(name, module)`` of the head.

    Raises:
        UsageError: the model has no ``nn.Linear``.
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
