"""Per-step CPU time of each regularizer of ``sharpcli.regularizers`` in one's own loop,
against a plain step (docs/benchmarks.md, "Regularizers in your own loop").

One process, one torch thread, one fixed batch: a 64-128-128-10 GELU MLP (26,122
parameters), batch 128, float32, SGD. Contenders:

- ``plain``: ``zero_grad; loss.backward(); optimizer.step()``;
- ``sam-by-hand``: SAM's step written out in plain torch, the floor of the wrapper's ``sam``;
- each oracle (``sam``, ``usam``, ``asam``, ``weight-noise``, ``nso``): the wrapper's
  ``step(closure)``, the closure a forward and a backward (SAM's floor: 2 gradient
  evaluations, so about 2x plain);
- each penalty (``wd``, ``ad``, ``gp``, ``hessian-trace``, ``gn-trace``, ``fa``, exact modes):
  ``(loss + penalty(loss, logits, y)).backward(); optimizer.step()``.

Every contender runs in rounds of ``--steps`` steps, the contenders interleaved round by
round (so a shared machine's load drifts hit all), timed with ``time.process_time`` (CPU
seconds of this process); the median round gives the per-step time. Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_own_loop.py --rounds 11 --steps 20

Prints a Markdown table (median ms/step, ratio to plain, gradient evaluations per step as
``sharp train`` counts them).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from sharpcli import regularizers  # noqa: E402

#: Gradient evaluations per step as ``sharp train`` counts them (StepStats.grad_evals).
GRAD_EVALS = {
    "plain": 1, "sam-by-hand": 2, "wd": 1, "ad": 1, "sam": 2, "usam": 2, "asam": 2, "weight-noise": 1,
    "nso": 2, "gp": 3, "gn-trace": 3, "hessian-trace": 7, "fa": 7,
}  # fmt: skip

DEFAULT = ["wd", "ad", "sam-by-hand", "sam", "usam", "asam", "weight-noise", "nso", "gp", "gn-trace",
           "hessian-trace", "fa"]  # fmt: skip


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)
    )


def _contender(name: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One step of ``name`` on (x, y), as a function."""
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    if name == "plain":

        def plain() -> None:
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            sgd.step()

        return plain
    if name == "sam-by-hand":
        return _sam_by_hand(model, sgd, x, y)
    # an oracle wraps the optimizer; a penalty takes none (it is added to the loss)
    oracle = regularizers.names()[name.split(":")[0]] == "oracle"
    made = regularizers.make(
        name, sgd if oracle else None, model=model, generator=torch.Generator().manual_seed(0)
    )
    if isinstance(made, regularizers.PerturbedOptimizer):

        def closure() -> torch.Tensor:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        return lambda: made.step(closure)
    penalty = made

    def penalized() -> None:
        sgd.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        (loss + penalty(loss, logits, y)).backward()
        sgd.step()

    return penalized


def _sam_by_hand(model: nn.Module, sgd: torch.optim.Optimizer, x, y) -> Callable[[], None]:
    """SAM's floor: the SAM paper's step written out in plain torch (gradient,
    ``e = rho g/||g||`` with one fused norm, gradient at ``theta + e``, ``e`` subtracted)."""
    params = list(model.parameters())

    def step() -> None:
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            grads = [p.grad for p in params]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            e = torch._foreach_mul(grads, 0.05 / norm)
            torch._foreach_add_(params, e)
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            torch._foreach_sub_(params, e)
        sgd.step()

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--regs", nargs="+", default=DEFAULT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 64, generator=gen), torch.randint(0, 10, (128,), generator=gen)
    names = ["plain", *args.regs]
    steps = {name: _contender(name, x, y) for name in names}
    for step in steps.values():  # warm-up: allocator, lazy imports
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            start = time.process_time()
            for _ in range(args.steps):
                steps[name]()
            times[name].append((time.process_time() - start) / args.steps)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"Date: {_dt.date.today()}; host: {platform.machine()}, {os.cpu_count()} cores; torch "
        f"{torch.__version__}, threads: {torch.get_num_threads()}; {args.rounds} rounds of "
        f"{args.steps} steps, median round."
    )
    print()
    print("| regularizer | ms/step (CPU) | ratio to plain | grad evals/step |")
    print("|---|---:|---:|---:|")
    for name in names:
        evals = GRAD_EVALS.get(name.split(":")[0], "")
        ratio = median[name] / median["plain"]
        print(f"| `{name}` | {1e3 * median[name]:.3f} | {ratio:.2f}x | {evals} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
