"""``python -m sharpcli`` and the ``sharp`` console script: the process around the command.

Two things happen here, before anything heavy (typer, numpy, torch: about 2 s) is imported:

- SIGINT and SIGTERM handling is installed (:mod:`sharpcli.interrupts`), so that a Ctrl-C or a
  ``timeout``/Slurm/Docker SIGTERM at any moment, the imports included, ends the run with one
  line and exit status 130 or 143, and replaces no output;
- a standard stream the caller closed (``sharp ... 1>&-``) is reopened onto /dev/null, so that
  no file the command opens takes its descriptor (a checkpoint opened as descriptor 1 would
  receive whatever is printed); writing to a closed stdout then counts as a reader gone away
  (exit 141, :func:`sharpcli.cli.runner.run_command`).
"""

from __future__ import annotations

import errno
import os
import sys
import time


class _ClosedStream:
    """``sys.stdout`` when the caller closed descriptor 1: every write fails as a closed pipe."""

    def write(self, text) -> int:
        if text:
            raise BrokenPipeError(errno.EPIPE, "stdout is closed")
        return 0

    def flush(self) -> None:
        return None

    def fileno(self) -> int:
        return 1

    def isatty(self) -> bool:
        return False


def _reopen_closed_streams() -> None:
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: ``fd``
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            if fd == 1:
                sys.stdout = _ClosedStream()
            elif fd == 2:  # Python set sys.stderr to None; print(file=None) would go to stdout
                sys.stderr = open(2, "w", closefd=False)


def _process_age() -> float:
    """Seconds since this process started (Linux: ``/proc``, 10 ms resolution), else 0."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            now = float(uptime.read().split()[0])
        return max(0.0, now - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def main() -> None:
    """Install signal handling and repair closed streams, then run :func:`sharpcli.cli.app.main`
    (telling it when the process started: the report's ``timing.startup_seconds``)."""
    started = time.perf_counter() - _process_age()
    # before the CLI's start-up imports: a signal during them exits as documented
    from sharpcli import interrupts

    args = sys.argv[1:]
    command = args[0] if args and not args[0].startswith("-") else None
    interrupts.install("exit", command)  # until the command body starts: nothing written yet
    _reopen_closed_streams()
    # the CLI's start-up imports, after the streams its consoles bind to are repaired
    from sharpcli.cli.app import main as app_main

    try:
        app_main(started=started)
    except SystemExit as done:
        if done.code is None or type(done.code) is int:
            _exit_now(done.code or 0)
        raise


def _exit_now(code: int) -> None:
    """End the process with ``code`` without the interpreter's teardown.

    With torch loaded, finalising the interpreter (module teardown, torch's destructors) costs
    about 0.4 s of CPU after the command is done. By now every output is published and the
    signal handlers are back; only the standard streams are flushed. sharpcli registers no
    ``atexit`` handler. Should a flush fail, or a profiler or tracer be watching the process
    (``python -m cProfile -m sharpcli``, coverage: they write their results at exit), the
    normal exit runs instead.
    """
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code)


if __name__ == "__main__":
    main()
