"""Checkpoints: the tool's own self-describing ``.safetensors`` files and foreign ones.

Own format (docs/commands/train.md): one ``.safetensors`` file whose tensors are the
model's state_dict and whose string metadata holds

- ``sharpcli.format``  format version (``"1"``),
- ``sharpcli.model``   JSON ``{"name": ..., "args": {...}}`` that ``build_model`` accepts,
- ``sharpcli.data``    JSON data spec that ``load_dataset`` accepts,
- ``sharpcli.train``   JSON training configuration (regularizers and seed included),
- ``sharpcli.metrics`` JSON final metrics,

so a checkpoint rebuilds its model and finds its data with no extra flag. The metadata is
untrusted input: each value must be JSON of the right kind (an object; the data spec may be a
string) nested at most :data:`MAX_METADATA_DEPTH` levels, and the model it describes is sized
from its arguments (:func:`sharpcli.models.estimate_state_size`) and refused when absurd for
the file (:func:`check_model_size`) before anything is allocated.

Foreign checkpoints: ``.safetensors`` or ``.pt/.pth/.bin/.ckpt`` files with ``arch``/``arch_args``
or ``model_factory="module:function"``. Torch files are read with
``torch.load(weights_only=True)``; a pickled whole module (or any other pickled object) is
refused unless ``trust_pickle`` (unpickling runs code). The weights may be the whole file or
one entry of a training checkpoint (``state_dict``, ``model_state_dict``, ... see
:data:`CONTAINER_KEYS`), with the prefixes that DDP (``module.``), ``torch.compile``
(``_orig_mod.``) or a LightningModule attribute (``model.``) put on every key; how they are
matched to the model is :func:`match_state_dict`. docs/checkpoints.md is the user's account.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from sharpcli import ledger
from sharpcli.atomic import write_bytes_atomic
from sharpcli.bounded import check_data_path
from sharpcli.errors import InputError, UsageError

FORMAT_VERSION = "1"
META_FORMAT = "sharpcli.format"
META_MODEL = "sharpcli.model"
META_DATA = "sharpcli.data"
META_TRAIN = "sharpcli.train"
META_METRICS = "sharpcli.metrics"

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
"""Extensions read with ``torch.load`` (``.ckpt``: PyTorch Lightning; ``x.pth.tar`` also works)."""

CONTAINER_KEYS = ("state_dict", "model_state_dict", "model_state", "model", "module", "net")
"""Entries of a training-checkpoint dict that may hold the model's weights, in the order tried
(``state_dict``: Lightning and most scripts; ``model_state_dict``: the PyTorch tutorial;
``model``/``module``/``net``: other trainers, DeepSpeed)."""

MAX_METADATA_DEPTH = 32
"""Deepest nesting of lists/objects accepted in a metadata value (real ones are 2-3 deep)."""

MAX_MODEL_VALUES = 2**31
"""No model described by metadata or ``arch_args`` may hold more values than this."""

SIZE_RATIO = 10
VALUES_SLACK = 1 << 20
TENSORS_SLACK = 1024
"""A described model may exceed what the file stores by ``SIZE_RATIO`` times plus these slacks
(cheap to build, and a near miss then gets the precise missing/shape-mismatch error)."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class LoadedCheckpoint:
    """A model rebuilt from a checkpoint and what the checkpoint says about itself."""

    model: nn.Module
    path: str
    sha256: str
    model_spec: dict | None = None
    data_spec: dict | None = None
    train_config: dict | None = None
    metrics: dict | None = None
    origin: str = "sharpcli"  # sharpcli | state_dict | pickle | huggingface
    # what loading did that the user should know (entry used, prefix stripped, dtype cast)
    notes: list[str] = field(default_factory=list)

    def info(self) -> dict:
        """The ``checkpoint`` block of the JSON report (``notes`` only when there are any)."""
        info = {
            "path": self.path,
            "sha256": self.sha256,
            "model": self.model_spec,
            "origin": self.origin,
            "train": self.train_config,
        }
        if self.notes:
            info["notes"] = list(self.notes)
        return info


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 digest of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    model_spec: dict,
    data_spec: dict | None = None,
    train_config: dict | None = None,
    metrics: dict | None = None,
) -> str:
    """Write ``model``'s state_dict with sharpcli metadata atomically; return its sha256.

    The file is staged in the publication in effect (:mod:`sharpcli.atomic`): under a command
    it appears with the command's other outputs at its end, so the digest is of the bytes."""
    from safetensors.torch import save

    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    metadata = {
        META_FORMAT: FORMAT_VERSION,
        META_MODEL: json.dumps(model_spec, sort_keys=True),
        META_DATA: json.dumps(data_spec, sort_keys=True),
        META_TRAIN: json.dumps(train_config, sort_keys=True),
        META_METRICS: json.dumps(metrics, sort_keys=True),
    }
    data = _canonical_safetensors(save(state, metadata=metadata))
    write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def _canonical_safetensors(data: bytes) -> bytes:
    """``data`` with its JSON header's keys sorted, so equal contents give equal bytes.

    safetensors writes the header's ``__metadata__`` in hash-map order, which differs from
    process to process; the header keeps its length (the same keys and values, compact JSON,
    padded with spaces), so the tensor offsets are unchanged.
    """
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(canonical) > size:  # cannot happen for the same content; keep the original then
        return data
    return data[:8] + canonical.ljust(size, b" ") + data[8 + size :]


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    try:
        tensors = {}
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            for key in fh.keys():
                tensors[key] = fh.get_tensor(key)
    except Exception as exc:  # safetensors raises its own error type for corrupt files
        raise InputError(
            f"not a readable safetensors file ({_first_line(exc)})", source=str(path)
        ) from exc
    return tensors, meta


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _read_torch_file(path: Path, trust_pickle: bool):
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        pickled_object = "Unsupported global" in text or "GLOBAL" in text
        if not pickled_object:
            raise InputError(
                f"not a readable PyTorch file ({_first_line(exc)})", source=str(path)
            ) from exc
        if not trust_pickle:
            found = re.search(r"GLOBAL ([A-Za-z_][\w.]{0,100})", text)
            named = f" ({found.group(1)})" if found else ""
            raise InputError(
                f"holds a pickled Python object{named}, not only tensors; unpickling runs code, "
                "so it is refused (pass `trust_pickle` if you trust this file)",
                source=str(path),
            ) from exc
    try:
        return torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as exc:
        raise InputError(f"could not unpickle ({_first_line(exc)})", source=str(path)) from exc


def _json_depth(value, limit: int) -> int:
    """Nesting depth of parsed JSON (``[]`` is 1), iteratively; stops counting past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                break
            stack.extend(
                (child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


def _json_kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number"
    )


def _parse_json_meta(meta: dict, key: str, path: Path, kinds: tuple[type, ...] = (dict,)):
    """The JSON value of metadata ``key`` (``None`` when absent or ``null``), checked.

    The metadata is untrusted text: invalid JSON, nesting deeper than
    :data:`MAX_METADATA_DEPTH` (Python's JSON parser raises ``RecursionError`` a thousand levels
    down, and later code that walks the value would recurse as deep), numbers too long to
    convert, or a value of the wrong kind (``sharpcli.train = [1, 2]``, ``sharpcli.model = 5``,
    which later code would call ``.get`` on) are an ``InputError`` naming the file (exit 2).
    """
    raw = meta.get(key)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except RecursionError:
        raise InputError(
            f"metadata {key} is nested too deeply (more than {MAX_METADATA_DEPTH} levels)",
            source=str(path),
        ) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"metadata {key} is not valid JSON", source=str(path)) from exc
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InputError(
            f"metadata {key} holds a number too long to read", source=str(path)
        ) from exc
    if _json_depth(value, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
        raise InputError(
            f"metadata {key} is nested too deeply (more than {MAX_METADATA_DEPTH} levels)",
            source=str(path),
        )
    if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
        wanted = " or ".join(_json_kind(kind()) for kind in kinds)
        raise InputError(
            f"metadata {key} must be {wanted}, got {_json_kind(value)}", source=str(path)
        )
    return value


def factory_from_string(spec: str, arch_args: dict | None = None) -> nn.Module:
    """Call ``module:function`` (importable from the working directory or PYTHONPATH)."""
    if ":" not in spec:
        raise UsageError("expected module:function", source="model_factory")
    module_name, func_name = spec.split(":", 1)
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UsageError(
            f"cannot import {module_name!r} ({_first_line(exc)})", source="model_factory"
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UsageError(f"{module_name!r} has no function {func_name!r}", source="model_factory")
    try:
        model = func(**(arch_args or {}))
    except Exception as exc:
        raise UsageError(f"{spec} failed ({_first_line(exc)})", source="model_factory") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"{spec} returned {type(model).__name__}, not a torch.nn.Module",
            source="model_factory",
        )
    return model


FACTORY_PREFIX = "factory:"


def _own_module_origin(module_name: str) -> str | None:
    """The file of ``module_name``'s top-level package if it is the user's own code: found in
    the working directory or a PYTHONPATH folder (not the standard library or an installed
    package). ``None`` otherwise. Nothing is imported."""
    import importlib.util

    top = module_name.split(".", 1)[0]
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or origin in ("built-in", "frozen"):
        return None
    folders = [cwd] + [f for f in os.environ.get("PYTHONPATH", "").split(os.pathsep) if f]
    real = os.path.realpath(origin)
    for folder in folders:
        base = os.path.realpath(folder)
        if real.startswith(base + os.sep):
            return origin
    return None


def factory_from_metadata(name: str, args: dict, path: Path) -> nn.Module:
    """Rebuild a model that ``sharp train --model-factory`` recorded as ``factory:module:fn``.

    A file's metadata may name any importable function, so sharp calls it only when its module
    is the user's own code (:func:`_own_module_origin`); an installed or standard-library
    module needs ``--model-factory`` on the command line. A missing module is an InputError
    naming the checkpoint and the module.
    """
    spec = name[len(FACTORY_PREFIX) :]
    module_name = spec.split(":", 1)[0]
    if _own_module_origin(module_name) is None:
        raise InputError(
            f"was trained with `model_factory={spec}`, whose module {module_name!r} is not in "
            "the working directory or on PYTHONPATH; run from the folder that holds it, or pass "
            f"`model_factory={spec}` to rebuild it from an installed package",
            source=str(path),
        )
    try:
        return factory_from_string(spec, args)
    except UsageError as exc:
        raise InputError(f"cannot rebuild its model ({exc.message})", source=str(path)) from exc


def _show_key(key) -> str:
    """A key for a one-line message: printable keys as they are, others escaped, 60 chars at most."""
    text = key if isinstance(key, str) and key.isprintable() and key.strip() == key else ascii(key)
    return text if len(text) <= 60 else text[:57] + "..."


def _sample(keys, count: int = 5) -> str:
    keys = list(keys)
    shown = ", ".join(_show_key(k) for k in keys[:count])
    return shown + (", ..." if len(keys) > count else "")


def _is_tensor_mapping(value) -> bool:
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
    own_state = model.state_dict()
    own_keys = list(own_state)
    own, groups = set(own_keys), _alias_groups(model)
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
    fits = plain or fits
    if not fits:
        raise _no_fit(candidates, own_keys, closest, own, groups, path)
    chosen, state = fits[0]
    for other, other_state in fits[1:]:
        same = set(other_state) == set(state) and all(
            other_state[k].dtype == v.dtype
            and other_state[k].shape == v.shape
            and torch.equal(other_state[k], v)
            for k, v in state.items()
        )
        if not same:
            raise InputError(
                f"is ambiguous: {chosen.describe() or 'the file as stored'} and "
                f"{other.describe()} both name the model's weights but hold different values; "
                "save the weights you mean on their own",
                source=str(path),
            )
    for group in groups:  # tied weights: fill in a missing name, check two given names agree
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
    return {k: state[k] for k in own_keys}, chosen.describe()


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


def _load_state(model: nn.Module, state: dict, path: Path) -> None:
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


def _half_precision_note(model: nn.Module, state: dict, path: Path) -> str | None:
    """A note when float16/bfloat16 weights went into a wider model (cast exactly, and the
    analysis then runs in ``--dtype``; the weights keep only the file's precision)."""
    own = model.state_dict()
    half = {}
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


def _format_count(n: int) -> str:
    """A count for a message; beyond 10**15 as a power of ten (str() of a huge int may raise)."""
    if n < 10**15:
        return f"{n:,}"
    return f"about 10^{int((n.bit_length() - 1) * 0.30103)}"


def check_model_size(
    spec: dict, candidates: list[tuple[str, dict]], path, described_by: str
) -> None:
    """Refuse to build a zoo model that is absurd for the file, before allocating anything.

    The model's size comes from its arguments alone
    (:func:`sharpcli.models.estimate_state_size`, exact and instant). Refused (``InputError``
    naming the file, exit 2): more than :data:`MAX_MODEL_VALUES` values, or more than
    :data:`SIZE_RATIO` times the values (or tensors) the file stores plus a small slack. A file
    whose weights fit the model stores exactly as many, so a legitimate checkpoint never trips
    this; without it, metadata saying ``width = 10**9`` allocated 64 GB (an internal error) and
    ``depth = 200000`` spent two minutes and 1.8 GB building modules only to report missing keys.
    """
    from sharpcli.models import estimate_state_size

    size = estimate_state_size(spec)
    stored_values = max(sum(int(t.numel()) for t in m.values()) for _, m in candidates)
    stored_tensors = max(len(m) for _, m in candidates)
    name = spec.get("name")
    described = (
        f"the model {described_by} ({name}) would have {_format_count(size.values)} values in "
        f"{_format_count(size.tensors)} tensors"
    )
    if size.values > MAX_MODEL_VALUES:
        raise InputError(
            f"{described}, more than the limit of 2**31; refusing to build it", source=str(path)
        )
    if (
        size.values > SIZE_RATIO * stored_values + VALUES_SLACK
        or size.tensors > SIZE_RATIO * stored_tensors + TENSORS_SLACK
    ):
        raise InputError(
            f"{described}, but the file stores {_format_count(stored_values)} values in "
            f"{_format_count(stored_tensors)} tensors; refusing to build it",
            source=str(path),
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
        if not tensor.is_floating_point():
            continue
        if name in strict and not torch.isfinite(tensor).all():
            raise InputError(f"weights contain NaN or Inf in {name}", source=path)
        if torch.isnan(tensor).any():
            raise InputError(f"weights contain NaN in the buffer {name}", source=path)


def _build_zoo_model(spec: dict, candidates, path: Path, described_by: str, *, metadata: bool):
    """Validate ``spec``, size it against the file (:func:`check_model_size`), then build it."""
    from sharpcli.models import build_model, validate_model_spec

    try:
        validate_model_spec(spec)
    except UsageError as exc:
        if metadata:
            raise InputError(
                f"metadata names a model that cannot be built ({exc.message})", source=str(path)
            ) from exc
        # the zoo names its model and model_args; here they came as arch and arch_args
        source = {"model": "arch", "model_args": "arch_args"}.get(exc.source, exc.source)
        raise UsageError(exc.message, source=source) from exc
    check_model_size(spec, candidates, path, described_by)
    return build_model(spec)


def _is_torch_file(p: Path) -> bool:
    suffixes = [x.lower() for x in p.suffixes]
    return p.suffix.lower() in TORCH_SUFFIXES or suffixes[-2:] in (
        [".pth", ".tar"],
        [".pt", ".tar"],
    )


def _load_hf_folder(p: Path, *, arch: str | None, model_factory: str | None) -> LoadedCheckpoint:
    """A Hugging Face ``save_pretrained`` folder (:mod:`sharpcli.io.hf_models`); any other
    folder is an InputError."""
    from sharpcli.io.hf_models import HF_PREFIX, is_hf_model_folder, load_hf_model, weights_file

    if not is_hf_model_folder(p):
        raise InputError(
            "is a folder, not a checkpoint file (a Hugging Face save_pretrained folder holds "
            "config.json and model.safetensors)",
            source=str(p),
        )
    if arch is not None or model_factory is not None:
        option = "arch" if arch is not None else "model_factory"
        raise UsageError(
            "a Hugging Face folder builds its model from its config.json", source=option
        )
    weights = weights_file(p)
    ledger.record_input(p / "config.json", "the checkpoint's config")
    ledger.record_input(weights, "the checkpoint")
    model, name = load_hf_model(p)
    check_finite_weights(model, str(p))
    return LoadedCheckpoint(
        model=model,
        path=str(p),
        sha256=sha256_file(weights),
        origin="huggingface",
        model_spec={"name": HF_PREFIX + name, "args": {}},
        notes=[f"{p}: built {name} with transformers from the folder (eager attention)"],
    )


def load_checkpoint(
    path: str | os.PathLike,
    *,
    arch: str | None = None,
    arch_args: dict | None = None,
    model_factory: str | None = None,
    trust_pickle: bool = False,
) -> LoadedCheckpoint:
    """Rebuild a model from a checkpoint (own or foreign) and verify its weights are finite.

    Foreign files may be plain state_dicts or training checkpoints, with the usual key prefixes
    (:func:`state_dict_candidates`, :func:`match_state_dict`); float16/bfloat16 weights load
    into the model's float parameters with a note (``LoadedCheckpoint.notes``). A zoo model
    described by metadata or ``arch_args`` is sized before it is built
    (:func:`check_model_size`). Every problem with the file is an ``InputError`` naming it.
    """
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", source=str(p))
    if p.is_dir():
        return _load_hf_folder(p, arch=arch, model_factory=model_factory)
    check_data_path(str(p))  # a FIFO or device would be read (hashed) forever
    ledger.record_input(p, "the checkpoint")
    suffix = p.suffix.lower()
    digest = sha256_file(p)
    override = arch is not None or model_factory is not None
    if arch is not None and model_factory is not None:
        raise UsageError("give `arch` or `model_factory`, not both", source="arch")

    model_spec = data_spec = train_config = metrics = None
    origin = "state_dict"
    if suffix == ".safetensors":
        state, meta = _read_safetensors(p)
        candidates = [("", state)]
        if META_MODEL in meta:
            origin = "sharpcli"
            model_spec = _parse_json_meta(meta, META_MODEL, p)
            data_spec = _parse_json_meta(meta, META_DATA, p, (dict, str))
            train_config = _parse_json_meta(meta, META_TRAIN, p)
            metrics = _parse_json_meta(meta, META_METRICS, p)
    elif _is_torch_file(p):
        state = _read_torch_file(p, trust_pickle)
        if isinstance(state, nn.Module):
            origin = "pickle"
            model = state
            check_finite_weights(model, str(p))
            return LoadedCheckpoint(
                model=model,
                path=str(p),
                sha256=digest,
                origin=origin,
                model_spec={"name": type(model).__name__, "args": {}},
            )
        candidates = state_dict_candidates(state, p)
    else:
        raise InputError(
            f"unknown checkpoint format {suffix or '(no extension)'}; expected .safetensors, "
            ".pt, .pth, .bin or .ckpt",
            source=str(p),
        )

    if override:
        if model_factory is not None:
            model = factory_from_string(model_factory, arch_args)
            model_spec = {"name": f"factory:{model_factory}", "args": arch_args or {}}
        else:
            model_spec = {"name": arch, "args": arch_args or {}}
            model = _build_zoo_model(
                model_spec, candidates, p, "given by `arch` and `arch_args`", metadata=False
            )
        origin = "state_dict" if origin != "sharpcli" else origin
    elif model_spec is None:
        raise InputError(
            "has no sharpcli metadata; say how to build the model with `arch=NAME` "
            "`arch_args=JSON` or `model_factory=module:function`",
            source=str(p),
        )
    elif str(model_spec.get("name", "")).startswith(FACTORY_PREFIX):
        model = factory_from_metadata(model_spec["name"], model_spec.get("args") or {}, p)
    else:
        model = _build_zoo_model(
            model_spec, candidates, p, f"in metadata {META_MODEL}", metadata=True
        )
    state, how = match_state_dict(model, candidates, p)
    notes = [f"{p}: loaded {how}"] if how else []
    half = _half_precision_note(model, state, p)
    if half:
        notes.append(half)
    _load_state(model, state, p)
    check_finite_weights(model, str(p))
    return LoadedCheckpoint(
        model=model,
        path=str(p),
        sha256=digest,
        model_spec=model_spec,
        data_spec=data_spec,
        train_config=train_config,
        metrics=metrics,
        origin=origin,
        notes=notes,
    )
