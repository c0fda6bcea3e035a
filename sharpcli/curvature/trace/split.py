"""Joint stochastic estimates of the GN/NME split ``H = G + N`` ([NME] section 2, eq. 2).

One Rademacher probe ``v`` and one joint pass give ``Hv`` and ``Gv`` (so
``Nv = Hv - Gv``) and, from the same products,

    tr(A)   ~ v^T A v          ([Hutchinson1989]),
    Tr(A^2) ~ ||A v||^2        (squared Frobenius norm, the quantity of [FA] eq. 1),

for A in {H, G, N}, with per-layer (diagonal block) values. Because the three
operators see the same probes, the identity ``tr(H) = tr(G) + tr(N)`` holds for
the estimates exactly (per probe), and the NME share ``tr(N)/tr(H)`` has far
less variance than a ratio of independent estimates. A pilot sizes the reported
sample so that the relative standard errors of ``tr(H)`` and ``tr(G)`` reach ``tol``
within ``max_matvecs`` joint products (two stages, as the trace estimators).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sharpcli import memory, progress
from sharpcli.catalogue.values import QUANTITIES, TRACE_KEY
from sharpcli.curvature.operators.hessian import joint_matmat
from sharpcli.curvature.operators.registry import GGN, HESSIAN, SPLIT
from sharpcli.curvature.products.scope import RademacherColumns, rademacher_bits_bytes
from sharpcli.curvature.trace.probes import (
    PerBatchTrace,
    check_budget,
    layer_dict,
    mean_stderr,
    pilot_size,
    planned_probes,
    probe_block,
    report_probes,
    segment_sums,
)


@dataclass
class SplitEstimate:
    """Per operator and quantity: estimate, stderr and per-layer values, from shared probes."""

    values: dict = field(
        default_factory=dict
    )  # values[op][quantity] = {"estimate", "stderr", "by_layer"}
    matvecs: int = 0
    samples: int = 0
    converged: bool = False
    tol: float = 0.0
    # per operator: the trace's data error (batch means), None where not recorded
    data: dict = field(default_factory=dict)


def gn_nme_split(
    engine,
    *,
    tol: float = 1e-2,
    max_matvecs: int = 1000,
    seed: int = 0,
    block_size: int = 8,
    min_samples: int = 10,
) -> SplitEstimate:
    r"""Traces and squared Frobenius norms of H, G and N = H - G from shared probes.

    For each Rademacher probe :math:`v`, one joint pass gives :math:`H v` and :math:`G v`
    (:func:`~sharpcli.curvature.operators.hessian.joint_matmat` of ``H``, ``G`` and ``H - G``), and

    .. math::

        \mathrm{tr}(A) \approx v^\top A v, \qquad \mathrm{Tr}(A^2) \approx \lVert A v \rVert^2,
        \qquad A \in \{H, G, N\},

    so :math:`\mathrm{tr}(H) = \mathrm{tr}(G) + \mathrm{tr}(N)` holds for the estimates.

    Args:
        engine: the :class:`~sharpcli.curvature.products.engine.CurvatureEngine` (its H and G operators).
        tol: the relative standard error wanted of ``tr(H)`` and ``tr(G)``: a pilot sizes
            the reported sample for it ([Stein1945], :mod:`sharpcli.curvature.trace.probes`).
        max_matvecs: the most joint products, the pilot's included.
        seed: seeds the probes.
        block_size: probes per product block.
        min_samples: the fewest probes of the pilot and of the reported sample.

    Returns:
        A :class:`SplitEstimate`: ``values[operator][quantity]`` for ``hessian``, ``ggn``,
        ``nme`` and ``trace``, ``frobenius_sq``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
        >>> engine = CurvatureEngine(model, AnalysisData(x, y, "cross-entropy", 5), ParamScope.resolve(model))
        >>> split = gn_nme_split(engine, max_matvecs=16)
        >>> h, g, n = (split.values[name]["trace"]["estimate"] for name in ("hessian", "ggn", "nme"))
        >>> abs(h - (g + n)) < 1e-12
        True
    """
    check_budget(tol, max_matvecs, block_size)
    H, G = engine.hessian(), engine.ggn()
    operators = (H, G, H - G)  # N = H - G ([NME] eq. 2): one joint pass gives all three
    dim, blocks = H.shape[0], H.blocks()
    generator = torch.Generator().manual_seed(int(seed))
    rows: dict[tuple[str, str], list[torch.Tensor]] = {
        (o, q): [] for o in SPLIT for q in QUANTITIES
    }
    matvecs = 0
    # the main sample's per-batch v^T H_b v and v^T G_b v (the traces' data errors)
    per_batch: dict[str, PerBatchTrace] | None = None

    def draw(count: int, run) -> None:
        """``count`` more probes into ``rows``, ``block_size`` drawn together at a time."""
        nonlocal matvecs
        drawn = 0
        while drawn < count:
            k = min(int(block_size), count - drawn)
            # the same seed gives the same probes whatever the block size and budget
            for V in probes.blocks(k):
                if per_batch is None:
                    HV, GV, NV = joint_matmat(operators, V)
                else:  # the main sample: per-batch forms of the joint pass, no extra product
                    with engine.recording_forms(V) as forms:
                        HV, GV, NV = joint_matmat(operators, V)
                    _add_split_forms(per_batch, forms.take_parts())
                for name, AV in zip(SPLIT, (HV, GV, NV)):
                    # float64 sums of the exact products, not product_segment_sums' float32
                    # dot products: those broke tr(H) = tr(G) + tr(N) by 5e-9 relative on a
                    # float32 MLP, these keep it to the products' own rounding
                    rows[(name, TRACE_KEY)].append(segment_sums(V * AV, blocks).T)
                    rows[(name, "frobenius_sq")].append(segment_sums(AV * AV, blocks).T)
                del V, HV, GV, NV
            matvecs += k
            drawn += k
            if not run.finished:  # somebody listens
                mean, stderr = mean_stderr(torch.cat(rows[(HESSIAN, TRACE_KEY)]))
                n = sum(r.shape[0] for r in rows[(HESSIAN, TRACE_KEY)])
                report_probes(run, matvecs, n, mean[0], stderr[0], tol, 0)

    # probe, H v, G v, N v and one elementwise product per column
    columns, held = probe_block(H, block_size, vectors=5, what="H,G,N split")
    probes = RademacherColumns(dim, generator, H.dtype, H.device, columns)
    budget = int(max_matvecs)
    # beside the block: a block's probes drawn together, as bits
    with memory.current().hold("probe block", held + rademacher_bits_bytes(dim, block_size)):
        run = progress.start("hutchinson H,G,N", total=budget, quantity="tr(H)", capped=True)
        # two stages as the trace estimators ([Stein1945], sharpcli.curvature.trace.probes): the
        # pilot sizes the sample for the slower of tr(H) and tr(G); only the main sample
        # is reported, so its standard errors are fixed-n ones
        pilot = pilot_size(min_samples, budget)
        count = budget
        if pilot:
            draw(pilot, run)
            plans = []
            for name in (HESSIAN, GGN):
                mean, stderr = mean_stderr(torch.cat(rows[(name, TRACE_KEY)]))
                plans.append(
                    planned_probes(
                        float(mean[0]),
                        float(stderr[0]),
                        pilot,
                        tol=tol,
                        least=max(2, int(min_samples)),
                        room=budget - pilot,
                    )
                )
            count = max(plans)
            for key in rows:
                rows[key] = []
        per_batch = {name: PerBatchTrace() for name in SPLIT}
        draw(count, run)
        converged = True
        for name in (HESSIAN, GGN):
            mean, stderr = mean_stderr(torch.cat(rows[(name, TRACE_KEY)]))
            converged = converged and bool(stderr[0] <= tol * abs(mean[0]))
    out = SplitEstimate(matvecs=matvecs, converged=converged, tol=tol)
    out.data = {name: per_batch[name].error() for name in SPLIT}
    for name in SPLIT:
        out.values[name] = {}
        for quantity in QUANTITIES:
            samples = torch.cat(rows[(name, quantity)])
            mean, stderr = mean_stderr(samples)
            out.samples = int(samples.shape[0])
            out.values[name][quantity] = {
                "estimate": float(mean[0]),
                "stderr": float(stderr[0]),
                "by_layer": layer_dict(list(blocks), mean, stderr),
            }
    hessian_trace = out.values[HESSIAN][TRACE_KEY]
    run.finish(
        matvecs,
        probes=out.samples,
        estimate=hessian_trace["estimate"],
        stderr=hessian_trace["stderr"],
    )
    return out


def _add_split_forms(per_batch: dict, taken) -> None:
    """Add a joint pass's per-batch ``v^T H_b v``, ``v^T G_b v`` and their difference (N)."""
    if taken is None or taken[0].shape[1] != 2:  # not one joint H and G pass
        for name in per_batch:
            per_batch[name].add(None)
        return
    forms, sizes = taken
    h = forms[:, 0].diagonal(dim1=1, dim2=2)
    g = forms[:, 1].diagonal(dim1=1, dim2=2)
    for name, values in zip(SPLIT, (h, g, h - g)):
        per_batch[name].add((values, sizes))
