"""The regularizers' torch-free records: ``--reg NAME[:k=v,...]`` (:mod:`sharpcli.regularizers`).

Each built-in's record is its class body in :mod:`sharpcli.regularizers.penalties` or
:mod:`sharpcli.regularizers.perturbed`
(:func:`~sharpcli.regularizers.base.declare_regularizer`): its summary, its
hyper-parameters in positional order with defaults and ranges, its paper key, whether
averaging its gradient over torchrun ranks is exact (``data_parallel``: None, else the reason
it is not) and, in ``info``, its ``kind`` (none, model, penalty or oracle) and whether it
needs the input of the final ``nn.Linear``. The generated index holds them.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Registry

__all__ = ["REGULARIZERS"]

# ``--reg NAME[:k=v,...]`` (sharpcli.regularizers.registry); parameters in positional order
REGULARIZERS: Registry[Any] = Registry(
    "regularizer",
    source="regs",
    entries=DECLARED.get("regularizer", ()),
    check="sharpcli.regularizers.registry:check_regularizer_class",
    make_entry="sharpcli.regularizers.registry:regularizer_class_entry",
)
