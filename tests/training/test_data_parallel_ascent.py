"""``sharp train`` under torchrun with the ascent family and the per-replica penalties.

One ``torch.multiprocessing`` spawn of 2 gloo ranks on CPU runs ``train`` (float64) with ``sam``
and ``usam`` (``--ascent-sync per-replica``, the default), ``sam`` and ``asam`` (``global``), and
with ``gp``, ``fa`` and ``gn-trace`` (per replica).
References, in the test process:

- per replica: one process whose step is the real :func:`training_step` on each rank's rows
  (``[floor(r B / 2), floor((r + 1) B / 2))``) in turn, from the same generator state, and the
  row-weighted mean of their gradients: the per-shard ascents (penalties) averaged;
- global: single-process ``sam`` on the whole batch.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
from cli_helpers import run_cli

TRAIN = (
    "train --data blobs:n=90,dim=6,classes=3 --epochs 2 --batch-size 25 --dtype float64 "
    "--width 6 --depth 2 --json - --quiet"
).split()
RUNS = {
    "sam": ["--reg", "sam:rho=0.2"],
    "sam-global": ["--reg", "sam:rho=0.2", "--ascent-sync", "global"],
    "usam": ["--reg", "usam:rho=0.2"],
    "asam-global": ["--reg", "asam", "--ascent-sync", "global"],
    "gp": ["--reg", "gp:rho=0.1"],
    "fa": ["--reg", "fa:lambda=0.1"],
    "gn-trace": ["--reg", "gn-trace:sigma2=0.1"],
}


def _argv(tmp, name: str, suffix: str) -> list[str]:
    return [*TRAIN, *RUNS[name], "--out", str(tmp / f"{name}-{suffix}.safetensors")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, ports: list[int], tmp: str, codes) -> None:
    """One rank: torchrun's environment, then ``main`` per run, stdout in a per-rank file."""
    from pathlib import Path

    from sharpcli.cli import runner
    from sharpcli.cli.app import main

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    for name, port in zip(RUNS, ports):
        os.environ["MASTER_PORT"] = str(port)
        runner.state()["debug"] = False
        with open(Path(tmp) / f"{name}.rank{rank}.out", "w") as out:
            sys.stdout = out
            try:
                main(_argv(Path(tmp), name, "ddp"))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                sys.stdout = sys.__stdout__
        codes[f"{name}.{rank}"] = code


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp-ascent")
    codes = mp.Manager().dict()
    ports = [_free_port() for _ in RUNS]
    mp.spawn(_rank_main, args=(2, ports, str(tmp), codes), nprocs=2, join=True)
    outputs = {}
    for name in RUNS:
        assert (codes[f"{name}.0"], codes[f"{name}.1"]) == (0, 0), name
        assert (tmp / f"{name}.rank1.out").read_text() == ""  # rank 1 prints nothing
        outputs[name] = json.loads((tmp / f"{name}.rank0.out").read_text())
    return tmp, outputs


def _per_shard_step(world: int):
    """A single-process step: the real ``training_step`` on each rank's rows from the same
    generator state, gradients averaged with the row weights B_r / B (float64)."""
    from sharpcli.regularizers import step as step_module
    from sharpcli.regularizers.stats import StepStats

    def step(model, xb, yb, loss_name, regs, generator, **precision):
        params = [p for p in model.parameters() if p.requires_grad]
        total, start = xb.shape[0], generator.get_state()
        mean = [torch.zeros_like(p) for p in params]
        loss = objective = 0.0
        for r in range(world):
            lo, hi = (r * total) // world, ((r + 1) * total) // world
            generator.set_state(start)
            stats = step_module.training_step(
                model, xb[lo:hi], yb[lo:hi], loss_name, regs, generator, **precision
            )
            for m, p in zip(mean, params):
                m.add_(p.grad * ((hi - lo) / total))
            loss += stats.loss * (hi - lo) / total
            objective += stats.objective * (hi - lo) / total
        for m, p in zip(mean, params):
            p.grad = m
        return StepStats(loss, objective, 0, total, stats.grad_evals)

    return step


def _weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", ["sam", "usam", "gp", "fa", "gn-trace"])
def test_per_replica_equals_the_per_shard_steps_averaged(two_ranks, capsys, monkeypatch, name):
    from sharpcli.training import epochs

    tmp, outputs = two_ranks
    monkeypatch.setattr(epochs, "training_step", _per_shard_step(2))
    reference = run_cli(capsys, *_argv(tmp, name, "shards"))
    assert reference.code == 0, reference.err
    parallel = _weights(tmp / f"{name}-ddp.safetensors")
    shards = _weights(tmp / f"{name}-shards.safetensors")
    assert _max_difference(parallel, shards) < 1e-12
    for row_ddp, row_ref in zip(
        outputs[name]["results"]["history"], reference.json()["results"]["history"]
    ):
        assert row_ddp["train_loss"] == pytest.approx(row_ref["train_loss"], rel=1e-12)
    record = outputs[name]["results"]["data_parallel"]
    assert record["world_size"] == 2 and name in record["per_replica"]
    if name in ("sam", "usam"):
        assert (record["ascent"], record["ascent_sync"]) == (name, "per-replica")
    else:
        assert (record["ascent"], record["ascent_sync"]) == (None, None)


@pytest.mark.parametrize("name", ["sam-global", "asam-global"])
def test_global_ascent_equals_one_process_on_the_whole_batch(two_ranks, capsys, name):
    from safetensors import safe_open

    tmp, outputs = two_ranks
    single = run_cli(capsys, *_argv(tmp, name, "single"))
    assert single.code == 0, single.err
    parallel = _weights(tmp / f"{name}-ddp.safetensors")
    assert _max_difference(parallel, _weights(tmp / f"{name}-single.safetensors")) < 1e-12
    record = outputs[name]["results"]["data_parallel"]
    assert (record["ascent"], record["ascent_sync"]) == (name.split("-")[0], "global")
    assert outputs[name]["settings"]["ascent_sync"] == "global"
    with safe_open(str(tmp / f"{name}-ddp.safetensors"), "pt") as handle:
        train = json.loads(handle.metadata()["sharpcli.train"])
    assert train["ascent_sync"] == "global" and train["data_parallel"] == record


def test_the_two_ascent_semantics_are_different_algorithms(two_ranks):
    # the same sam:rho=0.2 run, per replica and global: 8 steps apart by far more than rounding
    tmp, _ = two_ranks
    per_replica = _weights(tmp / "sam-ddp.safetensors")
    assert _max_difference(per_replica, _weights(tmp / "sam-global-ddp.safetensors")) > 1e-3
