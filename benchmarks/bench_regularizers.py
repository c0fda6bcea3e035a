"""Per-epoch cost of the ``sharp train`` regularizers relative to ``--reg none``.

Runs ``python -m sharpcli train`` as whole processes (public CLI only), one process per
(regularizer, repetition). Each repetition alternates ``--reg none`` runs with
regularizer runs, ``none A B none C D none ...`` (the regularizer order reversed on
every other repetition), so every regularizer run has a ``none`` run of the same model
and data beside it and slow drifts of a shared machine's load hit both. Per run it
reads the per-epoch ``seconds`` of the JSON report's ``results.history`` and drops
epoch 1 (warm-up: allocator, lazy imports).

Reported per regularizer:

- ``median s/epoch``: median over every kept epoch of every repetition;
- ``ratio``: median over repetitions of (median kept epoch of the run) / (mean of the
  median kept epochs of the ``none`` runs on either side of it), the cost relative to
  plain training;
- ``grad evals/step``: ``results.final.grad_evals`` of the run over that of its ``none``
  run (one evaluation per plain step), the counted cost;
- ``target`` and whether the ratio meets it.

Usage (the defaults are those of docs/benchmarks.md, "Training regularizers")::

    OMP_NUM_THREADS=1 python benchmarks/bench_regularizers.py --reps 5 [--markdown out.md]

Prints a Markdown table and the exact ``sharp train`` command line of each run.

``--in-process`` instead times ``training_step`` + ``optimizer.step`` per step inside one
process (public library API), the regularizers interleaved every 20 steps: much less
noisy on a shared machine, but without data loading and evaluation.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Budgets (epoch time / epoch time of ``--reg none``) the regularizers are held to.
TARGETS: dict[str, float] = {
    "ad": 1.1,
    "weight-noise": 1.2,
    "sam": 2.2,
    "usam": 2.2,
    "asam": 2.2,
    "nso": 2.2,
    "gp": 4.0,
    "gn-trace": 4.0,
    "hessian-trace": 4.0,
    "fa": 4.0,
}

DEFAULT_REGS = [
    "ad",
    "weight-noise",
    "sam",
    "usam",
    "asam",
    "nso",
    "gp",
    "gn-trace",
    "hessian-trace",
    "fa",
    # non-default modes, for reference
    "weight-noise:report=clean",
    "hessian-trace:mode=fd",
    "fa:mode=fd",
]


def train_command(args: argparse.Namespace, reg: str, out_dir: Path, tag: str) -> list[str]:
    """The ``sharp train`` command line of one run (``python -m sharpcli train ...``)."""
    return [
        sys.executable,
        "-m",
        "sharpcli",
        "train",
        "--data",
        args.data,
        "--model",
        args.model,
        "--width",
        str(args.width),
        "--depth",
        str(args.depth),
        "--activation",
        args.activation,
        "--batch-size",
        str(args.batch_size),
        "--epochs",
        str(args.epochs),
        "--seed",
        str(args.seed),
        "--lr",
        str(args.lr),
        "--reg",
        reg,
        "--out",
        str(out_dir / f"{tag}.safetensors"),
        "--json",
        str(out_dir / f"{tag}.json"),
    ]


def run_once(args: argparse.Namespace, reg: str, out_dir: Path, tag: str) -> dict:
    """Run one training process; return its kept epoch seconds and gradient evaluations."""
    cmd = train_command(args, reg, out_dir, tag)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    done = subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    if done.returncode != 0:
        raise SystemExit(
            f"bench: {shlex.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
        )
    report = json.loads((out_dir / f"{tag}.json").read_text())
    history = report["results"]["history"]
    seconds = [row["seconds"] for row in history[1:]]  # epoch 1 is warm-up
    return {
        "seconds": seconds,
        "median": statistics.median(seconds),
        "grad_evals": report["results"]["final"]["grad_evals"],
        "threads": report["environment"]["threads"],
    }


def in_process(args: argparse.Namespace) -> str:
    """Per-step cost inside one process: ``training_step`` + ``optimizer.step`` on one fixed
    batch, regularizers interleaved in rounds of 20 steps (so load drifts hit all alike),
    median per-step time over ``7 * reps`` rounds. Cheaper and far less noisy than whole
    processes on a loaded machine; it leaves out data loading and evaluation."""
    import torch

    from sharpcli.io.datasets import load_dataset
    from sharpcli.models import build_model, default_model_args
    from sharpcli.training.regularizers import parse_reg, training_step

    torch.set_num_threads(args.threads)
    data = load_dataset(args.data)
    x, y = data.split("train")
    x, y = x[: args.batch_size].float(), y[: args.batch_size]
    sizes = (
        {"depth": args.depth, "width": args.width} if args.model == "mlp" else {}
    )  # image models: zoo defaults
    model_args = default_model_args(
        args.model,
        tuple(data.input_shape),
        int(data.num_classes),
        activation=args.activation,
        **sizes,
    )
    torch.manual_seed(args.seed)
    model = build_model({"name": args.model, "args": model_args})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    generator = torch.Generator().manual_seed(args.seed)
    specs = ["none", *args.regs]
    regs = {spec: [parse_reg(spec)] for spec in specs}

    def steps(spec: str, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            training_step(model, x, y, "cross-entropy", regs[spec], generator)
            optimizer.step()
        return (time.perf_counter() - start) / n

    for spec in specs:
        steps(spec, 5)  # warm-up
    times: dict[str, list[float]] = {spec: [] for spec in specs}
    for _ in range(7 * args.reps):
        for spec in specs:
            times[spec].append(steps(spec, 20))
    base = statistics.median(times["none"])
    lines = [
        "| regularizer | median ms/step | ratio to none | target | met |",
        "|---|---:|---:|---:|---|",
    ]
    for spec in specs:
        med = statistics.median(times[spec])
        target = TARGETS.get(spec)
        met = "" if target is None else ("yes" if med / base <= target else "**no**")
        lines.append(
            f"| `{spec}` | {med * 1e3:.2f} | {med / base:.2f}x | "
            f"{'' if target is None else f'<= {target:g}x'} | {met} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regs", nargs="+", default=DEFAULT_REGS, help="regularizer specs to time")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per regularizer")
    parser.add_argument(
        "--group", type=int, default=2, help="regularizer runs between two none runs"
    )
    parser.add_argument("--data", default="blobs:n=8192,dim=64,classes=10")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--activation", default="gelu")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lr", type=float, default=0.01, help="small enough that no penalty diverges"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS unless already set")
    parser.add_argument("--markdown", type=Path, help="also write the Markdown table here")
    parser.add_argument("--raw", type=Path, help="write every run's numbers as JSON here")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="time training_step per step inside one process instead of whole runs",
    )
    args = parser.parse_args(argv)
    if args.in_process:
        table = in_process(args)
        command = (
            "OMP_NUM_THREADS="
            + os.environ.get("OMP_NUM_THREADS", str(args.threads))
            + " python benchmarks/bench_regularizers.py "
            + shlex.join(argv if argv is not None else sys.argv[1:])
        )
        text = f"Date: {_dt.date.today().isoformat()}; per step, in process.\n\n{table}\n\nBenchmark command: `{command}`"
        print(text)
        if args.markdown:
            args.markdown.write_text(text + "\n")
        return 0
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (epoch 1 is dropped as warm-up)")

    rows = []
    raw: dict = {"none": [], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-regs-") as tmp:
        out_dir = Path(tmp)
        for rep in range(args.reps):
            regs = list(args.regs) if rep % 2 == 0 else list(reversed(args.regs))
            base = [run_once(args, "none", out_dir, f"r{rep}-none0")]
            raw["none"].append(base[0])
            for j in range(0, len(regs), args.group):
                group = regs[j : j + args.group]
                results = {
                    reg: run_once(args, reg, out_dir, f"r{rep}-{j + k}")
                    for k, reg in enumerate(group)
                }
                after = run_once(args, "none", out_dir, f"r{rep}-none{j + 1}")
                raw["none"].append(after)
                for reg, res in results.items():
                    flank = [base[-1], after]
                    none_median = statistics.mean(r["median"] for r in flank)
                    none_evals = flank[0][
                        "grad_evals"
                    ]  # a plain step is 1 evaluation: the step count
                    raw["runs"].setdefault(reg, []).append(
                        {
                            **res,
                            "ratio": res["median"] / none_median,
                            "grad_evals_per_step": res["grad_evals"] / none_evals,
                        }
                    )
                    print(
                        f"rep {rep + 1}/{args.reps} {reg:28s} {res['median']:.3f} s/epoch vs none "
                        f"{none_median:.3f} -> {res['median'] / none_median:.2f}x",
                        file=sys.stderr,
                        flush=True,
                    )
                base.append(after)
        example = train_command(args, "REG", Path("OUT"), "run")

    none_epochs = [s for run in raw["none"] for s in run["seconds"]]
    none_median = statistics.median(none_epochs)
    rows.append(("none", none_median, 1.0, 1.0, None))
    for reg in args.regs:
        runs = raw["runs"][reg]
        epochs = [s for run in runs for s in run["seconds"]]
        ratio = statistics.median(run["ratio"] for run in runs)
        evals = statistics.median(run["grad_evals_per_step"] for run in runs)
        rows.append((reg, statistics.median(epochs), ratio, evals, TARGETS.get(reg)))

    threads = raw["none"][0]["threads"]
    lines = [
        f"Date: {_dt.date.today().isoformat()}; host: {platform.machine()}, {os.cpu_count()} cores "
        f"(shared); torch threads: {threads}; {args.reps} repetitions per regularizer, a none run "
        f"every {args.group} regularizer runs; "
        f"epochs 2-{args.epochs} of each run kept.",
        "",
        "| regularizer | median s/epoch | ratio to none | grad evals/step | target | met |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for reg, median, ratio, evals, target in rows:
        met = "" if target is None else ("yes" if ratio <= target else "**no**")
        target_text = "" if target is None else f"<= {target:g}x"
        lines.append(
            f"| `{reg}` | {median:.3f} | {ratio:.2f}x | {evals:.2f} | {target_text} | {met} |"
        )
    lines += [
        "",
        "Each run: `OMP_NUM_THREADS="
        + os.environ.get("OMP_NUM_THREADS", str(args.threads))
        + " python "
        + shlex.join(example[1:])
        + "` (REG the row's spec, or `none`).",
        "",
        "Benchmark command: `OMP_NUM_THREADS="
        + os.environ.get("OMP_NUM_THREADS", str(args.threads))
        + " python benchmarks/bench_regularizers.py "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        + "`",
    ]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.raw:
        args.raw.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
