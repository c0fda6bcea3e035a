"""The losses, the activations, the models and the ``sharp`` commands.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any, Callable

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Registry

__all__ = [
    "ACTIVATIONS",
    "COMMANDS",
    "DEFAULT_MODEL",
    "LOSSES",
    "MODELS",
    "MODEL_NAMES",
    "command_running",
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
# a person uses them (the order of ``sharp --help``). ``info``: its place in that order, the
# --help panel of its own options where not the default, and the library function it runs
# (``runs``, "module:function") where that function needs the command's name
COMMANDS: Registry[Any] = Registry("command", source="command", entries=DECLARED.get("command", ()))


def command_running(function: Callable[..., Any]) -> str:
    """The name of the command whose declaration says it runs ``function`` (``info["runs"]``).

    How a library module names the command it implements (the ``command`` of the report it
    makes, the label of its errors and progress) without spelling the name, which is declared
    once, beside the command.

    Args:
        function: the library function, as the command's declaration names it.

    Returns:
        The command's name.

    Raises:
        LookupError: no command declares that it runs ``function``.
    """
    runs = f"{function.__module__}:{function.__qualname__}"
    for entry in COMMANDS.entries():
        if entry.info.get("runs") == runs:
            return entry.name
    raise LookupError(f"no command declares that it runs {runs}")
