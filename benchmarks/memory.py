"""Peak resident memory of ``sharp eigen`` / ``sharp trace`` on a ~5M-parameter MLP.

Builds an ``mlp`` checkpoint (256 inputs, depth 5, width 1100, 10 classes: 5,138,110
float32 parameters) on the built-in ``blobs`` data, then runs each command as a child
process and reads its peak RSS (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` after
each child, which is the maximum over the children so far, so the commands run from the
smallest expected footprint up, each in a fresh measuring process). A baseline child that
only imports torch and sharpcli and loads the model gives the fixed cost.

Memory model (docs/benchmarks.md): one batch of activations and its first-order graph, plus a
few parameter-sized vectors per estimator. One P-vector is ``P * 4`` bytes in float32
(20.6 MB here). Lanczos keeps its Krylov basis, ``krylov_dim x P x bytes`` (``krylov_dim =
min(P, --eig-max-matvecs)``, default 100); Hutchinson keeps a block of ``block_size = 8``
probes and their products (16 P-vectors); Hutch++ keeps ``2 s`` P-vectors for a sketch of
s columns. The curvature pass caches each batch's first-order graph up to 1 GiB
(``DEFAULT_CACHE_BYTES``), which is what one pass over a small analysis set costs.

Usage: ``python benchmarks/memory.py [--workdir DIR] [--samples N] [--batch-size B]``;
prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ARCH = {"in_features": 256, "num_classes": 10, "depth": 5, "width": 1100, "activation": "relu"}
DATA = "blobs:n={n},dim=256,classes=10,seed=0"


def build_checkpoint(path: Path, samples: int) -> int:
    """Write the benchmark checkpoint; return its parameter count P."""
    import torch

    from sharpcli.io.checkpoints import save_checkpoint
    from sharpcli.models import build_model, default_model_args

    args = default_model_args(
        "mlp",
        (ARCH["in_features"],),
        ARCH["num_classes"],
        depth=ARCH["depth"],
        width=ARCH["width"],
        activation=ARCH["activation"],
    )
    spec = {"name": "mlp", "args": args}
    torch.manual_seed(0)
    model = build_model(spec)
    save_checkpoint(path, model, spec, data_spec=DATA.format(n=samples))
    return sum(p.numel() for p in model.parameters())


def peak_rss_of(argv: list[str]) -> tuple[int, float, str]:
    """Run ``argv`` in a fresh measuring child; return (peak RSS bytes, seconds, stdout)."""
    probe = (
        "import resource, subprocess, sys, time, json\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "dt = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps({'rss': rss, 'seconds': dt, 'code': p.returncode, 'out': p.stdout, 'err': p.stderr}))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    result = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, check=True
    )
    info = json.loads(result.stdout)
    if info["code"] != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({info['code']}): {info['err'].strip()}")
    return info["rss"], info["seconds"], info["out"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-matvecs", type=int, default=20)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sharp-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = workdir / "mlp5m.safetensors"
    params = build_checkpoint(ckpt, args.samples)
    sharp = [sys.executable, "-m", "sharpcli"]
    common = ["--batch-size", str(args.batch_size), "--quiet", "--json", "-"]
    runs = [
        (
            "baseline (import + load model)",
            [
                sys.executable,
                "-c",
                "import sys, sharpcli.cli.app; from sharpcli.io.checkpoints import load_checkpoint; "
                f"load_checkpoint({str(ckpt)!r})",
            ],
        ),
        (
            f"eigen --top-k 1 --eig-max-matvecs {args.max_matvecs}",
            [
                *sharp,
                "eigen",
                str(ckpt),
                "--top-k",
                "1",
                "--eig-max-matvecs",
                str(args.max_matvecs),
                *common,
            ],
        ),
        (
            f"trace --estimator hutchinson --trace-max-matvecs {args.max_matvecs}",
            [
                *sharp,
                "trace",
                str(ckpt),
                "--estimator",
                "hutchinson",
                "--trace-max-matvecs",
                str(args.max_matvecs),
                *common,
            ],
        ),
    ]
    vector_bytes = params * 4
    print(
        f"P = {params:,} float32 parameters; one P-vector = {vector_bytes / 1e6:.1f} MB; "
        f"analysis set {args.samples} samples x 256 features, batch {args.batch_size}"
    )
    print()
    print("| command | peak RSS (MB) | seconds | Krylov basis (MB) |")
    print("|---|---|---|---|")
    for label, argv in runs:
        rss, seconds, out = peak_rss_of(argv)
        basis = ""
        if label.startswith("eigen"):
            krylov = json.loads(out)["results"]["krylov_dim"]
            basis = f"{krylov} x P x 4 B = {krylov * vector_bytes / 1e6:.0f}"
        print(f"| `{label}` | {rss / 1e6:.0f} | {seconds:.1f} | {basis} |")


if __name__ == "__main__":
    main()
