"""Checkpoints: the tool's own self-describing ``.safetensors`` files and foreign ones.

Own format (docs/commands/train.md): one ``.safetensors`` file whose tensors are the
model's state_dict and whose string metadata holds

- ``sharpcli.format``  format version (``"1"``),
- ``sharpcli.model``   JSON ``{"name": ..., "args": {...}}`` that ``build_model`` accepts,
- ``sharpcli.data``    JSON data spec that ``load_dataset`` accepts,
- ``sharpcli.train``   JSON training configuration (regularizers and seed included),
- ``sharpcli.metrics`` JSON final metrics,

so a checkpoint rebuilds its model and finds its data with no extra flag.

Foreign checkpoints: ``.safetensors`` or ``.pt/.pth`` state_dicts with
``arch``/``arch_args`` or ``model_factory="module:function"``. ``.pt`` files are
read with ``torch.load(weights_only=True)``; a pickled whole module is refused
unless ``trust_pickle`` (unpickling runs code).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sharpcli.errors import InputError, UsageError
from sharpcli.io.atomic import atomic_path

FORMAT_VERSION = "1"
META_FORMAT = "sharpcli.format"
META_MODEL = "sharpcli.model"
META_DATA = "sharpcli.data"
META_TRAIN = "sharpcli.train"
META_METRICS = "sharpcli.metrics"


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
    origin: str = "sharpcli"  # sharpcli | state_dict | pickle

    def info(self) -> dict:
        """The ``checkpoint`` block of the JSON report."""
        return {
            "path": self.path,
            "sha256": self.sha256,
            "model": self.model_spec,
            "origin": self.origin,
            "train": self.train_config,
        }


def sha256_file(path: str | os.PathLike) -> str:
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
    """Write ``model``'s state_dict with sharpcli metadata atomically; return its sha256."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    metadata = {
        META_FORMAT: FORMAT_VERSION,
        META_MODEL: json.dumps(model_spec, sort_keys=True),
        META_DATA: json.dumps(data_spec, sort_keys=True),
        META_TRAIN: json.dumps(train_config, sort_keys=True),
        META_METRICS: json.dumps(metrics, sort_keys=True),
    }
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)
    return sha256_file(path)


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
            raise InputError(
                "holds a pickled Python object, not a plain state_dict; unpickling runs code, "
                "so it is refused (pass --trust-pickle if you trust this file)",
                source=str(path),
            ) from exc
    try:
        return torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as exc:
        raise InputError(f"could not unpickle ({_first_line(exc)})", source=str(path)) from exc


def _parse_json_meta(meta: dict, key: str, path: Path):
    raw = meta.get(key)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(f"metadata {key} is not valid JSON", source=str(path)) from exc


def factory_from_string(spec: str, arch_args: dict | None = None) -> nn.Module:
    """Call ``module:function`` (importable from the working directory or PYTHONPATH)."""
    if ":" not in spec:
        raise UsageError("expected module:function", source="--model-factory")
    module_name, func_name = spec.split(":", 1)
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UsageError(
            f"cannot import {module_name!r} ({_first_line(exc)})", source="--model-factory"
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UsageError(f"{module_name!r} has no function {func_name!r}", source="--model-factory")
    try:
        model = func(**(arch_args or {}))
    except Exception as exc:
        raise UsageError(f"{spec} failed ({_first_line(exc)})", source="--model-factory") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"{spec} returned {type(model).__name__}, not a torch.nn.Module",
            source="--model-factory",
        )
    return model


def _load_state(model: nn.Module, state: dict, path: Path) -> None:
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(
            "does not hold a state_dict (a mapping of names to tensors)", source=str(path)
        )
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if unexpected:
            parts.append(
                f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}"
            )
        raise InputError(
            f"state_dict does not match the model: {'; '.join(parts)}", source=str(path)
        )
    for key, value in state.items():
        if own[key].is_floating_point() != value.is_floating_point():
            raise InputError(
                f"dtype mismatch for {key}: checkpoint {str(value.dtype).replace('torch.', '')}, "
                f"model {str(own[key].dtype).replace('torch.', '')}",
                source=str(path),
            )
        if tuple(value.shape) != tuple(own[key].shape):
            raise InputError(
                f"shape mismatch for {key}: checkpoint {tuple(value.shape)}, model {tuple(own[key].shape)}",
                source=str(path),
            )
    model.load_state_dict(state, strict=True)


def check_finite_weights(model: nn.Module, path: str) -> None:
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise InputError(f"weights contain NaN or Inf in {name}", source=path)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    arch: str | None = None,
    arch_args: dict | None = None,
    model_factory: str | None = None,
    trust_pickle: bool = False,
) -> LoadedCheckpoint:
    """Rebuild a model from a checkpoint (own or foreign) and verify its weights are finite."""
    from sharpcli.models import build_model

    p = Path(path)
    if not p.exists():
        raise InputError("no such file", source=str(p))
    if p.is_dir():
        raise InputError("is a folder, not a checkpoint file", source=str(p))
    suffix = p.suffix.lower()
    digest = sha256_file(p)
    override = arch is not None or model_factory is not None
    if arch is not None and model_factory is not None:
        raise UsageError("give --arch or --model-factory, not both", source="--arch")

    model_spec = data_spec = train_config = metrics = None
    origin = "state_dict"
    if suffix == ".safetensors":
        state, meta = _read_safetensors(p)
        if META_MODEL in meta:
            origin = "sharpcli"
            model_spec = _parse_json_meta(meta, META_MODEL, p)
            data_spec = _parse_json_meta(meta, META_DATA, p)
            train_config = _parse_json_meta(meta, META_TRAIN, p)
            metrics = _parse_json_meta(meta, META_METRICS, p)
    elif suffix in (".pt", ".pth", ".bin"):
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
        if (
            isinstance(state, dict)
            and "state_dict" in state
            and isinstance(state["state_dict"], dict)
        ):
            state = state["state_dict"]
    else:
        raise InputError(
            f"unknown checkpoint format {suffix or '(no extension)'}; expected .safetensors, .pt or .pth",
            source=str(p),
        )

    if override:
        if model_factory is not None:
            model = factory_from_string(model_factory, arch_args)
            model_spec = {"name": f"factory:{model_factory}", "args": arch_args or {}}
        else:
            model_spec = {"name": arch, "args": arch_args or {}}
            try:
                model = build_model(model_spec)
            except UsageError as exc:
                # the zoo names --model/--arch-args; here the user typed --arch
                source = "--arch" if exc.source == "--model" else exc.source
                raise UsageError(exc.message, source=source) from exc
        origin = "state_dict" if origin != "sharpcli" else origin
    elif model_spec is None:
        raise InputError(
            "has no sharpcli metadata; say how to build the model with --arch NAME --arch-args JSON "
            "or --model-factory module:function",
            source=str(p),
        )
    else:
        try:
            model = build_model(model_spec)
        except UsageError as exc:
            raise InputError(
                f"metadata names a model that cannot be built ({exc.message})", source=str(p)
            ) from exc
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
    )
