"""SIGINT and SIGTERM for the ``sharp`` command: stop at once, publish nothing, leave no temp.

Why: people stop a run with Ctrl-C (SIGINT); torchrun, ``timeout``, Docker and Slurm stop it
with SIGTERM, which by default kills Python outright, leaving hidden temporary files behind.
Python's default SIGINT raises ``KeyboardInterrupt`` wherever the interpreter is, including in
the middle of importing numpy or torch (a traceback, a half-initialised module, or an exception
that library code swallows so that the run goes on and replaces its outputs).

The console entry point (:mod:`sharpcli.__main__`) calls :func:`install` before anything heavy
is imported. The handler then, per :func:`mode`:

- ``exit`` (the process is starting: imports, option parsing; nothing has been written yet):
  prints the one line and exits at once, so an import is never left half done to be used;
- ``defer`` (the same phase when ``sharp`` runs inside another program, ``main(argv)`` in a
  test): records the signal only; :func:`start` raises for it;
- ``raise`` (while the command works): raises :class:`Interrupted`, a ``BaseException`` (an
  ``except Exception`` in library code does not swallow it), so the ``finally`` blocks of
  :mod:`sharpcli.atomic` remove the temporary files on the way out;
- ``done`` (the command's files are published): records the signal only; the run completed.

A second signal while the first is still being handled (a hung cleanup, or an
``Interrupted`` that some library swallowed) removes the live temporary files
(:func:`at_interrupt` callbacks) and exits at once. :func:`check` refuses to publish once any
signal arrived, and :func:`blocked` holds both signals at the OS level while finished files are
renamed onto their paths, so a group of files is never half published.

The exit status is 128 + the signal number, as shells report a process killed by it: 130 for
SIGINT, 143 for SIGTERM. Only the standard library is imported here (it runs before torch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_state: dict = {
    "installed": False,
    "mode": "defer",
    "signum": None,
    "reported": False,
    "command": None,
    "installed_mode": "defer",
}
_previous: dict = {}
_cleanups: list[Callable[[], None]] = []


class Interrupted(BaseException):
    """The run was stopped by SIGINT or SIGTERM; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """128 + the signal number."""
        return 128 + int(self.signum)

    def one_line(self) -> str:
        """``interrupted by SIGINT`` (or the signal's name)."""
        return f"interrupted by {signal.Signals(self.signum).name}"


def install(mode: str = "defer", command: str | None = None) -> bool:
    """Handle SIGINT and SIGTERM as the module docstring says, starting in ``mode`` (``exit``
    for the ``sharp`` process itself, ``defer`` for a caller in another program); ``command``
    names the command in the line printed (``sharp train: interrupted by SIGINT``).

    A signal the parent process ignores stays ignored (a background job of a shell script
    ignores SIGINT, as ``nohup`` makes SIGHUP ignored), as Python itself does for SIGINT.

    Returns True when this call installed the handlers (the caller then calls :func:`uninstall`
    when it is done), False when they already were, or cannot be (not the main thread).
    """
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return False
    _state.update(installed=True, mode=mode, signum=None, reported=False, command=command)
    _state["installed_mode"] = mode
    for signum in SIGNALS:  # a signal pending since start-up is recorded as soon as one is in
        if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored by the parent: stays so
            _previous[signum] = signal.signal(signum, _handler)
    return True


def uninstall() -> None:
    """Restore the handlers :func:`install` replaced (in-process callers, such as tests)."""
    if not _state["installed"]:
        return
    for signum, previous in _previous.items():
        signal.signal(signum, previous)
    _previous.clear()
    _state.update(installed=False, mode="defer", signum=None, reported=False, command=None)


def installed() -> bool:
    """Whether the handlers are installed."""
    return bool(_state["installed"])


def received() -> int | None:
    """The first signal received since :func:`install`, or None."""
    return _state["signum"]


def mode() -> str:
    """The current mode (``exit`` or ``defer``)."""
    return _state["mode"]


def at_interrupt(callback: Callable[[], None]) -> None:
    """Run ``callback`` (best effort: remove temporary files) when an interrupted run is
    reported (:func:`report`), and before a hard exit."""
    _cleanups.append(callback)


def check() -> None:
    """Raise :class:`Interrupted` when a signal has arrived (it may have been swallowed)."""
    if _state["signum"] is not None:
        raise Interrupted(_state["signum"])


def start() -> None:
    """The command body starts: honour a signal deferred so far, then raise on the next one."""
    if not _state["installed"]:
        return
    check()
    _state["mode"] = "raise"


def done() -> None:
    """The command's files are about to be published: later signals no longer stop the run."""
    if _state["installed"]:
        _state["mode"] = "done"


def finishing() -> None:
    """The command returned (its status is decided): back to the start-up mode (``exit`` for
    the ``sharp`` process: a signal exits at once), unless the command published its files
    (``done``), which no signal undoes."""
    if _state["installed"] and _state["mode"] != "done":
        _state["mode"] = _state["installed_mode"]


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Hold SIGINT and SIGTERM at the OS level for the block (renames that publish files); a
    signal that arrives meanwhile is delivered when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def report(command: str | None, signum: int) -> int:
    """Clean up (:func:`at_interrupt`), print the one stderr line of an interrupted run (once);
    return its exit status."""
    _run_cleanups()
    if not _state["reported"]:
        _state["reported"] = True
        command = command or _state["command"]
        prefix = f"sharp {command}" if command else "sharp"
        _write_stderr(f"{prefix}: {Interrupted(signum).one_line()}\n")
    return 128 + int(signum)


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.flush()
    except Exception:  # stderr may be closed or broken; the exit status still says it
        pass
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


def _handler(signum, frame) -> None:
    if _state["mode"] == "exit" or (_state["signum"] is not None and _state["mode"] != "done"):
        _hard_exit(_state["signum"] or signum)
    if _state["signum"] is None:
        _state["signum"] = signum
    if _state["mode"] == "raise":
        raise Interrupted(signum)


def _run_cleanups() -> None:
    for callback in _cleanups:
        with contextlib.suppress(Exception):
            callback()


def _hard_exit(signum: int) -> None:
    """Start-up or a second signal: remove live temporaries, print the line (once), exit now."""
    os._exit(report(None, signum))
