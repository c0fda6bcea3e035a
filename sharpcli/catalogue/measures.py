"""What ``sharp analyze --metrics`` measures of a checkpoint, by name.

Each metric is declared beside its code (:func:`sharpcli.registry.declare`, kind
``"metric"``: :mod:`sharpcli.analyses.analyze`, :mod:`sharpcli.analyses.activations`,
:mod:`sharpcli.analyses.sharpness`) as a function of the run; its record's ``info`` gives its
place in the list (``order``), whether ``--metrics`` runs it by default (``default``) and the
result keys ``--fail-if`` may read (``keys``). This module reads them from the generated index.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Registry

__all__ = ["METRICS"]

# ``sharp analyze --metrics`` and ``sharp sweep --metrics``: a comma list of these
METRICS: Registry[Any] = Registry("metric", source="metrics", entries=DECLARED.get("metric", ()))
