"""The cross-entropy's logit gradient and Hessian by chunks of rows (large vocabularies).

References: autograd's own cross-entropy, differentiated once and twice (the loss's value,
``g_z`` and ``H_z u``), the engine's unchunked products (autograd's cross-entropy
differentiated twice, ``vocab_chunk=0``) and the dense double-backward Hessian; float64,
agreement to 1e-12 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fixtures.causal_lm import build_causal_lm, next_token_data
from sharpcli import memory
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.curvature.products.softmax_chunks import SoftmaxRows, VocabChunking
from sharpcli.losses import get_loss, token_reduction
from tests.hessian_helpers import double_backward_hessian

PRODUCTS = ("hessian_matmat", "ggn_matmat", "nme_matmat", "hessian_and_ggn_matmat")


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-12) -> None:
    scale = max(float(a.abs().max()), 1e-300)
    assert float((a - b).abs().max()) <= rel * scale, float((a - b).abs().max()) / scale


def _products(engine: CurvatureEngine, V: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for name in PRODUCTS:
        result = getattr(engine, name)(V)
        out.extend(result if isinstance(result, tuple) else (result,))
    out.append(engine.loss_and_gradient()[1])
    return out


def _token_logits(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 4, 7, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 7, (3, 4), generator=gen)
    y[0, 2:] = -100
    y[2, 0] = -100
    return z, y, gen


@pytest.mark.parametrize("reduction", ["tokens", "samples"])
@pytest.mark.parametrize("chunk", [1, 5, 12])
def test_rows_match_autograd_cross_entropy(reduction, chunk):
    """loss, g_z and H_z u (one direction, a block of two, in place) of SoftmaxRows against
    token-cross-entropy differentiated by autograd, ignored positions included."""
    z, y, gen = _token_logits()
    loss = get_loss("token-cross-entropy")
    with token_reduction(reduction, y):
        rows = SoftmaxRows.of_batch("token-cross-entropy", z, y, 0.4, chunk)
        leaf = z.clone().requires_grad_(True)
        value = loss.mean(leaf, y) * 0.4
        (gz,) = torch.autograd.grad(value, leaf, create_graph=True)
        assert float(rows.loss(z)) == pytest.approx(value.item(), rel=1e-14)
        _close(gz.detach(), rows.gradient(z), 1e-14)
        U = torch.randn(2, *z.shape, generator=gen, dtype=torch.float64)
        hu = [torch.autograd.grad(gz, leaf, u, retain_graph=True)[0] for u in U]
        _close(hu[0], rows.hessian_matvec(z, U[0]))
        _close(torch.stack(hu), rows.hessian_matvec(z, U))
        _close(hu[1], rows.hessian_matvec_differentiable(z, U[1]))
        in_place = U[1].clone()
        assert rows.hessian_matvec(z, in_place, out=in_place) is not None
        _close(hu[1], in_place)
    assert float(rows.gradient(z).view(-1, 7)[2:4].abs().max()) == 0.0  # ignored positions


def test_rows_of_class_logits():
    """`cross-entropy` on (batch, classes): rows are the samples, each weighing weight / B."""
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 9, (6,), generator=gen)
    rows = SoftmaxRows.of_batch("cross-entropy", z, y, 0.5, 4)
    leaf = z.clone().requires_grad_(True)
    value = F.cross_entropy(leaf, y) * 0.5
    (gz,) = torch.autograd.grad(value, leaf, create_graph=True)
    u = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    (hu,) = torch.autograd.grad(gz, leaf, u)
    assert float(rows.loss(z)) == pytest.approx(value.item(), rel=1e-14)
    _close(gz.detach(), rows.gradient(z), 1e-14)
    _close(hu, rows.hessian_matvec(z, u))


@pytest.mark.parametrize("reduction", ["tokens", "samples"])
@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("vectorize", [1, 3])
def test_chunked_products_equal_unchunked_on_a_causal_lm(reduction, chunk, vectorize):
    """H, G, N, joint H+G and the gradient of a causal transformer LM with padded positions:
    chunks of 1 and 5 rows (of 12-16) equal autograd's cross-entropy, column by column
    and vmapped."""
    model = build_causal_lm(seed=3)
    x, y = next_token_data(7, seed=4)
    with token_reduction(reduction, y):
        data = AnalysisData(x, y, "token-cross-entropy", 4)
        scope = ParamScope.resolve(model)
        V = torch.randn(scope.numel, 3, generator=torch.Generator().manual_seed(5)).double()
        reference = _products(CurvatureEngine(model, data, scope, vocab_chunk=0), V)
        chunked = CurvatureEngine(model, data, scope, vocab_chunk=chunk, vectorize=vectorize)
        for ours, theirs in zip(_products(chunked, V), reference):
            _close(theirs, ours)
        assert chunked.cached_batches == 2 and all(
            g.softmax is not None for g in chunked._cache.values()
        )
        if chunk == 5 and vectorize == 1:  # and the dense Hessian by double backward
            with twice_differentiable():  # the math attention backend
                loss_fn = get_loss("token-cross-entropy").mean
                dense = double_backward_hessian(model, list(model.parameters()), x, y, loss_fn)
            _close(dense @ V, chunked.hessian_matmat(V), 1e-10)


def test_chunked_products_equal_unchunked_for_class_logits():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 9)).double()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(10, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 9, (10,), generator=gen)
    data = AnalysisData(x, y, "cross-entropy", 4)
    scope = ParamScope.resolve(model)
    V = torch.randn(scope.numel, 2, generator=gen, dtype=torch.float64)
    reference = _products(CurvatureEngine(model, data, scope, vocab_chunk=0), V)
    for ours, theirs in zip(
        _products(CurvatureEngine(model, data, scope, vocab_chunk=3), V), reference
    ):
        _close(theirs, ours)


def test_k_dimensional_cross_entropy_with_ignore_index_chunked():
    """nn.CrossEntropyLoss(ignore_index=1) on (N, C, d1, d2) outputs (read as token
    cross-entropy over the positions): chunked products equal unchunked ones."""
    from sharpcli import Curvature

    class Segmenter(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4 * 2 * 3))

        def forward(self, x):
            return self.body(x).view(x.shape[0], 4, 2, 3)

    torch.manual_seed(2)
    model = Segmenter().double()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (9, 2, 3), generator=gen)
    curvature = Curvature(model, nn.CrossEntropyLoss(ignore_index=1), (x, y), batch_size=4)
    assert curvature.data.loss == "token-cross-entropy"
    view, data, scope = curvature._view, curvature.data, curvature.scope
    V = torch.randn(scope.numel, 2, generator=gen, dtype=torch.float64)
    reference = _products(CurvatureEngine(view, data, scope, vocab_chunk=0), V)
    for chunk in (2, 13):  # within a sample's 6 positions, and two whole samples
        chunked = CurvatureEngine(view, data, scope, vocab_chunk=chunk)
        for ours, theirs in zip(_products(chunked, V), reference):
            _close(theirs, ours)
        graph = next(iter(chunked._cache.values()))
        assert not graph.z.is_contiguous() and graph.softmax.block_rows == min(chunk, 12)


def test_automatic_chunking_and_its_plan():
    """None chunks only logits beyond one chunk; 0 never; other losses never; the plan's
    chunk is at most 1/64 of the room and its work is in the product workspace."""
    z = torch.zeros(2, 5, 8, dtype=torch.float64)  # 10 rows of 64 bytes
    y = torch.zeros(2, 5, dtype=torch.long)
    assert VocabChunking("token-cross-entropy").rows(z, y, 1.0) is None  # within 16 MiB
    rows = VocabChunking("token-cross-entropy", chunk_bytes=200).rows(z, y, 1.0)
    assert rows is not None and rows.chunk == 3 and rows.block_rows == 3
    assert VocabChunking("token-cross-entropy", 0, chunk_bytes=200).rows(z, y, 1.0) is None
    assert VocabChunking("mse", chunk_bytes=200).rows(z.view(2, 40), y, 1.0) is None
    assert VocabChunking("token-cross-entropy", 4).rows(z, y, 1.0).chunk == 4
    transposed = VocabChunking("token-cross-entropy", chunk_bytes=200).rows(
        z.transpose(0, 1), y.T, 1.0
    )  # any strides: chunks are views, of whole samples when one fits
    assert transposed.labels.shape == (5, 2) and transposed.block_rows == 2
    with pytest.raises(ValueError, match="vocab_chunk"):
        VocabChunking("cross-entropy", -1)

    model = build_causal_lm(seed=1)
    x, y = next_token_data(4, seed=2)
    with token_reduction("tokens", y):
        engine = CurvatureEngine(
            model, AnalysisData(x, y, "token-cross-entropy", 4), ParamScope.resolve(model)
        )
        plan = memory.MemoryPlan(budget=memory.rss_bytes() + 64 * 200)
        engine.chunking.fit_budget(64 * 200)
        assert engine.chunking.chunk_bytes == 200
        plan.budget = memory.rss_bytes() + (1 << 30)
        engine.plan_memory(plan)
    assert engine.chunking.chunk_bytes == 16 << 20  # a large room: the default chunk
    assert not any("by chunks" in note for note in plan.choices)  # 16 x 5 logits fit one

    with token_reduction("tokens", y):
        engine = CurvatureEngine(
            model,
            AnalysisData(x, y, "token-cross-entropy", 4),
            ParamScope.resolve(model),
            vocab_chunk=3,
        )
        plan = memory.MemoryPlan(budget=memory.rss_bytes() + (1 << 30))
        engine.plan_memory(plan)
    graph = next(iter(engine._cache.values()))
    assert "cross-entropy over 16 x 5 logits by chunks of 3 rows" in " ".join(plan.choices)
    gradient = sum(g.numel() * g.element_size() for g in graph.grads)  # counted once
    # the largest parameter's gradient-of-gradient temporary (one batch: no batch block)
    largest = max(p.numel() for p in engine.scope.params) * 8
    assert (
        plan.items[memory.PRODUCT_WORKSPACE]
        == 2 * graph.nbytes - gradient + 3 * 3 * 5 * 8 + largest
    )
