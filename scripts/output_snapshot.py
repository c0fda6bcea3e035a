"""What a user and a CI script see, written to a folder so that two versions can be diffed.

A refactoring that moves code must not change what sharp prints: every command's ``--help``
at 80 columns, and the tables and JSON reports of the README's model (trained here with the
defaults of ``sharp train``, as the README's first command does). Run it on the tree before
the change and on the tree after, then diff the two folders::

    python scripts/output_snapshot.py write BEFORE     # on the old tree
    python scripts/output_snapshot.py write AFTER      # on the new tree
    python scripts/output_snapshot.py diff BEFORE AFTER

``write`` runs ``python -m sharpcli`` from the current interpreter in a scratch folder, so
the tree on ``PYTHONPATH`` (or the installed one) is the one snapshotted, wherever it is run. What varies from run to run
(timings, the environment, memory readings, paths and checksums) is dropped from the JSON;
everything else is kept byte for byte. ``diff`` prints a unified diff of each file that
differs and exits 1 when any does (0 when the folders agree), so it can gate a refactoring.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMANDS = (
    "train",
    "eigen",
    "trace",
    "gn-nme",
    "density",
    "diagonal",
    "analyze",
    "activation-stats",
    "weight-rescale",
    "sharpness",
    "landscape",
    "bound-check",
    "compare",
    "sweep",
)

# The runs on the README's model whose table and JSON are kept.
RUNS = {
    "eigen": ["eigen", "model.safetensors", "--top-k", "2"],
    "trace": ["trace", "model.safetensors"],
    "gn-nme": ["gn-nme", "model.safetensors"],
    "density": ["density", "model.safetensors"],
    "analyze": ["analyze", "model.safetensors"],
    "sharpness": ["sharpness", "model.safetensors", "--samples", "256"],
    "activation-stats": ["activation-stats", "model.safetensors"],
    "bound-check": ["bound-check", "model.safetensors", "--samples", "256"],
}

# Keys whose values change from run to run of the same code.
VOLATILE = {"timing", "environment", "seconds", "tracking_seconds", "sha256", "path", "memory"}


def _sharp(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    # always from a scratch folder: ``python -m`` puts the working folder first on the path,
    # so run from a checkout it would import that checkout's sharpcli, not PYTHONPATH's
    env = {**os.environ, "COLUMNS": "80", "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "sharpcli", *args], capture_output=True, text=True, env=env, cwd=cwd
    )


def stable(doc):
    """``doc`` without the keys in :data:`VOLATILE`, at any depth."""
    if isinstance(doc, dict):
        return {k: stable(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [stable(v) for v in doc]
    return doc


def _json_text(doc) -> str:
    return json.dumps(stable(doc), indent=1, sort_keys=True) + "\n"


def write(out: Path) -> None:
    """Every help page, and each run's table and JSON on a freshly trained README model."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        (out / "help_sharp.txt").write_text(_sharp(["--help"], work).stdout)
        for command in COMMANDS:
            (out / f"help_{command}.txt").write_text(_sharp([command, "--help"], work).stdout)
        trained = _sharp(["train", "--out", "model.safetensors", "--quiet", "--json", "-"], work)
        if trained.returncode != 0:
            sys.exit(f"sharp train failed ({trained.returncode}): {trained.stderr.strip()}")
        (out / "json_train.json").write_text(_json_text(json.loads(trained.stdout)))
        for name, args in RUNS.items():
            report = _sharp([*args, "--json", "-"], work)
            text = (
                _json_text(json.loads(report.stdout))
                if report.returncode == 0
                else f"exit {report.returncode}\n{report.stderr}"
            )
            (out / f"json_{name}.json").write_text(text)
            (out / f"table_{name}.txt").write_text(_sharp(args, work).stdout)
    print(f"snapshot written to {out}")


def diff(before: Path, after: Path) -> int:
    """Print the differences between two snapshots; the number of files that differ."""
    names = sorted({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()})
    differing = 0
    for name in names:
        old, new = before / name, after / name
        old_lines = old.read_text().splitlines(keepends=True) if old.exists() else []
        new_lines = new.read_text().splitlines(keepends=True) if new.exists() else []
        if old_lines != new_lines or old.exists() != new.exists():
            differing += 1
            sys.stdout.writelines(
                difflib.unified_diff(old_lines, new_lines, f"{before}/{name}", f"{after}/{name}")
            )
    print(f"{differing} of {len(names)} files differ")
    return differing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("write", help="write a snapshot").add_argument("folder", type=Path)
    compare = sub.add_parser("diff", help="diff two snapshots (exit 1 when they differ)")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.action == "write":
        write(args.folder)
        return 0
    return 1 if diff(args.before, args.after) else 0


if __name__ == "__main__":
    sys.exit(main())
