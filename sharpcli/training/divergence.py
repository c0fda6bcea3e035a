"""When a training run has diverged: the rule ``train`` applies to its history after every epoch.

A run that collapses (the objective blows up for a few steps and the weights land where the
loss is many times larger) still ends with a finite loss, so nothing else stops it (a
regularizer such as ``fa`` at too large a strength can do this). An epoch has diverged when
either

- its mean training loss exceeds :data:`LOSS_FACTOR` times the best (lowest) epoch before it
  and also the first epoch's (so a net trained to a tiny loss that wobbles is not flagged), or
- its training accuracy is back at chance, ``1/C + 0.1 (1 - 1/C)`` or lower for ``C``
  classes, after an earlier epoch reached ``1/C + 0.5 (1 - 1/C)`` (classification only).
"""

from __future__ import annotations

LOSS_FACTOR = 4.0
CHANCE_MARGIN = 0.1  # "at chance": within this fraction of the way from chance to perfect
LEARNED_MARGIN = 0.5  # "having been above": at least this fraction of the way


def divergence(history: list[dict], num_classes: int | None = None) -> dict | None:
    """The first diverged epoch of ``history`` (rows with ``epoch``, ``train_loss`` and
    ``train_accuracy``), as ``{"epoch", "best_epoch", "train_loss", "best_train_loss",
    "reason"}``, or None. ``num_classes`` (None or < 2: no accuracy rule) sets chance at
    ``1 / num_classes``. See the module docstring for the rule."""
    if not history:
        return None
    first_loss = history[0]["train_loss"]
    best = history[0]
    chance = 1.0 / num_classes if num_classes is not None and num_classes >= 2 else None
    best_accuracy = history[0].get("train_accuracy")
    for row in history[1:]:
        loss, accuracy = row["train_loss"], row.get("train_accuracy")
        if loss > LOSS_FACTOR * best["train_loss"] and loss > first_loss:
            return _record(
                row,
                best,
                f"training loss {loss:.4g} at epoch {row['epoch']} is more than "
                f"{LOSS_FACTOR:g} times its best, {best['train_loss']:.4g} at epoch "
                f"{best['epoch']}",
            )
        if chance is not None and accuracy is not None and best_accuracy is not None:
            learned = chance + LEARNED_MARGIN * (1 - chance)
            at_chance = chance + CHANCE_MARGIN * (1 - chance)
            if best_accuracy >= learned and accuracy <= at_chance:
                return _record(
                    row,
                    best,
                    f"training accuracy {accuracy:.3g} at epoch {row['epoch']} is back at "
                    f"chance ({chance:.3g} for {num_classes} classes) after reaching "
                    f"{best_accuracy:.3g}",
                )
        if accuracy is not None:
            best_accuracy = accuracy if best_accuracy is None else max(best_accuracy, accuracy)
        if loss < best["train_loss"]:
            best = row
    return None


def _record(row: dict, best: dict, reason: str) -> dict:
    return {
        "epoch": row["epoch"],
        "best_epoch": best["epoch"],
        "train_loss": row["train_loss"],
        "best_train_loss": best["train_loss"],
        "reason": reason,
    }
