"""The regularizers of [AD]: weight decay, activation decay and dropout, and the plain loss.

``none`` is the plain loss; ``wd`` [AD] section 2.3; ``dropout`` [AD] section 4.2; ``ad`` [AD]
Theorem 2.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sharpcli.errors import UsageError
from sharpcli.losses import get_loss, token_weights
from sharpcli.regularizers.base import Penalty, Regularizer, declare_regularizer
from sharpcli.regularizers.passes import PassContext
from sharpcli.specs import Param

__all__ = ["NoRegularizer", "Dropout", "WeightDecay", "ActivationDecay"]


@declare_regularizer
class NoRegularizer(Regularizer):
    """``none``: the plain loss ``L(theta)``; 1 gradient evaluation per step."""

    name = "none"
    summary = "plain loss"
    kind = "none"
    data_parallel = None  # the batch-mean loss is linear in the batch


@declare_regularizer
class Dropout(Regularizer):
    """``dropout:p``: dropout with probability ``p`` on hidden representations ([AD] section 4.2).

    The model is built with it (:func:`model_overrides` returns ``{"dropout": p}``); the
    step itself is a plain gradient (1 evaluation), its masks drawn from the global RNG.
    Where it acts is the model's ``dropout`` argument (:mod:`sharpcli.models.zoo`): in
    ``mlp`` after every hidden activation; in the conv nets (``cnn``, ``vgg-small``,
    ``resnet``) only once, on the flattened features entering the classifier head, never
    between convolutions. Default ``p = 0.1``, the best rate of AD Fig. 2 (an MLP).
    """

    name = "dropout"
    summary = (
        "dropout p: after each hidden activation (mlp); before the head only (conv nets) (AD 4.2)"
    )
    kind = "model"
    HYPERPARAMS = (Param("p", "float", 0.1, "drop probability", minimum=0.0, below=1.0),)
    paper = "AD"
    # linear in the batch; the masks differ from one process's (independent per rank
    # reseeded per epoch from (seed, epoch, rank) so resume stays exact) but are a valid draw
    data_parallel = None

    def model_args(self) -> dict[str, Any]:
        """``{"dropout": p}``: the model is built with dropout."""
        return {"dropout": self.params["p"]}


@declare_regularizer
class WeightDecay(Penalty):
    """``wd:sigma``: weight decay over all trainable parameters ([AD] section 2.3).

    .. math:: P(\\theta) = \\frac{\\sigma^2}{2} \\|\\theta\\|^2, \\qquad
              \\nabla P = \\sigma^2 \\theta

    Value and gradient are closed-form (no backward pass: 0 extra evaluations).

    Args (hyper-parameters):
        sigma: smoothing scale (default 1e-3, the best weight-decay strength of AD Fig. 2).
    """

    name = "wd"
    summary = "L + s^2/2 ||theta||^2 (AD 2.3)"
    HYPERPARAMS = (
        Param("sigma", "float", 0.001, "smoothing scale; coefficient sigma^2/2", minimum=0.0),
    )
    paper = "AD"
    data_parallel = None  # sigma^2 theta is the same on every rank; row weights sum to 1

    def term(self, ctx: PassContext) -> torch.Tensor:
        """:math:`\\sigma^2/2 \\|\\theta\\|^2`, without a graph (see :meth:`analytic_grad`)."""
        sigma = self.params["sigma"]
        with torch.no_grad():
            sq = torch.stack(torch._foreach_norm([p.detach() for p in ctx.params])).square().sum()
        return 0.5 * sigma**2 * sq

    def analytic_grad(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:math:`\\sigma^2 \\theta`, per parameter."""
        coeff = self.params["sigma"] ** 2
        return list(torch._foreach_mul([p.detach() for p in params], coeff))


@declare_regularizer
class ActivationDecay(Penalty):
    """``ad:sigma``: activation decay, ``h`` the penultimate activation ([AD] Theorem 2).

    .. math:: P(\\theta) = \\frac{\\sigma^2}{2} \\frac1B \\sum_{b=1}^B \\|h_b\\|^2

    Gaussian noise :math:`N(0, \\sigma^2 I)` on the final weight matrix smooths
    cross-entropy to at most :math:`CE + \\sigma^2/2\\, \\|h^{(L-1)}\\|^2`. ``h`` is the input of the
    last ``nn.Linear`` in ``model.named_modules()``: in ``mlp`` the last hidden activation;
    in the conv nets only the flattened (pooled) features entering the head, so on a conv
    net it acts on that one representation, not on the convolutional layers (which the
    theorem, about noise on the final layer, does not cover). It is captured by a forward
    hook (no extra
    pass; its gradient flows through the clean backward: 0 extra evaluations). With
    ``--loss mse`` the same penalty is added (for mse the exact smoothing would be
    ``sigma^2 ||h||^2``; the table's form is kept for both). Default ``sigma = 0.1``
    (best AD strength of AD Fig. 2).

    Sequence models (``token-cross-entropy``, ``h`` of shape (B, T, D)): the head maps each
    position's ``h_it`` to its logits, and the loss of a sample is ``sum_t w_it CE_it`` with
    ``w_it = 1/n_i`` on its ``n_i`` labelled positions, so the bound applies per position
    and ``P = sigma^2/2 * (1/B) sum_i sum_t w_it ||h_it||^2``: unlabelled positions (``-100``)
    are not penalised, as they are not in the loss.

    Args (hyper-parameters):
        sigma: weight-noise scale of the final layer (default 0.1).
    """

    name = "ad"
    summary = (
        "CE + s^2/2 mean ||h||^2, h = the head's input (conv nets: pooled features) (AD Thm 2)"
    )
    HYPERPARAMS = (
        Param("sigma", "float", 0.1, "weight-noise scale of the final layer", minimum=0.0),
    )
    paper = "AD"
    data_parallel = None  # a mean over samples: linear in the batch
    needs_penultimate = True

    def term(self, ctx: PassContext) -> torch.Tensor:
        """The penalty on the penultimate activation, through the clean forward graph."""
        h = ctx.penultimate
        if get_loss(ctx.loss_name).per_token:
            if h.ndim != 3 or h.shape[:2] != ctx.y.shape:
                raise UsageError(
                    f"ad on a sequence model needs the penultimate activation per position "
                    f"(batch, length, features) like the labels {tuple(ctx.y.shape)}; got "
                    f"{tuple(h.shape)} (choose the module with `penultimate`)",
                    source="regs",
                )
            sq = h.pow(2).sum(dim=-1)  # (B, T)
            per_sample = (sq * token_weights(sq, ctx.y)).sum(dim=1)
        else:
            per_sample = h.reshape(h.shape[0], -1).pow(2).sum(dim=1)
        return 0.5 * self.params["sigma"] ** 2 * per_sample.mean()
