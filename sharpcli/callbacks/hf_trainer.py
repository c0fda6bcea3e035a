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

**Gradient accumulation.** An update's gradient is that of the loss of its whole batch, the
mean over its ``k`` micro-batches, whatever the model does with ``num_items_in_batch``. The
``Trainer`` itself decides from the signature alone: a model whose ``forward`` takes
``**kwargs`` is handed ``num_items_in_batch`` and its loss is taken as already divided by it
(not divided by ``k``), which is wrong by the factor ``k`` for the many models that take
``**kwargs`` and ignore it (``BertForSequenceClassification``). So here the model computes its
own micro-batch mean (``num_items_in_batch`` is not passed to it), and the micro-batch ``i``'s
loss is weighted ``n_i / N``: ``n_i`` its labelled items (labels other than ``-100``, shifted
for causal LMs), ``N`` the update's (``num_items_in_batch``, counted the same way for every
model with ``labels``): the exact mean over the update's items, as Hugging Face's own
accumulation fix defines it. Without ``labels`` (a model computing its loss from other
inputs) the weight is ``1 / k``. A ``compute_loss_func`` is called with
``num_items_in_batch=None`` too, so it returns the micro-batch's mean.

**Penalties** (``penalties=``, :class:`~sharpcli.regularizers.LossPenalty` objects): each
micro-batch's loss gets ``penalty(loss, outputs.logits, inputs["labels"])`` (``loss`` the
micro-batch mean) and the penalty term is weighted ``1 / k``, so an update's penalty is the
mean of its micro-batches' (for the nonlinear ``gp``, ``gn-trace`` and ``fa`` not the penalty
of the update's whole batch). The logits and labels must be those the penalty's ``loss`` reads
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

import torch

from sharpcli.callbacks import missing_framework
from sharpcli.errors import UsageError
from sharpcli.regularizers import LossPenalty, PerturbedOptimizer

try:
    from transformers import Trainer
except ImportError as exc:  # the optional extra is not installed
    raise missing_framework("transformers", "hf", exc) from exc

__all__ = ["RegularizedTrainer"]


def _loss_shifts_labels(trainer: Trainer) -> bool:
    """Whether the model's loss shifts its labels (a causal LM: position t predicts label t+1).

    As the ``Trainer`` tells it (the model's ``loss_type``) or by its class (the causal-LM
    classes of the auto mapping, the ``Trainer``'s rule for label smoothing).

    Returns:
        True for a decoder-only causal LM's loss.
    """
    if getattr(trainer, "_loss_shifts_labels", False):
        return True
    model = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - moved in a future transformers
        return False
    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


class RegularizedTrainer(Trainer):
    """A ``transformers.Trainer`` with the regularizers of :mod:`sharpcli.regularizers`.

    Pass an oracle's wrapper as ``optimizers=(wrapper, scheduler_or_None)`` and/or the
    penalties as ``penalties=[...]``; every other argument is the ``Trainer``'s. ``nso``
    (``2k`` passes averaged) is refused: train it in a plain loop.
    """

    # compute_loss weights each micro-batch for the accumulation itself (module docstring)
    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, penalties: Sequence[LossPenalty] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._in_training_step = False
        self._shifts_labels = _loss_shifts_labels(self)
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
        if oracle.perturbed_passes > 1:
            raise UsageError(
                f"{oracle.regularizer.name} averages {oracle.perturbed_passes} passes per "
                "update: train it with optimizer.step(closure) in your own loop",
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
        """The micro-batch's loss plus every penalty's term, weighted for accumulation.

        In a training step: ``(n_i / N) L_i + (1 / k) sum_p P_p(L_i)`` (module docstring:
        ``L_i`` the model's mean over the micro-batch, ``n_i`` its labelled items, ``N`` the
        update's, ``k`` the accumulation steps; ``1 / k`` in place of ``n_i / N`` where the
        ``Trainer`` counted no items). In evaluation the batch's ``L + sum_p P_p(L)``.

        Args:
            model: the model.
            inputs: the micro-batch.
            return_outputs: return ``(loss, outputs)``.
            num_items_in_batch: the labelled items of the whole update (``N``), or None.

        Returns:
            The loss, or ``(loss, outputs)``.

        Raises:
            UsageError: penalties on a batch without ``labels``.
        """
        labels = inputs.get("labels") if hasattr(inputs, "get") else None
        items = self._labelled_items(inputs) if num_items_in_batch is not None else None
        # the model's own mean over this micro-batch: num_items_in_batch is never handed on, as
        # models that take **kwargs may ignore it (the Trainer cannot tell those that read it)
        loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=None
        )
        penalty = None
        if self.penalties:
            if labels is None:
                raise UsageError(
                    "the penalties read the batch's labels: give the batches `labels`",
                    source="penalties",
                )
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
            terms = [term(loss, logits, labels) for term in self.penalties]
            penalty = terms[0] if len(terms) == 1 else torch.stack(terms).sum()
        if not self._in_training_step:
            total = loss if penalty is None else loss + penalty
            return (total, outputs) if return_outputs else total
        steps = getattr(self, "current_gradient_accumulation_steps", None)
        steps = steps or self.args.gradient_accumulation_steps
        if items is None or self.args.n_gpu > 1:  # no count (or DataParallel's split batch)
            total = loss / steps
        else:
            total = loss * (items / num_items_in_batch)
            if getattr(self.args, "average_tokens_across_devices", False):
                # N is the count over every rank, and the ranks' gradients are averaged
                tensor_parallel = getattr(self, "get_tp_size", lambda: 1)()
                total = total * (self.accelerator.num_processes // tensor_parallel)
        if penalty is not None:
            total = total + penalty / steps
        return (total, outputs) if return_outputs else total

    def _labelled_items(self, inputs: Any) -> Any:
        """A micro-batch's labelled items: the denominator of the model's mean loss.

        Returns:
            ``n_i``: labels other than ``-100`` (of ``shift_labels``, or of ``labels[..., 1:]``
            for a causal LM, whose loss shifts them), or None when they cannot be counted.
        """
        try:
            if "shift_labels" in inputs:
                counted = inputs["shift_labels"]
            elif self._shifts_labels:
                counted = inputs["labels"][..., 1:]
            else:
                counted = inputs["labels"]
            return counted.ne(-100).sum()
        except (TypeError, AttributeError, KeyError):
            return None

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        """The update's labelled items ``N``, counted as :meth:`_labelled_items` counts each.

        For every model with ``labels`` (the ``Trainer`` counts them only for models that take
        ``**kwargs``, and unshifted for a causal LM built without a ``loss_type``); summed
        over the ranks under ``average_tokens_across_devices``.

        Returns:
            ``N`` as a tensor on ``device``, or None when a micro-batch's cannot be counted.
        """
        counts = [self._labelled_items(batch) for batch in batch_samples]
        if not counts or any(count is None for count in counts):
            return None
        total = torch.stack(counts).sum().to(device)
        if getattr(self.args, "average_tokens_across_devices", False) and self.args.world_size > 1:
            total = self.accelerator.gather(total).sum()
        return total

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """The ``Trainer``'s step on one micro-batch, its loss weighted for accumulation.

        Args:
            model: the model.
            inputs: the micro-batch.
            num_items_in_batch: passed to the ``Trainer``.

        Returns:
            The micro-batch's loss, as the ``Trainer`` returns it.
        """
        self._in_training_step = True
        try:
            return self._regularized_step(model, inputs, num_items_in_batch)
        finally:
            self._in_training_step = False

    def _regularized_step(self, model: Any, inputs: Any, num_items_in_batch: Any) -> Any:
        """The ``Trainer``'s step on one micro-batch; after an update's last, the oracle's passes.

        Returns:
            The micro-batch's loss, as the ``Trainer`` returns it.
        """
        oracle = self._oracle()
        if oracle is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if not oracle.reads_clean_gradient:  # weight-noise: its one pass at the noisy weights
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
