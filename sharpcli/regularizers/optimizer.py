r"""The perturbation oracles of ``sharp train`` as a wrapper around any ``torch.optim`` optimizer.

:class:`PerturbedOptimizer` applies the gradient at perturbed weights :math:`\theta + e` at
:math:`\theta`: the ascent family (``sam`` [SAM], ``usam`` [USAM], ``asam`` [ASAM]: ``e`` the
ascent step from the clean gradient) and the weight-noise family (``weight-noise``, ``nso``
[NSO]: ``e`` Gaussian noise). The wrapper calls the oracle through
:class:`~sharpcli.regularizers.base.PerturbationOracle` (the points of a step, and whether they
read the clean gradient): the perturbations are the regularizer class's own
(:meth:`~sharpcli.regularizers.perturbed.sam.SAM.perturbation`,
:meth:`~sharpcli.regularizers.perturbed.noise.WeightNoise.noise`,
:meth:`~sharpcli.regularizers.perturbed.noise.NSO.perturbations`), the same code ``sharp train``
runs; the weights are restored by copy, as there.

Training conditions (docs/own-loop.md):

- **Mixed precision.** With ``grad_scaler`` (a ``torch.amp.GradScaler``) the ascent step is
  computed from the *unscaled* clean gradient (``grad / scale``), and :meth:`second_step`
  calls ``grad_scaler.step`` and ``grad_scaler.update``: a step whose clean or perturbed
  gradient holds an inf or NaN is skipped and the scale backs off, as the scaler does for a
  plain step (a non-finite clean gradient leaves the weights unperturbed and marks the
  perturbed gradient non-finite so the scaler sees it).
- **Gradient accumulation.** :meth:`first_step` reads ``p.grad`` as it is: after ``k``
  micro-batch backwards of ``loss / k`` it holds the large batch's gradient, and the ascent
  step is taken on it; the ``k`` backwards after it accumulate the gradient at the
  perturbed weights. Equal micro-batches make this the large-batch step.
- **Data parallel** (``model`` a ``DistributedDataParallel``): ``ascent_sync="per-replica"``
  (default) runs the clean backward of :meth:`first_pass` under ``model.no_sync()``: each
  replica takes its own ascent step from its local gradient, the gradients at the perturbed
  weights are all-reduced by DDP as usual (m-sharpness with m the local batch [SAM]).
  ``ascent_sync="global"`` lets DDP all-reduce the clean gradient once: every replica takes
  the ascent step of the global batch (single-process SAM on the whole batch).
- **Buffers** (BatchNorm running statistics, ``num_batches_tracked``): with ``model`` given,
  the buffers are restored after the perturbed pass to what the clean pass left, so they
  advance once per step; ``perturbed_updates_buffers=True`` keeps the perturbed pass's
  updates too. (``weight-noise`` makes one pass, at the noisy weights, whose update is kept;
  ``nso`` keeps its first pass's.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Protocol, TypeVar, overload, runtime_checkable

import torch
from torch import nn

from sharpcli.catalogue import values
from sharpcli.errors import UsageError
from sharpcli.regularizers.base import Oracle, PerturbationOracle
from sharpcli.regularizers.draws import global_norm

__all__ = ["ASCENT_SYNC", "PerturbedOptimizer"]

#: The semantics of the clean gradient under data parallelism (``ascent_sync``), the value
#: set of :mod:`sharpcli.catalogue.values`.
ASCENT_SYNC = values.ASCENT_SYNCS  # the accepted values of ascent_sync

#: what a closure returns (the loss), handed back by :meth:`PerturbedOptimizer.step`
_Loss = TypeVar("_Loss")


@runtime_checkable
class _DefersGradientSync(Protocol):
    """A data-parallel wrapper whose backward can skip the all-reduce (DDP, FSDP)."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """The context in which backward passes accumulate local gradients only."""
        ...


def check_optimizer(optimizer: Any, spec: str) -> None:
    """UsageError on ``optimizer`` unless it is an optimizer (``param_groups`` and ``step``).

    What was passed in its place is named: the model, its parameters (an iterator or a list:
    not yet an optimizer) or None, each with the call that works.

    Args:
        optimizer: what was passed as the optimizer an oracle wraps.
        spec: the oracle's spec, quoted in the message.

    Raises:
        UsageError: (source ``optimizer``) anything else than an optimizer.
    """
    if hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None)):
        return
    if optimizer is None:
        got = "None"
    elif isinstance(optimizer, nn.Module):
        got = f"the model ({type(optimizer).__name__})"
    elif isinstance(optimizer, (Iterator, list, tuple)):
        got = f"parameters ({type(optimizer).__name__}), not yet an optimizer"
    else:
        got = f"a {type(optimizer).__name__} object"
    raise UsageError(
        f"{spec.split(':')[0]} wraps a torch.optim optimizer, got {got}: "
        f"make({spec!r}, torch.optim.SGD(model.parameters(), lr=0.1), model=model)",
        source="optimizer",
    )


class PerturbedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim`` optimizer taking its step with the gradient at perturbed weights.

    Two forms, as the most used SAM wrappers have them:

    - ``step(closure)`` (timm style): ``closure`` zeroes nothing, runs forward and backward
      and returns the loss; it is called at theta and at the perturbed weights (``nso``:
      at the ``2k`` noisy points), and the base optimizer steps at theta.
    - ``first_step(zero_grad=True)`` after the clean backward (the ascent family) or before
      the one backward (``weight-noise``): moves the weights to ``theta + e``; after the
      backward there, ``second_step(zero_grad=True)`` restores theta and steps.

    ``step()`` without a closure is ``second_step()`` when a ``first_step`` is pending. With
    nothing pending it is refused (a plain step would silently train without the
    regularizer, as a host that runs the closure itself and then calls ``step()`` would),
    unless ``host_runs_passes`` is set by a host that runs the passes itself
    (:mod:`sharpcli.callbacks.hf_trainer`): then it is the base optimizer's step.

    Args:
        base_optimizer: Any ``torch.optim.Optimizer`` over the parameters; its
            ``param_groups`` and ``state`` are shared, and its ``state_dict`` is this one's.
        regularizer: A parsed perturbation oracle (``sharpcli.regularizers.make`` builds
            one from ``"sam:rho=0.05"``).
        model: The model (or its ``DistributedDataParallel``): the parameter names ASAM
            reads, the buffers restored after a perturbed pass, ``no_sync``. Optional.
        grad_scaler: A ``torch.amp.GradScaler`` the backward passes are scaled by.
        ascent_sync: ``"per-replica"`` (default) or ``"global"`` (see the module).
        perturbed_updates_buffers: Keep the buffer updates of the perturbed passes.
        generator: The noise oracles' generator (default: seeded from
            ``torch.initial_seed()`` on the parameters' device).

    Raises:
        UsageError: a regularizer that is not an oracle (a penalty), an oracle without the
            methods of :class:`~sharpcli.regularizers.base.PerturbationOracle` (which
            ``sharp train`` runs), a multi-point oracle that reads the clean gradient, or an
            unknown ``ascent_sync``.
    """

    def __init__(
        self,
        base_optimizer: torch.optim.Optimizer,
        regularizer: Oracle,
        *,
        model: nn.Module | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        ascent_sync: str = "per-replica",
        perturbed_updates_buffers: bool = False,
        generator: torch.Generator | None = None,
    ):
        if not isinstance(regularizer, Oracle):
            raise UsageError(
                f"{regularizer!r} is not a perturbation oracle (sam, usam, asam, weight-noise, "
                "nso); a penalty is added to the loss (sharpcli.regularizers.make(spec, model=))",
                source="regularizer",
            )
        if not isinstance(regularizer, PerturbationOracle):
            raise UsageError(
                f"{regularizer.name} defines no perturbations() for the optimizer wrapper; "
                "train this oracle with `sharp train`",
                source="regularizer",
            )
        if regularizer.perturbed_passes() > 1 and regularizer.reads_clean_gradient():
            raise UsageError(
                f"{regularizer.name}: the optimizer wrapper averages several points only for an "
                "oracle that reads no clean gradient; train this oracle with `sharp train`",
                source="regularizer",
            )
        if ascent_sync not in ASCENT_SYNC:
            raise UsageError(
                f"ascent_sync {ascent_sync!r} is not one of {', '.join(ASCENT_SYNC)}",
                source="ascent_sync",
            )
        check_optimizer(base_optimizer, regularizer.spec())
        super().__init__(base_optimizer.param_groups, dict(base_optimizer.defaults))
        self.base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups  # one set of groups: lr schedules
        self.state = base_optimizer.state
        self.defaults = base_optimizer.defaults
        self.regularizer = regularizer
        self.oracle: PerturbationOracle = regularizer  # what the steps call
        self.model = model
        self.grad_scaler = grad_scaler
        self.ascent_sync = ascent_sync
        self.perturbed_updates_buffers = perturbed_updates_buffers
        self.generator = generator
        self._saved: list[torch.Tensor] | None = None  # theta while perturbed
        self._theta: list[torch.Tensor] = []  # its storage, allocated once
        self._names_cache: tuple[tuple[int, ...], list[str]] | None = None
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._non_finite = False
        #: set by a host that runs the passes and calls step() once per update
        self.host_runs_passes = False

    # ----------------------------------------------------------------- what it acts on
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _names(self, params: list[torch.Tensor]) -> list[str] | None:
        """The parameters' names in the model (cached while the parameters stay the same).

        Returns:
            One name per parameter (``""`` for one the model does not hold), or None without
            a model.
        """
        if self.model is None:
            return None
        key = tuple(id(p) for p in params)
        if self._names_cache is None or self._names_cache[0] != key:
            names = {id(p): name for name, p in _unwrapped(self.model).named_parameters()}
            self._names_cache = (key, [names.get(id(p), "") for p in params])
        return self._names_cache[1]

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(torch.initial_seed())
        return self.generator

    @property
    def reads_clean_gradient(self) -> bool:
        """Whether :meth:`first_step` comes after a clean backward (the ascent family).

        ``weight-noise`` reads none: its :meth:`first_step` comes before its one backward.
        """
        return self.oracle.reads_clean_gradient()

    @property
    def perturbed_passes(self) -> int:
        """The backward passes of one step at perturbed weights (``nso``: ``2k``)."""
        return self.oracle.perturbed_passes()

    @property
    def pending(self) -> bool:
        """Whether the weights are perturbed (a :meth:`first_step` awaits its second)."""
        return self._saved is not None

    # ----------------------------------------------------------------- the two-call form
    def first_pass(self) -> contextlib.AbstractContextManager[None]:
        """The context of the clean backward.

        Returns:
            ``model.no_sync()`` for a ``DistributedDataParallel`` model (any with
            ``no_sync``) under ``ascent_sync="per-replica"``: the ascent stays local; a
            context that does nothing otherwise.
        """
        if self.ascent_sync == "per-replica" and isinstance(self.model, _DefersGradientSync):
            return self.model.no_sync()
        return contextlib.nullcontext()

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        """Move the weights to ``theta + e``.

        The ascent family reads ``e`` from the clean gradient in ``p.grad`` (unscaled by the
        grad scaler's scale); ``weight-noise`` draws its noise (no gradient read).

        Args:
            zero_grad: Zero the gradients afterwards (for the perturbed backward).

        Raises:
            UsageError: a :meth:`first_step` already pending, or an oracle averaging several
                points (``nso``: its ``2k`` passes need ``step(closure)``).
        """
        if self.pending:
            raise UsageError("first_step twice without a second_step", source="optimizer")
        passes = self.perturbed_passes
        if passes != 1:
            raise UsageError(
                f"{self.regularizer.name} averages {passes} passes: train it with "
                "optimizer.step(closure)",
                source="optimizer",
            )
        params = self._params()
        weights = [p.detach() for p in params]
        grads = None
        if self.reads_clean_gradient:  # else its one pass is at the perturbed weights: kept
            self._save_buffers()
            grads = self._clean_gradient(params)
        ((deltas, sign),) = self.oracle.perturbations(
            weights, grads, self._names(params), self._generator(weights[0].device)
        )
        # with a scaler an inf/NaN gradient is an expected event (the scale was too high): no
        # perturbation, and the step is skipped; without one it propagates as in any optimizer
        # step
        if (
            grads is not None
            and self._scaler() is not None
            and not bool(torch.isfinite(global_norm(grads)))
        ):
            self._non_finite = True
            deltas = [torch.zeros_like(w) for w in weights]
        if [t.shape for t in self._theta] != [w.shape for w in weights]:
            self._theta = [torch.empty_like(w) for w in weights]
        torch._foreach_copy_(self._theta, weights)
        self._saved = self._theta
        torch._foreach_add_(weights, deltas, alpha=sign)
        if zero_grad:
            self.zero_grad()

    def _clean_gradient(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach() for p in params]
        scaler = self._scaler()
        if scaler is not None:
            inverse = 1.0 / scaler.get_scale()
            grads = list(torch._foreach_mul(grads, inverse))
        return grads

    def _scaler(self) -> torch.amp.GradScaler | None:
        """The grad scaler when there is one and it is enabled.

        Returns:
            ``grad_scaler``, or None (no scaler, or one made with ``enabled=False``).
        """
        scaler = self.grad_scaler
        return scaler if scaler is not None and scaler.is_enabled() else None

    def _save_buffers(self) -> None:
        if self.model is None or self.perturbed_updates_buffers:
            return
        self._buffers = [(b, b.detach().clone()) for b in self.model.buffers()]

    @torch.no_grad()
    def restore(self) -> None:
        """Put theta (and the buffers as the clean pass left them) back.

        The gradient at the perturbed weights stays in ``p.grad``; a non-finite clean
        gradient marks it non-finite (the grad scaler then skips the step).

        Raises:
            UsageError: no :meth:`first_step` pending.
        """
        if self._saved is None:
            raise UsageError("restore without a first_step", source="optimizer")
        params = self._params()
        torch._foreach_copy_([p.detach() for p in params], self._saved)
        self._saved = None
        if self._buffers is not None:
            for live, saved in self._buffers:
                live.copy_(saved)
            self._buffers = None
        if self._non_finite:
            self._non_finite = False
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
                    break

    def second_step(self, zero_grad: bool = False) -> None:
        """Restore theta and step the base optimizer with the gradient in ``p.grad``.

        With a grad scaler the step goes through ``grad_scaler.step`` and
        ``grad_scaler.update``.

        Args:
            zero_grad: Zero the gradients afterwards.

        Raises:
            UsageError: no :meth:`first_step` pending.
        """
        self.restore()
        self._base_step()
        if zero_grad:
            self.zero_grad()

    def _base_step(self) -> None:
        scaler = self._scaler()
        if scaler is not None:
            scaler.step(self.base_optimizer)
            scaler.update()
        else:
            self.base_optimizer.step()

    # ----------------------------------------------------------------- the closure form
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], _Loss]) -> _Loss: ...

    def step(self, closure: Callable[[], _Loss] | None = None) -> _Loss | None:
        """One update.

        With ``closure`` (forward + backward, returns the loss): every pass of the oracle,
        then the base step. Without: :meth:`second_step` when a :meth:`first_step` is
        pending, else the base step for a host that runs the passes (see the class).

        Args:
            closure: Runs forward and backward at the current weights; returns the loss.

        Returns:
            What the closure returned at its first call: the clean pass's loss
            (``weight-noise``, ``nso``: the first noisy pass's); None without a closure.

        Raises:
            UsageError: no closure, no :meth:`first_step` pending and no host running the
                passes (a plain step would train without the regularizer).
        """
        if closure is None:
            if self.pending:
                self.second_step()
                return None
            if not self.host_runs_passes:
                raise UsageError(
                    f"{self.regularizer.name} takes its gradient at perturbed weights: call "
                    "step(closure), or first_step() and second_step() around the perturbed "
                    "backward; step() alone would be a plain step",
                    source="optimizer",
                )
            self._base_step()
            return None
        closure = torch.enable_grad()(closure)
        self.zero_grad()
        if self.perturbed_passes > 1:
            return self._averaged_step(closure)
        if not self.reads_clean_gradient:
            self.first_step()
            loss = closure()
        else:
            with self.first_pass():
                loss = closure()
            self.first_step(zero_grad=True)
            closure()
        self.second_step()
        return loss

    def _averaged_step(self, closure: Callable[[], _Loss]) -> _Loss:
        r"""The mean gradient over the oracle's points, then the step.

        ``nso``: the points :math:`\theta \pm U_j` (NSO Alg. 1).

        Returns:
            What the closure returned at the first point.
        """
        passes = self.perturbed_passes
        params = self._params()
        weights = [p.detach() for p in params]
        theta = [w.clone() for w in weights]
        total: list[torch.Tensor] | None = None
        first: list[_Loss] = []  # the first point's loss (a list: the loss may be None)
        buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        points = self.oracle.perturbations(
            weights, None, self._names(params), self._generator(weights[0].device)
        )
        for noise, sign in points:
            with torch.no_grad():
                torch._foreach_add_(weights, noise, alpha=sign)
            value = closure()
            with torch.no_grad():
                torch._foreach_copy_(weights, theta)
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach() for p in params]
            if total is None:
                total = [g.clone() for g in grads]
                first.append(value)
                if self.model is not None and not self.perturbed_updates_buffers:
                    buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
            else:
                torch._foreach_add_(total, grads)
            self.zero_grad()
        assert total is not None
        with torch.no_grad():
            for live, saved in buffers or []:
                live.copy_(saved)
        torch._foreach_div_(total, passes)
        for p, g in zip(params, total):
            p.grad = g
        self._base_step()
        return first[0]

    # ----------------------------------------------------------------- state
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients of the base optimizer's parameters."""
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state (this wrapper keeps none between steps).

        Returns:
            ``base_optimizer.state_dict()``.
        """
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the base optimizer's state."""
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state

    def __repr__(self) -> str:
        return (
            f"PerturbedOptimizer({self.regularizer.spec()!r}, {type(self.base_optimizer).__name__})"
        )


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` (or ``DataParallel``) wrapper.

    Returns:
        ``model.module`` for a wrapper, ``model`` itself otherwise.
    """
    return getattr(model, "module", model)
