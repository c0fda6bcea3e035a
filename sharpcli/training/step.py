"""The machinery of one regularised training step: passes, perturbations, accounting.

A training step evaluates the regularised objective

    O(theta) = L(theta) + sum_k P_k(theta)

(``L`` the batch-mean task loss of :mod:`sharpcli.losses`, ``P_k`` the additive
penalties of :mod:`sharpcli.training.regularizers`) once at the clean point and,
for the perturbation oracles, at perturbed points ``theta + delta``. This module
holds what every such evaluation needs and the regularizers share:

- :class:`StepEngine`: one batch, one model; ``evaluate`` runs a forward pass and
  the penalties, returns values and (optionally) the gradient of ``O`` as tensors;
  ``perturbed(deltas)`` moves the weights to ``theta + delta`` and restores them
  *by copy* (never by subtraction, which does not give theta back exactly in floating point).
- Extra passes (every pass after the first of the step) see the same dropout masks
  as the first (the global torch RNG is replayed from its state at the start of
  the step, and left as the first pass left it), and leave every module buffer
  (BatchNorm running statistics, ``num_batches_tracked``) as the first pass left it.
- :class:`PassContext`: what a penalty sees during one pass (logits, loss,
  penultimate activations, the shared first-order gradient of ``L``), and the
  bookkeeping of reverse-mode sweeps.

Cost accounting (``StepStats.grad_evals``): a forward graph is 1 *unit*. A
reverse sweep over a graph of ``U`` units costs ``U`` gradient evaluations, and
when it is taken with ``create_graph=True`` it adds the units it traversed to the
graph (a double-backward graph holds a forward and a backward, 2 units). Hence a
plain gradient costs 1, a gradient penalty ``||grad L||^p`` costs 1 (``grad L``
with graph) + 2 (backward through the doubled graph) = 3, a Hessian-vector product
taken from that graph costs 2, and the exact gradient of ``v^T H v`` costs
1 + 2 + 4 = 7. A forward pass without a backward costs 0, and every extra pass of a
finite-difference scheme (:meth:`StepEngine.loss_gradient`, a plain ``grad L`` at
perturbed weights) costs 1: the fd gradient of ``v^T H v`` costs 1 + 2 = 3 and the
central-difference one of ``||H v||^2`` 1 + 2 + 4 = 7.

Random draws (:func:`rademacher_like`, :func:`gaussian_like`) are one flat draw over
all parameters per call: a step pays one generator call per probe or noise sample.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss
from sharpcli.models.zoo import final_linear

__all__ = [
    "StepStats",
    "PassContext",
    "PassResult",
    "StepEngine",
    "rademacher_like",
    "gaussian_like",
    "global_norm",
]


@dataclass
class StepStats:
    """What one training step reports: batch means over its *reported pass*.

    The reported pass is the clean pass at theta, except for the noise oracles
    (``weight-noise``, ``nso``) with ``report=perturbed`` (their default), which report the
    passes whose gradients they return, at ``theta + U`` (see their docstrings).

    - ``loss``: task loss ``L`` of the reported pass.
    - ``objective``: ``L + sum_k P_k`` at the same weights, the quantity minimised.
    - ``correct``: correct predictions of the reported pass, as the loss counts them
      (:attr:`sharpcli.losses.Loss.correct`: argmax for cross-entropy, the logit's sign for
      binary cross-entropy, per labelled position for token cross-entropy; 0 for regression).
    - ``count``: batch size (samples: the weight of the step's means in an epoch's mean).
    - ``grad_evals``: gradient evaluations the step used, counted as in the module
      docstring (a double-backward counts its true number of backward passes).
    - ``penalties``: value of each additive penalty at theta, keyed by regularizer name.
    - ``counted``: predictions ``correct`` is out of (samples, or labelled positions for
      token cross-entropy; 0 where the loss defines no accuracy): accuracy is
      ``correct / counted``.
    """

    loss: float
    objective: float
    correct: int
    count: int
    grad_evals: int
    penalties: dict[str, float] = field(default_factory=dict)
    counted: int = 0


def _flat_split(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (consecutive slices in order), moved to each
    tensor's device and dtype where they differ from ``flat``'s."""
    # view_as: half the cost of view(t.shape), which builds a Size per tensor
    out = [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    device, dtype = flat.device, flat.dtype
    if all(t.dtype == dtype for t in tensors) and all(t.device == device for t in tensors):
        return out
    return [piece.to(device=t.device, dtype=t.dtype) for piece, t in zip(out, tensors)]


def rademacher_like(
    tensors: Sequence[torch.Tensor], generator: torch.Generator
) -> list[torch.Tensor]:
    """Independent Rademacher (+-1, probability 1/2 each) tensors shaped like ``tensors``.

    One draw per call: ``b = torch.randint(0, 2, (P,), generator=generator, dtype=dtype)``
    on the generator's device, ``P`` the total number of entries, ``dtype`` the first
    tensor's; the entries are ``2 b - 1`` split into consecutive slices in the order of
    ``tensors`` and moved to each tensor's device (so a CPU generator drives a CUDA model
    identically). One flat draw instead of one per tensor: a step pays one generator call.
    """
    total = sum(t.numel() for t in tensors)
    bits = torch.randint(
        0, 2, (total,), generator=generator, device=generator.device, dtype=tensors[0].dtype
    )
    return _flat_split(bits.mul_(2).sub_(1), tensors)


def gaussian_like(
    tensors: Sequence[torch.Tensor], sigma: float, generator: torch.Generator
) -> list[torch.Tensor]:
    """Independent ``N(0, sigma^2)`` tensors shaped like ``tensors``.

    Draw order: one flat ``torch.empty(P, dtype=dtype).normal_(generator=generator)`` on the
    generator's device (``P`` the total number of entries, ``dtype`` the first tensor's),
    multiplied by ``sigma`` in place, split into consecutive slices in the order of
    ``tensors`` and moved to each tensor's device. Tests reproduce a step's noise by
    repeating exactly this draw.
    """
    total = sum(t.numel() for t in tensors)
    flat = torch.empty(total, dtype=tensors[0].dtype, device=generator.device).normal_(
        generator=generator
    )
    return _flat_split(flat.mul_(sigma), tensors)


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Euclidean norm of the concatenation of ``tensors``: ``sqrt(sum_t ||t||^2)``.

    One fused ``torch._foreach_norm`` (the per-tensor norms) and the norm of those norms,
    in the tensors' own dtype (float32 for float32 parameters: the relative rounding error
    of a float32 norm, about 1e-7, is far below what any use of it here resolves), on the
    tensors' device, without a host synchronisation. Returns a 0-dim tensor of the first
    tensor's dtype.
    """
    dtype = tensors[0].dtype
    norms = torch._foreach_norm([t.detach() for t in tensors])
    if any(n.dtype != dtype for n in norms):
        norms = [n.to(dtype) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


def _added(first: torch.Tensor, rest) -> torch.Tensor:
    """``first + r_1 + r_2 + ...``: as ``first + sum(rest)`` without the operation that
    ``sum`` spends adding its start value 0 (a step adds a penalty or two per pass)."""
    for term in rest:
        first = first + term
    return first


_MODEL_FACTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def set_penultimate(model: nn.Module, module_name: str) -> None:
    """Make the OUTPUT of ``model``'s submodule ``module_name`` the penultimate representation
    that activation decay penalises, instead of the input of the last ``nn.Linear``."""
    modules = dict(model.named_modules())
    if module_name not in modules or module_name == "":
        names = ", ".join(n for n in list(modules)[1:9])
        raise UsageError(
            f"the model has no submodule {module_name!r} (modules: {names}, ...)",
            source="penultimate",
        )
    _MODEL_FACTS.setdefault(model, {})["head"] = (modules[module_name], "output")


def _model_facts(model: nn.Module, key: str):
    """Structural facts of ``model`` a step needs, computed once per model object (a step
    is built per batch; walking ``named_modules`` every batch is measurable on small
    models): ``"head"`` the classifier head (:func:`sharpcli.models.zoo.final_linear`, whose
    input activation decay penalises), ``"has_buffers"`` whether any
    module holds a buffer (BatchNorm running statistics), ``"params"`` every parameter in
    ``model.parameters()`` order (a step keeps those with ``requires_grad``, so freezing
    between steps is honoured). The model's structure must not change after its first
    step: no module or parameter added, removed or replaced (in-place updates, ``.to()``
    and ``load_state_dict`` keep the parameter objects and are fine)."""
    facts = _MODEL_FACTS.setdefault(model, {})
    if key not in facts:
        if key == "params":
            facts[key] = tuple(model.parameters())
        elif key == "head":
            head = final_linear(
                model,
                source="regs",
                missing="activation decay needs a final nn.Linear layer (its input is the "
                f"penultimate activation) or `penultimate` (a module name); the model "
                f"{type(model).__name__} has neither",
            )[1]
            facts[key] = (head, "input")
        else:
            facts[key] = any(True for _ in model.buffers())
    return facts[key]


class _RngReplay:
    """Replays the global torch RNG so every pass of a step sees the same dropout masks.

    ``start()`` records the state before the first pass; ``first_done()`` the state after
    it; ``replay()`` rewinds to the start before an extra pass; ``finish()`` leaves the
    RNG as the first pass left it, so a step with extra passes consumes the global RNG
    exactly like a plain step (dropout masks are the one thing drawn from it).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.before: tuple | None = None
        self.after: tuple | None = None

    def _get(self) -> tuple:
        cpu = torch.get_rng_state()
        gpu = torch.cuda.get_rng_state(self.device) if self.cuda else None
        return cpu, gpu

    def _set(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1], self.device)

    def start(self) -> None:
        self.before = self._get()

    def first_done(self) -> None:
        self.after = self._get()

    def replay(self) -> None:
        self._set(self.before)

    def finish(self) -> None:
        if self.after is not None:
            self._set(self.after)


@dataclass
class PassResult:
    """Values of one evaluation of the objective (tensors detached, on the model's device).

    ``grads`` is the gradient of the objective with respect to each trainable parameter
    (in ``StepEngine.params`` order) when it was asked for, else ``None``. ``logits``,
    ``labels`` and ``scorer`` (the loss's :attr:`sharpcli.losses.Loss.correct`; losses with an
    accuracy only) give :attr:`correct` and :attr:`counted`, computed when read: most passes
    of a step (perturbed, finite-difference) are never reported. Values stay tensors so
    that a step reads them back from the device once, in :meth:`StepEngine.stats`.
    """

    loss: torch.Tensor
    objective: torch.Tensor
    penalties: dict[str, torch.Tensor]
    grads: list[torch.Tensor] | None
    logits: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    scorer: Callable | None = None
    _score: tuple | None = field(default=None, repr=False)

    def _scored(self) -> tuple:
        if self._score is None:
            self._score = (0, 0) if self.scorer is None else self.scorer(self.logits, self.labels)
        return self._score

    @property
    def correct(self) -> torch.Tensor | int:
        """Correct predictions of the pass as the loss counts them, a 0-dim tensor, or ``0``
        where the loss defines no accuracy (regression)."""
        return self._scored()[0]

    @property
    def counted(self) -> torch.Tensor | int:
        """Predictions :attr:`correct` is out of (samples, or labelled positions): an int where
        the host knows it (every label counts), a 0-dim tensor where the device does (labelled
        positions), ``0`` where the loss defines no accuracy."""
        return self._scored()[1]


class PassContext:
    """What a penalty sees during one evaluation of the objective at the current weights.

    Attributes: ``model``, ``params`` (trainable, in order), ``x``, ``y``, ``logits``,
    ``loss`` (batch-mean task loss tensor with its graph), ``loss_name``, ``generator``,
    ``penultimate`` (input of the final ``nn.Linear`` when a penalty asked for it),
    ``want_grad`` (whether the objective will be differentiated in this pass).
    """

    def __init__(
        self,
        engine: "StepEngine",
        logits,
        loss,
        penultimate,
        want_grad: bool,
        first_grad_graph: bool,
    ):
        self.engine = engine
        self.model = engine.model
        self.params = engine.params
        self.x = engine.x
        self.y = engine.y
        self.loss_name = engine.loss_name
        self.loss_of = engine.loss_of
        self.generator = engine.generator
        self.logits = logits
        self.loss = loss
        self.penultimate = penultimate
        self.want_grad = want_grad
        self.units = 1  # the forward graph
        self._first_grad_graph = first_grad_graph
        self._first_grad: list[torch.Tensor] | None = None

    def count(self, sweeps: int) -> None:
        """Record ``sweeps`` gradient evaluations on the engine's counter."""
        self.engine.grad_evals += sweeps

    def first_grad(self) -> list[torch.Tensor]:
        """``grad_theta L`` at the current weights, computed once per pass and shared.

        Taken with ``create_graph=True`` when any penalty differentiates through it
        (gradient penalty, Hessian-vector products), which adds 1 unit to the graph.
        Costs 1 gradient evaluation.
        """
        if self._first_grad is None:
            grads = torch.autograd.grad(
                self.loss,
                self.params,
                create_graph=self._first_grad_graph,
                retain_graph=True,
                allow_unused=True,
            )
            self._first_grad = [
                torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)
            ]
            self.count(1)
            if self._first_grad_graph:
                self.units += 1
        return self._first_grad

    def hvp(self, vectors: Sequence[torch.Tensor], create_graph: bool) -> list[torch.Tensor]:
        """Hessian-vector product ``H v = grad_theta (grad L . v)`` by double backward.

        Reuses the first-order graph of :meth:`first_grad` (which must have been built
        with a graph). Costs 2 gradient evaluations; with ``create_graph`` it adds 2
        units to the graph that a later backward traverses.
        """
        grads = self.first_grad()
        dot = sum((g * v).sum() for g, v in zip(grads, vectors))
        out = torch.autograd.grad(
            dot, self.params, create_graph=create_graph, retain_graph=True, allow_unused=True
        )
        self.count(2)
        if create_graph:
            self.units += 2
        return [torch.zeros_like(p) if h is None else h for p, h in zip(self.params, out)]

    def gradient_of(self, scalar: torch.Tensor, create_graph: bool) -> list[torch.Tensor]:
        """``grad_theta scalar`` for a scalar computed from the forward graph (1 evaluation;
        adds 1 unit when ``create_graph``)."""
        out = torch.autograd.grad(
            scalar, self.params, create_graph=create_graph, retain_graph=True, allow_unused=True
        )
        self.count(1)
        if create_graph:
            self.units += 1
        return [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, out)]


class StepEngine:
    """Evaluates the regularised objective on one batch, at theta or at perturbed points.

    ``penalties`` are objects with the penalty protocol of
    :class:`sharpcli.training.regularizers.Penalty`: ``name``, ``needs_penultimate``,
    ``first_grad_mode(want_grad) -> None | "value" | "graph"``, ``needs_autograd``,
    ``term(ctx) -> Tensor`` (value, differentiable through the graph when its gradient
    comes from autograd), ``analytic_grad(params) -> list | None`` (closed-form gradient
    when the term is not in the graph), ``has_extra_passes`` / ``deferred_value`` and
    ``extra_passes(engine, ctx, want_grad) -> (value | None, gradient | None)`` (a value
    and/or gradient obtained by extra passes after the pass, e.g. finite differences of
    ``grad L``; a penalty with ``deferred_value`` gets no ``term`` call and returns its
    value there).

    The first pass of a step (:meth:`evaluate`, :meth:`forward_only` or
    :meth:`loss_gradient`, usually the clean pass at theta) fixes the dropout RNG state
    and the module buffers every later pass of the step reuses. ``single_pass=True``
    promises that the step makes no other pass (a plain gradient, additive penalties
    without finite differences): the RNG state is then not recorded, and a second pass
    is a programming error (RuntimeError).

    No value is read back from the device during the passes (no ``.item()``): the
    objectives stay tensors, and :meth:`stats` reads them all, checks that every pass's
    objective was finite (NumericalError otherwise) and builds the step's
    :class:`StepStats` in one synchronisation per step.
    """

    def __init__(
        self,
        model: nn.Module,
        x,
        y,
        loss_name: str,
        penalties: Sequence,
        generator: torch.Generator,
        single_pass: bool = False,
    ):
        self.model = model
        self.x = x
        self.y = y
        self.loss_name = loss_name
        loss = get_loss(loss_name)
        self.loss_of: Callable = loss.mean
        self.scorer: Callable | None = loss.correct
        self.penalties = list(penalties)
        self.generator = generator
        self.params = [p for p in _model_facts(model, "params") if p.requires_grad]
        if not self.params:
            raise UsageError("the model has no trainable parameters", source="regs")
        self.grad_evals = 0
        device = self.params[0].device
        self._on_cpu = device.type == "cpu"
        self._rng = _RngReplay(device)
        self._single_pass = single_pass
        self._passes = 0
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._objectives: list[torch.Tensor] = []  # every pass's objective, checked in stats()
        self._saved: list[list[torch.Tensor]] = []  # weights before a perturbation, per depth
        self._saved_versions: list[list[int] | None] = []  # weights' versions when restored
        self._weights: list[torch.Tensor] | None = None
        self._depth = 0  # nesting of perturbed() blocks
        self._head = (
            _model_facts(model, "head")
            if any(p.needs_penultimate for p in self.penalties)
            else None
        )
        self.has_buffers = _model_facts(model, "has_buffers")

    # ----------------------------------------------------------------- state control
    @property
    def weights(self) -> list[torch.Tensor]:
        """Detached views of the trainable parameters (``self.params`` order), made once per
        engine: in-place arithmetic on them moves the parameters without autograd recording
        it (so no ``torch.no_grad()`` block is needed around it)."""
        if self._weights is None:
            self._weights = [p.detach() for p in self.params]
        return self._weights

    @contextlib.contextmanager
    def perturbed(self, deltas: Sequence[torch.Tensor], sign: float = 1.0) -> Iterator[None]:
        """Weights at ``theta + sign * delta`` inside the block (``sign`` +1 or -1); restored by
        copy on exit (bitwise). ``deltas`` must not require grad.

        The weights are saved with one fused ``torch._foreach_copy_`` into buffers allocated
        once per engine and nesting depth (a perturbation inside a perturbed block, as a
        finite-difference penalty under SAM, saves into its own), moved in place with
        ``torch._foreach_add_(..., alpha=sign)`` (exactly ``theta - delta`` for ``sign=-1``,
        with no negated copy of ``delta``), and restored by copying the saved values back:
        restoring by subtracting ``delta`` would not give theta back bit for bit in floating
        point. The save is skipped when the buffer still holds the current weights: every
        in-place change of a tensor bumps its version counter, so equal versions since this
        depth's last restore mean nothing has touched the weights since (a step's second and
        later perturbations at one depth pay one copy, not two).
        """
        if sign not in (1.0, -1.0):
            raise ValueError(f"sign must be +1 or -1, not {sign}")
        depth = self._depth
        weights = self.weights
        if depth == len(self._saved):
            self._saved.append([torch.empty_like(w) for w in weights])
            self._saved_versions.append(None)
        saved = self._saved[depth]
        self._depth += 1
        try:
            if self._saved_versions[depth] != [w._version for w in weights]:
                torch._foreach_copy_(saved, weights)
            torch._foreach_add_(weights, list(deltas), alpha=sign)
            yield
        finally:
            self._depth = depth
            torch._foreach_copy_(weights, saved)
            self._saved_versions[depth] = [w._version for w in weights]

    def _begin_pass(self) -> bool:
        first = self._passes == 0
        self._passes += 1
        if first:
            if not self._single_pass:
                self._rng.start()
        else:
            if self._single_pass:
                raise RuntimeError("a second pass in a step declared single_pass")
            if self._buffers is None:
                # Nothing ran since the clean pass closed: the buffers are as it left them.
                self._buffers = (
                    [(b, b.detach().clone()) for b in self.model.buffers()]
                    if self.has_buffers
                    else []
                )
            self._rng.replay()
        return first

    def _end_pass(self, first: bool) -> None:
        if first:
            if not self._single_pass:
                self._rng.first_done()
        elif self._buffers is not None:
            with torch.no_grad():
                for live, saved in self._buffers:
                    live.copy_(saved)

    def finish(self) -> None:
        """Leave the global RNG as the clean pass left it (call once at the end of a step)."""
        self._rng.finish()

    # ----------------------------------------------------------------- evaluations
    def _forward(self):
        captured: dict[str, torch.Tensor] = {}
        handle = None
        if self._head is not None:
            module, where = self._head

            def hook(module, inputs, output):
                captured["h"] = output if where == "output" else inputs[0]

            handle = module.register_forward_hook(hook)
        try:
            logits = self.model(self.x)
        finally:
            if handle is not None:
                handle.remove()
        return logits, captured.get("h")

    def forward_only(self) -> None:
        """A forward pass at the current weights under ``torch.no_grad()``, its output unused:
        as the first pass of a step it sets the module buffers (BatchNorm running
        statistics) and the dropout RNG as a clean pass would. 0 gradient evaluations."""
        first = self._begin_pass()
        try:
            with torch.no_grad():
                self.model(self.x)
        finally:
            self._end_pass(first)

    def loss_gradient(self) -> list[torch.Tensor]:
        """``grad_theta L`` (task loss only) at the current weights as an extra pass: 1 evaluation."""
        first = self._begin_pass()
        try:
            with torch.enable_grad():
                logits = self.model(self.x)
                loss = self.loss_of(logits, self.y)
                grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            self.grad_evals += 1
            return [
                torch.zeros_like(p) if g is None else g.detach() for p, g in zip(self.params, grads)
            ]
        finally:
            self._end_pass(first)

    def evaluate(self, want_grad: bool) -> PassResult:
        """One pass: forward, loss, every penalty; with ``want_grad`` the gradient of the objective.

        Without ``want_grad`` and when no penalty needs autograd to compute its value
        (``wd``, ``ad``), the pass runs under ``torch.no_grad()`` (a forward only, 0
        gradient evaluations).
        """
        first = self._begin_pass()
        try:
            result, ctx = self._evaluate(want_grad, first)
        finally:
            self._end_pass(first)
        # Extra passes (finite differences) run after this pass has closed, so they
        # replay its dropout masks and restore its buffers.
        deferred: dict[str, torch.Tensor] = {}
        for pen in self.penalties:
            if pen.has_extra_passes:
                value, extra = pen.extra_passes(self, ctx, want_grad)
                if value is not None:
                    deferred[pen.name] = value.detach()
                if want_grad and extra is not None:
                    torch._foreach_add_(result.grads, extra)
        if deferred:
            result.penalties = {
                pen.name: deferred[pen.name] if pen.name in deferred else result.penalties[pen.name]
                for pen in self.penalties
            }
            result.objective = result.objective + sum(deferred.values())
        self._objectives.append(result.objective)
        return result

    def stats(self, reported: PassResult, count: int) -> StepStats:
        """The step's :class:`StepStats` from its reported pass, read from the device at once.

        Raises NumericalError when the objective of any pass of the step (the clean pass,
        perturbed passes) was not finite, naming the first such value.
        """
        names = list(reported.penalties)
        values = [*self._objectives, reported.loss, reported.objective]
        values += [reported.penalties[name] for name in names]
        scores = [reported.correct, reported.counted]  # tensors or host ints
        read = [i for i, score in enumerate(scores) if torch.is_tensor(score)]
        values += [scores[i] for i in read]
        if self._on_cpu:  # reading a CPU tensor waits for nothing
            host = [v.item() for v in values]
        else:  # one device-to-host copy for the whole step
            host = torch.cat([v.detach().to(torch.float64).reshape(-1) for v in values]).tolist()
        for i, value in zip(read, host[len(host) - len(read) :]):
            scores[i] = value
        del host[len(host) - len(read) :]
        n = len(self._objectives)
        for objective_value in host[:n]:
            if not math.isfinite(objective_value):
                regs = ", ".join(p.name for p in self.penalties) or "none"
                raise NumericalError(
                    f"the training objective became {objective_value} (regularizers: {regs}); "
                    "lower the learning rate or the regularization strength",
                    source="regs",
                )
        return StepStats(
            loss=float(host[n]),
            objective=float(host[n + 1]),
            correct=int(scores[0]),
            count=count,
            grad_evals=int(self.grad_evals),
            penalties={name: float(v) for name, v in zip(names, host[n + 2 :])},
            counted=int(scores[1]),
        )

    def _evaluate(self, want_grad: bool, first: bool) -> tuple[PassResult, PassContext]:
        modes = [p.first_grad_mode(want_grad) for p in self.penalties]
        need_autograd = want_grad or any(p.needs_autograd for p in self.penalties)
        with torch.set_grad_enabled(need_autograd):
            logits, penultimate = self._forward()
            loss = self.loss_of(logits, self.y)
            ctx = PassContext(
                self, logits, loss, penultimate, want_grad, first_grad_graph="graph" in modes
            )
            values: dict[str, torch.Tensor] = {}
            graph_terms: list[torch.Tensor] = []
            for pen in self.penalties:
                if pen.deferred_value:
                    continue
                value = pen.term(ctx)
                values[pen.name] = value.detach()
                if value.requires_grad and pen.grad_from_graph:
                    graph_terms.append(value)
            objective = _added(loss.detach(), values.values())
            grads = None
            if want_grad:
                grads = self._objective_gradient(ctx, loss, graph_terms)
        result = PassResult(loss.detach(), objective, values, grads)
        if self.scorer is not None:
            result.logits, result.labels = logits.detach(), self.y
            result.scorer = self.scorer
        return result, ctx

    def _objective_gradient(self, ctx: PassContext, loss, graph_terms) -> list[torch.Tensor]:
        extras = [p for p in self.penalties if p.has_extra_passes]
        if extras:
            # grad L is needed alone (finite-difference directions), so keep it separate.
            grads = [g.detach().clone() for g in ctx.first_grad()]
            if graph_terms:
                rest = torch.autograd.grad(sum(graph_terms), self.params, allow_unused=True)
                self.grad_evals += ctx.units
                grads = [g if r is None else g + r for g, r in zip(grads, rest)]
        else:
            total = _added(loss, graph_terms)
            out = torch.autograd.grad(total, self.params, allow_unused=True)
            self.grad_evals += ctx.units
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, out)]
        # without create_graph autograd returns tensors outside any graph: nothing to detach
        for pen in self.penalties:
            analytic = pen.analytic_grad(self.params)
            if analytic is not None:
                torch._foreach_add_(grads, analytic)
        return grads

    def write_grads(self, grads: Sequence[torch.Tensor]) -> None:
        """Set ``p.grad`` of every trainable parameter to the given gradient (replacing what was there)."""
        for p, g in zip(self.params, grads):
            p.grad = g.detach()
