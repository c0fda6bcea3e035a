"""What one training step reports (:class:`StepStats`), the record every regularizer's step
returns and the epoch loop averages."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """What one training step reports: batch means over its *reported pass*.

    The reported pass is the clean pass at theta, except for the noise oracles
    (``weight-noise``, ``nso``) with ``report=perturbed`` (their default), which report the
    passes whose gradients they return, at ``theta + U`` (see their docstrings).

    - ``loss``: task loss ``L`` of the reported pass.
    - ``objective``: ``L + sum_k P_k`` at the same weights, the quantity minimised.
    - ``correct``: correct predictions of the reported pass, as the loss counts them
      (:attr:`sharpcli.losses.Loss.correct`: argmax for cross-entropy, the logit's sign for
      binary cross-entropy, per labelled position for token cross-entropy; 0 for regression).
    - ``count``: batch size (samples: the weight of the step's means in an epoch's mean).
    - ``grad_evals``: gradient evaluations the step used, counted as in the module
      docstring (a double-backward counts its true number of backward passes).
    - ``penalties``: value of each additive penalty at theta, keyed by regularizer name.
    - ``counted``: predictions ``correct`` is out of (samples, or labelled positions for
      token cross-entropy; 0 where the loss defines no accuracy): accuracy is
      ``correct / counted``.
    """

    loss: float
    objective: float
    correct: int
    count: int
    grad_evals: int
    penalties: dict[str, float] = field(default_factory=dict)
    counted: int = 0
