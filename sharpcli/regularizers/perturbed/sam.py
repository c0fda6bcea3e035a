"""The sharpness-aware oracles: SAM [SAM], unnormalised SAM [USAM] and adaptive SAM [ASAM].

Each returns the gradient of the objective at :math:`\\theta + e(g)`, :math:`g` the clean
gradient, as [NME] App. B eq. 42-43 write them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sharpcli.regularizers.base import Oracle, ParamNames, Points, Tensors, declare_regularizer
from sharpcli.regularizers.draws import global_norm
from sharpcli.regularizers.passes import PassResult, StepPasses
from sharpcli.specs import Param

__all__ = ["AscentOracle", "SAM", "USAM", "ASAM"]


class AscentOracle(Oracle):
    """Two-step sharpness-aware oracle: clean gradient ``g = grad O(theta)``, perturbation
    ``e(g)``, returned gradient ``grad O(theta + e)`` ([NME] App. B eq. 42-43).

    2 x (evaluations of one objective gradient): **2** with no penalty. The two-pass ascent
    family (sam, usam, asam), whose members ``--ascent-sync`` applies to.

    Under torchrun (``sharpcli.training.data_parallel``) ``g`` is, by ``--ascent-sync``, this
    rank's own clean gradient (``per-replica``, the default: m-sharpness with m the local batch,
    [SAM] section 4) or the clean gradients all-reduced once (``global``: the single-process
    step on the whole batch); :meth:`StepPasses.ascent_gradient` gives it.
    """

    per_replica = (
        "each rank takes its ascent from its own rows' gradient (m-sharpness, m the local "
        "batch); the global ascent sync all-reduces that gradient first"
    )

    def perturbation(
        self, params: Tensors, grads: Tensors, names: ParamNames = None
    ) -> list[torch.Tensor]:
        """The ascent step :math:`e(g)`: what ``sharp train`` and the optimizer wrapper of
        :mod:`sharpcli.regularizers` both apply.

        Args:
            params: The weights (detached), in the step's order.
            grads: The clean gradient :math:`g`, one tensor per parameter.
            names: The parameters' names (``model.named_parameters()``), which ASAM reads;
                None where unknown.

        Returns:
            One perturbation tensor per parameter.
        """
        raise TypeError(f"{type(self).__name__} defines no perturbation()")

    def reads_clean_gradient(self) -> bool:
        """True: the ascent step is taken from the clean gradient (the wrapper's protocol)."""
        return True

    def perturbations(
        self, weights: Tensors, grads: Tensors | None, names: ParamNames, generator: torch.Generator
    ) -> Points:
        """The one point :math:`\\theta + e(g)`, for the optimizer wrapper.

        Yields:
            ``(e(g), 1.0)``, :meth:`perturbation` of the clean gradient.
        """
        if grads is None:
            raise TypeError(f"{self.name} takes its ascent step from the clean gradient")
        yield self.perturbation(weights, grads, names), 1.0

    def gradient(self, engine: StepPasses) -> tuple[PassResult, list[torch.Tensor]]:
        """The clean pass and the gradient at :math:`\\theta + e(g)`."""
        clean = engine.evaluate(want_grad=True)
        assert clean.grads is not None  # asked for (want_grad)
        ascent = engine.ascent_gradient(clean.grads)
        if ascent is None:  # not finite under loss scaling: the scaler skips this step
            return clean, clean.grads
        deltas = self.perturbation(engine.weights, ascent, engine.param_names)
        with engine.perturbed(deltas):
            at_perturbed = engine.evaluate(want_grad=True)
        assert at_perturbed.grads is not None  # asked for (want_grad)
        return clean, at_perturbed.grads


def _radius_over(rho: float, norm: torch.Tensor) -> torch.Tensor:
    """``rho / max(norm, tiny)`` as a 0-dim tensor (``tiny`` the smallest normal number of
    its dtype, 1.2e-38 in float32): ``rho / norm`` for every norm above it, and a zero
    perturbation when ``norm == 0`` (every entry is then 0), without reading the norm back
    to the host. A NaN norm stays NaN (the step's finiteness check reports it)."""
    return rho / norm.clamp_min(torch.finfo(norm.dtype).tiny)


@declare_regularizer
class SAM(AscentOracle):
    """``sam:rho``: sharpness-aware minimization [SAM] as written in [NME] eq. 42.

    .. math:: e = \\rho \\frac{g}{\\|g\\|}, \\qquad \\text{gradient } \\nabla O(\\theta + e)

    The norm is global over all trainable parameters; ``e = 0`` when ``g = 0``.
    2 gradient evaluations.

    Args (hyper-parameters):
        rho: radius of the ascent step (default 0.05, [SAM]).
    """

    name = "sam"
    summary = "gradient at theta + rho g/||g|| (NME App. B eq. 42)"
    HYPERPARAMS = (Param("rho", "float", 0.05, "radius of the ascent step", minimum=0.0),)
    paper = "SAM"
    # per-rank ascent steps are m-sharpness, another algorithm: run per replica (its base's
    # per_replica) or with --ascent-sync global
    data_parallel = "its ascent step needs the global gradient norm before the second pass"

    def perturbation(
        self, params: Tensors, grads: Tensors, names: ParamNames = None
    ) -> list[torch.Tensor]:
        """:math:`\\rho g / \\|g\\|`."""
        return list(
            torch._foreach_mul(list(grads), _radius_over(self.params["rho"], global_norm(grads)))
        )


@declare_regularizer
class USAM(AscentOracle):
    """``usam:rho``: unnormalised SAM [USAM] ([NME] eq. 43).

    .. math:: e = \\rho\\, g, \\qquad \\text{gradient } \\nabla O(\\theta + e)

    2 gradient evaluations.

    Args (hyper-parameters):
        rho: scale of the ascent step (default 0.05).
    """

    name = "usam"
    summary = "gradient at theta + rho g (NME App. B eq. 43)"
    HYPERPARAMS = (Param("rho", "float", 0.05, "scale of the ascent step", minimum=0.0),)
    paper = "USAM"
    data_parallel = "its ascent step needs the global gradient before the second pass"

    def perturbation(
        self, params: Tensors, grads: Tensors, names: ParamNames = None
    ) -> list[torch.Tensor]:
        """:math:`\\rho g`."""
        return [self.params["rho"] * g for g in grads]


@declare_regularizer
class ASAM(AscentOracle):
    """``asam:rho,eta``: adaptive SAM [ASAM] (Kwon et al. 2021).

    .. math:: e = \\rho \\frac{T^2 g}{\\|T g\\|}, \\qquad T = \\mathrm{diag}(|w| + \\eta)

    [AD] Table 1 trains it alone and combined with ``ad``. As the official code
    (github SamsungLabs/ASAM, ``asam.py``) does: ``T = diag(|w| + eta)`` on every parameter
    whose name (``model.named_parameters()``) contains ``"weight"`` (so also the scales of
    BatchNorm and LayerNorm, and embeddings), and ``T = I`` on the others (biases). Where
    the names are unknown (an optimizer wrapper given no model), a parameter with
    ``dim > 1`` counts as a weight. With ``eta = 0`` zero weights are never perturbed.
    ``e = 0`` when ``T g = 0``. Defaults ``rho = 0.5`` (ASAM's recommended radius),
    ``eta = 0.01``. 2 evaluations.
    """

    name = "asam"
    summary = "gradient at theta + rho T^2 g/||T g||, T = |w| + eta (ASAM, Kwon et al. 2021)"
    HYPERPARAMS = (
        Param("rho", "float", 0.5, "radius of the ascent step", minimum=0.0),
        Param("eta", "float", 0.01, "offset of the adaptive scale |w| + eta", minimum=0.0),
    )
    paper = "ASAM"
    data_parallel = "its ascent step needs the global scaled gradient norm before the second pass"

    def scales(
        self, params: Sequence[torch.Tensor], names: Sequence[str] | None = None
    ) -> list[torch.Tensor | None]:
        """``T`` per parameter: ``|w| + eta`` for a weight, ``None`` (identity) otherwise.

        Args:
            params: The weights.
            names: Their names: a weight's contains ``"weight"`` (the official code's rule);
                None: a weight is a parameter with ``dim > 1``.

        Returns:
            One scale tensor (or None) per parameter.
        """
        if names is None:
            weights = [p.dim() > 1 for p in params]
        else:
            weights = ["weight" in name for name in names]
        return [p.abs() + self.params["eta"] if w else None for p, w in zip(params, weights)]

    def perturbation(
        self, params: Tensors, grads: Tensors, names: ParamNames = None
    ) -> list[torch.Tensor]:
        """:math:`\\rho T^2 g / \\|T g\\|`."""
        scales = self.scales(params, names)
        scaled = [g if t is None else t * g for t, g in zip(scales, grads)]
        factor = _radius_over(self.params["rho"], global_norm(scaled))
        return list(
            torch._foreach_mul([s if t is None else t * s for t, s in zip(scales, scaled)], factor)
        )
