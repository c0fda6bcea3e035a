"""What every pass of one training step replays or reuses: the dropout RNG and per-model facts.

:class:`RngReplay` rewinds the global torch RNG so that every pass of a step sees the same
dropout masks; :func:`model_facts` caches the structural facts of a model (its head, its
parameters, whether it has buffers) that a step, built per batch, would otherwise recompute;
:func:`set_penultimate` names the module whose output activation decay penalises.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from sharpcli.errors import UsageError
from sharpcli.models.zoo import final_linear

__all__ = ["RngReplay", "model_facts", "set_penultimate"]

_MODEL_FACTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def set_penultimate(model: nn.Module, module_name: str) -> None:
    """Make the OUTPUT of ``model``'s submodule ``module_name`` the penultimate representation
    that activation decay penalises, instead of the input of the last ``nn.Linear``."""
    modules = dict(model.named_modules())
    if module_name not in modules or module_name == "":
        names = ", ".join(n for n in list(modules)[1:9])
        raise UsageError(
            f"the model has no submodule {module_name!r} (modules: {names}, ...)",
            source="penultimate",
        )
    _MODEL_FACTS.setdefault(model, {})["head"] = (modules[module_name], "output")


def model_facts(model: nn.Module, key: str):
    """Structural facts of ``model`` a step needs, computed once per model object (a step
    is built per batch; walking ``named_modules`` every batch is measurable on small
    models): ``"head"`` the classifier head (:func:`sharpcli.models.zoo.final_linear`, whose
    input activation decay penalises), ``"has_buffers"`` whether any
    module holds a buffer (BatchNorm running statistics), ``"params"`` every parameter in
    ``model.parameters()`` order (a step keeps those with ``requires_grad``, so freezing
    between steps is honoured). The model's structure must not change after its first
    step: no module or parameter added, removed or replaced (in-place updates, ``.to()``
    and ``load_state_dict`` keep the parameter objects and are fine)."""
    facts = _MODEL_FACTS.setdefault(model, {})
    if key not in facts:
        if key == "params":
            facts[key] = tuple(model.parameters())
        elif key == "head":
            head = final_linear(
                model,
                source="regs",
                missing="activation decay needs a final nn.Linear layer (its input is the "
                f"penultimate activation) or `penultimate` (a module name); the model "
                f"{type(model).__name__} has neither",
            )[1]
            facts[key] = (head, "input")
        else:
            facts[key] = any(True for _ in model.buffers())
    return facts[key]


class RngReplay:
    """Replays the global torch RNG so every pass of a step sees the same dropout masks.

    ``start()`` records the state before the first pass; ``first_done()`` the state after
    it; ``replay()`` rewinds to the start before an extra pass; ``finish()`` leaves the
    RNG as the first pass left it, so a step with extra passes consumes the global RNG
    exactly like a plain step (dropout masks are the one thing drawn from it).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.before: tuple | None = None
        self.after: tuple | None = None

    def _get(self) -> tuple:
        cpu = torch.get_rng_state()
        gpu = torch.cuda.get_rng_state(self.device) if self.cuda else None
        return cpu, gpu

    def _set(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1], self.device)

    def start(self) -> None:
        """Record the RNG state before the first pass."""
        self.before = self._get()

    def first_done(self) -> None:
        """Record the RNG state the first pass left."""
        self.after = self._get()

    def replay(self) -> None:
        """Rewind to the state before the first pass (before an extra pass)."""
        assert self.before is not None, "start() records the state replayed"
        self._set(self.before)

    def finish(self) -> None:
        """Leave the RNG as the first pass left it."""
        if self.after is not None:
            self._set(self.after)
