"""Data-parallel training under torchrun: which regularizers average exactly over ranks, which
run per replica, and the step that splits a global batch over the ranks and all-reduces its
gradient once (twice for a global ascent).
"""

from __future__ import annotations

import torch
from torch import nn

from sharpcli import catalogue
from sharpcli.curvature.products.data import all_reduce_sum
from sharpcli.distributed import rank_and_world
from sharpcli.errors import UsageError
from sharpcli.regularizers.base import family_of
from sharpcli.regularizers.perturbed.sam import AscentOracle
from sharpcli.regularizers.registry import data_parallel_refusal
from sharpcli.regularizers.stats import StepStats
from sharpcli.regularizers.step import training_step

__all__ = [
    "ASCENT_SYNCS",
    "data_parallel_rank_and_world",
    "check_data_parallel_regs",
    "per_replica_statement",
    "data_parallel_record",
    "data_parallel_step",
]

# --ascent-sync: where the ascent family's first gradient comes from under torchrun
ASCENT_SYNCS = catalogue.ASCENT_SYNCS

# --------------------------------------------------------------------------- data-parallel training
# Under torchrun (WORLD_SIZE > 1, see sharpcli.distributed) every rank runs the same loop with the
# same seeds: the same initial weights, shuffle, augmentation and step generator. Each global batch
# (augmented and noised whole, so the random streams match a single process) is split into
# contiguous per-rank rows; a rank runs ``training_step`` on its rows and the gradients are then
# all-reduced as the row-weighted average sum_r (B_r / B) grad_r, which is the gradient of the
# global batch whenever the regularised objective is an average over samples of terms that
# share every random draw across ranks. Whether that holds is part of each regularizer's own
# record: its class attribute ``data_parallel`` (sharpcli.regularizers.registry) is None when
# exact and otherwise the reason it is not (a penalty nonlinear in the batch gradient; an
# ascent step that needs the global gradient first). Such a regularizer runs *per replica*
# when its class states what a rank then computes (``per_replica``): each rank's step is the
# regularizer on its own rows, and the all-reduced gradient is the exact gradient of the
# row-weighted mean sum_r (B_r / B) O_r of the ranks' objectives (gp, fa: the penalty at the
# local batch; gn-trace: an unbiased estimate of the whole batch's tr(G)), or, for the ascent
# family, the mean of the ranks' gradients at their own ascent points (m-sharpness with m the
# local batch, [SAM] section 4; the first pass is not all-reduced, as DDP's ``no_sync``).
# ``--ascent-sync global`` all-reduces the ascent family's first gradient once instead, so
# every rank ascends along the whole batch's gradient: the single-process step. A regularizer
# that states no ``per_replica`` is refused with its reason.
# BatchNorm: batch statistics over each rank's rows (as torch DDP without SyncBatchNorm), not
# over the global batch; running statistics are row-weighted averages of the ranks' updates,
# so every rank keeps the same buffers. Results then differ from a single process.
# The model is not wrapped in torch's DistributedDataParallel: a step may run several forward and
# backward passes (oracles, double backward) and only the final gradient is to be averaged.


def data_parallel_rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the torchrun process group, ``(0, 1)`` in a single process."""
    return rank_and_world()


def per_replica_statement(reg) -> str | None:
    """What each rank computes for ``reg`` under torchrun when averaging is not exact (its
    class's ``per_replica``), None when it states none or is exact. A class that does not
    declare ``data_parallel`` in its own body gets None (refused), whatever it inherits."""
    family = family_of(reg if isinstance(reg, type) else type(reg))
    if "data_parallel" not in vars(family) or family.data_parallel is None:
        return None
    return getattr(family, "per_replica", None)


def check_data_parallel_regs(regs) -> None:
    """Refuse (UsageError on ``--reg``) the regularizers whose per-rank gradients cannot be
    averaged and that state no per-replica semantics, quoting each one's ``data_parallel``
    reason."""
    reasons_by_name = {r.name: data_parallel_refusal(r) for r in regs}
    refused = [
        r.name
        for r in regs
        if reasons_by_name[r.name] is not None and per_replica_statement(r) is None
    ]
    if refused:
        reasons = "; ".join(f"{name}: {reasons_by_name[name]}" for name in refused)
        raise UsageError(
            f"cannot train data-parallel with {', '.join(refused)} ({reasons}); "
            "run it in one process",
            source="regs",
        )


def data_parallel_record(regs, ascent_sync: str, world: int) -> dict | None:
    """The report's ``results.data_parallel``: None in one process, else ``world_size``, the
    ascent oracle with its ``ascent_sync`` (None without one), and ``per_replica``: each
    regularizer that runs per replica with its statement."""
    if world <= 1:
        return None
    ascent = [r.name for r in regs if isinstance(r, AscentOracle)]
    statements = {r.name: per_replica_statement(r) for r in regs}
    return {
        "world_size": world,
        "ascent": ascent[0] if ascent else None,
        "ascent_sync": ascent_sync if ascent else None,
        "per_replica": {name: text for name, text in statements.items() if text is not None},
    }


def data_parallel_step(
    model: nn.Module,
    xb: torch.Tensor,
    yb: torch.Tensor,
    loss_name: str,
    regs,
    generator: torch.Generator,
    *,
    ascent_sync: str = "per-replica",
    autocast_dtype: torch.dtype | None = None,
    loss_scale: float = 1.0,
) -> StepStats:
    """One training step on this rank's rows of the global batch, gradients averaged over ranks.

    Rank ``r`` of ``W`` takes rows ``[floor(r B / W), floor((r+1) B / W))`` (``B_r`` of them) and
    runs :func:`training_step`; then ONE all-reduce (``sharpcli.curvature.products.data.all_reduce_sum``)
    sums ``(B_r / B) grad_r`` (left in ``.grad``), ``(B_r / B)`` times each floating buffer
    (BatchNorm running statistics), and the step statistics (loss, objective and penalties
    weighted by ``B_r``; correct, predictions counted and count summed). A rank with no rows
    contributes zeros. ``grad_evals`` stays the per-rank count. With ``ascent_sync="global"``
    an ascent oracle's clean gradient is all-reduced the same way first (one more all-reduce),
    and every rank ascends along it.

    The final all-reduce also carries the last rank's step generator state (that rank always
    has rows), and every rank continues from it. A per-replica regularizer that draws per row
    (``gn-trace``'s labels) draws different amounts on ranks of unequal rows: the generators
    would drift apart, and with them the probes and noise the exact regularizers share.

    .. math:: g = \\sum_r \\frac{B_r}{B}\\, g_r

    Args:
        model: The model (the same weights on every rank).
        xb: The global batch's inputs.
        yb: The global batch's labels.
        loss_name: The task loss.
        regs: Parsed regularizers, each exact or per replica under data parallelism
            (:func:`check_data_parallel_regs`).
        generator: The step generator (the same state on every rank).
        ascent_sync: ``per-replica`` (each rank's own clean gradient) or ``global``.
        autocast_dtype: As :func:`training_step`'s.
        loss_scale: As :func:`training_step`'s.

    Returns:
        The global batch's :class:`StepStats`.
    """
    rank, world = data_parallel_rank_and_world()
    total = xb.shape[0]
    lo, hi = (rank * total) // world, ((rank + 1) * total) // world
    rows = hi - lo
    params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    penalty_names = [r.name for r in regs if r.kind == "penalty"]
    synced = ascent_sync == "global" and any(isinstance(r, AscentOracle) for r in regs)
    reduce = _row_weighted_mean(rows / total) if synced else None
    if rows > 0:
        stats = training_step(
            model,
            xb[lo:hi],
            yb[lo:hi],
            loss_name,
            regs,
            generator,
            autocast_dtype=autocast_dtype,
            loss_scale=loss_scale,
            ascent_reduce=reduce,
        )
    else:
        for p in params:
            p.grad = torch.zeros_like(p)
        if reduce is not None:  # the ranks with rows all-reduce their clean gradients
            reduce([torch.zeros_like(p) for p in params])
        stats = StepStats(loss=0.0, objective=0.0, correct=0, count=0, grad_evals=0)
    float_buffers = [b for b in model.buffers() if b.is_floating_point()]
    int_buffers = [b for b in model.buffers() if not b.is_floating_point()]
    has_rows = 1.0 if rows > 0 else 0.0
    head = _local_head(stats, rows, has_rows, penalty_names)
    parts = [torch.tensor(head, dtype=torch.float64)]
    parts += _flat_parts(params, float_buffers, int_buffers, rows / total, has_rows)
    state = generator.get_state()  # the last rank's travels with the sums (see the docstring)
    parts.append(state.to(torch.float64) * (1.0 if rank == world - 1 else 0.0))
    flat = torch.cat(parts)
    all_reduce_sum(flat)
    generator.set_state(flat[flat.numel() - state.numel() :].round().to(state.dtype))
    reduced_head = flat[: len(head)].tolist()
    _scatter(flat[len(head) :], params, float_buffers, int_buffers, reduced_head[4])
    count = reduced_head[3]
    return StepStats(
        loss=reduced_head[0] / count,
        objective=reduced_head[1] / count,
        correct=int(round(reduced_head[2])),
        count=int(round(count)),
        grad_evals=int(stats.grad_evals),
        penalties={name: reduced_head[6 + i] / count for i, name in enumerate(penalty_names)},
        counted=int(round(reduced_head[5])),
    )


def _row_weighted_mean(weight: float):
    """The all-reduce of a global ascent: ``grads -> sum_r (B_r / B) grads_r`` (float64 on the
    CPU in transit, back in each gradient's dtype and device); ``weight`` is ``B_r / B``."""

    def reduce(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat([g.reshape(-1).to(torch.float64).cpu() * weight for g in grads])
        all_reduce_sum(flat)
        out, offset = [], 0
        for g in grads:
            piece = flat[offset : offset + g.numel()].view(g.shape)
            offset += g.numel()
            out.append(piece.to(device=g.device, dtype=g.dtype))
        return out

    return reduce


def _local_head(
    stats: StepStats, rows: int, has_rows: float, penalty_names: list[str]
) -> list[float]:
    """This rank's statistics to sum over ranks: loss, objective (weighted by its rows),
    correct, count, whether it has rows, predictions counted, then each penalty (weighted)."""
    head = [
        stats.loss * rows,
        stats.objective * rows,
        float(stats.correct),
        float(stats.count),
        has_rows,
        float(stats.counted),
    ]
    return head + [stats.penalties.get(name, 0.0) * rows for name in penalty_names]


def _flat_parts(
    params: list[torch.Tensor],
    float_buffers: list[torch.Tensor],
    int_buffers: list[torch.Tensor],
    weight: float,
    has_rows: float,
) -> list[torch.Tensor]:
    """Gradients and floating buffers times this rank's row weight, integer buffers times
    whether it has rows, flat in float64 on the CPU (in the order :func:`_scatter` reads)."""
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64).cpu()
        * weight
        for p in params
    ]
    parts += [b.reshape(-1).to(torch.float64).cpu() * weight for b in float_buffers]
    parts += [b.reshape(-1).to(torch.float64).cpu() * has_rows for b in int_buffers]
    return parts


def _scatter(
    flat: torch.Tensor,
    params: list[torch.Tensor],
    float_buffers: list[torch.Tensor],
    int_buffers: list[torch.Tensor],
    ranks_with_rows: float,
) -> None:
    """Write the all-reduced values back: gradients into ``.grad``, buffers in place (integer
    buffers, ``num_batches_tracked``, as the common value of the ranks with rows)."""
    tagged = (
        [("grad", p) for p in params]
        + [("float", b) for b in float_buffers]
        + [("int", b) for b in int_buffers]
    )
    offset = 0
    for kind, tensor in tagged:
        piece = flat[offset : offset + tensor.numel()].view(tensor.shape)
        offset += tensor.numel()
        if kind == "grad":
            tensor.grad = piece.to(device=tensor.device, dtype=tensor.dtype).clone()
        elif kind == "float":
            tensor.copy_(piece.to(tensor.dtype))
        else:
            tensor.copy_(torch.round(piece / ranks_with_rows).to(tensor.dtype))
