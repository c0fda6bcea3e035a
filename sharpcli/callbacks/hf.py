"""Sharpness during a Hugging Face ``Trainer`` run, logged with ``Trainer.log``.

::

    from sharpcli.callbacks.hf import SharpnessCallback

    trainer = Trainer(model=model, args=args, train_dataset=train)
    SharpnessCallback(nn.CrossEntropyLoss(), probe_batch, every=100).attach(trainer)
    trainer.train()

``probe_batch`` is what :class:`sharpcli.Curvature` takes, typically a dict of tensors
``{"input_ids", "attention_mask", "labels"}`` (labels of a causal LM already shifted: sharp
compares output t with label t). Every ``every`` optimizer steps (``state.global_step``) the
metrics of :class:`sharpcli.Tracker` are measured on it with the trainer's model and passed to
``trainer.log``, so they land in ``trainer.state.log_history`` and in every reporting
integration of ``args.report_to`` (TensorBoard, W&B, ...), like the loss. The trainer's
optimizer (unwrapped from accelerate's wrapper) and its training batch size
(``per_device_train_batch_size x gradient_accumulation_steps x world_size``) are handed to
the tracker, so the stability quantities work here as in ``sharp train``.
"""

from __future__ import annotations

from typing import Any

from sharpcli.callbacks import missing_framework
from sharpcli.errors import UsageError
from sharpcli.tracker import Tracker

try:
    from transformers import TrainerCallback
except ImportError as exc:  # the optional extra is not installed
    raise missing_framework("transformers", "hf", exc) from exc

__all__ = ["SharpnessCallback"]


class SharpnessCallback(TrainerCallback):
    """Measure sharpness every ``every`` optimizer steps and log it through ``Trainer.log``.

    ``loss``, ``data`` and the keyword arguments are those of :class:`sharpcli.Tracker`.
    :meth:`attach` adds the callback to a trainer and keeps the trainer to log through (a
    ``TrainerCallback`` is not handed the trainer). ``tracker.history`` keeps every
    measurement with its step.
    """

    def __init__(self, loss, data, *, every: int = 100, **tracker_options):
        self.tracker = Tracker(loss, data, every=every, **tracker_options)
        self.trainer: Any = None  # a transformers.Trainer, once attached

    def attach(self, trainer) -> "SharpnessCallback":
        """Add this callback to ``trainer`` and log through it.

        Args:
            trainer: the Hugging Face ``Trainer``.

        Returns:
            The callback.
        """
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        """Refuse to run without a trainer to log through.

        Args:
            args: the trainer's ``TrainingArguments``.
            state: its ``TrainerState``.
            control: its ``TrainerControl``.
            **kwargs: the rest of what the trainer passes.

        Raises:
            UsageError: (``trainer``) added with ``trainer.add_callback`` instead of
                :meth:`attach`.
        """
        if self.trainer is None:
            raise UsageError(
                "the callback has no trainer to log through: add it with "
                "`SharpnessCallback(...).attach(trainer)` instead of `trainer.add_callback`",
                source="trainer",
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """After an optimizer step: measure and log when the step count is due."""
        step = int(state.global_step)
        if model is None or not self.tracker.due(step):
            return
        self.tracker.steps = step
        if self.tracker.train_batch_size is None:
            per_device = int(getattr(args, "per_device_train_batch_size", 0) or 0)
            accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
            world = max(1, int(getattr(args, "world_size", 1) or 1))
            self.tracker.train_batch_size = per_device * accumulation * world or None
        optimizer = kwargs.get("optimizer") or getattr(self.trainer, "optimizer", None)
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        self.trainer.log(self.tracker.measure(model, optimizer=optimizer))
