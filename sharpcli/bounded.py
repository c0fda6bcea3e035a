"""Bounded reads of data files: regular files only, never more bytes than the file holds.

A data path comes from ``--data`` or from a checkpoint's metadata, and the latter is chosen
by whoever wrote the checkpoint. ``/dev/zero`` would be read forever (4.6 GB before a memory
limit stopped it), a FIFO blocks the first ``open`` until some writer appears, and a log
file another process appends to never ends. So every reader of a data file opens it through
:func:`open_data_file` (or :func:`read_data_file` for the whole content), which

- opens without blocking (``O_NONBLOCK``: a FIFO's ``open`` returns at once) and refuses,
  by ``fstat`` of the opened descriptor, anything but a regular file: ``InputError`` naming
  the path and its kind (FIFO, character device, socket, ...);
- reads at most the size the file had when it was opened (:class:`_SizeBounded`), so a
  growing file ends, and ``SEEK_END`` is that size;

and :func:`check_data_path` refuses the same kinds of paths before a format is chosen.
Compressed members cannot expand beyond :data:`MAX_DEFLATE_RATIO` times their stored size,
deflate's own limit (about 1032:1), so :func:`check_zip_members` and the gzip reader bound
what a small archive may claim to unpack to.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import zipfile
from typing import BinaryIO, Iterator

from sharpcli.errors import InputError

MAX_DEFLATE_RATIO = 1100
"""Most bytes a compressed byte may unpack to (deflate's maximum is about 1032)."""

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def _kind(mode: int) -> str:
    """What a non-regular file is, in words (``"a FIFO (named pipe)"``)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str, mode: int) -> InputError:
    """The ``InputError`` for a path that is not a regular file."""
    return InputError(
        f"is {_kind(mode)}, not a regular file; refusing to read it (it may never end)",
        source=path,
    )


def check_data_path(path: str) -> None:
    """``InputError`` unless ``path`` is a directory or a regular file (symlinks followed).

    Called before a format is chosen, so no probe ever opens a FIFO or a device.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise InputError(f"cannot read ({exc.strerror or exc})", source=path) from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise not_regular(path, mode)


class _SizeBounded(io.RawIOBase):
    """A raw reader over an open regular file that ends at ``size`` bytes (its size at open)."""

    def __init__(self, fd: int, size: int):
        self._file = io.FileIO(fd, "rb", closefd=True)
        self._size = size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        """Fill ``buffer`` from the current position, never past ``size``."""
        left = self._size - self._file.tell()
        if left <= 0:
            return 0
        view = memoryview(buffer).cast("B")
        return self._file.readinto(view[: min(len(view), left)])

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Seek as a file of ``size`` bytes would (``SEEK_END`` is relative to ``size``)."""
        if whence == os.SEEK_END:
            return self._file.seek(self._size + offset, os.SEEK_SET)
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_regular(path: str) -> tuple[int, int]:
    """``(descriptor, size)`` of a regular file opened without blocking; InputError otherwise."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise InputError(f"cannot read ({exc.strerror or exc})", source=path) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise not_regular(path, info.st_mode)
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return fd, info.st_size


@contextlib.contextmanager
def open_data_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A buffered binary reader of the regular file ``path``, bounded by its size at open.

    Every data reader opens its files here (module docstring). Raises ``InputError`` naming
    the path when it cannot be opened or is not a regular file.
    """
    path = os.fspath(path)
    fd, size = _open_regular(path)
    handle = io.BufferedReader(_SizeBounded(fd, size), buffer_size=1 << 20)
    try:
        yield handle
    finally:
        handle.close()


def read_data_file(path: str | os.PathLike) -> bytes:
    """The whole content of the regular file ``path`` (at most its size at open)."""
    with open_data_file(path) as handle:
        try:
            return handle.read()
        except OSError as exc:
            raise InputError(
                f"cannot read ({exc.strerror or exc})", source=os.fspath(path)
            ) from None


def data_file_size(handle: BinaryIO) -> int:
    """The size of a file opened by :func:`open_data_file` (its bound)."""
    position = handle.tell()
    size = handle.seek(0, os.SEEK_END)
    handle.seek(position)
    return size


def check_zip_members(archive: zipfile.ZipFile, archive_size: int, path: str) -> None:
    """``InputError`` when the archive's members claim to unpack to more than their stored
    bytes can (``MAX_DEFLATE_RATIO``), or to more than that ratio times the archive's size.

    Readers allocate a member's declared size before they check it, so a 200-byte archive
    declaring a 10 GB member is refused here, before any member is read.
    """
    total = 0
    for info in archive.infolist():
        stored = max(info.compress_size, 1)
        if info.file_size > stored * MAX_DEFLATE_RATIO:
            raise InputError(
                f"an archive member declares {info.file_size:,} bytes from {info.compress_size:,} "
                "stored ones, more than compression can give",
                source=path,
            )
        total += info.file_size
    if total > max(archive_size, 1) * MAX_DEFLATE_RATIO:
        raise InputError(
            f"the archive's members declare {total:,} bytes in all, more than a file of "
            f"{archive_size:,} bytes can unpack to",
            source=path,
        )


MAX_JSON_DEPTH = 64
"""Deepest nesting of lists/objects accepted in JSON the tool reads (reports: about 8)."""


class JsonTooDeep(ValueError):
    """JSON nested deeper than the caller's limit (raised instead of a RecursionError)."""

    def __init__(self, limit: int):
        super().__init__(f"nested more than {limit} levels deep")
        self.limit = limit


def json_depth(value, limit: int) -> int:
    """Nesting depth of parsed JSON (``[]`` is 1), iteratively; stops counting past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                break
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def loads_json(text: str | bytes, max_depth: int = MAX_JSON_DEPTH):
    """``json.loads`` for untrusted text (an option's JSON, a report given to ``compare``).

    Python's parser recurses once per level and raises ``RecursionError`` about a thousand
    levels down, and code that walks the value recurses as deep; so nesting beyond
    ``max_depth`` raises :class:`JsonTooDeep`. Otherwise raises what ``json.loads`` raises:
    ``json.JSONDecodeError``, or ``ValueError`` for an integer of more than 4300 digits.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep(max_depth) from None
    if json_depth(value, max_depth) > max_depth:
        raise JsonTooDeep(max_depth)
    return value
