"""The error of ``--hvp finite-difference`` against exact double-backward Hessian products.

On small models (those of tests/curvature/test_finite_difference.py and a one-layer
transformer classifier whose attention runs torch's fused CPU kernel, which has no double
backward), in float32 and float64: the largest error ``||D v - H v|| / ||v||`` over the
Hessian's 3 largest and 3 smallest eigenvectors and 4 Gaussian directions, relative to
``||H||_2``, beside the stated bound ``beta`` (results.hvp.error_bound) and CPU seconds per
product (one thread). Prints a Markdown table (docs/benchmarks.md, "Finite-difference
Hessian products").

    OMP_NUM_THREADS=1 python benchmarks/bench_finite_difference.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.curvature.products.finite_difference import FiniteDifferenceEngine


class TinyTransformer(nn.Module):
    """8 tokens of 8 features -> one encoder layer (d 16, 2 heads) -> mean -> 3 classes."""

    def __init__(self, activation: str = "gelu"):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.encoder = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, activation=activation, batch_first=True
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


def models():
    torch.manual_seed(0)
    mlp = [nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.GELU(), nn.Linear(12, 3)]
    yield "MLP 6-12-12-3 (tanh, GELU)", nn.Sequential(*mlp), (6,)
    torch.manual_seed(0)
    cnn = [nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(), nn.Linear(48, 3)]
    yield "CNN conv-BN-tanh-linear", nn.Sequential(*cnn), (1, 6, 6)
    torch.manual_seed(0)
    yield "transformer layer (fused SDPA, GELU)", TinyTransformer(), (8, 8)
    # ReLU's kinks: a gradient jumps where a pre-activation crosses 0 within the step, and
    # double backward's Hessian (almost everywhere) does not see it
    torch.manual_seed(0)
    yield "transformer layer (fused SDPA, ReLU)", TinyTransformer("relu"), (8, 8)


def cpu_seconds_per_product(engine, V) -> float:
    start = time.process_time()
    engine.hessian_matmat(V)
    return (time.process_time() - start) / V.shape[1]


def main() -> None:
    torch.set_num_threads(1)
    print(
        "| model | P | dtype | ‖H‖₂ | largest error / ‖H‖₂ | bound β / ‖H‖₂ | error / β "
        "| CPU s a product: exact | finite difference |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.float64):
        for name, model, shape in models():
            model = model.to(dtype).eval()
            generator = torch.Generator().manual_seed(1)
            x = torch.randn(40, *shape, generator=generator, dtype=dtype)
            y = torch.randint(0, 3, (40,), generator=generator)
            data = AnalysisData(x, y, "cross-entropy", 16)
            scope = ParamScope.resolve(model)
            exact = CurvatureEngine(model, data, scope)
            H = exact.hessian_matmat(torch.eye(scope.numel, dtype=dtype)).double()
            H = (H + H.T) / 2
            eigenvalues, eigenvectors = torch.linalg.eigh(H)
            random = torch.randn(scope.numel, 4, generator=generator, dtype=torch.float64)
            V = torch.cat([eigenvectors[:, -3:], eigenvectors[:, :3], random], dim=1)
            fd = FiniteDifferenceEngine(model, data, scope)
            D = fd.hessian_matmat(V.to(dtype)).double()
            beta = fd.error_bound()
            error = float((torch.linalg.vector_norm(D - H @ V, dim=0) / V.norm(dim=0)).max())
            norm = float(eigenvalues.abs().max())
            probe = torch.randn(scope.numel, 4, generator=generator, dtype=torch.float64)
            seconds = [cpu_seconds_per_product(e, probe.to(dtype)) for e in (exact, fd)]
            print(
                f"| {name} | {scope.numel} | {str(dtype).replace('torch.', '')} | {norm:.3g} "
                f"| {error / norm:.2e} | {beta / norm:.2e} | {error / beta:.2f} "
                f"| {seconds[0]:.4f} | {seconds[1]:.4f} |"
            )


if __name__ == "__main__":
    main()
