"""Curvature benchmark: ``sharp eigen`` / ``sharp trace`` against PyHessian 0.1 at its defaults.

Two models, trained briefly first with ``sharp train`` (public CLI) so the curvature is that
of a realistic, not random, network:

- ``mlp``: GELU MLP 64-256-256-10 (85,002 parameters) on ``blobs:n=2000,dim=64,classes=10``
  (1500 training samples), 5 epochs;
- ``cnn``: the zoo's small CNN (conv 16, conv 32, linear; 6,378 parameters) on
  ``images:n=2000`` (1500 training samples of 3x8x8), 3 epochs.

Part A, whole processes (what a user waits for). For each model and command, ``--repeats``
pairs of processes, alternating which goes first, on the same checkpoint, data and batch
size (the whole training split in one batch unless ``--batch-size``):

- ``python -m sharpcli eigen CKPT --top-k 1`` vs ``... --engine pyhessian`` (PyHessian 0.1
  ``hessian(model, criterion, data=(x, y), cuda=False).eigenvalues()`` at its defaults
  ``maxIter=100, tol=1e-3, top_n=1`` inside the same CLI, so process start-up is identical;
  the engine adds one native Hessian product to compute the residual PyHessian lacks);
- ``python -m sharpcli trace CKPT`` (Hutch++, 1% relative standard error) vs ``... --engine
  pyhessian --trace-tol 0.001 --trace-max-matvecs 100`` (PyHessian's ``trace()`` defaults
  ``maxIter=100, tol=1e-3``).

Reported: median wall time of each side, the median over pairs of the wall-time ratio, the
median command-body time (the report's ``timing.seconds``: everything after argument parsing,
so without interpreter and torch start-up) and its ratio, matvecs and results.

Part B, in one Python process (the project's standard for speed: a ratio against PyHessian
run in the same process, alternating):

- costs of one product relative to one gradient pass over the same data
  (``CurvatureEngine.loss_and_gradient``): Hessian product with the first-order graph cached
  (as inside every estimator after its first product) and rebuilt (``cache_bytes=0``), and
  H and G together (``hessian_and_ggn_matvec``) relative to H alone;
- native Lanczos (``lanczos(op, top_k=1)``, tol 1e-3) vs ``pyhessian.hessian(...).eigenvalues()``
  including each side's set-up, at the full batch (PyHessian's ``data=`` mode) and at batch
  256 (its ``dataloader=`` mode);
- accuracy of both against a reference: Lanczos in float64 (model and data converted) to
  relative residual 1e-10; relative error of lambda_max and the relative residual
  ``||H u - lambda u|| / |lambda|`` of each engine's eigenvector, evaluated in float64;
- matvecs to 1% relative standard error: Hutch++ (``hutchpp``) vs plain Hutchinson
  (``hutchinson``) over ``--trace-seeds`` probe seeds, and PyHessian's ``trace()`` at defaults:
  samples taken, its error against a reference trace (Hutch++ at 0.5% relative standard
  error) and the relative standard error of its own samples (``--trace-seeds`` seeds);
- PyHessian's power iteration on a 2-parameter problem with Hessian diag(1, -3): it returns
  the largest |eigenvalue| (-3), not the largest eigenvalue (1).

Usage (the figures of docs/benchmarks.md, "Curvature: sharp vs PyHessian")::

    OMP_NUM_THREADS=1 python benchmarks/bench_curvature.py --repeats 5 [--markdown out.md]
    OMP_NUM_THREADS=1 python benchmarks/bench_curvature.py --quick   # a smoke run
    OMP_NUM_THREADS=1 python benchmarks/bench_curvature.py --blocks-only --repeats 7

``--blocks-only`` prints only the cost of a block of 8 Hessian products done in one vmapped
reverse pass (the ``CurvatureEngine`` default, used by the trace estimators) against the same
8 products column by column.

Prints Markdown tables. Public tools only: the ``sharp`` CLI, ``sharpcli``'s public library
API and PyPI ``pyhessian`` 0.1.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

MODELS = {
    "mlp": {
        "train": [
            "--data",
            "blobs:n=2000,dim=64,classes=10",
            "--model",
            "mlp",
            "--width",
            "256",
            "--depth",
            "2",
            "--activation",
            "gelu",
            "--epochs",
            "5",
        ],
        "label": "GELU MLP 64-256-256-10, blobs n=2000 dim=64 (1500 train samples)",
    },
    "cnn": {
        "train": ["--data", "images:n=2000", "--model", "cnn", "--epochs", "3"],
        "label": "small CNN (conv16-conv32-linear, ReLU), images n=2000 3x8x8 (1500 train samples)",
    },
}

TRAIN_SAMPLES = 1500  # both datasets: n=2000 with the default test fraction 0.25

# Targets (benchmark figures, not timed tests) from the issue.
TARGET_MATVEC_OVER_GRAD = 2.2
TARGET_EIGEN_SPEEDUP = 10.0
TARGET_RESIDUAL = 1e-3
TARGET_HUTCHPP_FRACTION = 0.5
TARGET_JOINT_OVER_H = 1.6


def median(values):
    """Median of a non-empty list of numbers."""
    return statistics.median(values)


def fmt(x, digits=3):
    """Compact number formatting for the tables."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def child_env(threads: int) -> dict:
    """Environment of every child process: fixed thread counts, no colour, no progress bars."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), NO_COLOR="1", TERM="dumb"
    )
    return env


def sharp(args: list[str]) -> list[str]:
    """A ``sharp`` command line through the current interpreter."""
    return [sys.executable, "-m", "sharpcli", *args]


# --------------------------------------------------------------------------- checkpoints
def train_checkpoints(models, workdir: Path, threads: int) -> dict:
    """Train each model with ``sharp train`` (seed 0) unless its checkpoint exists; return paths."""
    paths = {}
    for name in models:
        ckpt = workdir / f"{name}.safetensors"
        if not ckpt.exists():
            cmd = sharp(
                [
                    "train",
                    *MODELS[name]["train"],
                    "--seed",
                    "0",
                    "--out",
                    str(ckpt),
                    "-q",
                    "--json",
                    str(workdir / f"{name}_train.json"),
                ]
            )
            subprocess.run(cmd, check=True, env=child_env(threads), stdout=subprocess.DEVNULL)
        paths[name] = ckpt
    return paths


# --------------------------------------------------------------------------- part A
def process_commands(ckpt: Path, command: str, batch_size: int, out: Path) -> dict:
    """The two command lines (``sharp`` native defaults, PyHessian defaults) of one comparison."""
    common = [command, str(ckpt), "--batch-size", str(batch_size), "-q"]
    if command == "eigen":
        native = common + ["--top-k", "1"]
        baseline = common + ["--top-k", "1", "--engine", "pyhessian"]
    else:
        common[0] = "trace"
        native = common + (["--estimator", "gn-split"] if command == "trace-gn-split" else [])
        baseline = common + [
            "--engine",
            "pyhessian",
            "--trace-tol",
            "0.001",
            "--trace-max-matvecs",
            "100",
        ]
    return {
        "sharp": native + ["--json", str(out / "sharp.json")],
        "pyhessian": baseline + ["--json", str(out / "pyhessian.json")],
    }


def run_process(argv: list[str], json_path: Path, threads: int) -> dict:
    """Run one ``sharp`` process; return wall seconds, body seconds and its results."""
    start = time.perf_counter()
    proc = subprocess.run(
        sharp(argv),
        env=child_env(threads),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"sharp {' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-800:]}"
        )
    report = json.loads(json_path.read_text())
    return {"wall": wall, "body": report["timing"]["seconds"], "results": report["results"]}


def summary_of(command: str, results: dict) -> dict:
    """Matvecs and the headline number of one report."""
    if command == "eigen":
        lam = results["eigenvalues"][0]
        res = results["residuals"][0]
        return {
            "matvecs": results["matvecs"],
            "value": lam,
            "detail": f"lambda_max {lam:.5g}, rel. residual {fmt(res / abs(lam))}",
        }
    t = results["trace"]
    rel = None if t["stderr"] is None else t["stderr"] / abs(t["estimate"])
    return {
        "matvecs": t["matvecs"],
        "value": t["estimate"],
        "detail": f"trace {t['estimate']:.4g}, rel. stderr {fmt(rel)}",
    }


def part_a(
    ckpts: dict, repeats: int, batch_size: int, threads: int, workdir: Path
) -> tuple[list, list]:
    """Alternating whole-process runs; returns table rows and the exact command lines used."""
    rows, commands = [], []
    for name, ckpt in ckpts.items():
        for command in ("eigen", "trace", "trace-gn-split"):
            out = workdir / f"{name}_{command}"
            out.mkdir(exist_ok=True)
            argvs = process_commands(ckpt, command, batch_size, out)
            commands += [("sharp " + " ".join(argvs[k][:-2])) for k in ("sharp", "pyhessian")]
            runs = {"sharp": [], "pyhessian": []}
            for r in range(repeats):
                order = ("sharp", "pyhessian") if r % 2 == 0 else ("pyhessian", "sharp")
                for side in order:
                    runs[side].append(run_process(argvs[side], out / f"{side}.json", threads))
            wall_ratio = median(
                [p["wall"] / s["wall"] for s, p in zip(runs["sharp"], runs["pyhessian"])]
            )
            body_ratio = median(
                [p["body"] / s["body"] for s, p in zip(runs["sharp"], runs["pyhessian"])]
            )
            last = {k: summary_of(command, v[-1]["results"]) for k, v in runs.items()}
            rows.append(
                {
                    "model": name,
                    "command": command,
                    "sharp_wall": median([r["wall"] for r in runs["sharp"]]),
                    "py_wall": median([r["wall"] for r in runs["pyhessian"]]),
                    "wall_ratio": wall_ratio,
                    "sharp_body": median([r["body"] for r in runs["sharp"]]),
                    "py_body": median([r["body"] for r in runs["pyhessian"]]),
                    "body_ratio": body_ratio,
                    "sharp": last["sharp"],
                    "pyhessian": last["pyhessian"],
                }
            )
    return rows, commands


def table_a(rows) -> str:
    """Markdown table of the whole-process comparison."""
    lines = [
        "| model | command | sharp wall s | PyHessian wall s | wall ratio | sharp body s | PyHessian body s "
        "| body ratio | sharp matvecs | PyHessian matvecs | sharp result | PyHessian result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['command']} | {fmt(r['sharp_wall'])} | {fmt(r['py_wall'])} | "
            f"{r['wall_ratio']:.2f}x | {fmt(r['sharp_body'])} | {fmt(r['py_body'])} | {r['body_ratio']:.2f}x | "
            f"{r['sharp']['matvecs']} | {r['pyhessian']['matvecs']} | {r['sharp']['detail']} | "
            f"{r['pyhessian']['detail']} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- part B helpers
def load(ckpt: Path, batch_size: int, dtype: str = "float32"):
    """A sharpcli Session (model in eval mode, training split) through the public library."""
    from sharpcli.session import build_session

    return build_session(str(ckpt), batch_size=batch_size, dtype=dtype)


def timed(fn):
    """``(seconds, fn())``."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def matvec_costs(session, repeats: int) -> dict:
    """Median seconds of gradient, H (cached / rebuilt graph), H+G (cached / rebuilt), alternating."""
    import torch

    from sharpcli.curvature import CurvatureEngine

    data, scope = session.analysis_data(), session.scope(None)
    warm = CurvatureEngine(session.model, data, scope)
    cold = CurvatureEngine(session.model, data, scope, cache_bytes=0)
    v = torch.randn(scope.numel, generator=torch.Generator().manual_seed(0))
    hess_warm, hess_cold = warm.hessian(), cold.hessian()
    jobs = {
        "grad": lambda: warm.loss_and_gradient(),
        "H": lambda: hess_warm.matvec(v),
        "H_cold": lambda: hess_cold.matvec(v),
        "HG": lambda: warm.hessian_and_ggn_matvec(v),
        "HG_cold": lambda: cold.hessian_and_ggn_matvec(v),
    }
    for fn in jobs.values():  # warm-up: lazy imports, allocator, the cache
        fn()
    times = {k: [] for k in jobs}
    rounds = max(5, 3 * repeats)
    names = list(jobs)
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            times[k].append(timed(jobs[k])[0])
    med = {k: median(t) for k, t in times.items()}
    ratio = {  # medians of per-round ratios (each round's products ran back to back)
        "H/grad": median([h / g for h, g in zip(times["H"], times["grad"])]),
        "H_cold/grad": median([h / g for h, g in zip(times["H_cold"], times["grad"])]),
        "HG/H": median([a / b for a, b in zip(times["HG"], times["H"])]),
        "HG_cold/H_cold": median([a / b for a, b in zip(times["HG_cold"], times["H_cold"])]),
    }
    return {"seconds": med, "ratio": ratio, "numel": scope.numel, "batches": data.num_batches}


def block_costs(session, repeats: int, k: int = 8) -> dict:
    """Seconds for a block of ``k`` Hessian products (cached graph): one vmapped reverse pass
    (``CurvatureEngine`` default, ``vectorize=32``) vs column by column (``vectorize=1``), alternating.

    The trace estimators multiply blocks of 8 probes, so this is their per-product cost.
    """
    import torch

    from sharpcli.curvature import CurvatureEngine

    data, scope = session.analysis_data(), session.scope(None)
    vmapped = CurvatureEngine(session.model, data, scope)
    columns = CurvatureEngine(session.model, data, scope, vectorize=1)
    V = torch.randn(scope.numel, k, generator=torch.Generator().manual_seed(0))
    jobs = {
        "vmapped": lambda: vmapped.hessian_matmat(V),
        "columns": lambda: columns.hessian_matmat(V),
    }
    for fn in jobs.values():
        fn()
    times = {name: [] for name in jobs}
    for r in range(max(5, repeats)):
        for name in ("vmapped", "columns") if r % 2 == 0 else ("columns", "vmapped"):
            times[name].append(timed(jobs[name])[0])
    return {
        "k": k,
        "vmapped": median(times["vmapped"]),
        "columns": median(times["columns"]),
        "ratio": median([a / b for a, b in zip(times["vmapped"], times["columns"])]),
    }


def blocks_table(ckpts: dict, repeats: int, batch_size: int) -> str:
    """Markdown table of :func:`block_costs` for each model."""
    lines = [
        "#### Blocks of 8 Hessian products (cached graph): vmapped vs column by column\n",
        "| model | batch | vmapped block s | column-by-column s | vmapped / columns |",
        "|---|---|---|---|---|",
    ]
    for name, ckpt in ckpts.items():
        b = block_costs(load(ckpt, batch_size), repeats)
        lines.append(
            f"| {name} | {batch_size} | {fmt(b['vmapped'])} | {fmt(b['columns'])} | {b['ratio']:.2f}x |"
        )
    return "\n".join(lines)


class _PyHessianRun:
    """PyHessian 0.1 on a session's model and data at its defaults (``cuda=False``)."""

    def __init__(self, session):
        import torch

        self.torch = torch
        self.session = session
        self.criterion = torch.nn.CrossEntropyLoss()

    def hessian(self):
        """``pyhessian.hessian`` in ``data=`` mode (one batch) or ``dataloader=`` mode (batches)."""
        from pyhessian import hessian

        s = self.session
        # PyHessian's data= mode calls loss.backward(create_graph=True) without zeroing .grad first,
        # so leftover gradients would be added to its gradsH: clear them, as a careful user must.
        s.model.zero_grad(set_to_none=True)
        if s.batch_size >= s.num_samples:
            return hessian(s.model, self.criterion, data=(s.x, s.y), cuda=False)
        loader = [
            (s.x[i : i + s.batch_size], s.y[i : i + s.batch_size])
            for i in range(0, s.num_samples, s.batch_size)
        ]
        return hessian(s.model, self.criterion, dataloader=loader, cuda=False)

    def eigenvalues(self, seed: int):
        """Default ``eigenvalues()``: returns (lambda, eigenvector as a list of tensors, products used).

        Products are counted by wrapping PyHessian's product function (one call per power step).
        """
        import importlib

        module = importlib.import_module("pyhessian.hessian")
        original = module.hessian_vector_product
        count = [0]

        def counting(*a, **k):
            count[0] += 1
            return original(*a, **k)

        self.torch.manual_seed(seed)
        h = self.hessian()
        loader_product = h.dataloader_hv_product

        def counting_loader(v):
            count[0] += 1
            return loader_product(v)

        h.dataloader_hv_product = counting_loader
        module.hessian_vector_product = counting
        try:
            values, vectors = h.eigenvalues()
        finally:
            module.hessian_vector_product = original
        vec = [t.detach().clone() for t in vectors[0]]
        self.session.model.zero_grad(
            set_to_none=True
        )  # break PyHessian's graph-carrying .grad cycle
        return values[0], vec, count[0]

    def trace(self, seed: int):
        """Default ``trace()`` (maxIter=100, tol=1e-3): its list of samples v^T H v."""
        self.torch.manual_seed(seed)
        h = self.hessian()
        samples = h.trace()
        self.session.model.zero_grad(set_to_none=True)
        return [float(x) for x in samples]


def eigen_speed(session, repeats: int) -> dict:
    """Native Lanczos (set-up included) vs PyHessian eigenvalues() in this process, alternating."""
    from sharpcli.curvature import CurvatureEngine, lanczos

    py = _PyHessianRun(session)
    scope = session.scope(None)

    def native(seed):
        engine = CurvatureEngine(session.model, session.analysis_data(), scope)
        return lanczos(engine.hessian(), top_k=1, tol=1e-3, seed=seed, return_eigenvectors=True)

    native(0)  # warm-up (lazy imports inside torch.autograd)
    py.eigenvalues(0)
    nat, pyh, pairs = [], [], []
    for r in range(repeats):
        first_native = r % 2 == 0
        for side in ("n", "p") if first_native else ("p", "n"):
            if side == "n":
                tn, res_n = timed(lambda: native(r))
                nat.append((tn, res_n))
            else:
                tp, res_p = timed(lambda: py.eigenvalues(r))
                pyh.append((tp, res_p))
        pairs.append(pyh[-1][0] / nat[-1][0])
    return {
        "native_s": median([t for t, _ in nat]),
        "pyhessian_s": median([t for t, _ in pyh]),
        "speedup": median(pairs),
        "native_matvecs": [res.matvecs for _, res in nat],
        "native_results": [res for _, res in nat],
        "pyhessian_results": [res for _, res in pyh],
    }


def as_float64_session(ckpt: Path):
    """The same model and data in float64, one batch, for reference computations."""
    return load(ckpt, TRAIN_SAMPLES, dtype="float64")


def eigen_accuracy(ckpt: Path, speed: dict) -> dict:
    """Reference lambda_max (float64 Lanczos, tol 1e-10) and each engine's error and residual in float64."""
    import torch

    from sharpcli.curvature import CurvatureEngine, lanczos

    s64 = as_float64_session(ckpt)
    scope = s64.scope(None)
    op = CurvatureEngine(s64.model, s64.analysis_data(), scope).hessian()
    ref = lanczos(op, top_k=1, which="both", tol=1e-10, max_matvecs=400, seed=123)
    lam_ref, lam_min = ref.eigenvalues[0], ref.eigenvalues[-1]

    def rel_residual(lam, u):
        u = u.to(torch.float64)
        u = u / torch.linalg.vector_norm(u)
        return float(torch.linalg.vector_norm(op.matvec(u) - lam * u)) / abs(lam)

    native = [
        (r.eigenvalues[0], rel_residual(r.eigenvalues[0], r.eigenvectors[:, 0]))
        for r in speed["native_results"]
    ]
    pyh = [
        (lam, rel_residual(lam, scope.flatten(vec))) for lam, vec, _ in speed["pyhessian_results"]
    ]
    return {
        "lambda_ref": lam_ref,
        "lambda_min_ref": lam_min,
        "ref_matvecs": ref.matvecs,
        "ref_residual": ref.residuals[0] / abs(lam_ref),
        "ref_converged": ref.converged,
        "native_relerr": [abs(l - lam_ref) / abs(lam_ref) for l, _ in native],
        "native_resid": [r for _, r in native],
        "py_relerr": [abs(l - lam_ref) / abs(lam_ref) for l, _ in pyh],
        "py_signed": [(l - lam_ref) / abs(lam_ref) for l, _ in pyh],
        "py_resid": [r for _, r in pyh],
    }


def trace_study(session, repeats: int, reference_tol: float) -> dict:
    """Matvecs to 1% relative stderr (Hutch++ vs Hutchinson) and PyHessian trace() at defaults."""
    from sharpcli.curvature import (
        CurvatureEngine,
        exact_ggn_trace,
        gn_split_trace,
        hutchinson,
        hutchpp,
    )

    scope = session.scope(None)
    engine = CurvatureEngine(session.model, session.analysis_data(), scope)
    H = engine.hessian()
    ref_t, ref = timed(lambda: hutchpp(H, tol=reference_tol, max_matvecs=20000, seed=10_000))
    runs = {"hutchpp": ([], []), "hutchinson": ([], []), "gn-split": ([], [])}
    estimators = {
        "hutchpp": lambda seed: hutchpp(H, tol=1e-2, max_matvecs=20000, seed=seed),
        "hutchinson": lambda seed: hutchinson(H, tol=1e-2, max_matvecs=20000, seed=seed),
        # includes the exact Gauss-Newton trace (one backward pass per class and batch)
        "gn-split": lambda seed: gn_split_trace(engine, tol=1e-2, max_matvecs=20000, seed=seed),
    }
    names = list(estimators)
    for seed in range(repeats):
        for name in names[seed % 3 :] + names[: seed % 3]:  # rotate the order
            t, res = timed(lambda: estimators[name](seed))
            runs[name][0].append(res)
            runs[name][1].append(t)
    (pp, pp_s), (hu, hu_s), (gs, gs_s) = runs["hutchpp"], runs["hutchinson"], runs["gn-split"]
    ggn_s, ggn = timed(lambda: exact_ggn_trace(session.model, session.analysis_data(), scope))
    py = _PyHessianRun(session)
    py_runs = []
    for seed in range(repeats):
        t, samples = timed(lambda: py.trace(seed))
        n = len(samples)
        mean = sum(samples) / n
        sd = statistics.stdev(samples) if n > 1 else float("nan")
        py_runs.append(
            {
                "n": n,
                "estimate": mean,
                "seconds": t,
                "error": (mean - ref.estimate) / abs(ref.estimate),
                "rel_stderr": sd / n**0.5 / abs(mean),
            }
        )
    return {
        "ref": ref,
        "ref_seconds": ref_t,
        "hutchpp": pp,
        "hutchinson": hu,
        "hutchpp_s": pp_s,
        "hutchinson_s": hu_s,
        "gn_split": gs,
        "gn_split_s": gs_s,
        "ggn_exact": ggn,
        "ggn_exact_s": ggn_s,
        "fraction": median([a.matvecs / b.matvecs for a, b in zip(pp, hu)]),
        "gn_split_fraction": median([a.matvecs / b.matvecs for a, b in zip(gs, hu)]),
        "gn_split_time_fraction": median([a / b for a, b in zip(gs_s, hu_s)]),
        "pyhessian": py_runs,
    }


def unsketched_variance(runs) -> str:
    """Median per-probe variance of the runs that stayed plain Hutchinson (no sketch), as text."""
    plain = [r.stderr**2 * r.samples for r in runs if r.sketch_size == 0]
    return fmt(median(plain)) if plain else "(sketched: Hutch++ on N)"


def magnitude_demo() -> dict:
    """PyHessian power iteration on H = diag(1, -3): it answers -3 (largest |lambda|), not 1."""
    import torch
    from pyhessian import hessian

    from sharpcli.curvature import MatrixOperator, lanczos

    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = torch.eye(
        2
    )  # z = x W^T: z_ij = W_ji; loss = 0.5 * sum_i c_i W_ii^2 + const -> H = diag(c) on the diagonal
    c = torch.tensor([1.0, -3.0])

    def criterion(z, _y):
        return 0.5 * (c * torch.diagonal(z) ** 2).sum()

    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    values, _ = hessian(model, criterion, data=(x, torch.zeros(2)), cuda=False).eigenvalues()
    dense = torch.diag(
        torch.tensor([1.0, 0.0, 0.0, -3.0], dtype=torch.float64)
    )  # W flattened row-major
    native = lanczos(MatrixOperator(dense), top_k=1)
    return {"pyhessian": values[0], "native": native.eigenvalues[0]}


# --------------------------------------------------------------------------- part B tables
def part_b(ckpts: dict, repeats: int, batch_size: int, quick: bool, trace_seeds: int) -> str:
    """All in-process measurements as Markdown tables, ending with the targets table."""
    out = []
    cost_rows, eig_rows, acc_rows, tr_rows, _py_tr_rows = [], [], [], [], []
    batch_sizes = [batch_size] if quick or batch_size == 256 else [batch_size, 256]
    for name, ckpt in ckpts.items():
        for bs in batch_sizes:
            session = load(ckpt, bs)
            c = matvec_costs(session, repeats)
            cost_rows.append((name, bs, c))
            sp = eigen_speed(session, repeats)
            eig_rows.append((name, bs, sp))
            if bs == batch_size:
                acc_rows.append((name, eigen_accuracy(ckpt, sp)))
        session = load(ckpt, batch_size)
        tr_rows.append((name, trace_study(session, trace_seeds, reference_tol=5e-3)))
        del session
    demo = magnitude_demo()

    out.append("#### Product costs (in-process, medians of alternating rounds)\n")
    out.append(
        "| model | batch | P | batches | gradient ms | H ms (cached graph) | H ms (rebuilt) "
        "| H / gradient | H rebuilt / gradient | H+G ms | H+G / H | H+G rebuilt / H rebuilt |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, bs, c in cost_rows:
        s, r = c["seconds"], c["ratio"]
        out.append(
            f"| {name} | {bs} | {c['numel']} | {c['batches']} | {s['grad'] * 1e3:.1f} | {s['H'] * 1e3:.1f} | "
            f"{s['H_cold'] * 1e3:.1f} | {r['H/grad']:.2f}x | {r['H_cold/grad']:.2f}x | {s['HG'] * 1e3:.1f} | "
            f"{r['HG/H']:.2f}x | {r['HG_cold/H_cold']:.2f}x |"
        )
    out.append("\n#### Top eigenvalue: native Lanczos vs PyHessian eigenvalues() in one process\n")
    out.append(
        "| model | batch | PyHessian mode | native s | PyHessian s | speed-up (median of pairs) "
        "| native matvecs (median) | PyHessian products (median) |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for name, bs, sp in eig_rows:
        mode = "data=(x, y)" if bs >= TRAIN_SAMPLES else "dataloader"
        out.append(
            f"| {name} | {bs} | {mode} | {fmt(sp['native_s'])} | {fmt(sp['pyhessian_s'])} | "
            f"{sp['speedup']:.2f}x | {median(sp['native_matvecs'])} | "
            f"{median([n for _, _, n in sp['pyhessian_results']])} |"
        )
    out.append(
        "\n#### Accuracy of lambda_max against a float64 reference (Lanczos, residual <= 1e-10 |lambda|)\n"
    )
    out.append(
        "| model | lambda_max (ref) | lambda_min (ref) | native rel. error (median, max) "
        "| native rel. residual (max) | PyHessian rel. error (median, max) | PyHessian signed error range "
        "| PyHessian rel. residual (median, max) |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for name, a in acc_rows:
        out.append(
            f"| {name} | {a['lambda_ref']:.7g} | {a['lambda_min_ref']:.4g} | {fmt(median(a['native_relerr']))}, "
            f"{fmt(max(a['native_relerr']))} | {fmt(max(a['native_resid']))} | {fmt(median(a['py_relerr']))}, "
            f"{fmt(max(a['py_relerr']))} | {fmt(min(a['py_signed']))} .. {fmt(max(a['py_signed']))} | "
            f"{fmt(median(a['py_resid']))}, {fmt(max(a['py_resid']))} |"
        )
    out.append(
        f"\n#### Trace: matvecs to 1% relative standard error (probe seeds 0..{trace_seeds - 1})\n"
    )
    out.append(
        "| model | reference trace (Hutch++, rel. stderr) | Hutch++ matvecs (median, range) "
        "| Hutchinson matvecs (median, range) | Hutch++ / Hutchinson (median of seeds) "
        "| Hutch++ sketch | per-probe variance: Hutchinson / Hutch++ residual | Hutch++ s | Hutchinson s |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for name, t in tr_rows:
        pp = [r.matvecs for r in t["hutchpp"]]
        hu = [r.matvecs for r in t["hutchinson"]]
        ref = t["ref"]
        out.append(
            f"| {name} | {ref.estimate:.5g} ({fmt(ref.stderr / abs(ref.estimate))}, {ref.matvecs} matvecs) | "
            f"{median(pp)} ({min(pp)}-{max(pp)}) | {median(hu)} ({min(hu)}-{max(hu)}) | {t['fraction']:.2f} | "
            f"{sorted({r.sketch_size for r in t['hutchpp']})} | "
            f"{fmt(median([r.stderr**2 * r.samples for r in t['hutchinson']]))} / "
            f"{fmt(median([r.stderr**2 * r.samples for r in t['hutchpp']]))} | {fmt(median(t['hutchpp_s']))} | "
            f"{fmt(median(t['hutchinson_s']))} |"
        )
    out.append(
        "\n#### Trace: gn-split (exact tr(G) + Hutch++ on tr(N)) against plain Hutchinson, same seeds\n"
    )
    out.append(
        "| model | exact tr(G) (its s) | gn-split estimate (median) | gn-split matvecs (median, range) "
        "| gn-split / Hutchinson matvecs | gn-split s (incl. exact tr(G)) | gn-split / Hutchinson time "
        "| per-probe variance: Hutchinson on H / Hutchinson on N |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for name, t in tr_rows:
        gs = t["gn_split"]
        mv = [r.matvecs for r in gs]
        out.append(
            f"| {name} | {t['ggn_exact'].estimate:.5g} ({fmt(t['ggn_exact_s'])} s) | "
            f"{median([r.estimate for r in gs]):.5g} | {median(mv)} ({min(mv)}-{max(mv)}) | "
            f"{t['gn_split_fraction']:.2f} | {fmt(median(t['gn_split_s']))} | {t['gn_split_time_fraction']:.2f} | "
            f"{fmt(median([r.stderr**2 * r.samples for r in t['hutchinson']]))} / "
            f"{unsketched_variance(gs)} |"
        )
    out.append("\n#### PyHessian trace() at defaults (maxIter=100, tol=1e-3), per seed\n")
    out.append(
        "| model | seed | samples taken | estimate | error vs reference | rel. stderr of its samples | s |"
    )
    out.append("|---|---|---|---|---|---|---|")
    for name, t in tr_rows:
        for seed, r in enumerate(t["pyhessian"]):
            out.append(
                f"| {name} | {seed} | {r['n']} | {r['estimate']:.5g} | {r['error'] * 100:+.2f}% | "
                f"{r['rel_stderr'] * 100:.2f}% | {fmt(r['seconds'])} |"
            )
    out.append(
        f"\nPyHessian power iteration on H = diag(1, -3) (2 trainable directions, 2 null): returns "
        f"{demo['pyhessian']:.6g}; native Lanczos `which=largest` returns {demo['native']:.6g}.\n"
    )

    # targets
    mlp_cost = (
        next(c for n, bs, c in cost_rows if n == "mlp" and bs == batch_size)
        if "mlp" in ckpts
        else None
    )
    rows = []
    if mlp_cost:
        worst = max(c["ratio"]["H/grad"] for _, bs, c in cost_rows if bs == batch_size)
        rows.append(
            (
                "one curvature matvec <= 2.2x a gradient pass",
                f"H (cached graph) / gradient, worst model at batch {batch_size}: {worst:.2f}x",
                worst <= TARGET_MATVEC_OVER_GRAD,
            )
        )
        joint = max(c["ratio"]["HG/H"] for _, bs, c in cost_rows if bs == batch_size)
        rows.append(
            (
                "H and G in one pass <= 1.6x H alone",
                f"worst model at batch {batch_size}: {joint:.2f}x",
                joint <= TARGET_JOINT_OVER_H,
            )
        )
    best = min(sp["speedup"] for _, bs, sp in eig_rows if bs == batch_size)
    rows.append(
        (
            "`sharp eigen --top-k 1` >= 10x faster than PyHessian (in-process)",
            f"slowest model at batch {batch_size}: {best:.2f}x",
            best >= TARGET_EIGEN_SPEEDUP,
        )
    )
    worst_res = max(max(a["native_resid"]) for _, a in acc_rows)
    more_accurate = all(max(a["native_relerr"]) < median(a["py_relerr"]) for _, a in acc_rows)
    rows.append(
        (
            "... and more accurate, residual-certified to 1e-3",
            f"native rel. residual <= {fmt(worst_res)}; native error below PyHessian's median error on "
            f"{'every' if more_accurate else 'not every'} model",
            worst_res <= TARGET_RESIDUAL and more_accurate,
        )
    )
    if "mlp" in ckpts:
        t = next(t for n, t in tr_rows if n == "mlp")
        rows.append(
            (
                "trace to 1% with <= half the matvecs of Hutchinson (MLP)",
                f"Hutch++/Hutchinson = {t['fraction']:.2f}; gn-split/Hutchinson = {t['gn_split_fraction']:.2f} "
                f"(time {t['gn_split_time_fraction']:.2f})",
                min(t["fraction"], t["gn_split_fraction"]) <= TARGET_HUTCHPP_FRACTION,
            )
        )
    out.append("#### Targets (in-process figures)\n")
    out.append("| target | measured | met |")
    out.append("|---|---|---|")
    for target, measured, met in rows:
        out.append(f"| {target} | {measured} | {'met' if met else 'NOT met'} |")
    return "\n".join(out)


def environment(threads: int) -> str:
    """One line: date, CPU, usable cores, threads, Python, torch, pyhessian, sharpcli versions."""
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    import importlib.metadata as md

    return (
        f"{_dt.date.today().isoformat()}, {platform.processor() or platform.machine()}, "
        f"{cores} usable core(s) (os.cpu_count {os.cpu_count()}), shared with other jobs, "
        f"{threads} thread(s) (OMP_NUM_THREADS={threads}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, pyhessian {md.version('pyhessian')}, sharpcli {md.version('sharpcli')}"
    )


def main(argv=None) -> int:
    """Parse options, train the checkpoints, run parts A and B, print (and save) the Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=5, help="process pairs / in-process rounds / probe seeds"
    )
    parser.add_argument("--trace-seeds", type=int, default=3, help="probe seeds of the trace study")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: MLP only, 1 repeat, full batch only"
    )
    parser.add_argument("--models", default="mlp,cnn", help="comma list of mlp, cnn")
    parser.add_argument(
        "--batch-size", type=int, default=TRAIN_SAMPLES, help="analysis batch size (both sides)"
    )
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument(
        "--workdir", help="where checkpoints and reports go (default: a temporary folder)"
    )
    parser.add_argument("--skip-processes", action="store_true", help="only the in-process part B")
    parser.add_argument(
        "--blocks-only",
        action="store_true",
        help="only the table of vmapped vs column-by-column blocks of products",
    )
    parser.add_argument("--markdown", help="also write the Markdown output to this file")
    args = parser.parse_args(argv)
    models = ["mlp"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    repeats = 1 if args.quick else args.repeats
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        ckpts = train_checkpoints(models, workdir, args.threads)
        parts = [
            f"Machine: {environment(args.threads)}.\n",
            "Command: `OMP_NUM_THREADS=%d python benchmarks/bench_curvature.py %s`\n"
            % (args.threads, " ".join(argv if argv is not None else sys.argv[1:])),
        ]
        for name in models:
            parts.append(
                f"- `{name}`: {MODELS[name]['label']}; trained by "
                f"`sharp train {' '.join(MODELS[name]['train'])} --seed 0`"
            )
        parts.append("")
        if args.blocks_only:
            parts.append(blocks_table(ckpts, repeats, args.batch_size))
        elif not args.skip_processes:
            rows, commands = part_a(ckpts, repeats, args.batch_size, args.threads, workdir)
            parts.append(f"#### Whole processes, alternating pairs ({repeats} per row), medians\n")
            parts.append(table_a(rows))
            parts.append("\nCommand lines (`--json PATH` added):\n")
            parts += [f"    {c}" for c in commands]
            parts.append("")
        if not args.blocks_only:
            parts.append(
                part_b(
                    ckpts,
                    repeats,
                    args.batch_size,
                    args.quick,
                    1 if args.quick else args.trace_seeds,
                )
            )
        text = "\n".join(parts)
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
