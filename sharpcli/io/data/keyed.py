"""Datasets as named arrays: which key is the input, which the label, and keyword inputs.

Tensor files (``.safetensors``, ``.pt``, ``.npz``), ``.npy`` pairs, Arrow files, Hugging
Face ``save_to_disk`` folders and tables with list columns all come down to a mapping
``name -> array``. :func:`dataset_from_mapping` picks the arrays (docs/index.md, ``--data``):

- **inputs**: ``x_key`` (``--x-key``; several keys separated by commas), else ``x`` when
  the mapping has it, else every key that names a forward argument of Hugging Face models
  (:data:`KEYWORD_INPUTS`: ``input_ids``, ``attention_mask``, ``token_type_ids``,
  ``pixel_values``, ...), in the mapping's order;
- **labels**: ``y_key`` (``--y-key``), else the first of ``y``, ``labels``, ``label``;
- **test split**: ``x_test``/``y_test`` beside ``x``/``y``, or ``<key>_test`` for every
  chosen key (all or none).

Inputs named after forward arguments, or several inputs, are *keyword inputs*: the model is
called as ``model(input_ids=..., attention_mask=...)`` batch by batch, or as
``model({"input_ids": ..., ...})`` when its ``forward`` takes the batch dict as its one
argument (:func:`sharpcli.models.outputs.attach_keyword_inputs`, which reads the signature).
They travel as one tensor: one key as it is, several keys of one per-sample shape stacked on
axis 1 (``(N, K, T)`` for ids and masks), several of different shapes each flattened and
concatenated on axis 1 (``Dataset.input_shapes`` holds their shapes); so they must be all
integers or all floats; ``Dataset.input_keys`` names them in order. With the default ``x``/``y`` keys any other key
is refused (a misspelt ``x_tset`` would drop the test split silently); with keys named on
the command line, or keyword inputs, other keys (a text column) are left alone.

Keys appear in messages (``keys found: input_ids, labels``) when they are plain names
(letters, digits, ``_ . -``, at most 64 characters): they are what ``--x-key`` needs. Any
other key is counted, not shown (docs/json.md, "Inputs").
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from sharpcli.errors import InputError
from sharpcli.io.data.dataset import Dataset, as_tensor, finalize_dataset

__all__ = [
    "KEYWORD_INPUTS",
    "LABEL_KEYS",
    "dataset_from_mapping",
    "show_keys",
    "split_key_option",
]

KEYWORD_INPUTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "pixel_values",
    "pixel_mask",
    "input_values",
    "input_features",
    "decoder_input_ids",
    "decoder_attention_mask",
    "bbox",
)
"""Forward-argument names of Hugging Face models that make keyword inputs without ``x_key``."""

LABEL_KEYS = ("y", "labels", "label")
"""Label keys tried in order when ``y_key`` is not given."""

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def show_keys(keys) -> str:
    """The keys for a message: plain names shown, others only counted (module docstring)."""
    keys = [str(k) for k in keys]
    shown = [k for k in keys if _PLAIN_KEY.match(k)]
    hidden = len(keys) - len(shown)
    text = ", ".join(shown[:20]) + (f" and {len(shown) - 20} more" if len(shown) > 20 else "")
    if hidden:
        text += f"{', ' if text else ''}{hidden} key(s) not shown (not plain names)"
    return text or "none"


def split_key_option(value) -> tuple[str, ...] | None:
    """``"input_ids, attention_mask"`` -> ``("input_ids", "attention_mask")``; None stays None."""
    if value is None:
        return None
    keys = tuple(part.strip() for part in str(value).split(",") if part.strip())
    return keys or None


def _input_keys(keys: list[str], x_key, path: str) -> tuple[tuple[str, ...], bool]:
    """``(input keys, keyword)``: the arrays fed to the model and whether by keyword."""
    named = split_key_option(x_key)
    if named is not None:
        missing = [k for k in named if k not in keys]
        if missing:
            raise InputError(
                f"has no key {missing[0]!r} (`x_key`); keys found: {show_keys(keys)}", source=path
            )
        return named, len(named) > 1 or named[0] in KEYWORD_INPUTS
    if "x" in keys:
        return ("x",), False
    keyword = tuple(k for k in keys if k in KEYWORD_INPUTS)
    if keyword:
        return keyword, True
    raise InputError(
        f"has no input key x nor a forward-argument key such as input_ids or pixel_values; "
        f"keys found: {show_keys(keys)}; name the inputs with `x_key` (and the labels with `y_key`)",
        source=path,
    )


def _label_key(keys: list[str], y_key, inputs: tuple[str, ...], path: str) -> str:
    """The key of the labels: ``y_key``, else the first of :data:`LABEL_KEYS` present."""
    if y_key is not None:
        if y_key not in keys:
            raise InputError(
                f"has no key {y_key!r} (`y_key`); keys found: {show_keys(keys)}", source=path
            )
        if y_key in inputs:
            raise InputError(f"key {y_key!r} is both an input and the labels", source=path)
        return y_key
    found = next((k for k in LABEL_KEYS if k in keys and k not in inputs), None)
    if found is None:
        raise InputError(
            f"has no label key ({', '.join(LABEL_KEYS)}); keys found: {show_keys(keys)}; "
            "name it with `y_key`",
            source=path,
        )
    return found


def _test_keys(keys: list[str], inputs: tuple[str, ...], label: str, path: str):
    """The test split's keys (``x_test``/``y_test`` or ``<key>_test``), or None."""
    wanted: tuple[tuple[str, ...], str]
    if inputs == ("x",) and label == "y":
        wanted = ("x_test",), "y_test"
    else:
        wanted = tuple(f"{k}_test" for k in inputs), f"{label}_test"
    present = [k for k in (*wanted[0], wanted[1]) if k in keys]
    if not present:
        return None
    if len(present) != len(wanted[0]) + 1:
        missing = [k for k in (*wanted[0], wanted[1]) if k not in keys]
        raise InputError(
            f"has test key(s) {show_keys(present)} but not {show_keys(missing)}; give all or none",
            source=path,
        )
    return wanted


def _stack_inputs(arrays: list, keys: tuple[str, ...], path: str):
    """``(tensor, shapes)`` of the keyword inputs: one key as it is, several of one shape
    stacked on axis 1 (shapes None), several of different shapes each flattened and
    concatenated on axis 1 (``shapes`` their per-sample shapes)."""
    tensors = [as_tensor(a, k, path) for a, k in zip(arrays, keys)]
    if len(tensors) == 1:
        return tensors[0], None
    first, first_key = tensors[0], keys[0]
    for tensor, key in zip(tensors[1:], keys[1:]):
        if tensor.dim() == 0 or tensor.shape[0] != first.shape[0]:
            raise InputError(
                f"inputs {first_key} {tuple(first.shape)} and {key} {tuple(tensor.shape)} hold "
                "different numbers of samples",
                source=path,
            )
        if tensor.is_floating_point() != first.is_floating_point():
            raise InputError(
                f"inputs {first_key} ({first.dtype}) and {key} ({tensor.dtype}) mix integers and "
                "floats; keyword inputs travel as one tensor and need one kind",
                source=path,
            )
    dtype = torch.float64 if first.is_floating_point() else torch.int64
    if all(t.shape == first.shape for t in tensors):
        return torch.stack([t.to(dtype) for t in tensors], dim=1), None
    shapes = tuple(tuple(int(d) for d in t.shape[1:]) for t in tensors)
    flat = [t.to(dtype).reshape(t.shape[0], -1) for t in tensors]
    return torch.cat(flat, dim=1), shapes


def dataset_from_mapping(content: Mapping, spec: dict, path: str, *, default_keys: bool) -> Dataset:
    """The :class:`Dataset` of a ``name -> array`` mapping (rules in the module docstring).

    ``spec`` holds the optional ``x_key``/``y_key``; ``default_keys`` says the format's
    convention is the ``x``/``y`` keys, whose leftover keys are refused.
    """
    keys = [str(k) for k in content]
    x_key, y_key = spec.get("x_key"), spec.get("y_key")
    inputs, keyword = _input_keys(keys, x_key, path)
    label = _label_key(keys, y_key, inputs, path)
    test = _test_keys(keys, inputs, label, path)
    if default_keys and x_key is None and y_key is None and inputs == ("x",) and label == "y":
        allowed = {"x", "y", "x_test", "y_test"}
        unexpected = [k for k in keys if k not in allowed]
        if unexpected:
            raise InputError(
                f"has {len(unexpected)} key(s) besides x, y, x_test, y_test "
                f"({show_keys(unexpected)}); name the arrays to use with `x_key` and `y_key`",
                source=path,
            )
    x, shapes = _stack_inputs([content[k] for k in inputs], inputs, path)
    x_test = y_test = None
    if test is not None:
        x_test, test_shapes = _stack_inputs([content[k] for k in test[0]], test[0], path)
        if test_shapes != shapes:
            raise InputError(
                f"test inputs have per-sample shapes {test_shapes} but the inputs {shapes}",
                source=path,
            )
        y_test = content[test[1]]
    names = (
        ", ".join(inputs),
        label,
        ", ".join(test[0]) if test else "x_test",
        test[1] if test else "y_test",
    )
    return finalize_dataset(
        x,
        content[label],
        x_test,
        y_test,
        keep_float64=True,
        source=path,
        spec=spec,
        names=names,
        input_keys=inputs if keyword else None,
        input_shapes=shapes,
    )
