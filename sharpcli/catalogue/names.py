"""The losses, the activations and the ``sharp`` commands.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Entry, Registry
from sharpcli.specs import Param

__all__ = ["ACTIVATIONS", "COMMANDS", "LOSSES"]

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
# a person uses them (the order of ``sharp --help``); ``info``: its place in that order, and the
# --help panel of its own options where not the default
COMMANDS: Registry[Any] = Registry("command", source="command", entries=DECLARED.get("command", ()))
