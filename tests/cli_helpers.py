"""Run the ``sharp`` CLI in-process (fast) or as a real subprocess (for exit codes end to end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


def run_cli(capsys, *args: str) -> Run:
    """Call ``sharpcli.cli.app.main`` with ``args``; return exit code, stdout, stderr."""
    from sharpcli.cli import runner
    from sharpcli.cli.app import main

    capsys.readouterr()
    runner.state()["debug"] = False
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    captured = capsys.readouterr()
    return Run(code, captured.out, captured.err)


def run_process(*args: str, cwd=None, timeout: int = 300, env: dict | None = None) -> Run:
    """Run ``python -m sharpcli ARGS`` as a subprocess (``env``: variables to set)."""
    env = {**os.environ, **(env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "sharpcli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=env,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line_error(run: Run, code: int, *needles: str) -> None:
    """An error: the exit code, exactly one line on stderr naming what it is about, no traceback."""
    assert run.code == code, (run.code, run.out, run.err)
    lines = [l for l in run.err.splitlines() if l.strip()]
    assert len(lines) == 1, run.err
    assert "Traceback" not in run.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def run_in_process(*args: str) -> Run:
    """Like ``run_cli`` without pytest's capsys (for module-scoped fixtures)."""
    import contextlib
    import io

    from sharpcli.cli import runner
    from sharpcli.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    runner.state()["debug"] = False
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Run(code, out.getvalue(), err.getvalue())


def factory_checkpoint(folder, monkeypatch, module_name: str, source: str, seed: int = 0):
    """A user's factory module ``module_name`` (``source`` defines ``build()``) written into
    ``folder`` and importable, and the safetensors state_dict of ``build()`` seeded with ``seed``.

    Returns ``(model, weights_path)``; the module is imported afresh (no copy of an earlier
    test's module of the same name)."""
    import importlib
    import sys

    import torch
    from safetensors.torch import save_file

    (folder / f"{module_name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    module = importlib.import_module(module_name)
    torch.manual_seed(seed)
    model = module.build()
    weights = folder / f"{module_name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return model, weights
