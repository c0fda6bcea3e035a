"""Per-sample squared gradient norms without per-sample gradients (ghost norms).

For a layer ``out = W a + b`` applied to one sample, the gradient of ``<s, z>`` (any output
direction ``s``) w.r.t. ``W`` is ``delta a^T`` with ``delta = d<s, z>/d out``, so

    ||grad_W||^2 = ||delta||^2 ||a||^2,     ||grad_b||^2 = ||delta||^2

(Goodfellow 2015, "Efficient per-example gradient computations"). With positions
(sequence tokens, conv patches ``U = unfold(a)``) the gradient is ``delta U^T`` summed
over positions: it is formed per sample (``d_out x d_in`` numbers) or, when positions are
fewer, its norm is taken from Gram matrices, ``sum_{t,t'} (delta_t . delta_t')(a_t . a_t')``
(Rochette, Manoel & Tramel 2019). One backward pass from ``z`` to the layers' OUTPUTS
(no weight gradients) gives ``delta`` for every sample at once, because in eval mode the
samples of a batch do not interact.

:class:`LayerTaps` records the inputs and outputs of the ``nn.Linear``, ``nn.Conv2d`` and
eval-mode BatchNorm modules (``out = gamma a_hat + beta`` per channel, so the per-sample
gradients are ``sum_pos delta a_hat`` and ``sum_pos delta``) that own parameters of a scope;
parameters of other modules (custom layers, shared weights, layers called twice) are reported in ``uncovered`` so the caller
can use a generic per-sample Jacobian for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from sharpcli.curvature.scope import ParamScope

__all__ = ["LayerTaps"]


def _is_plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _is_eval_batchnorm(module: nn.Module) -> bool:
    """BatchNorm normalising with its running statistics (eval mode): samples do not interact."""
    return (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and type(module).forward is nn.modules.batchnorm._BatchNorm.forward
        and not module.training
        and module.running_mean is not None
        and module.affine
    )


def _is_plain_conv2d(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Conv2d)
        and type(module).forward is nn.Conv2d.forward
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


@dataclass
class _Tap:
    module: nn.Module
    weight: int | None  # scope index of the module's weight (None: not in scope)
    bias: int | None
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    def clear(self):
        self.inputs.clear()
        self.outputs.clear()


class LayerTaps:
    """Forward hooks on the scope's plain ``Linear``/``Conv2d``/eval BatchNorm layers; per-sample squared norms.

    Use as a context manager around the forward pass of a batch; then
    :meth:`accumulate` adds, for one output direction ``S`` (shape of the logits),
    ``sum_i ||d<S_i, z_i>/d theta_p||^2`` into ``totals[p]`` for every covered parameter ``p``.
    """

    def __init__(self, model: nn.Module, scope: ParamScope):
        index = {id(p): i for i, p in enumerate(scope.params)}
        owners: dict[int, int] = {}
        taps = []
        for module in model.modules():
            if not (
                _is_plain_linear(module) or _is_plain_conv2d(module) or _is_eval_batchnorm(module)
            ):
                continue
            w = index.get(id(module.weight))
            b = index.get(id(module.bias)) if module.bias is not None else None
            if w is None and b is None:
                continue
            taps.append(_Tap(module, w, b))
            for i in (w, b):
                if i is not None:
                    owners[i] = owners.get(i, 0) + 1
        # a parameter shared by two layers has a per-sample gradient that is a sum: not separable
        shared = {i for i, n in owners.items() if n > 1}
        self.taps = [t for t in taps if t.weight not in shared and t.bias not in shared]
        self.num_params = len(scope.params)
        self._handles = []

    # --------------------------------------------------------------- recording
    def _hook(self, tap: _Tap):
        def record(module, args, output):
            tap.inputs.append(args[0].detach())
            tap.outputs.append(output)
            # the rest of the network sees a copy, so an in-place op downstream (ReLU(inplace))
            # cannot change the tensor whose gradient is taken
            return output.clone()

        return record

    def __enter__(self):
        for tap in self.taps:
            tap.clear()
            self._handles.append(tap.module.register_forward_hook(self._hook(tap)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False

    @property
    def active(self) -> list[_Tap]:
        """Taps whose layer ran exactly once in the recorded forward pass."""
        return [t for t in self.taps if len(t.outputs) == 1 and t.outputs[0].requires_grad]

    @property
    def covered(self) -> set[int]:
        """Scope indices whose per-sample norms :meth:`accumulate` computes."""
        out = set()
        for tap in self.active:
            out.update(i for i in (tap.weight, tap.bias) if i is not None)
        return out

    @property
    def uncovered(self) -> list[int]:
        """Scope indices left to a generic per-sample method."""
        covered = self.covered
        return [i for i in range(self.num_params) if i not in covered]

    # --------------------------------------------------------------- norms
    def accumulate(self, z: torch.Tensor, direction: torch.Tensor, totals: torch.Tensor) -> None:
        """``totals[p] += sum_i ||grad_p <direction_i, z_i>||^2`` (float64) for covered ``p``.

        One backward pass from ``z`` to the covered layers' outputs; the graph is retained
        so the caller can ask for further directions.
        """
        active = self.active
        if not active:
            return
        deltas = torch.autograd.grad(
            z,
            [t.outputs[0] for t in active],
            grad_outputs=direction,
            retain_graph=True,
            allow_unused=True,
        )
        for tap, delta in zip(active, deltas):
            if delta is None:
                continue
            w_sq, b_sq = _layer_sq_norms(tap.module, tap.inputs[0], delta, tap.weight is not None)
            if tap.weight is not None:
                totals[tap.weight] += w_sq.sum().to(torch.float64)
            if tap.bias is not None:
                totals[tap.bias] += b_sq.sum().to(torch.float64)


def _layer_sq_norms(module: nn.Module, a: torch.Tensor, delta: torch.Tensor, want_weight: bool):
    """Per-sample ``(||grad_W||^2, ||grad_b||^2)``, each of shape ``(B,)``."""
    B = delta.shape[0]
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        # eval mode: out = gamma * a_hat + beta per channel (dim 1), a_hat from running statistics
        shape = (1, -1) + (1,) * (a.dim() - 2)
        a_hat = (a - module.running_mean.reshape(shape)) / (
            module.running_var.reshape(shape) + module.eps
        ).sqrt()
        dims = tuple(range(2, delta.dim()))
        b_sq = (delta.sum(dims) if dims else delta).square().sum(1)
        if not want_weight:
            return None, b_sq
        w = delta * a_hat
        return (w.sum(dims) if dims else w).square().sum(1), b_sq
    if isinstance(module, nn.Conv2d):
        # a: (B, C_in, H, W) -> patches U: (B, C_in*k*k, L); delta: (B, C_out, L)
        delta = delta.reshape(B, delta.shape[1], -1)
        b_sq = delta.sum(2).square().sum(1)
        if not want_weight:
            return None, b_sq
        U = F.unfold(
            a,
            module.kernel_size,
            dilation=module.dilation,
            padding=module.padding,
            stride=module.stride,
        )
        return _positions_sq_norm(delta.transpose(1, 2), U.transpose(1, 2)), b_sq
    # Linear: a (B, ..., d_in), delta (B, ..., d_out)
    if delta.dim() == 2:
        b_sq = delta.square().sum(1)
        w_sq = b_sq * a.square().sum(1) if want_weight else None
        return w_sq, b_sq
    delta = delta.reshape(B, -1, delta.shape[-1])
    b_sq = delta.sum(1).square().sum(1)
    if not want_weight:
        return None, b_sq
    return _positions_sq_norm(delta, a.reshape(B, -1, a.shape[-1])), b_sq


def _positions_sq_norm(delta: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``||sum_t delta_t a_t^T||_F^2`` per sample for ``delta`` (B, T, d_out), ``a`` (B, T, d_in)."""
    T, d_out, d_in = delta.shape[1], delta.shape[2], a.shape[2]
    if d_out * d_in <= T * T:
        grads = delta.transpose(1, 2) @ a  # (B, d_out, d_in), formed per sample
        return grads.square().sum((1, 2))
    return ((delta @ delta.transpose(1, 2)) * (a @ a.transpose(1, 2))).sum((1, 2))
