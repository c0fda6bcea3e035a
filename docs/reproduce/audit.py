"""Audit: every regularizer and diagnostic of ``sharp`` against its paper's formula, on digits.

Each row compares what ``sharpcli`` computes with an independent computation of the
paper's formula in plain torch (a hand-written functional MLP, explicit Hessians and
Jacobians, forward-mode derivatives), on real data: scikit-learn's bundled handwritten
digits (``fixtures/make_digits_data.py``). The models are tiny so that the Hessian can be
formed explicitly: MLPs 64-4-4-10 (330 parameters) in float64.

- *Regularizers* (``sharp train --reg``): the penalty's value and its part of the step
  gradient from :func:`sharpcli.regularizers.registry.training_step` (step gradient minus
  the plain gradient; for an oracle the whole gradient) on one batch of 64 digits, against
  the formula evaluated independently with the same random draw (the draw is reproduced
  from the step's seeded generator as ``sharpcli.regularizers.step`` documents it).
- *Diagnostics* (``sharp gn-nme``, ``bound-check``, ``weight-rescale``,
  ``activation-stats``): the ``--json`` report of the command run in-process on a tiny
  checkpoint trained on the digits file (``--dtype float64``), against the same quantity
  from the explicit Hessian, Gauss-Newton matrix and activations over all 1347 training
  digits. Quantities that the command estimates stochastically (Hutchinson traces, Monte
  Carlo smoothed losses) are compared in units of their reported standard error.

Usage (from the repository root; needs scikit-learn, the ``test`` extra)::

    python docs/reproduce/audit.py            # prints the audit table of docs/reproduce.md

``tests/docs/test_paper_audit.py`` runs :func:`audit` and asserts every row within its
tolerance, so the table cannot drift from the code.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import grad as func_grad
from torch.func import jvp

REPOSITORY = Path(__file__).resolve().parents[2]
WIDTH, DEPTH, BATCH, SEED = 4, 2, 64, 0


@dataclass(frozen=True)
class Row:
    """One audit row: what is compared, sharpcli's and the independent number, the error.

    ``sharp`` and ``independent`` are the two numbers (for a vector, their norms); ``error``
    is the relative difference (for a vector ``||a - b|| / ||b||``), or for ``kind == "se"``
    the difference in units of the standard error ``se`` that sharpcli reports; the row
    agrees when ``error <= tol``.
    """

    item: str
    paper: str
    quantity: str
    sharp: float
    independent: float
    error: float
    tol: float
    kind: str = "rel"
    se: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the row agrees within its tolerance."""
        return self.error <= self.tol

    def agreement(self) -> str:
        """The agreement as the page's table prints it."""
        if self.kind == "abs":
            return f"{self.sharp:.6g} vs {self.independent:.6g}, diff {self.error:.0e}"
        if self.kind == "se":
            return f"{self.sharp:.6g} vs {self.independent:.6g}, {self.error:.2f} se"
        return f"{self.sharp:.6g} vs {self.independent:.6g}, rel {self.error:.0e}"


def scalar_row(item, paper, quantity, a, b, tol=1e-12) -> Row:
    """Two numbers, relative difference."""
    a, b = float(a), float(b)
    return Row(item, paper, quantity, a, b, abs(a - b) / max(abs(b), 1e-300), tol)


def vec_row(item, paper, quantity, a, b, tol) -> Row:
    """Two vectors: their norms and ``||a - b|| / ||b||``."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return Row(item, paper, quantity, float(a.norm()), float(b.norm()),
               float((a - b).norm() / b.norm()), tol)  # fmt: skip


def se_row(item, paper, quantity, a, b, se, tol=3.0) -> Row:
    """A stochastic estimate ``a`` with standard error ``se`` against the exact ``b``."""
    a, b, se = float(a), float(b), float(se)
    return Row(item, paper, quantity, a, b, abs(a - b) / se, tol, kind="se", se=se)


# --------------------------------------------------------------------------- data and model
def digits_arrays() -> dict:
    """The digits file's arrays, from ``fixtures/make_digits_data.py``."""
    spec = importlib.util.spec_from_file_location(
        "make_digits_data", REPOSITORY / "fixtures" / "make_digits_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digits_arrays()


def shapes(in_features: int = 64, classes: int = 10) -> list[tuple[int, ...]]:
    """Parameter shapes of the MLP, in ``model.parameters()`` order."""
    out, fan_in = [], in_features
    for _ in range(DEPTH):
        out += [(WIDTH, fan_in), (WIDTH,)]
        fan_in = WIDTH
    return out + [(classes, fan_in), (classes,)]


def unflatten(theta: torch.Tensor) -> list[torch.Tensor]:
    """Split the flat parameter vector into the MLP's weights and biases."""
    parts, start = [], 0
    for shape in shapes():
        n = math.prod(shape)
        parts.append(theta[start : start + n].reshape(shape))
        start += n
    return parts


def act_fn(activation: str):
    """The activation in plain torch: ReLU, or GELU with the erf form of the Gaussian CDF."""
    if activation == "relu":
        return torch.relu
    return lambda u: u * 0.5 * (1.0 + torch.erf(u / math.sqrt(2.0)))


def forward(theta, x, activation, dropout=0.0):
    """Logits and the hidden representations ``h_1..h_depth`` of the functional MLP; with
    ``dropout > 0``, inverted dropout (``F.dropout``, global RNG) after each activation."""
    params, hidden, h = unflatten(theta), [], x
    phi = act_fn(activation)
    for i in range(DEPTH):
        h = phi(h @ params[2 * i].T + params[2 * i + 1])
        if dropout > 0:
            h = F.dropout(h, dropout, training=True)
        hidden.append(h)
    return h @ params[-2].T + params[-1], hidden


def cross_entropy(z, y):
    """Mean cross-entropy ``mean_i [logsumexp(z_i) - z_i,y_i]``."""
    return (torch.logsumexp(z, dim=1) - z.gather(1, y[:, None])[:, 0]).mean()


def loss_fn(x, y, activation):
    """``theta -> L(theta)`` on ``(x, y)``."""
    return lambda theta: cross_entropy(forward(theta, x, activation)[0], y)


def hessian(f, theta):
    """The explicit Hessian of ``f`` at ``theta`` (P x P)."""
    return torch.autograd.functional.hessian(f, theta, vectorize=True)


def ggn(theta, x, activation):
    """The explicit Gauss-Newton matrix ``G = (1/N) sum_i J_i^T (diag(p_i) - p_i p_i^T) J_i``."""

    def logits(t, sample):  # one sample's logits: per-sample Jacobians J_i by vmap
        return forward(t, sample[None], activation)[0][0]

    jac = torch.func.vmap(torch.func.jacrev(logits), in_dims=(None, 0))(theta, x)
    p = torch.softmax(forward(theta, x, activation)[0], dim=1)
    hz = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("nkp,nkl,nlq->pq", jac, hz, jac) / x.shape[0]


def sharp_model(theta, activation, dropout=0.0):
    """sharpcli's MLP with the parameters ``theta`` (the model under test)."""
    from sharpcli.models.zoo import MLP

    net = MLP(64, 10, depth=DEPTH, width=WIDTH, activation=activation, dropout=dropout)
    net = net.to(torch.float64)
    with torch.no_grad():
        for p, value in zip(net.parameters(), unflatten(theta)):
            p.copy_(value)
    return net


# --------------------------------------------------------------------------- regularizers
class Step:
    """sharpcli's training step on the batch, for one ``--reg`` spec at a fixed seed."""

    def __init__(self, theta, x, y, activation):
        self.theta, self.x, self.y, self.activation = theta, x, y, activation

    def run(self, spec: str, seed: int = 3):
        from sharpcli.regularizers.registry import parse_reg
        from sharpcli.regularizers.step import training_step

        net = sharp_model(self.theta, self.activation)
        gen = torch.Generator().manual_seed(seed)
        stats = training_step(net, self.x, self.y, "cross-entropy", [parse_reg(spec)], gen)
        return torch.cat([p.grad.reshape(-1) for p in net.parameters()]), stats

    def penalty(self, spec: str, seed: int = 3):
        """The penalty's value and its part of the step gradient."""
        plain, _ = self.run("none", seed)
        total, stats = self.run(spec, seed)
        (value,) = stats.penalties.values()
        return value, total - plain


def _rademacher(p: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (p,), generator=gen, dtype=torch.float64) * 2 - 1


def _gaussian(p: int, sigma: float, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(p, dtype=torch.float64).normal_(generator=gen) * sigma


def regularizer_rows(x, y) -> list[Row]:
    """Every regularizer of ``sharp train --reg`` against its formula (module docstring)."""
    torch.manual_seed(SEED)
    theta = torch.randn(sum(math.prod(s) for s in shapes()), dtype=torch.float64) * 0.3
    rows: list[Row] = []
    for activation in ("gelu", "relu"):
        rows += _regularizers_on(theta, x, y, activation)
    return rows


def _regularizers_on(theta, x, y, activation) -> list[Row]:  # noqa: C901 - one block per row
    step, f = Step(theta, x, y, activation), loss_fn(x, y, activation)
    g = func_grad(f)(theta)
    H = hessian(f, theta)
    P, rows, tag = theta.numel(), [], f" ({activation})"
    if activation == "relu":  # the ReLU rows: the penalties NME section 4.3 is about
        v = _rademacher(P, 3)
        value, _ = step.penalty("hessian-trace:sigma2=0.1,mode=exact")
        rows.append(
            scalar_row("hessian-trace exact" + tag, "NME eq. 19", "value 0.1 v^T H v", value,
                float(0.1 * v @ H @ v)),
        )  # fmt: skip
        value, pg = step.penalty("gp:rho=0.1,p=1")
        rows.append(
            vec_row("gp p=1" + tag, "NME eq. 7-8", "gradient rho H g/‖g‖", pg,
                    0.1 * H @ g / g.norm(), 1e-12)
        )  # fmt: skip
        return rows

    sigma = 0.1
    value, pg = step.penalty(f"wd:sigma={sigma}")
    rows.append(scalar_row("wd", "AD sec. 2.3", "value s^2/2 ‖theta‖^2", value,
                    float(sigma**2 / 2 * theta @ theta)))  # fmt: skip
    rows.append(vec_row("wd", "AD sec. 2.3", "gradient s^2 theta", pg, sigma**2 * theta, 1e-12))

    sigma = 0.5

    def ad_penalty(t):
        h = forward(t, x, activation)[1][-1]
        return sigma**2 / 2 * (h * h).sum(dim=1).mean()

    value, pg = step.penalty(f"ad:sigma={sigma}")
    rows.append(scalar_row("ad", "AD Thm 2", "value s^2/2 mean ‖h^(L-1)‖^2", value,
                    float(ad_penalty(theta))))  # fmt: skip
    rows.append(vec_row("ad", "AD Thm 2", "gradient (autograd of the value)", pg,
                        func_grad(ad_penalty)(theta), 1e-12))  # fmt: skip

    # dropout: placement after every hidden activation (AD sec. 4.2: "on intermediate layers")
    p = 0.3
    net = sharp_model(theta, activation, dropout=p).train()
    torch.manual_seed(11)
    z_sharp = net(x)
    torch.manual_seed(11)
    z_hand = forward(theta, x, activation, dropout=p)[0]
    rows.append(vec_row("dropout", "AD sec. 4.2", "train-mode logits, masks after each hidden "
                        "activation", z_sharp.detach(), z_hand, 1e-14))  # fmt: skip

    for power in (1, 2):
        rho = 0.1
        value, pg = step.penalty(f"gp:rho={rho},p={power}")
        want = rho * power * g.norm() ** (power - 2) * (H @ g)
        rows.append(scalar_row(f"gp p={power}", "NME eq. 7", f"value rho ‖g‖^{power}", value,
                        float(rho * g.norm() ** power)))  # fmt: skip
        rows.append(vec_row(f"gp p={power}", "NME eq. 8", "gradient rho p ‖g‖^(p-2) H g",
                            pg, want, 1e-12))  # fmt: skip
    _, pg = step.penalty("gp:rho=0.1,p=1,mode=fd")
    rows.append(vec_row("gp mode=fd", "NME eq. 8", "gradient vs exact H g (central fd)", pg,
                        0.1 * H @ g / g.norm(), 1e-5))  # fmt: skip

    # hessian-trace: the probe is the step generator's first Rademacher draw
    v = _rademacher(P, 3)

    def quad(t):  # v^T H(t) v by forward-over-forward mode: independent of reverse-mode HVPs
        return jvp(lambda s: jvp(f, (s,), (v,))[1], (t,), (v,))[1]

    value, pg = step.penalty("hessian-trace:sigma2=0.1,mode=exact")
    rows.append(scalar_row("hessian-trace exact", "NME eq. 19", "value 0.1 v^T H v", value,
                    float(0.1 * v @ H @ v)))  # fmt: skip
    want = 0.1 * func_grad(quad)(theta)
    rows.append(vec_row("hessian-trace exact", "NME eq. 19", "gradient 0.1 D^3L[v,v,.]", pg,
                        want, 1e-12))  # fmt: skip
    value, pg = step.penalty("hessian-trace:sigma2=0.1,mode=fd")
    # O(eps^2) truncation: 7.7e-4 at eps = 0.1 here, 1.9e-4 at 0.05 (docstring of HessianTrace)
    rows.append(vec_row("hessian-trace fd", "NME eq. 19", "gradient vs exact (eps 0.1)", pg,
                        want, 1e-3))  # fmt: skip

    # gn-trace: labels drawn from Cat(softmax z) by the loss's sampler with the step generator
    # (the draw is the random input; the rows check the formula given it, and the expectation
    # row below checks the draw's distribution), then B ||grad Lhat||^2
    from sharpcli.losses import get_loss

    gen = torch.Generator().manual_seed(3)
    z = forward(theta, x, activation)[0].detach()
    y_hat = get_loss("cross-entropy").sample_labels(z, gen)
    f_hat = loss_fn(x, y_hat, activation)
    g_hat = func_grad(f_hat)(theta)
    value, pg = step.penalty("gn-trace:sigma2=0.1")
    rows.append(scalar_row("gn-trace", "NME eq. 20", "value 0.1 B ‖grad Lhat‖^2", value,
                    float(0.1 * BATCH * g_hat @ g_hat)))  # fmt: skip
    rows.append(vec_row("gn-trace", "NME eq. 20", "gradient 0.2 B H_hat grad Lhat", pg,
                        0.2 * BATCH * hessian(f_hat, theta) @ g_hat, 1e-12))  # fmt: skip
    rows.append(_gn_trace_expectation(step, theta, x, activation))

    # fa: lambda ||H v||^2 / B
    def hv_sq(t):  # forward-over-reverse H(t) v
        return (jvp(func_grad(f), (t,), (v,))[1] ** 2).sum()

    value, pg = step.penalty("fa:lambda=0.1")
    rows.append(scalar_row("fa", "FA eq. 1", "value 0.1 ‖H v‖^2 / B", value,
                    float(0.1 * (H @ v).square().sum() / BATCH)))  # fmt: skip
    want = 0.1 / BATCH * func_grad(hv_sq)(theta)
    rows.append(vec_row("fa", "FA eq. 1", "gradient 0.1/B grad ‖H v‖^2", pg, want, 1e-12))
    _, pg = step.penalty("fa:lambda=0.1,mode=fd")
    rows.append(vec_row("fa mode=fd", "FA eq. 1", "gradient vs exact (eps auto)", pg, want, 1e-3))

    # oracles: the returned gradient is grad L at the perturbed weights
    rho = 0.05
    got, _ = step.run(f"sam:rho={rho}")
    rows.append(vec_row("sam", "NME eq. 42 [SAM]", "grad L(theta + rho g/‖g‖)", got,
                        func_grad(f)(theta + rho * g / g.norm()), 1e-12))  # fmt: skip
    rho = 0.5
    got, _ = step.run(f"usam:rho={rho}")
    rows.append(vec_row("usam", "NME eq. 43 [USAM]", "grad L(theta + rho g)", got,
                        func_grad(f)(theta + rho * g), 1e-12))  # fmt: skip
    rho, eta = 0.5, 0.01
    got, _ = step.run(f"asam:rho={rho},eta={eta}")
    t_scale = torch.cat([
        (w.abs() + eta).reshape(-1) if w.dim() > 1 else torch.ones(w.numel(), dtype=w.dtype)
        for w in unflatten(theta)
    ])  # fmt: skip
    e = rho * t_scale**2 * g / (t_scale * g).norm()
    rows.append(vec_row("asam", "[ASAM]", "grad L(theta + rho T^2 g/‖T g‖)", got,
                        func_grad(f)(theta + e), 1e-12))  # fmt: skip
    sigma = 0.05
    got, _ = step.run(f"weight-noise:sigma={sigma}")
    u = _gaussian(P, sigma, torch.Generator().manual_seed(3))
    rows.append(vec_row("weight-noise", "NSO sec. 2.1", "grad L(theta + U)", got,
                        func_grad(f)(theta + u), 1e-12))  # fmt: skip
    got, _ = step.run(f"nso:sigma={sigma},k=2")
    gen = torch.Generator().manual_seed(3)
    want = torch.zeros_like(theta)
    for _ in range(2):
        u = _gaussian(P, sigma, gen)
        want += (func_grad(f)(theta + u) + func_grad(f)(theta - u)) / 4
    rows.append(vec_row("nso", "NSO Alg. 1", "(1/2k) sum grad L(theta +- U_j)", got, want, 1e-12))
    return rows


def _gn_trace_expectation(step: Step, theta, x, activation) -> Row:
    """Unbiasedness: the mean gn-trace value over 200 seeds against the explicit tr(G)."""
    values = torch.tensor(
        [
            next(iter(step.run("gn-trace:sigma2=1", seed)[1].penalties.values()))
            for seed in range(200)
        ]
    )
    exact = float(torch.trace(ggn(theta, x, activation)))
    se = float(values.std() / math.sqrt(len(values)))
    return se_row(
        "gn-trace",
        "NME eq. 20",
        "mean of 200 draws (sigma2=1) vs explicit tr(G)",
        values.mean(),
        exact,
        se,
    )


# --------------------------------------------------------------------------- diagnostics
def _cli(*args: str) -> None:
    from sharpcli.cli import runner
    from sharpcli.cli.app import main

    runner.state()["debug"] = False
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
            main(list(args))
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise RuntimeError(f"sharp {' '.join(args)}: exit {exc.code}: {err.getvalue()}")


def _checkpoint_theta(path: Path) -> torch.Tensor:
    """The checkpoint's parameters as one flat float64 vector (read with safetensors)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    names = [f"{2 * i}.{kind}" for i in range(DEPTH + 1) for kind in ("weight", "bias")]
    return torch.cat([tensors[name].to(torch.float64).reshape(-1) for name in names])


def _report(workdir: Path, name: str, *args: str) -> dict:
    target = workdir / f"{name}.json"
    _cli(*args, "--json", str(target))
    return json.loads(target.read_text())["results"]


def diagnostic_rows(workdir: Path, arrays: dict) -> list[Row]:
    """The diagnostics' reports on tiny digits checkpoints against explicit computations."""
    import numpy as np

    data = workdir / "digits.npz"
    with open(data, "wb") as handle:
        np.savez(handle, **arrays)
    x = torch.as_tensor(arrays["x"], dtype=torch.float64)
    y = torch.as_tensor(arrays["y"])
    thetas = {}
    for activation in ("gelu", "relu"):
        out = workdir / f"tiny-{activation}.safetensors"
        _cli("train", "--data", str(data), "--width", str(WIDTH), "--epochs", "3",
             "--activation", activation, "--out", str(out))  # fmt: skip
        thetas[activation] = _checkpoint_theta(out)
    common = ("--data", str(data), "--dtype", "float64")
    rows = _spectrum_rows(workdir, common, thetas, x, y)
    rows += _bound_rows(workdir, common, thetas["gelu"], x, y)
    rows += _rescale_rows(workdir, common, thetas["relu"], x, y)
    rows += _activation_rows(workdir, common, thetas["relu"], x)
    return rows


def _spectrum_rows(workdir, common, thetas, x, y) -> list[Row]:
    """``sharp gn-nme``: H = G + N ([NME] eq. 2) against the explicit matrices."""
    rows = []
    for activation, theta in thetas.items():
        ckpt = str(workdir / f"tiny-{activation}.safetensors")
        res = _report(workdir, f"gn-nme-{activation}", "gn-nme", ckpt, "--max-matvecs", "100",
                      *common)  # fmt: skip
        H = hessian(loss_fn(x, y, activation), theta)
        G = ggn(theta, x, activation)
        N = H - G
        tag = f"gn-nme ({activation})"
        for key, matrix, symbol in (("hessian", H, "H"), ("ggn", G, "G"), ("nme", N, "N")):
            eig = torch.linalg.eigvalsh(matrix)
            trace = res[key]["trace"]
            rows.append(se_row(tag, "NME eq. 2", f"tr({symbol}) Hutchinson vs explicit",
                               trace["estimate"], torch.trace(matrix), trace["stderr"]))  # fmt: skip
            if activation == "gelu":
                rows.append(scalar_row(tag, "NME eq. 2", f"lambda_max({symbol}) Lanczos",
                                       res[key]["lambda_max"], eig[-1], 1e-6))  # fmt: skip
                lam = res[key]["lambda_min"]  # G is singular: compare on the scale of lambda_max
                rows.append(Row(tag, "NME eq. 2", f"lambda_min({symbol}) Lanczos", lam,
                                float(eig[0]), abs(lam - float(eig[0])) / float(eig[-1]), 1e-6,
                                "abs"))  # fmt: skip
        if activation == "gelu":
            rows.append(
                scalar_row(
                    tag,
                    "NME eq. 20",
                    "exact tr(G) vs explicit",
                    res["ggn_trace_check"]["exact"],
                    torch.trace(G),
                    1e-12,
                )
            )
            h = res["hessian"]
            rows.append(
                se_row(
                    tag,
                    "FA eq. 1",
                    "Tr(H^2) Hutchinson vs ‖H‖_F^2",
                    h["frobenius_sq"],
                    (H * H).sum(),
                    h["frobenius_sq_stderr"],
                )
            )
        else:  # NME sec. 4.3: ReLU has a zero second derivative, so diag(N) = 0 exactly
            diag = float(N.diagonal().abs().max())
            rows.append(Row(tag, "NME sec. 4.3", "max abs(diag N) explicit vs the paper's 0", 0.0,
                            diag, diag, 1e-12, "abs"))  # fmt: skip
    return rows


def _bound_rows(workdir, common, theta, x, y) -> list[Row]:
    """``sharp bound-check``: Corollary 1, Theorem 2/3 ([AD]) and noise stability ([NSO])."""
    sigma = 0.1
    res = _report(workdir, "bound-check", "bound-check", str(workdir / "tiny-gelu.safetensors"),
                  "--sigma", str(sigma), "--check", "theorem2,noise-stability", *common)  # fmt: skip
    f = loss_fn(x, y, "gelu")
    H = hessian(f, theta)
    P, last = theta.numel(), 10 * WIDTH
    start = P - 10 - last  # the final layer's weight: the default scope of Corollary 1
    block = H[start : start + last, start : start + last]
    g = func_grad(f)(theta)
    row = res["rows"][0]
    rows = [
        scalar_row("bound-check", "AD Fig. 1a", "plain_lambda_max of 4.weight",
                   row["plain_lambda_max"], torch.linalg.eigvalsh(block)[-1], 1e-6),
        scalar_row("bound-check", "AD Cor. 1", "epsilon = ‖grad L‖ over 4.weight",
                   res["epsilon_full"], g[start : start + last].norm(), 1e-12),
        scalar_row("bound-check", "AD Cor. 1", "H_at_theta = max abs(eig) of 4.weight",
                   row["H_at_theta"], torch.linalg.eigvalsh(block).abs().max(), 1e-6),
        scalar_row("bound-check", "AD Cor. 1 eq. 1", "bound_at_theta H erf(eps/(sqrt2 H sigma))",
                   row["bound_at_theta"],
                   row["H_at_theta"]
                   * math.erf(row["epsilon_at_theta"] / (math.sqrt(2) * row["H_at_theta"] * sigma)),
                   1e-12),
    ]  # fmt: skip
    # Theorem 2 and 3, per sample, averaged
    z, hidden = forward(theta, x, "gelu")
    h_sq = (hidden[-1] ** 2).sum(dim=1)
    ce = torch.logsumexp(z, dim=1) - z.gather(1, y[:, None])[:, 0]
    p = torch.softmax(z, dim=1)
    t2 = res["theorem2"][0]
    rows.append(scalar_row("bound-check", "AD Thm 2", "bound mean CE + s^2/2 ‖h‖^2",
                           t2["bound"], (ce + sigma**2 / 2 * h_sq).mean(), 1e-12))  # fmt: skip
    taylor = ce + sigma**2 / 2 * h_sq * (p * (1 - p)).sum(dim=1)
    rows.append(scalar_row("bound-check", "AD Thm 3", "Taylor CE + s^2/2 ‖h‖^2 sum p(1-p)",
                           t2["taylor"], taylor.mean(), 1e-12))  # fmt: skip
    # smoothed CE: D h ~ N(0, s^2 ||h||^2 I) for D with N(0, s^2) entries; own antithetic MC
    gen = torch.Generator().manual_seed(1)
    xi = torch.randn(512, *z.shape, generator=gen, dtype=torch.float64)
    noisy = z.detach() + sigma * h_sq.detach().sqrt()[:, None] * xi
    smooth = [torch.logsumexp(zz, 2) - zz.gather(2, y[None, :, None].expand(512, -1, 1))[..., 0]
              for zz in (noisy, 2 * z.detach() - noisy)]  # fmt: skip
    pairs = ((smooth[0] + smooth[1]) / 2).mean(dim=1)
    se = math.hypot(float(pairs.std() / math.sqrt(512)), t2["smoothed_stderr"])
    rows.append(se_row("bound-check", "AD Thm 2", "smoothed CE vs own Monte Carlo",
                       t2["smoothed_cross_entropy"], pairs.mean(), se))  # fmt: skip
    # noise stability: tr(H) and the gap E L(theta + U) - L(theta)
    ns = res["noise_stability"]
    rows.append(se_row("bound-check", "NSO eq. 4", "tr(H) (Hutch++) vs explicit",
                       ns["trace"], torch.trace(H), ns["trace_stderr"]))  # fmt: skip
    nrow = ns["rows"][0]
    rows.append(scalar_row("bound-check", "NSO eq. 4", "predicted = s^2/2 tr(H)",
                           nrow["predicted"], sigma**2 / 2 * ns["trace"], 1e-12))  # fmt: skip
    u = torch.randn(2000, P, generator=gen, dtype=torch.float64) * sigma
    with torch.no_grad():
        base = f(theta)
        gaps = torch.stack([(f(theta + uu) + f(theta - uu)) / 2 - base for uu in u])
    se = math.hypot(float(gaps.std() / math.sqrt(len(gaps))), nrow["gap_control_variate_stderr"])
    rows.append(se_row("bound-check", "NSO eq. 4", "gap E L(W+U) - L(W) vs own Monte Carlo",
                       nrow["gap_control_variate"], gaps.mean(), se))  # fmt: skip
    return rows


def _rescale_rows(workdir, common, theta, x, y) -> list[Row]:
    """``sharp weight-rescale``: [MAN] Fig. 1 global times 10 and the Dinh et al. layer
    rescaling, against the explicit Hessian of the rescaled weights."""
    ckpt = str(workdir / "tiny-relu.safetensors")
    f = loss_fn(x, y, "relu")
    layer = _report(workdir, "rescale-layer", "weight-rescale", ckpt, "--mode", "layer",
                    "--alpha", "10", *common)  # fmt: skip
    glob = _report(workdir, "rescale-global", "weight-rescale", ckpt, "--mode", "global",
                   "--alpha", "10", *common)  # fmt: skip
    parts = unflatten(theta)
    scaled = torch.cat([(w * s).reshape(-1) for w, s in
                        zip(parts, (10, 10, 0.1, 1, 1, 1))])  # fmt: skip
    H, H_scaled = hessian(f, theta), hessian(f, scaled)
    invariant = torch.linalg.eigvalsh(theta.abs()[:, None] * H * theta.abs()[None, :])[-1]
    with torch.no_grad():
        logit_change = (forward(scaled, x, "relu")[0] - forward(theta, x, "relu")[0]).abs().max()
    return [
        scalar_row("weight-rescale", "MAN Fig. 1", "layer x10: lambda_max of the rescaled net",
                   layer["rows"][0]["lambda_max"], torch.linalg.eigvalsh(H_scaled)[-1], 1e-6),
        scalar_row("weight-rescale", "[ASAM]", "invariant lambda_max(abs(theta) H abs(theta))",
                   layer["rows"][0]["invariant_lambda_max"], invariant, 1e-6),
        Row("weight-rescale", "[Dinh2017]", "layer x10: max logit change",
            layer["rows"][0]["max_logit_change"], float(logit_change),
            abs(layer["rows"][0]["max_logit_change"] - float(logit_change)), 1e-9, "abs"),
        scalar_row("weight-rescale", "MAN Fig. 1", "global x10: loss L(10 theta)",
                   glob["rows"][0]["loss"], f(10 * theta), 1e-12),
        scalar_row("weight-rescale", "MAN Fig. 1", "global x10: lambda_max",
                   glob["rows"][0]["lambda_max"],
                   torch.linalg.eigvalsh(hessian(f, 10 * theta))[-1], 1e-5),
    ]  # fmt: skip


def _activation_rows(workdir, common, theta, x) -> list[Row]:
    """``sharp activation-stats``: death and activation frequency ([MAN] sec. 2)."""
    res = _report(workdir, "activation-stats", "activation-stats",
                  str(workdir / "tiny-relu.safetensors"), *common)  # fmt: skip
    params, h, rows = unflatten(theta), x, []
    for i, layer in enumerate(res["layers"]):
        pre = h @ params[2 * i].T + params[2 * i + 1]
        h = torch.relu(pre)
        active = (pre > 0).to(torch.float64)
        dead = active.sum(dim=0) == 0
        xi = float(dead.to(torch.float64).mean())
        eta = float(active[:, ~dead].mean()) if (~dead).any() else float("nan")
        rows.append(Row("activation-stats", "MAN sec. 2", f"layer {i}: death frequency xi",
                        layer["death_frequency"], xi, abs(layer["death_frequency"] - xi),
                        0.0, "abs"))  # fmt: skip
        rows.append(scalar_row("activation-stats", "MAN sec. 2",
                               f"layer {i}: activation frequency eta (alive units)",
                               layer["activation_frequency"], eta, 1e-12))  # fmt: skip
    return rows


def audit(workdir: Path | None = None) -> list[Row]:
    """Every audit row (regularizers, then diagnostics)."""
    arrays = digits_arrays()
    x = torch.as_tensor(arrays["x"][:BATCH], dtype=torch.float64)
    y = torch.as_tensor(arrays["y"][:BATCH])
    rows = regularizer_rows(x, y)
    with tempfile.TemporaryDirectory() as tmp:
        rows += diagnostic_rows(Path(workdir or tmp), arrays)
    return rows


def markdown(rows: list[Row]) -> str:
    """The audit table of docs/reproduce.md: one line per row."""
    lines = [
        "| what | paper | computed independently | sharp vs independent, agreement |",
        "|---|---|---|---|",
    ]
    for row in rows:
        mark = "" if row.ok else " **DEVIATES**"
        lines.append(f"| {row.item} | {row.paper} | {row.quantity} | {row.agreement()}{mark} |")
    return "\n".join(lines)


def main() -> int:
    """Print the audit table; exit 1 when a row deviates beyond its tolerance."""
    torch.set_num_threads(1)
    rows = audit()
    print(markdown(rows))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
