"""sharp: measure and control the sharpness of neural-network loss landscapes.

The command-line tool ``sharp`` is a thin layer over this library; every
analysis is importable (``sharpcli.curvature``, ``sharpcli.analyses``,
``sharpcli.training``) for use from scripts. The in-memory entry for a model, a loss and
data already in a notebook is :class:`sharpcli.Curvature` (docs/api.md), and
:class:`sharpcli.Tracker` measures sharpness inside one's own training loop, and
:mod:`sharpcli.regularizers` regularizes it (docs/own-loop.md); all are imported on first
use, so ``import sharpcli`` (and ``sharp --help``) does not load torch.
"""

from typing import Any

__version__ = "0.1.0"
SCHEMA_ID = "sharpcli.report/2"

_LAZY = {"Curvature": "sharpcli.api", "Tracker": "sharpcli.tracker"}
_LAZY_MODULES = {"regularizers": "sharpcli.regularizers"}
__all__ = ["Curvature", "SCHEMA_ID", "Tracker", "__version__", "regularizers"]


def __getattr__(name: str) -> Any:
    """The lazy names on first access (PEP 562).

    ``sharpcli.Curvature`` and ``sharpcli.Tracker`` (classes), ``sharpcli.regularizers`` (a
    module).

    Args:
        name: the attribute asked for.

    Returns:
        The class, imported from :mod:`sharpcli.api` or :mod:`sharpcli.tracker`, or the module.

    Raises:
        AttributeError: ``name`` is none of them.
    """
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        module = importlib.import_module(_LAZY_MODULES[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'sharpcli' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the lazy ones included.

    Returns:
        The names, sorted.
    """
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))
