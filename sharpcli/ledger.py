"""Which files one command reads and which it will write: no output may land on an input.

Why: ``sharp train --data m.history.csv --out m.safetensors`` wrote the history CSV beside the
checkpoint onto its own data, and ``sharp eigen m.safetensors --json d.npz``, where m's metadata
names ``d.npz`` as its data, replaced the data by the report. The command line alone does not
show those files: side files (``<out>.history.csv``, ``<out>.state.pt``), sweep run files,
plots, and a data path named only inside a checkpoint's metadata. So

- every output is *declared* before the work (:func:`declare_output`): its path is writable
  (:func:`check_writable`), is not a file the command reads, and is not another output;
- every file read is *recorded* (:func:`record_input`: the checkpoint and dataset loaders,
  ``compare``'s reports) and checked against the outputs declared so far;
- a write checks once more (:func:`check_write`, called by :mod:`sharpcli.atomic`) for a
  file written without a declaration.

A clash is a :class:`~sharpcli.errors.UsageError` (exit 2) on the output's option, raised when
the second of the two files becomes known. Outputs are published only at the end of a command
(:mod:`sharpcli.atomic`), so the clash is always found before anything is written, including
when the data path only appears once the checkpoint is read. Reading a file that this command
has itself published (a sweep analyses the checkpoints it trained) is no clash.

Two paths are the same file when their real paths are equal or they are one inode (hard links).
The record lives for one command (:func:`scope`, opened by the CLI's ``run_command``); outside a
scope (library use) only :func:`check_writable` runs.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from sharpcli.errors import OutputPathError, UsageError

# Paths written directly, never replaced by a rename: the process's own streams and anything
# reached through /proc (``/dev/stdout`` links to ``/proc/self/fd/1``).
_STREAM_PATHS = ("/dev/stdout", "/dev/stderr", "/dev/tty")
_STREAM_PREFIXES = ("/proc/", "/dev/fd/")


def is_direct_target(path: str | os.PathLike) -> bool:
    """Whether ``path`` is written in place rather than by a rename: an existing target (links
    followed) that is not a regular file (``/dev/null``, a FIFO, a character device, a socket),
    or a stream path (``/dev/stdout``, ``/dev/fd/N``, ``/proc/...``). Renaming a temporary file
    onto such a path would replace the device node or link itself."""
    p = os.path.abspath(os.fspath(path))
    if p in _STREAM_PATHS or p.startswith(_STREAM_PREFIXES):
        return True
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_writable(path: str | os.PathLike, option: str = "out") -> Path:
    """Fail early, before any work, when ``path`` cannot be written (UsageError naming it).

    A regular file is replaced by a rename from its folder, so the folder must exist and be
    writable; a symbolic link is followed (the file it points to is replaced, the link stays).
    A direct target (:func:`is_direct_target`) only needs to be writable itself.
    """
    p = Path(path)
    if is_direct_target(p):
        if p.exists() and not os.access(p, os.W_OK):
            raise OutputPathError("is not writable", source=str(p))
        return p
    if p.is_dir():
        raise OutputPathError("is a directory, not a file path", source=str(p))
    parent = Path(os.path.realpath(p)).parent if p.is_symlink() else p.parent
    parent = parent if str(parent) else Path(".")
    if not parent.exists():
        raise OutputPathError(f"folder {parent} does not exist", source=str(p))
    if not parent.is_dir():
        raise OutputPathError(f"{parent} is a file, not a folder", source=str(p))
    if not os.access(parent, os.W_OK):
        raise OutputPathError(f"folder {parent} is not writable", source=str(p))
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputPathError("file is not writable", source=str(p))
    return p


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: equal real paths, or one inode (hard links)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@dataclass
class _Output:
    path: str
    option: str
    role: str | None
    shared: bool
    published: bool = False

    def named(self) -> str:
        return f"{self.path} ({self.role})" if self.role else self.path


@dataclass
class _Record:
    inputs: list = field(default_factory=list)  # (path, what)
    outputs: list = field(default_factory=list)  # _Output


_scopes: list[_Record] = []


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Record inputs and outputs for one command (nested scopes start afresh)."""
    _scopes.append(_Record())
    try:
        yield
    finally:
        _scopes.pop()


def _current() -> _Record | None:
    return _scopes[-1] if _scopes else None


def _input_clash(output: _Output, what: str) -> UsageError:
    return UsageError(
        f"{output.named()} is also an input of this command ({what}); writing there would "
        "destroy it",
        source=output.option,
    )


def declare_output(
    path: str | os.PathLike, option: str, *, role: str | None = None, shared: bool = False
) -> Path:
    """Check that the command may write ``path`` (``option`` names it in errors) and record it.

    ``role`` says which file it is when the option names another (``"the history CSV beside
    --out"``). ``shared=True`` declares a file that a later step declares again under its own
    option (a sweep's run checkpoints, declared up front, then by ``train``); otherwise a second
    declaration of the same file under another option is a clash (``--json X --plot X``).
    """
    p = check_writable(path, option)
    record = _current()
    if record is None:
        return p
    new = _Output(str(path), option, role, shared)
    for input_path, what in record.inputs:
        if same_file(p, input_path):
            raise _input_clash(new, what)
    for old in record.outputs:
        if not same_file(p, old.path):
            continue
        if old.option == option or old.shared:
            return p
        record.outputs.append(new)  # no error object goes there either
        raise UsageError(
            f"{new.named()} is also the `{old.option}` file; one would overwrite the other",
            source=option,
        )
    record.outputs.append(new)
    return p


def record_input(path: str | os.PathLike | None, what: str) -> None:
    """Record that the command reads ``path`` (``what``: "the checkpoint", "the --data file");
    UsageError when a declared, not yet written output is that file."""
    record = _current()
    if record is None or path is None:
        return
    record.inputs.append((os.fspath(path), what))  # first: no error object goes there either
    for output in record.outputs:
        if not output.published and same_file(path, output.path):
            raise _input_clash(output, what)


def _published_here(record: _Record, path) -> bool:
    return any(o.published and same_file(path, o.path) for o in record.outputs)


def check_write(path: str | os.PathLike) -> None:
    """UsageError when ``path`` is a file this command reads (and did not write itself)."""
    record = _current()
    if record is None or _published_here(record, path):
        return
    for input_path, what in record.inputs:
        if same_file(path, input_path):
            declared = [o for o in record.outputs if same_file(path, o.path)]
            output = (
                declared[0] if declared else _Output(os.fspath(path), os.fspath(path), None, False)
            )
            raise _input_clash(output, what)


def published(path: str | os.PathLike) -> None:
    """Mark ``path`` as written by this command (reading it back is then no clash)."""
    record = _current()
    if record is None:
        return
    for output in record.outputs:
        if same_file(path, output.path):
            output.published = True


def may_write_error_document(path: str | os.PathLike, option: str = "json") -> bool:
    """Whether the JSON error object may go to ``path``: not a file the command reads, and not
    another output's file (``train --out X --json X`` keeps the old checkpoint X)."""
    record = _current()
    if record is None:
        return True
    if any(same_file(path, input_path) for input_path, _ in record.inputs):
        return False
    return not any(o.option != option and same_file(path, o.path) for o in record.outputs)
