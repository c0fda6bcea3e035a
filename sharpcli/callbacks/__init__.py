"""Sharpness measured during training by the host framework's own loop, logged through its
logger: :mod:`sharpcli.callbacks.lightning` (PyTorch Lightning, ``pip install
sharpcli[lightning]``) and :mod:`sharpcli.callbacks.hf` (the Hugging Face ``Trainer``,
``pip install sharpcli[hf]``). Both wrap :class:`sharpcli.Tracker` (docs/tracking.md); a plain
loop uses the tracker itself. Each module imports its framework, so importing one needs only
that framework installed."""


def missing_framework(package: str, extra: str, exc: ImportError) -> ImportError:
    """The ImportError for a callback whose framework is not installed, naming the extra."""
    return ImportError(
        f"this callback needs {package} ({exc}); install it with `pip install sharpcli[{extra}]`"
    )
