"""Mixed precision of ``sharp train --precision``: autocast dtypes, the fp16 loss scale, and
the optimizer step that skips a step whose gradient is not finite, as torch's GradScaler does.

- ``fp32`` (default): no autocast; every pass runs in ``--dtype``.
- ``bf16``: every forward pass of the model under ``torch.autocast(dtype=torch.bfloat16)``
  (its backward follows the forward's dtypes); no loss scale (bfloat16 has float32's range).
- ``fp16``: the same in float16, with a dynamic loss scale ``S`` kept by a
  ``torch.amp.GradScaler`` (initial scale 2^16, halved on a step whose gradient is not finite,
  doubled after 2000 finite steps in a row: torch's defaults).

The weights, the optimizer and the gradients stay in ``--dtype`` (float32): the model's outputs
(and activations a penalty captures) are cast back to it, so the task loss and every penalty
are computed and accumulated in float32 (:class:`sharpcli.regularizers.passes.StepPasses`). Under
fp16 every reverse sweep of a step differentiates ``S`` times its scalar and divides by ``S``
(exact: ``S`` is a power of two), so the penalties and the ascent direction of sam, usam and asam
see unscaled gradients; an ascent whose clean gradient is not finite is not taken. The step's
gradient, all-reduced under torchrun, is handed to the GradScaler scaled by ``S`` again
(exact), which unscales it, skips the optimizer step when any entry is inf or NaN (the weights
unchanged) and updates ``S``; the skipped steps are counted in the report.
"""

from __future__ import annotations

import torch

from sharpcli import catalogue
from sharpcli.errors import UsageError

__all__ = ["PRECISIONS", "AUTOCAST_DTYPES", "check_precision", "MixedPrecision"]

PRECISIONS = catalogue.PRECISIONS
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def check_precision(precision: object, dtype: object) -> None:
    """UsageError naming ``precision`` for an unknown mode, or a mixed one with float64 weights.

    Args:
        precision: The ``--precision`` value.
        dtype: The ``--dtype`` value.

    Raises:
        UsageError: not one of :data:`PRECISIONS`, or bf16/fp16 with ``float64``.
    """
    if precision not in PRECISIONS:
        raise UsageError(
            f"unknown precision {precision!r}; accepted: {', '.join(PRECISIONS)}",
            source="precision",
        )
    if precision != "fp32" and dtype == "float64":
        raise UsageError(
            f"{precision} autocasts float32 weights; it does not apply to float64 "
            "(drop it, or train in float32)",
            source="precision",
        )


class MixedPrecision:
    """The precision of one training run: its autocast dtype, loss scale and optimizer step.

    Args:
        precision: ``fp32``, ``bf16`` or ``fp16``.
        device: The training device (autocast and the GradScaler run on its type).
        dtype: The weights' dtype, in which losses and penalties are computed.
    """

    def __init__(self, precision: str, device: torch.device, dtype: torch.dtype) -> None:
        self.precision = precision
        self.dtype = dtype
        self.autocast_dtype = AUTOCAST_DTYPES[precision]
        self.scaler = None
        if precision == "fp16":
            self.scaler = torch.amp.GradScaler(torch.device(device).type)
            # the scaler makes its scale tensor on its first scale(); the step's sweeps scale
            # by the number itself, so make it now, on the device
            self.scaler.scale(torch.ones((), device=device))
        self.skipped_steps = 0

    def loss_scale(self) -> float:
        """The scale ``S`` the step's reverse sweeps multiply by (1.0 without fp16)."""
        return 1.0 if self.scaler is None else float(self.scaler.get_scale())

    def step(self, optimizer: torch.optim.Optimizer, scale: float) -> bool:
        """The optimizer step on the unscaled gradients in ``p.grad``; under fp16 the
        GradScaler's: skipped when any gradient entry is inf or NaN, ``S`` updated.

        Args:
            optimizer: The run's optimizer.
            scale: The ``S`` the step's gradients were computed with (:meth:`loss_scale`).

        Returns:
            Whether the weights were updated (False: a skipped step, counted).
        """
        if self.scaler is None:
            optimizer.step()
            return True
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)  # exact: S is a power of two
        self.scaler.unscale_(optimizer)
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.loss_scale() < scale  # the scaler backs off exactly when it skipped
        self.skipped_steps += int(skipped)
        return not skipped

    def record(self) -> dict:
        """The report's ``results.precision``: the mode, the autocast dtype (None for fp32), the
        dtype losses and penalties are computed in, the fp16 loss scale now (None otherwise)
        and the steps skipped for a gradient that was not finite."""
        return {
            "precision": self.precision,
            "autocast": None if self.autocast_dtype is None else str(self.autocast_dtype)[6:],
            "penalties": str(self.dtype)[6:],
            "loss_scale": None if self.scaler is None else self.loss_scale(),
            "skipped_steps": self.skipped_steps,
        }

    def state_dict(self) -> dict:
        """What a resumed run needs: the GradScaler's state and the skipped-step count."""
        return {
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values."""
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
