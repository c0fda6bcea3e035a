"""The epochs of a training run: the run's shared state, one epoch of seeded shuffling,
augmentation and regularised optimizer steps, its history row, and evaluation."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from sharpcli import catalogue, progress
from sharpcli.catalogue.values import TRAIN
from sharpcli.errors import NumericalError
from sharpcli.io.data.dataset import Dataset
from sharpcli.losses import IGNORE_INDEX, get_loss, token_reduction
from sharpcli.regularizers.step import training_step
from sharpcli.training.config import TrainConfig, batch_size_for, parse_optimizer
from sharpcli.training.data_parallel import data_parallel_step
from sharpcli.training.precision import MixedPrecision

__all__ = [
    "Splits",
    "Run",
    "start_run",
    "train_epoch",
    "evaluate",
    "accuracy",
    "apply_label_noise",
    "augment_images",
    "tracking_subset",
]


def apply_label_noise(
    y: torch.Tensor, fraction: float, num_classes: int, seed: int
) -> torch.Tensor:
    """Replace a seeded ``fraction`` of labels by a uniformly drawn *different* class (AD Fig. 3).

    Per-position labels ``(N, T)`` are noised per labelled position: ``round(fraction * M)``
    of the ``M`` positions not marked ``-100`` (the ignored positions stay ``-100``). One label
    per sample ``(N,)`` is the case ``M = N`` (the same draws as ever).
    """
    if fraction <= 0:
        return y
    g = torch.Generator().manual_seed(seed + 7919)
    flat = y.reshape(-1).clone()
    labelled = (flat != IGNORE_INDEX).nonzero().squeeze(1) if y.ndim > 1 else None
    m = flat.numel() if labelled is None else labelled.numel()
    idx = torch.randperm(m, generator=g)[: int(round(fraction * m))]
    if labelled is not None:
        idx = labelled[idx]
    shift = torch.randint(1, num_classes, (idx.numel(),), generator=g)
    flat[idx] = (flat[idx] + shift) % num_classes
    return flat.view(y.shape)


def augment_images(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random crop with zero padding 4 and random horizontal flip, per sample, in torch ops."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    dy = torch.randint(0, 9, (n,), generator=generator)
    dx = torch.randint(0, 9, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    rows = dy[:, None] + torch.arange(h)[None, :]  # (n, h)
    cols = dx[:, None] + torch.arange(w)[None, :]  # (n, w)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(n)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # (n, h, w, c)
    return out.permute(0, 3, 1, 2).contiguous()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_name: str,
    batch_size: int = 1024,
    *,
    reduction: str | None = None,
) -> dict:
    """Mean loss per sample and accuracy over (x, y) in eval mode.

    Accuracy is the loss's own (:attr:`sharpcli.losses.Loss.correct`): correct predictions over
    the predictions it counts (samples; labelled positions for token cross-entropy); None where
    the loss defines none (regression) or counts no prediction.

    Args:
        model: The model.
        x: Inputs.
        y: Labels.
        loss_name: A registered loss.
        batch_size: Samples per forward pass.
        reduction: Token cross-entropy's averaging over this set
            (:func:`sharpcli.losses.token_reduction`): ``"tokens"`` gives the mean over all of
            its labelled tokens, ``"samples"`` the mean of per-sample means; None keeps the
            averaging in force.

    Returns:
        ``{"loss": ..., "accuracy": ...}``.
    """
    loss = get_loss(loss_name)
    if reduction is not None and loss.per_token:
        with token_reduction(reduction, y):
            return evaluate(model, x, y, loss_name, batch_size)
    was_training = model.training
    model.eval()
    total, correct, counted, n = 0.0, 0, 0, x.shape[0]
    for start in range(0, n, batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        z = model(xb)
        total += float(loss.mean(z, yb)) * xb.shape[0]
        if loss.correct is not None:
            right, count = loss.correct(z, yb)
            correct, counted = correct + int(right), counted + int(count)
    model.train(was_training)
    return {"loss": total / max(n, 1), "accuracy": accuracy(loss_name, correct, counted)}


def accuracy(loss_name: str, correct: int, counted: int) -> float | None:
    """``correct / counted`` for a loss with an accuracy that counted predictions, else None."""
    if get_loss(loss_name).correct is None or counted == 0:
        return None
    return correct / counted


def _lr_at(cfg: TrainConfig, epoch: int, step: int | None = None) -> float:
    """The learning rate of the optimizer step ``step`` (0-based, counted over the run) in
    the 0-based ``epoch``.

    The schedule: ``constant`` is ``lr``; ``cosine`` is ``lr (1 + cos(pi t)) / 2`` with
    ``t`` the fraction of the run done, per step ``step / steps`` in a run counted in steps
    (``cfg.steps``), per epoch ``epoch / epochs`` otherwise (as it always was). A warm-up of
    ``cfg.warmup`` steps multiplies it by ``min(1, (step + 1) / warmup)`` (linear, the first
    step at ``lr / warmup``). ``step`` None: the epoch's rate without warm-up.
    """
    rate = cfg.lr
    if cfg.schedule == "cosine":
        if cfg.steps is not None and step is not None:
            done = min(step, cfg.steps - 1) / cfg.steps
        else:
            done = min(epoch, cfg.epochs - 1) / cfg.epochs
        rate = cfg.lr * 0.5 * (1.0 + math.cos(math.pi * done))
    if cfg.warmup > 0 and step is not None:
        rate *= min(1.0, (step + 1) / cfg.warmup)
    return rate


def _make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The torch optimizer of ``cfg.optimizer`` (``NAME[:k=v,...]``,
    :func:`~sharpcli.training.config.parse_optimizer`) at ``cfg.lr``: SGD with
    ``cfg.momentum`` (and ``nesterov``), Adam, AdamW (decoupled weight decay) and RMSprop
    with the hyper-parameters the spec gives, torch's defaults for the others."""
    params = [p for p in model.parameters() if p.requires_grad]
    name, given = parse_optimizer(cfg.optimizer)
    class_name, _ = catalogue.OPTIMIZER_DECLARATIONS[name]
    kwargs: dict = {"lr": cfg.lr}
    if name == "sgd":
        kwargs["momentum"] = cfg.momentum
        kwargs["nesterov"] = bool(given.pop("nesterov", 0))
    if "beta1" in given or "beta2" in given:
        kwargs["betas"] = (given.pop("beta1", 0.9), given.pop("beta2", 0.999))
    kwargs.update(given)
    return getattr(torch.optim, class_name)(params, **kwargs)


@dataclass
class Splits:
    """The training data: the dataset, its train (and test) tensors, and what was done to them.

    :func:`sharpcli.training.loop._load_splits` fills it on the CPU as the dataset gives it (labels noised);
    :func:`sharpcli.training.loop._place_splits` converts the tensors in place to the model's dtype and device.
    """

    dataset: Dataset
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor | None
    y_test: torch.Tensor | None
    num_outputs: int
    notes: list = field(default_factory=list)

    def test_split(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(x_test, y_test)``, or None without a test split (evaluated after every epoch)."""
        if self.x_test is None or self.y_test is None:
            return None
        return self.x_test, self.y_test


@dataclass
class Run:
    """What the epochs of one run share and what its resumable state saves.

    ``shuffle_gen`` orders the samples of each epoch, ``step_gen`` drives the regularizers'
    random draws (on the model's device), ``aug_gen`` the augmentation and input noise; the
    global torch RNG is left to dropout. ``amp`` is the run's precision (autocast, the fp16
    loss scale, skipped steps). ``history`` holds one row per completed epoch.
    """

    cfg: TrainConfig
    regs: list
    splits: Splits
    model: nn.Module
    optimizer: torch.optim.Optimizer
    shuffle_gen: torch.Generator
    step_gen: torch.Generator
    aug_gen: torch.Generator
    amp: MixedPrecision
    rank: int = 0
    world: int = 1
    history: list = field(default_factory=list)
    start_epoch: int = 0
    # the tracked rows (``results.tracked``), each with its step, and the tracked quantities'
    # warm starts (StepContext.warm: the previous top eigenvector), saved with the state so
    # that a resumed run measures what the uninterrupted one did
    tracked: list = field(default_factory=list)
    warm: dict = field(default_factory=dict)


def start_run(
    cfg: TrainConfig,
    regs: list,
    splits: Splits,
    model: nn.Module,
    device: torch.device,
    rank_world: tuple[int, int],
) -> Run:
    """A fresh run: the optimizer and the random streams seeded from ``cfg.seed`` (+1, +2, +3)."""
    rank, world = rank_world
    return Run(
        cfg=cfg,
        regs=regs,
        splits=splits,
        model=model,
        optimizer=_make_optimizer(cfg, model),
        shuffle_gen=torch.Generator().manual_seed(cfg.seed + 1),
        step_gen=torch.Generator(device=device).manual_seed(cfg.seed + 2),
        aug_gen=torch.Generator().manual_seed(cfg.seed + 3),
        amp=MixedPrecision(cfg.precision, device, next(model.parameters()).dtype),
        rank=rank,
        world=world,
    )


def tracking_subset(
    cfg: TrainConfig, splits: Splits, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed seeded subset of ``cfg.track_samples`` training samples the tracker sees."""
    n = splits.x_train.shape[0]
    track_idx = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + 5))[
        : cfg.track_samples
    ]
    return splits.x_train[track_idx.to(device)], splits.y_train[track_idx.to(device)]


class _EpochSums:
    """Running sums over an epoch's optimizer steps, weighted by each step's batch size."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.objective = 0.0
        self.correct = 0
        self.counted = 0
        self.count = 0
        self.grad_evals = 0
        self.skipped = 0
        self.penalties: dict = {}

    def add(self, stats) -> None:
        """Add one step's :class:`~sharpcli.regularizers.registry.StepStats`."""
        b = stats.count
        self.loss += stats.loss * b
        self.objective += stats.objective * b
        self.correct += stats.correct
        self.counted += stats.counted
        self.count += b
        self.grad_evals += stats.grad_evals
        for k, v in stats.penalties.items():
            self.penalties[k] = self.penalties.get(k, 0.0) + v * b


# after_step(step, xb, yb): called after each optimizer step (counted from 1 over the run)
AfterStep = Callable[[int, torch.Tensor, torch.Tensor], None]


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_epoch(
    run: Run,
    epoch: int,
    meter: progress.Run,
    position: tuple[int, int],
    after_step: AfterStep | None = None,
) -> dict:
    """One epoch (0-based ``epoch``): a seeded shuffle, every batch's steps, each at its
    learning rate (:func:`_lr_at`, set on the optimizer before the step).

    Returns the history row (without the tracked curvature, which the caller adds): means over
    the epoch's steps, and the test split's loss and accuracy after it. Each step is reported
    to ``meter`` and then to ``after_step``; ``position`` is ``(steps before this epoch,
    epochs in the run)``. A run counted in steps (``cfg.steps``) ends its last training
    epoch at that step (the ``noise_finetune`` epoch after it is whole).
    """
    cfg, model, splits = run.cfg, run.model, run.splits
    t0 = time.perf_counter()
    finetune = epoch >= cfg.epochs
    noise_std = cfg.noise_finetune if finetune else cfg.input_noise
    done, epochs = position
    lr = _lr_at(cfg, epoch, done if cfg.warmup or cfg.steps is not None else None)
    _set_lr(run.optimizer, lr)
    model.train()
    if run.world > 1:  # dropout masks: independent per rank, reproducible per epoch (resume)
        torch.manual_seed(cfg.seed * 1_000_003 + 7 * epoch * run.world + run.rank + 11)
    n = splits.x_train.shape[0]
    perm = torch.randperm(n, generator=run.shuffle_gen)
    sums = _EpochSums()
    detail = f"epoch {epoch + 1}/{epochs}"
    batch_size = batch_size_for(cfg, n)
    last = cfg.steps if cfg.steps is not None and not finetune else None
    per_step = cfg.warmup > 0 or (cfg.steps is not None and cfg.schedule != "constant")
    for start in range(0, n, batch_size):
        if last is not None and done >= last:
            break
        xb, yb = _batch(run, perm[start : start + batch_size], noise_std)
        for _ in range(cfg.repeat_batch):  # MAN Table 2: R optimizer steps on each batch
            if last is not None and done >= last:
                break
            if per_step:  # the rate of this step, in force before it (and its tracking)
                _set_lr(run.optimizer, _lr_at(cfg, epoch, done))
            stats, stepped = _optimizer_step(run, xb, yb, epoch, start)
            sums.add(stats)
            sums.skipped += int(not stepped)
            done += 1
            meter.update(done, estimate=sums.loss / sums.count, detail=detail)
            if after_step is not None:
                after_step(done, xb, yb)
    row = {
        "epoch": epoch + 1,
        "lr": lr,
        "train_loss": sums.loss / sums.count,
        "train_objective": sums.objective / sums.count,
        "train_accuracy": accuracy(cfg.chosen_loss, sums.correct, sums.counted),
        "grad_evals": sums.grad_evals,
        "penalties": {k: v / sums.count for k, v in sums.penalties.items()},
        "noise_finetune": finetune,
    }
    if run.amp.scaler is not None:  # fp16: steps the GradScaler skipped (gradient not finite)
        row["skipped_steps"] = sums.skipped
    test = splits.test_split()
    if test is not None:
        ev = evaluate(model, *test, cfg.chosen_loss, reduction=cfg.token_reduction)
        row["test_loss"], row["test_accuracy"] = ev["loss"], ev["accuracy"]
    row["seconds"] = time.perf_counter() - t0
    return row


def _batch(run: Run, rows: torch.Tensor, noise_std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of sample indices ``rows``, augmented and noised when asked."""
    splits, device = run.splits, run.splits.x_train.device
    idx = rows.to(device)
    xb, yb = splits.x_train[idx], splits.y_train[idx]
    if run.cfg.augment and xb.ndim == 4:
        xb = augment_images(xb.cpu(), run.aug_gen).to(device)
    if noise_std > 0:
        noise = torch.randn(xb.shape, generator=run.aug_gen, dtype=xb.dtype)
        xb = xb + noise_std * noise.to(device)
    return xb, yb


def _optimizer_step(run: Run, xb: torch.Tensor, yb: torch.Tensor, epoch: int, start: int):
    """One regularised step on the batch (data-parallel under torchrun, in the run's
    precision); returns its StepStats and whether the weights moved (False: an fp16 step whose
    gradient was not finite, skipped as the GradScaler does).

    NumericalError when the objective is not finite (``start``: the batch's first sample).
    """
    scale = run.amp.loss_scale()
    args = (run.model, xb, yb, run.cfg.chosen_loss, run.regs, run.step_gen)
    if run.world > 1:
        stats = data_parallel_step(
            *args,
            ascent_sync=run.cfg.ascent_sync,
            autocast_dtype=run.amp.autocast_dtype,
            loss_scale=scale,
        )
    else:
        stats = training_step(*args, autocast_dtype=run.amp.autocast_dtype, loss_scale=scale)
    if not math.isfinite(stats.objective):
        raise NumericalError(
            f"the training objective became {stats.objective} in epoch {epoch + 1} at sample {start}; "
            "lower `lr` or the regularizer strength",
            source=TRAIN,
        )
    return stats, run.amp.step(run.optimizer, scale)
