"""A Lanczos step's own cost beyond its product at research scale.

``lanczos_step`` then the next row stored, at P = 124,439,808 (GPT-2 small's parameter count),
float32, a basis of 6 rows in memory, one thread, with a stand-in product (a copy of a fixed
vector: what flattening a real product costs), CPU seconds (user + system), median of 4::

    OMP_NUM_THREADS=1 python benchmarks/bench_lanczos_step.py [--gram-schmidt] [--dim P]

Without ``--gram-schmidt`` the step skips its pass against the basis (as a semi-orthogonal
step does); with it, the pass runs. Run it with ``PYTHONPATH`` at an older checkout to compare
(code from before the skip returns three values from ``lanczos_step`` and always runs it).
"""

from __future__ import annotations

import argparse
import resource

import torch

from sharpcli.curvature.eigen.krylov import KrylovBasis
from sharpcli.curvature.eigen.ritz import lanczos_step


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class StandIn:
    """A "product" that copies one fixed vector."""

    name = "stand-in"
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, dim: int, generator: torch.Generator):
        self.shape = (dim, dim)
        self.v = torch.randn(dim, generator=generator)

    def matvec(self, x):
        return self.v.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=124_439_808)
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--gram-schmidt", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    op = StandIn(args.dim, gen)
    basis = KrylovBasis(args.dim, torch.float32, "cpu")
    for _ in range(args.rows):
        q = torch.randn(args.dim, generator=gen)
        basis.append(q / q.norm())
    coupling = [(args.rows - 2, 0.5)]
    times = []
    for _ in range(4):
        start = cpu()
        try:
            skip = None if args.gram_schmidt else (lambda alpha, beta, local: True)
            alpha, beta, w, _ = lanczos_step(op, basis, coupling, 1, skip)
            basis.append(w, divisor=beta)
        except TypeError:  # code from before the skip: (op, basis, coupling, step) -> 3 values
            alpha, beta, w = lanczos_step(op, basis, coupling, 1)
            w.div_(beta)
            basis.append(w)
        times.append(cpu() - start)
        basis.truncate(args.rows)
        del w
    start = cpu()
    op.matvec(None)
    copy = cpu() - start
    step = sorted(times)[len(times) // 2]
    print(f"P = {args.dim:,}, {args.rows} rows: a step {step:.3f} CPU s, the stand-in's copy "
          f"{copy:.3f}, beyond it {step - copy:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
