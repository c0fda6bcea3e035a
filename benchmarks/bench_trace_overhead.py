"""CPU seconds per Hutchinson probe beyond the product, on a synthetic operator of GPT-2's size.

``sharp trace --estimator hutchinson`` at GPT-2 small (P = 124,439,808 float32 parameters)
spends, per probe, the product (a graph-kept double backward, ~4 CPU s) plus the estimator's
own P-vector passes: drawing the Rademacher probe, converting it, the per-layer sums of
``v * Av``, and the engine's copies of the probe and the product. This script measures that
overhead without the model, so that it can be profiled on a small machine:

- ``--operator diagonal`` (default): a :class:`~sharpcli.curvature.CurvatureOperator` whose
  product is ``d * v`` (one memory-bound pass), its layout that of GPT-2 small's 148
  parameter pieces (one per-layer block each). Like the engine it reads each probe column
  contiguous (a gather when the probe block is row-major); it multiplies into a column-major
  block kept between products, and that multiplication's CPU time is measured and
  subtracted: what is left is the estimator's own (``trace.hutchinson``).
- ``--operator engine``: the real :class:`~sharpcli.curvature.CurvatureEngine` Hessian of a
  model with GPT-2 small's 148 parameter pieces (named like them, so 75 per-layer blocks)
  whose loss is a cross-entropy over logits quadratic in each piece: its double backward is
  a few P-vector passes. The bare graph-kept HVP (``torch.autograd.grad`` of the cached
  gradient with contiguous vectors, the least of two before and two after each run) is
  measured on its own and subtracted: what is left is the estimator's and the engine's
  overhead, as inside ``sharp trace`` at GPT-2.

Usage (one thread, as the research-scale figures in docs/benchmarks.md)::

    OMP_NUM_THREADS=1 python benchmarks/bench_trace_overhead.py [--synthetic P]
        [--operator diagonal|engine] [--probes 8] [--block-size 8] [--columns 2]
        [--repeats 2] [--heap reuse|bounded] [--profile FILE]

prints the CPU seconds (user + system, ``resource.getrusage``) per probe in all, of the
product, and beyond it. ``--columns`` sets the memory plan so that a probe block of
``--block-size`` is multiplied that many columns at a time (GPT-2's default budget on a
shared machine gives a few); ``--profile FILE`` writes a cProfile (CPU-time clock) of the last
repeat and prints its top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sharpcli import memory  # noqa: E402
from sharpcli.curvature import AnalysisData, CurvatureEngine, CurvatureOperator  # noqa: E402
from sharpcli.curvature.products.scope import ParamScope  # noqa: E402
from sharpcli.curvature.trace.hutchinson import hutchinson  # noqa: E402

GPT2_SMALL = 124_439_808


def gpt2_pieces() -> list[tuple[str, int]]:
    """GPT-2 small's 148 parameter tensors, ``(name, numel)`` in ``named_parameters`` order."""
    d, vocab, context = 768, 50257, 1024
    pieces = [("wte.weight", vocab * d), ("wpe.weight", context * d)]
    for i in range(12):
        h = f"h.{i}"
        pieces += [
            (f"{h}.ln_1.weight", d),
            (f"{h}.ln_1.bias", d),
            (f"{h}.attn.c_attn.weight", d * 3 * d),
            (f"{h}.attn.c_attn.bias", 3 * d),
            (f"{h}.attn.c_proj.weight", d * d),
            (f"{h}.attn.c_proj.bias", d),
            (f"{h}.ln_2.weight", d),
            (f"{h}.ln_2.bias", d),
            (f"{h}.mlp.c_fc.weight", d * 4 * d),
            (f"{h}.mlp.c_fc.bias", 4 * d),
            (f"{h}.mlp.c_proj.weight", 4 * d * d),
            (f"{h}.mlp.c_proj.bias", d),
        ]
    pieces += [("ln_f.weight", d), ("ln_f.bias", d)]
    assert sum(n for _, n in pieces) == GPT2_SMALL
    return pieces


def scaled_pieces(total: int) -> list[tuple[str, int]]:
    """GPT-2 small's pieces scaled to ``total`` entries (each at least 1; the first absorbs
    the rounding)."""
    pieces = [(name, max(1, n * total // GPT2_SMALL)) for name, n in gpt2_pieces()]
    rest = total - sum(n for _, n in pieces)
    name, n = pieces[0]
    pieces[0] = (name, n + rest)
    return pieces


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def system_seconds() -> float:
    """System CPU seconds of this process so far (page faults: memory mapped afresh)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


class DiagonalOperator(CurvatureOperator):
    """``d * V`` over GPT-2's pieces; ``product_seconds`` accumulates the product's CPU time."""

    name = "synthetic diagonal"

    def __init__(self, pieces: list[tuple[str, int]]):
        total = sum(n for _, n in pieces)
        super().__init__(total, torch.float32, "cpu")
        self.d = torch.rand(total, generator=torch.Generator().manual_seed(1)) + 0.5
        self.layer_blocks, start = {}, 0
        for name, n in pieces:
            self.layer_blocks[name] = slice(start, start + n)
            start += n
        self.product_seconds = 0.0
        self.out: torch.Tensor | None = None

    def blocks(self) -> dict[str, slice]:
        return dict(self.layer_blocks)

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        # a column is read contiguous (the engine's reverse pass does), and multiplied into its
        # column of a block kept between products (timed: the product), so that what is left
        # is the estimator's own work, not this operator's allocations
        k = V.shape[1]
        if self.out is None or self.out.shape[1] < k:
            self.out = torch.empty(k, V.shape[0], dtype=V.dtype).T
        for j in range(k):
            column = V[:, j].contiguous()
            start = cpu_seconds()
            torch.mul(self.d, column, out=self.out[:, j])
            self.product_seconds += cpu_seconds() - start
            del column
        return self.out[:, :k]


class QuadraticPieces(nn.Module):
    """Logits ``x A + q U`` with ``q_i = |p_i|^2 / n_i`` over GPT-2's pieces: the Hessian
    product of its cross-entropy is a few elementwise passes over the parameters."""

    def __init__(self, pieces: list[tuple[str, int]], classes: int = 4, features: int = 8):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.names = []
        for name, n in pieces:
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, nn.Parameter(0.5 * torch.randn(n, generator=gen)))
            self.names.append(name)
        self.register_buffer("A", torch.randn(features, classes, generator=gen))
        self.register_buffer("U", torch.randn(len(pieces), classes, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.stack([torch.dot(p, p) / p.numel() for p in self.parameters()])
        return x @ self.A + q @ self.U


def engine_operator(pieces):
    """The Hessian operator of :class:`QuadraticPieces` and a function that returns the bare
    HVP's CPU seconds (the least of ``count`` products)."""
    model = QuadraticPieces(pieces)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 8, generator=gen)
    y = torch.randint(0, 4, (16,), generator=gen)
    scope = ParamScope.resolve(model)
    engine = CurvatureEngine(model, AnalysisData(x, y, "cross-entropy", 16), scope)
    _, graph = next(iter(engine._graphs()))  # built once and cached, as in a run
    vector = torch.randn(scope.numel, generator=gen)
    pieces_v = [vector[a:b] for a, b in zip(scope.offsets[:-1], scope.offsets[1:])]
    vectors = [pieces_v[i] for i in graph.grad_index]

    def bare(count: int = 2) -> float:
        seconds = []
        for _ in range(count):
            start = cpu_seconds()
            out = torch.autograd.grad(
                graph.grads, list(scope.params), grad_outputs=vectors, retain_graph=True
            )
            seconds.append(cpu_seconds() - start)
            del out
        return min(seconds)

    return engine.hessian(), bare


def plan_for(dim: int, block_size: int, columns: int, heap: str) -> None:
    """A memory plan that fits ``columns`` probe columns (3 float32 P-vectors each) beside a
    block's signs (at most one int8 P-vector per probe), not one more, the C heap as ``heap``
    says (``reuse``: freed blocks reused, as a default budget at GPT-2 small chooses;
    ``bounded``: trimmed after every product, as a tight one)."""
    per_column = dim * 4 * 3
    budget = memory.rss_bytes() + dim * block_size + columns * per_column + per_column // 4
    plan = memory.activate(memory.MemoryPlan(budget=budget, baseline=memory.rss_bytes()))
    if heap == "reuse" and memory._set_heap(memory.REUSE_MMAP_THRESHOLD, memory.REUSE_MMAP_MAX):
        plan.heap = "reuse"  # what settle_heap chooses when the budget holds the slack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--synthetic", type=int, default=GPT2_SMALL, metavar="P")
    parser.add_argument("--operator", choices=("diagonal", "engine"), default="diagonal")
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--columns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--heap", choices=("reuse", "bounded"), default="reuse")
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pieces = scaled_pieces(args.synthetic)
    bare = None
    if args.operator == "diagonal":
        op = DiagonalOperator(pieces)
    else:
        op, bare = engine_operator(pieces)
    print(
        f"P = {op.shape[0]:,} float32 in {len(pieces)} pieces, {len(op.blocks())} blocks; "
        f"{args.probes} probes, block {args.block_size}, {args.columns} columns a product; "
        f"operator {args.operator}, torch {torch.__version__}, {torch.get_num_threads()} thread"
    )
    results = []
    for repeat in range(args.repeats):
        plan_for(op.shape[0], args.block_size, args.columns, args.heap)
        profiler = None
        if args.profile and repeat == args.repeats - 1:
            profiler = cProfile.Profile(time.process_time)
        if isinstance(op, DiagonalOperator):
            op.product_seconds = 0.0
        bare_seconds = 0.0 if bare is None else bare()  # in this repeat's conditions
        start, start_system = cpu_seconds(), system_seconds()
        if profiler is not None:
            profiler.enable()
        result = hutchinson(
            op, tol=1e-12, max_matvecs=args.probes, seed=0, block_size=args.block_size
        )
        if profiler is not None:
            profiler.disable()
        total = (cpu_seconds() - start) / result.matvecs
        system = (system_seconds() - start_system) / result.matvecs
        if bare is not None:  # and once more after it: the least of the four
            bare_seconds = min(bare_seconds, bare())
        product = op.product_seconds / result.matvecs if bare is None else bare_seconds
        results.append((total, product))
        print(
            f"repeat {repeat}: {total:.3f} CPU s a probe in all, product {product:.3f}, "
            f"beyond the product {total - product:.3f}, system {system:.3f} (estimate {result.estimate:.6g}, "
            f"{result.matvecs} probes; {'; '.join(memory.current().choices) or 'full blocks'})"
        )
        memory.clear()
        if profiler is not None:
            profiler.dump_stats(args.profile)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    best = min(results, key=lambda r: r[0] - r[1])
    print(
        f"best: {best[0]:.3f} CPU s a probe, product {best[1]:.3f}, "
        f"beyond the product {best[0] - best[1]:.3f}"
    )


if __name__ == "__main__":
    main()
