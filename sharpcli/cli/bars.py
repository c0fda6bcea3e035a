"""The progress bar on stderr: what :mod:`sharpcli.progress` reports, as a rich display.

One line per open run (a nested run, e.g. a training run's ``--track`` Lanczos or a sweep's
training run, indented under its parent); a run's line goes when it finishes. A line reads

    tr(H)          ━━━━━━━━ 144/1000 matvecs b4/12   tr 11.2 ±0.2 n=80 sk… 0:03<0:02

the phase, a bar towards the count the run projects to stop at (its budget when it cannot
tell), the count out of the budget with the batch of the product under way when a product
spans several (``b4/12``), the current estimate with its standard error (``±``) or Ritz
residual (``res``) and the probes when they differ from the count, and the elapsed and
remaining time. The phase, bar and time columns have fixed widths; the counts and numbers
take what a line of the terminal's width leaves and are cut at the end with an ellipsis, so a
line never folds (80 columns show the numbers, 60 columns the counts and times). While no
run is open (loading, a pass without counts) a pulsing line with the command's own text and
the elapsed time shows that work goes on.

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

REDRAW_SECONDS = 0.1
# column widths (characters); the counts and numbers get the rest of the terminal's width
DESCRIPTION_WIDTH = 14
BAR_WIDTH = 8
TIME_WIDTH = 9  # "0:15<0:20"
FIXED_WIDTH = DESCRIPTION_WIDTH + BAR_WIDTH + TIME_WIDTH + 3  # and the 3 gaps between columns
# short names of estimates on the bar
SHORT = {"lambda_max": "max", "lambda_min": "min", "lambda": "lambda"}


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

    with Progress(
        text_column("{task.description}", DESCRIPTION_WIDTH),
        BarColumn(bar_width=BAR_WIDTH),
        text_column("{task.fields[text]}", max(stderr_console.width - FIXED_WIDTH - 1, 1)),
        _time_column(),
        console=stderr_console,
        transient=True,
        redirect_stdout=False,  # stdout is the report's; nothing else may land there
    ) as bar:
        display = _Display(bar, text)
        with channel.reporting(display.on_event):
            yield


class _Display:
    """Turns :class:`sharpcli.progress.Event` s into the lines of a rich ``Progress``."""

    def __init__(self, bar, text: str) -> None:
        self.bar = bar
        self.idle = bar.add_task("working", total=None, text=text, finish_at=None)
        self.tasks: dict[int, int] = {}  # run id -> rich task id
        self.depth: dict[int, int] = {}
        self.drawn: dict[int, float] = {}  # run id -> time of its last redraw
        self.started: dict[int, float] = {}  # run id -> time of its first event

    def on_event(self, event: channel.Event) -> None:
        """Add, redraw (throttled) or remove the line of ``event``'s run."""
        now = time.monotonic()
        task = self.tasks.get(event.run)
        if event.final:
            if task is not None:
                self._draw(task, event)
                self.bar.refresh()  # its last numbers reach the screen, however short the run
                self.bar.remove_task(task)
                del self.tasks[event.run], self.drawn[event.run], self.depth[event.run]
                del self.started[event.run]
            self.bar.update(self.idle, visible=not self.tasks)
            return
        if task is None:
            depth = self.depth.get(event.parent, -1) + 1 if event.parent is not None else 0
            self.depth[event.run] = depth
            task = self.bar.add_task(
                "  " * depth + event.phase, total=None, text="", finish_at=None
            )
            self.started[event.run] = now
            self.tasks[event.run] = task
            self.bar.update(self.idle, visible=False)
        elif now - self.drawn[event.run] < REDRAW_SECONDS:
            return
        self.drawn[event.run] = now
        self._draw(task, event)

    def _draw(self, task: int, event: channel.Event) -> None:
        total = bar_total(event)
        self.bar.update(
            task,
            completed=event.done,
            total=total,
            text=line_text(event),
            finish_at=finish_time(self.started[event.run], time.monotonic(), event.done, total),
        )


def bar_total(event: channel.Event) -> int | None:
    """What the bar fills towards: the projected stop when known, else the budget."""
    if event.expected is not None:
        return max(event.expected, event.done)
    return event.total


def finish_time(started: float, now: float, done: int, total: int | None) -> float | None:
    """When the run reaches ``total`` at its mean rate so far (``time.monotonic`` clock), or
    None before the first unit or without a total. The mean over the whole run, not a recent
    window: the total moves with the run's projection, and units (products, steps) cost about
    the same throughout."""
    if total is None or done <= 0 or now <= started:
        return None
    return now + (now - started) * max(total - done, 0) / done


def line_text(event: channel.Event) -> str:
    """The counts, padded to the widest this run can show (they do not move the numbers
    while it runs), then the numbers."""
    widest = f"{event.total}/{event.total} {event.unit}" if event.total is not None else ""
    if event.batches and event.batches > 1:
        widest += f" b{event.batches}/{event.batches}"
    numbers = numbers_text(event)
    counts = counts_text(event)
    return f"{counts:<{len(widest)}}  {numbers}" if numbers else counts


def counts_text(event: channel.Event) -> str:
    """``136/1000 matvecs`` (``136 matvecs`` without a budget), ``b3/6`` for the batch under
    way when a product spans several batches."""
    text = f"{event.done}/{event.total}" if event.total is not None else f"{event.done}"
    text += f" {event.unit}"
    if event.batch is not None and event.batches and event.batches > 1:
        text += f" b{event.batch}/{event.batches}"
    return text


def numbers_text(event: channel.Event) -> str:
    """``tr 11.36 ±0.1 n=104``, ``max 2.719 res 2e-04``, ``loss 0.3121 epoch 2/5``: the
    estimate with its standard error or residual, the probes (when they are not the count) and
    the run's detail, most important first (a narrow line cuts the end)."""
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
    return " ".join(parts)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _time_column():
    from rich.progress import ProgressColumn
    from rich.table import Column
    from rich.text import Text

    class TimeColumn(ProgressColumn):
        """``elapsed<remaining`` (``0:03<0:02``); the remaining time counts down to the
        run's :func:`finish_time` between redraws."""

        def render(self, task) -> Text:
            text = _clock(task.elapsed or 0.0)
            finish_at = task.fields.get("finish_at")
            if finish_at is not None:
                text += f"<{_clock(max(finish_at - time.monotonic(), 0.0))}"
            return Text(text, style="progress.elapsed", no_wrap=True)

    return TimeColumn(table_column=Column(no_wrap=True, min_width=TIME_WIDTH))
