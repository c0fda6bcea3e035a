"""The penalties of sharpcli.regularizers as loss terms: their precision under autocast and
a grad scaler, the activation hook, and what they refuse. (Their values and gradients equal
sharp train's, which the paper audit checks: tests/docs/test_paper_audit.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli import regularizers
from sharpcli.errors import UsageError


def _mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 5, generator=gen, dtype=dtype), torch.randint(0, 3, (32,), generator=gen)


def _term_and_grad(model, spec, x, y, autocast=None, scaler=None):
    pen = regularizers.make(spec, model=model, generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    term = pen(loss, logits, y)
    total = loss + term
    (scaler.scale(total) if scaler is not None else total).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if scaler is not None:
        grads = grads / scaler.get_scale()
    pen.remove()
    return term, grads


SPECS = [
    "wd:sigma=0.3",
    "ad:sigma=0.5",
    "gp:rho=0.1",
    "hessian-trace:sigma2=0.1",
    "gn-trace",
    "fa:lambda=0.1",
]


@pytest.mark.parametrize("spec", SPECS)
def test_under_bf16_autocast_the_term_is_float32_and_near_the_float32_term(spec):
    x, y = _batch()
    reference, ref_grad = _term_and_grad(_mlp(), spec, x, y)
    term, grad = _term_and_grad(_mlp(), spec, x, y, autocast=torch.bfloat16)
    assert term.dtype == torch.float32
    eps = torch.finfo(torch.bfloat16).eps
    assert (
        abs(float(term.detach()) - float(reference.detach()))
        <= 2 * eps * abs(float(reference.detach())) + 1e-6
    )
    assert (grad - ref_grad).norm() <= 2 * eps * ref_grad.norm()


@pytest.mark.parametrize("spec", ["wd:sigma=0.3", "gp:rho=0.1"])
def test_a_scaled_backward_gives_the_unscaled_gradient(spec):
    """The term added to the unscaled loss, the sum scaled (2^10): the same gradient once
    unscaled (powers of two scale exactly)."""
    x, y = _batch()
    _, want = _term_and_grad(_mlp(), spec, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _, got = _term_and_grad(_mlp(), spec, x, y, scaler=scaler)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_activation_decay_reads_the_input_of_the_final_linear():
    model, (x, y) = _mlp(torch.float64), _batch(torch.float64)
    pen = regularizers.make("ad:sigma=0.5", model=model)
    logits = model(x)
    h = model[1](model[0](x))
    want = 0.5**2 / 2 * h.pow(2).sum(dim=1).mean()
    torch.testing.assert_close(pen(F.cross_entropy(logits, y), logits, y), want, rtol=1e-14, atol=0)
    pen.remove()
    assert not model[2]._forward_hooks


def test_penalties_refuse_what_they_cannot_run():
    model = _mlp()
    with pytest.raises(UsageError, match="mode=exact"):
        regularizers.make("gp:mode=fd", model=model)
    with pytest.raises(UsageError, match="model=model"):
        regularizers.make("wd")
    with pytest.raises(UsageError, match="not an additive penalty"):
        regularizers.LossPenalty(
            copy.copy(
                regularizers.make("sam", torch.optim.SGD(model.parameters(), lr=1)).regularizer
            ),
            model,
        )
