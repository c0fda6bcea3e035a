r"""Hessian products by central differences of gradients (``--hvp finite-difference``).

.. math::

    H v \approx D_h(v) = \frac{\nabla L(\theta + h v) - \nabla L(\theta - h v)}{2 h}

Two plain gradients (forward and backward, no graph kept, no double backward) per product,
so it works where torch has no second derivative (fused attention kernels, custom CUDA
ops) and on models sharded by PyTorch FSDP2 (``fully_shard``), whose gradients are only
first order ([GranziolJuarev2026], whose shard-local products this follows; hessian-
eigenthings 1.0 offers the same product).

The step. The error of a central difference is a truncation term
:math:`\frac{h^2}{6} \nabla^4 L[v, v, v]` plus rounding, about :math:`\epsilon \|g\| / h`
for gradients computed to a relative :math:`\epsilon`; their sum is smallest at
:math:`h \propto \epsilon^{1/3}`, where the error is :math:`O(\epsilon^{2/3})`
([NocedalWright2006] section 8.1). Perturbations are taken relative to the weights, as
for Jacobian-free Newton-Krylov products ([KnollKeyes2004]): the a priori step moves the
weights by a vector of norm

.. math::

    \|h v\| = s_0 = \epsilon^{1/3} (1 + \|\theta\|), \qquad h = s / \|v\|,

with :math:`\epsilon` the machine epsilon of the products' dtype
(:math:`\epsilon^{1/3}` = 4.9e-3 in float32, 6.1e-6 in float64), so the perturbation stays
far above the weights' own rounding (:math:`\epsilon \|\theta\|`) whatever their scale, and
the product is homogeneous in ``v`` (``D(c v) = c D(v)`` up to rounding). The constant
of the optimum depends on the model's fourth derivatives, so before the first product the
step ``s`` is chosen from a ladder ``s0, s0/4, s0/16, s0/64`` by the measured error, and the
error bound ``beta`` (``||D(v) - H v|| <= beta ||v||``) is measured at it
(:mod:`sharpcli.curvature.products.finite_difference`: two-step comparisons at the extreme Ritz vectors of a
short Lanczos run, 30 to 48 gradients once per set of weights). Consequences: an eigenvalue
moves by at most about ``beta`` (Weyl's inequality), a probe's quadratic form ``v^T D(v)``
by at most ``beta ||v||^2`` (``beta P`` for a Rademacher probe).

Weights are restored bit for bit after every product (copied back from a snapshot, never
by subtracting the step). Only the Hessian has such a product: the Gauss-Newton and NME
products need the first-order graph kept for a second backward, and are refused
(``hvp`` is the parameter named).

The step and the error bound of finite-difference Hessian products, measured per run.

For the central difference :math:`D_s(u) = (\nabla L(\theta + s u) - \nabla L(\theta - s u)) / 2s`
of a unit vector ``u`` (:mod:`sharpcli.curvature.products.finite_difference`), the error is a
truncation :math:`c\,s^2` plus a rounding :math:`r_s` of size about :math:`\epsilon \|g\| / s`.
Comparing two steps,

.. math::

    R_s(u) = \|D_{2s}(u) - D_s(u)\| = \|3 c\,s^2 + r_{2s} - r_s\|,

is 3 times the truncation where it dominates and about 1.1 times the rounding where that
does (``|r_{2s}| ~ |r_s| / 2``, uncorrelated), so :math:`R_s(u) \ge \|D_s(u) - H u\|` on
either side of the optimum: Richardson's comparison of two steps used as an error estimate,
and, minimised over a ladder of steps, a choice of the step from estimated truncation and
rounding errors as [GillMurraySaundersWright1983] choose forward-difference intervals.

The truncation is largest along the directions of large curvature (100 to 1000 times a
random direction's on the test models), so :func:`calibrate` measures where they are: it
runs :data:`LANCZOS_STEPS` Lanczos steps of ``D`` from a seeded random unit vector, takes
the largest and the smallest Ritz vectors, walks the step down from the a priori
:math:`s_0 = \epsilon^{1/3} (1 + \|\theta\|)` by factors of 4 while the larger of their two
``R`` falls (at most :data:`RUNGS` steps), and states

.. math::

    \beta = 2 \max\big(R_{s}(u_{\max}), R_{s}(u_{\min}), R_{s}(u_0)\big), \qquad
    \|D_s(v) - H v\| \le \beta \|v\|

at the chosen step ``s`` (``u_0`` the random start). On the test models the largest error
over the Hessian's extreme eigenvectors and random directions is 1.8 to 3.3 times below
``beta`` (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sharpcli import catalogue, memory
from sharpcli.curvature.products.data import (
    all_reduce_sum,
    distributed_rank_and_world,
    to_model_batch,
)
from sharpcli.curvature.products.differentiable import reentrant_checkpoints_as_plain_forward
from sharpcli.curvature.products.engine import CurvatureEngine
from sharpcli.curvature.products.graphs import ByteCounter
from sharpcli.errors import NumericalError, UsageError

__all__ = [
    "BOUND_FACTOR",
    "HVP_METHODS",
    "LANCZOS_STEPS",
    "RUNGS",
    "calibrate",
    "Calibration",
    "FiniteDifferenceEngine",
    "is_sharded",
    "relative_step",
    "shard_model",
]

HVP_METHODS = catalogue.HVP_METHODS


def relative_step(dtype: torch.dtype) -> float:
    """``eps^(1/3)`` of ``dtype``: the central difference's step relative to ``1 + ||theta||``.

    Args:
        dtype: a floating dtype.

    Returns:
        The relative step (4.9e-3 for float32, 6.1e-6 for float64).
    """
    return float(torch.finfo(dtype).eps) ** (1.0 / 3.0)


def is_sharded(params) -> bool:
    """Whether any of ``params`` is a DTensor (a parameter sharded by FSDP2's ``fully_shard``).

    Args:
        params: parameters.

    Returns:
        True for a sharded model.
    """
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model``'s parameters across the process group with FSDP2 (``fully_shard``).

    Every module that owns parameters directly becomes its own FSDP unit (its parameters
    gathered for its forward and backward only), then the root; each rank keeps a dim-0
    shard of every parameter. The model is changed in place.

    Args:
        model: the model, identical on every rank.

    Returns:
        ``model``.

    Raises:
        UsageError: (``hvp``, whose ``fsdp`` asks for the sharding on the command line) no
            process group (not under torchrun).
    """
    from torch.distributed.fsdp import fully_shard

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise UsageError(
            "sharding the model by FSDP needs a process group: run under torchrun",
            source="hvp",
        )
    if is_sharded(model.parameters()):
        return model
    units = [
        module
        for module in model.modules()
        if module is not model and any(True for _ in module.parameters(recurse=False))
    ]
    sharded = [fully_shard(module) for module in units] + [fully_shard(model)]
    # the analysis loss weights each batch by B_b / N over the global N: the ranks' gradients
    # are summed, not averaged (FSDP2 divides by the world size by default)
    for unit in sharded:
        unit.set_gradient_divide_factor(1.0)
    return model


class FiniteDifferenceEngine(CurvatureEngine):
    r"""The Hessian product as a central difference of gradients (module docstring).

    ``hessian_matmat(V)`` costs two gradients (a forward and a backward each, over this
    rank's batches) per column. The other products of :class:`CurvatureEngine` (G, N, the
    joint pass, the cached first-order graphs that the Fisher operators use) are refused with
    a UsageError on ``hvp``. On a model sharded by FSDP2 each rank perturbs and reads its own
    shard and the product's columns are gathered whole; otherwise the ranks' sums are added
    with ``all_reduce_sum`` as in the exact engine.

    Args:
        model: the model (its parameters may be FSDP2-sharded DTensors).
        data: the analysis set.
        scope: the parameters differentiated.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
        >>> data, scope = AnalysisData(x, y, "cross-entropy", 5), ParamScope.resolve(model)
        >>> fd = FiniteDifferenceEngine(model, data, scope)
        >>> v = torch.randn(scope.numel, dtype=torch.float64)
        >>> error = fd.hessian_matmat(v) - CurvatureEngine(model, data, scope).hessian_matmat(v)
        >>> bool(error.norm() <= fd.error_bound() * v.norm())
        True
    """

    # differences of whole-set gradients: no per-batch parts to record (no data error)
    records_batch_forms = False

    def __init__(self, model, data, scope):
        super().__init__(model, data, scope, cache_bytes=0, vectorize=1)
        self.sharded = is_sharded(scope.params)
        self.relative_step = relative_step(scope.dtype)
        # gradients over the analysis set: two per product column, four for the bound
        self.gradients = 0
        self._bound: tuple[int, Calibration] | None = None  # (weights epoch, its calibration)
        # the weights' version counters as the last product left them, and the epoch they
        # belong to: it moves only when the weights change outside this engine
        self._restored_versions: tuple | None = None
        self._epoch = 0

    # ----------------------------------------------------------------- refused products
    def _refuse(self, what: str):
        raise UsageError(
            f"the finite-difference product gives the Hessian only; {what} needs the "
            "double backward of `hvp=exact`",
            source="hvp",
        )

    def ggn_matmat(self, V, *, operator="Gauss-Newton"):
        """Refused: G needs the first-order graph kept (UsageError on ``hvp``)."""
        self._refuse("the Gauss-Newton product")

    def nme_matmat(self, V, *, operator="NME"):
        """Refused: N needs the first-order graph kept (UsageError on ``hvp``)."""
        self._refuse("the NME product")

    def hessian_and_ggn_matvec(self, v):
        """Refused: the joint pass needs the first-order graph kept (UsageError on ``hvp``)."""
        self._refuse("the joint Hessian and Gauss-Newton product")

    def require_gauss_newton(self, operator: str) -> None:
        """Refused (UsageError on ``hvp``): the ``ggn`` and ``nme`` operators (and any with a G
        part), built by the registry on this engine, need the first-order graphs.

        Args:
            operator: the operator's name.
        """
        self._refuse(f"the {operator} operator")

    def _graphs(self):
        self._refuse("an operator built on the first-order graphs")

    def clear_cache(self) -> None:
        """Forget the measured error bound (nothing else is cached): the next report measures
        it again at the current weights (a fused optimizer step moves no version counter)."""
        super().clear_cache()
        self._bound = None

    # ----------------------------------------------------------------- memory
    def plan_memory(self, plan, *, auto_cache: bool = False) -> None:
        """Count the product's workspace in the run's memory plan (nothing is cached).

        A product holds a snapshot of the weights (this rank's shard), the two gradients and
        the column's difference, four parameter-sized vectors, and one batch's forward
        activations for its backward (measured on the first batch with saved-tensor hooks;
        not measured on a sharded model, whose forward gathers weights collectively).
        ``auto_cache`` is ignored: there are no graphs to keep.

        Args:
            plan: the run's :class:`~sharpcli.memory.MemoryPlan`.
            auto_cache: unused.
        """
        local = sum(self._local(p).numel() for p in self.scope.params)
        workspace = 4 * local * (torch.finfo(self.scope.dtype).bits // 8)
        if not self.sharded:
            for x_b, y_b, weight in self.data.batches():
                x_b, y_b = to_model_batch(x_b, y_b, self.scope.dtype, self.scope.device)
                counter = ByteCounter()
                with (
                    torch.enable_grad(),
                    reentrant_checkpoints_as_plain_forward(),  # as the products run it
                    torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack),
                ):
                    self.loss(self.model(x_b), y_b) * weight
                workspace += counter.nbytes
                break
        plan.require(
            "one batch's finite-difference product (its activations, a weight snapshot and "
            "two gradients)",
            workspace,
            "lower `batch_size`",
        )
        plan.reserve(memory.PRODUCT_WORKSPACE, workspace)
        plan.note(
            "Hessian products by central differences of gradients (two gradients a product, "
            "no graph kept)"
        )

    # ----------------------------------------------------------------- shards
    @staticmethod
    def _local(p: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter or gradient (the whole tensor when unsharded)."""
        return p.to_local() if hasattr(p, "to_local") else p

    def _local_slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parameter-shaped parts of a flat full-length vector that this rank's shards hold.

        FSDP2 shards a parameter on dim 0 as ``torch.chunk`` does (rank r takes chunk r,
        empty past the last chunk).
        """
        parts = self.scope.unflatten(flat)
        if not self.sharded:
            return parts
        rank, world = distributed_rank_and_world()
        out = []
        for part, p in zip(parts, self.scope.params):
            local = self._local(p)
            chunks = part.chunk(world, dim=0) if part.dim() else (part,)
            piece = chunks[rank] if rank < len(chunks) else part[:0]
            if piece.shape != local.shape:
                raise NumericalError(
                    f"a shard of shape {tuple(local.shape)} does not match the dim-0 chunk "
                    f"{tuple(piece.shape)} of a parameter of shape {tuple(part.shape)}",
                    source="fsdp",
                )
            out.append(piece)
        return out

    def _gather(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """The full flat vector from this rank's parameter-shaped parts (an all-gather each
        when sharded)."""
        if not self.sharded:
            return self._flat(locals_)
        from torch.distributed.tensor import DTensor

        full = []
        for t, p in zip(locals_, self.scope.params):
            assert isinstance(p, DTensor)  # every parameter of a sharded model
            layout = DTensor.from_local(
                t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
            full.append(layout.full_tensor())
        return self._flat(full)

    def weight_norm(self) -> float:
        """``||theta||`` over the scope (float64; summed over the shards when sharded).

        Returns:
            The norm.
        """
        local = torch.zeros((), dtype=torch.float64)
        for p in self.scope.params:
            local += self._local(p.detach()).double().pow(2).sum().cpu()
        if self.sharded:
            all_reduce_sum(local)
        return math.sqrt(float(local))

    def initial_step(self) -> float:
        """``s0 = eps^(1/3) (1 + ||theta||)``, the a priori step (the calibration of
        :mod:`sharpcli.curvature.products.finite_difference` walks it down while the error falls).

        Returns:
            ``s0``.
        """
        return self.relative_step * (1.0 + self.weight_norm())

    # ----------------------------------------------------------------- gradients
    def _batches(self):
        """This rank's batches; under FSDP padded with zero-weight repeats of its first batch
        to the largest rank's count (every rank must run as many forward and backward passes
        as the others: FSDP gathers parameters collectively)."""
        batches = list(self.data.batches())
        if self.sharded:
            count = torch.tensor(float(len(batches)), dtype=torch.float64)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            if not batches:
                raise UsageError("a rank has no samples to analyse", source="samples")
            batches += [(batches[0][0], batches[0][1], 0.0)] * (int(count) - len(batches))
        return batches

    def _batch_gradient(self, x_b, y_b, weight: float, index: int) -> tuple[float, list]:
        """One batch's weighted loss and its gradient (this rank's parameter-shaped parts)."""
        params = list(self.scope.params)
        # first derivatives only: the model's own kernels (fused attention) stay, but a
        # reentrant checkpoint would drop its parameters' gradients (module differentiable)
        with torch.enable_grad(), reentrant_checkpoints_as_plain_forward():
            loss_b = self.loss(self.model(x_b), y_b) * weight
            if not torch.isfinite(loss_b):
                raise NumericalError(
                    f"loss is {loss_b.item()} on batch {index} at perturbed weights",
                    source="Hessian operator",
                )
            if not self.sharded:
                grads = torch.autograd.grad(loss_b, params, allow_unused=True)
                zeros = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
                return float(loss_b.detach()), zeros
            for p in params:
                p.grad = None
            loss_b.backward()  # FSDP reduce-scatters the shards' gradients (summed)
        out = [
            torch.zeros_like(self._local(p)) if p.grad is None else self._local(p.grad)
            for p in params
        ]
        for p in params:
            p.grad = None
        return float(loss_b.detach()), out

    def _weights_epoch(self) -> int:
        """A number that changes when the weights changed since this engine last restored them
        (restoring moves the version counters too, but leaves the weights as they were)."""
        versions = self._state_versions()
        if versions != self._restored_versions:
            self._epoch += 1
            self._restored_versions = versions
        return self._epoch

    @contextlib.contextmanager
    def _restoring(self):
        """Snapshot the scope's weights (this rank's shards), restore them bit for bit after."""
        self._weights_epoch()
        locals_ = [self._local(p) for p in self.scope.params]
        with torch.no_grad():
            snapshot = [t.detach().clone() for t in locals_]
        try:
            yield snapshot
        finally:
            with torch.no_grad():
                for t, saved in zip(locals_, snapshot):
                    t.copy_(saved)
            self._restored_versions = self._state_versions()

    def _difference(self, v: torch.Tensor, step: float, snapshot, batches) -> torch.Tensor:
        """``D(v) = (g(theta + h v) - g(theta - h v)) / (2 h)`` with ``h = step / ||v||``,
        batch by batch (each batch's difference before the sum, so large gradients cancel
        before they are added); the weights are left at ``theta - h v``."""
        norm = float(torch.linalg.vector_norm(v.double()))
        if norm == 0.0:
            return torch.zeros_like(v)
        h = step / norm
        parts = self._local_slices(v)
        locals_ = [self._local(p) for p in self.scope.params]
        total = [torch.zeros_like(t) for t in locals_]
        dtype, device = self.scope.dtype, self.scope.device
        for index, (x_b, y_b, weight) in enumerate(batches):
            x_b, y_b = to_model_batch(x_b, y_b, dtype, device)
            gradients = []
            for sign in (1.0, -1.0):
                with torch.no_grad():
                    for t, saved, dv in zip(locals_, snapshot, parts):
                        torch.add(saved, dv, alpha=sign * h, out=t)
                gradients.append(self._batch_gradient(x_b, y_b, weight, index)[1])
            for acc, plus, minus in zip(total, *gradients):
                acc += (plus - minus) / (2.0 * h)
        self.gradients += 2
        flat = self._gather(total)
        if not self.sharded:
            all_reduce_sum(flat)
        if not torch.isfinite(flat).all():
            raise NumericalError(
                "Hessian product by finite differences is not finite", source="Hessian operator"
            )
        return flat

    # ----------------------------------------------------------------- products
    def hessian_matmat(self, V: torch.Tensor, *, operator: str = "Hessian") -> torch.Tensor:
        """The Hessian product by central differences, two gradients a column.

        Args:
            V: a ``(P, k)`` block or a ``(P,)`` vector.
            operator: unused (the name of the product in the exact engine's errors).

        Returns:
            :math:`D(V) \\approx H V`, shaped like ``V``; the weights as they were, bit for bit.
        """
        squeeze = V.dim() == 1
        V = self._as_block(V)
        out = torch.zeros_like(V)
        step = self._calibration().step
        batches = self._batches()
        with self._restoring() as snapshot:
            for j in range(V.shape[1]):
                out[:, j] = self._difference(V[:, j], step, snapshot, batches)
        memory.trim_heap()
        return out[:, 0] if squeeze else out

    def loss_and_gradient(self) -> tuple[float, torch.Tensor]:
        """The analysis loss and its gradient (first derivatives only, any model).

        Returns:
            ``(L(theta), grad L(theta))``, flat in the scope's layout.
        """
        scope = self.scope
        total = torch.zeros((), dtype=torch.float64)
        grad = [torch.zeros_like(self._local(p)) for p in scope.params]
        for index, (x_b, y_b, weight) in enumerate(self._batches()):
            x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
            loss_b, parts = self._batch_gradient(x_b, y_b, weight, index)
            total += loss_b
            for acc, g in zip(grad, parts):
                acc += g
        self.gradients += 1
        flat = self._gather(grad)
        if not self.sharded:
            all_reduce_sum(flat)
        return float(all_reduce_sum(float(total))), flat

    # ----------------------------------------------------------------- the error bound
    def error_bound(self) -> float:
        """``beta``: ``||D(v) - H v|| <= beta ||v||`` at the chosen step (module docstring).

        Returns:
            ``beta``.
        """
        return float(self.bound_record()["error_bound"])

    def _calibration(self) -> Calibration:
        """The step and the bound at the current weights (:func:`calibrate`), measured once
        per set of weights, before the first product."""
        epoch = self._weights_epoch()
        if self._bound is not None and self._bound[0] == epoch:
            return self._bound[1]
        s0 = self.initial_step()
        batches = self._batches()
        with self._restoring() as snapshot:

            def difference(u: torch.Tensor, step: float) -> torch.Tensor:
                u = u.to(self.scope.dtype)
                return self._difference(u, step, snapshot, batches).double()

            calibration = calibrate(difference, self.scope.numel, self.scope.device, s0)
        self._bound = (epoch, calibration)
        return calibration

    def bound_record(self) -> dict:
        """The report's ``hvp`` record: the steps, the bound and what they cost.

        Returns:
            ``{"method", "relative_step", "weight_norm", "initial_step", "step_factor",
            "step_norm", "error_bound", "error_bound_relative", "calibration_gradients",
            "gradients"}`` (``step_norm``: the step used, ``initial_step`` times
            ``step_factor``; ``error_bound_relative``: ``beta`` over the largest ``||D u||``
            of the calibration, about ``||H||_2``).
        """
        calibration = self._calibration()
        return {
            "method": "finite-difference",
            "relative_step": self.relative_step,
            "weight_norm": self.weight_norm(),
            "initial_step": calibration.step / calibration.step_factor,
            "step_factor": calibration.step_factor,
            "step_norm": calibration.step,
            "error_bound": calibration.error_bound,
            "error_bound_relative": (
                calibration.error_bound / calibration.scale if calibration.scale > 0 else None
            ),
            "calibration_gradients": calibration.gradients,
            "gradients": self.gradients,
        }


BOUND_FACTOR = 2.0  # beta: this times the largest two-step difference (module docstring)
CALIBRATION_SEED = 0x5EED  # the seeded unit vector the Lanczos steps start from
LANCZOS_STEPS = 6  # to the extreme Ritz vectors, where the curvature is
RUNGS = 4  # steps s0, s0/4, s0/16, s0/64 at most
RUNG_RATIO = 4.0


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured.

    Attributes:
        step: the chosen step ``s`` (the norm of every perturbation ``h v``).
        step_factor: ``s / s0``, a power of 1/4.
        error_bound: ``beta``.
        scale: the largest ``||D u||`` of the Lanczos steps (about ``||H||_2``).
        gradients: the gradients over the analysis set it took.
    """

    step: float
    step_factor: float
    error_bound: float
    scale: float
    gradients: int


def calibrate(
    difference: Callable[[torch.Tensor, float], torch.Tensor], numel: int, device, s0: float
) -> Calibration:
    """Choose the step and measure the error bound (module docstring).

    Args:
        difference: ``(u, s) -> D_s(u)`` in float64 for a float64 vector ``u`` (two gradients).
        numel: the number of parameters P.
        device: where the vectors live.
        s0: the a priori step ``eps^(1/3) (1 + ||theta||)``.

    Returns:
        The :class:`Calibration`.
    """
    gradients = 0

    def product(u: torch.Tensor, s: float) -> torch.Tensor:
        nonlocal gradients
        gradients += 2
        return difference(u, s)

    def two_steps(u: torch.Tensor, s: float, near: torch.Tensor | None = None) -> float:
        near = product(u, s) if near is None else near
        return float(torch.linalg.vector_norm(product(u, 2.0 * s) - near))

    basis, products, ritz = _short_lanczos(lambda u: product(u, s0), numel, device)
    best: tuple[float, float] | None = None  # (step factor, its largest R at the Ritz vectors)
    factor = 1.0
    for _ in range(RUNGS):
        largest = max(two_steps(u, s0 * factor) for u in ritz)
        if best is not None and largest >= best[1]:
            break
        best = (factor, largest)
        factor /= RUNG_RATIO
    assert best is not None
    factor, largest = best
    near = products[:, 0] if factor == 1.0 else None
    largest = max(largest, two_steps(basis[:, 0], s0 * factor, near))
    scale = float(torch.linalg.vector_norm(products, dim=0).max())
    return Calibration(s0 * factor, factor, BOUND_FACTOR * largest, scale, gradients)


def _short_lanczos(product: Callable[[torch.Tensor], torch.Tensor], numel: int, device):
    """:data:`LANCZOS_STEPS` Lanczos steps (full reorthogonalisation, float64) of ``product``
    from a seeded unit vector: the basis, its products, and the Ritz vectors of the largest
    and the smallest Ritz value."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    start = torch.randn(numel, generator=generator, dtype=torch.float64)
    steps = max(1, min(LANCZOS_STEPS, numel))
    basis = torch.zeros(numel, steps, dtype=torch.float64, device=device)
    products = torch.zeros_like(basis)
    basis[:, 0] = (start / start.norm()).to(device)
    taken = steps
    for j in range(steps):
        products[:, j] = product(basis[:, j])
        if j + 1 == steps:
            break
        kept = basis[:, : j + 1]
        residual = products[:, j] - kept @ (kept.T @ products[:, j])
        residual -= kept @ (kept.T @ residual)  # twice is enough ([Parlett1998])
        norm = float(residual.norm())
        if norm <= 1e-12 * float(products[:, j].norm()):  # an invariant subspace
            taken = j + 1
            break
        basis[:, j + 1] = residual / norm
    basis, products = basis[:, :taken], products[:, :taken]
    projected = basis.T @ products
    _, vectors = torch.linalg.eigh((projected + projected.T) / 2)
    ritz = [basis @ vectors[:, -1]] + ([basis @ vectors[:, 0]] if taken > 1 else [])
    return basis, products, ritz
