"""GPT-2 medium and large shapes under a memory budget: peak RSS from outside, CPU seconds.

Writes GPT-2-shaped ``--model-factory`` checkpoints built from their published configs (never
downloaded; :func:`scale_models.gpt2`): medium (d 1024, 24 layers, 16 heads, 354,823,168
parameters) and large (d 1280, 36 layers, 20 heads, 774,030,080), vocabulary 50257, tied
head, 4 x 64 tokens of seeded random data. Then runs, each as a child whose peak resident set
and CPU seconds are read with ``os.wait4`` (the child's own rusage, from outside the process):

- ``sharp eigen --top-k 1 --eig-max-matvecs N --max-memory BUDGET``
- ``sharp trace --estimator hutchinson --trace-tol 0.05 --trace-max-matvecs N
  --max-memory BUDGET``

and prints one table row per run: CPU seconds (user + system), peak RSS, products, value,
how the products were taken (exact or finite differences with their error bound) and where
the Krylov basis was kept (the report's memory choices).

Usage: ``python benchmarks/bench_large.py [--models medium,large] [--commands eigen,trace]
[--products 20] [--budget 20G] [--workdir DIR] [--lock /tmp/bigmem.lock] [--timeout S]``.
``--lock`` takes that file's lock (``flock``) around each child only, so that other large runs
on a shared machine take turns between them; ``--timeout`` kills a child after S seconds
(exit 124), counted inside the lock. A GPT-2-large product takes about a minute of one
core: measure with ``--products 2`` first.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_scale import GPT2_MEDIUM, measure, write_case  # noqa: E402

GPT2_LARGE = {"vocab": 50257, "positions": 1024, "d": 1280, "layers": 36, "heads": 20}
GPT2_MINI = {"vocab": 50257, "positions": 1024, "d": 384, "layers": 6, "heads": 6}  # smoke test
SHAPES = {"mini": GPT2_MINI, "medium": GPT2_MEDIUM, "large": GPT2_LARGE}


def command(kind: str, ckpt: Path, data: Path, products: int, budget: str) -> list[str]:
    """The sharp command line of one run (one thread, JSON report on stdout)."""
    common = [
        sys.executable, "-m", "sharpcli", kind, str(ckpt), "--data", str(data),
        "--batch-size", "64", "--threads", "1", "--quiet", "--json", "-",
        "--max-memory", budget,
    ]  # fmt: skip
    if kind == "eigen":
        return [*common, "--top-k", "1", "--eig-max-matvecs", str(products)]
    return [
        *common, "--estimator", "hutchinson", "--trace-tol", "0.05",
        "--trace-max-matvecs", str(products),
    ]  # fmt: skip


def describe(report: dict) -> tuple[str, str, str]:
    """``(value, products, where)`` of a report: the estimate, how the products were taken,
    and the memory plan's choices about the basis and the heap."""
    results = report.get("results", {})
    if "eigenvalues" in results:
        value = f"lambda_1 = {results['eigenvalues'][0]:.6g}"
    else:
        trace = results.get("trace", {})
        value = f"tr = {trace.get('estimate', float('nan')):.6g} +- {trace.get('stderr', 0):.2g}"
    hvp = results.get("hvp")
    how = (
        "exact (double backward)"
        if hvp is None
        else f"finite differences{' (chosen by the budget)' if hvp.get('by_budget') else ''}, "
        f"|D v - H v| <= {hvp['error_bound']:.3g} |v|"
    )
    choices = report.get("timing", {}).get("memory", {}).get("choices", [])
    where = "; ".join(c for c in choices if "basis" in c or "heap" in c or "freed" in c)
    return value, how, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="medium,large")
    parser.add_argument("--commands", default="eigen,trace")
    parser.add_argument("--products", type=int, default=20)
    parser.add_argument("--budget", default="20G")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--lock", default=None, help="flock this file around each child")
    parser.add_argument("--save", default=None, help="write each run's JSON report here")
    parser.add_argument(
        "--timeout", type=int, default=None, help="kill a child after this many seconds"
    )
    args = parser.parse_args()

    import os

    import torch

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sharp-large-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    rows = []
    for name in args.models.split(","):
        shape = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, shape["vocab"], (4, 65), generator=g)
        ckpt, data = workdir / f"gpt2-{name}.safetensors", workdir / f"gpt2-{name}-data.safetensors"
        if ckpt.exists() and data.exists():  # counted from the file: no 3 GB model built again
            from safetensors import safe_open

            with safe_open(str(ckpt), framework="pt") as fh:
                count = sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
        else:
            ckpt, data, count = write_case(
                workdir, f"gpt2-{name}", "gpt2", shape, seq[:, :-1], seq[:, 1:]
            )
        for kind in args.commands.split(","):
            argv = command(kind, ckpt, data, args.products, args.budget)
            if args.timeout:  # inside the lock: the wait for it is not counted
                argv = ["timeout", str(args.timeout), *argv]
            if args.lock:
                argv = ["flock", args.lock, *argv]
            info = measure(argv, env)
            row = {
                "model": f"GPT-2 {name} ({count:,})",
                "command": kind,
                "cpu": info["cpu"],
                "user": info["user"],
                "sys": info["sys"],
                "rss": info["rss"],
                "code": info["code"],
            }
            if info["code"] == 0:
                report = json.loads(info["out"])
                if args.save:
                    Path(args.save).mkdir(parents=True, exist_ok=True)
                    (Path(args.save) / f"gpt2-{name}-{kind}.json").write_text(info["out"])
                row["products"] = report.get("timing", {}).get("matvecs", "")
                row["value"], row["how"], row["where"] = describe(report)
                memory = report.get("timing", {}).get("memory", {})
                row["planned"] = memory.get("planned_peak_bytes", 0)
            else:
                row["value"] = info["err"].strip().splitlines()[-1][:200] if info["err"] else ""
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"\nbudget --max-memory {args.budget}, one thread, 4 x 64 tokens\n")
    print(
        "| model | command | CPU s (user + sys) | peak RSS (outside) | planned peak | products "
        "| value | products taken | exit |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['command']} | {r['cpu']:.0f} ({r['user']:.0f} + "
            f"{r['sys']:.0f}) | {r['rss'] / 2**30:.2f} GiB | "
            f"{r.get('planned', 0) / 2**30:.2f} GiB | {r.get('products', '')} | "
            f"{r['value']} | {r.get('how', '')} | {r['code']} |"
        )
    for r in rows:
        if r.get("where"):
            print(f"\n{r['model']} {r['command']}: {r['where']}")


if __name__ == "__main__":
    main()
