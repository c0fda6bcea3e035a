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

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from sharpcli import ledger, memory, progress
from sharpcli.atomic import publication, write_atomic, write_text_atomic
from sharpcli.errors import InputError, NumericalError, SharpError, UsageError
from sharpcli.io.checkpoints import save_checkpoint
from sharpcli.losses import IGNORE_INDEX, get_loss
from sharpcli.training.divergence import divergence

OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("constant", "cosine")
STATE_VERSION = 1


@dataclass
class TrainConfig:
    """Everything that determines a training run; stored in the checkpoint's ``sharpcli.train``."""

    model: str = "mlp"
    model_args: dict = field(default_factory=dict)
    model_factory: str | None = None  # module:function building the user's own model
    output: str | None = None  # which of the model's outputs are the logits
    penultimate: str | None = None  # module whose output activation decay penalises
    data: str | dict = "blobs"
    label_column: str | None = None
    epochs: int = 5
    batch_size: int = 64
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    schedule: str = "constant"
    label_noise: float = 0.0
    augment: bool = False
    input_noise: float = 0.0
    repeat_batch: int = 1
    noise_finetune: float = 0.0
    seed: int = 0
    regs: list = field(default_factory=lambda: ["none"])
    dtype: str = "float32"
    device: str = "cpu"
    track: list = field(default_factory=list)
    track_every: int = 1
    track_samples: int = 512
    loss: str | None = None

    def identity(self) -> dict:
        """The fields a resumed run must share with the run it continues."""
        d = asdict(self)
        d.pop("epochs")
        return d


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
    stopped_on_divergence: bool = False  # --stop-diverged ended the run at that epoch


def train_report(
    result: TrainResult, settings: dict, *, out: str, device: str = "cpu", dtype: str = "float32"
) -> dict:
    """The JSON report of a training run (docs/json.md: results.history, .final, .checkpoint)."""
    from sharpcli.distributed import rank_and_world
    from sharpcli.report.envelope import environment_info, make_report

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
    }
    return make_report(
        "train",
        settings=result.config | settings | {"out": str(out)},
        results=results,
        checkpoint=result.checkpoint | {"train": result.config},
        data={"spec": result.data_spec, "split": "train", "samples": None}
        | ({"notes": list(result.notes)} if result.notes else {}),
        timing={"seconds": 0.0, "matvecs": 0},
        environment=environment_info(device, dtype, rank_and_world()[1]),
    )


def state_path_for(out: str | Path) -> Path:
    """The resumable state file beside checkpoint ``out`` (``out`` + ``.state.pt``)."""
    out = Path(out)
    return out.with_name(out.name + ".state.pt")


def history_csv_path_for(out: str | Path) -> Path:
    """The history CSV beside checkpoint ``out`` (its stem + ``.history.csv``)."""
    out = Path(out)
    return out.with_name(out.stem + ".history.csv")


def declare_outputs(out: str | Path) -> Path:
    """Declare (:mod:`sharpcli.ledger`) every file a run writes, before any work: the
    checkpoint ``out``, its history CSV and its resumable state beside it. UsageError naming the
    first one that cannot be written (a folder, a missing folder) or that the run also reads."""
    out = ledger.declare_output(out, "out")
    ledger.declare_output(history_csv_path_for(out), "out", role="the history CSV beside `out`")
    ledger.declare_output(state_path_for(out), "out", role="the resumable state beside `out`")
    return out


OPTION_OF = {name: name for name in TrainConfig.__dataclass_fields__}
"""The parameter that sets each TrainConfig field, named by the errors about it (the CLI spells
it as its own option; sweep's ``set`` option sets any field, and its errors name that option).
``loss`` has none in ``train`` (the data's task picks it)."""

_FIELD_TYPES = {
    int: ("epochs", "batch_size", "repeat_batch", "seed", "track_every", "track_samples"),
    float: ("lr", "momentum", "label_noise", "input_noise", "noise_finetune"),
    bool: ("augment",),
    str: ("model", "optimizer", "schedule", "dtype", "device"),
    dict: ("model_args",),
    list: ("regs", "track"),
}


def _shown(value) -> str:
    """``repr(value)`` cut to 40 characters, for a message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_types(cfg: TrainConfig) -> None:
    """UsageError naming the option of the first field whose value has the wrong type.

    ``sweep --set epochs=abc`` stores the string ``"abc"``; comparing it later was exit 4.
    Numbers must be finite (``--input-noise nan``); integers are not booleans.
    """
    for kind, names in _FIELD_TYPES.items():
        for name in names:
            value = getattr(cfg, name)
            wrong = isinstance(value, bool) != (kind is bool) or not isinstance(
                value, (int, float) if kind is float else kind
            )
            if kind is float and not wrong and not math.isfinite(value):
                raise UsageError(f"must be a finite number, got {value!r}", source=OPTION_OF[name])
            if wrong:
                what = {int: "an integer", float: "a number", bool: "true or false"}.get(
                    kind, f"a {kind.__name__}"
                )
                raise UsageError(f"must be {what}, got {_shown(value)}", source=OPTION_OF[name])
    for name in ("loss", "label_column"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, str):
            raise UsageError(f"must be a string, got {_shown(value)}", source=OPTION_OF[name])
    if not isinstance(cfg.data, (str, dict)):
        raise UsageError("must be a data spec string", source="data")


def validate_config(cfg: TrainConfig) -> None:
    """UsageError naming the option of the first setting out of its type or range."""
    from sharpcli.losses import LOSSES
    from sharpcli.preflight import check_seed

    _check_types(cfg)
    check_seed(cfg.seed)
    if not 0.0 <= cfg.momentum < 1.0:
        raise UsageError(f"must be in [0, 1), got {cfg.momentum!r}", source="momentum")
    if cfg.track_samples < 1:
        raise UsageError("must be at least 1", source="track_samples")
    if cfg.loss is not None and cfg.loss not in LOSSES:
        raise UsageError(f"unknown loss {cfg.loss!r}; accepted: {', '.join(LOSSES)}", source="loss")
    if cfg.epochs < 1:
        raise UsageError("must be at least 1", source="epochs")
    if cfg.batch_size < 1:
        raise UsageError("must be at least 1", source="batch_size")
    if cfg.optimizer not in OPTIMIZERS:
        raise UsageError(
            f"unknown optimizer {cfg.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}",
            source="optimizer",
        )
    if cfg.schedule not in SCHEDULES:
        raise UsageError(
            f"unknown schedule {cfg.schedule!r}; accepted: {', '.join(SCHEDULES)}",
            source="schedule",
        )
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise UsageError("must be a positive number", source="lr")
    if not (0.0 <= cfg.label_noise < 1.0):
        raise UsageError("must be in [0, 1)", source="label_noise")
    if cfg.repeat_batch < 1:
        raise UsageError("must be at least 1", source="repeat_batch")
    if cfg.noise_finetune < 0:
        raise UsageError("must be >= 0", source="noise_finetune")
    if cfg.input_noise < 0:
        raise UsageError("must be >= 0", source="input_noise")
    if cfg.track_every < 1:
        raise UsageError("must be at least 1", source="track_every")


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
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_name: str, batch_size: int = 1024
) -> dict:
    """Mean loss per sample and accuracy over (x, y) in eval mode.

    Accuracy is the loss's own (:attr:`sharpcli.losses.Loss.correct`): correct predictions over
    the predictions it counts (samples; labelled positions for token cross-entropy); None where
    the loss defines none (regression) or counts no prediction.
    """
    was_training = model.training
    model.eval()
    loss = get_loss(loss_name)
    total, correct, counted, n = 0.0, 0, 0, x.shape[0]
    for start in range(0, n, batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        z = model(xb)
        total += float(loss.mean(z, yb)) * xb.shape[0]
        if loss.correct is not None:
            right, count = loss.correct(z, yb)
            correct, counted = correct + int(right), counted + int(count)
    model.train(was_training)
    return {"loss": total / max(n, 1), "accuracy": _accuracy(loss_name, correct, counted)}


def _accuracy(loss_name: str, correct: int, counted: int) -> float | None:
    """``correct / counted`` for a loss with an accuracy that counted predictions, else None."""
    if get_loss(loss_name).correct is None or counted == 0:
        return None
    return correct / counted


def _lr_at(cfg: TrainConfig, epoch: int) -> float:
    if cfg.schedule == "cosine":
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / cfg.epochs))
    return cfg.lr


def _make_optimizer(cfg: TrainConfig, model: nn.Module):
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.Adam(params, lr=cfg.lr)


def _write_history_csv(path: Path, history: list) -> None:
    import pandas as pd

    flat = pd.json_normalize(history, sep=".")
    write_text_atomic(path, flat.to_csv(index=False))


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
    and random streams, fresh or resumed (:func:`_start_run`), the epochs
    (:func:`_train_epoch`), and the final evaluation and checkpoint (:func:`_finish_run`).
    """
    from sharpcli.curvature.differentiable import twice_differentiable
    from sharpcli.preflight import (
        SECOND_DERIVATIVE_SAMPLES,
        check_second_derivatives,
        resolve_device,
        resolve_dtype,
    )
    from sharpcli.training.regularizers import parse_reg, validate_combination

    validate_config(cfg)
    out = declare_outputs(out)
    state_file = state_path_for(out)
    regs = [parse_reg(r) for r in cfg.regs]
    validate_combination(regs)
    rank, world = data_parallel_rank_and_world()
    if world > 1:
        check_data_parallel_regs(regs)
    cfg.regs = [r.spec() for r in regs]

    dtype, device = resolve_dtype(cfg.dtype), resolve_device(cfg.device)
    plan = memory.activate(memory.MemoryPlan.for_run(max_memory, str(device)))
    splits = _load_splits(cfg)
    plan.baseline = memory.allocated_bytes(str(device))  # the data now loaded
    model, model_spec = _build_model(cfg, splits, regs, dtype, device)
    _place_splits(cfg, splits, model, dtype, device)
    if any(getattr(reg, "needs_autograd", False) for reg in regs):  # second-order penalties
        with twice_differentiable():
            check_second_derivatives(
                model,
                splits.x_train[:SECOND_DERIVATIVE_SAMPLES],
                splits.y_train,
                cfg.loss,
                source=model_spec["name"],
            )
    run = _start_run(cfg, regs, splits, model, device, (rank, world))
    if resume:
        _restore_state(run, state_file)
    else:
        torch.manual_seed(cfg.seed + 4)

    x_track, y_track = _tracking_subset(cfg, splits, device)
    # MAN Table 4: one extra final epoch with input noise of std ``noise_finetune``
    total_epochs = cfg.epochs + (1 if cfg.noise_finetune > 0 else 0)
    last_epoch = total_epochs if stop_after is None else min(total_epochs, stop_after)
    steps = _steps_per_epoch(cfg, splits)
    best = _BestWeights(model) if stop_on_divergence else None
    # second-order regularizers differentiate the backward pass: attention and weight norm
    # must be computed by kernels whose second derivative exists and is right
    with (
        twice_differentiable(),
        progress.start("train", total=last_epoch * steps, unit="steps", quantity="loss") as meter,
    ):
        for epoch in range(run.start_epoch, last_epoch):
            row = _train_epoch(run, epoch, meter, (epoch * steps, total_epochs))
            if tracker is not None and (
                (epoch + 1) % cfg.track_every == 0 or epoch + 1 == total_epochs
            ):
                t1 = time.perf_counter()
                row["tracked"] = tracker(model, x_track, y_track, cfg.loss, epoch + 1)
                row["tracking_seconds"] = time.perf_counter() - t1
            run.history.append(row)
            meter.update((epoch + 1) * steps, record={**row, "epochs": total_epochs})
            if rank == 0:
                _save_state(state_file, run, epoch + 1, last=epoch + 1 == last_epoch)
            if best is not None:
                best.update(row)
                if divergence(run.history, splits.num_outputs) is not None:
                    best.restore()
                    break
    result = _finish_run(run, out, model_spec)
    result.divergence = divergence(run.history, splits.num_outputs)
    result.stopped_on_divergence = best is not None and result.divergence is not None
    return result


class _BestWeights:
    """A copy of the model's weights (and buffers) at the epoch with the lowest training loss."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.loss, self.state = model, math.inf, None

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
    return -(-splits.x_train.shape[0] // cfg.batch_size) * cfg.repeat_batch


@dataclass
class _Splits:
    """The training data: the dataset, its train (and test) tensors, and what was done to them.

    :func:`_load_splits` fills it on the CPU as the dataset gives it (labels noised);
    :func:`_place_splits` converts the tensors in place to the model's dtype and device.
    """

    dataset: object
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor | None
    y_test: torch.Tensor | None
    num_outputs: int
    notes: list = field(default_factory=list)

    @property
    def has_test(self) -> bool:
        """Whether the dataset has a test split (evaluated after every epoch)."""
        return self.x_test is not None


def _load_splits(cfg: TrainConfig) -> _Splits:
    """Load ``cfg.data``; complete ``cfg.data`` (the resolved spec) and, unless the model's
    outputs decide it (:func:`_place_splits`), ``cfg.loss``.

    Classification labels get ``cfg.label_noise`` (AD Fig. 3; per labelled position for
    per-position labels); the number of model outputs is the number of classes, or the
    regression target's width. Labels ``(N, T)``, one per position (``-100``: unlabelled),
    train with ``token-cross-entropy`` (a sequence model's ``(B, T, V)`` outputs), regression
    targets with ``mse``; one class label per sample leaves the loss to the model's outputs.
    """
    from sharpcli.io.datasets import load_dataset
    from sharpcli.preflight import loss_for_task

    dataset = load_dataset(cfg.data, label_column=cfg.label_column)
    per_position = dataset.task == "classification" and dataset.y_train.ndim == 2
    cfg.data = dataset.spec
    if per_position or dataset.task == "regression":
        cfg.loss = cfg.loss or loss_for_task(dataset.task, per_position=per_position)
    x_train, y_train = dataset.split("train")
    x_test, y_test = dataset.split("test") if dataset.x_test is not None else (None, None)
    if dataset.task == "classification":
        num_outputs = int(dataset.num_classes)
        y_train = apply_label_noise(y_train, cfg.label_noise, num_outputs, cfg.seed)
    else:
        num_outputs = 1 if y_train.ndim == 1 else int(y_train.shape[1])
    return _Splits(dataset, x_train, y_train, x_test, y_test, num_outputs)


def _build_model(
    cfg: TrainConfig, splits: _Splits, regs: list, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, dict]:
    """The model to train, initialised from ``cfg.seed``, and its spec for the checkpoint.

    A zoo model ``cfg.model`` sized for the data's shapes (the regularizers may override its
    arguments: ``dropout``), or the user's own ``cfg.model_factory`` called with
    ``cfg.model_args``, recorded as ``{"name": "factory:module:function", "args": ...}`` so
    the checkpoint rebuilds itself where the module is importable (docs/own-model.md).
    """
    from sharpcli.io.checkpoints import FACTORY_PREFIX, factory_from_string
    from sharpcli.models import build_model, default_model_args
    from sharpcli.models.outputs import attach_keyword_inputs, attach_output_selector
    from sharpcli.training.regularizers import model_overrides
    from sharpcli.training.step import set_penultimate

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
    attach_keyword_inputs(model, splits.dataset.input_keys)  # model(**batch) for keyed data
    if cfg.penultimate is not None:
        set_penultimate(model, cfg.penultimate)
    return model, model_spec


TRAINING_COPIES = 6  # weights, gradients, two optimizer buffers, two regularizer copies


def _plan_training_memory(cfg: TrainConfig, splits: _Splits, overrides: dict, dtype) -> None:
    """Count the model's parameters on the ``meta`` device (nothing allocated) and check that
    :data:`TRAINING_COPIES` copies of them fit the run's memory plan, before the model is
    built: a width the machine cannot hold is a usage error naming the model's size options,
    not an allocation failure. A factory that cannot build on ``meta`` is built as usual."""
    from sharpcli.io.checkpoints import factory_from_string
    from sharpcli.models import build_model, default_model_args

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
    cfg: TrainConfig, splits: _Splits, model: nn.Module, dtype: torch.dtype, device: torch.device
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
    from sharpcli.preflight import check_model_accepts, prepare_features, to_analysis_dtype

    dataset = splits.dataset
    regression = dataset.task == "regression"
    splits.x_train, splits.notes = prepare_features(
        model, splits.x_train, dtype, device, dataset.source, batch_size=cfg.batch_size
    )
    splits.y_train = splits.y_train.to(device)
    if regression:
        splits.y_train = to_analysis_dtype(splits.y_train, dtype, device, dataset.source, "targets")
    if splits.has_test:
        splits.x_test, test_notes = prepare_features(
            model, splits.x_test, dtype, device, dataset.source, batch_size=cfg.batch_size
        )
        splits.notes += [note for note in test_notes if note not in splits.notes]
        splits.y_test = splits.y_test.to(device)
        if regression:
            splits.y_test = to_analysis_dtype(
                splits.y_test, dtype, device, dataset.source, "test targets"
            )
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


@dataclass
class _Run:
    """What the epochs of one run share and what its resumable state saves.

    ``shuffle_gen`` orders the samples of each epoch, ``step_gen`` drives the regularizers'
    random draws (on the model's device), ``aug_gen`` the augmentation and input noise; the
    global torch RNG is left to dropout. ``history`` holds one row per completed epoch.
    """

    cfg: TrainConfig
    regs: list
    splits: _Splits
    model: nn.Module
    optimizer: torch.optim.Optimizer
    shuffle_gen: torch.Generator
    step_gen: torch.Generator
    aug_gen: torch.Generator
    rank: int = 0
    world: int = 1
    history: list = field(default_factory=list)
    start_epoch: int = 0


def _start_run(
    cfg: TrainConfig,
    regs: list,
    splits: _Splits,
    model: nn.Module,
    device: torch.device,
    rank_world: tuple[int, int],
) -> _Run:
    """A fresh run: the optimizer and the random streams seeded from ``cfg.seed`` (+1, +2, +3)."""
    rank, world = rank_world
    return _Run(
        cfg=cfg,
        regs=regs,
        splits=splits,
        model=model,
        optimizer=_make_optimizer(cfg, model),
        shuffle_gen=torch.Generator().manual_seed(cfg.seed + 1),
        step_gen=torch.Generator(device=device).manual_seed(cfg.seed + 2),
        aug_gen=torch.Generator().manual_seed(cfg.seed + 3),
        rank=rank,
        world=world,
    )


def _restore_state(run: _Run, state_file: Path) -> None:
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
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise InputError(
            f"resumable state does not fit this run ({type(exc).__name__})", source=str(state_file)
        ) from None
    run.history = state["history"]
    run.start_epoch = state["epoch"]


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
    """The resumable state in ``state_file``, its structure checked (what :func:`_save_state`
    writes) and its ``config`` and ``history`` parsed. A missing, unreadable or foreign file
    (a regular file read up to its size, ``weights_only``) is an InputError naming it."""
    import io

    from sharpcli.bounded import loads_json, read_data_file

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
    if saved != identity:
        diff = sorted(
            f"`{OPTION_OF.get(k, k)}`"
            for k in set(saved) | set(identity)
            if saved.get(k) != identity.get(k)
        )
        raise UsageError(
            f"the saved run used other settings ({', '.join(diff)}); resume with the same options "
            "(only `epochs` may grow)",
            source="resume",
        )
    if cfg.epochs != saved_epochs:
        _check_more_epochs(cfg, saved_epochs, state["epoch"])


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


def _tracking_subset(
    cfg: TrainConfig, splits: _Splits, device: torch.device
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
        self.penalties: dict = {}

    def add(self, stats) -> None:
        """Add one step's :class:`~sharpcli.training.regularizers.StepStats`."""
        b = stats.count
        self.loss += stats.loss * b
        self.objective += stats.objective * b
        self.correct += stats.correct
        self.counted += stats.counted
        self.count += b
        self.grad_evals += stats.grad_evals
        for k, v in stats.penalties.items():
            self.penalties[k] = self.penalties.get(k, 0.0) + v * b


def _train_epoch(run: _Run, epoch: int, meter: progress.Run, position: tuple[int, int]) -> dict:
    """One epoch (0-based ``epoch``): the learning rate, a seeded shuffle, every batch's steps.

    Returns the history row (without the tracked curvature, which the caller adds): means over
    the epoch's steps, and the test split's loss and accuracy after it. Each step is reported
    to ``meter``; ``position`` is ``(steps before this epoch, epochs in the run)``.
    """
    cfg, model, splits = run.cfg, run.model, run.splits
    t0 = time.perf_counter()
    finetune = epoch >= cfg.epochs
    noise_std = cfg.noise_finetune if finetune else cfg.input_noise
    lr = _lr_at(cfg, min(epoch, cfg.epochs - 1))
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    model.train()
    if run.world > 1:  # dropout masks: independent per rank, reproducible per epoch (resume)
        torch.manual_seed(cfg.seed * 1_000_003 + 7 * epoch * run.world + run.rank + 11)
    n = splits.x_train.shape[0]
    perm = torch.randperm(n, generator=run.shuffle_gen)
    sums = _EpochSums()
    done, epochs = position
    detail = f"epoch {epoch + 1}/{epochs}"
    for start in range(0, n, cfg.batch_size):
        xb, yb = _batch(run, perm[start : start + cfg.batch_size], noise_std)
        for _ in range(cfg.repeat_batch):  # MAN Table 2: R optimizer steps on each batch
            sums.add(_optimizer_step(run, xb, yb, epoch, start))
            done += 1
            meter.update(done, estimate=sums.loss / sums.count, detail=detail)
    row = {
        "epoch": epoch + 1,
        "lr": lr,
        "train_loss": sums.loss / sums.count,
        "train_objective": sums.objective / sums.count,
        "train_accuracy": _accuracy(cfg.loss, sums.correct, sums.counted),
        "grad_evals": sums.grad_evals,
        "penalties": {k: v / sums.count for k, v in sums.penalties.items()},
        "noise_finetune": finetune,
    }
    if splits.has_test:
        ev = evaluate(model, splits.x_test, splits.y_test, cfg.loss)
        row["test_loss"], row["test_accuracy"] = ev["loss"], ev["accuracy"]
    row["seconds"] = time.perf_counter() - t0
    return row


def _batch(run: _Run, rows: torch.Tensor, noise_std: float) -> tuple[torch.Tensor, torch.Tensor]:
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


def _optimizer_step(run: _Run, xb: torch.Tensor, yb: torch.Tensor, epoch: int, start: int):
    """One regularised step on the batch (data-parallel under torchrun); returns its StepStats.

    NumericalError when the objective is not finite (``start``: the batch's first sample).
    """
    from sharpcli.training.regularizers import training_step

    step = data_parallel_step if run.world > 1 else training_step
    stats = step(run.model, xb, yb, run.cfg.loss, run.regs, run.step_gen)
    if not math.isfinite(stats.objective):
        raise NumericalError(
            f"the training objective became {stats.objective} in epoch {epoch + 1} at sample {start}; "
            "lower `lr` or the regularizer strength",
            source="train",
        )
    run.optimizer.step()
    return stats


def _finish_run(run: _Run, out: Path, model_spec: dict) -> TrainResult:
    """Evaluate the trained model, write the checkpoint and history CSV (rank 0), and report.

    Both files are published together (:func:`sharpcli.atomic.publication`), under the CLI
    with the final resumable state, the plot and the report at the end of the command.
    NumericalError when the final training loss is not finite.
    """
    cfg, model, splits, history = run.cfg, run.model, run.splits, run.history
    final_train = evaluate(model, splits.x_train, splits.y_train, cfg.loss)
    final = {
        "epochs_completed": len(history),
        "train_loss": final_train["loss"],
        "train_accuracy": final_train["accuracy"],
    }
    if splits.has_test:
        ev = evaluate(model, splits.x_test, splits.y_test, cfg.loss)
        final["test_loss"], final["test_accuracy"] = ev["loss"], ev["accuracy"]
    final["grad_evals"] = sum(r["grad_evals"] for r in history)
    final["seconds"] = sum(r["seconds"] for r in history)
    if not math.isfinite(final["train_loss"]):
        raise NumericalError("the final training loss is not finite", source="train")
    cfg_dict = json.loads(json.dumps(asdict(cfg)))
    records = [reg.run_record() for reg in run.regs]
    csv_path = history_csv_path_for(out)
    data_spec = splits.dataset.spec
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
                train_config=cfg_dict | {"regularizers": records},
                metrics=metrics,
            )
            _write_history_csv(csv_path, history)
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
    )


def _save_state(path: Path, run: _Run, epoch: int, *, last: bool = False) -> None:
    """Write the resumable state after ``epoch`` completed epochs (atomically).

    It is published at once, so that an interrupted run resumes from its last epoch, except
    after the ``last`` epoch: that state joins the publication in effect (the command's, with
    the checkpoint and history), so a run that fails at the end leaves the state before it."""
    state = {
        "version": STATE_VERSION,
        "epoch": epoch,
        "config": json.dumps(asdict(run.cfg), sort_keys=True),
        "model": copy.deepcopy(run.model.state_dict()),
        "optimizer": run.optimizer.state_dict(),
        "rng_global": torch.get_rng_state(),
        "rng_shuffle": run.shuffle_gen.get_state(),
        "rng_step": run.step_gen.get_state(),
        "rng_aug": run.aug_gen.get_state(),
        "history": json.dumps(run.history),
    }
    with publication(own=not last):
        write_atomic(path, lambda fh: torch.save(state, fh))


# --------------------------------------------------------------------------- data-parallel training
# Under torchrun (WORLD_SIZE > 1, see sharpcli.distributed) every rank runs the same loop with the
# same seeds: the same initial weights, shuffle, augmentation and step generator. Each global batch
# (augmented and noised whole, so the random streams match a single process) is split into
# contiguous per-rank rows; a rank runs ``training_step`` on its rows and the gradients are then
# all-reduced as the row-weighted average sum_r (B_r / B) grad_r, which is the gradient of the
# global batch whenever the regularised objective is an average over samples of terms that
# share every random draw across ranks. Whether that holds is part of each regularizer's own
# record: its class attribute ``data_parallel`` (sharpcli.training.regularizers) is None when
# exact and otherwise the reason it is not (a penalty nonlinear in the batch gradient; an
# ascent step that needs the global gradient first), and such regularizers are refused.
# BatchNorm: batch statistics over each rank's rows (as torch DDP without SyncBatchNorm), not
# over the global batch; running statistics are row-weighted averages of the ranks' updates,
# so every rank keeps the same buffers. Results then differ from a single process.
# The model is not wrapped in torch's DistributedDataParallel: a step may run several forward and
# backward passes (oracles, double backward) and only the final gradient is to be averaged.


def data_parallel_rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the torchrun process group, ``(0, 1)`` in a single process."""
    from sharpcli.distributed import rank_and_world

    return rank_and_world()


def check_data_parallel_regs(regs) -> None:
    """Refuse (UsageError on ``--reg``) the regularizers whose per-rank gradients cannot be
    averaged, quoting each one's ``data_parallel`` reason."""
    from sharpcli.training.regularizers import data_parallel_refusal

    reasons_by_name = {r.name: data_parallel_refusal(r) for r in regs}
    refused = [name for name, reason in reasons_by_name.items() if reason is not None]
    if refused:
        reasons = "; ".join(f"{name}: {reasons_by_name[name]}" for name in refused)
        raise UsageError(
            f"cannot train data-parallel with {', '.join(refused)} ({reasons}); "
            "run it in one process",
            source="regs",
        )


def data_parallel_step(
    model: nn.Module,
    xb: torch.Tensor,
    yb: torch.Tensor,
    loss_name: str,
    regs,
    generator: torch.Generator,
):
    """One training step on this rank's rows of the global batch, gradients averaged over ranks.

    Rank ``r`` of ``W`` takes rows ``[floor(r B / W), floor((r+1) B / W))`` (``B_r`` of them) and
    runs :func:`training_step`; then ONE all-reduce (``sharpcli.curvature.data.all_reduce_sum``)
    sums ``(B_r / B) grad_r`` (left in ``.grad``), ``(B_r / B)`` times each floating buffer
    (BatchNorm running statistics), and the step statistics (loss, objective and penalties
    weighted by ``B_r``; correct, predictions counted and count summed). A rank with no rows contributes zeros.
    ``grad_evals`` stays the per-rank count. Returns the global batch's :class:`StepStats`.
    """
    from sharpcli.curvature.data import all_reduce_sum
    from sharpcli.training.regularizers import StepStats, training_step

    rank, world = data_parallel_rank_and_world()
    total = xb.shape[0]
    lo, hi = (rank * total) // world, ((rank + 1) * total) // world
    rows = hi - lo
    params = [p for p in model.parameters() if p.requires_grad]
    penalty_names = [r.name for r in regs if r.kind == "penalty"]
    if rows > 0:
        stats = training_step(model, xb[lo:hi], yb[lo:hi], loss_name, regs, generator)
    else:
        for p in params:
            p.grad = torch.zeros_like(p)
        stats = StepStats(loss=0.0, objective=0.0, correct=0, count=0, grad_evals=0)
    weight = rows / total
    float_buffers = [b for b in model.buffers() if b.is_floating_point()]
    int_buffers = [b for b in model.buffers() if not b.is_floating_point()]
    has_rows = 1.0 if rows > 0 else 0.0
    head = [
        stats.loss * rows,
        stats.objective * rows,
        float(stats.correct),
        float(stats.count),
        has_rows,
        float(stats.counted),
    ]
    head += [stats.penalties.get(name, 0.0) * rows for name in penalty_names]
    parts = [torch.tensor(head, dtype=torch.float64)]
    parts += [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64).cpu()
        * weight
        for p in params
    ]
    parts += [b.reshape(-1).to(torch.float64).cpu() * weight for b in float_buffers]
    parts += [b.reshape(-1).to(torch.float64).cpu() * has_rows for b in int_buffers]
    flat = torch.cat(parts)
    all_reduce_sum(flat)
    offset = len(head)
    reduced_head = flat[:offset].tolist()
    tagged = (
        [("grad", p) for p in params]
        + [("float", b) for b in float_buffers]
        + [("int", b) for b in int_buffers]
    )
    for kind, tensor in tagged:
        piece = flat[offset : offset + tensor.numel()].view(tensor.shape)
        offset += tensor.numel()
        if kind == "grad":
            tensor.grad = piece.to(device=tensor.device, dtype=tensor.dtype).clone()
        elif kind == "float":
            tensor.copy_(piece.to(tensor.dtype))
        else:  # integer buffers (num_batches_tracked): the common value of the ranks with rows
            tensor.copy_(torch.round(piece / reduced_head[4]).to(tensor.dtype))
    count = reduced_head[3]
    return StepStats(
        loss=reduced_head[0] / count,
        objective=reduced_head[1] / count,
        correct=int(round(reduced_head[2])),
        count=int(round(count)),
        grad_evals=int(stats.grad_evals),
        penalties={name: reduced_head[6 + i] / count for i, name in enumerate(penalty_names)},
        counted=int(round(reduced_head[5])),
    )
