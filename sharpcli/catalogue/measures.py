"""The measures of a checkpoint by name: ``analyze --metrics``, ``train --track``, ``bound-check --check``.

Each metric is declared beside its code (:func:`sharpcli.registry.declare`, kind
``"metric"``: :mod:`sharpcli.analyses.analyze`, :mod:`sharpcli.analyses.activations`,
:mod:`sharpcli.analyses.sharpness`) as a function of the run; its record's ``info`` gives its
place in the list (``order``), whether ``--metrics`` runs it by default (``default``), the
result keys ``--fail-if`` may read (``keys``) and the rows of the command's table (``rows``).
The quantities that training tracks are declared in :mod:`sharpcli.analyses.tracking` (kind
``"trackable"``), each under the name of the metric it follows, with the keys it records and
their place in a history row (``column``); the checks of ``bound-check`` as functions of its
run (:mod:`sharpcli.analyses.theorem2`, :mod:`sharpcli.analyses.noise_stability`, kind
``"check"``). Each command runs the chosen ones through these registries. This module reads
them from the generated index.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Registry

__all__ = ["CHECKS", "DEFAULT_METRICS", "METRICS", "TRACKABLE"]

# ``sharp analyze --metrics`` and ``sharp sweep --metrics``: a comma list of these
METRICS: Registry[Any] = Registry("metric", source="metrics", entries=DECLARED.get("metric", ()))
# what ``--metrics`` runs when not given: the metrics declared as defaults, in order
DEFAULT_METRICS = tuple(e.name for e in METRICS.entries() if e.info.get("default"))

# ``sharp train --track`` and sharpcli.Tracker's ``metrics``: a comma list of these
TRACKABLE: Registry[Any] = Registry(
    "trackable", source="track", entries=DECLARED.get("trackable", ())
)

# ``sharp bound-check --check``: a comma list of these, run after the bound of AD Corollary 1
CHECKS: Registry[Any] = Registry("check", source="check", entries=DECLARED.get("check", ()))
