"""Hugging Face ``save_pretrained`` folders as checkpoints (docs/checkpoints.md).

A folder holding ``config.json`` and its weights (``model.safetensors``, sharded
``model-0000x-of-0000y.safetensors`` with their index, or ``pytorch_model.bin``) is built with
``transformers`` from that folder alone: the class its config names in ``architectures``
(else ``AutoModel``), ``from_pretrained(folder, local_files_only=True)``, so nothing is
downloaded and the renamings transformers applies to old keys on load (ViT's in transformers
5) are its own. Attention is the eager implementation, whose second derivatives torch
computes (the session's self-check verifies them), and ``use_cache`` is off: an analysis
wants logits only, which the output selector takes from ``.logits``
(:mod:`sharpcli.models.outputs`). ``.bin`` weights are unpickled by transformers with
``weights_only`` loading; a config asking for remote code is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sharpcli.errors import InputError
from sharpcli.io.data.dataset import describe_exception

__all__ = ["HF_PREFIX", "is_hf_model_folder", "load_hf_model", "weights_file"]

HF_PREFIX = "hf:"
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def weights_file(folder: str | os.PathLike) -> Path | None:
    """The weights file (or shard index) of a ``save_pretrained`` folder, None without one."""
    for name in _WEIGHTS:
        candidate = Path(folder) / name
        if candidate.is_file():
            return candidate
    return None


def is_hf_model_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds ``config.json`` and model weights (``save_pretrained``)."""
    return (Path(folder) / "config.json").is_file() and weights_file(folder) is not None


def load_hf_model(folder: str | os.PathLike) -> tuple[torch.nn.Module, str]:
    """``(model in float32 and eval mode, its class name)`` from a ``save_pretrained`` folder.

    Every failure (transformers missing, a config naming no known class, weights that do not
    fit) is an ``InputError`` naming the folder.
    """
    source = str(folder)
    try:
        import transformers
    except ImportError:
        raise InputError(
            "is a Hugging Face model folder; reading it needs transformers "
            "(pip install 'sharpcli[hf]')",
            source=source,
        ) from None
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no config warnings or weight-loading bars on stderr
    hf_logging.disable_progress_bar()
    try:
        return _build(transformers, source)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _build(transformers, source: str) -> tuple[torch.nn.Module, str]:
    """:func:`load_hf_model` with transformers' logging quiet."""
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception as exc:
        raise InputError(
            f"has no readable config.json ({describe_exception(exc)})", source=source
        ) from None
    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoModel
    if hasattr(config, "use_cache"):
        config.use_cache = False
    try:
        model = cls.from_pretrained(
            source,
            config=config,
            local_files_only=True,
            attn_implementation="eager",
            dtype=torch.float32,
        )
    except Exception as exc:
        raise InputError(
            f"cannot build its {cls.__name__} ({describe_exception(exc)})", source=source
        ) from None
    return model.eval(), cls.__name__
