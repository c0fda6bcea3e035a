"""Atomic file writes: a temporary file in the target's folder, fsync, then rename.

A run that fails (or is killed) never leaves a half-written output and never
touches an existing file at that path until the new content is complete.

Below every layer that writes files (io checkpoints, report plots, training, cli), beside
:mod:`sharpcli.errors`: it imports nothing else of sharpcli.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from sharpcli.errors import OutputPathError


def check_writable(path: str | os.PathLike, option: str | None = None) -> Path:
    """Fail early, before any work, when ``path`` cannot be written: ``OutputPathError`` with
    the path as its source. ``option`` (the parameter that named the path) is not used: the
    path is what the user must fix."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.exists() and p.is_dir():
        raise OutputPathError("is a directory, not a file path", source=str(p))
    if not parent.exists():
        raise OutputPathError(f"folder {parent} does not exist", source=str(p))
    if not parent.is_dir():
        raise OutputPathError(f"{parent} is a file, not a folder", source=str(p))
    if not os.access(parent, os.W_OK):
        raise OutputPathError(f"folder {parent} is not writable", source=str(p))
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputPathError("file is not writable", source=str(p))
    return p


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_atomic(path: str | os.PathLike, writer: Callable[[Path], None]) -> None:
    """Call ``writer(tmp_path)`` and move the result onto ``path`` atomically."""
    with atomic_path(path) as tmp:
        writer(tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
