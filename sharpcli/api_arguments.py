"""The checks of the arguments a user passes to ``Curvature`` and ``Tracker``.

Each returns the value as the library uses it, or raises a UsageError naming the argument.
"""

from __future__ import annotations

import torch

from sharpcli.errors import UsageError
from sharpcli.preflight import check_seed, resolve_device, resolve_dtype


def integer_argument(value: object, name: str, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum``; a UsageError naming ``name`` otherwise.

    Args:
        value: the argument as passed.
        name: the argument's name, the error's source.
        minimum: the least value accepted.

    Returns:
        ``value``.

    Raises:
        UsageError: (``name``) a bool, not an integer, or below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"must be an integer >= {minimum}, got {value!r}", source=name)
    return value


def seed_argument(seed: object) -> int:
    """``seed`` if it is an integer in ``0..MAX_SEED`` (:func:`sharpcli.preflight.check_seed`).

    Args:
        seed: the argument as passed.

    Returns:
        ``seed``; a UsageError on ``seed`` otherwise.
    """
    return check_seed(seed, "seed")


def dtype_argument(dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The products' dtype: ``model_dtype`` for None, else a floating dtype or its name.

    Args:
        dtype: None, ``"float32"``/``"float64"`` or a floating ``torch.dtype``.
        model_dtype: The dtype of the model's parameters.

    Returns:
        The dtype the products run in.

    Raises:
        UsageError: (``dtype``) neither a floating dtype nor its name.
    """
    if dtype is None:
        return model_dtype
    if isinstance(dtype, str):
        return resolve_dtype(dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UsageError(
            f"expected a floating torch dtype or 'float32'/'float64', got {dtype!r}",
            source="dtype",
        )
    return dtype


def device_argument(device: str | torch.device | None, model_device: torch.device) -> torch.device:
    """The products' device: ``model_device`` for None, else ``device`` as torch reads it.

    Args:
        device: None, a ``torch.device`` or a name (``"cpu"``, ``"cuda:0"``).
        model_device: The device of the model's parameters.

    Returns:
        The device the products run on (:func:`sharpcli.preflight.resolve_device`).
    """
    if device is None:
        return model_device
    return resolve_device(str(device))
