"""The analysis set and the ONE pass over it (the options every analysis command shares).

Every curvature quantity is an average over the analysis set,
``L(theta) = (1/N) sum_i l(f(theta, x_i), y_i)``. The set is streamed in
batches; a batch of ``B_b`` samples enters with weight ``B_b / N`` applied to
its *mean* loss, so the result is the mean over samples whatever the batch
size (never a mean of per-batch means, the hessian-eigenthings bug).

Data parallel: when ``torch.distributed`` is initialised,
rank ``r`` of ``W`` takes the contiguous shard ``[floor(r N / W), floor((r+1) N / W))``
of the set, ``N`` stays the global count, and every sum over data goes through
:func:`all_reduce_sum`, so the reduced result equals the single-process one
up to float summation order. Sharding happens here and nowhere else.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import torch
from torch import nn

from sharpcli import progress
from sharpcli.distributed import collective, raise_if_peer_failed
from sharpcli.errors import UsageError
from sharpcli.losses import loss_fn

__all__ = [
    "AnalysisData",
    "all_reduce_sum",
    "subsample_data",
    "distributed_rank_and_world",
    "determinism_check",
    "prepare_model_for_analysis",
    "per_sample_draws",
    "train_mode_modules",
]


def distributed_rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the running ``torch.distributed`` group, ``(0, 1)`` without one.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` without a process group.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def all_reduce_sum(value):
    """Sum ``value`` over all ranks: the single reduction point of every data sum.

    Accepts a tensor, a list/tuple of tensors, or a Python float. Tensors are
    reduced in place (and returned); a float is returned reduced. Without an
    initialised process group (or with one rank) this is the identity.

    Every reduction first runs the collective status check of
    :func:`sharpcli.distributed.raise_if_peer_failed`, so a rank that failed (NaN on its
    shard, say) stops every rank with its error instead of leaving them waiting here.
    Under NCCL, CPU tensors travel through a copy on the rank's GPU.

    Args:
        value: a tensor, a list or tuple of tensors, or a float.

    Returns:
        ``value`` summed over ranks (tensors in place).
    """
    _, world = distributed_rank_and_world()
    if world == 1:
        return value

    raise_if_peer_failed()
    if isinstance(value, torch.Tensor):
        _all_reduce_tensor(value)
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            return value
        flat = torch.cat([t.reshape(-1) for t in value])
        _all_reduce_tensor(flat)
        offset = 0
        for t in value:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return value
    tensor = torch.tensor(float(value), dtype=torch.float64)
    _all_reduce_tensor(tensor)
    return float(tensor)


def _all_reduce_tensor(tensor: torch.Tensor) -> None:
    """In-place SUM all-reduce; CPU tensors go through the GPU under the NCCL backend."""

    if tensor.device.type == "cpu" and torch.distributed.get_backend() == "nccl":
        on_gpu = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        collective(torch.distributed.all_reduce, on_gpu, op=torch.distributed.ReduceOp.SUM)
        tensor.copy_(on_gpu.cpu())
        return
    collective(torch.distributed.all_reduce, tensor, op=torch.distributed.ReduceOp.SUM)


class AnalysisData:
    """The analysis set ``(x, y)`` with its loss name and batch size.

    ``batches()`` yields ``(x_b, y_b, weight_b)`` with ``weight_b = B_b / N``:
    ``sum_b weight_b * mean_loss_b = (1/N) sum_i l_i``. Under torch.distributed
    each rank iterates over its contiguous shard only; ``N`` (``num_samples``)
    is the global count and ``local_num_samples`` the shard's.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, loss: str, batch_size: int):
        loss_fn(loss)  # validates the loss name (UsageError source="loss")
        if int(batch_size) < 1:
            raise UsageError(f"batch size must be >= 1, got {batch_size}", source="batch_size")
        if x.shape[0] != y.shape[0]:
            raise UsageError(
                f"inputs have {x.shape[0]} samples but targets have {y.shape[0]}", source="y"
            )
        if x.shape[0] == 0:
            raise UsageError("the analysis set is empty", source="x")
        self.loss = loss
        self.batch_size = int(batch_size)
        self.num_samples = int(x.shape[0])
        rank, world = distributed_rank_and_world()
        start = (rank * self.num_samples) // world
        stop = ((rank + 1) * self.num_samples) // world
        self.rank, self.world_size = rank, world
        self.shard_start = start  # global index of this rank's first sample
        self.x = x[start:stop]
        self.y = y[start:stop]
        self.local_num_samples = stop - start

    @property
    def num_batches(self) -> int:
        """Number of batches on this rank."""
        return -(-self.local_num_samples // self.batch_size)

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        """Yield ``(x_b, y_b, B_b / N)`` over this rank's shard, in a fixed order.

        Each batch the caller is done with is reported to :func:`sharpcli.progress.batch`
        (the batches of one product, shown by the progress bar).

        Yields:
            ``(x_b, y_b, B_b / N)``: a batch of inputs, its labels and its weight in the mean.
        """
        total = self.num_batches
        for index, start in enumerate(range(0, self.local_num_samples, self.batch_size)):
            x_b = self.x[start : start + self.batch_size]
            y_b = self.y[start : start + self.batch_size]
            yield x_b, y_b, x_b.shape[0] / self.num_samples
            progress.batch(index + 1, total)

    def __len__(self) -> int:
        return self.num_samples


def prepare_model_for_analysis(model: nn.Module) -> nn.Module:
    """Put ``model`` in eval mode (BatchNorm on running statistics, dropout off), as PyHessian does.

    Args:
        model: the model.

    Returns:
        ``model``, in eval mode.
    """
    model.eval()
    return model


def _module_changes_in_train_mode(module: nn.Module) -> bool:
    """Whether ``module`` computes something else in train mode (dropout, batch statistics)."""
    if isinstance(module, nn.modules.dropout._DropoutNd) or isinstance(module, nn.AlphaDropout):
        return module.p > 0
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return True
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return module.track_running_stats
    return "Dropout" in type(module).__name__


def train_mode_modules(model: nn.Module) -> list[str]:
    """Names of modules in training mode whose output differs from eval mode (dropout, BatchNorm).

    Args:
        model: the model.

    Returns:
        The names of those modules.
    """
    return [
        name or type(model).__name__
        for name, module in model.named_modules()
        if module.training and _module_changes_in_train_mode(module)
    ]


def determinism_check(model: nn.Module, data: AnalysisData, op, *, seed: int = 0) -> None:
    """Check the analysis is deterministic, as curvlinops does at construction.

    First, modules that behave differently in training mode (dropout with p > 0,
    BatchNorm, tracked InstanceNorm) must be in eval mode: otherwise the loss
    being analysed is random or depends on batch composition. Then two passes
    of ``op`` (any operator with ``matvec``; its first-order cache is cleared
    before each pass when it has one) with the same seeded Rademacher vector
    must agree exactly. Raises :class:`UsageError` naming the offending modules
    or the mismatch.

    Args:
        model: the model.
        data: the analysis set.
        op: an operator with ``matvec`` (and ``shape``, ``dtype``, ``device``).
        seed: seeds the probe.
    """
    offenders = train_mode_modules(model)
    if offenders:
        raise UsageError(
            "the model is in training mode with dropout/BatchNorm active in "
            f"{', '.join(offenders[:5])}{' ...' if len(offenders) > 5 else ''}: curvature "
            "would be random; call model.eval() (sharpcli.curvature.prepare_model_for_analysis)",
            source="model",
        )
    generator = torch.Generator().manual_seed(seed)
    dim = op.shape[0]
    v = (torch.randint(0, 2, (dim,), generator=generator) * 2 - 1).to(
        dtype=op.dtype, device=op.device
    )
    results = []
    for _ in range(2):
        clear = getattr(op, "clear_cache", None)
        if clear is not None:
            clear()
        results.append(op.matvec(v))
    if not torch.equal(results[0], results[1]):
        diff = (results[0] - results[1]).abs().max().item()
        raise UsageError(
            f"two passes over the same data gave different curvature products (max difference "
            f"{diff:.3g}): the model or data pipeline is not deterministic (random layers, "
            "shuffling, or non-deterministic kernels)",
            source="model",
        )


def to_model_batch(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, device) -> tuple:
    """Move a batch to the model's device; floating inputs/targets take the model's dtype.

    Args:
        x: the inputs.
        y: the targets.
        dtype: the model's dtype.
        device: the model's device.

    Returns:
        ``(x, y)`` on ``device``.
    """
    x = x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device=device)
    y = y.to(device=device, dtype=dtype) if y.is_floating_point() else y.to(device=device)
    return x, y


def subsample_data(data: AnalysisData, fraction: float, seed: int = 0) -> AnalysisData:
    """The analysis set restricted to a seeded random fraction of its samples.

    Each rank keeps ``max(1, round(fraction * n_r))`` of its ``n_r`` samples (a seeded
    permutation's first ones, in their original order) and ``num_samples`` becomes the global
    count of kept samples (summed over ranks), so batches still enter with weight
    ``B_b / N_S`` and products are the mean over the subsample,

    .. math::

        A_S = \\frac{1}{|S|} \\sum_{i \\in S} A_i.

    ``data`` is left unchanged; the kept samples are copied (indexing), nothing else is.

    Args:
        data: the analysis set.
        fraction: the fraction of samples kept, in (0, 1] (UsageError on ``warm_fraction``
            otherwise).
        seed: seeds the permutation (offset by the rank).

    Returns:
        A shallow copy of ``data`` over the kept samples.

    Example:
        >>> import torch
        >>> data = AnalysisData(torch.randn(10, 3), torch.zeros(10, dtype=torch.long), "cross-entropy", 4)
        >>> subsample_data(data, 0.3).num_samples
        3
    """
    fraction = float(fraction)
    if not (0.0 < fraction <= 1.0) or not math.isfinite(fraction):
        raise UsageError(
            f"warm-start fraction must be in (0, 1], got {fraction}", source="warm_fraction"
        )
    local = int(data.local_num_samples)
    keep = min(local, max(1, round(fraction * local))) if local else 0
    generator = torch.Generator().manual_seed(int(seed) + 7919 * int(data.rank))
    index = torch.randperm(local, generator=generator)[:keep].sort().values
    sub = copy.copy(data)
    sub.x = data.x[index.to(data.x.device)]
    sub.y = data.y[index.to(data.y.device)]
    sub.local_num_samples = keep
    sub.num_samples = int(round(all_reduce_sum(float(keep))))
    return sub


_DRAW_BLOCK = 1024  # samples per independently seeded block of label draws


def per_sample_draws(
    base_seed: int, start: int, stop: int, samples: int, kind: str, tail: tuple
) -> torch.Tensor:
    """Random numbers for the global sample indices ``[start, stop)``, shape ``(samples, stop - start, *tail)``.

    Sample ``i`` takes its numbers from block ``i // 1024``, whose CPU generator is seeded with
    ``base_seed * 2**20 + block``: every rank and every batch size sees the same numbers for
    the same sample. ``kind`` is ``"uniform"`` (U[0, 1)) or ``"normal"`` (N(0, 1)), float64.

    Args:
        base_seed: the seed of the draws.
        start: the first global sample index.
        stop: one past the last.
        samples: the draws per sample.
        kind: ``"uniform"`` or ``"normal"``.
        tail: the shape of one draw.

    Returns:
        The float64 draws.
    """
    draw = torch.rand if kind == "uniform" else torch.randn
    parts = []
    for block in range(
        start // _DRAW_BLOCK,
        (stop - 1) // _DRAW_BLOCK + 1 if stop > start else start // _DRAW_BLOCK,
    ):
        generator = torch.Generator().manual_seed(base_seed * 2**20 + block)
        values = draw((samples, _DRAW_BLOCK, *tail), generator=generator, dtype=torch.float64)
        lo = max(start, block * _DRAW_BLOCK) - block * _DRAW_BLOCK
        hi = min(stop, (block + 1) * _DRAW_BLOCK) - block * _DRAW_BLOCK
        parts.append(values[:, lo:hi])
    if not parts:
        return torch.zeros((samples, 0, *tail), dtype=torch.float64)
    return torch.cat(parts, dim=1)
