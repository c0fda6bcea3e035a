"""One logits tensor from whatever a model returns.

Researchers' models return a tensor, a tuple or list (logits plus auxiliary outputs), a dict
or a HuggingFace-style output object with a ``.logits`` attribute. Every analysis needs one
logits tensor, so the model's output is mapped by the ``output`` argument (``--output``):

- absent (the default): the tensor itself; ``.logits`` or the ``"logits"`` key when there is
  one; otherwise the first tensor of a tuple, list or dict (in its order);
- an integer (``"0"``, ``"1"``, ``"-1"``): that element of a tuple or list;
- any other word: that key of a dict, or that attribute of an output object.

:func:`attach_output_selector` installs the mapping as a forward hook on the root module,
so parameter names, ``functional_call`` and ``torch.func`` transforms are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from sharpcli.errors import UsageError

__all__ = [
    "attach_keyword_inputs",
    "attach_output_selector",
    "describe_output",
    "keyword_batch",
    "select_output",
]


def describe_output(out) -> str:
    """A short description of a model output, for messages: ``tuple(Tensor(2, 3), dict)``.

    Args:
        out: what a model returned.

    Returns:
        The description.
    """
    if isinstance(out, torch.Tensor):
        return f"Tensor{tuple(out.shape)}"
    if isinstance(out, (tuple, list)):
        inner = ", ".join(describe_output(o) for o in list(out)[:4])
        return f"{type(out).__name__}({inner}{', ...' if len(out) > 4 else ''})"
    if isinstance(out, dict):
        return f"{type(out).__name__} with keys {', '.join(map(str, list(out)[:6]))}"
    return type(out).__name__


def _default(out):
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    return None


def select_output(out, output: str | None = None) -> torch.Tensor:
    """The logits in ``out`` by ``output`` (module docstring); UsageError if there are none.

    Args:
        out: what a model returned.
        output: where the logits are (module docstring); ``None`` for the default rule.

    Returns:
        The logits tensor.

    Raises:
        UsageError: there is no tensor where ``output`` says, or none at all.
    """
    if isinstance(out, torch.Tensor) and output is None:
        return out
    if output is None:
        chosen = _default(out)
    elif isinstance(out, (tuple, list)) and output.lstrip("-").isdigit():
        index = int(output)
        chosen = out[index] if -len(out) <= index < len(out) else None
    elif isinstance(out, dict):
        chosen = out.get(output)
    else:
        chosen = getattr(out, output, None)
    if not isinstance(chosen, torch.Tensor):
        missing = "no logits tensor in it" if output is None else f"no tensor at {output!r}"
        raise UsageError(
            f"the model returns {describe_output(out)}, {missing}; choose one with "
            "`output` (an index, a key or an attribute)",
            source="output",
        )
    return chosen


def attach_output_selector(model: nn.Module, output: str | None = None):
    """Make ``model(x)`` return :func:`select_output` of its output; returns the hook handle.

    Nothing is attached for a model that already returns a tensor and needs no ``output``.

    Args:
        model: the model.
        output: where the logits are.
    """

    def hook(module, args, out):
        return select_output(out, output)

    return model.register_forward_hook(hook)


def keyword_batch(x: torch.Tensor, keys) -> dict:
    """The keyword arguments one batch tensor holds: ``{keys[0]: x}`` for one key, else
    ``{keys[i]: x[:, i]}`` (several inputs stacked on axis 1, see ``Dataset.input_keys``).

    Args:
        x: a batch tensor.
        keys: the model's keyword input names.

    Returns:
        The keyword arguments.

    Example:
        >>> sorted(keyword_batch(torch.zeros(2, 3), ["input_ids"]))
        ['input_ids']
    """
    keys = tuple(keys)
    if len(keys) == 1:
        return {keys[0]: x}
    return {key: x[:, i] for i, key in enumerate(keys)}


def attach_keyword_inputs(model: nn.Module, keys) -> object | None:
    """Make ``model(x)`` call ``model(**keyword_batch(x, keys))``; returns the hook handle.

    Data with keyword inputs (``input_ids``, ``attention_mask``, ``pixel_values``, ...) travels
    as one tensor through every batch loop, shard and subset; a forward pre-hook on the root
    module unpacks it, so parameter names, ``functional_call`` and ``torch.func`` transforms
    are unchanged. ``keys`` None or empty attaches nothing.

    Args:
        model: the model.
        keys: its keyword input names.

    Returns:
        The hook handle, or ``None`` when nothing was attached.
    """
    if not keys:
        return None
    keys = tuple(keys)

    def hook(module, args, kwargs):
        if len(args) == 1 and isinstance(args[0], torch.Tensor) and not kwargs:
            return (), keyword_batch(args[0], keys)
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)
