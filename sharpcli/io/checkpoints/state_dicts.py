"""A file's weights as a model's state_dict: where they are, how their keys read, loading them.

A foreign file's weights may be the whole file or one entry of a training checkpoint
(:data:`CONTAINER_KEYS`, :func:`state_dict_candidates`), with the prefixes that DDP
(``module.``), ``torch.compile`` (``_orig_mod.``) or a LightningModule attribute (``model.``)
put on every key; :func:`match_state_dict` accepts a reading only if it names exactly the
model's tensors, and :func:`load_state` loads it after checking dtypes and shapes name by
name. :mod:`sharpcli.io.checkpoints` builds the model these go into.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import torch
from torch import nn

from sharpcli.errors import InputError

__all__ = [
    "CONTAINER_KEYS",
    "check_finite_weights",
    "half_precision_note",
    "load_state",
    "match_state_dict",
    "state_dict_candidates",
]

CONTAINER_KEYS = ("state_dict", "model_state_dict", "model_state", "model", "module", "net")
"""Entries of a training-checkpoint dict that may hold the model's weights, in the order tried
(``state_dict``: Lightning and most scripts; ``model_state_dict``: the PyTorch tutorial;
``model``/``module``/``net``: other trainers, DeepSpeed)."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _show_key(key) -> str:
    """A key for a one-line message: printable keys as they are, others escaped, 60 chars at most."""
    text = key if isinstance(key, str) and key.isprintable() and key.strip() == key else ascii(key)
    return text if len(text) <= 60 else text[:57] + "..."


def _sample(keys, count: int = 5) -> str:
    keys = list(keys)
    shown = ", ".join(_show_key(k) for k in keys[:count])
    return shown + (", ..." if len(keys) > count else "")


def _is_tensor_mapping(value: object) -> TypeGuard[Mapping[str, torch.Tensor]]:
    return (
        isinstance(value, Mapping)
        and all(isinstance(k, str) for k in value)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )


def state_dict_candidates(obj, path: str | os.PathLike) -> list[tuple[str, dict]]:
    """The mappings of names to tensors in a loaded file that may be the model's weights.

    ``[("", obj)]`` for a plain state_dict; for a training checkpoint (a dict with ``epoch``,
    ``optimizer``, ...) every entry named in :data:`CONTAINER_KEYS` that is a state_dict (or,
    only reachable with ``trust_pickle``, a pickled module), as ``("'state_dict'", ...)``.
    Which one holds this model's weights is decided by :func:`match_state_dict`, against the
    model's keys. Anything else is an ``InputError`` saying what the file holds.
    """
    if _is_tensor_mapping(obj):
        return [("", dict(obj))]
    if not isinstance(obj, Mapping):
        raise InputError(
            f"does not hold a state_dict (a mapping of names to tensors) but a {type(obj).__name__}",
            source=str(path),
        )
    found = []
    for key in CONTAINER_KEYS:
        value = obj.get(key)
        if isinstance(value, nn.Module):  # only unpickled under trust_pickle
            value = value.state_dict()
        if _is_tensor_mapping(value):
            found.append((repr(key), dict(value)))
    if not found:
        entries = [k for k in obj if isinstance(k, str)]
        raise InputError(
            f"does not hold a state_dict (a mapping of names to tensors): a dict of "
            f"{len(obj)} entries ({_sample(entries)}) with no {', '.join(CONTAINER_KEYS)} entry "
            "holding only tensors",
            source=str(path),
        )
    return found


def _leading_components(keys) -> list[str]:
    """The dotted components that begin every key, short of each key's last component."""
    common: list[str] | None = None
    for key in keys:
        parts = key.split(".")[:-1]
        if common is None:
            common = parts
        else:
            n = 0
            while n < min(len(common), len(parts)) and common[n] == parts[n]:
                n += 1
            common = common[:n]
        if not common:
            return []
    return common or []


def _alias_groups(model: nn.Module) -> list[list[str]]:
    """The model's state_dict names grouped by the tensor they name (tied weights: 2+ names)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


@dataclass
class _Renaming:
    """One way to read a candidate mapping's keys as the model's: strip or add a prefix."""

    where: str  # "" for the whole file, or the entry: "'state_dict'"
    strip: str = ""
    add: str = ""

    def apply(self, key: str) -> str:
        return self.add + key[len(self.strip) :]

    def describe(self) -> str:
        parts = [f"the {self.where} entry" if self.where else ""]
        if self.strip:
            parts.append(f"the prefix {self.strip!r} stripped from every key")
        if self.add:
            parts.append(f"the prefix {self.add!r} (the model's) added to every key")
        return ", ".join(p for p in parts if p)


def _renamings(where: str, keys: list[str], model_keys: list[str]) -> list[_Renaming]:
    """As is; then each common leading prefix of the file's keys stripped (``module.``,
    ``model.``, ``module._orig_mod.``, ...); then each common leading prefix of the model's keys
    (a ``torch.compile``-d or wrapped model) added to the file's."""
    out = [_Renaming(where)]
    lead = _leading_components(keys)
    out += [_Renaming(where, strip=".".join(lead[:k]) + ".") for k in range(1, len(lead) + 1)]
    own_lead = _leading_components(model_keys)
    out += [_Renaming(where, add=".".join(own_lead[:k]) + ".") for k in range(1, len(own_lead) + 1)]
    return out


def _fits(renamed: set[str], own: set[str], groups: list[list[str]]) -> bool:
    """Names exactly the model's: nothing unexpected, every tensor (one name of a tied one) given."""
    return renamed <= own and all(any(name in renamed for name in g) for g in groups)


def match_state_dict(
    model: nn.Module, candidates: list[tuple[str, dict]], path: str | os.PathLike
) -> tuple[dict[str, torch.Tensor], str]:
    """The file's weights keyed by the model's state_dict names, and how they were found.

    Tries, for each candidate mapping (:func:`state_dict_candidates`), its keys as they are,
    then with a prefix stripped, then with the model's own prefix added (:func:`_renamings`).
    A prefix is stripped only if *every* key has it, and a renaming is accepted only if the
    renamed keys are exactly the model's state_dict keys (for tied weights one name of the
    pair is enough, and two names must hold equal values), so nothing is guessed: an
    exact match as stored wins; otherwise the accepted readings must agree tensor for tensor,
    or the file is ambiguous (``InputError``). When nothing fits, the ``InputError`` (one
    line, naming the file) lists a sample of the keys found and of the keys the model expects,
    and what the closest reading misses. The description is ``""`` for a plain match.
    """
    own_keys = list(model.state_dict())
    own, groups = set(own_keys), _alias_groups(model)
    fits, closest = _readings(candidates, own_keys, own, groups)
    if not fits:
        raise _no_fit(candidates, own_keys, closest, own, groups, path)
    chosen, state = fits[0]
    _check_readings_agree(fits, path)
    _fill_tied_weights(state, groups, path)
    return {k: state[k] for k in own_keys}, chosen.describe()


def _readings(candidates, own_keys: list[str], own: set[str], groups) -> tuple[list, tuple | None]:
    """Every reading (candidate and renaming) whose keys are exactly the model's, plain ones
    (as stored) alone when there are any; and the reading closest to the model's keys
    (``(overlap, renaming, renamed)``) for the error when none fits."""
    fits: list[tuple[_Renaming, dict]] = []
    closest: tuple[int, _Renaming, dict] | None = None
    for where, mapping in candidates:
        keys = list(mapping)
        for renaming in _renamings(where, keys, own_keys):
            if not all(k.startswith(renaming.strip) for k in keys):
                continue
            renamed = {renaming.apply(k): v for k, v in mapping.items()}
            if _fits(set(renamed), own, groups):
                fits.append((renaming, renamed))
            overlap = len(own.intersection(renamed))
            if closest is None or overlap > closest[0]:
                closest = (overlap, renaming, renamed)
    plain = [f for f in fits if not f[0].strip and not f[0].add]
    return plain or fits, closest


def _same_tensors(a: dict, b: dict) -> bool:
    """Whether two state mappings name the same tensors with equal dtypes, shapes and values."""
    return set(a) == set(b) and all(
        a[k].dtype == v.dtype and a[k].shape == v.shape and torch.equal(a[k], v)
        for k, v in b.items()
    )


def _check_readings_agree(fits: list, path) -> None:
    """An InputError (the file is ambiguous) unless every accepted reading holds the first's
    values tensor for tensor."""
    chosen, state = fits[0]
    for other, other_state in fits[1:]:
        if not _same_tensors(other_state, state):
            raise InputError(
                f"is ambiguous: {chosen.describe() or 'the file as stored'} and "
                f"{other.describe()} both name the model's weights but hold different values; "
                "save the weights you mean on their own",
                source=str(path),
            )


def _fill_tied_weights(state: dict, groups: list[list[str]], path) -> None:
    """Tied weights (one tensor, several names): fill in the names the file leaves out, and
    refuse two given names that hold different values."""
    for group in groups:
        given = [name for name in group if name in state]
        first = state[given[0]]
        for name in given[1:]:
            value = state[name]
            if value.shape != first.shape or not torch.equal(value, first.to(value.dtype)):
                raise InputError(
                    f"tied weights {_show_key(given[0])} and {_show_key(name)} (one tensor in "
                    "the model) hold different values in the file",
                    source=str(path),
                )
        for name in group:
            state.setdefault(name, first)


def _no_fit(candidates, own_keys, closest, own, groups, path) -> InputError:
    """The error when no reading of the file's keys is the model's: what was found, what fits."""
    where, mapping = candidates[0]
    parts = []
    if closest is not None and closest[0] > 0:
        _, renaming, renamed = closest
        missing = [k for k in own_keys if k not in renamed]
        unexpected = [k for k in renamed if k not in own]
        how = renaming.describe()
        if missing:
            parts.append(f"missing {_sample(missing, 3)}")
        if unexpected:
            parts.append(f"unexpected {_sample(unexpected, 3)}")
        if how and parts:
            parts[0] = f"with {how}: {parts[0]}"
        where, mapping = renaming.where, next(m for w, m in candidates if w == renaming.where)
    keys = list(mapping)
    entry = f"'s {where} entry" if where else ""
    parts.append(
        f"the file{entry} holds {len(keys)} keys ({_sample(keys)}), "
        f"the model expects {len(own_keys)} ({_sample(own_keys)})"
    )
    hint = _partial_prefix_hint(keys, own, groups)
    if hint:
        parts.append(hint)
    return InputError(f"state_dict does not match the model: {'; '.join(parts)}", source=str(path))


def _partial_prefix_hint(keys: list[str], own: set[str], groups) -> str:
    """Say so when the keys under one prefix would fit but other keys stop the stripping
    (a LightningModule that also saved a loss weight or a second network)."""
    by_first: dict[str, list[str]] = {}
    for key in keys:
        if "." in key:
            by_first.setdefault(key.split(".", 1)[0], []).append(key)
    for group in by_first.values():
        if len(group) == len(keys):
            continue
        lead = _leading_components(group)
        for k in range(1, len(lead) + 1):
            prefix = ".".join(lead[:k]) + "."
            if _fits({key[len(prefix) :] for key in group}, own, groups):
                others = [key for key in keys if not key.startswith(prefix)]
                n = len(others)
                return (
                    f"the {len(group)} keys under {prefix!r} would fit, but {n} other "
                    f"key{'s' if n != 1 else ''} ({_sample(others, 3)}) "
                    f"{'do' if n != 1 else 'does'} not have that prefix, so it is not stripped; "
                    "save only the model's weights"
                )
    return ""


def load_state(model: nn.Module, state: dict, path: Path) -> None:
    """Check dtypes (floating or not) and shapes name by name, then ``load_state_dict``."""
    own = model.state_dict()
    for key, value in state.items():
        if own[key].is_floating_point() != value.is_floating_point():
            raise InputError(
                f"dtype mismatch for {_show_key(key)}: checkpoint "
                f"{str(value.dtype).replace('torch.', '')}, "
                f"model {str(own[key].dtype).replace('torch.', '')}",
                source=str(path),
            )
        if tuple(value.shape) != tuple(own[key].shape):
            raise InputError(
                f"shape mismatch for {_show_key(key)}: checkpoint {tuple(value.shape)}, "
                f"model {tuple(own[key].shape)}",
                source=str(path),
            )
    _widen_to(model, state)
    model.load_state_dict(state, strict=True)


def _widen_to(model: nn.Module, state: dict) -> None:
    """Cast ``model`` to the widest floating dtype of ``state`` when that is wider than its own.

    ``load_state_dict`` copies into the model's tensors, so float64 weights loaded into a
    factory's float32 model would be rounded to float32 before ``--dtype float64`` widens them
    again: a float64 checkpoint must reach a float64 analysis exactly. (Narrower weights, e.g.
    float16, go into the wider model exactly; the analysis dtype is set later either way.)
    """
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    if not dtypes:
        return
    widest = max(dtypes, key=lambda d: torch.finfo(d).bits)
    own = [t.dtype for t in model.state_dict().values() if t.is_floating_point()]
    if own and all(torch.finfo(d).bits < torch.finfo(widest).bits for d in own):
        model.to(widest)


def half_precision_note(model: nn.Module, state: dict, path: Path) -> str | None:
    """A note when float16/bfloat16 weights went into a wider model (cast exactly, and the
    analysis then runs in ``--dtype``; the weights keep only the file's precision)."""
    own = model.state_dict()
    half: dict[str, list[str]] = {}
    for key, value in state.items():
        if value.dtype in _HALF_DTYPES and own[key].dtype not in _HALF_DTYPES:
            half.setdefault(str(value.dtype).replace("torch.", ""), []).append(key)
    if not half:
        return None
    floating = sum(1 for v in state.values() if v.is_floating_point())
    stored = " and ".join(
        f"{dtype} ({len(keys)} of {floating} tensors)" for dtype, keys in half.items()
    )
    return (
        f"{path}: weights stored as {stored} are cast to the analysis dtype (exactly: the "
        "values keep their half precision)"
    )


def check_finite_weights(model: nn.Module, path: str) -> None:
    """An InputError on ``path`` naming the first tensor of ``model`` that cannot be a weight.

    Parameters and normalisation statistics (a BatchNorm's running mean and variance) must be
    finite. Other floating-point buffers may hold +-Inf but not NaN: an additive attention mask
    (``nn.Transformer.generate_square_subsequent_mask``) is -Inf above the diagonal by design.
    """
    from torch.nn.modules.batchnorm import _NormBase

    statistics = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, _NormBase)
        for name, _ in module.named_buffers(recurse=False)
    }
    strict = statistics | {name for name, _ in model.named_parameters()}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        # one pass without a P-sized mask: the extremes are finite exactly when every entry
        # is (NaN propagates into both), and +-Inf without NaN leaves them non-NaN
        low, high = torch.aminmax(tensor.detach())
        if name in strict and not bool(torch.isfinite(low) & torch.isfinite(high)):
            raise InputError(f"weights contain NaN or Inf in {name}", source=path)
        if bool(torch.isnan(low) | torch.isnan(high)):
            raise InputError(f"weights contain NaN in the buffer {name}", source=path)
