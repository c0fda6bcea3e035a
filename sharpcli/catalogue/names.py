"""The losses, the activations, the models and the ``sharp`` commands.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Entry, Registry

__all__ = ["ACTIVATIONS", "COMMANDS", "DEFAULT_MODEL", "LOSSES", "MODELS", "MODEL_NAMES"]


# the losses of the analyses and of training (sharpcli.losses, declared there); ``info``:
# whether the labels are classes (accuracy is defined)
LOSSES: Registry[Any] = Registry("loss", source="loss", entries=DECLARED.get("loss", ()))


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

# the ``sharp`` commands, in the order a person uses them (the order of ``sharp --help``)
COMMANDS: Registry[Any] = Registry(
    "command",
    source="command",
    entries=[
        Entry(
            "train",
            "Train a model, optionally under a sharpness regularizer.",
            "sharpcli.cli.cmd_train:train_command",
        ),
        Entry(
            "eigen",
            "Largest or smallest curvature eigenvalues (how sharp the minimum is).",
            "sharpcli.cli.cmd_spectrum:eigen_command",
            paper="Lanczos1950",
        ),
        Entry(
            "trace",
            "Trace of the curvature: the sum of all its eigenvalues.",
            "sharpcli.cli.cmd_spectrum:trace_command",
            paper="Hutchinson1989",
        ),
        Entry(
            "gn-nme",
            "Split the Hessian into its Gauss-Newton and nonlinear parts.",
            "sharpcli.cli.cmd_spectrum:gn_nme_command",
            paper="NME",
        ),
        Entry(
            "density",
            "The whole eigenvalue spectrum, estimated and plotted.",
            "sharpcli.cli.cmd_spectrum:density_command",
            paper="Ghorbani2019",
        ),
        Entry(
            "diagonal",
            "The curvature's diagonal per parameter, as a .safetensors file.",
            "sharpcli.cli.cmd_diagonal:diagonal_command",
            paper="Bekas2007",
        ),
        Entry(
            "analyze",
            "Several of these measures in one report; a gate for CI.",
            "sharpcli.cli.cmd_analyze:analyze_command",
        ),
        Entry(
            "activation-stats",
            "How often activations are active or dead, per layer.",
            "sharpcli.cli.cmd_diagnostics:activation_stats_command",
        ),
        Entry(
            "weight-rescale",
            "Show which sharpness measures change when weights are rescaled.",
            "sharpcli.cli.cmd_diagnostics:weight_rescale_command",
            paper="MAN",
        ),
        Entry(
            "sharpness",
            "Worst-case and average-case sharpness, invariant to rescaling when adaptive.",
            "sharpcli.cli.cmd_sharpness:sharpness_command",
            paper="Andriushchenko2023",
        ),
        Entry(
            "landscape",
            "Loss on a line or plane through the checkpoint, plotted.",
            "sharpcli.cli.cmd_landscape:landscape_command",
            paper="Li2018",
        ),
        Entry(
            "bound-check",
            "Check the papers' curvature bounds on a trained model.",
            "sharpcli.cli.cmd_diagnostics:bound_check_command",
            paper="AD",
        ),
        Entry(
            "compare",
            "Runs side by side in one table and plot.",
            "sharpcli.cli.cmd_compare:compare_command",
        ),
        Entry(
            "sweep",
            "Train and measure over a grid of regularizer settings and seeds.",
            "sharpcli.cli.cmd_sweep:sweep_command",
        ),
    ],
)
