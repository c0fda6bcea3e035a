"""Data-parallel runs under ``torchrun`` (README.md): process group, output rank, failures.

``torchrun --nproc_per_node W -m sharpcli CMD ...`` (or ``python -m torch.distributed.run``)
starts W copies of the command with the environment variables ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. :func:`init_from_environment` (called at
the start of ``sharp``'s ``main``) joins the process group they describe when
``WORLD_SIZE > 1``: backend ``nccl`` for ``--device cuda`` (each rank on ``cuda:LOCAL_RANK``),
``gloo`` otherwise. From there on

- the analysis set is sharded by rank and every sum over data is all-reduced in ONE place,
  :func:`sharpcli.curvature.data.all_reduce_sum`; random probes come from CPU generators
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
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from sharpcli.errors import GateTripped, InputError, NumericalError, SharpError, UsageError

if TYPE_CHECKING:
    import torch

__all__ = [
    "announce_failure",
    "barrier",
    "cleanup",
    "environment_world_size",
    "init_from_environment",
    "is_initialized",
    "is_main_process",
    "raise_if_peer_failed",
    "rank_and_world",
]

STATUS_OK = 0
_ERROR_CLASSES = {
    "usage": UsageError,
    "input": InputError,
    "numerical": NumericalError,
    "gate": GateTripped,
}
_STATE = {"owned": False}  # True when this module created the process group (and so destroys it)


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
    torch.distributed.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=world
    )
    _STATE["owned"] = True
    return True


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if rank_and_world()[1] > 1:
        import torch

        torch.distributed.barrier()


def cleanup() -> None:
    """Wait for every rank, then destroy the process group if :func:`init_from_environment` created it."""
    if _STATE["owned"] and is_initialized():
        import torch

        try:
            torch.distributed.barrier()
        except RuntimeError:  # a peer is gone (crashed): nothing left to wait for
            pass
        torch.distributed.destroy_process_group()
    _STATE["owned"] = False


def _status_device() -> torch.device:
    import torch

    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_status(code: int) -> int:
    import torch

    status = torch.tensor([int(code)], dtype=torch.int64, device=_status_device())
    torch.distributed.all_reduce(status, op=torch.distributed.ReduceOp.MAX)
    return int(status.item())


def _gather_failures(mine: dict | None) -> list[dict]:
    import torch

    world = rank_and_world()[1]
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
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
    if world == 1 or getattr(err, "propagated", False):
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
