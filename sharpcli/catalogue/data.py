"""The data formats that ``--data PATH`` reads and the built-in datasets of ``--data NAME``.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Registry

__all__ = ["DATASETS", "DATA_FORMATS", "DEFAULT_DATASET"]


# ``--data PATH`` (sharpcli.io.data.formats): each format declared on its probe
# (sharpcli.io.data: tensor_files, tables, arrow, vision). ``info["order"]`` matters twice:
# it is the order of the lists in messages, and folder layouts are probed in it (CIFAR-10
# batches win over a CIFAR-100 train/test pair in the same folder).
DATA_FORMATS: Registry[Any] = Registry(
    "data format",
    source="data",
    entries=sorted(DECLARED.get("data format", ()), key=lambda e: int(e.info["order"])),
    check="sharpcli.io.data.formats:check_format",
    make_entry="sharpcli.io.data.formats:format_entry",
)

# ``--data NAME[:k=v,...]``: the built-in synthetic datasets, declared on their generators in
# sharpcli.io.data.builtin, which types and checks their parameters
DATASETS: Registry[Any] = Registry(
    "built-in dataset", source="data", entries=DECLARED.get("built-in dataset", ())
)
# the default of ``--data`` (torch-free: TrainConfig's default); "" only while the index
# holds no dataset (the generator remakes it)
DEFAULT_DATASET = next((e.name for e in DATASETS.entries() if e.info.get("default")), "")
