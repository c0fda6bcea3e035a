"""eigen, trace and density with the model sharded by FSDP2 (``--hvp fsdp``: finite differences)
across 2 gloo ranks on CPU equal the unsharded single-process run within the stated
finite-difference error (results.hvp.error_bound).

One ``torch.multiprocessing`` spawn of 2 ranks runs the three commands through
``sharpcli.cli.app.main`` with torchrun's environment variables; the single-process
references (exact and finite-difference) run in the test process. 45 samples in batches of
8: rank 0 holds 22 (3 batches), rank 1 23 (3 batches). Slow (about 60 s on 2 cores): every
product gathers and reduce-scatters each FSDP unit per batch through gloo.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from cli_helpers import run_cli
from test_distributed import _free_port, _one_json_document

COMMON = ["--dtype", "float64", "--batch-size", "8", "--json", "-", "--quiet"]


def _commands(ckpt: str) -> dict[str, list[str]]:
    return {
        "eigen": ["eigen", ckpt, "--top-k", "2", "--which", "both", "--eig-tol", "1e-8"],
        "trace": [
            "trace",
            ckpt,
            "--estimator",
            "hutchinson",
            "--trace-tol",
            "1e-9",
            "--trace-max-matvecs",
            "12",
        ],
        "density": ["density", ckpt, "--probes", "2", "--steps", "8", "--grid-points", "64"],
    }


def _rank_main(rank: int, world: int, ports: list[int], tmp: str, ckpt: str, codes) -> None:
    """One rank: torchrun's environment, then ``main`` per command with stdout in a file."""
    from pathlib import Path

    from sharpcli.cli import runner
    from sharpcli.cli.app import main

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    for (name, argv), port in zip(_commands(ckpt).items(), ports):
        os.environ["MASTER_PORT"] = str(port)
        runner.state()["debug"] = False
        with (
            open(Path(tmp) / f"{name}.rank{rank}.out", "w") as out,
            open(Path(tmp) / f"{name}.rank{rank}.err", "w") as err,
        ):
            sys.stdout, sys.stderr = out, err
            try:
                main([*argv, "--hvp", "fsdp", *COMMON])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        codes[f"{name}.{rank}"] = code


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    from sharpcli.io.checkpoints import save_checkpoint
    from sharpcli.models import build_model, default_model_args

    tmp = tmp_path_factory.mktemp("fsdp")
    # widths 7 and 5 do not divide by 2: uneven shards of every weight
    spec = {
        "name": "mlp",
        "args": default_model_args("mlp", (6,), 3, width=7, depth=2, activation="gelu"),
    }
    torch.manual_seed(0)
    ckpt = str(tmp / "model.safetensors")
    save_checkpoint(ckpt, build_model(spec), spec, data_spec="blobs:n=60,dim=6,classes=3,seed=3")
    manager = mp.Manager()
    codes = manager.dict()
    # the ports are picked before the ranks bind them: another process can take one in
    # between (EADDRINUSE on rank 0, rank 1 then waits to join for good), so such a run is
    # stopped after a deadline and retried on fresh ports
    for _ in range(3):
        ports = [_free_port() for _ in _commands(ckpt)]
        ranks = mp.spawn(_rank_main, args=(2, ports, str(tmp), ckpt, codes), nprocs=2, join=False)
        deadline = time.monotonic() + 300
        while not ranks.join(timeout=5) and time.monotonic() < deadline:
            pass
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
        errors = " ".join(path.read_text() for path in tmp.glob("*.err"))
        if len(codes) == 2 * len(_commands(ckpt)) and "address already in use" not in errors:
            break
        codes.clear()
    outputs = {}
    for name in _commands(ckpt):
        for rank in (0, 1):
            outputs[name, rank] = (
                (tmp / f"{name}.rank{rank}.out").read_text(),
                (tmp / f"{name}.rank{rank}.err").read_text(),
                codes[f"{name}.{rank}"],
            )
    return ckpt, outputs


def _single(capsys, argv: list[str], hvp: str) -> dict:
    run = run_cli(capsys, *argv, "--hvp", hvp, *COMMON)
    assert run.code == 0, run.err
    return run.json()["results"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eigen", "trace", "density"])
def test_sharded_run_equals_the_unsharded_one_within_the_stated_error(sharded, capsys, name):
    ckpt, outputs = sharded
    (out0, err0, code0), (out1, err1, code1) = outputs[name, 0], outputs[name, 1]
    assert (code0, code1) == (0, 0), (err0, err1)
    assert out1 == "" and err1 == ""  # rank 1 prints nothing
    report = _one_json_document(out0)
    assert report["environment"]["world_size"] == 2
    par = report["results"]
    assert par["hvp"]["sharded"] is True
    argv = _commands(ckpt)[name]
    exact, fd = _single(capsys, argv, "exact"), _single(capsys, argv, "finite-difference")
    assert fd["hvp"]["sharded"] is False
    beta = par["hvp"]["error_bound"]
    # the same step: ||theta|| summed over the shards, the same ladder's choice
    assert par["hvp"]["step_norm"] == pytest.approx(fd["hvp"]["step_norm"], rel=1e-12)
    assert par["hvp"]["error_bound"] <= 1e-7 * max(1.0, abs(fd["hvp"]["weight_norm"]))
    numel = exact["scope"]["numel"]
    assert par["scope"]["numel"] == numel
    if name == "eigen":
        for a, b, ra, rb in zip(
            exact["eigenvalues"], par["eigenvalues"], exact["residuals"], par["residuals"]
        ):
            assert abs(a - b) <= beta + ra + rb, (a, b, beta)
        # against the unsharded finite differences: the summation order only
        scale = max(map(abs, fd["eigenvalues"]))
        for a, b in zip(fd["eigenvalues"], par["eigenvalues"]):
            assert abs(a - b) <= 1e-8 * scale
    elif name == "trace":
        assert exact["trace"]["samples"] == par["trace"]["samples"]
        assert abs(exact["trace"]["estimate"] - par["trace"]["estimate"]) <= beta * numel
    else:
        assert abs(exact["trace_estimate"] - par["trace_estimate"]) <= beta * numel
        assert par["matvecs"] == fd["matvecs"]
