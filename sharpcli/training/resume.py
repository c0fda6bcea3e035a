"""Checkpointing and resume of a training run: the files beside the checkpoint and the
resumable state (model, optimizer, every RNG, history) written after every epoch, read back
and checked against the run that continues it."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pandas as pd
import torch

from sharpcli import ledger
from sharpcli.atomic import publication, write_atomic, write_text_atomic
from sharpcli.bounded import loads_json, read_data_file
from sharpcli.errors import InputError, UsageError
from sharpcli.losses import LOSSES
from sharpcli.training.config import ADDED_SETTINGS, TrainConfig
from sharpcli.training.epochs import Run

__all__ = [
    "STATE_VERSION",
    "state_path_for",
    "history_csv_path_for",
    "tracked_csv_path_for",
    "declare_outputs",
    "write_history_csv",
    "restore_state",
    "save_state",
]

STATE_VERSION = 1


def state_path_for(out: str | Path) -> Path:
    """The resumable state file beside checkpoint ``out`` (``out`` + ``.state.pt``)."""
    out = Path(out)
    return out.with_name(out.name + ".state.pt")


def history_csv_path_for(out: str | Path) -> Path:
    """The history CSV beside checkpoint ``out`` (its stem + ``.history.csv``)."""
    out = Path(out)
    return out.with_name(out.stem + ".history.csv")


def tracked_csv_path_for(out: str | Path) -> Path:
    """The CSV of the tracked rows beside checkpoint ``out`` (its stem + ``.tracked.csv``):
    one row per tracked step, written when curvature is tracked."""
    out = Path(out)
    return out.with_name(out.stem + ".tracked.csv")


def declare_outputs(out: str | Path) -> Path:
    """Declare (:mod:`sharpcli.ledger`) every file a run writes, before any work: the
    checkpoint ``out``, its history CSV and its resumable state beside it. UsageError naming the
    first one that cannot be written (a folder, a missing folder) or that the run also reads."""
    out = ledger.declare_output(out, "out")
    ledger.declare_output(history_csv_path_for(out), "out", role="the history CSV beside `out`")
    ledger.declare_output(state_path_for(out), "out", role="the resumable state beside `out`")
    ledger.declare_output(
        tracked_csv_path_for(out), "out", role="the tracked curvature's CSV beside `out`"
    )
    return out


def write_history_csv(path: Path, history: list) -> None:
    """Write the history rows as a CSV (nested keys dotted), atomically."""
    flat = pd.json_normalize(history, sep=".")
    write_text_atomic(path, flat.to_csv(index=False))


def restore_state(run: Run, state_file: Path) -> None:
    """Continue ``run`` from its resumable state: weights, optimizer, every RNG and the history.

    InputError naming the state file when it is missing, unreadable or not a state of this
    tool (:func:`_read_state`); UsageError (``--resume``) when it was written by a run with
    other settings (:func:`_check_same_identity`: only more epochs are allowed).
    """
    state = _read_state(state_file)
    _check_same_identity(run.cfg, state)
    try:
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng_global"])
        run.shuffle_gen.set_state(state["rng_shuffle"])
        run.step_gen.set_state(state["rng_step"])
        run.aug_gen.set_state(state["rng_aug"])
        run.amp.load_state_dict(state.get("precision") or {})
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise InputError(
            f"resumable state does not fit this run ({type(exc).__name__})", source=str(state_file)
        ) from None
    run.history = state["history"]
    run.tracked = _tracked_rows(state, state_file)
    device = next(run.model.parameters()).device
    warm = state.get("warm") or {}
    run.warm = {
        k: v.to(device) for k, v in warm.items() if isinstance(k, str) and torch.is_tensor(v)
    }
    run.start_epoch = state["epoch"]


def _tracked_rows(state: dict, state_file: Path) -> list:
    """The per-step tracked rows of a state (absent in older states: none)."""
    text = state.get("tracked")
    if text is None:
        return []
    try:
        rows = loads_json(text) if isinstance(text, str) else None
    except ValueError:
        rows = None
    if not isinstance(rows, list):
        raise InputError(
            "is not a resumable state of sharp train (its tracked rows are not a JSON list)",
            source=str(state_file),
        )
    return rows


_STATE_FIELDS = {
    "version": int,
    "epoch": int,
    "config": str,
    "model": dict,
    "optimizer": dict,
    "rng_global": torch.Tensor,
    "rng_shuffle": torch.Tensor,
    "rng_step": torch.Tensor,
    "rng_aug": torch.Tensor,
    "history": str,
}


def _read_state(state_file: Path) -> dict:
    """The resumable state in ``state_file``, its structure checked (what :func:`save_state`
    writes) and its ``config`` and ``history`` parsed. A missing, unreadable or foreign file
    (a regular file read up to its size, ``weights_only``) is an InputError naming it."""
    if not state_file.exists():
        raise InputError(
            "no resumable state for this output; run without `resume` first",
            source=str(state_file),
        )
    content = read_data_file(state_file)
    try:
        state = torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"resumable state is unreadable ({first})", source=str(state_file)
        ) from exc
    problem = _state_problem(state)
    if problem is None:
        try:
            state = dict(
                state, config=loads_json(state["config"]), history=loads_json(state["history"])
            )
        except ValueError:  # not JSON, or nested too deeply
            problem = "its config or history is not JSON"
    if problem is None and not (
        isinstance(state["config"], dict) and isinstance(state["history"], list)
    ):
        problem = "its config is not an object or its history not a list"
    if problem is not None:
        raise InputError(
            f"is not a resumable state of sharp train ({problem})", source=str(state_file)
        )
    return state


def _state_problem(state) -> str | None:
    """What is wrong with the structure of a loaded state (None when it has every field)."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict"
    missing = [key for key in _STATE_FIELDS if key not in state]
    if missing:
        return f"missing {', '.join(missing)}"
    wrong = [
        key
        for key, kind in _STATE_FIELDS.items()
        if not isinstance(state[key], kind) or (kind is int and isinstance(state[key], bool))
    ]
    if wrong:
        return f"{', '.join(wrong)} of the wrong type"
    if state["version"] != STATE_VERSION:
        return f"version {state['version']}, this sharp writes {STATE_VERSION}"
    if state["epoch"] < 0:
        return "a negative epoch"
    return None


def _check_same_identity(cfg: TrainConfig, state: dict) -> None:
    """UsageError (``--resume``) unless the saved run is this run with at most more epochs.

    What may change on resume is ``--epochs``, upwards only, and only under a constant
    learning rate (a cosine schedule spreads over the epochs, so the epochs done would have
    had other rates) and before the ``--noise-finetune`` epoch, which is the last; every other
    setting must be the saved run's (the message names each one that differs, by option).
    """
    saved = dict(state["config"])
    saved_epochs = saved.pop("epochs", None)
    identity = json.loads(json.dumps(cfg.identity()))
    if "token_reduction" not in saved:  # saved before the option: token losses per sample
        saved["token_reduction"] = "samples" if _per_token(saved) else identity["token_reduction"]
    # saved before the options: no autocast, and the only ascent sync then allowed (one process)
    saved.setdefault("precision", "fp32")
    saved.setdefault("ascent_sync", "per-replica")
    for key, value in ADDED_SETTINGS.items():  # saved before these options: run without them
        saved.setdefault(key, value)
    if saved != identity:
        diff = sorted(
            f"`{k}`" for k in set(saved) | set(identity) if saved.get(k) != identity.get(k)
        )
        raise UsageError(
            f"the saved run used other settings ({', '.join(diff)}); resume with the same options "
            "(only `epochs` may grow)",
            source="resume",
        )
    if cfg.epochs != saved_epochs:
        _check_more_epochs(cfg, saved_epochs, state["epoch"])


def _per_token(config: dict) -> bool:
    """Whether a saved configuration's loss is a token loss (one label per position)."""

    loss = config.get("loss")
    return isinstance(loss, str) and loss in LOSSES and LOSSES.get(loss).per_token


def _check_more_epochs(cfg: TrainConfig, saved_epochs, done: int) -> None:
    """UsageError (``--epochs``) unless resuming with ``cfg.epochs`` continues the saved run."""
    if not isinstance(saved_epochs, int) or cfg.epochs < saved_epochs:
        raise UsageError(
            f"the saved run was for {saved_epochs} epochs and completed {done}; `resume` "
            f"continues it, so `epochs` must be at least {saved_epochs}, got {cfg.epochs}",
            source="epochs",
        )
    if cfg.schedule != "constant":
        raise UsageError(
            f"the saved run was for {saved_epochs} epochs under the {cfg.schedule} schedule, whose "
            f"rates depend on the epoch count; resume with `epochs={saved_epochs}`",
            source="epochs",
        )
    if cfg.noise_finetune > 0 and done > saved_epochs:
        raise UsageError(
            f"the saved run already ran its `noise_finetune` epoch after {saved_epochs} epochs; "
            f"resume with `epochs={saved_epochs}`",
            source="epochs",
        )


def save_state(path: Path, run: Run, epoch: int, *, last: bool = False) -> None:
    """Write the resumable state after ``epoch`` completed epochs (atomically).

    It is published at once, so that an interrupted run resumes from its last epoch, except
    after the ``last`` epoch: that state joins the publication in effect (the command's, with
    the checkpoint and history), so a run that fails at the end leaves the state before it."""
    state = {
        "version": STATE_VERSION,
        "epoch": epoch,
        "config": json.dumps(run.cfg.to_dict(), sort_keys=True),
        "model": copy.deepcopy(run.model.state_dict()),
        "optimizer": run.optimizer.state_dict(),
        "rng_global": torch.get_rng_state(),
        "rng_shuffle": run.shuffle_gen.get_state(),
        "rng_step": run.step_gen.get_state(),
        "rng_aug": run.aug_gen.get_state(),
        "history": json.dumps(run.history),
        "tracked": json.dumps(run.tracked),  # the tracked rows; absent in older states
        # the tracked quantities' warm starts (tensors only); absent in older states
        "warm": {k: v.detach().cpu() for k, v in run.warm.items() if torch.is_tensor(v)},
        "precision": run.amp.state_dict(),  # the fp16 loss scale; absent in older states
    }
    with publication(own=not last):
        write_atomic(path, lambda fh: torch.save(state, fh))
