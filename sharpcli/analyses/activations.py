"""Activation statistics of [MAN] section 2 and the output-level quantities of MAN sections 5-5.3.

Per activation layer (every module of :data:`sharpcli.models.activations.ACTIVATION_TYPES`,
one entry per call of the module in a forward pass), over the analysis set of B samples:

- an *output* is one entry of the layer's per-sample output: a unit of a dense layer, one
  (channel, position) of a convolutional feature map; N is their number per sample;
- an output is *active* on sample i where its pre-activation (the module's input) is ``> 0``
  (so ReLU, GELU, beta-GELU, ... are all counted the same way); ``M_i`` = inactive outputs;
- an output is *dead* when it is inactive for every one of the B samples; P = dead outputs;
- death frequency ``xi = P / N`` (MAN section 2);
- activation frequency ``eta = 1 - (1/B) sum_i M_i / N`` computed *excluding* the dead outputs,
  as MAN states ("activation frequency is computed excluding such dead outputs"): with
  ``N' = N - P`` and ``M'_i = M_i - P``, ``eta = 1 - (1/B) sum_i M'_i / N'
  = (sum_i A_i) / (B N')`` where ``A_i = N - M_i`` is the number of active outputs of sample i
  (a dead output is never active, so ``A_i`` counts alive outputs only). ``eta`` is undefined
  (``None``) when every output is dead. The frequency over all outputs, ``sum_i A_i / (B N)``,
  is reported beside it as ``activation_frequency_including_dead``;
- ``mean_sq_norm``: ``(1/B) sum_i ||a_i||^2`` of the layer's output (post-activation), the
  ``s_{l-1}`` of MAN section 3.1.

Output level, with ``p = softmax(z)`` (cross-entropy models): Gini impurity
``(1/B) sum_i (1 - ||p_i||^2)`` (MAN section 5), entropy ``-(1/B) sum_i sum_c p_ic log p_ic``
(nats), confidence ``(1/B) sum_i max_c p_ic``, loss (the analysis loss), accuracy.

``penultimate_sq_norm``: ``(1/B) sum_i ||h_i^(L-1)||^2`` of the input of the classifier head
(the last ``nn.Linear``), the activation-decay penalty of AD Theorem 2.

``input_jacobian_fro``: ``(1/B) sum_i ||d z_i / d x_i||_F``, the Frobenius norm of the
input-output Jacobian of the logits over all input entries (MAN Table 3, "over all pixels"),
averaged over samples; ``input_jacobian_fro_softmax`` is the same for the probabilities
``p_i`` (the variant of [Novak2018]): ``d p_c/dx = p_c (d z_c/dx - sum_k p_k d z_k/dx)``.
Both come from C + 1 reverse passes per batch, ``r_c = d (sum_i z_ic) / dx`` (row c of every
sample's Jacobian, since samples do not interact in eval mode) and ``rbar = d (sum_i p_i . z_i)/dx``
with ``p`` held constant.

All sums over samples go through :func:`sharpcli.curvature.products.data.all_reduce_sum`, so the
statistics are the same under data parallelism.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum, to_model_batch
from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss, per_sample_loss
from sharpcli.models.activations import activation_modules, activation_spec
from sharpcli.models.zoo import final_linear
from sharpcli.registry import declare

__all__ = [
    "ACTIVATION_STATS",
    "ActivationStatsResult",
    "LayerActivationStats",
    "OutputStats",
    "activation_stats",
    "activation_stats_metric",
]

# the metric of ``sharp analyze --metrics`` (and the label of its errors)
ACTIVATION_STATS = "activation-stats"
# the numbers of one layer's statistics, as ``--fail-if`` reads them
_LAYER_KEYS = (
    "outputs",
    "dead_outputs",
    "death_frequency",
    "activation_frequency",
    "activation_frequency_including_dead",
    "mean_sq_norm",
    "output_shape",
    "output_shape.*",
)


@dataclass
class LayerActivationStats:
    """MAN section 2 statistics of one activation layer (see the module docstring for the formulas)."""

    name: str
    kind: str
    output_shape: list[int]
    outputs: int
    dead_outputs: int
    death_frequency: float
    activation_frequency: float | None
    activation_frequency_including_dead: float
    mean_sq_norm: float

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


@dataclass
class OutputStats:
    """Output-level statistics: Gini impurity ``1 - ||p||^2``, entropy, confidence, loss, accuracy.

    The softmax quantities and accuracy are ``None`` for regression (mse) models.
    """

    gini_impurity: float | None
    entropy: float | None
    confidence: float | None
    loss: float
    accuracy: float | None

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


@dataclass
class ActivationStatsResult:
    """Everything ``sharp activation-stats`` reports (the keys of docs/json.md)."""

    layers: list[LayerActivationStats]
    output: OutputStats
    penultimate_sq_norm: float | None
    penultimate_layer: str | None
    input_jacobian_fro: float | None
    input_jacobian_fro_softmax: float | None
    samples: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dict with the keys of docs/json.md (``layers``, ``output``, ...)."""
        return {
            "layers": [layer.to_dict() for layer in self.layers],
            "output": self.output.to_dict(),
            "penultimate_sq_norm": self.penultimate_sq_norm,
            "penultimate_layer": self.penultimate_layer,
            "input_jacobian_fro": self.input_jacobian_fro,
            "input_jacobian_fro_softmax": self.input_jacobian_fro_softmax,
            "samples": self.samples,
            "notes": list(self.notes),
        }


class _LayerAccumulator:
    """Running sums of one activation layer: per-output active counts, ``sum ||a||^2``."""

    def __init__(self, name: str, kind: str, output_shape: tuple[int, ...], device: torch.device):
        self.name = name
        self.kind = kind
        self.output_shape = list(output_shape)
        self.outputs = math.prod(output_shape) if output_shape else 1
        self.active_counts = torch.zeros(self.outputs, dtype=torch.float64, device=device)
        self.sq_norm_sum = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, pre_activation: torch.Tensor, activation: torch.Tensor) -> None:
        """Count ``pre_activation > 0`` per output over the batch and add ``sum_i ||a_i||^2``."""
        batch = pre_activation.shape[0]
        active = (pre_activation.detach().reshape(batch, -1) > 0).to(torch.float64)
        if active.shape[1] != self.outputs:
            raise NumericalError(
                f"activation layer {self.name} changed its output size between batches "
                f"({self.outputs} then {active.shape[1]})",
                source=ACTIVATION_STATS,
            )
        self.active_counts += active.sum(dim=0)
        a = activation.detach().reshape(batch, -1).to(torch.float64)
        self.sq_norm_sum += (a * a).sum()

    def finish(self, num_samples: int) -> LayerActivationStats:
        """The layer's statistics from the (all-reduced) sums over ``num_samples`` samples."""
        dead = int((self.active_counts == 0).sum())
        total_active = float(self.active_counts.sum())
        alive = self.outputs - dead
        eta = total_active / (num_samples * alive) if alive > 0 else None
        return LayerActivationStats(
            name=self.name,
            kind=self.kind,
            output_shape=self.output_shape,
            outputs=self.outputs,
            dead_outputs=dead,
            death_frequency=dead / self.outputs,
            activation_frequency=eta,
            activation_frequency_including_dead=total_active / (num_samples * self.outputs),
            mean_sq_norm=float(self.sq_norm_sum) / num_samples,
        )


def _kind(module: nn.Module) -> str:
    return activation_spec(module) or type(module).__name__  # foreign types: their class name


def _head(model: nn.Module) -> tuple[str, nn.Module] | None:
    try:
        return final_linear(model)
    except UsageError:
        return None


class _ActivationRecorder:
    """The hooks of one analysis: a forward hook on every activation layer (one accumulator per
    layer and call in a forward pass, in call order) and a forward pre-hook on the classifier
    head summing ``||h||^2`` of its input. A context manager: the hooks live inside ``with``."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.layers = activation_modules(model)
        self.head = _head(model)
        self.accumulators: dict[tuple[str, int], _LayerAccumulator] = {}
        self.order: list[tuple[str, int]] = []
        self.calls: dict[str, int] = {}
        self.penultimate = torch.zeros((), dtype=torch.float64, device=device)
        self._handles: list = []

    def __enter__(self) -> "_ActivationRecorder":
        self._handles = [
            module.register_forward_hook(self._layer_hook(name)) for name, module in self.layers
        ]
        if self.head is not None:
            self._handles.append(self.head[1].register_forward_pre_hook(self._head_hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _layer_hook(self, name: str):
        def hook(module, inputs, output):
            index = self.calls.get(name, 0)
            self.calls[name] = index + 1
            key = (name, index)
            pre = inputs[0]
            if key not in self.accumulators:
                label = name if index == 0 else f"{name}#{index + 1}"
                self.accumulators[key] = _LayerAccumulator(
                    label, _kind(module), tuple(pre.shape[1:]), pre.device
                )
                self.order.append(key)
            self.accumulators[key].add(pre, output)

        return hook

    def _head_hook(self, module, inputs) -> None:
        h = inputs[0].detach().reshape(inputs[0].shape[0], -1).to(torch.float64)
        self.penultimate += (h * h).sum()

    def layer_sums(self) -> list[torch.Tensor]:
        """The layers' running sums, to all-reduce in place: active counts, then ``sum ||a||^2``."""
        accumulators = [self.accumulators[k] for k in self.order]
        return [acc.active_counts for acc in accumulators] + [
            acc.sq_norm_sum for acc in accumulators
        ]


_OUTPUT_SUMS = ("loss", "gini", "entropy", "confidence", "correct", "counted", "jac", "jac_softmax")


def _forward(model: nn.Module, x: torch.Tensor, with_graph: bool, batch_index: int):
    """The logits of batch ``x``; with ``with_graph`` ``x`` requires grad and the graph is kept
    (for the Jacobian). NumericalError when a logit is not finite."""
    if with_graph:
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            z = model(x)
    else:
        with torch.no_grad():
            z = model(x)
    if not torch.isfinite(z).all():
        raise NumericalError(
            f"logits are not finite on batch {batch_index}", source=ACTIVATION_STATS
        )
    return x, z


def _add_output_sums(sums: dict, loss: str, z: torch.Tensor, y: torch.Tensor) -> None:
    """Add a batch's loss, (cross-entropy) softmax statistics and the loss's count of correct
    predictions (:attr:`sharpcli.losses.Loss.correct`: per labelled position for token labels)
    to ``sums``."""
    sums["loss"] += per_sample_loss(loss, z, y).to(torch.float64).sum()
    if get_loss(loss).softmax_per_sample:
        p = torch.softmax(z.to(torch.float64), dim=-1)
        sums["gini"] += (1.0 - (p * p).sum(dim=-1)).sum()
        sums["entropy"] += (-torch.special.xlogy(p, p).sum(dim=-1)).sum()
        sums["confidence"] += p.max(dim=-1).values.sum()
    scorer = get_loss(loss).correct
    if scorer is not None:
        correct, counted = scorer(z, y)
        sums["correct"] += correct
        sums["counted"] += counted


def activation_stats(
    model: nn.Module, data: AnalysisData, *, jacobian: bool = True
) -> ActivationStatsResult:
    """MAN section 2 activation statistics, output statistics, the AD penalty and ``||J_x||_F``.

    ``model`` must be in eval mode (samples independent); ``data`` is the analysis set (its
    ``loss`` decides whether softmax statistics apply). ``jacobian=False`` skips the C + 1
    reverse passes per batch of the input-output Jacobian (both Jacobian norms are then ``None``,
    as they are for integer inputs). Raises :class:`NumericalError` when the logits are not
    finite.
    """
    params = list(model.parameters())
    dtype = params[0].dtype if params else torch.get_default_dtype()
    device = params[0].device if params else torch.device("cpu")
    sums = {k: torch.zeros((), dtype=torch.float64, device=device) for k in _OUTPUT_SUMS}
    use_jacobian = jacobian
    notes: list[str] = []
    with _ActivationRecorder(model, device) as recorder:
        for batch_index, (x_b, y_b, _) in enumerate(data.batches()):
            x_b, y_b = to_model_batch(x_b, y_b, dtype, device)
            recorder.calls.clear()
            if use_jacobian and not x_b.is_floating_point():
                use_jacobian = False
                notes.append("inputs are not floating point: no input-output Jacobian")
            x_b, z = _forward(model, x_b, use_jacobian, batch_index)
            _add_output_sums(sums, data.loss, z.detach(), y_b)
            if use_jacobian:
                logit_sq, softmax_sq = _jacobian_sq_norms(x_b, z)
                sums["jac"] += logit_sq.sqrt().sum()
                sums["jac_softmax"] += softmax_sq.sqrt().sum()
    all_reduce_sum(recorder.layer_sums() + list(sums.values()) + [recorder.penultimate])
    return _result(recorder, sums, data, use_jacobian, notes)


@declare(
    "metric",
    ACTIVATION_STATS,
    "per layer: dead and active outputs, mean squared norm; output statistics, ||J_x||_F",
    paper="MAN",
    info={
        "order": 5,
        "keys": (
            *(f"activations.layers.*.{k}" for k in _LAYER_KEYS),
            *(
                f"activations.output.{k}"
                for k in ("gini_impurity", "entropy", "confidence", "loss", "accuracy")
            ),
            "activations.penultimate_sq_norm",
            "activations.input_jacobian_fro",
            "activations.input_jacobian_fro_softmax",
            "activations.samples",
        ),
    },
)
def activation_stats_metric(run) -> None:
    """``sharp analyze``'s ``activations``: :func:`activation_stats` of the session's model on
    its analysis set.

    Args:
        run: the :class:`sharpcli.analyses.analyze.MetricRun`, whose results it adds to.
    """
    run.results["activations"] = activation_stats(
        run.session.model, run.session.analysis_data()
    ).to_dict()


def _result(
    recorder: _ActivationRecorder, sums: dict, data: AnalysisData, jacobian: bool, notes: list
) -> ActivationStatsResult:
    """The statistics from the all-reduced sums: per-sample means over the analysis set."""
    n = data.num_samples
    softmax_stats = get_loss(data.loss).softmax_per_sample  # gini, entropy, confidence

    def mean(key: str, applies: bool = True) -> float | None:
        return float(sums[key]) / n if applies else None

    output = OutputStats(
        gini_impurity=mean("gini", softmax_stats),
        entropy=mean("entropy", softmax_stats),
        confidence=mean("confidence", softmax_stats),
        loss=float(sums["loss"]) / n,
        accuracy=float(sums["correct"] / sums["counted"]) if float(sums["counted"]) else None,
    )
    if not recorder.layers:
        notes.append("the model has no activation layer modules")
    head = recorder.head
    if head is None:
        notes.append("the model has no nn.Linear head: no penultimate activation norm")
    return ActivationStatsResult(
        layers=[recorder.accumulators[key].finish(n) for key in recorder.order],
        output=output,
        penultimate_sq_norm=float(recorder.penultimate) / n if head is not None else None,
        penultimate_layer=head[0] if head is not None else None,
        input_jacobian_fro=mean("jac", jacobian),
        input_jacobian_fro_softmax=mean("jac_softmax", jacobian and softmax_stats),
        samples=n,
        notes=notes,
    )


def _jacobian_sq_norms(x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``||dz_i/dx_i||_F^2`` and ``||dp_i/dx_i||_F^2`` (shape ``(B,)`` each, float64).

    Row c of every sample's logit Jacobian is ``r_c = d(sum_i z_ic)/dx`` (samples independent);
    ``rbar = d(sum_i sum_k p_ik z_ik)/dx`` with ``p`` constant is ``sum_k p_k r_k``; the
    probability Jacobian's rows are ``p_c (r_c - rbar)``.
    """
    batch, classes = z.shape
    p = torch.softmax(z.detach(), dim=-1)
    (rbar,) = torch.autograd.grad((z * p).sum(), x, retain_graph=True)
    rbar = rbar.reshape(batch, -1).to(torch.float64)
    logit_sq = torch.zeros(batch, dtype=torch.float64, device=x.device)
    softmax_sq = torch.zeros(batch, dtype=torch.float64, device=x.device)
    p64 = p.to(torch.float64)
    for c in range(classes):
        (row,) = torch.autograd.grad(z[:, c].sum(), x, retain_graph=c < classes - 1)
        row = row.reshape(batch, -1).to(torch.float64)
        logit_sq += (row * row).sum(dim=1)
        diff = row - rbar
        softmax_sq += p64[:, c] ** 2 * (diff * diff).sum(dim=1)
    return logit_sq, softmax_sq
