"""The size of a zoo model's state_dict, computed from its spec without building it.

A checkpoint's metadata (or ``--arch-args``) decides what :func:`sharpcli.models.zoo.build_model`
allocates, so a file can ask for ``width = 10**9`` (64 GB) or ``depth = 200000`` (minutes and
gigabytes of modules before any weight is compared);
:func:`sharpcli.io.checkpoints.load_checkpoint` compares :func:`estimate_state_size` with what
the file stores and refuses absurd models before building them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sharpcli import catalogue
from sharpcli.models.specs import image_hw, validate_model_spec
from sharpcli.models.zoo import MLP, VGG_SMALL_CHANNELS, SmallCNN, VGGSmall, vgg_small_width

__all__ = ["StateSize", "estimate_state_size"]


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

    Args:
        spec: a model spec.

    Returns:
        ``StateSize(tensors, values)``.

    Raises:
        UsageError: a bad spec.

    Example:
        >>> spec = {"name": "mlp", "args": {"in_features": 4, "num_classes": 2, "depth": 1}}
        >>> estimate_state_size({**spec, "args": {**spec["args"], "width": 3}})
        StateSize(tensors=4, values=23)
    """
    complete = validate_model_spec(spec)
    architecture, a = catalogue.MODELS.get(complete["name"]), complete["args"]
    masked = a.get("mask_ratio", 0.0) > 0.0
    if architecture is MLP:
        depth, width, bias = a["depth"], a["width"], a["bias"]
        head_in = width if depth > 0 else a["in_features"]
        parts = [_linear(head_in, a["num_classes"], bias)]
        if depth > 0:
            parts.append(_total(_linear(a["in_features"], width, bias), _mask(width, masked)))
            parts.append(_total(_linear(width, width, bias), _mask(width, masked), times=depth - 1))
        return _total(*parts)
    height, width_px = image_hw(a["image_size"])
    if architecture in (SmallCNN, VGGSmall):
        if architecture is SmallCNN:
            channels = a["channels"]
        else:
            channels = [vgg_small_width(base, a["width_multiplier"]) for base in VGG_SMALL_CHANNELS]
        parts, prev = [], a["in_channels"]
        for out in channels:
            pixels = out * height * width_px  # the mask covers the pre-activation before pooling
            parts += [_conv3x3(prev, out, True), _batch_norm(out, a["batch_norm"])]
            parts.append(_mask(pixels, masked))
            if (
                architecture is SmallCNN or min(height, width_px) >= 2
            ):  # VGG-small skips a too-small pool
                height, width_px = height // 2, width_px // 2
            prev = out
        if architecture is SmallCNN:
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
