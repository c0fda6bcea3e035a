"""The engine of one regularised training step: passes, perturbations, accounting.

:class:`StepPasses` evaluates the regularised objective on one batch at theta or at perturbed
weights; :class:`PassContext` is what a penalty sees during one pass; :class:`PenaltyNeeds`
is what a penalty declares it needs from the pass. :mod:`sharpcli.regularizers.step` describes the
step as a whole and its cost accounting.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

import torch
from torch import nn

from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss
from sharpcli.regularizers.replay import RngReplay, model_facts
from sharpcli.regularizers.stats import StepStats

__all__ = ["PenaltyNeeds", "PassContext", "PassResult", "StepPasses"]


LossGradGraph = Literal["never", "to_differentiate", "always"]


@dataclass(frozen=True)
class PenaltyNeeds:
    """What an additive penalty needs from the pass that evaluates it: the whole protocol
    between a penalty and :class:`StepPasses`, fixed per class (each mode of a regularizer is
    its own class, so nothing here depends on its hyper-parameters).

    A penalty's value is ``term(ctx)``; a value returned with an autograd graph is
    differentiated through it, one returned without gets its gradient from
    ``analytic_grad(params)`` (closed form) or from ``extra_passes``.

    Args:
        autograd: its value needs autograd even when the step takes no gradient (it
            differentiates the loss: ``grad L``, Hessian-vector products, a sampled loss).
        loss_grad_graph: when the pass must build ``grad L`` with ``create_graph``:
            ``"never"``; ``"to_differentiate"`` when the step differentiates the objective
            (the term is a function of ``grad L``, as ``||grad L||^p``); ``"always"``
            (the value itself needs ``H v``, a derivative of ``grad L``).
        extra_passes: ``extra_passes(engine, ctx, want_grad)`` runs after the pass (finite
            differences of ``grad L`` at perturbed weights) and returns
            ``(value | None, gradient | None)``.
        deferred_value: the value comes from ``extra_passes`` and ``term`` is not called
            (requires ``extra_passes``).
    """

    autograd: bool = False
    loss_grad_graph: LossGradGraph = "never"
    extra_passes: bool = False
    deferred_value: bool = False

    def __post_init__(self) -> None:
        if self.loss_grad_graph not in ("never", "to_differentiate", "always"):
            raise ValueError(f"loss_grad_graph {self.loss_grad_graph!r} is not a known mode")
        if self.deferred_value and not self.extra_passes:
            raise ValueError("a deferred value comes from extra passes: set extra_passes")

    def keeps_loss_grad_graph(self, want_grad: bool) -> bool:
        """Whether ``grad L`` is built with ``create_graph`` in a pass.

        Args:
            want_grad: whether the pass differentiates the objective.

        Returns:
            True when the penalty differentiates through ``grad L`` in this pass.
        """
        return self.loss_grad_graph == "always" or (
            want_grad and self.loss_grad_graph == "to_differentiate"
        )


def _added(first: torch.Tensor, rest) -> torch.Tensor:
    """``first + r_1 + r_2 + ...``: as ``first + sum(rest)`` without the operation that
    ``sum`` spends adding its start value 0 (a step adds a penalty or two per pass)."""
    for term in rest:
        first = first + term
    return first


@dataclass
class PassResult:
    """Values of one evaluation of the objective (tensors detached, on the model's device).

    ``grads`` is the gradient of the objective with respect to each trainable parameter
    (in ``StepPasses.params`` order) when it was asked for, else ``None``. ``logits``,
    ``labels`` and ``scorer`` (the loss's :attr:`sharpcli.losses.Loss.correct`; losses with an
    accuracy only) give :attr:`correct` and :attr:`counted`, computed when read: most passes
    of a step (perturbed, finite-difference) are never reported. Values stay tensors so
    that a step reads them back from the device once, in :meth:`StepPasses.stats`.
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
        engine: "StepPasses",
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
            self._first_grad = self.engine.grad(
                self.loss, create_graph=self._first_grad_graph, retain_graph=True
            )
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
        dot = functools.reduce(operator.add, [(g * v).sum() for g, v in zip(grads, vectors)])
        out = self.engine.grad(dot, create_graph=create_graph, retain_graph=True)
        self.count(2)
        if create_graph:
            self.units += 2
        return out

    def gradient_of(self, scalar: torch.Tensor, create_graph: bool) -> list[torch.Tensor]:
        """``grad_theta scalar`` for a scalar computed from the forward graph (1 evaluation;
        adds 1 unit when ``create_graph``)."""
        out = self.engine.grad(scalar, create_graph=create_graph, retain_graph=True)
        self.count(1)
        if create_graph:
            self.units += 1
        return out


class StepPasses:
    """Evaluates the regularised objective on one batch, at theta or at perturbed points.

    ``penalties`` are :class:`sharpcli.regularizers.base.Penalty` objects: a ``name``,
    ``needs_penultimate``, a :class:`PenaltyNeeds` record ``needs``, ``term(ctx)``,
    ``analytic_grad(params)`` and ``extra_passes(engine, ctx, want_grad)``.

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

    Mixed precision (:mod:`sharpcli.training.precision`): ``autocast_dtype`` runs every
    forward pass under ``torch.autocast`` and casts the outputs (and captured activations)
    back to the parameters' dtype, in which the loss and penalties are computed. ``loss_scale``
    ``S`` multiplies the scalar of every reverse sweep, whose gradients are multiplied by
    ``1/S`` (exact for a power of two): fp16 activations' gradients do not underflow, and
    penalties, ascent directions and ``p.grad`` see unscaled gradients. ``ascent_reduce``
    all-reduces an ascent oracle's clean gradient (:meth:`ascent_gradient`).
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
        *,
        autocast_dtype: torch.dtype | None = None,
        loss_scale: float = 1.0,
        ascent_reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
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
        self.params = [p for p in model_facts(model, "params") if p.requires_grad]
        if not self.params:
            raise UsageError("the model has no trainable parameters", source="regs")
        self.grad_evals = 0
        device = self.params[0].device
        self._on_cpu = device.type == "cpu"
        self._rng = RngReplay(device)
        self._single_pass = single_pass
        self._passes = 0
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._objectives: list[torch.Tensor] = []  # every pass's objective, checked in stats()
        self._saved: list[list[torch.Tensor]] = []  # weights before a perturbation, per depth
        self._saved_versions: list[list[int] | None] = []  # weights' versions when restored
        self._weights: list[torch.Tensor] | None = None
        self._depth = 0  # nesting of perturbed() blocks
        self._head = (
            model_facts(model, "head") if any(p.needs_penultimate for p in self.penalties) else None
        )
        self.has_buffers = model_facts(model, "has_buffers")
        self.autocast_dtype = autocast_dtype
        self.loss_scale = float(loss_scale)
        self.ascent_reduce = ascent_reduce

    # ----------------------------------------------------------------- state control
    @property
    def param_names(self) -> list[str]:
        """The names of the trainable parameters (``model.named_parameters()``), in
        ``self.params`` order: ASAM's scale reads them."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        return [names[id(p)] for p in self.params]

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
                captured["h"] = self._as_params(output if where == "output" else inputs[0])

            handle = module.register_forward_hook(hook)
        try:
            logits = self._model_output()
        finally:
            if handle is not None:
                handle.remove()
        return logits, captured.get("h")

    def _model_output(self) -> torch.Tensor:
        """``model(x)``, under ``torch.autocast`` when the step runs in mixed precision, the
        output cast back to the parameters' dtype (the loss is computed in it)."""
        if self.autocast_dtype is None:
            return self.model(self.x)
        with torch.autocast(self.params[0].device.type, dtype=self.autocast_dtype):
            out = self.model(self.x)
        return self._as_params(out)

    def _as_params(self, tensor: torch.Tensor) -> torch.Tensor:
        """A floating tensor of an autocast pass in the parameters' dtype (others as given)."""
        if self.autocast_dtype is None or not tensor.is_floating_point():
            return tensor
        return tensor.to(self.params[0].dtype)

    def grad(
        self, scalar: torch.Tensor, *, create_graph: bool = False, retain_graph: bool | None = None
    ) -> list[torch.Tensor]:
        """``grad_theta scalar`` for every trainable parameter (zeros where unused), by a
        reverse sweep of ``loss_scale * scalar`` divided by ``loss_scale`` (the class docstring).

        Args:
            scalar: A 0-dim tensor with a graph to the parameters.
            create_graph: Keep the sweep's graph (to differentiate the result).
            retain_graph: Keep the graph ``scalar`` hangs on (torch's default: ``create_graph``).

        Returns:
            One gradient tensor per trainable parameter, unscaled.
        """
        scale = self.loss_scale
        out = torch.autograd.grad(
            scalar * scale if scale != 1.0 else scalar,
            self.params,
            create_graph=create_graph,
            retain_graph=retain_graph,
            allow_unused=True,
        )
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, out)]
        return grads if scale == 1.0 else [g * (1.0 / scale) for g in grads]

    def ascent_gradient(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The gradient an ascent oracle (sam, usam, asam) follows from the clean pass's
        ``grads``: as given, or all-reduced over the torchrun ranks by ``ascent_reduce``
        (``--ascent-sync global``); None when loss scaling is on and it is not finite (the
        step is skipped by the scaler, and the ascent pass not run)."""
        if self.ascent_reduce is not None:
            grads = self.ascent_reduce(grads)
        if self.loss_scale != 1.0:
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            if not bool(finite):
                return None
        return grads

    def forward_only(self) -> None:
        """A forward pass at the current weights under ``torch.no_grad()``, its output unused:
        as the first pass of a step it sets the module buffers (BatchNorm running
        statistics) and the dropout RNG as a clean pass would. 0 gradient evaluations."""
        first = self._begin_pass()
        try:
            with torch.no_grad():
                self._model_output()
        finally:
            self._end_pass(first)

    def loss_gradient(self) -> list[torch.Tensor]:
        """``grad_theta L`` (task loss only) at the current weights as an extra pass: 1 evaluation."""
        first = self._begin_pass()
        try:
            with torch.enable_grad():
                loss = self.loss_of(self._model_output(), self.y)
                grads = self.grad(loss)
            self.grad_evals += 1
            return grads
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
            if pen.needs.extra_passes:
                value, extra = pen.extra_passes(self, ctx, want_grad)
                if value is not None:
                    deferred[pen.name] = value.detach()
                if want_grad and extra is not None and result.grads is not None:
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
        scores: list[torch.Tensor | float] = [reported.correct, reported.counted]  # or host ints
        read = [i for i, score in enumerate(scores) if isinstance(score, torch.Tensor)]
        values += [score for score in scores if isinstance(score, torch.Tensor)]
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
        graph = any(p.needs.keeps_loss_grad_graph(want_grad) for p in self.penalties)
        need_autograd = want_grad or any(p.needs.autograd for p in self.penalties)
        with torch.set_grad_enabled(need_autograd):
            logits, penultimate = self._forward()
            loss = self.loss_of(logits, self.y)
            ctx = PassContext(self, logits, loss, penultimate, want_grad, first_grad_graph=graph)
            values: dict[str, torch.Tensor] = {}
            graph_terms: list[torch.Tensor] = []
            for pen in self.penalties:
                if pen.needs.deferred_value:
                    continue
                value = pen.term(ctx)
                values[pen.name] = value.detach()
                if value.requires_grad:  # else analytic_grad or extra passes give it
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
        extras = [p for p in self.penalties if p.needs.extra_passes]
        if extras:
            # grad L is needed alone (finite-difference directions), so keep it separate.
            grads = [g.detach().clone() for g in ctx.first_grad()]
            if graph_terms:
                rest = self.grad(_added(graph_terms[0], graph_terms[1:]))
                self.grad_evals += ctx.units
                grads = [g + r for g, r in zip(grads, rest)]
        else:
            grads = self.grad(_added(loss, graph_terms))
            self.grad_evals += ctx.units
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
