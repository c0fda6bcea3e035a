"""Per-sample squared gradient norms without per-sample Jacobians (ghost norms).

For a layer ``out = W a + b`` applied to one sample, the gradient of ``<s, z>`` (any output
direction ``s``) w.r.t. ``W`` is ``delta a^T`` with ``delta = d<s, z>/d out``, so

    ||grad_W||^2 = ||delta||^2 ||a||^2,     ||grad_b||^2 = ||delta||^2

[Goodfellow2015]. With positions (sequence tokens, conv patches ``U = unfold(a)``) the
gradient is ``sum_t delta_t a_t^T``; its norm is taken from the per-sample gradient
(``d_out x d_in`` numbers) or, when positions are fewer, from Gram matrices,
``sum_{t,t'} (delta_t . delta_t')(a_t . a_t')`` [Rochette2019]. One backward pass from ``z``
to the layers' OUTPUTS (no weight gradients) gives ``delta`` for every sample at once,
because in eval mode the samples of a batch do not interact.

Shared parameters. A parameter used more than once (a layer called twice, a weight tied
between two layers, an embedding tied to the output head) has a per-sample gradient that is
the SUM of its uses' gradients, and the square of a sum is not the sum of squares. Every use
is therefore recorded as a factor pair ``(u_t, v_t)`` with gradient ``sum_t u_t v_t^T`` (a
weight viewed as a matrix) or as a per-sample vector (biases, normalisation affines); the uses
of one parameter are concatenated along the positions before squaring. A parameter counts as
covered only when the recorded uses are ALL of its uses in the autograd graph of the logits
(one graph edge into its gradient accumulator per recorded use); any other use (a functional
call on ``module.weight``, a custom layer) leaves it to the caller's generic per-sample
Jacobian path.

Layers with a ghost-norm rule: ``nn.Linear`` (any leading shape), ``nn.Conv2d`` (zero
padding, one group), ``nn.Embedding`` (no ``max_norm``/``scale_grad_by_freq``; a one-hot
``u_t``), ``nn.LayerNorm`` (``grad_gamma = sum_t delta_t * x_hat_t``), and BatchNorm in eval
mode (``grad_gamma = sum_pos delta * a_hat`` per channel, running statistics).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from sharpcli.curvature.products.scope import ParamScope

__all__ = ["LayerTaps", "autograd_uses"]

_CHUNK_BYTES = 64 << 20  # memory for one chunk of per-sample factors / Gram matrices


# --------------------------------------------------------------------------- which layers
def _is_plain(module: nn.Module, cls) -> bool:
    return isinstance(module, cls) and type(module).forward is cls.forward


def _is_eval_batchnorm(module: nn.Module) -> bool:
    """BatchNorm normalising with its running statistics (eval mode): samples do not interact."""
    return (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and type(module).forward is nn.modules.batchnorm._BatchNorm.forward
        and not module.training
        and module.running_mean is not None
        and module.affine
    )


def _is_tappable(module: nn.Module) -> bool:
    if _is_plain(module, nn.Linear) or _is_plain(module, nn.LayerNorm):
        return True
    if _is_plain(module, nn.Conv2d):
        return bool(
            module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
    if _is_plain(module, nn.Embedding):
        return module.max_norm is None and not module.scale_grad_by_freq
    return _is_eval_batchnorm(module)


# --------------------------------------------------------------------------- per-use gradients
@dataclass
class _OneHot:
    """Rows ``e_{index_t}`` of the identity of size ``size``, kept as indices (B, T)."""

    index: torch.Tensor
    size: int

    def dense(self, dtype) -> torch.Tensor:
        return F.one_hot(self.index, self.size).to(dtype)


@dataclass
class _Outer:
    """Per-sample gradient ``sum_t u_t v_t^T`` of a weight viewed as (m, n): u (B,T,m), v (B,T,n)."""

    u: torch.Tensor | _OneHot
    v: torch.Tensor


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


def _use_gradients(module: nn.Module, a: torch.Tensor, delta: torch.Tensor):
    """One call's per-sample gradients ``(weight, bias)``: each an :class:`_Outer` or (B, n)."""
    B = delta.shape[0]
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        # eval mode: out = gamma * a_hat + beta per channel (dim 1), a_hat from running statistics
        shape = (1, -1) + (1,) * (a.dim() - 2)
        assert module.running_mean is not None and module.running_var is not None  # tappable
        mean, var = module.running_mean.reshape(shape), module.running_var.reshape(shape)
        a_hat = (a - mean) / (var + module.eps).sqrt()
        dims = tuple(range(2, delta.dim()))
        w = delta * a_hat
        return (w.sum(dims) if dims else w), (delta.sum(dims) if dims else delta)
    if isinstance(module, nn.LayerNorm):
        # out = gamma * x_hat + beta over the normalised trailing dims, x_hat per position
        dims = tuple(range(a.dim() - len(module.normalized_shape), a.dim()))
        mean = a.mean(dims, keepdim=True)
        var = a.var(dims, unbiased=False, keepdim=True)
        x_hat = (a - mean) / (var + module.eps).sqrt()
        n = int(torch.Size(module.normalized_shape).numel())
        w = (delta * x_hat).reshape(B, -1, n).sum(1)
        return w, delta.reshape(B, -1, n).sum(1)
    if isinstance(module, nn.Embedding):
        # out_t = E[index_t]: grad_E = sum_t e_{index_t} delta_t^T; padding rows get no gradient
        index = a.reshape(B, -1)
        delta = delta.reshape(B, -1, delta.shape[-1])
        if module.padding_idx is not None:
            delta = delta * (index != module.padding_idx).unsqueeze(-1).to(delta.dtype)
        return _Outer(_OneHot(index, module.num_embeddings), delta), None
    if isinstance(module, nn.Conv2d):
        # a: (B, C_in, H, W) -> patches U: (B, C_in*k*k, L); delta: (B, C_out, L)
        delta = delta.reshape(B, delta.shape[1], -1).transpose(1, 2)
        padding = module.padding
        assert not isinstance(padding, str)  # "same"/"valid" convolutions are not tapped
        U = F.unfold(
            a,
            module.kernel_size,
            dilation=module.dilation,
            padding=padding,
            stride=module.stride,
        )
        return _Outer(delta, U.transpose(1, 2)), delta.sum(1)
    # Linear: a (B, ..., d_in), delta (B, ..., d_out)
    u = delta.reshape(B, -1, delta.shape[-1])
    return _Outer(u, a.reshape(B, -1, a.shape[-1])), u.sum(1)


# --------------------------------------------------------------------------- squared norms
def _cat_u(parts: list, dtype) -> torch.Tensor | _OneHot:
    if all(isinstance(p, _OneHot) for p in parts):
        return _OneHot(torch.cat([p.index for p in parts], 1), parts[0].size)
    return torch.cat([p.dense(dtype) if isinstance(p, _OneHot) else p for p in parts], 1)


def _gram(u) -> torch.Tensor:
    if isinstance(u, _OneHot):
        return (u.index[:, :, None] == u.index[:, None, :]).to(torch.float64)
    return u @ u.transpose(1, 2)


def _dense_u(u, dtype) -> torch.Tensor:
    return u.dense(dtype) if isinstance(u, _OneHot) else u


def _rows(u, index: slice):
    return _OneHot(u.index[index], u.size) if isinstance(u, _OneHot) else u[index]


def _outer_sq_norms(u, v: torch.Tensor) -> torch.Tensor:
    """``||sum_t u_t v_t^T||_F^2`` per sample, in memory-bounded chunks of samples.

    The gradient is formed per sample when ``m n <= T^2``; otherwise the Gram identity
    ``sum_{t,t'} (u_t . u_t')(v_t . v_t')`` needs only T x T numbers per sample.
    """
    B, T, n = v.shape
    m = u.size if isinstance(u, _OneHot) else u.shape[2]
    explicit = m * n <= T * T
    per_sample = (m * n if explicit else T * T) + T * (m + n)
    rows = max(1, _CHUNK_BYTES // max(1, per_sample * v.element_size()))
    out = []
    for start in range(0, B, rows):
        uc, vc = _rows(u, slice(start, start + rows)), v[start : start + rows]
        if explicit:
            grads = _dense_u(uc, v.dtype).transpose(1, 2) @ vc  # (b, m, n)
            out.append(grads.square().sum((1, 2)))
        else:
            out.append((_gram(uc).to(v.dtype) * (vc @ vc.transpose(1, 2))).sum((1, 2)))
    return torch.cat(out)


def _combined_sq_norms(parts: list) -> torch.Tensor:
    """Per-sample ``||sum over uses of the use's gradient||^2`` for one parameter."""
    if all(isinstance(p, _Outer) for p in parts):
        dtype = parts[0].v.dtype
        u = _cat_u([p.u for p in parts], dtype)
        return _outer_sq_norms(u, torch.cat([p.v for p in parts], 1))
    total: torch.Tensor | int = 0
    for p in parts:
        if isinstance(p, _Outer):  # a tie between a matrix use and a vector use: form it
            p = (_dense_u(p.u, p.v.dtype).transpose(1, 2) @ p.v).flatten(1)
        total = total + p
    assert isinstance(total, torch.Tensor)  # parts is not empty
    return total.square().sum(1)


# --------------------------------------------------------------------------- graph uses
def autograd_uses(output: torch.Tensor, params: Sequence[torch.Tensor]) -> list[int]:
    """How many times each of ``params`` enters the autograd graph of ``output``.

    Counts the edges into each parameter's gradient accumulator from the graph nodes that
    ``output`` depends on: a parameter used twice (two layers, one layer called twice, a
    functional use of ``module.weight``) has two.

    Args:
        output: a tensor with an autograd graph.
        params: the parameters.

    Returns:
        The count for each of ``params``, in order.
    """
    index = {id(p): i for i, p in enumerate(params)}
    counts = [0] * len(params)
    root = output.grad_fn
    if root is None:
        return counts
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:
                i = index.get(id(variable))
                if i is not None:
                    counts[i] += 1
                continue
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return counts


# --------------------------------------------------------------------------- the taps
class LayerTaps:
    """Forward hooks on the scope's layers that have a ghost-norm rule; per-sample squared norms.

    Use as a context manager around the forward pass of a batch, call :meth:`resolve` with the
    logits, then :meth:`accumulate` adds, for one output direction ``S`` (shape of the
    logits), ``sum_i ||d<S_i, z_i>/d theta_p||^2`` into ``totals[p]`` for every covered
    parameter ``p``; :attr:`uncovered` lists the rest.
    """

    def __init__(self, model: nn.Module, scope: ParamScope):
        self.params = list(scope.params)
        index = {id(p): i for i, p in enumerate(self.params)}
        taps = []
        for module in model.modules():
            if not _is_tappable(module):
                continue
            w = index.get(id(module.weight)) if module.weight is not None else None
            bias = getattr(module, "bias", None)
            b = index.get(id(bias)) if bias is not None else None
            if w is not None or b is not None:
                taps.append(_Tap(module, w, b))
        self.taps = taps
        self.num_params = len(self.params)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._covered: set[int] = set()

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
        self._covered = set()
        for tap in self.taps:
            tap.clear()
            self._handles.append(tap.module.register_forward_hook(self._hook(tap)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False

    def resolve(self, z: torch.Tensor) -> None:
        """Decide the covered parameters for the recorded forward pass that produced ``z``.

        A parameter is covered when every one of its uses in the graph of ``z`` is a recorded
        call of a tapped layer (and there is at least one).

        Args:
            z: the output of the recorded forward pass.
        """
        recorded = [0] * self.num_params
        for tap in self.taps:
            calls = sum(1 for out in tap.outputs if out.requires_grad)
            for i in (tap.weight, tap.bias):
                if i is not None:
                    recorded[i] += calls
        in_graph = autograd_uses(z, self.params)
        self._covered = {
            i for i in range(self.num_params) if recorded[i] > 0 and recorded[i] == in_graph[i]
        }

    @property
    def covered(self) -> set[int]:
        """Scope indices whose per-sample norms :meth:`accumulate` computes."""
        return set(self._covered)

    @property
    def uncovered(self) -> list[int]:
        """Scope indices left to a generic per-sample method."""
        return [i for i in range(self.num_params) if i not in self._covered]

    def _active(self) -> list[_Tap]:
        return [
            t
            for t in self.taps
            if (t.weight in self._covered or t.bias in self._covered)
            and all(out.requires_grad for out in t.outputs)
        ]

    # --------------------------------------------------------------- norms
    def accumulate(self, z: torch.Tensor, direction: torch.Tensor, totals: torch.Tensor) -> None:
        """``totals[p] += sum_i ||grad_p <direction_i, z_i>||^2`` (float64) for covered ``p``.

        One backward pass from ``z`` to the covered layers' outputs; the graph is retained
        so the caller can ask for further directions.

        Args:
            z: the recorded forward pass's output.
            direction: shaped like ``z``, constant.
            totals: float64 per scope parameter, added to in place.
        """
        active = self._active()
        outputs = [out for tap in active for out in tap.outputs]
        if not outputs:
            return
        # the gradient of the scalar <z, direction> (a constant direction), not
        # grad_outputs=direction: torch's grad_outputs path imports sympy (slow to import)
        deltas = iter(
            torch.autograd.grad(
                (z * direction.detach()).sum(), outputs, retain_graph=True, allow_unused=True
            )
        )
        uses: dict[int, list] = {}
        for tap in active:
            for a, out in zip(tap.inputs, tap.outputs):
                delta = next(deltas)
                if delta is None:
                    delta = torch.zeros_like(out)
                w_grad, b_grad = _use_gradients(tap.module, a, delta)
                for i, grad in ((tap.weight, w_grad), (tap.bias, b_grad)):
                    if i in self._covered and grad is not None:
                        uses.setdefault(i, []).append(grad)
        for i, parts in uses.items():
            totals[i] += _combined_sq_norms(parts).sum().to(torch.float64)
