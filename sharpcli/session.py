"""Resolve a checkpoint, a data spec and the common options into one analysis session.

Every analysis command starts here: the model is rebuilt (own checkpoint or
foreign state_dict), moved to the device and dtype, put in eval mode
(BatchNorm uses running statistics, dropout off, as PyHessian does); the
analysis set is the chosen split, optionally a fixed seeded subset, checked
against the model (features it accepts, labels within its classes, finite
values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sharpcli.errors import InputError, UsageError
from sharpcli.io.checkpoints import LoadedCheckpoint, load_checkpoint

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; accepted: float32, float64", source="--dtype")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r}", source="--device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "CUDA was asked for but this torch build sees no CUDA device", source="--device"
        )
    if device.type == "mps" and not (
        hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    ):
        raise UsageError("MPS was asked for but is not available", source="--device")
    # torch.device() accepts every device type torch knows of (meta, xpu, hpu, ...), available or
    # not; a value that holds and returns a number is one the analyses and training can run on.
    # 'meta' tensors have shapes but no data, so nothing could be computed there.
    try:
        usable = torch.ones(1, device=device).add(1).item() == 2.0
    except (
        Exception
    ) as exc:  # RuntimeError, NotImplementedError, AssertionError: not built/available
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"device {name!r} cannot hold data here ({first})", source="--device"
        ) from None
    if not usable:
        raise UsageError(f"device {name!r} does not compute correctly", source="--device")
    return device


def loss_for_task(task: str) -> str:
    return "mse" if task == "regression" else "cross-entropy"


def check_model_accepts(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str, source: str
) -> int:
    """Run one sample through the model; return its number of outputs.

    Catches what a user can get wrong: features of the wrong shape, labels out
    of the model's range, regression targets of the wrong width.
    """
    if x.shape[0] == 0:
        raise InputError("the analysis set is empty", source=source)
    try:
        with torch.no_grad():
            out = model(x[:1])
    except (RuntimeError, ValueError, IndexError) as exc:
        shape = tuple(x.shape[1:])
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"samples of shape {shape} do not fit the model ({first})", source=source
        ) from None
    if out.ndim != 2:
        raise InputError(
            f"the model returns outputs of shape {tuple(out.shape)}, expected (batch, classes)",
            source=source,
        )
    n_out = out.shape[1]
    if task == "classification":
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= n_out):
            raise InputError(
                f"labels range over [{int(y.min())}, {int(y.max())}] but the model has {n_out} classes",
                source=source,
            )
    else:
        width = 1 if y.ndim == 1 else y.shape[1]
        if width != n_out:
            raise InputError(
                f"targets have {width} columns but the model has {n_out} outputs", source=source
            )
    return n_out


def check_deterministic_forward(model: nn.Module, x: torch.Tensor, source: str) -> None:
    """Refuse a model that is not deterministic in analysis mode (SPEC section 1: eval mode).

    The analysis loss ``L(theta)`` must be a function of ``theta``: a module still in training
    mode that behaves differently there (dropout with p > 0, BatchNorm on batch statistics,
    see :func:`sharpcli.curvature.data.train_mode_modules`; possible when a foreign model
    overrides ``train()``), or a forward that draws random numbers whatever the mode (e.g.
    ``F.dropout(x, training=True)``), would make every curvature product random. Checked on the
    first batch: two forward passes must give bit-identical logits (the global RNG state is
    restored afterwards). Raises :class:`UsageError` naming the modules or the difference.
    """
    from sharpcli.curvature.data import train_mode_modules

    offenders = train_mode_modules(model)
    if offenders:
        shown = ", ".join(offenders[:5]) + (" ..." if len(offenders) > 5 else "")
        raise InputError(
            f"the model stays in training mode after eval() in {shown} (dropout/BatchNorm active): "
            "curvature would be random",
            source=source,
        )
    if x.shape[0] == 0:
        return
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        first = model(x)
        second = model(x)
    if not torch.equal(first, second):
        both_nan = torch.isnan(first) & torch.isnan(second)
        if not torch.equal(first[~both_nan], second[~both_nan]):
            diff = float((first - second)[~both_nan].abs().max())
            raise InputError(
                f"the model is not deterministic in eval mode: two forward passes on the same inputs differ "
                f"by up to {diff:.3g} (a layer draws random numbers, e.g. dropout with training=True): "
                "curvature would be random",
                source=source,
            )


@dataclass
class Session:
    """A model in analysis mode and its analysis set, with what produced them."""

    checkpoint: LoadedCheckpoint
    model: nn.Module
    dataset: object  # sharpcli.io.datasets.Dataset
    x: torch.Tensor
    y: torch.Tensor
    loss: str
    split: str
    batch_size: int
    device: torch.device
    dtype: torch.dtype
    seed: int
    num_outputs: int
    cache_bytes: int = 1 << 30  # budget of cached first-order graphs in curvature passes
    extra: dict = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return int(self.x.shape[0])

    def data_info(self) -> dict:
        return {"spec": self.dataset.spec, "split": self.split, "samples": self.num_samples}

    def analysis_data(self):
        """The analysis set as the curvature engine streams it."""
        from sharpcli.curvature import AnalysisData

        return AnalysisData(self.x, self.y, loss=self.loss, batch_size=self.batch_size)

    def scope(self, spec: str | None):
        from sharpcli.curvature import ParamScope

        return ParamScope.resolve(self.model, spec)

    def environment(self) -> dict:
        from sharpcli.curvature.data import distributed_rank_and_world
        from sharpcli.report.envelope import environment_info

        _, world = distributed_rank_and_world()
        return environment_info(str(self.device), str(self.dtype).replace("torch.", ""), world)

    def report(self, command: str, settings: dict, results: dict, matvecs: int = 0) -> dict:
        from sharpcli.report.envelope import make_report

        return make_report(
            command,
            settings=settings,
            results=results,
            checkpoint=self.checkpoint.info(),
            data=self.data_info(),
            timing={"seconds": 0.0, "matvecs": int(matvecs)},
            environment=self.environment(),
        )


def build_session(
    checkpoint: str,
    *,
    data: str | None = None,
    label_column: str | None = None,
    split: str = "train",
    samples: int | None = None,
    batch_size: int = 256,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    arch: str | None = None,
    arch_args: dict | None = None,
    model_factory: str | None = None,
    trust_pickle: bool = False,
    cache_mb: int = 1024,
    **_ignored,
) -> Session:
    """Load everything an analysis needs; every user mistake is an InputError/UsageError."""
    from sharpcli.io.datasets import load_dataset, subset

    if split not in ("train", "test"):
        raise UsageError(f"unknown split {split!r}; accepted: train, test", source="--split")
    if batch_size < 1:
        raise UsageError("must be at least 1", source="--batch-size")
    if samples is not None and samples < 1:
        raise UsageError("must be at least 1", source="--samples")
    if cache_mb < 0:
        raise UsageError("must be >= 0", source="--cache-mb")
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)

    ckpt = load_checkpoint(
        checkpoint,
        arch=arch,
        arch_args=arch_args,
        model_factory=model_factory,
        trust_pickle=trust_pickle,
    )
    data_spec = data if data is not None else ckpt.data_spec
    if data_spec is None:
        raise UsageError(
            f"the checkpoint {checkpoint} names no dataset; pass --data", source="--data"
        )
    dataset = load_dataset(data_spec, label_column=label_column)
    x, y = dataset.split(split)
    x, y = subset(x, y, samples, seed)

    # requires_grad stays as the model sets it: frozen parameters (a fine-tuned backbone) are
    # outside the default scope (sharpcli.curvature.scope.ParamScope.resolve)
    model = ckpt.model.to(device=torch_device, dtype=torch_dtype).eval()
    x = x.to(device=torch_device, dtype=torch_dtype)
    y = y.to(device=torch_device)
    if dataset.task == "regression":
        y = y.to(torch_dtype)
    loss = (ckpt.train_config or {}).get("loss") or loss_for_task(dataset.task)
    n_out = check_model_accepts(model, x, y, dataset.task, dataset.source)
    check_deterministic_forward(model, x[: min(int(batch_size), 64)], source=checkpoint)
    return Session(
        checkpoint=ckpt,
        model=model,
        dataset=dataset,
        x=x,
        y=y,
        loss=loss,
        split=split,
        batch_size=batch_size,
        device=torch_device,
        dtype=torch_dtype,
        seed=seed,
        num_outputs=n_out,
        cache_bytes=int(cache_mb) << 20,
    )
