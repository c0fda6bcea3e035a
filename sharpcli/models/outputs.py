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

import inspect
import math

import torch
from torch import nn

from sharpcli.errors import UsageError

__all__ = [
    "KEYWORDS",
    "ONE_DICT",
    "attach_keyword_inputs",
    "attach_output_selector",
    "describe_output",
    "input_call_style",
    "keyword_batch",
    "select_output",
]


def describe_output(out) -> str:
    """A short description of a model output, for messages: ``tuple(Tensor(2, 3), dict)``.

    Args:
        out: what a model returned.
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


def keyword_batch(x: torch.Tensor, keys, shapes=None) -> dict:
    """The keyword arguments one batch tensor holds: ``{keys[0]: x}`` for one key, else
    ``{keys[i]: x[:, i]}`` (several inputs of one shape stacked on axis 1, see
    ``Dataset.input_keys``), or, with ``shapes`` (inputs of different shapes, each flattened
    and concatenated on axis 1, see ``Dataset.input_shapes``), ``keys[i]``'s columns of ``x``
    viewed as ``(B, *shapes[i])``.

    Args:
        x: a batch tensor.
        keys: the model's keyword input names.
        shapes: the inputs' per-sample shapes when they travel concatenated, else None.

    Returns:
        The keyword arguments.

    Example:
        >>> sorted(keyword_batch(torch.zeros(2, 3), ["input_ids"]))
        ['input_ids']
    """
    keys = tuple(keys)
    if shapes is not None:
        sizes = [math.prod(shape) for shape in shapes]
        parts = x.split(sizes, dim=1)
        return {
            key: part.reshape(x.shape[0], *shape) for key, part, shape in zip(keys, parts, shapes)
        }
    if len(keys) == 1:
        return {keys[0]: x}
    return {key: x[:, i] for i, key in enumerate(keys)}


KEYWORDS = "keywords"
"""Call style: the batch's inputs as keyword arguments, ``model(x1=..., x2=...)``."""
ONE_DICT = "dict"
"""Call style: the batch's inputs as one dict argument, ``model({"x1": ..., "x2": ...})``."""

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def input_call_style(forward, keys, source: str = "data") -> str:
    """How a ``forward`` takes named inputs ``keys``, read from its signature (never tried):
    :data:`KEYWORDS` or :data:`ONE_DICT`.

    1. **keywords** (``forward(self, x1, x2)``, ``forward(self, input_ids=None, **kwargs)``):
       every key names a parameter (or ``forward`` takes ``**kwargs``), and every parameter
       without a default is one of the keys;
    2. otherwise **one dict** (``forward(self, batch)`` reading ``batch["x1"]``): ``forward``
       has exactly one parameter without a default, positional and not named after a key;
    3. anything else is a UsageError on ``source`` naming the signature and the keys.

    Keywords win where both could be read (they are the first rule): a ``forward(self, x1,
    batch=None)`` with keys ``x1``, ``x2`` gets neither, and a signature that cannot be read
    (a built-in) gets keywords, as Hugging Face models take them.

    Args:
        forward: the bound ``forward`` of the model (``self`` already bound).
        keys: the input names.
        source: the parameter or file the refusal names.

    Returns:
        The call style.

    Example:
        >>> def forward(batch): ...
        >>> input_call_style(forward, ["x1", "x2"])
        'dict'
    """
    keys = tuple(keys)
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: Hugging Face's convention
        return KEYWORDS
    named = {p.name for p in parameters if p.kind in _NAMED}
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)
    required = [
        p
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if (takes_any or all(k in named for k in keys)) and all(p.name in keys for p in required):
        return KEYWORDS
    if len(required) == 1 and required[0].kind in _POSITIONAL and required[0].name not in keys:
        return ONE_DICT
    shown = ", ".join(str(p) for p in parameters)
    raise UsageError(
        f"the model's forward({shown}) takes neither the inputs {', '.join(keys)} as keyword "
        "arguments (every parameter without a default one of them) nor one dict of them (exactly "
        "one parameter without a default, positional, named after none of them); name its "
        "parameters after the inputs or take the batch dict as the one argument",
        source=source,
    )


def attach_keyword_inputs(
    model: nn.Module, keys, source: str = "x_key", shapes=None
) -> object | None:
    """Make ``model(x)`` call ``model(**keyword_batch(x, keys))``, or ``model(keyword_batch(x,
    keys))`` for a ``forward`` that takes the batch dict as its one argument
    (:func:`input_call_style`); returns the hook handle.

    Data with keyword inputs (``input_ids``, ``attention_mask``, ``pixel_values``, ...) travels
    as one tensor through every batch loop, shard and subset; a forward pre-hook on the root
    module unpacks it, so parameter names, ``functional_call`` and ``torch.func`` transforms
    are unchanged. ``keys`` None or empty attaches nothing.

    Args:
        model: the model.
        keys: its keyword input names.
        source: what a signature that takes neither style is a UsageError on.
        shapes: the inputs' per-sample shapes when they travel concatenated
            (:func:`keyword_batch`), else None.

    Returns:
        The hook handle, or ``None`` when nothing was attached.
    """
    if not keys:
        return None
    keys = tuple(keys)
    style = input_call_style(model.forward, keys, source)

    def hook(module, args, kwargs):
        if len(args) == 1 and isinstance(args[0], torch.Tensor) and not kwargs:
            batch = keyword_batch(args[0], keys, shapes)
            return ((batch,), {}) if style == ONE_DICT else ((), batch)
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)
