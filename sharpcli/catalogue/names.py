"""The losses, the activations, the models and the ``sharp`` commands.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Registry

__all__ = [
    "ACTIVATIONS",
    "COMMANDS",
    "DEFAULT_MODEL",
    "LOSSES",
    "MODELS",
    "MODEL_NAMES",
]


# the losses of the analyses and of training (sharpcli.losses, declared there); ``info``:
# whether the labels are classes (accuracy is defined)
LOSSES: Registry[Any] = Registry(
    "loss",
    source="loss",
    entries=DECLARED.get("loss", ()),
    check="sharpcli.losses:check_loss",
    make_entry="sharpcli.losses:loss_entry",
)


# ``--activation NAME[:beta=B]`` (sharpcli.models.activations, declared there), [NME]
# sections 4.3-4.4
ACTIVATIONS: Registry[Any] = Registry(
    "activation", source="activation", entries=DECLARED.get("activation", ())
)

# ``--model NAME`` (sharpcli.models.zoo: each architecture declared on its class, whose ``ARGS``
# are its spec's arguments)
MODELS: Registry[Any] = Registry("model", source="model", entries=DECLARED.get("model", ()))
MODEL_NAMES: tuple[str, ...] = MODELS.builtin_names()
# the default of ``--model`` (torch-free: TrainConfig's default); "" only while the index holds
# no model (the generator remakes it)
DEFAULT_MODEL = next((e.name for e in MODELS.entries() if e.info.get("default")), "")

# the ``sharp`` commands (sharpcli.cli.cmd_*, each declared beside its function), in the order
# a person uses them (the order of ``sharp --help``). ``info``: its place in that order and the
# --help panel of its own options where not the default
COMMANDS: Registry[Any] = Registry("command", source="command", entries=DECLARED.get("command", ()))
