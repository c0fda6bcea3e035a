"""Parameter scopes, the analysis set (batch weights, sharding) and the data-parallel reduction."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_cnn, make_data, make_mlp

from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    ParamScope,
    all_reduce_sum,
    exact_ggn_trace,
)
from sharpcli.errors import UsageError


def test_scope_specs_layout_and_blocks():
    model = make_mlp("gelu")  # 0: Linear(4,6), 2: Linear(6,6), 4: Linear(6,3)
    full = ParamScope.resolve(model)
    assert full.names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert full.numel == 24 + 6 + 36 + 6 + 18 + 3 == 93 and full.spec == "all"
    assert ParamScope.resolve(model, "all").names == full.names
    assert ParamScope.resolve(model, "last").names == ["4.weight", "4.bias"]
    assert ParamScope.resolve(model, "*.bias, 0.weight").names == [
        "0.weight",
        "0.bias",
        "2.bias",
        "4.bias",
    ]
    assert list(full.blocks().items()) == [
        ("0", slice(0, 30)),
        ("2", slice(30, 72)),
        ("4", slice(72, 93)),
    ]
    assert ParamScope.resolve(make_cnn(), "last").names == ["4.weight", "4.bias"]
    assert list(ParamScope.resolve(make_cnn()).blocks()) == ["0", "1", "4"]  # conv, batchnorm, head
    vec = torch.arange(93, dtype=torch.float64)
    parts = full.unflatten(vec)
    assert [tuple(p.shape) for p in parts] == [(6, 4), (6,), (6, 6), (6,), (3, 6), (3,)]
    assert parts[2][0, 0] == 30 and torch.equal(full.flatten(parts), vec)


def test_scope_errors_name_the_option():
    model = make_mlp("gelu")
    with pytest.raises(UsageError, match="matches no parameter") as info:
        ParamScope.resolve(model, "encoder.*")
    assert info.value.source == "params"
    frozen = make_mlp("gelu")
    for p in frozen[4].parameters():
        p.requires_grad_(False)
    with pytest.raises(UsageError, match="no trainable"):
        ParamScope.resolve(frozen, "last")
    assert "4.weight" not in ParamScope.resolve(frozen).names
    with pytest.raises(UsageError):
        ParamScope.resolve(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3)), "last")


def test_seeded_probes():
    scope = ParamScope.resolve(make_mlp("gelu"))
    a = scope.rademacher(torch.Generator().manual_seed(3), 4)
    b = scope.rademacher(torch.Generator().manual_seed(3), 4)
    assert a.shape == (93, 4) and a.dtype == torch.float64 and torch.equal(a, b)
    assert set(a.unique().tolist()) == {-1.0, 1.0}
    g = scope.gaussian(torch.Generator().manual_seed(3))
    assert g.shape == (93,) and not torch.equal(g, scope.gaussian(torch.Generator().manual_seed(4)))


def test_batches_weights_and_validation():
    x, y = make_data("vector")
    data = AnalysisData(x, y, "cross-entropy", 5)
    batches = list(data.batches())
    assert [b[0].shape[0] for b in batches] == [5, 5, 5, 5, 3] and data.num_batches == 5
    assert [b[2] for b in batches] == [5 / 23] * 4 + [3 / 23]
    assert torch.equal(torch.cat([b[0] for b in batches]), x)
    with pytest.raises(UsageError) as info:
        AnalysisData(x, y, "cross-entropy", 0)
    assert info.value.source == "batch_size"
    with pytest.raises(UsageError) as info:
        AnalysisData(x, y, "hinge", 4)
    assert info.value.source == "loss"  # the library names its parameter
    t = torch.ones(3)
    assert all_reduce_sum(t) is t and all_reduce_sum(2.5) == 2.5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, world, port, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = make_mlp("gelu")
        x, y = make_data("vector")
        data = AnalysisData(x, y, "cross-entropy", 4)
        scope = ParamScope.resolve(model)
        v = scope.gaussian(torch.Generator().manual_seed(0))
        Hv, Gv = CurvatureEngine(model, data, scope).hessian_and_ggn_matvec(v)
        loss, grad = CurvatureEngine(model, data, scope).loss_and_gradient()
        trace = exact_ggn_trace(model, data, scope).estimate
        out[rank] = (data.local_num_samples, data.num_samples, Hv, Gv, loss, grad, trace)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_data_parallel_equals_single_process():
    world = 2
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_rank_main, args=(world, _free_port(), out), nprocs=world, join=True)
    model = make_mlp("gelu")
    x, y = make_data("vector")
    data = AnalysisData(x, y, "cross-entropy", 23)
    scope = ParamScope.resolve(model)
    v = scope.gaussian(torch.Generator().manual_seed(0))
    Hv, Gv = CurvatureEngine(model, data, scope).hessian_and_ggn_matvec(v)
    loss, grad = CurvatureEngine(model, data, scope).loss_and_gradient()
    trace = exact_ggn_trace(model, data, scope).estimate
    assert [out[r][0] for r in range(world)] == [11, 12]  # contiguous shards, N stays global
    for r in range(world):
        local, total, Hv_r, Gv_r, loss_r, grad_r, trace_r = out[r]
        assert total == 23
        assert torch.allclose(Hv_r, Hv, atol=1e-14, rtol=0) and torch.allclose(
            Gv_r, Gv, atol=1e-14, rtol=0
        )
        assert loss_r == pytest.approx(loss, abs=1e-14) and torch.allclose(
            grad_r, grad, atol=1e-14, rtol=0
        )
        assert trace_r == pytest.approx(trace, abs=1e-13)
