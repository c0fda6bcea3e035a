"""Loss.sample_labels: one sampler per loss, drawing from the model's predictive distribution.

Checked against the distribution itself (label frequencies and moments against the model's
probabilities) and against what the sampled-label estimators rely on: ``E[r r^T] = H_z`` for
the output gradient ``r`` at a drawn label, and ``E[g g^T] = G = J^T H_z J`` on a tiny float64
model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharpcli.curvature import AnalysisData, ParamScope
from sharpcli.curvature.trace.ggn import exact_ggn_trace
from sharpcli.curvature.trace.sampled_ggn import sampled_label_ggn_trace
from sharpcli.errors import UsageError
from sharpcli.losses import IGNORE_INDEX, LOSSES, get_loss

DRAWS = 40_000


def _outputs(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    if name == "binary-cross-entropy":
        return torch.randn(4, generator=gen, dtype=torch.float64)
    if name == "token-cross-entropy":
        return torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    return torch.randn(3, 4, generator=gen, dtype=torch.float64)


# losses whose output Hessian depends on the observed target (a piecewise second derivative):
# no distribution's gradients give it in expectation, so they draw no labels
NO_SAMPLER = ("huber", "smooth-l1", "bce-probabilities")


def test_every_loss_has_a_sampler():
    assert all((loss.sampler is None) == (name in NO_SAMPLER) for name, loss in LOSSES.items())


@pytest.mark.parametrize("name", ["cross-entropy", "token-cross-entropy"])
def test_categorical_frequencies_are_the_softmax(name):
    z = _outputs(name)
    labels = get_loss(name).sample_labels(
        z.expand(DRAWS, *z.shape), torch.Generator().manual_seed(11)
    )
    assert labels.shape == (DRAWS, *z.shape[:-1]) and labels.dtype == torch.int64
    p = torch.softmax(z, dim=-1)
    freq = torch.nn.functional.one_hot(labels, z.shape[-1]).to(torch.float64).mean(0)
    stderr = (p * (1 - p) / DRAWS).sqrt()
    assert ((freq - p).abs() <= 4.5 * stderr + 1e-12).all()


def test_bernoulli_frequencies_are_the_sigmoid():
    z = _outputs("binary-cross-entropy")  # one logit for each of 4 samples
    labels = get_loss("binary-cross-entropy").sample_labels(
        z.repeat(DRAWS), torch.Generator().manual_seed(11)
    )
    assert set(labels.unique().tolist()) <= {0.0, 1.0} and labels.dtype == z.dtype
    p = torch.sigmoid(z)
    stderr = (p * (1 - p) / DRAWS).sqrt()
    assert ((labels.reshape(DRAWS, -1).mean(0) - p).abs() <= 4.5 * stderr).all()


def test_gaussian_moments_are_the_mse_likelihood():
    z = _outputs("mse")  # l = (1/C)||z - y||^2 is the NLL of N(z, (C/2) I) up to constants
    labels = get_loss("mse").sample_labels(
        z.expand(DRAWS, *z.shape), torch.Generator().manual_seed(11)
    )
    variance = z.shape[-1] / 2.0
    assert ((labels.mean(0) - z).abs() <= 4.5 * (variance / DRAWS) ** 0.5).all()
    # the sample variance of a Gaussian has standard error variance * sqrt(2 / (n - 1))
    assert ((labels.var(0) - variance).abs() <= 4.5 * variance * (2 / DRAWS) ** 0.5).all()


def test_token_labels_keep_the_unlabelled_positions():
    z = _outputs("token-cross-entropy")
    y = torch.tensor([[1, IGNORE_INDEX, 2], [IGNORE_INDEX, 0, 3]])
    labels = get_loss("token-cross-entropy").sample_labels(z, torch.Generator(), y=y)
    assert torch.equal(labels == IGNORE_INDEX, y == IGNORE_INDEX)
    assert bool(((labels[y != IGNORE_INDEX] >= 0) & (labels[y != IGNORE_INDEX] < 4)).all())


def test_draws_are_a_map_of_keyed_random_numbers():
    """labels_from_noise is deterministic: the same numbers give the same labels, on any
    split of the batch (what makes sampled traces independent of batch size and ranks)."""
    for name in LOSSES:
        if name in NO_SAMPLER:
            continue
        loss = get_loss(name)
        z = _outputs(name)
        gen = torch.Generator().manual_seed(5)
        draw = torch.rand if loss.sampler.noise == "uniform" else torch.randn
        noise = draw(loss.label_noise_shape(z), generator=gen, dtype=torch.float64)
        whole = loss.labels_from_noise(z, noise)
        halves = torch.cat(
            [loss.labels_from_noise(z[:1], noise[:1]), loss.labels_from_noise(z[1:], noise[1:])]
        )
        assert torch.equal(whole, halves), name
        again = loss.sample_labels(z, torch.Generator().manual_seed(5))
        assert torch.equal(again, whole), name


def test_multi_label_draws_give_the_output_hessian():
    """(B, K) logits, the mean over K labels: the drawn targets' output gradients have second
    moment H_z = diag(s (1 - s)) / K (a plain Bernoulli draw would give 1/K^2)."""
    loss = get_loss("binary-cross-entropy")
    z = torch.tensor([[0.3, -1.2, 2.0]], dtype=torch.float64).expand(DRAWS, 3).clone()
    labels = loss.sample_labels(z, torch.Generator().manual_seed(4))
    zz = z.clone().requires_grad_(True)
    (r,) = torch.autograd.grad(loss.per_sample(zz, labels).sum(), zz)
    s = torch.sigmoid(z[0])
    second_moment = r.T @ r / DRAWS
    expected = torch.diag(s * (1 - s) / 3)
    assert torch.allclose(second_moment, expected, atol=5 * float(expected.max()) / DRAWS**0.5)


@pytest.mark.parametrize("name", ["cross-entropy", "binary-cross-entropy", "mse"])
def test_expected_outer_product_of_gradients_is_the_gauss_newton_matrix(name):
    """E_{y^}[g g^T] = J^T H_z J on a tiny float64 model: the output gradients' second moment
    is H_z (Fisher information of the predictive distribution), and so the parameters'."""
    torch.manual_seed(0)
    outputs = 1 if name == "binary-cross-entropy" else 3
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, outputs)).double()
    x = torch.randn(1, 2, dtype=torch.float64)
    loss = get_loss(name)
    params = [p for p in model.parameters()]

    def logits():
        z = model(x)
        return z.reshape(1) if name == "binary-cross-entropy" else z

    z = logits().detach()
    labels = loss.sample_labels(
        z.expand(DRAWS, *z.shape[1:]).clone(), torch.Generator().manual_seed(2)
    )
    # output gradients of the per-sample loss at each drawn label: r = d l(z, y^) / dz
    zz = z.expand(DRAWS, *z.shape[1:]).clone().requires_grad_(True)
    (r,) = torch.autograd.grad(loss.per_sample(zz, labels).sum(), zz)
    r = r.reshape(DRAWS, -1)
    second_moment = r.T @ r / DRAWS
    width = r.shape[1]
    eye = torch.eye(width, dtype=torch.float64)
    Hz = torch.stack(
        [loss.hessian_matvec(z, None, eye[c].reshape(z.shape)).reshape(-1) for c in range(width)]
    )
    assert torch.allclose(second_moment, Hz, atol=5 * float(Hz.abs().max()) / DRAWS**0.5)
    # parameters: g = J^T r, so E[g g^T] = J^T E[r r^T] J = G
    J = torch.stack(
        [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(logits().reshape(-1)[c], params)])
            for c in range(width)
        ]
    )
    G = J.T @ Hz @ J
    sampled = J.T @ second_moment @ J
    assert float((sampled - G).norm()) <= 0.05 * float(G.norm())


def test_sampled_label_trace_of_binary_cross_entropy_matches_the_exact_trace():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 1)).double()
    x = torch.randn(30, 3, dtype=torch.float64)
    y = (torch.randn(30, dtype=torch.float64) > 0).to(torch.float64)
    data = AnalysisData(x, y, "binary-cross-entropy", batch_size=7)
    scope = ParamScope.resolve(model)
    exact = exact_ggn_trace(model, data, scope).estimate
    result = sampled_label_ggn_trace(
        model, data, scope, samples=4, generator=torch.Generator().manual_seed(3)
    )
    assert 0 < result.stderr < 0.5 * exact
    assert abs(result.estimate - exact) <= 4 * result.stderr


def test_sampled_label_trace_refuses_a_per_token_loss():
    model = nn.Linear(3, 4).double()
    data = AnalysisData(
        torch.randn(2, 5, 3, dtype=torch.float64),
        torch.zeros(2, 5, dtype=torch.int64),
        "token-cross-entropy",
        batch_size=2,
    )
    with pytest.raises(UsageError, match="one predictive distribution per sample"):
        sampled_label_ggn_trace(model, data, ParamScope.resolve(model))
