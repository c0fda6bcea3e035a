"""A model as the in-memory API analyses it: unwrapped, in eval mode, twice differentiable.

:func:`analysis_mode` is the mode of every product of :class:`sharpcli.api.Curvature`, and
:class:`EvalModeOperator` carries it into the operators a user holds and multiplies later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from sharpcli.curvature import CurvatureOperator
from sharpcli.curvature.products.differentiable import twice_differentiable


@contextlib.contextmanager
def analysis_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The model as the ``sharp`` commands analyse it: eval mode, twice differentiable.

    :func:`eval_mode` and :func:`~sharpcli.curvature.products.differentiable.twice_differentiable`
    (SDPA on its math kernel, the MHA fast path off, ...: the layers' double backward).

    Args:
        model: the module.

    Yields:
        ``model``, in that mode inside the block.
    """
    with eval_mode(model), twice_differentiable():
        yield model


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block; every module's own mode restored after.

    Args:
        model: the module.

    Yields:
        ``model``, in eval mode inside the block.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``nn.DataParallel``, ``DistributedDataParallel``, ``torch.compile``.

    Their parameter names carry ``module.`` or ``_orig_mod.``; curvature is taken through the
    plain module, whose forward is twice differentiable.

    Args:
        model: a module, wrapped or not.

    Returns:
        The innermost plain module.
    """
    while True:
        compiled = getattr(model, "_orig_mod", None)  # torch.compile
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(compiled, nn.Module):
            model = compiled
        else:
            return model


class EvalModeOperator(CurvatureOperator):
    """``inner`` (a registered operator) with every product run in ``mode``.

    ``mode`` is eval mode and the token loss's averaging; ``inner`` keeps the count of
    products it made.
    """

    def __init__(
        self,
        inner: CurvatureOperator,
        mode: Callable[[], contextlib.AbstractContextManager[object]],
    ) -> None:
        super().__init__(inner.shape[0], inner.dtype, inner.device)
        self.name = inner.name
        self.inner = inner
        self.mode = mode  # Curvature._analysis_mode
        self.engine = getattr(inner, "engine", None)
        self.scope = getattr(inner, "scope", None)

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        with self.mode():
            return self.inner.matmat(V)

    def clear_cache(self) -> None:
        """Drop the cached first-order graphs of the underlying pass."""
        self.inner.clear_cache()
