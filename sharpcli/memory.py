"""Memory planning: what a run will hold, worked out before it allocates, against a budget.

Every command runs under a :class:`MemoryPlan`: a byte budget (``--max-memory SIZE``, default
:data:`DEFAULT_FRACTION` of the memory the machine or the device has free when the run starts)
and the allocations the run plans to hold (parameters and their copies, the Krylov basis,
blocks of probes and their products, cached graphs). Estimators ask the plan how much room is
left before they allocate and choose how to run from the answer (a Krylov basis that restarts,
smaller probe blocks, a smaller Hutch++ sketch); a plan that cannot be met is a
:class:`~sharpcli.errors.UsageError` on ``max_memory`` saying what is needed and which
parameter lowers it. An allocation that fails all the same (the free memory shrank, another
process grew) is reported the same way by :func:`as_usage_error`, never as an internal error.

The plan is a context variable (:func:`activate`, :func:`current`), like the progress
channel: code deep in an estimator reads the run's budget without it being threaded through
every call. Without an active plan, :func:`current` gives a fresh default one.

Accounting. ``baseline`` is the process's resident memory when the plan starts (the
interpreter, torch, the model and the data already loaded); :meth:`MemoryPlan.hold` adds an
item for as long as a ``with`` block runs, and ``planned_peak`` records the largest
``baseline + sum(items)`` reached. The report's ``timing.memory`` puts it beside the measured
peak resident set (``getrusage``) and, on CUDA, the device's peak allocation.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import os
import platform
import re
import resource
import sys
from dataclasses import dataclass, field

from sharpcli.errors import UsageError

__all__ = [
    "DEFAULT_FRACTION",
    "MemoryPlan",
    "activate",
    "as_usage_error",
    "allocated_bytes",
    "available_bytes",
    "bound_heap",
    "clear",
    "settle_heap",
    "trim_heap",
    "current",
    "format_bytes",
    "heap_slack",
    "parse_size",
    "peak_rss_bytes",
    "rss_bytes",
]

DEFAULT_FRACTION = 0.8  # of the memory free when the run starts (docs/memory.md)
PRODUCT_WORKSPACE = "product workspace (one batch)"  # the plan item of one curvature product
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(i?b)?\s*$", re.I)


def parse_size(text: str | int | float, *, source: str = "max_memory") -> int:
    """Bytes of a size such as ``8G``, ``512M``, ``1.5GiB``, ``2e9`` (binary units: K = 1024).

    >>> parse_size("1.5G")
    1610612736
    >>> parse_size(4096)
    4096
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(str(text))
        if match is None:
            raise UsageError(
                f"cannot read {text!r} as a size; write bytes or a number with K, M, G or T "
                "(binary units), e.g. 8G or 512M",
                source=source,
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = value * _UNITS[unit]
    if not (math.isfinite(size) and size >= 1):
        raise UsageError(f"a size must be at least 1 byte, got {text!r}", source=source)
    return int(size)


def format_bytes(size: float) -> str:
    """``size`` in binary units to three significant digits (``%.3g``): ``1.5 GiB``.

    >>> format_bytes(1610612736)
    '1.5 GiB'
    """
    size = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1024
    return f"{size:.3g} TiB"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available() -> int | None:
    """What the process's cgroup (v2) still allows: ``memory.max - memory.current``."""
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as handle:
            limit = handle.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as handle:
            used = int(handle.read().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def available_bytes(device: str = "cpu") -> int:
    """Memory free for this run on ``device``: for CUDA the device's free memory
    (``torch.cuda.mem_get_info``); otherwise the host's available memory (``MemAvailable``,
    bounded by a cgroup limit), plus what this process already holds, since a plan counts the
    process's own resident set in its ``baseline``."""
    if str(device).startswith("cuda"):
        import torch

        index = torch.device(device).index
        free, _ = torch.cuda.mem_get_info(index if index is not None else 0)
        return int(free)
    candidates = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    free = min(candidates) if candidates else 8 << 30
    return int(free) + rss_bytes()


HEAP_MMAP_THRESHOLD = 1 << 20  # blocks this large are mapped and unmapped on their own
HEAP_TRIM_THRESHOLD = 64 << 20  # free memory at the heap's top beyond this goes back
# glibc's own ceiling for its dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit):
# blocks below it are reused from the heap once freed, as glibc does by default
REUSE_MMAP_THRESHOLD = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc's mallopt (malloc.h)
# how many blocks glibc may map on their own: its default, and none when freed blocks are
# reused (every block from the heap: a product's 0.1-0.5 GB temporaries were otherwise mapped
# and zeroed afresh each product, 0.8 CPU s a product of GPT-2 small's 7.1)
GLIBC_MMAP_MAX, REUSE_MMAP_MAX = 65536, 0
# What glibc keeps resident, as freed blocks it reuses, beyond what a run holds when the heap
# is left at its reuse thresholds: the free top it does not trim (HEAP_TRIM_THRESHOLD) and a
# fraction of the planned work (planned peak less baseline) less the first batch's graph,
# built before any product and kept through them all (the other cached graphs are built
# during the first product, between blocks it frees). Measured beyond the plan without it:
# 3% of that work on GPT-2 small (4944M), 1% on ResNet-18 (one batch, 11 of 891 MiB), 29% on
# a 3M-parameter MLP of 12 batches (91 of 315 MiB); the margin keeps the plan an upper bound
# (docs/memory.md, "What the budget bounds")
ALLOCATOR_SLACK = 0.15
ALLOCATOR_SLACK_ITEM = "freed blocks the allocator keeps for reuse"


def heap_slack(plan: MemoryPlan, beside: int = 0) -> int:
    """Bytes :func:`settle_heap` will plan beside the peak to leave the heap reusing freed
    blocks: the heap's untrimmed top (:data:`HEAP_TRIM_THRESHOLD`) and :data:`ALLOCATOR_SLACK`
    of the planned work (planned peak less baseline) less the first batch's first-order graph
    when it is kept between products (``first_graph_bytes``: built before any product and
    never freed); 0 where the heap is settled already (its slack, if any, is held) or is not
    glibc's on the CPU.

    Planners that could take the room it needs for something that buys less time (a Krylov
    basis kept in memory rather than in a scratch file) reserve it first: reusing freed blocks
    saves the kernel's zeroing of every block a product maps, 2.5 CPU s of system time a
    product on ResNet-18, where a basis read back from a scratch file costs about 3% of a run.
    ``beside``: work such a planner will add to the plan whatever it chooses (counted as
    work, so that the slack reserved is the one :func:`settle_heap` will ask for).
    """
    if plan.heap is not None or plan.device.startswith("cuda") or _glibc() is None:
        return 0
    peak = max(plan.planned_peak, plan.in_use + int(beside))
    freed = max(0, peak - plan.baseline - plan.first_graph_bytes)
    return int(HEAP_TRIM_THRESHOLD + ALLOCATOR_SLACK * freed)


def settle_heap() -> str | None:
    """Choose, at a run's first curvature product, how the C heap treats what products free.

    Bounding the heap (:func:`bound_heap`, and :func:`trim_heap` after every product) keeps the
    resident set at what the run holds, but every block of 1 MiB or more is then mapped and
    zeroed by the kernel afresh for every product: on ResNet-18 2.5 CPU s of system time a
    product, 1.45x the bare product's cost. So when the budget holds the planned peak plus
    :func:`heap_slack` (the heap's untrimmed top and :data:`ALLOCATOR_SLACK` of the work), the
    heap is left to reuse freed blocks (thresholds at glibc's defaults' ceiling) and that slack
    is planned as an item; otherwise it is bounded. Runs once per plan, on the CPU under glibc.

    Returns:
        ``"reuse"`` or ``"bounded"`` (the plan's ``heap``), None without an active CPU plan.
    """
    plan = active()
    if plan is None or plan.device.startswith("cuda"):
        return None
    if plan.heap is None:
        slack = heap_slack(plan)
        # the heap's free top is kept up to the slack the plan counts: trimmed beyond 64 MiB,
        # a product's freed temporaries (0.5 GB at GPT-2 small) went back to the system and
        # the next product faulted and zeroed them afresh (8 of 11 CPU s of system time in a
        # 20-matvec run of a 27M-parameter GPT-2 shape)
        if plan.planned_peak + slack <= plan.budget and _set_heap(
            REUSE_MMAP_THRESHOLD, REUSE_MMAP_MAX, max(HEAP_TRIM_THRESHOLD, slack)
        ):
            plan.add_to_peak(ALLOCATOR_SLACK_ITEM, slack)
            plan.heap = "reuse"
            plan.note(
                "freed memory reused by the allocator (the budget holds "
                f"{format_bytes(slack)} more than the plan): no heap trimming"
            )
        else:
            bound_heap()
            plan.heap = "bounded"
            plan.note("freed memory returned to the system after every product (a tight budget)")
    return plan.heap


def _set_heap(
    mmap_threshold: int, mmap_max: int = GLIBC_MMAP_MAX, trim_threshold: int = HEAP_TRIM_THRESHOLD
) -> bool:
    """glibc's mmap threshold to ``mmap_threshold``, the most blocks it maps on their own to
    ``mmap_max`` and its trim threshold (free memory at the heap's top kept beyond it goes
    back) to ``trim_threshold``; False off glibc."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = mallopt(_M_MMAP_MAX, mmap_max) == 1 and ok
    return mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)) == 1 and ok


def bound_heap() -> bool:
    """Make memory that tensors free go back to the system (glibc ``mallopt``), so the
    resident set follows what the run holds and the plan's peak bounds it.

    By default glibc raises its mmap threshold to the largest block freed so far (up to
    32 MiB): after the first product every activation, gradient and Krylov slice of up to
    32 MiB comes from the brk heap, whose freed holes are not returned while a later block
    sits above them. Interleaving a product's graph (thousands of such blocks, freed
    together) with the basis's slice buffers then left the GPT-2-small heap 4.9 GB resident
    after 15 products, growing with each (docs/memory.md, "What the budget bounds"). A fixed
    threshold of :data:`HEAP_MMAP_THRESHOLD` maps every larger block on its own (freed at
    once) and :data:`HEAP_TRIM_THRESHOLD` trims the heap's free top.

    Returns:
        Whether the allocator took the settings (False off glibc, e.g. macOS or musl).
    """
    return _set_heap(HEAP_MMAP_THRESHOLD)


_LIBC: list = []  # glibc's handle once loaded (empty: not loaded yet; [None]: not glibc)


def _glibc():
    if not _LIBC:
        handle = None
        if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
            try:
                handle = ctypes.CDLL(None)
                handle.malloc_trim.argtypes = [ctypes.c_size_t]
            except (OSError, AttributeError):
                handle = None
        _LIBC.append(handle)
    return _LIBC[0]


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``, which also
    releases free pages inside the heap); called after every product, whose double backward
    (and graph, when it was not cached) has just been freed.

    Not when :func:`settle_heap` left the heap to reuse freed blocks. Blocks under
    :data:`HEAP_MMAP_THRESHOLD` (most activations) still come from the heap,
    where holes left between longer-lived blocks (a cached graph) stay resident and the next
    product's blocks land beside them: at GPT-2-small size the peak grew by ~100 MB a product
    under a 5.3 GB budget, past the budget by the 10th product. Runs only under an active
    plan on the CPU.

    Returns:
        Whether the heap was trimmed.
    """
    plan = active()
    if plan is None or plan.device.startswith("cuda") or plan.heap == "reuse":
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def rss_bytes() -> int:
    """The process's resident set size now (``/proc/self/statm``; the peak where that is
    missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (``getrusage``: KiB on Linux, bytes on
    macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass
class MemoryPlan:
    """A run's byte budget and the allocations it plans to hold (module docstring).

    ``budget``: bytes the run may hold in all (host memory on CPU, device memory on CUDA);
    ``stated``: how the budget was set (``max_memory=8G`` or the default's derivation);
    ``baseline``: what the process held when the plan started (host RSS, or the device's
    allocated bytes on CUDA).
    """

    budget: int
    device: str = "cpu"
    stated: str = ""
    baseline: int = 0
    items: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    planned_peak: int = 0
    choices: list[str] = field(default_factory=list)
    heap: str | None = None  # how the C heap treats freed memory (settle_heap), once chosen
    first_graph_bytes: int = 0  # the first batch's graph when kept between products (heap_slack)

    @classmethod
    def for_run(cls, max_memory: str | int | None = None, device: str = "cpu") -> MemoryPlan:
        """The plan of a run on ``device``: budget ``max_memory`` (a size, see
        :func:`parse_size`; per process) or :data:`DEFAULT_FRACTION` of
        :func:`available_bytes`, divided among torchrun's ranks on this host when they share
        its memory (CPU)."""
        baseline = allocated_bytes(device)
        if max_memory is None:
            free = available_bytes(device)
            budget = int(DEFAULT_FRACTION * free)
            stated = f"default: {DEFAULT_FRACTION:.0%} of {format_bytes(free)} free"
            # torchrun's ranks on one host share its memory (each CUDA rank has its device)
            ranks = _local_ranks()
            if ranks > 1 and not str(device).startswith("cuda"):
                budget //= ranks
                stated += f", shared by {ranks} ranks on this host"
        else:
            budget = parse_size(max_memory)
            stated = f"max_memory={max_memory}"
        return cls(budget=budget, device=str(device), stated=stated, baseline=baseline)

    @property
    def in_use(self) -> int:
        """Planned bytes held now: the baseline plus every item being held."""
        return self.baseline + sum(self.held.values())

    def room(self) -> int:
        """Bytes the budget still leaves for new allocations (can be negative)."""
        return self.budget - self.in_use

    def require(self, what: str, nbytes: int, lower: str) -> None:
        """UsageError on ``max_memory`` unless ``nbytes`` more fit: it says what ``what``
        needs, what the budget leaves, and ``lower`` (the parameters that lower the need)."""
        if nbytes > self.room():
            raise UsageError(
                f"{what} needs {format_bytes(nbytes)} but the memory budget "
                f"({format_bytes(self.budget)}, {self.stated}) leaves "
                f"{format_bytes(max(self.room(), 0))} after {format_bytes(self.in_use)} "
                f"already held; {lower} or raise `max_memory`",
                source="max_memory",
            )

    def count_that_fit(self, per_item: int, reserve: int = 0) -> int:
        """How many allocations of ``per_item`` bytes fit once ``reserve`` bytes are set aside."""
        return max(0, (self.room() - int(reserve)) // max(1, int(per_item)))

    def reserve(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` as held under ``name`` until the run ends or ``name`` is reserved
        again (a later curvature pass replaces the cache of an earlier one)."""
        self.held[name] = int(nbytes)
        self.items[name] = max(self.items.get(name, 0), self.held[name])
        self.planned_peak = max(self.planned_peak, self.in_use)

    def add_to_peak(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` as held under ``name`` from now on, on top of the planned peak
        reached so far (not only of what is held now): memory that grows with the run's
        largest moment, such as the allocator's reuse slack."""
        self.held[name] = int(nbytes)
        self.items[name] = max(self.items.get(name, 0), int(nbytes))
        self.planned_peak = max(self.planned_peak + int(nbytes), self.in_use)

    @contextlib.contextmanager
    def hold(self, name: str, nbytes: int):
        """Count ``nbytes`` as held under ``name`` while the block runs (nested holds add up);
        the item's largest size is kept for the report."""
        nbytes = int(nbytes)
        key = name
        suffix = 2
        while key in self.held:  # the same kind of item held twice at once (nested estimators)
            key, suffix = f"{name} ({suffix})", suffix + 1
        self.held[key] = nbytes
        self.items[name] = max(self.items.get(name, 0), nbytes)
        self.planned_peak = max(self.planned_peak, self.in_use)
        try:
            yield
        finally:
            self.held.pop(key, None)

    def note(self, text: str) -> None:
        """Record a choice the budget forced (a smaller block, a restarted basis)."""
        if text not in self.choices:
            self.choices.append(text)

    def to_dict(self) -> dict:
        """The report's ``timing.memory``: budget, planned peak and items, measured peaks."""
        out = {
            "budget_bytes": int(self.budget),
            "budget": self.stated,
            "baseline_bytes": int(self.baseline),
            "planned_peak_bytes": int(max(self.planned_peak, self.baseline)),
            "planned": {k: int(v) for k, v in self.items.items()},
            "peak_rss_bytes": peak_rss_bytes(),
            "choices": list(self.choices),
        }
        if self.device.startswith("cuda"):
            import torch

            out["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        return out

    def summary(self) -> str:
        """One line for ``--verbose``: planned peak vs measured peak, against the budget."""
        info = self.to_dict()
        measured = info.get("peak_device_bytes", info["peak_rss_bytes"])
        return (
            f"memory: planned peak {format_bytes(info['planned_peak_bytes'])}, measured "
            f"{format_bytes(measured)}, budget {format_bytes(self.budget)} ({self.stated})"
        )


def _local_ranks() -> int:
    """The processes torchrun started on this host (``LOCAL_WORLD_SIZE``; 1 outside it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def allocated_bytes(device: str) -> int:
    """What the process holds now: its resident set on the host, allocated bytes on CUDA."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.memory_allocated(device))
    return rss_bytes()


_PLAN: contextvars.ContextVar[MemoryPlan | None] = contextvars.ContextVar("sharp_memory_plan")


def activate(plan: MemoryPlan) -> MemoryPlan:
    """Make ``plan`` the run's plan (what :func:`current` returns from now on)."""
    _PLAN.set(plan)
    return plan


def current() -> MemoryPlan:
    """The active plan, or a fresh default one (budget from the memory free now, not kept)
    when no run has started one."""
    plan = _PLAN.get(None)
    return plan if plan is not None else MemoryPlan.for_run()


def clear() -> None:
    """End the active plan (a command's run is over; the next one starts its own)."""
    _PLAN.set(None)


def active() -> MemoryPlan | None:
    """The active plan, or None when no run has started one."""
    return _PLAN.get(None)


_ALLOCATION_FAILURE = re.compile(
    r"(can't allocate memory|not enough memory|out of memory|tried to allocate|"
    r"std::bad_alloc|Cannot allocate memory)",
    re.I,
)


def as_usage_error(exc: BaseException) -> UsageError | None:
    """A failed allocation (torch's ``OutOfMemoryError``, its CPU allocator's RuntimeError,
    ``MemoryError``) as a UsageError on ``max_memory``; None for any other exception."""
    text = str(exc)
    is_oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
    if not is_oom and not (isinstance(exc, RuntimeError) and _ALLOCATION_FAILURE.search(text)):
        return None
    wanted = re.search(r"allocate (?:memory: you tried to allocate )?(\d+) bytes", text)
    need = f" ({format_bytes(int(wanted.group(1)))} in one piece)" if wanted else ""
    plan = active()
    budget = f"; budget {format_bytes(plan.budget)} ({plan.stated})" if plan is not None else ""
    return UsageError(
        f"ran out of memory{need}{budget}: lower `batch_size` or `samples`, the model's size, "
        "or `max_memory` so that sharp plans for the memory there is",
        source="max_memory",
    )
