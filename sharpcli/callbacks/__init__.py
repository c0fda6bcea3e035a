"""Sharpness measured inside a host framework's training loop, logged through its logger.

:mod:`sharpcli.callbacks.lightning` (PyTorch Lightning, ``pip install
sharpcli[lightning]``) and :mod:`sharpcli.callbacks.hf` (the Hugging Face ``Trainer``,
``pip install sharpcli[hf]``). Both wrap :class:`sharpcli.Tracker` (docs/tracking.md); a plain
loop uses the tracker itself. Each module imports its framework, so importing one needs only
that framework installed.
"""


def missing_framework(package: str, extra: str, exc: ImportError) -> ImportError:
    """The ImportError for a callback whose framework is not installed, naming the extra.

    Args:
        package: the framework's package (``lightning``, ``transformers``).
        extra: the extra of sharpcli that installs it.
        exc: the error of importing it.

    Returns:
        The error to raise.
    """
    return ImportError(
        f"this callback needs {package} ({exc}); install it with `pip install sharpcli[{extra}]`"
    )
