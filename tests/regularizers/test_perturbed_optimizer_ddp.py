"""The optimizer wrapper under DistributedDataParallel: 2 gloo ranks on CPU (one
``torch.multiprocessing`` spawn) against single-process computations, float64.

- ``ascent_sync="per-replica"``: each rank's ascent from its shard's gradient, the perturbed
  gradients averaged: the single-process mean over shards of grad L_s(theta + e_s).
- ``ascent_sync="global"``: single-process SAM on the whole batch.
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

RHO, LR, STEPS, WORLD = 0.1, 0.5, 2, 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 5, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (16,), generator=gen
    )


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sharpcli import regularizers

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    x, y = _data()
    xs, ys = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
    try:
        for sync in ("per-replica", "global"):
            ddp = DistributedDataParallel(_model())
            opt = regularizers.make(
                f"sam:rho={RHO}",
                torch.optim.SGD(ddp.parameters(), lr=LR),
                model=ddp,
                ascent_sync=sync,
            )

            def closure():
                loss = F.cross_entropy(ddp(xs), ys)
                loss.backward()
                return loss

            for _ in range(STEPS):
                opt.step(closure)
            weights = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
            torch.save(weights, os.path.join(out, f"{sync}-{rank}.pt"))
        _two_calls_accumulated(rank, xs, ys, out)
    finally:
        dist.destroy_process_group()


def _two_calls_accumulated(rank, xs, ys, out) -> None:
    """Per-replica SAM in the two-call form over 2 accumulated micro-batches of the shard:
    every clean backward in ``first_pass()`` (local), the perturbed ones under ``no_sync``
    but the last (davda54/sam issue 94: DDP and accumulation together)."""
    from torch.nn.parallel import DistributedDataParallel

    from sharpcli import regularizers

    ddp = DistributedDataParallel(_model())
    opt = regularizers.make(f"sam:rho={RHO}", torch.optim.SGD(ddp.parameters(), lr=LR), model=ddp)
    micro = list(zip(xs.chunk(2), ys.chunk(2)))
    for _ in range(STEPS):
        for xb, yb in micro:
            with opt.first_pass():
                (F.cross_entropy(ddp(xb), yb) / 2).backward()
        opt.first_step(zero_grad=True)
        for index, (xb, yb) in enumerate(micro):
            with ddp.no_sync() if index == 0 else contextlib.nullcontext():
                (F.cross_entropy(ddp(xb), yb) / 2).backward()
        opt.second_step(zero_grad=True)
    weights = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    torch.save(weights, os.path.join(out, f"accumulated-{rank}.pt"))


def _grad(model, x, y):
    return torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))


def _perturbed_grad(model, x, y, direction):
    """grad L(theta + rho d/||d||) on (x, y), d the given direction; theta restored."""
    norm = torch.sqrt(sum((d * d).sum() for d in direction))
    e = [RHO * d / norm for d in direction]
    with torch.no_grad():
        for p, d in zip(model.parameters(), e):
            p.add_(d)
    g = _grad(model, x, y)
    with torch.no_grad():
        for p, d in zip(model.parameters(), e):
            p.sub_(d)
    return g


def _single_process(sync: str) -> torch.Tensor:
    model = _model()
    x, y = _data()
    for _ in range(STEPS):
        if sync == "global":
            step = _perturbed_grad(model, x, y, _grad(model, x, y))
        else:
            per_shard = [
                _perturbed_grad(model, xs, ys, _grad(model, xs, ys))
                for xs, ys in zip(x.chunk(WORLD), y.chunk(WORLD))
            ]
            step = [sum(parts) / WORLD for parts in zip(*per_shard)]
        with torch.no_grad():
            for p, g in zip(model.parameters(), step):
                p.sub_(LR * g)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_rank_main, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return out


@pytest.mark.parametrize("sync", ["per-replica", "global"])
def test_two_ranks_equal_the_single_process_computation(two_ranks, sync):
    ranks = [torch.load(two_ranks / f"{sync}-{r}.pt") for r in range(WORLD)]
    assert torch.equal(ranks[0], ranks[1])  # the replicas agree
    torch.testing.assert_close(ranks[0], _single_process(sync), rtol=0, atol=1e-13)


def test_two_calls_with_accumulation_under_ddp_are_per_replica_sam(two_ranks):
    ranks = [torch.load(two_ranks / f"accumulated-{r}.pt") for r in range(WORLD)]
    assert torch.equal(ranks[0], ranks[1])
    torch.testing.assert_close(ranks[0], _single_process("per-replica"), rtol=0, atol=1e-13)


def test_the_two_semantics_differ(two_ranks):
    """Per-replica and global ascents are different algorithms here (not vacuous)."""
    a = torch.load(two_ranks / "per-replica-0.pt")
    b = torch.load(two_ranks / "global-0.pt")
    assert (a - b).abs().max() > 1e-6
