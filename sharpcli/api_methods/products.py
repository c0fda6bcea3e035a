"""What every method of ``Curvature`` stands on: its products, their mode and their cache.

:class:`CurvatureProducts` is the base of :class:`sharpcli.api.Curvature` that holds the
matrix-free operators (``curvature.operator("ggn") @ v``), the cache of first-order graphs
they share (:meth:`~CurvatureProducts.refresh`) and the parameter blocks
(:meth:`~CurvatureProducts.blocks_of`); the methods of :mod:`.estimates` and
:mod:`.perturbed` build on it. Its attributes are set by ``Curvature.__init__``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from sharpcli.analyses.blocks import block_engines
from sharpcli.api_methods.modes import EvalModeOperator, analysis_mode
from sharpcli.catalogue import EXACT_HVP
from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    CurvatureOperator,
    ParamScope,
    build_operator,
)
from sharpcli.curvature.operators.registry import HESSIAN
from sharpcli.errors import UsageError
from sharpcli.io.torch_losses.readings import LossReading
from sharpcli.losses import token_reduction


class CurvatureProducts:
    """The products of a ``Curvature``: operators, their eval mode, the graph cache, blocks."""

    model: nn.Module  # the model differentiated (a converted copy for another device/dtype)
    loss: str  # the registered loss name
    loss_reading: LossReading | None  # how the loss reads the outputs
    token_reduction: str | None  # a token loss's averaging, None for the other losses
    num_samples: int
    num_outputs: int  # model outputs per sample
    batch_size: int
    dtype: torch.dtype
    device: torch.device
    data: AnalysisData  # the sample indices 0..N-1 and the labels
    scope: ParamScope
    engine: CurvatureEngine
    hvp: str  # "exact" or "finite-difference" (sharpcli.analyses.hvp)
    _view: nn.Module  # the model on the stored inputs: forward(index)

    def _analysis_mode(self) -> contextlib.ExitStack:
        """The model view in :func:`analysis_mode`, and the token loss's averaging.

        A token loss is averaged over the analysis set per :attr:`token_reduction`
        (:func:`sharpcli.losses.token_reduction`).

        Returns:
            The context manager that enters both.
        """
        stack = contextlib.ExitStack()
        stack.enter_context(analysis_mode(self._view))
        if self.token_reduction is not None:
            stack.enter_context(token_reduction(self.token_reduction, self.data.y))
        return stack

    @property
    def num_params(self) -> int:
        """P, the number of parameters in scope (the operators are P x P)."""
        return self.scope.numel

    def operator(self, operator: str = HESSIAN) -> CurvatureOperator:
        """The curvature operator ``operator`` as a matrix-free P x P operator.

        ``A @ v`` for a flat vector of length P (laid out parameter by parameter,
        ``curvature.scope``), ``A @ V`` for a (P, k) block, ``A.to_dense()`` for tiny P. Its
        products run with the model in eval mode and share this object's cache of
        first-order graphs.

        Args:
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.

        Returns:
            A :class:`~sharpcli.curvature.CurvatureOperator`.

        Raises:
            UsageError: an unknown operator name.

        >>> import torch
        >>> from torch import nn
        >>> from sharpcli import Curvature
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
        >>> curvature = Curvature(model, "cross-entropy", (x, y))
        >>> H, G, N = (curvature.operator(name) for name in ("hessian", "ggn", "nme"))
        >>> v = torch.randn(curvature.num_params, dtype=torch.float64)
        >>> torch.allclose(H @ v, G @ v + N @ v)     # H = G + N ([NME] eq. 2)
        True
        """
        op = EvalModeOperator(build_operator(operator, self.engine), self._analysis_mode)
        self.refresh()
        return op

    def refresh(self) -> None:
        """Drop the cached first-order graphs, so the next product sees the current weights.

        Every method starts with it: the cache is also dropped when a parameter's version
        counter moves, but a fused optimizer step (``torch.optim.AdamW(fused=True)``, the
        Hugging Face Trainer's default) updates weights in place without moving it.
        """
        self.engine.clear_cache()

    def blocks_of(
        self, blocks: str | Mapping[str, str]
    ) -> Iterable[tuple[str, list[str], CurvatureEngine]]:
        """The parameter blocks of ``blocks`` within ``params``, each with its own engine.

        ``"params"`` (each tensor), ``"modules"`` (the parameters each module owns),
        ``"layers"`` (the model's repeated blocks, e.g. a transformer's) or named globs,
        ``"attn=*.attn.*,mlp=*.mlp.*"`` or ``{"attn": "*.attn.*", "mlp": "*.mlp.*"}``
        (:func:`sharpcli.analyses.blocks.block_partition`). The engines share this object's
        data and model; one block's cached graphs are held at a time.

        Args:
            blocks: the spec.

        Returns:
            An iterable of ``(block name, parameter names, engine)``, each engine built as
            it is reached.

        Raises:
            UsageError: (``blocks``) a spec that names no parameter in scope, or per-block
                products asked of ``hvp="finite-difference"``.
        """
        if self.hvp != EXACT_HVP:
            raise UsageError("per-block products need `hvp=exact`", source="blocks")
        return block_engines(
            self.scope.names,
            blocks,
            self.model,
            lambda glob: CurvatureEngine(
                self._view, self.data, ParamScope.resolve(self._view, glob)
            ),
        )
