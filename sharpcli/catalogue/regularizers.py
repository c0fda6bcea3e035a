"""The regularizers' records: ``--reg NAME[:k=v,...]`` (:mod:`sharpcli.training.regularizers`).

Each record holds the regularizer's summary, its hyper-parameters in positional order with
defaults and ranges, its paper key, whether averaging its gradient over torchrun ranks is
exact (``data_parallel``: None, else the reason it is not) and, in ``info``, its ``kind``
(none, model, penalty or oracle) and whether it needs the input of the final ``nn.Linear``.
The classes read all of this from here.

This module imports no torch.
"""

from __future__ import annotations

from sharpcli.registry import Entry, Registry
from sharpcli.specs import Param

__all__ = ["REGULARIZERS"]

P = Param


def _reg(
    name: str,
    kind: str,
    summary: str,
    impl: str,
    params: tuple[Param, ...],
    *,
    paper: str,
    data_parallel: str | None,
    needs_penultimate: bool,
) -> Entry:
    """A regularizer's record; ``info``: its ``kind`` (none, model, penalty or oracle) and
    whether it needs the input of the final ``nn.Linear``."""
    info = {"kind": kind, "needs_penultimate": needs_penultimate}
    return Entry(name, summary, impl, params, paper, data_parallel, info)


_REPORT = P(
    "report",
    "choice",
    "perturbed",
    "reported loss: at the perturbed weights (free) or clean at theta (one more forward)",
    choices=("perturbed", "clean"),
)

# ``--reg NAME[:k=v,...]`` (sharpcli.training.regularizers); parameters in positional order
REGULARIZERS: Registry = Registry(
    "regularizer",
    source="regs",
    entries=[
        _reg(
            "none",
            "none",
            "plain loss",
            "sharpcli.training.regularizers:NoRegularizer",
            (),
            paper="",
            data_parallel=None,  # the batch-mean loss is linear in the batch
            needs_penultimate=False,
        ),
        _reg(
            "wd",
            "penalty",
            "L + s^2/2 ||theta||^2 (AD 2.3)",
            "sharpcli.training.regularizers:WeightDecay",
            (P("sigma", "float", 0.001, "smoothing scale; coefficient sigma^2/2", minimum=0.0),),
            paper="AD",
            data_parallel=None,  # sigma^2 theta is the same on every rank; row weights sum to 1
            needs_penultimate=False,
        ),
        _reg(
            "dropout",
            "model",
            "dropout p: after each hidden activation (mlp); before the head only (conv nets) (AD 4.2)",
            "sharpcli.training.regularizers:Dropout",
            (P("p", "float", 0.1, "drop probability", minimum=0.0, below=1.0),),
            paper="AD",
            # linear in the batch; the masks differ from one process's (independent per rank,
            # reseeded per epoch from (seed, epoch, rank) so resume stays exact) but are a valid draw
            data_parallel=None,
            needs_penultimate=False,
        ),
        _reg(
            "ad",
            "penalty",
            "CE + s^2/2 mean ||h||^2, h = the head's input (conv nets: pooled features) (AD Thm 2)",
            "sharpcli.training.regularizers:ActivationDecay",
            (P("sigma", "float", 0.1, "weight-noise scale of the final layer", minimum=0.0),),
            paper="AD",
            data_parallel=None,  # a mean over samples: linear in the batch
            needs_penultimate=True,
        ),
        _reg(
            "sam",
            "oracle",
            "gradient at theta + rho g/||g|| (NME App. B eq. 42)",
            "sharpcli.training.regularizers:SAM",
            (P("rho", "float", 0.05, "radius of the ascent step", minimum=0.0),),
            paper="SAM",
            # per-rank ascent steps ("local SAM") would be a different algorithm
            data_parallel="its ascent step needs the global gradient norm before the second pass",
            needs_penultimate=False,
        ),
        _reg(
            "usam",
            "oracle",
            "gradient at theta + rho g (NME App. B eq. 43)",
            "sharpcli.training.regularizers:USAM",
            (P("rho", "float", 0.05, "scale of the ascent step", minimum=0.0),),
            paper="USAM",
            data_parallel="its ascent step needs the global gradient before the second pass",
            needs_penultimate=False,
        ),
        _reg(
            "asam",
            "oracle",
            "gradient at theta + rho T^2 g/||T g||, T = |w| + eta (ASAM, Kwon et al. 2021)",
            "sharpcli.training.regularizers:ASAM",
            (
                P("rho", "float", 0.5, "radius of the ascent step", minimum=0.0),
                P("eta", "float", 0.01, "offset of the adaptive scale |w| + eta", minimum=0.0),
            ),
            paper="ASAM",
            data_parallel="its ascent step needs the global scaled gradient norm before the second pass",
            needs_penultimate=False,
        ),
        _reg(
            "gp",
            "penalty",
            "L + rho ||grad L||^p, p in {1,2} (NME eq. 7)",
            "sharpcli.training.regularizers:GradientPenalty",
            (
                P("rho", "float", 0.01, "penalty strength", minimum=0.0),
                P("p", "choice", 1, "power of the gradient norm", choices=(1, 2)),
                P(
                    "mode",
                    "choice",
                    "exact",
                    "exact double backprop or finite-difference HVP",
                    choices=("exact", "fd"),
                ),
                P("eps", "float", 0.001, "finite-difference step length (mode=fd)", positive=True),
            ),
            paper="NME",
            data_parallel="its penalty ||grad L||^p is nonlinear in the batch gradient",
            needs_penultimate=False,
        ),
        _reg(
            "hessian-trace",
            "penalty",
            "L + s^2 v^T H v, v Rademacher (NME eq. 19; s^2 = 2x the tr(H) weight of weight-noise sigma^2); fd: finite-difference curvature at step eps, exact: autograd Hessian",
            "sharpcli.training.regularizers:HessianTrace",
            (
                P("sigma2", "float", 0.01, "penalty strength (noise variance)", minimum=0.0),
                P("probes", "int", 1, "Rademacher probes averaged per step", minimum=1),
                P(
                    "mode",
                    "choice",
                    "exact",
                    "exact: the autograd Hessian (zero at kinks), third-order autograd; fd: finite-difference curvature at step eps (sees ReLU kinks: on ReLU nets a different regularizer, which diverged at its defaults on the built-in nets)",
                    choices=("exact", "fd"),
                ),
                P(
                    "eps",
                    "float",
                    0.1,
                    "finite-difference step length in parameter space (mode=fd)",
                    positive=True,
                ),
            ),
            paper="NME",
            data_parallel=None,  # the probes are shared, v^T H v linear in the batch
            needs_penultimate=False,
        ),
        _reg(
            "gn-trace",
            "penalty",
            "L + s^2 tr(G), sampled-label estimator (NME eq. 20; s^2 = 2x the tr weight of weight-noise sigma^2)",
            "sharpcli.training.regularizers:GaussNewtonTrace",
            (P("sigma2", "float", 0.01, "penalty strength (noise variance)", minimum=0.0),),
            paper="NME",
            data_parallel="its estimate B ||grad L(y^)||^2 is nonlinear in the batch gradient",
            needs_penultimate=False,
        ),
        _reg(
            "weight-noise",
            "oracle",
            "gradient at theta + U, U ~ N(0, s^2 I) (NSO 2.1); to 2nd order L + s^2/2 tr(H), = hessian-trace:sigma2=s^2/2",
            "sharpcli.training.regularizers:WeightNoise",
            (P("sigma", "float", 0.01, "noise standard deviation", minimum=0.0), _REPORT),
            paper="NSO",
            # U comes from the step generator, the same on every rank; grad L(theta + U) is linear
            # in the batch
            data_parallel=None,
            needs_penultimate=False,
        ),
        _reg(
            "nso",
            "oracle",
            "gradient averaged over theta +- U_j, j = 1..k (NSO Alg. 1)",
            "sharpcli.training.regularizers:NSO",
            (
                P("sigma", "float", 0.01, "noise standard deviation", minimum=0.0),
                P("k", "int", 1, "number of noise pairs per step", minimum=1),
                _REPORT,
            ),
            paper="NSO",
            data_parallel=None,  # as weight-noise: the same U_j on every rank
            needs_penultimate=False,
        ),
        _reg(
            "fa",
            "penalty",
            "L + lambda Tr(H^2)/B, Tr(H^2) = ||Hv||^2 (FA eq. 1); exact autograd or fd",
            "sharpcli.training.regularizers:FlatnessAware",
            (
                P("lambda", "float", 0.01, "penalty strength", minimum=0.0),
                P(
                    "mode",
                    "choice",
                    "exact",
                    "exact: the FA penalty by third-order autograd; fd: central finite differences of grad L (no third-order graph; on ReLU/max-pool nets a different, kink-dominated regularizer)",
                    choices=("exact", "fd"),
                ),
                P(
                    "eps",
                    "float",
                    "auto",
                    "finite-difference step length in parameter space (mode=fd); auto: eta(dtype) * ||theta||",
                    positive=True,
                    auto=True,
                ),
            ),
            paper="FA",
            data_parallel="its penalty ||H v||^2 is nonlinear in the batch Hessian product",
            needs_penultimate=False,
        ),
    ],
)
