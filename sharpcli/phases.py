"""CPU seconds per phase of a run: where a command's time goes beside its products.

A whole run is more than its products: start-up (the interpreter, the CLI, importing torch),
loading the checkpoint and the data, the preflight checks (:mod:`sharpcli.preflight`: the
loss inferred from a forward pass, the deterministic-forward check, the second-derivative
self-check, the reachability of every parameter), the first graph (the forward pass and
gradient the products reuse, with the memory plan around it), the products of the estimator,
and the report. The run wrapper (:mod:`sharpcli.cli.runner`) starts a ledger when the
computation starts; the library marks the end of each phase (:func:`mark`) at the point
where it ends, and the ledger charges the process's CPU seconds (user + system, all threads:
``time.process_time``) since the previous mark to that phase. The report's
``timing.cpu_seconds`` gives the split, and ``--verbose`` prints it on stderr.

Without a ledger started (library calls outside a command) :func:`mark` does nothing. The
ledger is a context variable, like the memory plan: nested commands in one process (tests,
sweeps) each keep their own.
"""

from __future__ import annotations

import contextvars
import time

STARTUP = "startup"
LOAD = "load"
PREFLIGHT = "preflight"
FIRST_GRAPH = "first_graph"
PRODUCTS = "products"
REPORT = "report"
ANALYSIS = "analysis"
# the phases in the order a run goes through them (the report and the stderr line keep it)
ORDER = (STARTUP, LOAD, PREFLIGHT, FIRST_GRAPH, PRODUCTS, ANALYSIS, REPORT)


class PhaseLedger:
    """CPU seconds charged to each phase; the clock reading of the last mark."""

    def __init__(self, startup_seconds: float):
        self.seconds: dict[str, float] = {STARTUP: max(0.0, startup_seconds)}
        self.last = time.process_time()

    def mark(self, phase: str) -> None:
        """Charge the CPU seconds since the previous mark to ``phase`` (added to it)."""
        now = time.process_time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, now - self.last)
        self.last = now

    def split(self) -> dict[str, float]:
        """``{phase: CPU seconds}`` in :data:`ORDER` (rounded to ms), and ``total``."""
        out = {p: round(self.seconds[p], 3) for p in ORDER if p in self.seconds}
        out.update({p: round(s, 3) for p, s in self.seconds.items() if p not in out})
        out["total"] = round(sum(self.seconds.values()), 3)
        return out

    def summary(self) -> str:
        """One line: ``CPU seconds: startup 4.1, load 2.0, ... (total 30.2)``."""
        split = self.split()
        total = split.pop("total")
        parts = ", ".join(f"{p.replace('_', ' ')} {s:.1f}" for p, s in split.items())
        return f"CPU seconds by phase: {parts} (total {total:.1f})"


_LEDGER: contextvars.ContextVar[PhaseLedger | None] = contextvars.ContextVar(
    "sharp_phase_ledger", default=None
)


def start(startup_seconds: float) -> PhaseLedger:
    """Start this command's ledger; ``startup_seconds``: the CPU seconds spent before it."""
    ledger = PhaseLedger(startup_seconds)
    _LEDGER.set(ledger)
    return ledger


def mark(phase: str) -> None:
    """End ``phase`` here: the CPU seconds since the previous mark are charged to it."""
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger.mark(phase)


def active() -> PhaseLedger | None:
    """The running command's ledger, or None."""
    return _LEDGER.get()


def marked(phase: str) -> bool:
    """Whether ``phase`` has been charged in the running command."""
    ledger = _LEDGER.get()
    return ledger is not None and phase in ledger.seconds


def clear() -> None:
    """End the ledger (the next command starts its own)."""
    _LEDGER.set(None)
