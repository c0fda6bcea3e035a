"""The losses, the activations and the ``sharp`` commands.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any, Callable

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Entry, Registry
from sharpcli.specs import Param

__all__ = ["ACTIVATIONS", "COMMANDS", "LOSSES", "command_running"]

P = Param

# the losses of the analyses and of training (sharpcli.losses); ``info``: whether the labels
# are classes (accuracy is defined)
LOSSES: Registry[Any] = Registry(
    "loss",
    source="loss",
    entries=[
        Entry(
            "cross-entropy",
            "softmax cross-entropy on (batch, classes) logits and class labels",
            "sharpcli.losses",
            info={"classification": True},
        ),
        Entry(
            "mse",
            "mean squared error (mean over the outputs) on regression targets",
            "sharpcli.losses",
            info={"classification": False},
        ),
        Entry(
            "binary-cross-entropy",
            "binary cross-entropy with logits: one logit per sample, labels 0/1",
            "sharpcli.losses",
            info={"classification": True},
        ),
        Entry(
            "token-cross-entropy",
            "cross-entropy per position of (batch, length, vocabulary) outputs, labels -100 ignored",
            "sharpcli.losses",
            info={"classification": True},
        ),
    ],
)


# ``--activation NAME[:beta=B]`` (sharpcli.models.activations), [NME] sections 4.3-4.4
ACTIVATIONS: Registry[Any] = Registry(
    "activation",
    source="activation",
    entries=[
        Entry("relu", "ReLU", "sharpcli.models.activations:ReLU"),
        Entry("gelu", "GELU", "sharpcli.models.activations:GELU"),
        Entry(
            "beta-gelu",
            "x Phi(beta x): GELU with sharpness beta",
            "sharpcli.models.activations:BetaGELU",
            (P("beta", "float", 1.0, "sharpness, > 0; 1 = GELU", positive=True),),
            paper="NME",
        ),
        Entry(
            "augmented-relu",
            "ReLU forward, a Gaussian of inverse width beta as its second derivative",
            "sharpcli.models.activations:AugmentedReLU",
            (P("beta", "float", 1.0, "inverse width of the Gaussian, > 0", positive=True),),
            paper="NME",
        ),
        Entry(
            "diminished-gelu",
            "GELU forward, no second derivative",
            "sharpcli.models.activations:DiminishedGELU",
            paper="NME",
        ),
    ],
)

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
