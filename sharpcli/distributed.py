"""Data-parallel runs under ``torchrun`` (README.md): process group, output rank, failures.

``torchrun --nproc_per_node W -m sharpcli CMD ...`` (or ``python -m torch.distributed.run``)
starts W copies of the command with the environment variables ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. :func:`init_from_environment` (called at
the start of ``sharp``'s ``main``) joins the process group they describe when
``WORLD_SIZE > 1``: backend ``nccl`` for ``--device cuda`` (each rank on ``cuda:LOCAL_RANK``),
``gloo`` otherwise. From there on

- the analysis set is sharded by rank and every sum over data is all-reduced in ONE place,
  :func:`sharpcli.curvature.products.data.all_reduce_sum`; random probes come from CPU generators
  seeded identically on every rank, so every rank holds the same result;
- only rank 0 (:func:`is_main_process`) prints, writes JSON, tables and files;
- a failure on any rank reaches every rank (:func:`announce_failure` /
  :func:`raise_if_peer_failed`), so all ranks exit with the same code and rank 0 prints the
  failing rank's one-line message (naming that rank), instead of the others waiting forever
  in their next collective.

Failure protocol. Every collective of a command is preceded by a one-element ``MAX``
all-reduce of a status code: 0 from a rank that is fine, the exit code from a rank that
failed (sent by :func:`announce_failure` from the CLI's error handler). When the reduced code
is non-zero every rank then gathers the failure descriptions (``all_gather_object``) and the
healthy ranks raise the lowest failing rank's error. The command's final step on success
(:func:`raise_if_peer_failed` in ``run_command``) is such a status exchange too, so a failure
after the last data reduction is also seen by everyone. This relies on every rank running
the same sequence of collectives, which holds because all of them go through
``all_reduce_sum``.

Under torchrun the launcher itself exits with 1 when any rank exits non-zero (its summary
lists each rank's exit code); run with ``WORLD_SIZE`` ranks started by other means (e.g.
``torch.multiprocessing``) to see the ranks' own codes.

A rank that stops answering. The protocol above needs every rank to reach its collectives; a
rank that is stopped (SIGSTOP, a debugger, swapped out) or killed without torchrun would leave
the others blocked for gloo's default 30 minutes, then fail with a library traceback (exit 4).
So the process group is created with a timeout (:data:`TIMEOUT_ENV`, default
:data:`DEFAULT_TIMEOUT` seconds), every collective runs through :func:`collective`, and a
collective that times out or loses its peer raises :class:`PeerFailure` (exit 3) naming the
rank that did not arrive. Which rank that is comes from progress marks: before each
collective a rank writes its count of collectives to the process group's store
(``sharp/step/<rank>``); the ranks whose count is behind are the ones missing (with two ranks,
the other one), and when the store itself does not answer it is rank 0, which hosts it
(outside torchrun's agent store). After such a failure the group is broken: no further
collective is attempted (no status exchange, no final barrier), and the lowest rank that is
not to blame prints the message.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import threading
from typing import TYPE_CHECKING

from sharpcli.errors import (
    EXIT_NUMERICAL,
    GateTripped,
    InputError,
    NumericalError,
    SharpError,
    UsageError,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "PeerFailure",
    "announce_failure",
    "barrier",
    "cleanup",
    "collective",
    "environment_world_size",
    "init_from_environment",
    "is_initialized",
    "is_main_process",
    "raise_if_peer_failed",
    "rank_and_world",
    "timeout_seconds",
]

TIMEOUT_ENV = "SHARP_DIST_TIMEOUT"
"""Environment variable: seconds a collective waits for every rank before the run fails."""
DEFAULT_TIMEOUT = 600.0

STATUS_OK = 0
_ERROR_CLASSES = {
    "usage": UsageError,
    "input": InputError,
    "numerical": NumericalError,
    "gate": GateTripped,
}
# owned: this module created the process group (and so destroys it); broken: a collective timed
# out or lost a peer (no further collective is attempted); step: collectives this rank entered
_STATE = {"owned": False, "broken": False, "step": 0}


class PeerFailure(SharpError):
    """Another rank stopped answering (stalled past the timeout, or gone): exit 3.

    ``culprits`` are the ranks that did not arrive (empty when they cannot be told);
    ``report_here`` tells whether this rank prints the message (the lowest rank not to blame).
    """

    exit_code = EXIT_NUMERICAL
    kind = "error"
    propagated = True  # never announced to the other ranks: the group is broken

    def __init__(self, message: str, *, culprits: list[int], report_here: bool, **details):
        source = f"rank {culprits[0]}" if culprits else "torch.distributed"
        super().__init__(message, source=source, **details)
        self.culprits = culprits
        self.report_here = report_here


def is_initialized() -> bool:
    """Whether a ``torch.distributed`` process group is running in this process."""
    torch = sys.modules.get("torch")  # torch not imported yet (``sharp --help``): no group
    if torch is None:
        return False
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the running process group, ``(0, 1)`` without one."""
    if is_initialized():
        import torch

        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """True on rank 0 (and in a single process): the only rank that prints and writes."""
    return rank_and_world()[0] == 0


def _env_int(name: str, default: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None:
        if default is None:
            raise UsageError(
                f"torchrun variable {name} is not set (WORLD_SIZE > 1 needs RANK, LOCAL_RANK, "
                "MASTER_ADDR and MASTER_PORT)",
                source=name,
            )
        return default
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"must be an integer, got {text!r}", source=name) from None
    if value < 0:
        raise UsageError(f"must be >= 0, got {value}", source=name)
    return value


def timeout_seconds() -> float:
    """Seconds a collective waits for the other ranks: ``SHARP_DIST_TIMEOUT``, default 600.

    A positive number (fractions allowed); anything else is a UsageError naming the variable.
    """
    text = os.environ.get(TIMEOUT_ENV)
    if text is None or not text.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise UsageError(
            f"must be a number of seconds, got {text[:40]!r}", source=TIMEOUT_ENV
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(
            f"must be a positive number of seconds, got {text[:40]!r}", source=TIMEOUT_ENV
        )
    return value


def environment_world_size() -> int:
    """``WORLD_SIZE`` from the environment (1 when unset): how many ranks torchrun started."""
    return max(1, _env_int("WORLD_SIZE", 1))


def _requested_device(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return "cpu"


def init_from_environment(argv: list[str] | None = None) -> bool:
    """Join the process group torchrun describes when ``WORLD_SIZE > 1``; return whether one runs.

    Backend: ``nccl`` when ``--device`` in ``argv`` names CUDA (the rank's device is set to
    ``cuda:LOCAL_RANK``, so ``--device cuda`` means "this rank's GPU"; an explicit index is
    refused because every rank would share it), ``gloo`` otherwise. Rendezvous through the
    ``env://`` variables ``MASTER_ADDR``/``MASTER_PORT``. Idempotent: an already running
    group (e.g. started by a test harness) is kept and not destroyed by :func:`cleanup`.
    Raises :class:`UsageError` for missing or inconsistent variables.
    """
    if is_initialized():
        return True
    world = environment_world_size()
    if world == 1:
        return False
    import torch

    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", rank)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UsageError(f"torchrun variable {name} is not set", source=name)
    if rank >= world:
        raise UsageError(f"RANK {rank} is not below WORLD_SIZE {world}", source="RANK")
    device = _requested_device(list(argv or []))
    backend = "gloo"
    if device.startswith("cuda"):
        if ":" in device:
            raise UsageError(
                "under torchrun use `device=cuda`: each rank takes cuda:LOCAL_RANK",
                source="device",
            )
        if torch.cuda.is_available() and torch.distributed.is_nccl_available():
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            backend = "nccl"
    _join(backend, rank, world, local_rank)
    _STATE.update(owned=True, broken=False, step=0)
    return True


def _join(backend: str, rank: int, world: int, local_rank: int) -> None:
    """``init_process_group`` through ``env://``, given at most :func:`timeout_seconds`.

    The rendezvous runs in a daemon thread: torch's store client, connected to a port whose
    holder accepts and never answers (rank 0 stopped, or a foreign server on a reused
    ``MASTER_PORT``), waits for the handshake's answer without a timeout. Torch's own errors
    (a peer that never comes, a port in use) are raised as they are.

    Raises:
        UsageError: the join did not end within the timeout (naming the master's address and
            :data:`TIMEOUT_ENV`).
    """
    import torch

    seconds = timeout_seconds()
    outcome: dict[str, BaseException | None] = {}

    def rendezvous() -> None:
        try:
            if backend == "nccl":  # the current device is per thread
                torch.cuda.set_device(local_rank % torch.cuda.device_count())
            torch.distributed.init_process_group(
                backend=backend,
                init_method="env://",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=seconds),
            )
            outcome["error"] = None
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    joining = threading.Thread(target=rendezvous, name="sharp-join", daemon=True)
    joining.start()
    joining.join(seconds)
    if "error" not in outcome:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise UsageError(
            f"rank {rank} of {world} could not join the process group at {address} within "
            f"{seconds:g} s (nothing answered there: start every rank, e.g. with torchrun, "
            f"or pick a free MASTER_PORT; {TIMEOUT_ENV} sets the wait)",
            source="MASTER_PORT",
        )
    error = outcome["error"]
    if error is not None:
        raise error


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if rank_and_world()[1] > 1:
        import torch

        collective(torch.distributed.barrier)


def cleanup() -> None:
    """Wait for every rank, then destroy the process group if :func:`init_from_environment`
    created it (without waiting when the group is broken: a peer stalled or is gone)."""
    if _STATE["owned"] and is_initialized():
        import torch

        if not _STATE["broken"]:
            try:
                torch.distributed.barrier()
            except RuntimeError:  # a peer is gone (crashed): nothing left to wait for
                pass
        torch.distributed.destroy_process_group()
    _STATE.update(owned=False, broken=False, step=0)


def collective(function, /, *args, **kwargs):
    """Run one collective ``function(*args, **kwargs)`` of the process group (module docstring).

    Marks this rank's progress in the store first; a collective (or store access) that times
    out or finds a peer gone raises :class:`PeerFailure` naming the rank that did not arrive,
    instead of a library ``RuntimeError``.
    """
    if _STATE["broken"]:
        raise PeerFailure(
            "the process group is broken by an earlier failure", culprits=[], report_here=False
        )
    _STATE["step"] += 1
    try:
        _mark_progress(_STATE["step"])
        return function(*args, **kwargs)
    except RuntimeError as exc:  # torch.distributed.DistError and gloo/NCCL errors
        raise _peer_failure(exc) from None


def _store():
    """The default process group's store, or None (a private torch accessor, guarded)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def _mark_progress(step: int) -> None:
    store = _store()
    if store is not None:
        store.set(f"sharp/step/{rank_and_world()[0]}", str(step))


def _store_host() -> int | None:
    """The rank whose process hosts the store: rank 0, except under torchrun's agent store."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def _missing_ranks(rank: int, world: int) -> list[int]:
    """The ranks that did not reach this rank's current collective (module docstring).

    The store is read in a daemon thread given ``min(10 s, timeout)``: a store whose host is
    stopped never answers (its client waits for an acknowledgement without a timeout), and
    then that host is the rank missing.
    """
    others = [q for q in range(world) if q != rank]
    fallback = others if world == 2 else []
    store = _store()
    if store is None:
        return fallback
    steps: dict[int, int] = {}
    reader = threading.Thread(target=_read_marks, args=(store, rank, others, steps), daemon=True)
    reader.start()
    reader.join(min(10.0, timeout_seconds()))
    if rank not in steps:  # the store did not answer: its host is the one missing
        host = _store_host()
        return [host] if host is not None and host != rank else fallback
    behind = [q for q in others if steps.get(q, 0) < _STATE["step"]]
    return behind or fallback


def _read_marks(store, rank: int, others: list[int], steps: dict) -> None:
    """Fill ``steps`` with each rank's mark (``rank`` itself last: the store answered)."""
    try:
        found = {q: store.check([f"sharp/step/{q}"]) for q in [rank, *others]}
        for q in others:
            steps[q] = int(store.get(f"sharp/step/{q}")) if found[q] else 0
        steps[rank] = _STATE["step"]
    except (RuntimeError, ValueError):
        pass


def _peer_failure(exc: BaseException) -> PeerFailure:
    """The :class:`PeerFailure` for a collective that failed with ``exc``; the group is broken."""
    _STATE["broken"] = True
    rank, world = rank_and_world()
    timeout = timeout_seconds()
    text = str(exc).lower()
    stalled = "timed out" in text or "timeout" in text
    culprits = _missing_ranks(rank, world)
    who = ", ".join(str(q) for q in culprits)
    named = (
        f"rank{'s' if len(culprits) > 1 else ''} {who} of {world}" if culprits else "a peer rank"
    )
    what = (
        f"did not reach a collective within {timeout:g} s (stalled; {TIMEOUT_ENV} sets the wait)"
        if stalled
        else "is gone (its connection closed: the process crashed or was killed)"
    )
    healthy = [q for q in range(world) if q not in culprits]
    return PeerFailure(
        f"{named} {what}; rank {rank} stopped waiting",
        culprits=culprits,
        report_here=bool(healthy) and rank == healthy[0],
        rank=culprits[0] if culprits else None,
    )


def _status_device() -> "torch.device":
    import torch

    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_status(code: int) -> int:
    import torch

    status = torch.tensor([int(code)], dtype=torch.int64, device=_status_device())
    collective(torch.distributed.all_reduce, status, op=torch.distributed.ReduceOp.MAX)
    return int(status.item())


def _gather_failures(mine: dict | None) -> list[dict]:
    import torch

    world = rank_and_world()[1]
    gathered: list = [None] * world
    collective(torch.distributed.all_gather_object, gathered, mine)
    return [g for g in gathered if g is not None]


def _error_from(failure: dict) -> SharpError:
    cls = _ERROR_CLASSES.get(failure["kind"], SharpError)
    rank, world = failure["rank"], failure["world_size"]
    err = cls(
        f"{failure['message']} [on rank {rank} of {world}; batches counted within its shard]",
        source=failure["source"],
        rank=rank,
    )
    err.exit_code = failure["exit_code"]
    err.propagated = True
    return err


def raise_if_peer_failed() -> None:
    """Collective status check: raise the failing rank's error if any rank announced a failure.

    Call on every rank at the same point (before each data reduction and once at the end of
    a command). No-op in a single process.
    """
    rank, world = rank_and_world()
    if world == 1:
        return
    if _exchange_status(STATUS_OK) != STATUS_OK:
        failures = _gather_failures(None)
        raise _error_from(min(failures, key=lambda f: f["rank"]))


def announce_failure(err: SharpError) -> SharpError:
    """Tell every rank that this one failed with ``err``; return the error to report.

    Matches the status exchange the other ranks are waiting in (before their next reduction,
    or at the end of their command). Returns the error of the lowest failing rank, so every
    rank reports the same one. An error that came from a peer (already propagated) or a single
    process returns ``err`` unchanged without any communication.
    """
    rank, world = rank_and_world()
    if world == 1 or getattr(err, "propagated", False) or _STATE["broken"]:
        return err
    payload = {
        "kind": err.kind,
        "message": err.message,
        "source": err.source,
        "exit_code": int(err.exit_code),
        "rank": rank,
        "world_size": world,
    }
    _exchange_status(max(1, int(err.exit_code)))
    failures = _gather_failures(payload)
    first = min(failures, key=lambda f: f["rank"])
    return _error_from(first)
