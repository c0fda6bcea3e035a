"""Start-up and whole-process cost: ``sharp eigen --top-k 1`` against a PyHessian script.

Measured in CPU time (user + system of each child process, from ``os.wait4``): the machine
these figures come from is shared, and CPU time swings far less than wall time under load.

1. **Whole processes.** The GELU MLP of ``bench_curvature.py`` (64-256-256-10, 85,002
   parameters, trained 5 epochs with ``sharp train`` on ``blobs:n=2000,dim=64,classes=10``)
   and its 1500 training samples in one batch: ``python -m sharpcli eigen CKPT --top-k 1
   --batch-size 1500 -q --json OUT`` against ``python benchmarks/pyhessian_eigen.py BUNDLE``
   (torch and PyHessian 0.1 only: the same weights and samples, exported once to a
   ``torch.save`` bundle, ``eigenvalues(maxIter=100, tol=1e-3, top_n=1)``). ``--repeats``
   rounds, the order alternating, round ``r`` with ``--seed r`` on both sides (the random
   start vectors); medians, and the median of the per-pair CPU ratios. ``--baseline TREE``
   adds ``sharp eigen`` run from another source tree (``git archive COMMIT | tar -x -C
   TREE``) as a third side: before and after a change.
   sharp's phases come from its report: ``timing.startup_seconds`` (process start to the
   computation: interpreter, CLI, torch and library imports) and ``timing.compute_seconds``.
2. **``sharp --help``**: wall and CPU time of ``--repeats`` processes.
3. **Imports**: one ``python -X importtime -m sharpcli eigen ...``; the top-level imports of
   20 ms or more (cumulative), and whether pandas, pyarrow or sympy were imported.

Usage (the figures of docs/benchmarks.md, "Start-up")::

    OMP_NUM_THREADS=1 python benchmarks/bench_startup.py --repeats 7 [--markdown out.md]

``--workdir`` keeps the trained checkpoint between runs.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_curvature import child_env, train_checkpoints  # noqa: E402

HEAVY = ("pandas", "pyarrow", "sympy", "matplotlib", "scipy")


def run_child(
    argv: list[str], threads: int, cwd: Path | None = None, pythonpath: str | None = None
) -> dict:
    """Run one process to its end; its wall seconds and CPU seconds (user + system)."""
    env = child_env(threads)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=cwd,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({code}): {err[-800:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime}


def export_bundle(ckpt: Path, bundle: Path) -> None:
    """The checkpoint's weights and training split (float32), for the PyHessian script."""
    import torch

    from sharpcli.io.checkpoints import load_checkpoint
    from sharpcli.io.data.loading import load_dataset

    loaded = load_checkpoint(str(ckpt))
    x, y = load_dataset(loaded.data_spec).split("train")
    state = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    torch.save({"state": state, "x": x.float(), "y": y}, bundle)


def _eigen_args(ckpt: Path, report: Path) -> list[str]:
    """``sharpcli eigen`` for lambda_max of the whole set in one batch, quiet, JSON to ``report``."""
    return [
        "sharpcli",
        "eigen",
        str(ckpt),
        "--top-k",
        "1",
        "--batch-size",
        "1500",
        "-q",
        "--json",
        str(report),
    ]


def whole_processes(
    ckpt: Path, bundle: Path, repeats: int, threads: int, out: Path, baseline: Path | None
) -> dict:
    """Alternating rounds of whole processes (pair ``r`` with seed ``r`` on every side); per
    side the runs and its last result. ``baseline``: a source tree of sharpcli (another
    commit) run as a third side, ``sharp (baseline)``."""
    sharp_json, script_json = out / "sharp.json", out / "pyhessian.json"
    sides = {
        "sharp": [sys.executable, "-m", *_eigen_args(ckpt, sharp_json)],
        "pyhessian": [
            sys.executable,
            str(HERE / "pyhessian_eigen.py"),
            str(bundle),
            "--json",
            str(script_json),
        ],
    }
    paths = {"sharp": None, "pyhessian": None}
    if baseline is not None:
        sides["baseline"] = list(sides["sharp"])
        paths["baseline"] = str(baseline)
    names = list(sides)
    runs: dict[str, list] = {name: [] for name in names}
    for r in range(repeats):
        for side in names if r % 2 == 0 else names[::-1]:
            run = run_child([*sides[side], "--seed", str(r)], threads, pythonpath=paths[side])
            if side != "pyhessian":
                report = json.loads(sharp_json.read_text())
                run["startup"] = report["timing"].get("startup_seconds", float("nan"))
                run["compute"] = report["timing"].get(
                    "compute_seconds", report["timing"]["seconds"]
                )
                run["value"] = report["results"]["eigenvalues"][0]
                run["products"] = report["results"]["matvecs"]
            else:
                result = json.loads(script_json.read_text())
                run["compute"] = result["compute_seconds"]
                run["value"] = result["eigenvalue"]
                run["products"] = result["products"]
            runs[side].append(run)
    commands = {k: " ".join(["python", *v[1:], "--seed", "R"]) for k, v in sides.items()}
    return {"runs": runs, "commands": commands}


def help_runs(repeats: int, threads: int) -> list[dict]:
    """``sharp --help`` processes."""
    return [
        run_child([sys.executable, "-m", "sharpcli", "--help"], threads) for _ in range(repeats)
    ]


def import_profile(ckpt: Path, threads: int, out: Path) -> tuple[list, list]:
    """Top-level imports >= 20 ms of one ``-X importtime`` eigen run; heavy modules seen."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", *_eigen_args(ckpt, out / "importtime.json")],
        env=child_env(threads),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=True,
    )
    top, seen = [], set()
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _, cumulative, name = line.split(":", 1)[1].split("|")
        module = name.strip()
        if module.split(".")[0] in HEAVY:
            seen.add(module.split(".")[0])
        if not name.startswith("  ") and int(cumulative) >= 20_000:
            top.append((module, int(cumulative) / 1e6))
    return top, sorted(seen)


def med(values) -> float:
    return statistics.median(values)


def report(whole: dict, helps: list, imports: tuple, repeats: int, threads: int) -> str:
    runs = whole["runs"]
    s, p = runs["sharp"], runs["pyhessian"]
    ratio = med([a["cpu"] / b["cpu"] for a, b in zip(s, p)])

    def row(label: str, rs: list, startup: bool) -> str:
        products = sorted(r["products"] for r in rs)
        values = [r["value"] for r in rs]
        return (
            f"| {label} | {med([r['cpu'] for r in rs]):.2f} | {med([r['wall'] for r in rs]):.2f} "
            f"| {med([r['startup'] for r in rs]) if startup else float('nan'):.2f} | "
            f"{med([r['compute'] for r in rs]):.2f} | {med(products):g} "
            f"({products[0]}-{products[-1]}) | {min(values):.5g}-{max(values):.5g} |"
        ).replace("| nan |", "|  |")

    help_wall = " ".join(f"{r['wall']:.2f}" for r in helps)
    help_cpu = " ".join(f"{r['cpu']:.2f}" for r in helps)
    lines = [
        f"Date: {_dt.date.today().isoformat()}; host: {platform.machine()}, {os.cpu_count()} "
        f"cores (shared); Python {platform.python_version()}; threads: {threads}; "
        f"{repeats} alternating pairs, medians.",
        "",
        "| process | CPU s | wall s | start-up s | compute s | products (range) | "
        "lambda_max (range) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        row("`sharp eigen --top-k 1`", s, True),
        *(
            [row("the same, before (baseline tree)", runs["baseline"], False)]
            if "baseline" in runs
            else []
        ),
        row("PyHessian script", p, False),
        "",
        f"CPU time sharp / PyHessian (median of pairs): **{ratio:.2f}x** "
        f"(target <= 1: {'met' if ratio <= 1 else '**not met**'}).",
        "",
        f"`sharp --help`: wall {help_wall} s; CPU {help_cpu} s "
        f"(median wall {med([r['wall'] for r in helps]):.2f} s).",
        "",
        "Top-level imports of `sharp eigen` (`-X importtime`, cumulative, >= 20 ms): "
        + ", ".join(f"{m} {t:.2f} s" for m, t in imports[0])
        + f"; heavy modules imported: {', '.join(imports[1]) or 'none'}.",
        "",
        f"sharp: `{whole['commands']['sharp']}`; PyHessian: `{whole['commands']['pyhessian']}`.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint and bundle here")
    parser.add_argument("--markdown", type=Path, help="also write the Markdown here")
    parser.add_argument(
        "--baseline", type=Path, help="a sharpcli source tree (another commit) to run beside"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ckpt = train_checkpoints(["mlp"], work, args.threads)["mlp"]
        bundle = work / "mlp_bundle.pt"
        if not bundle.exists():
            export_bundle(ckpt, bundle)
        whole = whole_processes(ckpt, bundle, args.repeats, args.threads, work, args.baseline)
        helps = help_runs(args.repeats, args.threads)
        imports = import_profile(ckpt, args.threads, work)
    text = report(whole, helps, imports, args.repeats, args.threads)
    command = "OMP_NUM_THREADS={} python benchmarks/bench_startup.py {}".format(
        args.threads, " ".join(argv if argv is not None else sys.argv[1:])
    )
    text += f"\n\nBenchmark command: `{command.strip()}`"
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
