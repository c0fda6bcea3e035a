"""Resolve a checkpoint, a data spec and the common options into one analysis session.

Every analysis command starts here: the model is rebuilt (own checkpoint or
foreign state_dict), moved to the device and dtype, put in eval mode
(BatchNorm uses running statistics, dropout off, as PyHessian does); the
analysis set is the chosen split, optionally a fixed seeded subset, checked
against the model (features it accepts, labels within its classes, finite
values). Features take the analysis dtype, except token ids looked up by an
``nn.Embedding``, which reach the model as int64 (:func:`sharpcli.preflight.prepare_features`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from sharpcli import memory, phases
from sharpcli.catalogue.values import SPLITS, TRAIN
from sharpcli.curvature import AnalysisData, ParamScope
from sharpcli.curvature.products.data import distributed_rank_and_world
from sharpcli.errors import InputError, UsageError
from sharpcli.io.checkpoints import META_DATA, META_TRAIN, LoadedCheckpoint, load_checkpoint
from sharpcli.io.data.dataset import Dataset
from sharpcli.io.data.loading import load_dataset, subset
from sharpcli.io.torch_losses.causal_lm import (
    causal_lm_name,
    check_own_loss_of_batch,
    input_ids_of,
    labels_shifted_by_hand,
    own_loss_note,
)
from sharpcli.io.torch_losses.options import LossSpec, configure_loss, parse_loss_spec, reference
from sharpcli.io.torch_losses.readings import (
    LossReading,
    check_loss_value,
    read_loss,
    reference_loss,
)
from sharpcli.losses import (
    CROSS_ENTROPY,
    IGNORE_INDEX,
    LOSSES,
    TOKEN_CROSS_ENTROPY,
    get_loss,
    set_token_reduction,
)
from sharpcli.models.outputs import attach_keyword_inputs, attach_output_selector
from sharpcli.preflight import (
    SECOND_DERIVATIVE_SAMPLES,
    altered_derivative_notes,
    check_deterministic_forward,
    check_second_derivatives,
    check_seed,
    infer_loss,
    model_outputs,
    prepare_features_and_outputs,
    release_padding_rows,
    resolve_device,
    resolve_dtype,
    self_check_bytes,
    self_check_samples,
    to_analysis_dtype,
    unreached_parameter_notes,
)
from sharpcli.report.envelope import environment_info, make_report


@dataclass(frozen=True)
class LossOrigin:
    """Where the loss of an analysis came from, for the report: ``source`` is ``"option"``
    (``--loss``), ``"checkpoint"`` (the training loss its metadata stores), ``"inferred"``
    (from the model's outputs and the labels, :func:`sharpcli.preflight.infer_loss`) or
    ``"model"`` (the model's own loss on a batch with labels); ``reason`` says it in words."""

    source: str
    reason: str


@dataclass
class Session:
    """A model in analysis mode and its analysis set, with what produced them."""

    checkpoint: LoadedCheckpoint
    model: nn.Module
    dataset: Dataset
    x: torch.Tensor
    y: torch.Tensor
    loss: str
    split: str
    batch_size: int
    device: torch.device
    dtype: torch.dtype
    seed: int
    num_outputs: int
    loss_origin: LossOrigin | None = None  # None: a session built by hand (tests)
    # budget of cached first-order graphs in curvature passes; None: up to what the memory
    # plan leaves (sharpcli.curvature.operators.hessian.CurvatureEngine.plan_memory)
    cache_bytes: int | None = None
    # token-cross-entropy: "tokens" (mean over all labelled tokens) or "samples", and the mean
    # labelled positions per sample that the token mean divides by
    token_reduction: str | None = None
    mean_positions: float | None = None
    extra: dict = field(default_factory=dict)
    # what was done to the checkpoint and the data (stderr); the report keeps the checkpoint's
    # in checkpoint.notes and the rest in data.notes
    notes: list[str] = field(default_factory=list)
    # the loss is a Hugging Face causal LM's own (sharpcli.io.torch_losses.causal_lm), checked against its
    # `loss` on the first batch; the note saying so is in notes
    loss_from_model: bool = False

    @property
    def num_samples(self) -> int:
        """The number of samples analysed."""
        return int(self.x.shape[0])

    def data_info(self) -> dict:
        """The report's ``data`` section; ``notes`` (e.g. float ids converted) when there are any."""
        info = {
            "spec": self.dataset.spec,
            "split": self.split,
            "samples": self.num_samples,
            "loss": self.loss,
        }
        if self.loss_origin is not None:
            info["loss_source"] = self.loss_origin.source
            info["loss_reason"] = self.loss_origin.reason
        if self.token_reduction is not None:
            info["token_reduction"] = self.token_reduction
        notes = [note for note in self.notes if note not in self.checkpoint.notes]
        if notes:
            info["notes"] = notes
        return info

    def analysis_data(self):
        """The analysis set as the curvature engine streams it."""

        return AnalysisData(self.x, self.y, loss=self.loss, batch_size=self.batch_size)

    def scope(self, spec: str | None):
        """The parameter scope of ``spec`` in the model (:meth:`ParamScope.resolve`)."""

        return ParamScope.resolve(self.model, spec)

    def environment(self) -> dict:
        """The report's ``environment`` section for this session's device, dtype and world size."""

        _, world = distributed_rank_and_world()
        return environment_info(str(self.device), str(self.dtype).replace("torch.", ""), world)

    def report(self, command: str, settings: dict, results: dict, matvecs: int = 0) -> dict:
        """The full report of ``command`` with this session's checkpoint, data and environment."""

        return make_report(
            command,
            settings=settings,
            results=results,
            checkpoint=self.checkpoint.info(),
            data=self.data_info(),
            timing={"seconds": 0.0, "matvecs": int(matvecs)},
            environment=self.environment(),
        )


def _load_data(spec, label_column: str | None, from_checkpoint: str | None, **options):
    """``load_dataset(spec)``; when the spec is the checkpoint's own (``from_checkpoint``, no
    ``--data`` given), a bad spec is an InputError naming the checkpoint's metadata, not the
    ``--data`` option the user never gave. How a metadata path resolves: docs/checkpoints.md."""

    what = "the `data` file" if from_checkpoint is None else f"the data named in {from_checkpoint}"
    try:
        return load_dataset(spec, label_column=label_column, what=what, **options)
    except UsageError as err:
        if from_checkpoint is None or err.source != "data":
            raise
        raise InputError(f"metadata {META_DATA}: {err.message}", source=from_checkpoint) from None


def _metadata_loss(ckpt: LoadedCheckpoint, checkpoint: str) -> str | None:
    """The training loss the checkpoint's metadata names (None: infer it from the outputs);
    anything but a registered loss name is an InputError naming the checkpoint."""

    loss = (ckpt.train_config or {}).get("loss")
    if loss is not None and (not isinstance(loss, str) or loss not in LOSSES):
        raise InputError(
            f"metadata {META_TRAIN}: 'loss' is not one of {', '.join(LOSSES)}", source=checkpoint
        )
    return loss


def _labels_problem(reading: LossReading, out: torch.Tensor, y: torch.Tensor) -> str | None:
    """The loss's check (:attr:`sharpcli.losses.Loss.check`) of every label of the set against
    the model's outputs ``out`` on its first rows: the first rows' labels with their own
    outputs, then each following block of as many rows against outputs of as many rows (the
    checks compare shapes per sample and the labels' values, so an outputs-labels pair always
    has one row count; one sample's outputs against all labels would compare (1, 1) with
    (N, 1)). The first problem found, or None."""
    declared = get_loss(reading.name)
    rows = int(out.shape[0])
    for start in range(0, int(y.shape[0]), rows):
        labels = y[start : start + rows]
        problem = declared.problem(reading.outputs(out[: labels.shape[0]]), reading.labels(labels))
        if problem:
            return problem
    return None


def _analysis_loss(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    dataset,
    checkpoint: str,
    *,
    loss: str | None,
    stored: str | None,
    outputs: torch.Tensor | None = None,
) -> tuple[LossReading, torch.Tensor, LossOrigin]:
    """The loss of the analysis, how it reads the model's outputs on the first batch ``x``
    and the labels ``y`` (:func:`sharpcli.io.torch_losses.readings.read_loss`), the outputs
    themselves (the deterministic-forward check's first pass), and
    where the loss came from (:class:`LossOrigin`).

    ``loss`` (the option) over the checkpoint's ``stored`` loss; neither: cross-entropy read
    from the outputs' shape for K-dimensional outputs, else the loss
    :func:`~sharpcli.preflight.infer_loss` picks. Labels that do not fit the loss are an
    InputError on the data, or on the checkpoint naming its stored loss and the option that
    overrides it when the stored loss chose; sharp's loss on the batch must equal torch's
    (:func:`~sharpcli.io.torch_losses.readings.check_loss_value`). ``outputs``: the model's
    outputs on ``x`` from an earlier forward pass (no gradients, eval mode: the token-id
    check's first batch), which then stand for this one.
    """

    if isinstance(outputs, torch.Tensor) and outputs.shape[0] == x.shape[0]:
        out = outputs
    else:
        out = model_outputs(model, x, dataset.source)
    spec = parse_loss_spec(loss) if loss is not None else None  # NAME[:k=v,...]
    if spec is not None:
        name = spec.name
        origin = LossOrigin("option", "named by the user")
    elif stored is not None:
        name = stored
        origin = LossOrigin("checkpoint", f"the training loss stored in {checkpoint}")
    elif dataset.task != "regression" and out.ndim >= 3:
        name = CROSS_ENTROPY  # torch's cross-entropy; read_loss finds where its classes lie
        origin = LossOrigin("inferred", "inferred: class labels per position")
    else:
        name, reason = infer_loss(dataset.task, out, y)
        origin = LossOrigin("inferred", reason)

    def mismatch(problem: str) -> InputError:
        if loss is None and stored is not None:  # the checkpoint's loss does not fit the data
            return InputError(
                f"its stored loss {stored!r} does not fit {dataset.source}: {problem}; choose "
                "the loss with `loss`",
                source=checkpoint,
            )
        return InputError(problem, source=dataset.source)

    head = y[: out.shape[0]]
    try:
        reading = read_loss(name, out, head, named=loss is not None or stored is not None)
    except UsageError as err:
        if err.source != "data":
            raise
        raise mismatch(err.message) from None
    torch_loss = reference(spec) or reference_loss(reading)
    # torch's options over the whole set (sharpcli.io.torch_losses.options)
    configured = configure_loss(spec or LossSpec(name), reading.name, reading.labels(y))
    reading = LossReading(configured, reading.layout)
    problem = _labels_problem(reading, out, y)
    if problem:
        raise mismatch(problem)
    ignore = IGNORE_INDEX if get_loss(reading.name).softmax else None
    label = f"torch's {spec.text if spec is not None else name}"
    check_loss_value(torch_loss, reading, out, head, ignore, label)
    if origin.source == "inferred" and name == CROSS_ENTROPY and out.ndim >= 3:
        origin = LossOrigin(
            "inferred",
            "inferred: class labels per position, classes on dim 1 as torch's cross_entropy"
            if reading.layout == "classes-last"
            else "inferred: labels (batch, length) for outputs (batch, length, vocabulary)",
        )
    return reading, out, origin


def _check_options(
    split: str,
    batch_size: int,
    samples: int | None,
    cache_mb: int | None,
    seed: int,
    loss: str | None,
) -> None:
    """The options a user can get wrong, refused before anything loads (UsageError naming
    each): an unknown split, sizes below their minimum, a seed out of range, an unknown loss
    or loss option (listing the accepted ones)."""
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r}; accepted: train, test", source="split")
    if batch_size < 1:
        raise UsageError("must be at least 1", source="batch_size")
    if samples is not None and samples < 1:
        raise UsageError("must be at least 1", source="samples")
    if cache_mb is not None and cache_mb < 0:
        raise UsageError("must be >= 0", source="cache_mb")
    check_seed(seed)
    if loss is not None and parse_loss_spec(loss).get("ignore_index") != IGNORE_INDEX:
        raise UsageError(
            "ignore_index is the library's (nn.CrossEntropyLoss(ignore_index=...)); in a "
            f"data file label the ignored samples or positions {IGNORE_INDEX}",
            source="loss",
        )


def _placed_model(
    ckpt: LoadedCheckpoint,
    dataset: Dataset,
    output: str | None,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """The checkpoint's model on ``device`` in ``dtype``, in eval mode, called as the data
    asks and returning one logits tensor."""
    # requires_grad stays as the model sets it: frozen parameters (a fine-tuned backbone) are
    # outside the default scope (sharpcli.curvature.products.scope.ParamScope.resolve)
    model = ckpt.model.to(device=device, dtype=dtype).eval()
    # a tuple, dict or .logits output becomes one logits tensor (sharpcli.models.outputs);
    # the selector a training run used is recorded in its checkpoint
    if output is None:
        output = (ckpt.train_config or {}).get("output")
    attach_output_selector(model, output)
    # model(**batch), or model(batch) for forward(self, batch) (sharpcli.models.outputs)
    attach_keyword_inputs(model, dataset.input_keys, shapes=dataset.input_shapes)
    return model


def _placed_targets(
    y: torch.Tensor, dataset: Dataset, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The labels on ``device``; regression targets in the analysis dtype too."""
    y = y.to(device=device)
    if dataset.task == "regression":
        y = to_analysis_dtype(y, dtype, device, dataset.source, "targets")
    return y


def _read_as_loss(
    model: nn.Module,
    reading: LossReading,
    out_shape: tuple,
    y: torch.Tensor,
    token_reduction: str,
    notes: list[str],
) -> torch.Tensor:
    """The labels as the registered loss takes them; a model whose outputs the loss reads
    reshaped returns them so (a forward hook) and ``notes`` says what was done."""
    if reading.layout == "classes-last" and token_reduction == "samples":
        raise UsageError(
            "cross-entropy on outputs (N, C, d1, ..., dk) is the mean over every labelled "
            "position, as torch computes it; `token_reduction=samples` is for "
            f"{TOKEN_CROSS_ENTROPY}",
            source="token_reduction",
        )
    if not reading.reshapes:
        return y
    model.register_forward_hook(lambda module, args, out: reading.outputs(out))
    note = reading.note(out_shape)  # every reshaping layout says what it did
    if note is not None:
        notes.append(note)
    return reading.labels(y)


def build_session(
    checkpoint: str,
    *,
    data: str | None = None,
    label_column: str | None = None,
    x_key: str | None = None,
    y_key: str | None = None,
    shift_labels: bool | None = None,
    x_shape: str | None = None,
    split: str = TRAIN,
    samples: int | None = None,
    batch_size: int = 256,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    arch: str | None = None,
    arch_args: dict | None = None,
    model_factory: str | None = None,
    trust_pickle: bool = False,
    cache_mb: int | None = None,
    output: str | None = None,
    curvature: bool = True,
    double_backward: bool = True,
    max_memory: str | int | None = None,
    token_reduction: str = "tokens",
    loss: str | None = None,
) -> Session:
    """Load everything an analysis needs; every user mistake is an InputError/UsageError.

    ``curvature`` (default): the analysis differentiates the model twice, so torch's second
    derivatives of it are checked first (:func:`check_second_derivatives`); analyses of
    first derivatives and activations only (``activation-stats``) pass False. An analysis
    whose Hessian products are differences of gradients (``hvp=finite-difference``) passes
    ``double_backward=False``: it never differentiates twice, so the check is skipped (and a
    model without a double backward is accepted).
    """

    _check_options(split, batch_size, samples, cache_mb, seed, loss)
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    # the run's memory plan (sharpcli.memory): estimators size themselves from it
    plan = memory.activate(memory.MemoryPlan.for_run(max_memory, str(torch_device)))

    ckpt = load_checkpoint(
        checkpoint,
        arch=arch,
        arch_args=arch_args,
        model_factory=model_factory,
        trust_pickle=trust_pickle,
    )
    stored = _metadata_loss(ckpt, checkpoint)
    # a Hugging Face causal LM with no loss named: its own loss, its labels read as it reads them
    causal_lm = causal_lm_name(ckpt.model) if loss is None and stored is None else None
    data_spec = data if data is not None else ckpt.data_spec
    if data_spec is None:
        raise UsageError(
            f"the checkpoint {checkpoint} names no dataset; pass `data`", source="data"
        )
    dataset = _load_data(
        data_spec,
        label_column,
        checkpoint if data is None else None,
        x_key=x_key,
        y_key=y_key,
        shift_labels=shift_labels,
        x_shape=x_shape,
        trust_pickle=trust_pickle,
        causal_lm=causal_lm,
    )
    x, y = dataset.split(split)
    x, y = subset(x, y, samples, seed)

    model = _placed_model(ckpt, dataset, output, torch_device, torch_dtype)
    # for token ids the id check's first batch is the loss read's forward pass too
    prepared = prepare_features_and_outputs(
        model, x, torch_dtype, torch_device, dataset.source, batch_size=batch_size
    )
    x, notes = prepared.x, prepared.notes
    if curvature:  # pad rows' zeroed gradients are no derivative (release_padding_rows)
        notes += release_padding_rows(model)
    y = _placed_targets(y, dataset, torch_device, torch_dtype)
    phases.mark(phases.LOAD)  # the checkpoint, the data and the model on its device
    shifted_here = bool((dataset.spec or {}).get("shift_labels"))
    own_loss = causal_lm is not None and (
        shifted_here
        or labels_shifted_by_hand(input_ids_of(x, dataset.input_keys, dataset.input_shapes), y)
    )
    reading, first_outputs, origin = _analysis_loss(
        model,
        x[:batch_size],
        y,
        dataset,
        checkpoint,
        loss=TOKEN_CROSS_ENTROPY if own_loss else loss,
        stored=stored,
        outputs=prepared.first_outputs,
    )
    del prepared
    if (
        own_loss
    ):  # the number differentiated is the model's own `loss` (sharpcli.io.torch_losses.causal_lm)
        check_own_loss_of_batch(model, x[:batch_size], dataset.input_keys, y, token_reduction)
        origin = LossOrigin("model", own_loss_note(str(causal_lm), shifted_here))
    out_shape = tuple(first_outputs.shape)
    checked = x[: min(int(batch_size), 64)]
    # the loss's forward pass (no gradients, eval mode) on the same samples is the check's
    # first pass: one forward of the first batch less (0.7 CPU s at GPT-2 small); checked
    # before the loss's reshaping hook is attached, as that pass ran without it
    same = checked.shape[0] == first_outputs.shape[0] and not model.training
    check_deterministic_forward(
        model, checked, source=checkpoint, first=first_outputs if same else None
    )
    del first_outputs, checked
    y = _read_as_loss(model, reading, out_shape, y, token_reduction, notes)
    loss, n_out = reading.name, math.prod(out_shape[1:])
    plan.baseline = memory.allocated_bytes(str(torch_device))  # model and data now loaded
    # the token loss's average (sharpcli.losses.set_token_reduction) over this analysis set
    mean_positions = None
    per_token = get_loss(loss).per_token
    if per_token:
        mean_positions = set_token_reduction(token_reduction, y)
    if curvature and double_backward:  # the analysis differentiates the model twice
        with plan.hold("second-derivative self-check", self_check_bytes(model)):
            check_second_derivatives(
                model, x[: self_check_samples(model)], y, loss, source=checkpoint
            )
        notes += altered_derivative_notes(model)
    notes += unreached_parameter_notes(model, x[:SECOND_DERIVATIVE_SAMPLES], y, loss)
    phases.mark(phases.PREFLIGHT)
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
        loss_origin=origin,
        cache_bytes=None if cache_mb is None else int(cache_mb) << 20,
        token_reduction=token_reduction if per_token else None,
        mean_positions=mean_positions,
        notes=[*ckpt.notes, *notes],
        loss_from_model=own_loss,
    )
