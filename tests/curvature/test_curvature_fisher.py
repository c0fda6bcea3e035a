"""The Fisher operators (sharpcli/curvature/operators/fisher.py) against dense float64 references.

EF: ``(1/N) sum_i g_i g_i^T`` from per-sample gradients of the per-sample loss (one backward
pass per sample). Fisher: the same at the operator's drawn labels, and its expectation over
the labels, enumerated exactly on a tiny model, is the Gauss-Newton matrix of the engine.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from cli_helpers import run_cli
from torch import nn

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope, build_operator
from sharpcli.curvature.operators.fisher import (
    EmpiricalFisherOperator,
    FisherOperator,
    fisher_residuals,
)
from sharpcli.curvature.operators.registry import OPERATORS
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss, token_reduction


def _flat_grad(model, loss) -> torch.Tensor:
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).reshape(-1)
            for p, g in zip(model.parameters(), grads)
        ]
    )


def _setup(loss: str, n: int = 7, seed: int = 0):
    """A float64 tanh MLP (or a tiny sequence model for the token loss) and data."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if loss == "token-cross-entropy":
        model = nn.Sequential(nn.Embedding(5, 3), nn.Tanh(), nn.Linear(3, 4)).double().eval()
        x = torch.randint(0, 5, (n, 3), generator=gen)
        y = torch.randint(0, 4, (n, 3), generator=gen)
        y[0, 1] = y[3, 0] = y[3, 2] = -100  # unlabelled positions, unequal counts
        return model, x, y
    outputs = 1 if loss == "binary-cross-entropy" else 3
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, outputs)).double().eval()
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    if loss == "mse":
        y = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    elif loss == "binary-cross-entropy":
        y = torch.randint(0, 2, (n, 1), generator=gen).double()
    else:
        y = torch.randint(0, 3, (n,), generator=gen)
    return model, x, y


def _dense_outer(model, x, labels_per_sample, loss: str, weights=None) -> torch.Tensor:
    """``sum_i w_i g_i g_i^T`` with ``g_i = grad l(f(x_i), labels_i)`` (``w_i = 1/N`` default)."""
    per_sample = get_loss(loss).per_sample
    n = x.shape[0]
    total = 0.0
    for i in range(n):
        g = _flat_grad(model, per_sample(model(x[i : i + 1]), labels_per_sample[i][None]).sum())
        w = 1.0 / n if weights is None else weights[i]
        total = total + w * torch.outer(g, g)
    return total


LOSSES = ["cross-entropy", "mse", "binary-cross-entropy", "token-cross-entropy"]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("batch_size", [3, 7])
def test_empirical_fisher_equals_the_mean_outer_product_of_per_sample_gradients(loss, batch_size):
    model, x, y = _setup(loss)
    with token_reduction("tokens", y if loss == "token-cross-entropy" else None):
        reference = _dense_outer(model, x, y, loss)
        data = AnalysisData(x, y, loss, batch_size=batch_size)
        engine = CurvatureEngine(model, data, ParamScope.resolve(model))
        F = build_operator("ef", engine).to_dense()
        engine.vectorize, engine._batched_ok = 4, True  # the vmapped columns give the same matrix
        F_vmapped = EmpiricalFisherOperator(engine).to_dense()
    assert reference.abs().max() > 1e-3
    assert torch.allclose(F, reference, atol=1e-12, rtol=0)
    assert torch.allclose(F_vmapped, reference, atol=1e-12, rtol=0)


@pytest.mark.parametrize("loss", LOSSES)
def test_fisher_equals_the_outer_products_at_its_drawn_labels(loss):
    """The operator with 2 draws per sample against (1/(2N)) sum_is g_is g_is^T at the same
    labels (each token position's gradient weighted by sqrt(w_t))."""
    model, x, y = _setup(loss)
    with token_reduction("tokens", y if loss == "token-cross-entropy" else None):
        data = AnalysisData(x, y, loss, batch_size=3)
        engine = CurvatureEngine(model, data, ParamScope.resolve(model))
        fisher = FisherOperator(engine, samples=2, seed=5)
        F = fisher.to_dense()
        with torch.no_grad():
            z = model(x)
        labels = torch.cat([fisher.labels(b, z[3 * b : 3 * b + 3]) for b in range(3)], dim=1)
        if loss == "token-cross-entropy":
            # r_t / sqrt(w_t): the gradient of sum_t sqrt(w_t) CE_t, weights from the data's labels
            from sharpcli.losses import token_weights

            w = token_weights(z, y)
            per_sample = (
                lambda i, lab: (  # noqa: E731
                    torch.nn.functional.cross_entropy(
                        model(x[i : i + 1])[0], lab, ignore_index=-100, reduction="none"
                    )
                    * w[i].sqrt()
                ).sum()
            )
        else:
            per_sample = (
                lambda i, lab: (
                    get_loss(loss)
                    .per_sample(  # noqa: E731
                        model(x[i : i + 1]), lab[None]
                    )
                    .sum()
                )
            )
        reference = 0.0
        for s in range(2):
            for i in range(x.shape[0]):
                g = _flat_grad(model, per_sample(i, labels[s, i]))
                reference = reference + torch.outer(g, g) / (2 * x.shape[0])
    assert torch.allclose(F, reference, atol=1e-12, rtol=0)
    # labels differ between draws and from the data (a sampled, not the empirical, Fisher)
    assert not torch.equal(labels[0], labels[1])


def _enumerated_fisher(model, x, y, loss: str) -> torch.Tensor:
    """``(1/N) sum_i E_{y^ ~ p(.|z_i)} g(y^) g(y^)^T`` by summing over every label (every
    combination of the positions' labels for the token loss), residuals from
    :func:`fisher_residuals`."""
    n = x.shape[0]
    total = 0.0
    for i in range(n):
        z = model(x[i : i + 1])
        if loss == "binary-cross-entropy":
            q = torch.sigmoid(z.detach())[0, 0]
            outcomes = [
                (torch.tensor([[1.0]], dtype=z.dtype), q),
                (torch.zeros(1, 1).double(), 1 - q),
            ]
        elif loss == "token-cross-entropy":
            p = torch.softmax(z.detach()[0], -1)  # (T, V)
            T, V = p.shape
            outcomes = []
            for combo in itertools.product(range(V), repeat=T):
                lab = torch.tensor(combo)[None]
                lab = torch.where(y[i : i + 1] == -100, -100, lab)
                prob = torch.prod(
                    torch.stack(
                        [
                            p[t, c] if y[i, t] != -100 else p.new_tensor(1.0 / V)
                            for t, c in enumerate(combo)
                        ]
                    )
                )
                outcomes.append((lab, prob))
        else:
            p = torch.softmax(z.detach(), -1)[0]
            outcomes = [(torch.tensor([c]), p[c]) for c in range(p.shape[0])]
        for lab, prob in outcomes:
            z = model(x[i : i + 1])
            r = fisher_residuals(loss, z, lab, y[i : i + 1])
            g = _flat_grad(model, (z * r.detach()).sum())  # J^T r
            total = total + prob * torch.outer(g, g) / n
    return total


@pytest.mark.parametrize("loss", ["cross-entropy", "binary-cross-entropy", "token-cross-entropy"])
def test_the_fishers_expectation_over_labels_is_the_gauss_newton_matrix(loss):
    model, x, y = _setup(loss, n=5)
    with token_reduction("tokens", y if loss == "token-cross-entropy" else None):
        expected = _enumerated_fisher(model, x, y, loss)
        data = AnalysisData(x, y, loss, batch_size=2)
        G = build_operator(
            "ggn", CurvatureEngine(model, data, ParamScope.resolve(model))
        ).to_dense()
    assert G.abs().max() > 1e-3
    assert torch.allclose(expected, G, atol=1e-12, rtol=0)


def test_mse_fisher_residuals_have_the_logit_hessian_as_covariance():
    """mse: y^ ~ N(z, (C/2) I) gives E[r r^T] = (2/C) I = H_z (the unit-variance Gaussian's
    would be (C/2)^2 times larger): the covariance of 40000 draws within 3%."""
    z = torch.zeros(40000, 4, dtype=torch.float64)
    labels = get_loss("mse").sample_labels(z, torch.Generator().manual_seed(0))
    r = fisher_residuals("mse", z, labels)
    cov = r.T @ r / r.shape[0]
    assert torch.allclose(cov, 0.5 * torch.eye(4, dtype=torch.float64), atol=0.015)


def test_many_draws_approach_the_gauss_newton_matrix_and_the_empirical_fisher_does_not():
    model, x, y = _setup("cross-entropy", n=6)
    data = AnalysisData(x, y, "cross-entropy", batch_size=6)
    engine = CurvatureEngine(model, data, ParamScope.resolve(model))
    G = engine.ggn().to_dense()
    errors = []
    for samples in (50, 3200):
        F = FisherOperator(engine, samples=samples, seed=1).to_dense()
        errors.append(float((F - G).norm() / G.norm()))
    assert errors[1] < 0.05 and errors[1] < errors[0] / 3  # 1/sqrt(S): 8x fewer expected
    ef = EmpiricalFisherOperator(engine).to_dense()
    assert float((ef - G).norm() / G.norm()) > 0.1


def test_registry_records_and_bad_input():
    assert OPERATORS["ef"].psd and OPERATORS["fisher"].psd
    assert OPERATORS["ef"].rank_bound(23, 3, "cross-entropy") == 23
    model, x, y = _setup("cross-entropy")
    engine = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 3), ParamScope.resolve(model)
    )
    with pytest.raises(UsageError) as info:
        FisherOperator(engine, samples=0)
    assert info.value.source == "samples"
    # the subsample rebuild keeps the draws' settings
    sub, kept, total = FisherOperator(engine, samples=3, seed=2).on_subsample(0.5, seed=0)
    assert isinstance(sub, FisherOperator) and (sub.samples, sub.seed) == (3, 2) and kept < total


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    spec = tiny_mlp_spec(d_in=4, classes=3, width=6, depth=1, activation="gelu")
    folder = tmp_path_factory.mktemp("fisher")
    return str(write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5))


DATA = "blobs:n=40,dim=4,classes=3,seed=4"


@pytest.mark.parametrize("command", ["eigen", "trace", "density"])
def test_cli_runs_the_fisher_operators(capsys, tiny_checkpoint, command):
    extra = {"eigen": ["--top-k", "2"], "trace": ["--tol", "0.2"], "density": ["--probes", "2"]}
    for operator in ("ef", "fisher"):
        run = run_cli(
            capsys,
            command,
            tiny_checkpoint,
            "--operator",
            operator,
            "--dtype",
            "float64",
            "--json",
            "-",
            *extra[command],
        )
        assert run.code == 0, run.err
        results = run.json()["results"]
        assert results["operator"] == operator
        if command == "eigen":
            assert min(results["eigenvalues"]) > 0


def test_api_curvature_takes_the_fisher_operators():
    from sharpcli import Curvature

    model, x, y = _setup("cross-entropy", n=9)
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y), batch_size=4)
    reference = _dense_outer(model, x, y, "cross-entropy")
    assert torch.allclose(curvature.operator("ef").to_dense(), reference, atol=1e-12, rtol=0)
    top = curvature.eigenvalues(top_k=1, tol=1e-10, operator="ef")
    assert top.eigenvalues[0] == pytest.approx(
        float(torch.linalg.eigvalsh(reference)[-1]), rel=1e-8
    )
    G = curvature.operator("ggn").to_dense()
    fisher = curvature.operator("fisher").to_dense()
    assert torch.linalg.eigvalsh(fisher)[0] > -1e-12 and not torch.allclose(fisher, G)
