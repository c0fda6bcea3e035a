"""``Tracker``: sharpness measured inside one's own training loop, every ``every`` steps.

The entry for a plain loop (docs/tracking.md); the Lightning and Hugging Face callbacks
(:mod:`sharpcli.callbacks`) drive one. Each measurement is a :class:`~sharpcli.api.Curvature`
of the model on a fixed probe set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from sharpcli.analyses.analyze import EIGEN
from sharpcli.analyses.tracking import StepContext, check_tracked, measure
from sharpcli.api import Curvature
from sharpcli.api_arguments import integer_argument, seed_argument
from sharpcli.errors import UsageError


class Tracker:
    """Sharpness measured inside a training loop every ``every`` steps, on a fixed probe set.

    ``tracker.step(model)`` after each optimizer step counts the step and, every ``every``
    steps, measures ``metrics`` on ``data`` with the model in eval mode (each module's mode
    restored after) and returns them (else ``None``); ``tracker.measure(model)`` measures now.
    Metrics (:data:`sharpcli.analyses.tracking.TRACKABLE`, each run through that registry):
    ``eigen`` (``lambda_max`` of the Hessian, Lanczos), ``trace`` (``tr(H)``, [Hutch++]),
    ``gn-nme`` (``tr(G)``, ``tr(N)`` and the NME share from shared probes, [NME] eq. 2),
    ``frobenius`` (``Tr(H^2)``, [FA] eq. 1), ``sharpness`` (adaptive worst-case sharpness,
    [Andriushchenko2023]) and any quantity registered there (docs/tracking.md's table).
    The cost budget: ``max_matvecs`` Hessian-vector products per metric (each about two
    backward passes over ``data``; ``tol`` may stop a trace sooner), so one measurement costs
    at most ``len(metrics) * max_matvecs`` products over the probe set; keep ``data`` small
    (a few hundred samples). Returned keys carry ``prefix`` (``sharpness/lambda_max``), with
    ``{prefix}matvecs`` and ``{prefix}seconds`` of the measurement. Nothing draws from the
    global RNG, so tracking does not change the training trajectory. One
    :class:`~sharpcli.analyses.tracking.StepContext` (``tracker.context``) is kept for the
    Tracker's life and filled at each measurement with the optimizer, the step count and
    the training batch size, so that the quantities' warm starts persist between
    measurements.

    Args:
        loss: A torch loss module or a registered loss name, as :class:`~sharpcli.api.Curvature`.
        data: The probe set: ``(x, y)``, a dict batch, a DataLoader or an iterable of batches.
        every: Measure every this many steps.
        metrics: Names of :data:`sharpcli.analyses.tracking.TRACKABLE`.
        max_matvecs: The most products per metric.
        tol: The relative residual (``eigen``) or standard error (traces) wanted.
        params: Which parameters, as :class:`~sharpcli.api.Curvature`'s ``params``.
        batch_size: Samples per product batch.
        seed: Seeds the probes and start vectors (the same at every measurement).
        prefix: Prepended to every returned key.
        optimizer: The training loop's torch optimizer, which the stability quantities read
            (the learning rate and momentum of its ``param_groups`` for thresholds, Adam's
            and RMSprop's second moments for the preconditioned sharpness); None: those
            quantities are refused. :meth:`step` and :meth:`measure` may also pass it.
        train_batch_size: The training mini-batch size (batch sharpness draws batches of
            it from ``data``); None: unknown.

    Raises:
        UsageError: an argument out of range, named in ``error.source``.

    >>> import torch
    >>> from torch import nn
    >>> from sharpcli import Tracker
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    >>> x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    >>> tracker = Tracker(nn.CrossEntropyLoss(), (x[:32], y[:32]), every=2, metrics=["eigen"])
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> logged = []
    >>> for step in range(4):
    ...     optimizer.zero_grad()
    ...     nn.functional.cross_entropy(model(x), y).backward()
    ...     optimizer.step()
    ...     metrics = tracker.step(model)
    ...     if metrics is not None:
    ...         logged.append((tracker.steps, sorted(metrics)))
    >>> logged[0]
    (2, ['sharpness/lambda_max', 'sharpness/matvecs', 'sharpness/seconds'])
    >>> len(logged)
    2
    """

    def __init__(
        self,
        loss: str | nn.Module,
        data: object,
        *,
        every: int = 100,
        metrics: str | Sequence[str] = (EIGEN,),
        max_matvecs: int = 100,
        tol: float = 5e-2,
        params: str | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        prefix: str = "sharpness/",
        optimizer: Any = None,
        train_batch_size: int | None = None,
    ) -> None:
        integer_argument(every, "every")
        integer_argument(max_matvecs, "max_matvecs")
        seed_argument(seed)
        if train_batch_size is not None:
            integer_argument(train_batch_size, "train_batch_size")
        if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
            raise UsageError(f"must be a positive number, got {tol!r}", source="tol")
        names = [metrics] if isinstance(metrics, str) else list(metrics)
        if not names:
            raise UsageError("name at least one metric", source="metrics")
        try:
            check_tracked(names)
        except UsageError as exc:
            raise UsageError(exc.message, source="metrics") from None
        self.loss, self.data, self.every = loss, data, every
        self.metrics, self.max_matvecs, self.tol = names, max_matvecs, float(tol)
        self.params, self.batch_size, self.seed, self.prefix = params, batch_size, seed, prefix
        self.steps = 0
        self.optimizer, self.train_batch_size = optimizer, train_batch_size
        self.context = StepContext()  # one per Tracker: warm starts persist
        self.history: list[dict[str, Any]] = []  # every measurement, with its "step"
        self._curvature: Curvature | None = None

    def _curvature_for(self, model: nn.Module) -> Curvature:
        """One Curvature per model (data read and checked once); rebuilt for another model.

        Args:
            model: the model being trained.

        Returns:
            Its Curvature on the tracked data.
        """
        if self._curvature is None or self._curvature.model is not model:
            self._curvature = Curvature(
                model, self.loss, self.data, params=self.params, batch_size=self.batch_size
            )
        return self._curvature

    def due(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) is one to measure at.

        Args:
            step: The step number.

        Returns:
            True every ``every`` steps.
        """
        return step >= 1 and step % self.every == 0

    def step(
        self, model: nn.Module, step: int | None = None, *, optimizer: Any = None
    ) -> dict[str, Any] | None:
        """Count one training step (or set the count to ``step``); measure when it is due.

        Args:
            model: The model being trained (measured in eval mode, its modes restored).
            step: The step number to set; None: one more than the last.
            optimizer: The optimizer, if not given to the Tracker (kept from now on).

        Returns:
            The metrics (:meth:`measure`) when the step is due, else None.
        """
        self.steps = self.steps + 1 if step is None else int(step)
        return self.measure(model, optimizer=optimizer) if self.due(self.steps) else None

    def measure(self, model: nn.Module, *, optimizer: Any = None) -> dict[str, Any]:
        """The metrics now, keyed ``{prefix}name``, recorded in ``history``.

        Args:
            model: The model to measure (in eval mode, its modes restored).
            optimizer: The optimizer, if not given to the Tracker (kept from now on).

        Returns:
            ``{prefix}name -> value`` for each metric, with ``{prefix}matvecs`` and
            ``{prefix}seconds``.
        """
        import time

        start = time.perf_counter()
        if optimizer is not None:
            self.optimizer = optimizer
        self.context.optimizer = self.optimizer
        self.context.step = self.steps
        self.context.batch_size = self.train_batch_size
        curvature = self._curvature_for(model)
        curvature.refresh()  # the weights moved since the last measurement
        with curvature._analysis_mode():
            values, matvecs = measure(
                curvature.engine,
                self.metrics,
                seed=self.seed,
                tol=self.tol,
                max_matvecs=self.max_matvecs,
                eigen_max_matvecs=self.max_matvecs,
                step=self.context,
            )
        values.update(matvecs=matvecs, seconds=time.perf_counter() - start)
        out = {f"{self.prefix}{k}": v for k, v in values.items() if v is not None}
        self.history.append({"step": self.steps, **out})
        return out
