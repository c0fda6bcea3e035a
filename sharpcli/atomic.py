"""Publishing output files: nothing a command already has is lost or left half-written.

Every file the tool writes goes through a :class:`Publication`:

- :meth:`Publication.stage` writes the content into a hidden temporary file beside the target
  (``.NAME.<8 random hex digits>.tmp``) and fsyncs it. The temporary file is created like any new file,
  ``0666 & ~umask``, or takes the mode of the file it will replace, so an overwritten file
  keeps its permissions. A failed write (disk full, I/O error) is a UsageError naming the
  target; the temporary file is removed and the target is untouched.
- :meth:`Publication.commit` renames every staged file onto its target, after the last one
  was written and with SIGINT/SIGTERM held (:mod:`sharpcli.interrupts`): the files of one run
  (checkpoint, history, state, plot, report) replace the old ones together, and a run that
  fails or is stopped before that point replaces none of them.
- A target that is not a regular file (``/dev/null``, ``/dev/stdout``, a FIFO, a character
  device; :func:`~sharpcli.ledger.is_direct_target`) is written in place at commit time,
  opened for appending and never truncated, created or renamed over: a rename would replace
  the device node itself. A symbolic link is followed; the file it points to is replaced.

:func:`publication` gives the publication in effect: the CLI opens one per command
(``run_command``), so everything a command writes is published at its end; a library call
outside any opens its own, which commits when the call's ``with`` block ends. Temporary files
on disk are listed in ``_LIVE``: an interrupted run removes any that an exception did not.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import sys
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, cast

from sharpcli import interrupts, ledger
from sharpcli.errors import UsageError
from sharpcli.ledger import check_writable, is_direct_target  # noqa: F401  (re-exported)

_LIVE: set[str] = set()  # temporary files on disk now


def remove_live_temps() -> None:
    """Remove every temporary file still on disk (best effort; for a hard exit)."""
    for name in list(_LIVE):
        with contextlib.suppress(OSError):
            os.unlink(name)
        _LIVE.discard(name)


interrupts.at_interrupt(remove_live_temps)


class _Sink:
    """A binary file object over a descriptor that remembers the first OSError of a write.

    Serialisers wrap their writer's errors (``torch.save`` raises a RuntimeError around ENOSPC);
    the remembered OSError is what the user is told. Writes go through ``os.write``.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.error: OSError | None = None
        self.written = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        try:
            while view:
                done = os.write(self.fd, view)
                view = view[done:]
                self.written += done
        except OSError as exc:
            self.error = self.error or exc
            raise
        return total

    def flush(self) -> None:
        return None

    def writable(self) -> bool:
        return True


def _write_error(target: Path, exc: OSError) -> UsageError:
    return UsageError(f"cannot write {target} ({exc.strerror or exc})", source=str(target))


def _open_temp(real: Path) -> tuple[int, str]:
    """A new hidden temporary file beside ``real``, ``0666 & ~umask`` (the kernel applies the
    umask) or, when ``real`` exists, with its permission bits; listed in ``_LIVE``."""
    folder = real.parent if str(real.parent) else Path(".")
    for _ in range(100):
        name = str(folder / f".{real.name}.{secrets.token_hex(4)}.tmp")
        _LIVE.add(name)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            _LIVE.discard(name)
            continue
        except BaseException:
            _LIVE.discard(name)
            raise
        try:
            os.fchmod(fd, os.stat(real).st_mode & 0o7777)
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        return fd, name
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(folder))


def _unlink(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)
    _LIVE.discard(name)


def _fill(fd: int, target: Path, write: Callable[[BinaryIO], object]) -> None:
    """Run ``write`` on the descriptor and fsync; an OSError of the file is a UsageError."""
    sink = _Sink(fd)
    try:
        # _Sink has the part of a binary file that serialisers call (write, flush, writable)
        write(cast(BinaryIO, sink))
        os.fsync(fd)
    except (interrupts.Interrupted, KeyboardInterrupt):
        raise
    except Exception as exc:
        cause = sink.error or (exc if isinstance(exc, OSError) else None)
        if cause is None:
            raise
        raise _write_error(target, cause) from exc


class Publication:
    """Files staged as hidden temporaries, renamed onto their targets together (module doc)."""

    def __init__(self) -> None:
        self._staged: list[tuple[str, Path, Path]] = []  # (temporary, real target, target)
        self._direct: list[tuple[Path, bytes]] = []

    def stage(self, path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
        """Write ``write(file)``'s bytes to a temporary file for ``path`` (see module doc)."""
        target = Path(path)
        ledger.check_write(target)
        if is_direct_target(target):
            buffer = io.BytesIO()
            write(buffer)
            self._direct = [d for d in self._direct if d[0] != target]
            self._direct.append((target, buffer.getvalue()))
            return target
        check_writable(target, str(target))
        real = Path(os.path.realpath(target))
        try:
            fd, tmp = _open_temp(real)
        except OSError as exc:
            raise _write_error(target, exc) from exc
        try:
            try:
                _fill(fd, target, write)
            finally:
                os.close(fd)
        except OSError as exc:  # the close itself failed (a network file system flushing late)
            _unlink(tmp)
            raise _write_error(target, exc) from exc
        except BaseException:
            _unlink(tmp)
            raise
        for old in [s for s in self._staged if s[1] == real]:  # staged again: the last one wins
            self._staged.remove(old)
            _unlink(old[0])
        self._staged.append((tmp, real, target))
        return target

    def commit(self, *, final: bool = False) -> None:
        """Write the direct targets, then rename every temporary onto its target.

        Nothing is renamed once a signal has arrived (:func:`sharpcli.interrupts.check`); with
        ``final`` (the command's last step) later signals no longer stop the run. A rename that
        fails is a UsageError naming the target; the remaining temporaries are removed.
        """
        try:
            self._write_direct()
            interrupts.check()
            if final:
                interrupts.done()
            with interrupts.blocked():
                self._rename_all()
        finally:
            self.discard()

    def _write_direct(self) -> None:
        if self._direct:
            with contextlib.suppress(Exception):
                sys.stdout.flush()  # the report after any table already printed
        for target, data in self._direct:
            try:
                fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                try:
                    _Sink(fd).write(data)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise _write_error(target, exc) from exc
        self._direct = []

    def _rename_all(self) -> None:
        folders = set()
        while self._staged:
            tmp, real, target = self._staged[0]
            try:
                os.replace(tmp, real)
            except OSError as exc:
                raise _write_error(target, exc) from exc
            _LIVE.discard(tmp)
            self._staged.pop(0)
            ledger.published(target)
            folders.add(real.parent)
        for folder in folders:  # the renames themselves survive a crash
            with contextlib.suppress(OSError):
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def discard(self) -> None:
        """Remove every staged temporary file; the targets stay as they are."""
        for tmp, _, _ in self._staged:
            _unlink(tmp)
        self._staged = []
        self._direct = []


_STACK: list[Publication] = []


@contextlib.contextmanager
def publication(*, own: bool = False, final: bool = False) -> Iterator[Publication]:
    """The publication in effect; a new one (committed when the block ends without an
    exception, discarded otherwise) when there is none or ``own=True``. ``final``: see
    :meth:`Publication.commit`."""
    if _STACK and not own:
        yield _STACK[-1]
        return
    pub = Publication()
    _STACK.append(pub)
    try:
        yield pub
        _STACK.remove(pub)
        pub.commit(final=final)
    finally:
        if pub in _STACK:
            _STACK.remove(pub)
        pub.discard()


def write_atomic(path: str | os.PathLike, writer: Callable[[BinaryIO], object]) -> None:
    """Stage ``writer(file)``'s bytes for ``path`` in the publication in effect."""
    with publication() as pub:
        pub.stage(path, writer)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`write_atomic`)."""
    write_atomic(path, lambda fh: fh.write(data))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically, UTF-8 encoded."""
    write_bytes_atomic(path, text.encode("utf-8"))
