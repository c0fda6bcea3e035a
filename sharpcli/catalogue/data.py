"""The data formats that ``--data PATH`` reads and the built-in datasets of ``--data NAME``.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Entry, Registry

__all__ = ["DATASETS", "DATA_FORMATS"]


# ``--data PATH`` (sharpcli.io.formats): each format declared on its probe (sharpcli.io.file_formats,
# datasets_arrow, datasets_vision). ``info["order"]`` matters twice: it is the order of the lists
# in messages, and folder layouts are probed in it (CIFAR-10 batches win over a CIFAR-100
# train/test pair in the same folder).
DATA_FORMATS: Registry[Any] = Registry(
    "data format",
    source="data",
    entries=sorted(DECLARED.get("data format", ()), key=lambda e: int(e.info["order"])),
)

# ``--data NAME[:k=v,...]``: the built-in synthetic datasets (sharpcli.io.datasets_builtin);
# their parameters are typed and checked there
DATASETS: Registry[Any] = Registry(
    "built-in dataset",
    source="data",
    entries=[
        Entry("blobs", "a Gaussian mixture in R^dim", "sharpcli.io.datasets_builtin:make_blobs"),
        Entry(
            "images",
            "channels x size x size images, one smooth template per class",
            "sharpcli.io.datasets_builtin:make_images",
        ),
    ],
)
