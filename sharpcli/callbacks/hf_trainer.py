"""The regularizers of ``sharp train`` in a Hugging Face ``Trainer`` run.

With its gradient accumulation and mixed precision: the perturbation oracles (SAM, USAM, ASAM,
weight-noise) and the penalties.

::

    from sharpcli import regularizers
    from sharpcli.callbacks.hf_trainer import RegularizedTrainer

    optimizer = regularizers.make("sam:rho=0.05", torch.optim.AdamW(model.parameters()),
                                  model=model)
    trainer = RegularizedTrainer(model=model, args=args, train_dataset=train,
                                 optimizers=(optimizer, None),
                                 penalties=[regularizers.make("gp:rho=0.01", model=model)])
    trainer.train()

**Penalties** (``penalties=``, :class:`~sharpcli.regularizers.LossPenalty` objects): each
micro-batch's loss gets ``penalty(loss, outputs.logits, inputs["labels"])`` added before the
``Trainer`` divides it by the accumulation steps, so an update's penalty is the mean of its
micro-batches' (for the nonlinear ``gp``, ``gn-trace`` and ``fa`` not the penalty of the
update's whole batch). The logits and labels must be those the penalty's ``loss`` reads
(``cross-entropy``: classification logits ``(B, C)`` and labels ``(B,)``).

**Oracles** (the optimizer a :class:`~sharpcli.regularizers.PerturbedOptimizer`): the
``Trainer`` calls ``optimizer.step()`` once per update, after the backward of every
micro-batch of it. :class:`RegularizedTrainer` runs the oracle's passes there: it keeps the
update's micro-batches; after the last one's backward (the gradient accumulated over all of
them) it takes the wrapper's :meth:`~sharpcli.regularizers.PerturbedOptimizer.first_step`
(the ascent on the accumulated gradient, unscaled by the fp16 grad scaler's scale), runs the
backward of every micro-batch again at the perturbed weights, and restores the weights: the
``Trainer``'s own clipping, grad-scaler step and learning-rate schedule then apply the
gradient at the perturbed weights at theta. ``weight-noise`` perturbs before the update's
first micro-batch instead and runs no second pass.

Under ``DistributedDataParallel`` the clean backward of ``ascent_sync="per-replica"`` (the
wrapper's default) stays local (``no_sync``); the Trainer all-reduces the perturbed pass.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from sharpcli.callbacks import missing_framework
from sharpcli.errors import UsageError
from sharpcli.regularizers import LossPenalty, PerturbedOptimizer
from sharpcli.training.penalties.noise import NSO, WeightNoise

try:
    from transformers import Trainer
except ImportError as exc:  # the optional extra is not installed
    raise missing_framework("transformers", "hf", exc) from exc

__all__ = ["RegularizedTrainer"]


class RegularizedTrainer(Trainer):
    """A ``transformers.Trainer`` with the regularizers of :mod:`sharpcli.regularizers`.

    Pass an oracle's wrapper as ``optimizers=(wrapper, scheduler_or_None)`` and/or the
    penalties as ``penalties=[...]``; every other argument is the ``Trainer``'s. ``nso``
    (``2k`` passes averaged) is refused: train it in a plain loop.
    """

    def __init__(self, *args: Any, penalties: Sequence[LossPenalty] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.penalties = list(penalties)
        self._micro_batches: list[tuple[Any, Any]] = []
        oracle = self._oracle()
        if oracle is None:
            if not self.penalties:
                raise UsageError(
                    "RegularizedTrainer needs optimizers=(sharpcli.regularizers.make(spec, "
                    "optimizer, model=model), None) or penalties=[...]",
                    source="optimizers",
                )
            return
        if isinstance(oracle.regularizer, NSO):
            raise UsageError(
                "nso averages 2k passes per update: train it with optimizer.step(closure) in "
                "your own loop",
                source="optimizers",
            )
        oracle.host_runs_passes = True

    def _oracle(self) -> PerturbedOptimizer | None:
        """The wrapper among the optimizer and what accelerate wrapped it in.

        Returns:
            The :class:`PerturbedOptimizer`, or None when the optimizer is not one.
        """
        optimizer = self.optimizer
        while optimizer is not None and not isinstance(optimizer, PerturbedOptimizer):
            optimizer = getattr(optimizer, "optimizer", None)  # accelerate's wrapper
        return optimizer

    def compute_loss(
        self,
        model: Any,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The ``Trainer``'s loss plus every penalty's term on the micro-batch.

        Args:
            model: the model.
            inputs: the micro-batch.
            return_outputs: return ``(loss, outputs)``.
            num_items_in_batch: passed to the ``Trainer``.

        Returns:
            The loss, or ``(loss, outputs)``.
        """
        if not self.penalties:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]
        loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        total = loss
        for penalty in self.penalties:
            total = total + penalty(loss, logits, labels)
        return (total, outputs) if return_outputs else total

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """The ``Trainer``'s step on one micro-batch.

        After the update's last micro-batch, the oracle's passes (see the module).

        Args:
            model: the model.
            inputs: the micro-batch.
            num_items_in_batch: passed to the ``Trainer``.

        Returns:
            The micro-batch's loss, as the ``Trainer`` returns it.
        """
        oracle = self._oracle()
        if oracle is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if isinstance(oracle.regularizer, WeightNoise):
            if not oracle.pending:
                oracle.first_step()
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.accelerator.sync_gradients:
                oracle.restore()
            return loss
        local = oracle.ascent_sync == "per-replica" and hasattr(model, "no_sync")
        with model.no_sync() if local else contextlib.nullcontext():
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro_batches.append((inputs, num_items_in_batch))
        if self.accelerator.sync_gradients:
            oracle.grad_scaler = getattr(self.accelerator, "scaler", None)
            try:
                oracle.first_step(zero_grad=True)
            finally:
                oracle.grad_scaler = None  # the Trainer's optimizer step runs the scaler
            batches, self._micro_batches = self._micro_batches, []
            for index, (again, count) in enumerate(batches):
                last = index == len(batches) - 1
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    super().training_step(model, again, count)
            oracle.restore()
        return loss
