"""The G/N split's tr(H) standard error on a tied-weight model covers (issue: "z-scores' sd
0.58 over 16 seeds, where Hutchinson and Hutch++ give 0.99").

Measured at `sharp trace --estimator gn-split --trace-tol 0.02 --trace-max-matvecs 400` on
the tied-module model (one hidden Linear applied twice, 93 parameters, 32 samples): over
seeds 0-95 the z-scores' sd is 0.93 and the root-mean-square standard error is 1.09 times
the estimates' spread; over 192 further seeds 0.94 and 1.07, with the sd of consecutive
groups of 16 seeds ranging over 0.76-1.12. The 0.58 was the spread of a 16-seed estimate
of a heavy-tailed quadratic form (N is indefinite), not a standard error twice too large:
the sd of z from 16 seeds is itself uncertain by about 1/sqrt(2 * 15) = 0.18 for a normal
z, more for a skewed one. The z-scores' sd also reads low where the estimate and its error
are correlated (a skewed residual: a large deviation comes with a large standard error),
so the ratio of the mean squared standard error to the estimates' variance is checked too.
"""

from __future__ import annotations

import torch
from hessian_helpers import double_backward_hessian
from torch import nn

from sharpcli.curvature.operators.hessian import CurvatureEngine
from sharpcli.curvature.products.data import AnalysisData
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.ggn import gn_split_trace

SEEDS = range(96)


class _TiedModule(nn.Module):
    """One hidden ``nn.Linear`` applied twice (a tied module)."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.out(h)


def test_gn_split_trace_stderr_covers_on_a_tied_module():
    torch.manual_seed(0)
    model = _TiedModule().double().eval()
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2))
    truth = float(torch.trace(double_backward_hessian(model, list(model.parameters()), x, y)))
    engine = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 32), ParamScope.resolve(model, "all")
    )
    runs = [gn_split_trace(engine, tol=0.02, max_matvecs=400, seed=seed) for seed in SEEDS]
    estimates = torch.tensor([r.estimate for r in runs], dtype=torch.float64)
    stderrs = torch.tensor([r.stderr for r in runs], dtype=torch.float64)
    z = (estimates - truth) / stderrs
    # 96 seeds: the sd of z known to about +-0.1; the band is narrower than the suite's
    # [0.7, 1.4], which a 0.58 (the issue's) would fail
    assert 0.8 <= float(z.std()) <= 1.25, float(z.std())
    assert abs(float(z.mean())) <= 3 / len(SEEDS) ** 0.5
    ratio = float((stderrs**2).mean().sqrt() / estimates.std())
    assert 0.85 <= ratio <= 1.2, ratio
    # the sketch grew on most seeds: the pooled (pilot and main) variance is what is tested
    assert sum(r.sketch_size > 0 for r in runs) >= len(runs) // 2
