"""Sharpness during a PyTorch Lightning fit, logged with ``LightningModule.log_dict``.

::

    from sharpcli.callbacks.lightning import SharpnessCallback

    callback = SharpnessCallback(nn.CrossEntropyLoss(), (x_probe, y_probe), every=100)
    trainer = lightning.Trainer(callbacks=[callback], ...)

Every ``every`` optimizer steps (``trainer.global_step``), after the training batch, the
metrics of :class:`sharpcli.Tracker` are measured on the probe data with the
``LightningModule`` itself as the model (its ``forward`` must return the logits, or an output
with ``.logits``) and logged under ``sharpness/...`` at that step, so every logger the
``Trainer`` has (TensorBoard, CSV, W&B, ...) records them and ``trainer.callback_metrics``
holds the last ones. The trainer's optimizer (``trainer.optimizers[0]``) and the training
batch's size are handed to the tracker, so the stability quantities (thresholds from the
learning rate, preconditioned sharpness from Adam's state) work here as in ``sharp train``.
"""

from __future__ import annotations

from sharpcli.callbacks import missing_framework
from sharpcli.tracker import Tracker

try:
    from lightning.pytorch import Callback
except ImportError as exc:  # the optional extra is not installed
    raise missing_framework("lightning", "lightning", exc) from exc

__all__ = ["SharpnessCallback"]


class SharpnessCallback(Callback):
    """Measure sharpness every ``every`` optimizer steps and log it through Lightning.

    ``loss``, ``data`` and the keyword arguments are those of :class:`sharpcli.Tracker`
    (``metrics``, ``max_matvecs``, ``tol``, ``params``, ``batch_size``, ``seed``, ``prefix``).
    ``tracker.history`` keeps every measurement with its step.
    """

    def __init__(self, loss, data, *, every: int = 100, **tracker_options):
        super().__init__()
        self.tracker = Tracker(loss, data, every=every, **tracker_options)
        self._last_step: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """After a training batch: measure when the optimizer step count is due (once a step)."""
        step = int(trainer.global_step)
        if step == self._last_step or not self.tracker.due(step):
            return
        self._last_step = step
        self.tracker.steps = step
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        if self.tracker.train_batch_size is None:
            self.tracker.train_batch_size = _batch_size(batch)
        metrics = self.tracker.measure(pl_module, optimizer=optimizers[0] if optimizers else None)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)


def _batch_size(batch) -> int | None:
    """The samples in a training batch.

    Args:
        batch: a tensor, a tuple or list, or a dict of tensors.

    Returns:
        The first dimension of its first tensor; None when it holds none.
    """
    import torch

    if isinstance(batch, torch.Tensor):
        items = [batch]
    elif isinstance(batch, dict):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    for item in items:
        if isinstance(item, torch.Tensor) and item.ndim > 0:
            return int(item.shape[0])
    return None
