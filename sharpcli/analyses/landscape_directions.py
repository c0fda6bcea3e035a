"""The directions of a loss-landscape picture, and their file.

- ``random``: filter-normalized Gaussian directions ([Li2018] section 4): each filter
  ``d_i`` (a slice along a weight's first dimension: a convolution's output channel, a
  linear layer's output neuron) is rescaled to the norm of the weight's filter,
  ``d_i <- d_i ||w_i|| / (||d_i|| + 1e-10)``. Parameters with one dimension or none
  (biases, normalization layers' gamma and beta) get a zero direction (``bias_bn="zero"``,
  the ``--xignore biasbn`` of [Li2018]'s code) or the weight itself (``"weights"``, that
  code's default), as that code does.
- ``eigen``: the top Hessian eigenvectors (unit norm, Lanczos of the curvature engine).
- a second checkpoint: ``w1 - w0``, the line of [GoodfellowVinyals2015].

The directions are saved to and read from a safetensors file (tensors ``d1.NAME`` and
``d2.NAME``; metadata: how they were made), so a figure can be redone.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from sharpcli import ledger
from sharpcli.atomic import write_bytes_atomic
from sharpcli.errors import InputError, UsageError

__all__ = [
    "checkpoint_direction",
    "filter_normalized_direction",
    "load_directions",
    "save_directions",
]


def filter_normalized_direction(
    weights: list[torch.Tensor], gen: torch.Generator, bias_bn: str = "zero"
) -> list[torch.Tensor]:
    """A Gaussian direction normalized filter by filter to the weights ([Li2018] eq. 1).

    Args:
        weights: the parameters, one tensor each.
        gen: the random generator (CPU).
        bias_bn: ``"zero"`` or ``"weights"``: the direction of 1-D parameters.

    Returns:
        One direction tensor per parameter, in the weights' dtype and device.
    """
    direction = []
    for w in weights:
        d = torch.randn(w.shape, generator=gen, dtype=torch.float64)
        w64 = w.detach().to(device="cpu", dtype=torch.float64)
        if w.dim() <= 1:
            d = torch.zeros_like(w64) if bias_bn == "zero" else w64.clone()
        else:
            flat_d, flat_w = d.reshape(d.shape[0], -1), w64.reshape(w64.shape[0], -1)
            scale = flat_w.norm(dim=1) / (flat_d.norm(dim=1) + 1e-10)
            d = (flat_d * scale[:, None]).reshape(w.shape)
        direction.append(d.to(dtype=w.dtype, device=w.device))
    return direction


def checkpoint_direction(
    model: nn.Module, names: list[str], other: nn.Module
) -> list[torch.Tensor]:
    """``w1 - w0`` on ``names``: the line from ``model`` (w0) to ``other`` (w1).

    Args:
        model: the first checkpoint's model.
        names: the parameters.
        other: the second checkpoint's model.

    Returns:
        One tensor per parameter.

    Raises:
        UsageError: ``other`` lacks a parameter or has another shape (source ``along``).
    """
    mine = dict(model.named_parameters())
    theirs = dict(other.named_parameters())
    missing = [n for n in names if n not in theirs]
    extra = [n for n in theirs if n not in mine]
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which CKPT lacks"
        raise UsageError(
            f"the second checkpoint is another architecture: it {what}", source="along"
        )
    for n in names:
        if theirs[n].shape != mine[n].shape:
            raise UsageError(
                f"the second checkpoint is another architecture: {n} has shape "
                f"{tuple(theirs[n].shape)}, not {tuple(mine[n].shape)}",
                source="along",
            )
    return [
        theirs[n].detach().to(dtype=mine[n].dtype, device=mine[n].device) - mine[n].detach()
        for n in names
    ]


def save_directions(
    path: str | os.PathLike, names: list[str], directions: list[list[torch.Tensor]], info: dict
) -> None:
    """Write the directions (``d1.NAME``, ``d2.NAME``) and ``info`` to a safetensors file.

    Args:
        path: the file.
        names: the parameters.
        directions: one list of tensors per direction.
        info: how they were made (JSON-ready).
    """
    from safetensors.torch import save

    tensors = {
        f"d{k + 1}.{name}": d.detach().to("cpu").contiguous()
        for k, direction in enumerate(directions)
        for name, d in zip(names, direction)
    }
    metadata = {"sharpcli.landscape": json.dumps(info, sort_keys=True)}
    write_bytes_atomic(path, save(tensors, metadata=metadata))


def load_directions(
    path: str | os.PathLike, model: nn.Module, names: list[str]
) -> tuple[list[list[torch.Tensor]], dict]:
    """The directions of a file :func:`save_directions` wrote, for ``model``'s parameters.

    Args:
        path: the file.
        model: the model (dtype, device, shapes).
        names: the parameters the directions must cover.

    Returns:
        The directions and the file's ``info``.

    Raises:
        InputError: not such a file, or directions for other parameters or shapes.
    """
    from safetensors import SafetensorError, safe_open

    source = str(path)
    if not os.path.isfile(source):
        raise InputError("no such file", source=source)
    ledger.record_input(source, "the directions")
    try:
        with safe_open(source, framework="pt") as handle:
            keys = list(handle.keys())
            tensors = {k: handle.get_tensor(k) for k in keys}
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"not a directions file ({exc})", source=source) from None
    if "sharpcli.landscape" not in metadata:
        raise InputError("not a directions file of sharp landscape", source=source)
    info = json.loads(metadata["sharpcli.landscape"])
    params = dict(model.named_parameters())
    count = max((int(k.split(".", 1)[0][1:]) for k in keys), default=0)
    directions = []
    for k in range(1, count + 1):
        direction = []
        for n in names:
            key = f"d{k}.{n}"
            if key not in tensors or tensors[key].shape != params[n].shape:
                raise InputError(
                    f"holds no direction of shape {tuple(params[n].shape)} for parameter {n}",
                    source=source,
                )
            direction.append(tensors[key].to(dtype=params[n].dtype, device=params[n].device))
        directions.append(direction)
    return directions, info
