"""Progress of long computations: one context-local channel from the loops to a display.

The loops that take the time (Lanczos steps, trace probes, SLQ probes, the batches of one
product, training steps, sweep runs) report what they did here; whoever wants to see it (the
CLI's progress bar, a test, a notebook) installs a callback with :func:`reporting`. Nothing
else connects the two.

Why a context variable and not ``progress=`` parameters: the counts live several calls deep
(``sharp analyze`` -> :func:`sharpcli.analyses.spectrum.gn_nme` ->
:func:`sharpcli.curvature.eigen.lanczos.lanczos` -> an operator's ``matmat`` ->
:meth:`sharpcli.curvature.products.data.AnalysisData.batches`), and a callback parameter would have to
grow on every function between the command and the loop, registered operators included. A
:class:`contextvars.ContextVar` reaches them all, stays per thread (two analyses in two
threads do not mix their counts), and costs one ``ContextVar.get`` per report when nobody
listens. It carries only counts and numbers the loop already holds on the host: reporting
adds no device synchronisation; the display throttles its own rendering.

Producers::

    run = progress.start("lanczos", total=budget, unit="matvecs", quantity="lambda")
    run.update(done, estimate=theta, residual=r)      # after each step
    run.finish(done, estimate=theta, residual=r)      # the numbers of the result
    progress.batch(i, n)                              # batch i of n inside one product
    with progress.phase("trace (hessian)"): ...       # labels the runs started inside

Consumer::

    with progress.reporting(events.append): ...       # callback(event: Event)

Runs nest (a training run's ``--track`` Lanczos, a sweep's training runs): each
:class:`Event` names its run (``run``) and the run it was started inside (``parent``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

__all__ = ["Event", "Run", "active", "batch", "phase", "reporting", "start"]


@dataclass(frozen=True)
class Event:
    """One report of a run: how far it got and its current numbers.

    ``phase`` is the label of the enclosing :func:`phase` (else ``method``); ``method`` the
    loop ("lanczos", "hutch++", "train", ...); ``run`` the run's id, ``parent`` the id of the
    run it was started inside (None at the top). ``done`` counts ``unit`` (matvecs, steps,
    batches, runs) out of the budget ``total`` (None: unknown); ``expected`` is the count
    at which the run projects to stop when it can tell (a trace estimator from its standard
    error: ``n (stderr / (tol |estimate|))^2`` probes). ``capped``: the run stops at a
    tolerance, so ``total`` is a cap, not a plan (Lanczos, power iteration, Hutchinson,
    Hutch++; no time left is projected from it). ``probes`` counts random probes,
    ``quantity`` names ``estimate`` ("tr", "lambda_max", "loss"), ``stderr`` is its standard
    error, ``residual`` its Ritz residual ``||A u - theta u||``, ``detail`` a short text
    ("epoch 2/5"). ``batch``/``batches``: the batch of the product under way. ``final``:
    the run is over and the numbers are those of its result. ``record``: the numbers of a
    part of the run that has just ended, for a display to print as a line of its own (a
    training epoch's history row, with ``epochs``); only on the one event that reports it.
    """

    phase: str
    method: str
    run: int
    parent: int | None
    unit: str
    done: int
    total: int | None = None
    expected: int | None = None
    capped: bool = False
    probes: int | None = None
    quantity: str | None = None
    estimate: float | None = None
    stderr: float | None = None
    residual: float | None = None
    detail: str | None = None
    batch: int | None = None
    batches: int | None = None
    final: bool = False
    record: dict | None = None


class _Channel:
    """The installed callback and the stack of open runs (the innermost receives batches)."""

    def __init__(self, callback: Callable[[Event], None]) -> None:
        self.callback = callback
        self.open: list[Run] = []


_CHANNEL: contextvars.ContextVar[_Channel | None] = contextvars.ContextVar(
    "sharpcli_progress", default=None
)
_PHASE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "sharpcli_progress_phase", default=None
)
_IDS = itertools.count(1)


@contextlib.contextmanager
def reporting(callback: Callable[[Event], None]) -> Iterator[None]:
    """Send the events of every run started inside the block to ``callback(event)``."""
    token = _CHANNEL.set(_Channel(callback))
    try:
        yield
    finally:
        _CHANNEL.reset(token)


@contextlib.contextmanager
def phase(label: str) -> Iterator[None]:
    """Label the runs started inside the block (``Event.phase``), e.g. ``"trace (ggn)"``."""
    token = _PHASE.set(label)
    try:
        yield
    finally:
        _PHASE.reset(token)


def active() -> bool:
    """Whether anyone listens (a callback is installed): skip work done only to report."""
    return _CHANNEL.get() is not None


class Run:
    """A reporting loop; made by :func:`start`. ``update`` after each step, ``finish`` once.

    As a context manager (``with progress.start(...) as run:``) it is closed on the way out
    even when the loop raises, so a failed run a caller recovers from (a diverged training run
    in a sweep) is not left open to receive the next run's batches.
    """

    def __init__(self, channel: _Channel | None, first: Event | None) -> None:
        self._channel = channel
        self._last = first
        self.finished = channel is None

    def update(self, done: int, **numbers) -> None:
        """Report ``done`` units so far and any :class:`Event` field in ``numbers``."""
        if self.finished or self._last is None:  # no listener (then _last is None too)
            return
        numbers.setdefault("record", None)
        self._emit(dataclasses.replace(self._last, done=int(done), batch=None, **numbers))

    def finish(self, done: int, **numbers) -> None:
        """Report the run's end: ``done`` and the numbers of its result."""
        if self.finished or self._channel is None or self._last is None:
            return
        numbers.setdefault("record", None)
        self._emit(
            dataclasses.replace(self._last, done=int(done), batch=None, final=True, **numbers)
        )
        self.finished = True
        if self in self._channel.open:
            self._channel.open.remove(self)

    @property
    def total(self) -> int | None:
        """The run's budget (``Event.total``); None without a listener."""
        return None if self._last is None else self._last.total

    def close(self) -> None:
        """Finish the run with its last numbers unless it finished already."""
        if not self.finished and self._last is not None:
            self.finish(self._last.done)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _batch(self, done: int, total: int) -> None:
        if self._last is None:  # no listener
            return
        self._emit(dataclasses.replace(self._last, batch=done, batches=total, record=None))

    def _emit(self, event: Event) -> None:
        self._last = event
        if self._channel is not None:
            self._channel.callback(event)


_NO_RUN = Run(None, None)


def start(
    method: str,
    *,
    total: int | None = None,
    unit: str = "matvecs",
    quantity: str | None = None,
    **numbers,
) -> Run:
    """Start a run of ``method`` counting ``unit`` out of ``total``; reports its first event
    (``done=0``). Without a listener, a run that does nothing (no allocation, no call)."""
    channel = _CHANNEL.get()
    if channel is None:
        return _NO_RUN
    innermost = channel.open[-1]._last if channel.open else None
    parent = None if innermost is None else innermost.run
    first = Event(
        phase=_PHASE.get() or method,
        method=method,
        run=next(_IDS),
        parent=parent,
        unit=unit,
        done=0,
        total=None if total is None else int(total),
        quantity=quantity,
        **numbers,
    )
    run = Run(channel, first)
    channel.open.append(run)
    channel.callback(first)
    return run


def batch(done: int, total: int) -> None:
    """Batch ``done`` of ``total`` of the product (or pass) under way, for the innermost open
    run; nothing without a listener or an open run."""
    channel = _CHANNEL.get()
    if channel is not None and channel.open:
        channel.open[-1]._batch(done, total)
