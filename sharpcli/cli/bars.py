"""The progress bar on stderr: what :mod:`sharpcli.progress` reports, as a rich display.

One line per open run (a nested run, e.g. a training run's ``--track`` Lanczos or a sweep's
training run, indented under its parent); a run's line goes when it finishes. A line reads

    tr(H)          ━━━━━━━━━━ 144/1000 matvecs b4/12 tr 11.2 ±0.2 n=80    0:03<0:02

the phase, a bar towards the count the run projects to stop at (its budget when it cannot
tell), the work done in the unit being spent (products, steps, batches) out of the budget,
with the batch of the product under way when a product spans several (``b4/12``), the current
estimate with its standard error (``±``) or Ritz residual (``res``) and the probes when they
differ from the count, and the elapsed and remaining time. Nothing is cut: the numbers that
do not fit the line's width are left out whole, least important first (:func:`line_text`).

The remaining time is shown only once it is stable (:class:`_Eta`): from the measured cost of
a unit after the first (which pays for caches and warm-up) and a planned count, the run's
projection or a budget it runs to the end (training steps, SLQ steps, batches); never from
the budget of a run that stops at a tolerance (Lanczos, power iteration, Hutchinson, Hutch++:
``Event.capped``) while it cannot project; and only after the last estimates agree.

A run may report a part of it that has ended (``Event.record``: a training epoch); its line
(:func:`record_line`: the epoch, train and test loss and accuracy) is printed above the bars
and stays (for a run at the top: a sweep's training runs print none). While no run is open (loading, a pass without counts) a pulsing line with the
command's own text and the elapsed time shows that work goes on.

Nothing is shown under ``--quiet`` or ``--json -``, on ranks other than 0, or when stderr is
not a terminal (logs, pipes and tests see clean stderr). Rendering is throttled: a run's line
is redrawn at most ``REDRAW_SECONDS`` apart (always at its start and end), so reporting each
step or batch costs a comparison; rich itself refreshes the screen 10 times a second. rich is
imported only here, when a bar is shown (``sharp --help`` stays fast).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from sharpcli import distributed
from sharpcli import progress as channel
from sharpcli.catalogue.values import SPLITS

REDRAW_SECONDS = 0.1
# column widths (characters) at 80 columns; a wider terminal widens the bar and the text
DESCRIPTION_WIDTH = 14
BAR_WIDTH = 10
TIME_WIDTH = 10  # "0:36<18:12"
FIXED_WIDTH = DESCRIPTION_WIDTH + BAR_WIDTH + TIME_WIDTH + 3  # and the 3 gaps between columns
# short names of estimates on the bar
SHORT = {"lambda_max": "max", "lambda_min": "min", "lambda": "lambda"}
# The remaining time is shown once this many units after the first are measured and the last
# ETA_AGREE estimates of the finish time agree within ETA_SPREAD of the time left (or 1 s).
ETA_UNITS = 2
ETA_AGREE = 3
ETA_SPREAD = 0.2


def widths(columns: int) -> tuple[int, int]:
    """(bar, text) widths of a line on a terminal ``columns`` wide: at 80 columns the bar is
    ``BAR_WIDTH`` cells; half of any extra width goes to the bar (up to 40 cells)."""
    extra = max(columns - 80, 0)
    bar = min(BAR_WIDTH + extra // 2, 40)
    text = max(columns - DESCRIPTION_WIDTH - bar - TIME_WIDTH - 3 - 1, 1)
    return bar, text


@contextlib.contextmanager
def progress_bar(stderr_console, disabled: bool, text: str) -> Iterator[None]:
    """Show the runs reported inside the block on ``stderr_console`` (see module docstring);
    ``text`` names the work while no run is open. Nothing when ``disabled``."""
    if disabled or not stderr_console.is_terminal or not distributed.is_main_process():
        yield
        return
    from rich.progress import BarColumn, Progress, TextColumn
    from rich.table import Column

    def text_column(template: str, width: int):
        return TextColumn(
            template, table_column=Column(no_wrap=True, overflow="ellipsis", width=width)
        )

    bar_width, text_width = widths(stderr_console.width)
    with Progress(
        text_column("{task.description}", DESCRIPTION_WIDTH),
        BarColumn(bar_width=bar_width),
        text_column("{task.fields[text]}", text_width),
        _time_column(),
        console=stderr_console,
        transient=True,
        redirect_stdout=False,  # stdout is the report's; nothing else may land there
    ) as bar:
        display = _Display(bar, text, text_width)
        with channel.reporting(display.on_event):
            yield


class _Eta:
    """When a run will finish, shown only once stable (module docstring)."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None  # (time, done) at the first unit done
        self.estimates: list[float] = []

    def update(self, now: float, done: int, planned: int | None) -> float | None:
        """The finish time (``time.monotonic`` clock) to show, or None."""
        if done <= 0:
            return None
        if self.first is None:
            self.first = (now, done)
            return None
        t0, d0 = self.first
        measured = done - d0
        if planned is None or measured < ETA_UNITS or now <= t0:
            self.estimates.clear()
            return None
        finish = now + (now - t0) / measured * max(planned - done, 0)
        self.estimates = (self.estimates + [finish])[-ETA_AGREE:]
        if len(self.estimates) < ETA_AGREE:
            return None
        spread = max(self.estimates) - min(self.estimates)
        return finish if spread <= max(ETA_SPREAD * (finish - now), 1.0) else None


class _Display:
    """Turns :class:`sharpcli.progress.Event` s into the lines of a rich ``Progress``."""

    def __init__(self, bar, text: str, text_width: int) -> None:
        self.bar = bar
        self.text_width = text_width
        self.idle = bar.add_task("working", total=None, text=text, finish_at=None)
        self.tasks: dict[int, int] = {}  # run id -> rich task id
        self.depth: dict[int, int] = {}
        self.drawn: dict[int, float] = {}  # run id -> time of its last redraw
        self.eta: dict[int, _Eta] = {}

    def on_event(self, event: channel.Event) -> None:
        """Add, redraw (throttled) or remove the line of ``event``'s run; print a record."""
        now = time.monotonic()
        if event.record is not None and event.parent is None:  # not each run of a sweep
            self.bar.console.print(
                record_line(event.record, self.bar.console.width), markup=False, highlight=False
            )
        task = self.tasks.get(event.run)
        if event.final:
            if task is not None:
                self._draw(task, event, now)
                self.bar.refresh()  # its last numbers reach the screen, however short the run
                self.bar.remove_task(task)
                del self.tasks[event.run], self.drawn[event.run], self.depth[event.run]
                del self.eta[event.run]
            self.bar.update(self.idle, visible=not self.tasks)
            return
        if task is None:
            depth = self.depth.get(event.parent, -1) + 1 if event.parent is not None else 0
            self.depth[event.run] = depth
            task = self.bar.add_task(
                "  " * depth + event.phase, total=None, text="", finish_at=None
            )
            self.eta[event.run] = _Eta()
            self.tasks[event.run] = task
            self.bar.update(self.idle, visible=False)
        elif now - self.drawn[event.run] < REDRAW_SECONDS and event.record is None:
            return
        self.drawn[event.run] = now
        self._draw(task, event, now)

    def _draw(self, task: int, event: channel.Event, now: float) -> None:
        total = bar_total(event)
        finish = self.eta[event.run].update(now, event.done, planned_total(event))
        self.bar.update(
            task,
            completed=event.done,
            total=total,
            text=line_text(event, self.text_width),
            finish_at=None if event.final else finish,
        )


def bar_total(event: channel.Event) -> int | None:
    """What the bar fills towards: the projected stop when known, else the budget."""
    if event.expected is not None:
        return max(event.expected, event.done)
    return event.total


def planned_total(event: channel.Event) -> int | None:
    """The count the run will reach: its projection, or its budget when it runs to the end
    (not a run capped at a tolerance, ``Event.capped``); None when it cannot tell."""
    if event.expected is not None:
        return max(event.expected, event.done)
    if event.capped:
        return None
    return event.total


def line_text(event: channel.Event, width: int | None = None) -> str:
    """The counts, padded to the widest this run can show (they do not move the numbers
    while it runs), then as many of the numbers as fit ``width``, each whole."""
    widest = f"{event.total}/{event.total} {event.unit}" if event.total is not None else ""
    if event.batches and event.batches > 1:
        widest += f" b{event.batches}/{event.batches}"
    counts = counts_text(event)
    parts = number_parts(event)
    while parts:
        text = f"{counts:<{len(widest)}} {' '.join(parts)}"
        if width is None or len(text) <= width:
            return text
        parts.pop()
    return counts


def counts_text(event: channel.Event) -> str:
    """``136/1000 matvecs`` (``136 matvecs`` without a budget), ``b3/6`` for the batch under
    way when a product spans several batches."""
    text = f"{event.done}/{event.total}" if event.total is not None else f"{event.done}"
    text += f" {event.unit}"
    if event.batch is not None and event.batches and event.batches > 1:
        text += f" b{event.batch}/{event.batches}"
    return text


def number_parts(event: channel.Event) -> list[str]:
    """``tr 11.36 ±0.1 n=104``, ``max 2.719 res 2e-04``, ``loss 0.3121 epoch 2/5`` in parts: the
    estimate with its standard error or residual, the probes (when they are not the count) and
    the run's detail, most important first."""
    parts = []
    if event.estimate is not None:
        name = event.quantity or "estimate"
        parts.append(f"{SHORT.get(name, name)} {event.estimate:.4g}")
        if event.stderr is not None:
            parts.append(f"±{event.stderr:.1g}")
        if event.residual is not None:
            parts.append(f"res {event.residual:.0e}")
    if event.probes and not (event.unit == "matvecs" and event.probes == event.done):
        parts.append(f"n={event.probes}")
    if event.detail:
        parts.append(event.detail)
    return parts


def record_line(record: dict, width: int = 80) -> str:
    """One line for a part of a run that ended: a training epoch reads
    ``epoch  3/10  train loss 0.4123 acc 0.861  test loss 0.441 acc 0.85  1.2 s``; the parts
    that do not fit ``width`` are left out whole, from the end."""
    epochs = record.get("epochs")
    epoch = record.get("epoch")
    head = f"epoch {epoch:>{len(str(epochs))}}/{epochs}" if epochs else f"epoch {epoch}"
    parts = [head]
    for split in SPLITS:
        loss, acc = record.get(f"{split}_loss"), record.get(f"{split}_accuracy")
        if loss is None:
            continue
        text = f"{split} loss {loss:.4g}"
        if acc is not None:
            text += f" acc {acc:.3f}"
        parts.append(text)
    if record.get("seconds") is not None:
        parts.append(f"{record['seconds']:.1f} s")
    while len("  ".join(parts)) > width - 1 and len(parts) > 1:
        parts.pop()
    return "  ".join(parts)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _time_column():
    from rich.progress import ProgressColumn
    from rich.table import Column
    from rich.text import Text

    class TimeColumn(ProgressColumn):
        """``elapsed<remaining`` (``0:03<0:02``); the remaining time (once stable) counts
        down to the run's finish time between redraws."""

        def render(self, task) -> Text:
            text = _clock(task.elapsed or 0.0)
            finish_at = task.fields.get("finish_at")
            if finish_at is not None:
                left = f"<{_clock(max(finish_at - time.monotonic(), 0.0))}"
                text = text + left if len(text + left) <= TIME_WIDTH else left
            return Text(text, style="progress.elapsed", no_wrap=True)

    return TimeColumn(table_column=Column(no_wrap=True, min_width=TIME_WIDTH))
