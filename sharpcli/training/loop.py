"""The training loop of ``sharp train`` (docs/commands/train.md).

One epoch: a seeded shuffle, optional image augmentation (random crop with
padding 4, horizontal flip) and input Gaussian noise, then per batch one
``training_step`` of the regularizer registry (which leaves the gradient of the
regularised objective in ``.grad``) and a plain optimizer step; the learning
rate follows a constant or cosine schedule per epoch. After each epoch the
test split is evaluated, curvature is optionally tracked, and the resumable
state (model, optimizer, every RNG, history) is written atomically beside the
checkpoint, so a run interrupted after epoch k and resumed ends with the same
weights, bit for bit on CPU, as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from sharpcli import memory, progress
from sharpcli.atomic import publication
from sharpcli.catalogue.values import TEST, TRAIN
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.distributed import rank_and_world
from sharpcli.errors import NumericalError, SharpError, UsageError
from sharpcli.io.checkpoints import FACTORY_PREFIX, factory_from_string, save_checkpoint
from sharpcli.io.data.loading import load_dataset
from sharpcli.losses import get_loss, token_reduction
from sharpcli.models import build_model, default_model_args
from sharpcli.models.outputs import attach_keyword_inputs, attach_output_selector
from sharpcli.preflight import (
    SECOND_DERIVATIVE_SAMPLES,
    check_model_accepts,
    check_second_derivatives,
    loss_for_task,
    prepare_features,
    resolve_device,
    resolve_dtype,
    to_analysis_dtype,
)
from sharpcli.regularizers.base import Penalty
from sharpcli.regularizers.registry import model_overrides
from sharpcli.regularizers.replay import set_penultimate
from sharpcli.report.envelope import environment_info, make_report
from sharpcli.training.config import (
    OPTIMIZERS,
    SCHEDULES,
    TrainConfig,
    batch_size_for,
    config_from_options,
    parse_track_every,
    validate_config,
)
from sharpcli.training.data_parallel import (
    check_data_parallel_regs,
    data_parallel_rank_and_world,
    data_parallel_record,
    data_parallel_step,
)
from sharpcli.training.divergence import divergence
from sharpcli.training.epochs import (
    Run,
    Splits,
    apply_label_noise,
    augment_images,
    evaluate,
    start_run,
    tracking_subset,
)
from sharpcli.training.epochs import train_epoch as _train_epoch
from sharpcli.training.resume import (
    STATE_VERSION,
    declare_outputs,
    history_csv_path_for,
    restore_state,
    save_state,
    state_path_for,
    tracked_csv_path_for,
    write_history_csv,
)


@dataclass
class TrainResult:
    """What a training run returns: history, final metrics, checkpoint, specs, config and notes."""

    history: list
    final: dict
    checkpoint: dict
    model_spec: dict
    data_spec: dict
    config: dict
    history_csv: str
    resumed_from_epoch: int = 0
    notes: list = field(default_factory=list)  # what was done to the data (float ids -> int64)
    # what each regularizer computed (Regularizer.run_record: spec, kind, computes)
    regularizers: list = field(default_factory=list)
    # the first diverged epoch (sharpcli.training.divergence), None when training did not diverge
    divergence: dict | None = None
    stopped_on_divergence: bool = False  # --stop-on-divergence ended the run there
    # MixedPrecision.record(): the mode, autocast dtype, penalties' dtype, loss scale, skips
    precision: dict = field(default_factory=dict)
    # data_parallel_record(): None in one process; the ranks, ascent sync, per-replica ones
    data_parallel: dict | None = None
    # one row per tracked step ({step, epoch, lr, ...tracked keys}) and their CSV (None: none)
    tracked: list = field(default_factory=list)
    tracked_csv: str | None = None


def train_report(
    result: TrainResult, settings: dict, *, out: str, device: str = "cpu", dtype: str = "float32"
) -> dict:
    """The JSON report of a training run (docs/json.md: results.history, .final, .checkpoint)."""

    results = {
        "history": result.history,
        "final": result.final,
        "checkpoint": result.checkpoint,
        "history_csv": result.history_csv,
        "resumed_from_epoch": result.resumed_from_epoch,
        "regularizers": result.regularizers,
        "diverged": result.divergence is not None,
        "divergence": result.divergence,
        "stopped_on_divergence": result.stopped_on_divergence,
        "precision": result.precision,
        "data_parallel": result.data_parallel,
        "tracked": result.tracked,
        "tracked_csv": result.tracked_csv,
    }
    return make_report(
        TRAIN,
        settings=result.config | settings | {"out": str(out)},
        results=results,
        checkpoint=result.checkpoint | {TRAIN: result.config},
        data={"spec": result.data_spec, "split": TRAIN, "samples": None}
        | ({"notes": list(result.notes)} if result.notes else {}),
        timing={"seconds": 0.0, "matvecs": 0},
        environment=environment_info(device, dtype, rank_and_world()[1]),
    )


def train(
    cfg: TrainConfig,
    out: str | Path,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    tracker: Callable[..., dict] | None = None,
    max_memory: str | int | None = None,
    stop_on_divergence: bool = False,
) -> TrainResult:
    """Train per ``cfg`` and write the checkpoint ``out`` (atomically) and its history CSV.

    After every epoch the history is checked for divergence
    (:func:`sharpcli.training.divergence.divergence`): the result's ``divergence`` names the
    first diverged epoch. ``stop_on_divergence`` ends the run there and writes the weights of
    the epoch with the lowest training loss instead of the last (``stopped_on_divergence``).

    ``stop_after=k`` ends the run after epoch k as an interruption would (the
    resumable state is kept); ``resume=True`` continues from that state.
    ``tracker(model, x, y, loss, epoch)`` returns curvature metrics recorded in the history; it
    sees a fixed seeded subset of ``cfg.track_samples`` training samples.
    Each optimizer step is reported to :mod:`sharpcli.progress` (a ``train`` run counting
    steps, with the epoch's running mean loss).

    The steps, in the order their random draws are made (the order is part of bit-for-bit
    resume): the data (:func:`_load_splits`), the model (:func:`_build_model`, seeded with
    ``cfg.seed``), the features on the model's device (:func:`_place_splits`), the optimizer
    and random streams, fresh or resumed (:func:`sharpcli.training.epochs.start_run`), the epochs
    (:func:`sharpcli.training.epochs.train_epoch`), and the final evaluation and checkpoint (:func:`_finish_run`).
    """

    validate_config(cfg)
    out = declare_outputs(out)
    state_file = state_path_for(out)
    regs = list(cfg.regs)
    rank, world = data_parallel_rank_and_world()
    if world > 1:
        check_data_parallel_regs(regs)

    dtype, device = resolve_dtype(cfg.dtype), resolve_device(cfg.device)
    plan = memory.activate(memory.MemoryPlan.for_run(max_memory, str(device)))
    splits = _load_splits(cfg)
    plan.baseline = memory.allocated_bytes(str(device))  # the data now loaded
    model, model_spec = _build_model(cfg, splits, regs, dtype, device)
    _place_splits(cfg, splits, model, dtype, device)
    _check_second_order(cfg, regs, model, splits, model_spec["name"])
    steps = _steps_per_epoch(cfg, splits)
    if cfg.steps is not None:  # counted in steps: the epochs that hold them, the last partial
        cfg.epochs = -(-cfg.steps // steps)
    run = start_run(cfg, regs, splits, model, device, (rank, world))
    if resume:
        restore_state(run, state_file)
    else:
        torch.manual_seed(cfg.seed + 4)

    # MAN Table 4: one extra final epoch with input noise of std ``noise_finetune``
    total_epochs = cfg.epochs + (1 if cfg.noise_finetune > 0 else 0)
    last_epoch = total_epochs if stop_after is None else min(total_epochs, stop_after)
    best = _BestWeights(model) if stop_on_divergence else None
    every, unit = parse_track_every(cfg.track_every)
    tracking = None if tracker is None else _Tracking(run, tracker, every, unit, device)
    # second-order regularizers differentiate the backward pass: attention and weight norm
    # must be computed by kernels whose second derivative exists and is right
    with (
        twice_differentiable(),
        _token_mean(cfg, splits.y_train),
        progress.start(
            TRAIN, total=_steps_before(cfg, last_epoch, steps), unit="steps", quantity="loss"
        ) as meter,
    ):
        for epoch in range(run.start_epoch, last_epoch):
            before = _steps_before(cfg, epoch, steps)
            after_step = None if tracking is None or unit != "steps" else tracking.after_step
            row = _train_epoch(run, epoch, meter, (before, total_epochs), after_step)
            if tracking is not None:
                tracking.end_epoch(row, epoch, total_epochs, _steps_before(cfg, epoch + 1, steps))
            run.history.append(row)
            meter.update(
                _steps_before(cfg, epoch + 1, steps), record={**row, "epochs": total_epochs}
            )
            if rank == 0:
                save_state(state_file, run, epoch + 1, last=epoch + 1 == last_epoch)
            if best is not None:
                best.update(row)
                if divergence(run.history, splits.num_outputs) is not None:
                    best.restore()
                    break
    result = _finish_run(run, out, model_spec)
    result.divergence = divergence(run.history, splits.num_outputs)
    result.stopped_on_divergence = best is not None and result.divergence is not None
    return result


def _check_second_order(cfg: TrainConfig, regs: list, model: nn.Module, splits, name: str):
    """A second-order penalty differentiates the backward pass: the model's second
    derivatives are checked first (:func:`check_second_derivatives`)."""
    if any(isinstance(reg, Penalty) and reg.needs.autograd for reg in regs):
        with twice_differentiable():
            check_second_derivatives(
                model,
                splits.x_train[:SECOND_DERIVATIVE_SAMPLES],
                splits.y_train,
                cfg.chosen_loss,
                source=name,
            )


class _Tracking:
    """The curvature tracked during one run: the tracker (one curvature engine and one
    :class:`~sharpcli.analyses.tracking.StepContext` kept for the run, so warm starts
    persist), the probe set (``cfg.track_on``: the fixed seeded subset, or each step's
    training batch), and the rows it adds to ``run.tracked``: ``{step, epoch, lr, ...,
    matvecs}``, ``lr`` the rate the optimizer's ``param_groups`` held for that step,
    ``matvecs`` the curvature products the measurement took."""

    def __init__(self, run: Run, tracker: Callable[..., dict], every: int, unit: str, device):
        self.run, self.tracker, self.every, self.unit = run, tracker, every, unit
        self.subset = tracking_subset(run.cfg, run.splits, device)
        context = getattr(tracker, "context", None)  # a RunTracker's StepContext
        if context is not None:  # its warm starts live in the run (saved with its state)
            context.warm = run.warm
        self.batch_size = batch_size_for(run.cfg, run.splits.x_train.shape[0])
        self.seconds = 0.0

    def _measure(self, step: int, epoch: int, x: torch.Tensor, y: torch.Tensor) -> dict:
        """The tracked quantities after optimizer step ``step`` (in ``epoch``, from 1),
        recorded in ``run.tracked``; the model's mode is restored by the tracker."""
        run = self.run
        t1 = time.perf_counter()
        with _token_mean(run.cfg, y):  # the probe set's own, as an analysis of it
            values = self.tracker(
                run.model,
                x,
                y,
                run.cfg.loss,
                optimizer=run.optimizer,
                step=step,
                batch_size=self.batch_size,
            )
        self.seconds += time.perf_counter() - t1
        lr = run.optimizer.param_groups[0]["lr"]
        products = getattr(self.tracker, "products", None)  # the measurement's products
        run.tracked.append({"step": step, "epoch": epoch, "lr": lr, **values, "matvecs": products})
        return values

    def end_epoch(self, row: dict, epoch: int, total_epochs: int, steps_done: int) -> None:
        """After epoch ``epoch`` (0-based): measure when epochs are counted and this one is
        due (every ``every``-th, and the last); with steps counted, take the seconds measured
        inside the epoch out of its ``seconds``.

        Args:
            row: the epoch's history row, which this adds to.
            epoch: the epoch just ended.
            total_epochs: the epochs of the run.
            steps_done: the optimizer steps taken so far.
        """
        if self.unit == "epochs":
            if (epoch + 1) % self.every == 0 or epoch + 1 == total_epochs:
                self.track_epoch(row, steps_done)
        else:  # measured inside the epoch: its seconds left out
            row["tracking_seconds"] = self.take_seconds()
            row["seconds"] = max(0.0, row["seconds"] - row["tracking_seconds"])

    def after_step(self, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        """Per-step tracking: measure after every ``every``-th optimizer step."""
        if step % self.every == 0:
            x, y = (xb, yb) if self.run.cfg.track_on == "batch" else self.subset
            self._measure(step, len(self.run.history) + 1, x, y)

    def track_epoch(self, row: dict, step: int) -> None:
        """Per-epoch tracking: measure now, in ``row["tracked"]`` as ever (and in
        ``run.tracked``), with the seconds it took. ``track_on`` ``batch`` has no batch
        between epochs: the subset is measured."""
        self.seconds = 0.0
        row["tracked"] = self._measure(step, row["epoch"], *self.subset)
        row["tracking_seconds"] = self.take_seconds()

    def take_seconds(self) -> float:
        """The seconds spent measuring since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _steps_before(cfg: TrainConfig, epoch: int, steps_per_epoch: int) -> int:
    """Optimizer steps taken before the 0-based ``epoch`` (a run counted in steps stops at
    ``cfg.steps``; its ``noise_finetune`` epoch comes after them)."""
    if cfg.steps is None:
        return epoch * steps_per_epoch
    if epoch > cfg.epochs:  # past the noise-finetune epoch
        return cfg.steps + (epoch - cfg.epochs) * steps_per_epoch
    return min(epoch * steps_per_epoch, cfg.steps)


def _token_mean(cfg: TrainConfig, y: torch.Tensor) -> contextlib.AbstractContextManager:
    """Token cross-entropy averaged per ``cfg.token_reduction`` over the set ``y``
    (:func:`sharpcli.losses.token_reduction`); nothing for the other losses."""

    if cfg.loss is None or not get_loss(cfg.loss).per_token:
        return contextlib.nullcontext()
    return token_reduction(cfg.token_reduction, y)


class _BestWeights:
    """A copy of the model's weights (and buffers) at the epoch with the lowest training loss."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.loss = model, math.inf
        self.state: dict | None = None

    def update(self, row: dict) -> None:
        """Keep the weights now if ``row``'s training loss is the lowest so far."""
        if row["train_loss"] < self.loss:
            self.loss = row["train_loss"]
            self.state = copy.deepcopy(self.model.state_dict())

    def restore(self) -> None:
        """Load the kept weights into the model."""
        if self.state is not None:
            self.model.load_state_dict(self.state)


def _steps_per_epoch(cfg: TrainConfig, splits) -> int:
    """Optimizer steps per epoch: ``repeat_batch`` on each of the ``ceil(n / batch_size)``
    batches."""
    n = splits.x_train.shape[0]
    return -(-n // batch_size_for(cfg, n)) * cfg.repeat_batch


def _load_splits(cfg: TrainConfig) -> Splits:
    """Load ``cfg.data``; complete ``cfg.data`` (the resolved spec) and, unless the model's
    outputs decide it (:func:`_place_splits`), ``cfg.loss``.

    Classification labels get ``cfg.label_noise`` (AD Fig. 3; per labelled position for
    per-position labels); the number of model outputs is the number of classes, or the
    regression target's width. Labels ``(N, T)``, one per position (``-100``: unlabelled),
    train with ``token-cross-entropy`` (a sequence model's ``(B, T, V)`` outputs), regression
    targets with ``mse``; one class label per sample leaves the loss to the model's outputs.
    """

    dataset = load_dataset(cfg.data, label_column=cfg.label_column)
    per_position = dataset.task == "classification" and dataset.y_train.ndim == 2
    cfg.data = dataset.spec
    if per_position or dataset.task == "regression":
        cfg.loss = cfg.loss or loss_for_task(dataset.task, per_position=per_position)
    x_train, y_train = dataset.split(TRAIN)
    x_test, y_test = dataset.split(TEST) if dataset.x_test is not None else (None, None)
    if dataset.num_classes is not None:  # classification
        num_outputs = int(dataset.num_classes)
        y_train = apply_label_noise(y_train, cfg.label_noise, num_outputs, cfg.seed)
    else:
        num_outputs = 1 if y_train.ndim == 1 else int(y_train.shape[1])
    return Splits(dataset, x_train, y_train, x_test, y_test, num_outputs)


def _build_model(
    cfg: TrainConfig, splits: Splits, regs: list, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, dict]:
    """The model to train, initialised from ``cfg.seed``, and its spec for the checkpoint.

    A zoo model ``cfg.model`` sized for the data's shapes (the regularizers may override its
    arguments: ``dropout``), or the user's own ``cfg.model_factory`` called with
    ``cfg.model_args``, recorded as ``{"name": "factory:module:function", "args": ...}`` so
    the checkpoint rebuilds itself where the module is importable (docs/own-model.md).
    """

    overrides = model_overrides(regs)
    _plan_training_memory(cfg, splits, overrides, dtype)
    torch.manual_seed(cfg.seed)
    if cfg.model_factory is not None:
        if overrides:
            raise UsageError(
                f"changes the model's arguments ({', '.join(overrides)}), which a "
                "`model_factory` model does not take: build that into your factory",
                source="regs",
            )
        model = factory_from_string(cfg.model_factory, cfg.model_args)
        model_spec = {"name": FACTORY_PREFIX + cfg.model_factory, "args": dict(cfg.model_args)}
    else:
        input_shape = tuple(splits.dataset.input_shape)
        args = default_model_args(cfg.model, input_shape, splits.num_outputs, **cfg.model_args)
        args.update(overrides)
        model_spec = {"name": cfg.model, "args": args}
        model = build_model(model_spec)
    model = model.to(device=device, dtype=dtype)
    attach_output_selector(model, cfg.output)
    # model(**batch), or model(batch) for forward(self, batch): keyed data
    attach_keyword_inputs(model, splits.dataset.input_keys, shapes=splits.dataset.input_shapes)
    if cfg.penultimate is not None:
        set_penultimate(model, cfg.penultimate)
    return model, model_spec


TRAINING_COPIES = 6  # weights, gradients, two optimizer buffers, two regularizer copies


def _plan_training_memory(cfg: TrainConfig, splits: Splits, overrides: dict, dtype) -> None:
    """Count the model's parameters on the ``meta`` device (nothing allocated) and check that
    :data:`TRAINING_COPIES` copies of them fit the run's memory plan, before the model is
    built: a width the machine cannot hold is a usage error naming the model's size options,
    not an allocation failure. A factory that cannot build on ``meta`` is built as usual."""

    state = torch.random.get_rng_state()
    try:
        with torch.device("meta"):
            if cfg.model_factory is not None:
                model = factory_from_string(cfg.model_factory, cfg.model_args)
            else:
                input_shape = tuple(splits.dataset.input_shape)
                args = default_model_args(
                    cfg.model, input_shape, splits.num_outputs, **cfg.model_args
                )
                args.update(overrides)
                model = build_model({"name": cfg.model, "args": args})
        count = sum(p.numel() for p in model.parameters())
    except (SharpError, TypeError, ValueError, RuntimeError, NotImplementedError):
        return  # the real build reports the problem, or builds what meta could not
    finally:
        torch.random.set_rng_state(state)
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = TRAINING_COPIES * count * itemsize
    lower = (
        "lower the model's size (`model_args`)"
        if cfg.model_factory is not None
        else "lower `width` or `depth`"
    )
    plan = memory.current()
    plan.require(f"training a model of {count:,} parameters", need, lower)
    plan.reserve("model, gradients, optimizer state", need)


def _place_splits(
    cfg: TrainConfig, splits: Splits, model: nn.Module, dtype: torch.dtype, device: torch.device
) -> None:
    """Move the splits to ``device`` as the model takes them and check that it accepts them.

    Features go to the training dtype, except token ids an ``nn.Embedding`` looks up, which stay
    int64 (:func:`sharpcli.preflight.prepare_features`; its notes are collected in
    ``splits.notes``); regression targets go to the training dtype. Input perturbations
    (``--input-noise``, ``--noise-finetune``, ``--augment``) are refused on token ids.
    Class labels with no loss set train with the loss the model's outputs call for
    (:func:`sharpcli.preflight.infer_loss`, as the analyses pick it): ``binary-cross-entropy``
    for one logit per sample, ``cross-entropy`` otherwise.
    """

    dataset = splits.dataset
    regression = dataset.task == "regression"
    n = splits.x_train.shape[0]
    splits.x_train, splits.notes = prepare_features(
        model, splits.x_train, dtype, device, dataset.source, batch_size=batch_size_for(cfg, n)
    )
    splits.y_train = splits.y_train.to(device)
    if regression:
        splits.y_train = to_analysis_dtype(splits.y_train, dtype, device, dataset.source, "targets")
    test = splits.test_split()
    if test is not None:
        splits.x_test, test_notes = prepare_features(
            model, test[0], dtype, device, dataset.source, batch_size=batch_size_for(cfg, n)
        )
        splits.notes += [note for note in test_notes if note not in splits.notes]
        y_test = test[1].to(device)
        if regression:
            y_test = to_analysis_dtype(y_test, dtype, device, dataset.source, "test targets")
        splits.y_test = y_test
    if not splits.x_train.is_floating_point():
        _refuse_input_perturbations(cfg)
    _, cfg.loss = check_model_accepts(
        model, splits.x_train, splits.y_train, dataset.task, dataset.source, cfg.loss
    )


def _refuse_input_perturbations(cfg: TrainConfig) -> None:
    """UsageError on the first option that perturbs input features (they are integer token ids)."""
    for option, value in (
        ("input_noise", cfg.input_noise),
        ("noise_finetune", cfg.noise_finetune),
        ("augment", cfg.augment),
    ):
        if value:
            raise UsageError(
                "perturbs input features, but this model takes integer token ids",
                source=option,
            )


def _finish_run(run: Run, out: Path, model_spec: dict) -> TrainResult:
    """Evaluate the trained model, write the checkpoint and history CSV (rank 0), and report.

    Both files are published together (:func:`sharpcli.atomic.publication`), under the CLI
    with the final resumable state, the plot and the report at the end of the command.
    NumericalError when the final training loss is not finite.
    """
    cfg, model, splits, history = run.cfg, run.model, run.splits, run.history
    final_train = evaluate(
        model, splits.x_train, splits.y_train, cfg.chosen_loss, reduction=cfg.token_reduction
    )
    final = {
        "epochs_completed": len(history),
        "train_loss": final_train["loss"],
        "train_accuracy": final_train["accuracy"],
    }
    test = splits.test_split()
    if test is not None:
        ev = evaluate(model, *test, cfg.chosen_loss, reduction=cfg.token_reduction)
        final["test_loss"], final["test_accuracy"] = ev["loss"], ev["accuracy"]
    final["grad_evals"] = sum(r["grad_evals"] for r in history)
    if run.amp.scaler is not None:
        final["skipped_steps"] = run.amp.skipped_steps
    final["seconds"] = sum(r["seconds"] for r in history)
    if not math.isfinite(final["train_loss"]):
        raise NumericalError("the final training loss is not finite", source=TRAIN)
    cfg_dict = json.loads(json.dumps(cfg.to_dict()))
    records = [reg.run_record() for reg in run.regs]
    csv_path = history_csv_path_for(out)
    tracked_csv = tracked_csv_path_for(out)
    data_spec = splits.dataset.spec
    data_parallel = data_parallel_record(run.regs, cfg.ascent_sync, run.world)
    parallel = {} if data_parallel is None else {"data_parallel": data_parallel}
    sha = None  # ranks > 0 write nothing and report nothing (sharpcli.distributed)
    if run.rank == 0:
        # wall-clock seconds belong in the report, not the checkpoint: identical runs give
        # byte-identical files (the same sha256)
        metrics = {k: v for k, v in final.items() if k != "seconds"}
        with publication():
            sha = save_checkpoint(
                out,
                model,
                model_spec,
                data_spec=data_spec,
                train_config=cfg_dict | {"regularizers": records} | parallel,
                metrics=metrics,
            )
            write_history_csv(csv_path, history)
            if run.tracked:
                write_history_csv(tracked_csv, run.tracked)
    return TrainResult(
        history=history,
        final=final,
        checkpoint={"path": str(out), "sha256": sha, "model": model_spec},
        model_spec=model_spec,
        data_spec=data_spec,
        config=cfg_dict,
        history_csv=str(csv_path),
        resumed_from_epoch=run.start_epoch,
        notes=splits.notes,
        regularizers=records,
        precision=run.amp.record(),
        data_parallel=data_parallel,
        tracked=run.tracked,
        tracked_csv=str(tracked_csv) if run.tracked else None,
    )


__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "STATE_VERSION",
    "TrainConfig",
    "TrainResult",
    "validate_config",
    "config_from_options",
    "train",
    "train_report",
    "evaluate",
    "apply_label_noise",
    "augment_images",
    "state_path_for",
    "history_csv_path_for",
    "declare_outputs",
    "check_data_parallel_regs",
    "data_parallel_rank_and_world",
    "data_parallel_step",
]
