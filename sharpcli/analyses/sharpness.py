"""Worst-case and average-case sharpness, adaptive or standard ([Andriushchenko2023]).

For a batch ``S`` of ``m`` samples (m-sharpness, [SAM] section 4), a radius ``rho`` and a
scale ``c`` (``c = |w|`` elementwise: adaptive, [ASAM]; ``c = 1``: standard):

- worst case: ``S_max = max_{||delta / c||_p <= rho} L_S(w + delta) - L_S(w)``, p = 2 or inf;
- average case: ``S_avg = E_delta L_S(w + delta) - L_S(w)`` with
  ``delta ~ N(0, rho^2 diag(c^2))`` (p = 2) or ``delta / c`` uniform on ``[-rho, rho]^P``
  (p = inf), the noise of [Andriushchenko2023]'s code.

Both are averaged over the batches ``S`` of the analysis set. In the scaled variable
``u = delta / c`` the constraint is a plain p-ball and a function-preserving rescaling
``w' = D w`` (D diagonal positive, [MAN]; [Dinh2017]) maps ``c`` to ``D c`` and leaves
``L(w' + c' u)`` equal to ``L(w + c u)``: the adaptive measures are invariant, the standard
ones are not.

The maximum is sought by Auto-PGD ([Croce2020]) in ``u``, as [Andriushchenko2023]'s code
does: steps along the normalised direction ``a / ||a||_2`` (p = 2) or ``sign(a)`` (p = inf),
projection onto the ball, momentum 0.75, the step size (initially
``step_size * rho``) halved at the Auto-PGD checkpoints when the best loss improved on fewer
than 75% of the steps since the last checkpoint or did not improve at all at the same step
size (then the ascent restarts from the best point). The first restart starts at ``u = 0``,
later ones at random points of the ball's surface (p = 2) or of the box (p = inf). The best
point over steps and restarts is the maximiser; it lies in the ball by construction.

The direction ``a`` is the accumulated gradient of [Dong2018] (MI-FGSM),
``a_k = mu a_{k-1} / ||a_{k-1}||_1 + g_k / ||g_k||_1`` with ``mu = 1`` and
``g = c * grad_w L``, reset to ``g`` when the ascent returns to its best point. Why not ``g``
alone, as the reference code steps: a ReLU net's loss has kinks in ``w`` (a unit switching
on or off for one sample), and a local maximum of the ascent often lies on one. There
``sign(g)`` flips in a few coordinates from one side to the other, the iterates zigzag
across the kink without raising the best loss, Auto-PGD halves its step to its floor and
stops at a point that is not a maximum along the kink (on the 77-weight ReLU net of the
tests, linf ball: 0.0156078 where a float64 projected ascent finds 0.0156337, coordinates
with gradients of 6e-4 still inside the box). The accumulated gradient averages the two
sides, so its sign points along the kink; the same net then reaches 0.0156468.

Under ``torchrun`` (W ranks) the batches ``S`` are split across the ranks, batch ``b`` to rank
``b mod W``, each evaluated on the whole analysis set's samples of that batch (rebuilt once
from the shards); a rank skips another rank's batch by drawing, and discarding, the random
numbers that batch takes, so every batch sees the same draws as in one process. The
per-batch results are gathered by an all-reduce of zero-padded rows: the result is bitwise
the single-process one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from sharpcli import catalogue, progress
from sharpcli.analyses.perturbed import (
    Evaluation,
    PerturbedModel,
    normalization_parameters,
    whole_analysis_set,
)
from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.errors import UsageError, check_positive
from sharpcli.registry import declare

__all__ = [
    "KINDS",
    "NORMS",
    "NORM_LAYERS",
    "SHARPNESS",
    "SharpnessConfig",
    "SharpnessResult",
    "SharpnessRow",
    "apgd_checkpoints",
    "sharpness",
    "sharpness_metric",
]

# the metric of ``sharp analyze --metrics`` (and the quantity of ``train --track``), the
# group of its results, and the name of its progress runs
SHARPNESS = "sharpness"

KINDS = catalogue.SHARPNESS_KINDS
NORMS = catalogue.SHARPNESS_NORMS
NORM_LAYERS = catalogue.NORM_LAYERS
MOMENTUM = 0.75  # Auto-PGD's alpha ([Croce2020] section 3.2)
MIN_UPDATE_RATIO = 0.75  # condition 1 of the step-size halving ([Croce2020] eq. 4)
GRADIENT_MOMENTUM = 1.0  # mu of the accumulated gradient ([Dong2018] eq. 6)


@dataclass
class SharpnessConfig:
    """What :func:`sharpness` measures and how.

    Attributes:
        kind: ``"worst-case"`` or ``"average"``.
        norm: ``"l2"`` or ``"linf"``: the geometry of the ball (worst case) or the noise
            (average: Gaussian for l2, uniform in the box for linf).
        rhos: the radii (worst case) or noise scales (average), each > 0.
        adaptive: ``c = |w|`` ([ASAM]) rather than ``c = 1``.
        m: samples per sharpness batch (m-sharpness); None: the whole set as one batch.
        params: the parameter scope (``all``, ``last`` or globs, :class:`ParamScope`).
        norm_layers: ``"include"``: normalization layers' affine parameters are perturbed
            like the others (the reference code perturbs every parameter); ``"exclude"``:
            they stay fixed. Running statistics never move (eval mode).
        steps: Auto-PGD steps per restart (worst case).
        restarts: Auto-PGD restarts (worst case).
        step_size: the first step size as a multiple of rho (the reference's 2).
        noise_draws: noise draws per batch (average case).
        seed: seeds the restarts and the noise.
    """

    kind: str = "worst-case"
    norm: str = "l2"
    rhos: tuple[float, ...] = (0.05,)
    adaptive: bool = True
    m: int | None = None
    params: str | None = None
    norm_layers: str = "include"
    steps: int = 20
    restarts: int = 1
    step_size: float = 2.0
    noise_draws: int = 100
    seed: int = 0

    def validate(self) -> None:
        """UsageError naming the parameter of the first bad setting."""
        _one_of(self.kind, KINDS, "kind")
        _one_of(self.norm, NORMS, "norm")
        _one_of(self.norm_layers, NORM_LAYERS, "norm_layers")
        check_positive(self.rhos, "rho")
        checks = [
            (self.m is None or self.m >= 1, "m", f"must be >= 1, got {self.m}"),
            (self.steps >= 1, "steps", f"must be >= 1, got {self.steps}"),
            (self.restarts >= 1, "restarts", f"must be >= 1, got {self.restarts}"),
            (
                self.step_size > 0 and math.isfinite(self.step_size),
                "step_size",
                f"must be a finite number > 0, got {self.step_size:g}",
            ),
            (self.noise_draws >= 2, "noise_draws", f"must be >= 2, got {self.noise_draws}"),
        ]
        for ok, source, message in checks:
            if not ok:
                raise UsageError(message, source=source)


def _one_of(value: str, allowed: tuple[str, ...], source: str) -> None:
    if value not in allowed:
        raise UsageError(f"must be one of {', '.join(allowed)}; got {value!r}", source=source)


@dataclass
class SharpnessRow:
    """One rho: the sharpness over the batches and what produced it.

    ``sharpness`` is the mean over batches of ``L_S(w + delta_S) - L_S(w)``; ``stderr`` its
    standard error over the batches (None with one batch; average case: with one batch the
    noise's); ``stderr_noise`` (average case) the part due to the finite noise draws;
    ``loss`` and ``loss_perturbed`` the means over batches at ``w`` and at the maximisers
    (worst case) or of the noisy losses (average); ``perturbation_norm`` the largest
    ``||delta_S / c||_p`` over batches (worst case; <= rho); ``history`` (worst case) the
    mean over batches of the best sharpness found after each step (step 0: the start).
    """

    rho: float
    sharpness: float
    stderr: float | None
    loss: float
    loss_perturbed: float
    accuracy: float | None
    accuracy_perturbed: float | None
    perturbation_norm: float | None = None
    stderr_noise: float | None = None
    history: list[float] | None = None

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


@dataclass
class SharpnessResult:
    """The rows per rho and the settings that define the measure."""

    config: SharpnessConfig
    rows: list[SharpnessRow]
    params: str
    num_params: int
    excluded: list[str]
    batches: int
    m: int
    evaluations: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dict: the definition (kind, norm, adaptive, m, ...) and ``rows``."""
        c = self.config
        definition = {
            "kind": c.kind,
            "norm": c.norm,
            "adaptive": c.adaptive,
            "scale": "|w|" if c.adaptive else "1",
            "m": self.m,
            "batches": self.batches,
            "params": self.params,
            "num_params": self.num_params,
            "norm_layers": c.norm_layers,
            "excluded": self.excluded,
            # eval mode: BatchNorm running statistics and dropout do not move with the weights
            "running_statistics": "fixed (eval mode)",
        }
        if c.kind == "worst-case":
            definition |= {
                "ascent": "auto-pgd",
                "steps": c.steps,
                "restarts": c.restarts,
                "step_size": c.step_size,
            }
        else:
            definition |= {
                "noise": "gaussian" if c.norm == "l2" else "uniform",
                "noise_draws": c.noise_draws,
            }
        return definition | {
            "rows": [row.to_dict() for row in self.rows],
            "evaluations": self.evaluations,
            "notes": list(self.notes),
        }


def apgd_checkpoints(steps: int) -> list[int]:
    """The steps after which Auto-PGD may halve its step size ([Croce2020] section 3.2).

    ``p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)``; the checkpoints are
    ``ceil(p_j * steps)`` for ``j >= 1`` below ``steps``.

    Args:
        steps: the steps of one ascent.

    Returns:
        The checkpoint steps, ascending, each in ``[1, steps)``.
    """
    p = [0.0, 0.22]
    marks = [math.ceil(0.22 * steps)]
    while True:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
        mark = math.ceil(p[-1] * steps)
        if mark >= steps or mark == marks[-1]:
            break
        marks.append(mark)
    return [s for s in dict.fromkeys(marks) if 1 <= s < steps]


def _l2(u: torch.Tensor) -> float:
    """``||u||_2`` accumulated in float64: a float32 norm overflows to Inf from ``~1.8e19`` (its
    square past float32's largest), and ``u * rho / Inf`` silently turned a huge ball into the
    point ``w`` (sharpness 0 for a larger radius)."""
    return float(torch.linalg.vector_norm(u, dtype=torch.float64))


def _l1(u: torch.Tensor) -> float:
    """``||u||_1`` accumulated in float64 (see :func:`_l2`)."""
    return float(torch.linalg.vector_norm(u, ord=1, dtype=torch.float64))


def _norm(u: torch.Tensor, norm: str) -> float:
    return float(u.abs().max()) if norm == "linf" else _l2(u)


def _project(u: torch.Tensor, rho: float, norm: str) -> torch.Tensor:
    if norm == "linf":
        return u.clamp(-rho, rho)
    length = _l2(u)
    return u * (rho / length) if length > rho else u


def _ascent_direction(g: torch.Tensor, norm: str) -> torch.Tensor:
    if norm == "linf":
        return g.sign()
    length = _l2(g)
    return g / length if length > 0 else torch.zeros_like(g)


def _accumulate(previous: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """``mu a / ||a||_1 + g / ||g||_1`` ([Dong2018]); ``g`` itself when there is no ``a``."""
    if previous is None:
        return g
    g_l1, a_l1 = _l1(g), _l1(previous)
    step = g / g_l1 if g_l1 > 0 else torch.zeros_like(g)
    return step + (GRADIENT_MOMENTUM / a_l1) * previous if a_l1 > 0 else step


def _random_start(dim: int, rho: float, norm: str, gen: torch.Generator, like: torch.Tensor):
    if norm == "linf":  # uniform in the box, as the reference code starts
        u = (2 * torch.rand(dim, generator=gen, dtype=torch.float64) - 1) * rho
    else:
        u = torch.randn(dim, generator=gen, dtype=torch.float64)
        u *= rho / float(u.norm())
    return u.to(dtype=like.dtype, device=like.device)


@dataclass
class _BatchMaximum:
    loss: float
    accuracy: float | None
    u: torch.Tensor
    history: list[float]


def _auto_pgd(
    model: PerturbedModel,
    x: torch.Tensor,
    y: torch.Tensor,
    start_loss: float,
    rho: float,
    config: SharpnessConfig,
    gen: torch.Generator,
) -> _BatchMaximum:
    """The largest loss Auto-PGD finds in ``||u||_p <= rho`` on one batch (module docstring)."""
    norm, steps = config.norm, config.steps
    checkpoints = set(apgd_checkpoints(steps))
    zero = torch.zeros(model.dim, dtype=model.dtype, device=model.device)
    overall = _BatchMaximum(start_loss, None, zero, [start_loss] * (steps + 1))
    for restart in range(config.restarts):
        u = zero.clone() if restart == 0 else _random_start(model.dim, rho, norm, gen, zero)
        current = model.evaluate(u, x, y, gradient=True)
        best_u, best = u, current
        direction = current.required_gradient()
        history = [max(best.loss, start_loss)]
        previous = u
        eta = config.step_size * rho
        last_mark, mark_eta, mark_loss, improved = 0, eta, best.loss, 0
        for step in range(1, steps + 1):
            z = _project(u + eta * _ascent_direction(direction, norm), rho, norm)
            moved = u + MOMENTUM * (z - u) + (1 - MOMENTUM) * (u - previous)
            u, previous = _project(moved, rho, norm), u
            current = model.evaluate(u, x, y, gradient=True)
            direction = _accumulate(direction, current.required_gradient())
            if current.loss > best.loss:
                best_u, best = u, current
                improved += 1
            history.append(max(best.loss, start_loss))
            if step in checkpoints:
                too_few = improved < MIN_UPDATE_RATIO * (step - last_mark)
                stalled = eta == mark_eta and best.loss == mark_loss
                last_mark, mark_eta, mark_loss, improved = step, eta, best.loss, 0
                if too_few or stalled:
                    eta /= 2
                    u, previous, current = best_u, best_u, best
                    direction = best.required_gradient()
        for i, value in enumerate(history):
            overall.history[i] = max(overall.history[i], value)
        if best.loss > overall.loss:
            overall.loss, overall.accuracy, overall.u = best.loss, best.accuracy, best_u
    return overall


def _noise(dim: int, rho: float, norm: str, gen: torch.Generator, like: torch.Tensor):
    if norm == "linf":
        u = (2 * torch.rand(dim, generator=gen, dtype=torch.float64) - 1) * rho
    else:
        u = torch.randn(dim, generator=gen, dtype=torch.float64) * rho
    return u.to(dtype=like.dtype, device=like.device)


def _mean_stderr(values: list[float]) -> tuple[float, float | None]:
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _mean_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) else math.fsum(values) / len(values)


def _batch_row(
    moved: PerturbedModel,
    x: torch.Tensor,
    y: torch.Tensor,
    start: Evaluation,
    rho: float,
    config: SharpnessConfig,
    gen: torch.Generator,
    weights: torch.Tensor,
) -> list[float]:
    """One batch's row of the table in :func:`sharpness`: sharpness, perturbed loss,
    accuracy, has accuracy, maximiser norm, noise variance of the mean, history."""
    if config.kind == "worst-case":
        found = _auto_pgd(moved, x, y, start.loss, rho, config, gen)
        accuracy = start.accuracy if found.accuracy is None else found.accuracy
        history = [h - start.loss for h in found.history]
        head = [found.loss - start.loss, found.loss, accuracy or 0.0, float(accuracy is not None)]
        return head + [_norm(found.u, config.norm), 0.0] + history
    draws = [
        moved.evaluate(_noise(moved.dim, rho, config.norm, gen, weights), x, y)
        for _ in range(config.noise_draws)
    ]
    mean, err = _mean_stderr([d.loss for d in draws])
    accuracy = _mean_or_none([d.accuracy for d in draws])
    head = [mean - start.loss, mean, accuracy or 0.0, float(accuracy is not None), 0.0]
    return head + [float(err or 0.0) ** 2]


def _skip_draws(
    dim: int, rho: float, config: SharpnessConfig, gen: torch.Generator, like: torch.Tensor
) -> None:
    """Draw and discard what one batch of another rank draws (module docstring)."""
    if config.kind == "worst-case":
        for _ in range(config.restarts - 1):
            _random_start(dim, rho, config.norm, gen, like)
    else:
        for _ in range(config.noise_draws):
            _noise(dim, rho, config.norm, gen, like)


def _row(rho: float, table: torch.Tensor, starts: list, config: SharpnessConfig) -> SharpnessRow:
    """The row of one rho from its batches' rows (:func:`_batch_row`), in batch order."""
    column = [[float(v) for v in table[:, k]] for k in range(table.shape[1])]
    mean, stderr = _mean_stderr(column[0])
    worst = config.kind == "worst-case"
    stderr_noise = None
    if not worst:
        stderr_noise = math.sqrt(math.fsum(column[5])) / len(column[5])
        if stderr is None:
            stderr = stderr_noise
    accs = [a if has > 0 else None for a, has in zip(column[2], column[3])]
    return SharpnessRow(
        rho=rho,
        sharpness=mean,
        stderr=stderr,
        loss=math.fsum(s.loss for s in starts) / len(starts),
        loss_perturbed=math.fsum(column[1]) / len(column[1]),
        accuracy=_mean_or_none([s.accuracy for s in starts]),
        accuracy_perturbed=_mean_or_none(accs),
        perturbation_norm=max(column[4]) if worst else None,
        stderr_noise=stderr_noise,
        history=[math.fsum(h) / len(h) for h in column[6:]] if worst else None,
    )


def _perturbed_names(
    model: nn.Module, scope: ParamScope, config: SharpnessConfig
) -> tuple[list[str], list[str]]:
    """(the parameters perturbed, the normalization layers' left out by ``norm_layers``)."""
    norm_names = normalization_parameters(model)
    excluded = (
        [n for n in scope.names if n in norm_names] if config.norm_layers == "exclude" else []
    )
    names = [n for n in scope.names if n not in excluded]
    if not names:
        raise UsageError(
            "no parameter is left to perturb once normalization layers are excluded",
            source="norm_layers",
        )
    return names, excluded


def _batch_table(
    moved: PerturbedModel,
    chunks: list[tuple[torch.Tensor, torch.Tensor]],
    starts: list[Evaluation],
    mine: list[int],
    config: SharpnessConfig,
    gen: torch.Generator,
    weights: torch.Tensor,
    run: progress.Run,
) -> torch.Tensor:
    """The measures per rho and batch (:func:`_batch_row`) of this rank's batches ``mine``,
    zeros elsewhere (summed over the ranks after); the other ranks' random draws are skipped
    so that every batch sees the draws of a single process.

    Columns: sharpness, loss_perturbed, accuracy, has accuracy, norm, noise variance, then
    worst-case's history.
    """
    width = 6 + (config.steps + 1 if config.kind == "worst-case" else 0)
    table = torch.zeros(len(config.rhos), len(chunks), width, dtype=torch.float64)
    for r, rho in enumerate(config.rhos):
        for b, ((cx, cy), start) in enumerate(zip(chunks, starts)):
            if b not in mine:
                _skip_draws(moved.dim, rho, config, gen, weights)
                continue
            table[r, b] = torch.tensor(
                _batch_row(moved, cx, cy, start, rho, config, gen, weights),
                dtype=torch.float64,
            )
            run.update(r * len(mine) + mine.index(b) + 1, detail=f"rho {rho:g}")
    run.finish(len(mine) * len(config.rhos))
    return table


def sharpness(model: nn.Module, data: AnalysisData, config: SharpnessConfig) -> SharpnessResult:
    """Worst-case or average-case sharpness of ``model`` on ``data`` for each rho
    ([Andriushchenko2023]; module docstring).

    The model's parameters are moved in place during the run and restored exactly after it.
    Progress: a ``sharpness`` run counting batches x rhos.

    Args:
        model: the model, in eval mode.
        data: the analysis set (its batch size sets the forward passes' size).
        config: the measure.

    Returns:
        The rows per rho with the definition.

    Raises:
        UsageError: a bad setting, or nothing left to perturb.
    """
    config.validate()
    scope = ParamScope.resolve(model, config.params)
    names, excluded = _perturbed_names(model, scope, config)
    named = dict(model.named_parameters())
    weights = torch.cat([named[n].detach().reshape(-1) for n in names])
    scale = weights.abs() if config.adaptive else None
    x, y = whole_analysis_set(data)
    n = int(x.shape[0])
    if config.m is not None and int(config.m) > n:
        # cutting m to n would measure another m-sharpness than the one asked for
        raise UsageError(
            f"is {config.m}, above the {n} samples of the analysis set (leave it out to "
            "perturb the whole set as one batch)",
            source="m",
        )
    m = n if config.m is None else int(config.m)
    chunks = [(x[s : s + m], y[s : s + m]) for s in range(0, n, m)]
    gen = torch.Generator().manual_seed(int(config.seed))
    mine = [b for b in range(len(chunks)) if b % data.world_size == data.rank]
    with (
        PerturbedModel(model, names, scale, data.loss, data.batch_size) as moved,
        progress.start(SHARPNESS, total=len(mine) * len(config.rhos), unit="batches") as run,
    ):
        starts = [moved.evaluate(None, cx, cy) for cx, cy in chunks]
        table = _batch_table(moved, chunks, starts, mine, config, gen, weights, run)
        evaluations = int(all_reduce_sum(float(moved.evaluations)))
    all_reduce_sum(table)
    rows = [_row(float(rho), table[r], starts, config) for r, rho in enumerate(config.rhos)]
    notes = []
    if config.adaptive and bool((weights == 0).any()):
        zeros = int((weights == 0).sum())
        notes.append(f"{zeros} weights are exactly 0: with c = |w| they are not perturbed")
    return SharpnessResult(
        config=config,
        rows=rows,
        params=scope.spec,
        num_params=int(weights.numel()),
        excluded=excluded,
        batches=len(chunks),
        m=m,
        evaluations=evaluations,
        notes=notes,
    )


# analyze's sharpness: adaptive l2 at this rho, over the whole set ([Andriushchenko2023])
METRIC_RHO = 0.05


@declare(
    "metric",
    SHARPNESS,
    "adaptive l2 sharpness at rho 0.05: worst case (Auto-PGD) and average case",
    paper="Andriushchenko2023",
    info={
        "order": 6,
        "keys": tuple(
            f"sharpness.{kind}{part}"
            for kind in ("worst_case", "average")
            for part in ("", "_stderr", "_loss_perturbed")
        )
        + ("sharpness.rho",),
        "rows": ("sharpness.*",),
    },
)
def sharpness_metric(run) -> None:
    """``sharp analyze``'s ``sharpness``: adaptive l2 sharpness at rho 0.05 over the whole set,
    worst case (20 Auto-PGD steps) and average case (100 draws), first derivatives and forward
    passes only.

    Args:
        run: the :class:`sharpcli.analyses.analyze.MetricRun`, whose results it adds to.
    """
    found: dict[str, float | None] = {"rho": METRIC_RHO}
    for kind, key in zip(KINDS, ("worst_case", "average")):
        config = SharpnessConfig(
            kind=kind, rhos=(METRIC_RHO,), params=run.params, seed=run.session.seed
        )
        row = sharpness(run.session.model, run.session.analysis_data(), config).rows[0]
        found |= {
            key: row.sharpness,
            f"{key}_stderr": row.stderr,
            f"{key}_loss_perturbed": row.loss_perturbed,
        }
    run.results[SHARPNESS] = found
