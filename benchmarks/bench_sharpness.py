"""Cost of ``sharp sharpness`` and ``sharp landscape`` on the research-size ResNet-18.

The CIFAR ResNet-18 (11.2M parameters) of ``benchmarks/scale_models.py``, built by hand as
in ``bench_scale.py`` (no downloads), with 64 seeded random images 3x32x32. Each command
runs as a whole child process on one thread; its CPU time (user + system) and peak resident
memory come from ``os.wait4`` (:func:`bench_scale.measure`).

Runs: adaptive worst-case l2 sharpness (``--rho 0.05``, 20 Auto-PGD steps, one restart, the
64 images as one batch), average-case sharpness (``--noise-draws 20``), and a 21 x 21
filter-normalized landscape (441 passes over the 64 images).

Usage: ``python benchmarks/bench_sharpness.py [--workdir DIR] [--device cpu|cuda]
[--steps 21]``; prints a Markdown table (docs/benchmarks.md, "Sharpness and landscapes").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_scale  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=21, help="landscape grid points per axis")
    parser.add_argument("--runs", default="worst-case,average,landscape")
    args = parser.parse_args(argv)
    import torch

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-sharpness-"))
    workdir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)
    ckpt, data, count = bench_scale.write_case(workdir, "resnet18", "resnet18", {}, x, y)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    runs = {
        "worst-case": (
            "sharpness",
            ["--kind", "worst-case", "--rho", "0.05", "--steps", "20"],
            "`sharp sharpness --rho 0.05` (worst case, 20 steps)",
        ),
        "average": (
            "sharpness",
            ["--kind", "average", "--rho", "0.05", "--noise-draws", "20"],
            "`sharp sharpness --kind average --noise-draws 20`",
        ),
        "landscape": (
            "landscape",
            ["--steps", str(args.steps)],
            f"`sharp landscape --steps {args.steps}` ({args.steps}x{args.steps})",
        ),
    }
    rows: list = []
    print(f"ResNet-18: {count} parameters, 64 images, device {args.device}", file=sys.stderr)
    for name in args.runs.split(","):
        command, extra, label = runs[name]
        argv_ = bench_scale.sharp(command, ckpt, data, *extra, device=args.device)
        bench_scale.run(label, argv_, env, rows)
    print("| run | CPU s | wall s | peak RSS GiB | result |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['label']} | {row['cpu']:.1f} | {row['wall']:.1f} | "
            f"{row['rss'] / 2**30:.2f} | {_summary(row['report'])} |"
        )
    (workdir / "bench_sharpness.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k not in ("out", "err")} for r in rows])
    )
    return 0


def _summary(report: dict | None) -> str:
    if report is None:
        return "failed"
    results = report["results"]
    if report["command"] == "sharpness":
        row = results["rows"][0]
        return f"sharpness {row['sharpness']:.4g}, {results['evaluations']} passes"
    return f"loss {results['loss_min']:.4g} to {results['loss_max']:.4g}, {results['evaluations']} passes"


if __name__ == "__main__":
    raise SystemExit(main())
