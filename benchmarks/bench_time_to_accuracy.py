"""Time to accuracy: lambda_max and tr(H) by sharp, PyHessian 0.1 and curvlinops + scipy ``eigsh``.

What a user pays for a number of a given accuracy. For each workload, tool and target relative
error, every tool runs a ladder of its own stopping tolerances, loosest first
(``10^(-j/2)``, j = 1, 2, ...), each step with ``--seeds`` start vectors (or probe sets), and the
cost of the loosest tolerance whose answer reaches the target for every seed is that tool's
cost for it ("its tol set so it reaches the target": a user cannot pick a lucky start). Costs
are Hessian products and CPU seconds (``time.process_time()``, one torch thread, construction of
each tool's operator included; medians over the seeds; on ``--device cuda`` wall seconds after
``torch.cuda.synchronize()``). Within one workload the tools' ladders are interleaved (step j
of every tool, in an order that rotates with j), so all tools see the same machine load;
``--repeats`` adds timings of the chosen steps, again rotating. A tool leaves the ladder once
it reaches the smallest target, fails to converge in its budget, or three tightenings that each
cost more products did not halve its error (its float32 floor).

lambda_max (the largest eigenvalue of the Hessian of the mean loss over the analysis set):

- ``sharp``: :func:`sharpcli.curvature.eigen.lanczos` (Lanczos [Lanczos1950] with full
  reorthogonalisation [Parlett1998]), ``k=1``,
  ``tol`` = the relative residual ``||H u - theta u|| <= tol |theta|`` it certifies (float32
  products: the residual is an explicit extra product, counted);
- ``sharp warm=subsample``: the same, started from the top Ritz vector of 4 Lanczos steps on
  the Hessian of a seeded 10% subsample of the data (``warm_start="subsample"``; those cheaper
  products are counted as full-product equivalents, ``|S|/N`` each);
- ``sharp warm=gradient``: started from the loss gradient (``warm_start="gradient"``; one
  gradient pass, in the CPU seconds, not in the product count);
- ``PyHessian``: ``pyhessian.hessian(model, criterion, data=(x, y)).eigenvalues(top_n=1, tol,
  maxIter)`` (power iteration [PyHessian]), ``tol`` = its relative
  change of the Rayleigh quotient between iterations;
- ``curvlinops+eigsh``: ``curvlinops.HessianLinearOperator(...).to_scipy()`` ([Curvlinops] 3.0.1,
  ``check_deterministic=False`` so only the eigensolver's products are paid) and
  ``scipy.sparse.linalg.eigsh(k=1, which="LA", tol, v0=seeded)`` ([ARPACK] implicitly restarted
  Lanczos, ``ncv=20`` by default: at least 20 products).

The error is ``|lambda - lambda_ref| / |lambda_ref|`` against a long float64 run (model and data
converted to float64; Lanczos ``k=2`` to relative residual 1e-10, which also gives
``lambda_2 / lambda_1``). The tools run in float32, so errors below ~1e-7-1e-6 are out of
their reach (the float32 products' own rounding).

Trace (``tr(H)``; the error of a ladder step is the root mean square over the seeds of
``|estimate - ref| / |ref|``, since a trace estimate is random whatever the tolerance):

- ``sharp hutchpp``: [Hutch++], ``tol`` = relative
  standard error;
- ``sharp gn-split``: ``tr(H) = tr(G) + tr(N)``, exact Gauss-Newton trace plus Hutch++ on the NME
  (its exact part is in the CPU seconds, not in the products);
- ``PyHessian``: ``hessian(...).trace(maxIter, tol)`` ([Hutchinson1989]; its running-mean stop
  rule).

The reference trace is ``gn-split`` to a relative standard error ``--trace-ref-tol`` (default
3e-3) with its own seed, so errors down to about 1e-2 are measurable.

Workloads (checkpoints trained first by ``sharp train``, seed 0, float32; the whole training
split is one batch, the way PyHessian's ``data=`` mode takes it):

- ``resnet``: CIFAR ResNet-8 [He2016] width 32 with BatchNorm (298,026 parameters) on
  ``images:n=667`` (500 training images 3x8x8), 3 epochs (lambda_max only: a trace to 1% needs
  thousands of its 0.5 s products);
- ``cnn``: the zoo's small CNN (6,378 parameters) on ``images:n=2000`` (1500 training), 3 epochs;
- ``mlp``: ``sharp train`` at its defaults (MLP 16-64-64-4, ReLU; 5,508 parameters; ``blobs``,
  1500 training samples);
- ``mlp-clustered``: GELU MLP 64-256-256-10 (85,002 parameters) on
  ``blobs:n=2000,dim=64,classes=10``, 5 epochs: its top eigenvalues are clustered
  (``lambda_2 / lambda_1`` about 0.9), where power iteration crawls.

``--quick`` (about 3 CPU minutes): ResNet-8 width 16 on 200 images, a CNN on 600 images, both
MLPs, 2 seeds, trace on the MLPs only.

Usage (the figures of docs/benchmarks.md, "Time to accuracy", were made in two runs and one
merge)::

    OMP_NUM_THREADS=1 python benchmarks/bench_time_to_accuracy.py --workloads resnet \
        --workdir /tmp/tta --json /tmp/tta/resnet.json
    OMP_NUM_THREADS=1 python benchmarks/bench_time_to_accuracy.py \
        --workloads cnn,mlp,mlp-clustered --workdir /tmp/tta --json /tmp/tta/small.json
    python benchmarks/bench_time_to_accuracy.py --from-json /tmp/tta/resnet.json \
        /tmp/tta/small.json --markdown /tmp/tta/tta.md --plot docs/time_to_accuracy.png
    OMP_NUM_THREADS=1 python benchmarks/bench_time_to_accuracy.py --quick   # a smoke run

Needs ``pip install -c constraints.txt -e .[bench]`` (PyHessian 0.1, curvlinops-for-pytorch
3.0.1, scipy) and matplotlib for the plot. Prints Markdown; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

WORKLOADS = {
    "resnet": {
        "train": ["--model", "resnet", "--depth", "8", "--width", "32"]
        + ["--data", "images:n=667", "--epochs", "3"],
        "quick": ["--model", "resnet", "--depth", "8", "--width", "16"]
        + ["--data", "images:n=267", "--epochs", "3"],
        "label": "ResNet-8 width 32, BatchNorm, images 3x8x8 (500 train)",
        "quick_label": "ResNet-8 width 16, BatchNorm, images 3x8x8 (200 train)",
        "trace": False,
    },
    "cnn": {
        "train": ["--model", "cnn", "--data", "images:n=2000", "--epochs", "3"],
        "quick": ["--model", "cnn", "--data", "images:n=800", "--epochs", "3"],
        "label": "small CNN (conv16-conv32-linear), images 3x8x8 (1500 train)",
        "quick_label": "small CNN (conv16-conv32-linear), images 3x8x8 (600 train)",
        "trace": True,
        "quick_trace": False,
    },
    "mlp": {
        "train": [],
        "quick": [],
        "label": "sharp train defaults: MLP 16-64-64-4 ReLU, blobs (1500 train)",
        "trace": True,
    },
    "mlp-clustered": {
        "train": ["--data", "blobs:n=2000,dim=64,classes=10", "--model", "mlp"]
        + ["--width", "256", "--depth", "2", "--activation", "gelu", "--epochs", "5"],
        "quick": ["--data", "blobs:n=2000,dim=64,classes=10", "--model", "mlp"]
        + ["--width", "256", "--depth", "2", "--activation", "gelu", "--epochs", "5"],
        "label": "GELU MLP 64-256-256-10, blobs 10 classes (1500 train)",
        "trace": True,
    },
}

EIGEN_TARGETS = (1e-2, 1e-3, 1e-4, 1e-6)
TRACE_TARGETS = (1e-1, 3e-2, 1e-2)
EIGEN_TOOLS = (
    "sharp",
    "sharp warm=subsample",
    "sharp warm=gradient",
    "PyHessian",
    "curvlinops+eigsh",
)
TRACE_TOOLS = ("sharp hutchpp", "sharp gn-split", "PyHessian")
EIGEN_LADDER = [10 ** (-j / 2) for j in range(1, 15)]  # 0.32 ... 1e-7
TRACE_LADDER = {
    "sharp hutchpp": [0.1, 0.05, 0.03, 0.02, 0.01, 0.005],
    "sharp gn-split": [0.1, 0.05, 0.03, 0.02, 0.01, 0.005],
    "PyHessian": [0.1, 0.03, 0.01, 0.003, 0.001],
}
SHARP_MAX_MATVECS = 80
PYHESSIAN_MAX_ITER = 400  # power iterations (lambda_max)
PYHESSIAN_TRACE_MAX_ITER = 200  # Hutchinson samples (trace)
EIGSH_MAX_RESTARTS = 6


def fmt(x, digits=3):
    """Compact number formatting for the tables."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-2:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


# --------------------------------------------------------------------------- set-up
def child_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NO_COLOR="1", TERM="dumb")
    return env


def train(name: str, workdir: Path, quick: bool) -> Path:
    """Train a workload's checkpoint with ``sharp train`` (seed 0) unless it exists."""
    suffix = "_quick" if quick else ""
    ckpt = workdir / f"{name}{suffix}.safetensors"
    if not ckpt.exists():
        args = WORKLOADS[name]["quick" if quick else "train"]
        cmd = [sys.executable, "-m", "sharpcli", "train", *args, "--seed", "0"]
        cmd += ["--out", str(ckpt), "-q", "--json", str(workdir / f"{name}{suffix}_train.json")]
        subprocess.run(cmd, check=True, env=child_env(), stdout=subprocess.DEVNULL)
    return ckpt


class Clock:
    """CPU seconds of this process on CPU; synchronised wall seconds on an accelerator."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def __call__(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()


class Workload:
    """A checkpoint's model and training split (one batch) on ``device``, float32."""

    def __init__(self, ckpt: Path, device: str, dtype: str = "float32"):
        from sharpcli.session import build_session

        self.session = build_session(str(ckpt), batch_size=1 << 30, device=device, dtype=dtype)
        s = self.session
        self.model, self.x, self.y = s.model, s.x, s.y
        self.device = device
        self.scope = s.scope(None)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.P = self.scope.numel
        self.N = s.num_samples
        if s.loss != "cross-entropy":
            raise SystemExit(f"{ckpt}: this benchmark is for classifiers (cross-entropy)")

    def data(self):
        return self.session.analysis_data()

    def engine(self):
        from sharpcli.curvature import CurvatureEngine

        return CurvatureEngine(self.model, self.data(), self.scope)


# --------------------------------------------------------------------------- lambda_max tools
def run_sharp(w: Workload, clock, tol: float, seed: int, warm: str | None) -> dict:
    from sharpcli.curvature import lanczos

    start = clock()
    op = w.engine().hessian()
    r = lanczos(op, top_k=1, tol=tol, max_matvecs=SHARP_MAX_MATVECS, seed=seed, warm_start=warm)
    seconds = clock() - start
    extra = 0.0
    if r.warm_start and r.warm_start.get("full_product_equivalents"):
        extra = r.warm_start["full_product_equivalents"]
    return {
        "value": r.eigenvalues[0],
        "products": r.matvecs + extra,
        "seconds": seconds,
        "stopped": "converged" if r.converged[0] else "budget",
    }


class _PyHessianCounter:
    """Counts PyHessian's Hessian-vector products (one per power or Hutchinson step)."""

    def __enter__(self):
        self.module = importlib.import_module("pyhessian.hessian")
        self.original = self.module.hessian_vector_product
        self.count = 0

        def counting(*a, **k):
            self.count += 1
            return self.original(*a, **k)

        self.module.hessian_vector_product = counting
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
        return self

    def __exit__(self, *exc):
        self.module.hessian_vector_product = self.original
        self._warnings.__exit__(*exc)


def _pyhessian(w: Workload):
    import torch
    from pyhessian import hessian

    w.model.zero_grad(set_to_none=True)  # its constructor adds into .grad: start clean
    return hessian(
        w.model,
        torch.nn.CrossEntropyLoss(),
        data=(w.x, w.y),
        cuda=w.device.startswith("cuda"),
    )


def run_pyhessian(w: Workload, clock, tol: float, seed: int) -> dict:
    import torch

    torch.manual_seed(seed)
    with _PyHessianCounter() as counter:
        start = clock()
        values, _ = _pyhessian(w).eigenvalues(maxIter=PYHESSIAN_MAX_ITER, tol=tol, top_n=1)
        seconds = clock() - start
    w.model.zero_grad(set_to_none=True)  # break its graph-carrying .grad cycle
    return {
        "value": float(values[0]),
        "products": counter.count,
        "seconds": seconds,
        "stopped": "converged" if counter.count < PYHESSIAN_MAX_ITER else "budget",
    }


def run_curvlinops(w: Workload, clock, tol: float, seed: int) -> dict:
    import numpy as np
    import torch
    from curvlinops import HessianLinearOperator
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

    count = [0]
    v0 = np.random.default_rng(seed).standard_normal(w.P)
    start = clock()
    H = HessianLinearOperator(
        w.model, torch.nn.CrossEntropyLoss(), w.params, [(w.x, w.y)], check_deterministic=False
    ).to_scipy(dtype=np.float64)

    def matmat(X):
        count[0] += 1 if X.ndim == 1 else X.shape[1]
        return H @ X

    A = LinearOperator(H.shape, matvec=matmat, matmat=matmat, dtype=np.float64)
    stopped = "converged"
    try:
        values = eigsh(
            A,
            k=1,
            which="LA",
            tol=tol,
            v0=v0,
            maxiter=EIGSH_MAX_RESTARTS,
            return_eigenvectors=False,
        )
        value = float(values[0])
    except ArpackNoConvergence as error:
        value = float(error.eigenvalues[0]) if len(error.eigenvalues) else float("nan")
        stopped = "budget"
    seconds = clock() - start
    return {"value": value, "products": count[0], "seconds": seconds, "stopped": stopped}


def eigen_runner(tool: str):
    if tool == "sharp":
        return lambda w, c, tol, seed: run_sharp(w, c, tol, seed, None)
    if tool == "sharp warm=subsample":
        return lambda w, c, tol, seed: run_sharp(w, c, tol, seed, "subsample")
    if tool == "sharp warm=gradient":
        return lambda w, c, tol, seed: run_sharp(w, c, tol, seed, "gradient")
    if tool == "PyHessian":
        return run_pyhessian
    return run_curvlinops


# --------------------------------------------------------------------------- trace tools
def run_hutchpp(w: Workload, clock, tol: float, seed: int) -> dict:
    from sharpcli.curvature import hutchpp

    start = clock()
    r = hutchpp(w.engine().hessian(), tol=tol, max_matvecs=4000, seed=seed)
    return {"value": r.estimate, "products": r.matvecs, "seconds": clock() - start}


def run_gn_split(w: Workload, clock, tol: float, seed: int) -> dict:
    from sharpcli.curvature import gn_split_trace

    start = clock()
    r = gn_split_trace(w.engine(), tol=tol, max_matvecs=4000, seed=seed)
    return {
        "value": r.estimate,
        "products": r.matvecs,
        "seconds": clock() - start,
        "stderr": r.stderr,
    }


def run_pyhessian_trace(w: Workload, clock, tol: float, seed: int) -> dict:
    import torch

    torch.manual_seed(seed)
    with _PyHessianCounter() as counter:
        start = clock()
        samples = _pyhessian(w).trace(maxIter=PYHESSIAN_TRACE_MAX_ITER, tol=tol)
        seconds = clock() - start
    w.model.zero_grad(set_to_none=True)
    return {
        "value": float(sum(samples) / len(samples)),
        "products": counter.count,
        "seconds": seconds,
    }


TRACE_RUNNERS = {
    "sharp hutchpp": run_hutchpp,
    "sharp gn-split": run_gn_split,
    "PyHessian": run_pyhessian_trace,
}


# --------------------------------------------------------------------------- references
def eigen_reference(ckpt: Path, device: str, clock) -> dict:
    """lambda_1 and lambda_2 of the float64 model: Lanczos to relative residual 1e-10."""
    from sharpcli.curvature import lanczos

    w = Workload(ckpt, device, dtype="float64")
    start = clock()
    r = lanczos(w.engine().hessian(), top_k=2, tol=1e-10, max_matvecs=300, seed=123)
    return {
        "lambda_1": r.eigenvalues[0],
        "lambda_2": r.eigenvalues[1],
        "residuals": r.residuals,
        "converged": r.converged,
        "matvecs": r.matvecs,
        "seconds": clock() - start,
    }


def product_seconds(w: Workload, clock, repeats: int = 3) -> float:
    """Median seconds of one Hessian product with the first-order graph cached."""
    import torch

    op = w.engine().hessian()
    v = torch.randn(w.P, generator=torch.Generator().manual_seed(0)).to(op.dtype).to(op.device)
    op.matvec(v)
    times = []
    for _ in range(repeats):
        start = clock()
        op.matvec(v)
        times.append(clock() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------- ladders
def rotate(items, shift):
    items = list(items)
    shift %= len(items)
    return items[shift:] + items[:shift]


def stagnant(runs: list, steps: int = 3) -> bool:
    """The last ``steps`` tightenings each bought more products but together did not halve the
    error: the tool is at its floor (float32 rounding of its own arithmetic), and tighter
    tolerances only cost more. (Tightenings that stop at the same product count do not count:
    the tool has not moved yet.)"""
    if len(runs) <= steps:
        return False
    window = runs[-steps - 1 :]
    grew = all(b["products"] > a["products"] for a, b in zip(window, window[1:]))
    return grew and min(r["error"] for r in window[1:]) > window[0]["error"] / 2


def eigen_study(w: Workload, clock, ref: dict, seeds: int, repeats: int, log) -> dict:
    """Interleaved tolerance ladders of every lambda_max tool, ``seeds`` start vectors per step.

    A step's error is the worst over the seeds (a tolerance must work whatever the start), its
    products and seconds the medians; then ``repeats`` more timings of the chosen steps."""
    lam = ref["lambda_1"]
    runs = {tool: [] for tool in EIGEN_TOOLS}
    active = set(EIGEN_TOOLS)
    for j, tol in enumerate(EIGEN_LADDER):
        for tool in rotate(EIGEN_TOOLS, j):
            if tool not in active:
                continue
            outs = [eigen_runner(tool)(w, clock, tol, s) for s in range(seeds)]
            errors = [abs(o["value"] - lam) / abs(lam) for o in outs]
            out = {
                "tol": tol,
                "values": [o["value"] for o in outs],
                "errors": errors,
                "error": max(errors),
                "products": statistics.median(o["products"] for o in outs),
                "seconds": statistics.median(o["seconds"] for o in outs),
                "stopped": "converged"
                if all(o["stopped"] == "converged" for o in outs)
                else "budget",
            }
            out["samples"] = [out["seconds"]]
            runs[tool].append(out)
            log(
                f"    {tool:22s} tol {tol:.1e}: worst error {out['error']:.2e}, "
                f"{fmt(out['products'])} products, {out['seconds']:.2f} s ({out['stopped']})"
            )
            if (
                out["error"] <= min(EIGEN_TARGETS)
                or out["stopped"] != "converged"
                or stagnant(runs[tool])
            ):
                active.discard(tool)
        if not active:
            break
    chosen = choose(runs, EIGEN_TARGETS)

    def again(tool, run):
        outs = [eigen_runner(tool)(w, clock, run["tol"], s) for s in range(seeds)]
        return {"seconds": statistics.median(o["seconds"] for o in outs)}

    _repeat(chosen, runs, repeats, again)
    return {"runs": runs, "chosen": summarise(chosen, runs, EIGEN_TARGETS)}


def trace_study(w: Workload, clock, ref: dict, seeds: int, repeats: int, log) -> dict:
    """Interleaved ladders of the trace tools (``seeds`` probe seeds per step)."""
    tr = ref["trace"]
    runs = {tool: [] for tool in TRACE_TOOLS}
    active = set(TRACE_TOOLS)
    steps = max(len(v) for v in TRACE_LADDER.values())
    for j in range(steps):
        for tool in rotate(TRACE_TOOLS, j):
            if tool not in active or j >= len(TRACE_LADDER[tool]):
                continue
            tol = TRACE_LADDER[tool][j]
            outs = [TRACE_RUNNERS[tool](w, clock, tol, 1000 + s) for s in range(seeds)]
            errors = [abs(o["value"] - tr) / abs(tr) for o in outs]
            out = {
                "tol": tol,
                "values": [o["value"] for o in outs],
                "error": math.sqrt(sum(e * e for e in errors) / len(errors)),
                "errors": errors,
                "products": statistics.median(o["products"] for o in outs),
                "seconds": statistics.median(o["seconds"] for o in outs),
                "stopped": "converged",
            }
            out["samples"] = [out["seconds"]]
            runs[tool].append(out)
            log(
                f"    {tool:22s} tol {tol:.0e}: rms error {out['error']:.2e}, "
                f"{fmt(out['products'])} products, {out['seconds']:.2f} s"
            )
            if out["error"] <= min(TRACE_TARGETS):
                active.discard(tool)
        if not active:
            break
    chosen = choose(runs, TRACE_TARGETS)

    def again(tool, run):
        outs = [TRACE_RUNNERS[tool](w, clock, run["tol"], 1000 + s) for s in range(seeds)]
        return {"seconds": statistics.median(o["seconds"] for o in outs)}

    _repeat(chosen, runs, repeats, again)
    return {"runs": runs, "chosen": summarise(chosen, runs, TRACE_TARGETS)}


def choose(runs: dict, targets) -> dict:
    """For each tool and target: index of the first (loosest) ladder run reaching it, or None."""
    return {
        tool: {t: next((i for i, r in enumerate(rs) if r["error"] <= t), None) for t in targets}
        for tool, rs in runs.items()
    }


def _repeat(chosen, runs, repeats, again):
    """``repeats`` more timings of every chosen run, tools rotating; medians into ``seconds``."""
    todo = sorted(
        {(tool, i) for tool, per in chosen.items() for i in per.values() if i is not None}
    )
    for r in range(repeats):
        for tool, i in rotate(todo, r):
            runs[tool][i]["samples"].append(again(tool, runs[tool][i])["seconds"])
    for rs in runs.values():
        for run in rs:
            run["seconds"] = statistics.median(run["samples"])


def summarise(chosen, runs, targets) -> dict:
    out = {}
    for tool, per in chosen.items():
        out[tool] = {}
        for t in targets:
            i = per[t]
            out[tool][str(t)] = (
                None
                if i is None
                else {k: runs[tool][i][k] for k in ("tol", "error", "products", "seconds")}
            )
    return out


# --------------------------------------------------------------------------- report
def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def cost_table(study: dict, targets, tools, kind: str) -> list[str]:
    """Markdown rows: per tool and target, products / seconds (the tolerance that reached it)."""
    lines = [
        "| tool | " + " | ".join(f"{kind} <= {t:g}" for t in targets) + " |",
        "|---|" + "---|" * len(targets),
    ]
    for tool in tools:
        cells = []
        for t in targets:
            c = study["chosen"][tool][str(t)]
            cells.append(
                "not reached"
                if c is None
                else f"{fmt(c['products'])} / {fmt(c['seconds'])} s (tol {c['tol']:.0e})"
            )
        lines.append(f"| {tool} | " + " | ".join(cells) + " |")
    return lines


def ratio_table(study: dict, targets, pairs, kind: str) -> list[str]:
    """Markdown rows: ``a / b`` of products and of seconds per target, for each (a, b)."""
    lines = [
        "| ratio | " + " | ".join(f"{kind} <= {t:g}: products, seconds" for t in targets) + " |",
        "|---|" + "---|" * len(targets),
    ]
    for a, b in pairs:
        cells = []
        for t in targets:
            x, y = study["chosen"][a][str(t)], study["chosen"][b][str(t)]
            if x is None or y is None:
                cells.append("-")
            else:
                cells.append(
                    f"{fmt(ratio(x['products'], y['products']))}x, "
                    f"{fmt(ratio(x['seconds'], y['seconds']))}x"
                )
        lines.append(f"| {a} / {b} | " + " | ".join(cells) + " |")
    return lines


EIGEN_PAIRS = [
    ("PyHessian", "sharp"),
    ("PyHessian", "sharp warm=subsample"),
    ("PyHessian", "sharp warm=gradient"),
    ("curvlinops+eigsh", "sharp"),
    ("curvlinops+eigsh", "sharp warm=subsample"),
    ("curvlinops+eigsh", "sharp warm=gradient"),
    ("sharp", "sharp warm=subsample"),
    ("sharp", "sharp warm=gradient"),
]
TRACE_PAIRS = [
    ("PyHessian", "sharp hutchpp"),
    ("PyHessian", "sharp gn-split"),
    ("sharp hutchpp", "sharp gn-split"),
]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = list(results)
    rows = [("eigen", "lambda_max, worst over seeds", EIGEN_TARGETS, EIGEN_TOOLS)]
    if any("trace" in results[n] for n in names):
        rows.append(("trace", "tr(H), rms over seeds", TRACE_TARGETS, TRACE_TOOLS))
    fig, axes = plt.subplots(
        len(rows), len(names), figsize=(4.2 * len(names), 3.6 * len(rows)), squeeze=False
    )
    style = {
        "sharp": ("tab:blue", "o"),
        "sharp warm=subsample": ("tab:orange", "s"),
        "sharp warm=gradient": ("tab:green", "^"),
        "PyHessian": ("tab:red", "+"),
        "curvlinops+eigsh": ("tab:purple", "D"),
        "sharp hutchpp": ("tab:blue", "x"),
        "sharp gn-split": ("tab:cyan", "o"),
    }
    for r, (key, label, targets, tools) in enumerate(rows):
        legend_done = False
        for c, name in enumerate(names):
            ax = axes[r][c]
            study = results[name].get(key)
            if study is None:
                ax.axis("off")
                ax.set_title(f"{name}: {key} not run", fontsize=9)
                continue
            for tool in tools:
                rs = study["runs"][tool]
                if not rs:
                    continue
                xs = [x["seconds"] for x in rs]
                ys = [max(x["error"], 1e-9) for x in rs]
                color, marker = style[tool]
                ax.plot(xs, ys, marker=marker, color=color, label=tool, lw=1, ms=4)
            for t in targets:
                ax.axhline(t, color="grey", lw=0.5, ls=":")
            ax.set_xscale("log")
            ax.set_yscale("log")
            plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
            ax.xaxis.set_minor_formatter(plain)
            ax.set_title(f"{name}: {label}", fontsize=9)
            ax.set_xlabel("CPU seconds" if not results[name]["cuda"] else "seconds (GPU, synced)")
            ax.set_ylabel("relative error")
            ax.grid(True, which="major", lw=0.3)
            if not legend_done:
                ax.legend(fontsize=7)
                legend_done = True
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(device: str) -> str:
    import torch

    versions = []
    for module in ("pyhessian", "curvlinops", "scipy", "sharpcli"):
        try:
            from importlib.metadata import version

            dist = {"pyhessian": "PyHessian", "curvlinops": "curvlinops-for-pytorch"}.get(
                module, module
            )
            versions.append(f"{module} {version(dist)}")
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            versions.append(f"{module} ?")
    return (
        f"{_dt.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores, "
        f"device {device}, torch threads {torch.get_num_threads()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, " + ", ".join(versions)
    )


def render(results: dict, env: str, args) -> None:
    """Print (and with ``--markdown`` write) the tables of ``results``."""
    lines = [f"Environment: {env}", ""]
    for name, info in results.items():
        ref = info["reference"]
        lines += [
            f"#### {name}: {info['label']}",
            "",
            f"P = {info['P']:,} parameters, N = {info['N']} samples (one batch); one Hessian "
            f"product (graph cached) {fmt(info['product_seconds'])} s. Reference (float64 "
            f"Lanczos, {ref['matvecs']} products): lambda_1 = {ref['lambda_1']:.8g}, "
            f"lambda_2 / lambda_1 = {ref['lambda_2'] / ref['lambda_1']:.3f}.",
            "",
        ]
        lines += cost_table(info["eigen"], EIGEN_TARGETS, EIGEN_TOOLS, "error")
        lines.append("")
        lines += ratio_table(info["eigen"], EIGEN_TARGETS, EIGEN_PAIRS, "error")
        lines.append("")
        if "trace" in info:
            tref = info["trace_reference"]
            lines += [
                f"Trace: reference {tref['trace']:.6g} +- {tref['stderr']:.2g} (gn-split, "
                f"{tref['matvecs']} products; relative standard error "
                f"{abs(tref['stderr'] / tref['trace']):.1e}, so errors down to about 3x that "
                "are measurable); error = root mean square over the probe seeds.",
                "",
            ]
            lines += cost_table(info["trace"], TRACE_TARGETS, TRACE_TOOLS, "error")
            lines.append("")
            lines += ratio_table(info["trace"], TRACE_TARGETS, TRACE_PAIRS, "error")
            lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, a few minutes")
    parser.add_argument(
        "--workloads", default=None, help=f"comma-separated subset of {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="extra timings of each chosen ladder step (default 0: the seeds' runs are the timings)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="start-vector / probe seeds per ladder step (default 3; 2 with --quick)",
    )
    parser.add_argument(
        "--trace-ref-tol",
        type=float,
        default=3e-3,
        help="relative standard error of the reference trace",
    )
    parser.add_argument("--no-trace", action="store_true", help="lambda_max only")
    parser.add_argument("--workdir", help="checkpoints go here (default: a temporary folder)")
    parser.add_argument("--markdown", help="also write the Markdown here")
    parser.add_argument("--json", help="write every run here")
    parser.add_argument("--plot", help="PNG of error vs seconds (default WORKDIR/tta.png)")
    parser.add_argument(
        "--from-json",
        nargs="+",
        metavar="JSON",
        help="run nothing: merge these --json outputs into one Markdown and plot",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        results, envs = {}, []
        for path in args.from_json:
            saved = json.loads(Path(path).read_text())
            envs.append(saved.pop("_environment", "?"))
            results.update(saved)
        render(results, " / ".join(dict.fromkeys(envs)), args)
        if args.plot:
            plot(results, Path(args.plot))
        return 0

    import torch

    torch.set_num_threads(1)
    repeats = args.repeats if args.repeats is not None else 0
    seeds = args.seeds if args.seeds is not None else (2 if args.quick else 3)
    names = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; accepted: {', '.join(WORKLOADS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sharp_tta_"))
    workdir.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.device)
    t_start = time.perf_counter()

    def log(text):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {text}", file=sys.stderr, flush=True)

    results: dict = {}
    for name in names:
        spec = WORKLOADS[name]
        log(f"{name}: training")
        ckpt = train(name, workdir, args.quick)
        w = Workload(ckpt, args.device)
        info = {
            "label": spec.get("quick_label", spec["label"]) if args.quick else spec["label"],
            "P": w.P,
            "N": w.N,
            "cuda": clock.cuda,
            "product_seconds": product_seconds(w, clock),
        }
        log(f"{name}: P={w.P} N={w.N}, one product {info['product_seconds']:.3f} s; reference")
        ref = eigen_reference(ckpt, args.device, clock)
        info["reference"] = ref
        log(
            f"{name}: lambda_1 {ref['lambda_1']:.8g}, lambda_2/lambda_1 "
            f"{ref['lambda_2'] / ref['lambda_1']:.3f} ({ref['matvecs']} float64 products)"
        )
        results[name] = info
        info["eigen"] = eigen_study(w, clock, ref, seeds, repeats, log)
        do_trace = spec["trace"] and not args.no_trace
        if args.quick:
            do_trace = do_trace and spec.get("quick_trace", True)
        if do_trace:
            from sharpcli.curvature import gn_split_trace

            start = clock()
            r = gn_split_trace(w.engine(), tol=args.trace_ref_tol, max_matvecs=20000, seed=99)
            info["trace_reference"] = {
                "trace": r.estimate,
                "stderr": r.stderr,
                "matvecs": r.matvecs,
                "seconds": clock() - start,
            }
            log(
                f"{name}: reference trace {r.estimate:.6g} +- {r.stderr:.2g} ({r.matvecs} products)"
            )
            info["trace"] = trace_study(w, clock, info["trace_reference"], seeds, repeats, log)

    env = environment(args.device)
    render(results, env, args)
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "_environment": env}, indent=1))
    plot_path = Path(args.plot) if args.plot else workdir / "tta.png"
    plot(results, plot_path)
    log(f"plot written to {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
