"""``Curvature``: the in-memory entry, a model, a loss and data in, the library's results out.

The one object a notebook needs (docs/api.md; docs/from-pyhessian.md maps PyHessian's calls)::

    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    curvature.eigenvalues(top_k=3).eigenvalues      # top-3 Hessian eigenvalues
    curvature.trace().estimate                  # tr(H) by [Hutch++]

Everything is about the mean loss over the samples of ``data``,
``L(theta) = (1/N) sum_i l(f(theta, x_i), y_i)`` (the analysis loss of
:mod:`sharpcli.curvature.products.data`), at the model's current weights, in eval mode (dropout off,
BatchNorm on running statistics, as [PyHessian] does): every method switches the model to
eval mode for its products and restores each module's mode afterwards.

``data`` is read once and kept on the analysis device: ``(x, y)`` tensors, a ``dict`` of
tensors (one batch: its label under ``labels`` or ``y``, every other key a keyword argument
of ``model.forward``, as Hugging Face models take ``input_ids`` and ``attention_mask``), a
``DataLoader`` or any iterable of such batches (``(x, y)``, ``(dict, y)`` or dicts). Batches
are concatenated in order, so the result does not depend on how they were batched; a
shuffling loader gives the same numbers.

How the inputs reach the model: the analysis set streamed by
:class:`~sharpcli.curvature.AnalysisData` is the sample *indices* ``0..N-1``, and the model is
seen through a view of itself (the same modules and parameters, the same parameter names)
whose ``forward(index)`` calls the model's own ``forward`` on the indexed rows of the stored
inputs, positional or keyword, and returns its logits (``.logits`` of an output object, the
first tensor of a tuple: :func:`sharpcli.models.outputs.select_output`). The curvature
engine, its sharding under ``torch.distributed`` and every estimator work unchanged on it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from sharpcli.analyses.blocks import block_engines, density_blocks, eigen_blocks, trace_blocks
from sharpcli.analyses.diagonal import diagonal_result
from sharpcli.analyses.hvp import FINITE_DIFFERENCE, check_hvp
from sharpcli.analyses.landscape import LandscapeConfig, loss_landscape
from sharpcli.analyses.sharpness import SharpnessConfig, sharpness
from sharpcli.analyses.spectrum import (
    check_choice,
    eigen_result,
    gn_nme_result,
    operator_of,
    trace_result,
)
from sharpcli.analyses.step_curvature import (
    BatchSharpness,
    CriticalSharpness,
    GradientShare,
    batch_sharpness,
    critical_sharpness,
    gradient_share,
)
from sharpcli.api_arguments import (
    device_argument,
    dtype_argument,
    integer_argument,
    seed_argument,
)
from sharpcli.catalogue import EXACT_HVP, WHICH
from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    CurvatureOperator,
    EigenResult,
    ParamScope,
    SpectralDensity,
    TraceResult,
    build_operator,
    lanczos,
    spectral_density,
)
from sharpcli.curvature.diagonal import DEFAULT_DIAGONAL_ESTIMATOR, DiagonalResult
from sharpcli.curvature.operators.preconditioned import (
    PreconditionedOperator,
    diagonal_preconditioner,
)
from sharpcli.curvature.operators.registry import HESSIAN
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.curvature.products.finite_difference import FiniteDifferenceEngine
from sharpcli.curvature.trace.estimators import DEFAULT_ESTIMATOR
from sharpcli.errors import InputError, UsageError, first_line
from sharpcli.io.data.in_memory import (
    LABEL_KEYS,
    LOSS_MODULES,
    CollectedData,
    apply_ignore_index,
    collect_data,
    loss_spec,
    model_on_data,
    own_loss_labels,
    refuse_unshifted_labels,
    resolve_loss,
    to_device,
    token_reduction_of,
)
from sharpcli.io.torch_losses.causal_lm import check_model_own_loss
from sharpcli.io.torch_losses.options import configure_loss, reference
from sharpcli.io.torch_losses.readings import LossReading, check_loss_value
from sharpcli.losses import get_loss, token_reduction
from sharpcli.preflight import SECOND_DERIVATIVE_SAMPLES, check_second_derivatives

__all__ = ["Curvature", "LABEL_KEYS"]


# The methods grouped by job, in this order: set-up (the arguments checked and the data read
# once), the products (the operators, their eval mode, the cache of first-order graphs, the
# parameter blocks), the curvature estimates, the preconditioned eigenvalues, the curvature
# along a training step and the loss at moved weights. docs/reference.md lists them so.
class Curvature:
    """Curvature of ``loss`` over ``data`` at ``model``'s weights.

    Eigenvalues, traces, density, the Gauss-Newton/NME split and the matrix-free products
    themselves.

    Args:
        model: An ``nn.Module``; its output is the logits tensor, an output object with
            ``.logits`` or a tuple whose first tensor is the logits. Used as it is (its parameters
            are the ones differentiated), except that ``device``/``dtype`` other than its own make a
            converted copy (``copy.deepcopy(model).to(device, dtype)``) taken here, leaving ``model``
            untouched (and later changes to its weights unseen).
        loss: A torch loss module with its options, as torch defines them:
            ``nn.CrossEntropyLoss`` (``weight``, ``ignore_index``, ``label_smoothing``,
            probability targets; classes on dim 1 of (batch, classes, d1, ..., dk) outputs as
            torch reads them, a language model's (batch, length, vocabulary) logits on the
            flattened positions), ``nn.NLLLoss`` after a ``LogSoftmax`` head,
            ``nn.BCEWithLogitsLoss`` (any shape; ``weight``, ``pos_weight``), ``nn.BCELoss``
            (a Sigmoid head's probabilities), ``nn.MSELoss``
            (any output shape), ``nn.HuberLoss``, ``nn.SmoothL1Loss``, each with
            ``reduction`` ``'mean'`` or ``'sum'``; or a spec ``NAME[:k=v,...]`` of a
            registered loss with the same options (``"cross-entropy:label_smoothing=0.1"``;
            :mod:`sharpcli.io.torch_losses.options`); docs/api.md tabulates the shapes. A module's
            value on the first batch must equal sharp's
            (:func:`sharpcli.io.torch_losses.readings.check_loss_value`). None (left out): a Hugging
            Face causal LM's own loss, its labels shifted as it shifts them and the value
            checked against its ``loss`` (:mod:`sharpcli.io.torch_losses.causal_lm`;
            ``loss_from_model`` and ``loss_note`` say so); refused for any other model.
        token_reduction: How a token loss averages over the set
            (:func:`sharpcli.losses.set_token_reduction`): ``"tokens"`` (the default; the mean over
            all labelled tokens, Hugging Face's loss) or ``"samples"`` (each sample's mean over its
            labelled positions, then the mean over samples; with the name
            ``"token-cross-entropy"`` only). Ignored by the other losses.
        data: ``(x, y)``, a dict of tensors with ``labels`` (or ``y``), a DataLoader or an
            iterable of batches (module docstring), or a ``datasets.Dataset`` (one batch).
        params: ``None`` (every trainable parameter), ``"last"`` (the last ``nn.Linear``) or
            comma-separated globs on parameter names (``"fc.*,head.weight"``).
        batch_size: Samples per product batch (memory only: the results are means over
            samples); default a DataLoader's batch size, or 256 for tensors.
        device: Where the products run; None: the model's device.
        dtype: The products' dtype; None: the model's.
        hvp: ``"exact"`` (double backward) or ``"finite-difference"``: Hessian products as
            central differences of gradients
            (:class:`~sharpcli.curvature.products.finite_difference.FiniteDifferenceEngine`), for a
            model without a double backward; the Hessian only (``ggn``, ``nme`` and ``blocks``
            are refused), no second-derivative self-check, and
            ``curvature.engine.bound_record()`` gives the step and the measured error
            bound ``||D v - H v|| <= error_bound ||v||``.

    Before anything is computed, a forward pass over the set (no gradients) checks that the
    model takes every input and that the loss fits its outputs and the labels, and one
    Hessian-vector product is compared with a difference of gradients in float64 on 8
    samples (the model's layers differentiate twice correctly;
    :func:`sharpcli.preflight.check_second_derivatives`).

    Raises:
        UsageError: an argument a user can get wrong, named in ``error.source``.

    >>> import torch
    >>> from torch import nn
    >>> from sharpcli import Curvature
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    >>> x, y = torch.randn(32, 4, dtype=torch.float64), torch.randint(0, 3, (32,))
    >>> curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    >>> H = curvature.operator().to_dense()          # 67 x 67, product by product
    >>> top = curvature.eigenvalues(top_k=2, tol=1e-8)
    >>> exact = torch.linalg.eigvalsh(H)              # ascending
    >>> torch.allclose(torch.tensor(top.eigenvalues, dtype=H.dtype), exact[-2:].flip(0))
    True
    >>> abs(curvature.trace(estimator="hutchpp", tol=1e-3).estimate - H.trace().item()) < 0.05
    True
    """

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

    # ----------------------------------------------------------------- set-up
    def __init__(
        self,
        model: nn.Module,
        loss: str | nn.Module | None = None,
        data: object = None,
        *,
        params: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = None,
        token_reduction: str | None = None,
        hvp: str = EXACT_HVP,
    ):
        if not isinstance(model, nn.Module):
            raise UsageError(f"expected an nn.Module, got {type(model).__name__}", source="model")
        model = unwrap(model)
        first = next(iter(model.parameters()), None)
        if first is None:
            raise UsageError("the model has no parameters", source="model")
        if batch_size is not None:
            integer_argument(batch_size, "batch_size")
        check_hvp(hvp)
        self.hvp = hvp
        self.dtype = dtype_argument(dtype, first.dtype)
        self.device = device_argument(device, first.device)
        if self.dtype != first.dtype or self.device != first.device:
            model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype)
        self.model = model
        self.loss_reading = None  # how the loss reads the outputs
        if data is None:
            raise UsageError(
                "no data: pass `data`, the batches the loss is taken over", source="data"
            )
        collected = collect_data(data, batch_size)
        # loss None: a Hugging Face causal LM's own loss (sharpcli.io.torch_losses.causal_lm), noted here
        self.loss_note: str | None = None
        if loss is None:
            loss, collected, self.loss_note = own_loss_labels(model, collected, token_reduction)
        self.loss_from_model = self.loss_note is not None
        self.loss, collected = self._loss_and_data(loss, collected)
        self.token_reduction = token_reduction_of(loss, self.loss, token_reduction)
        self.num_samples = collected.num_samples
        self.batch_size = collected.batch_size
        self._view = self._on_data(collected)
        self._check_forward()
        if hvp != FINITE_DIFFERENCE:  # differences of gradients never differentiate twice
            self._self_check(collected)
        index = torch.arange(self.num_samples)
        self.data = AnalysisData(index, collected.y, self.loss, self.batch_size)
        self.scope = ParamScope.resolve(self._view, params)
        engine_class = FiniteDifferenceEngine if hvp == FINITE_DIFFERENCE else CurvatureEngine
        self.engine = engine_class(self._view, self.data, self.scope)

    def _on_data(self, collected: CollectedData, rows: int | None = None) -> nn.Module:
        """The model view on (the first ``rows`` of) the analysis set, on the analysis device.

        Args:
            collected: the analysis set.
            rows: how many of its first rows (default all).

        Returns:
            The view: a module that takes sample indices and returns the model's outputs.
        """
        take = slice(None) if rows is None else slice(0, rows)
        x = None
        if collected.x is not None:
            x = to_device(collected.x[take], self.dtype, self.device)
        keywords = {
            k: to_device(v[take], self.dtype, self.device) for k, v in collected.keywords.items()
        }
        return model_on_data(self.model, x, keywords, self.loss_reading)

    def _loss_and_data(
        self, loss: str | nn.Module, collected: CollectedData
    ) -> tuple[str, CollectedData]:
        """The loss name for the model's outputs, and the data with ignored labels applied.

        Args:
            loss: the ``loss`` argument: a name or a loss module.
            collected: the analysis set.

        Returns:
            The loss's name and the analysis set with its labels as the loss reads them.

        Raises:
            UsageError: the loss is neither, the model cannot run on the data, or the outputs
                do not fit the loss.
        """
        if not isinstance(loss, (str, nn.Module)):
            raise UsageError(
                f"expected a loss module ({LOSS_MODULES}) or a name, got {type(loss).__name__}",
                source="loss",
            )
        rows = min(collected.batch_size, collected.num_samples)  # the first batch
        probe = self._on_data(collected, rows=rows)
        try:
            with torch.no_grad(), eval_mode(probe):
                logits = probe(torch.arange(rows, device=self.device))
        except UsageError:
            raise
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            first = first_line(exc)
            raise UsageError(
                f"the model cannot run on the inputs of `data` ({first})", source="data"
            ) from None
        head = collected.y[:rows].to(logits.device)
        reading, ignore_index = resolve_loss(loss, logits, head)
        name = reading.name
        self.loss_reading = reading  # the views from here on lay the outputs out for it
        labels = reading.labels(collected.y)
        collected = CollectedData(collected.x, collected.keywords, labels, collected.batch_size)
        collected = apply_ignore_index(collected, name, ignore_index)
        if self.loss_from_model:  # the number differentiated is the model's own `loss`
            inputs = self._first_inputs(collected, rows)
            check_model_own_loss(self.model, inputs, logits, collected.y[:rows].to(logits.device))
        elif not reading.reshapes:
            refuse_unshifted_labels(collected, name)
        # torch's options (reduction, weight, label_smoothing, ...) over the whole set
        spec = loss_spec(loss)
        name = configure_loss(spec, name, collected.y)
        reading = self.loss_reading = LossReading(name, reading.layout)
        few = collected.y[: min(2, collected.num_samples)].to(logits.device)
        probe = self._on_data(collected, rows=few.shape[0])
        with torch.no_grad(), eval_mode(probe):
            laid_out = probe(torch.arange(few.shape[0], device=self.device))
        problem = get_loss(name).problem(laid_out, few)
        if problem:
            raise UsageError(f"{problem} (loss {name})", source="data")
        if isinstance(loss, nn.Module):  # the loss differentiated is the module's own
            check_loss_value(loss, reading, logits, head, ignore_index)
        elif (module := reference(spec)) is not None:  # a spec with options: torch's module
            check_loss_value(module, reading, logits, head, ignore_index, spec.text)
        self.num_outputs = int(laid_out[0].numel())  # model outputs per sample
        return name, collected

    def _first_inputs(
        self, collected: CollectedData, rows: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The model's inputs on the first ``rows`` samples, on the analysis device.

        Args:
            collected: the analysis set.
            rows: how many of its first rows.

        Returns:
            A dict of keyword inputs, or the positional input.
        """
        if collected.x is not None:
            return to_device(collected.x[:rows], self.dtype, self.device)
        return {
            k: to_device(v[:rows], self.dtype, self.device) for k, v in collected.keywords.items()
        }

    def _check_forward(self) -> None:
        """One forward pass over the whole set without gradients, batch by batch.

        An input the model cannot take (a token id beyond its embedding, say) is a UsageError
        on ``data`` here rather than an error in the middle of a curvature product.

        Raises:
            UsageError: a batch the model cannot run on.
        """
        index = torch.arange(self.num_samples, device=self.device)
        with torch.no_grad(), eval_mode(self._view):
            for start in range(0, self.num_samples, self.batch_size):
                rows = index[start : start + self.batch_size]
                try:
                    self._view(rows)
                except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                    first = first_line(exc)
                    raise UsageError(
                        f"the model cannot run on samples {start}..{start + len(rows) - 1} of "
                        f"`data` ({first})",
                        source="data",
                    ) from None

    def _self_check(self, collected: CollectedData) -> None:
        """Refuse a model whose layers torch differentiates twice wrongly (8 samples).

        Args:
            collected: the analysis set.

        Raises:
            UsageError: torch's second derivatives of the model are wrong.
        """
        rows = min(SECOND_DERIVATIVE_SAMPLES, self.num_samples)
        view = self._on_data(collected, rows=rows)

        try:
            with analysis_mode(view):
                check_second_derivatives(
                    view, torch.arange(rows), collected.y[:rows], self.loss, source="model"
                )
        except InputError as exc:  # about the argument `model`, not a file
            raise UsageError(exc.message, source="model") from None

    # ----------------------------------------------------------------- products
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

    # ----------------------------------------------------------------- curvature estimates
    def eigenvalues(
        self,
        top_k: int = 1,
        which: str = "largest",
        operator: str = HESSIAN,
        *,
        method: str = "lanczos",
        tol: float = 1e-3,
        max_matvecs: int | None = None,
        seed: int = 0,
        return_eigenvectors: bool = False,
        blocks: str | Mapping[str, str] | None = None,
        k: int | None = None,
    ) -> EigenResult | list[dict[str, Any]]:
        r"""The ``top_k`` extreme eigenvalues of ``operator``, each certified by its residual.

        A Ritz pair :math:`(\theta, u)` is converged when
        :math:`\lVert A u - \theta u \rVert \le \mathrm{tol}\,|\theta|`.

        Args:
            top_k: How many eigenvalues (per end with ``which="both"``); ``sharp eigen
                --top-k``.
            which: ``"largest"``, ``"smallest"`` or ``"both"``.
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.
            method: ``"lanczos"`` ([Lanczos1950], full reorthogonalisation [Parlett1998])
                or ``"power"`` (the largest ``|eigenvalue|`` only, as [PyHessian]).
            tol: The relative residual each pair must reach.
            max_matvecs: The most products (Lanczos default ``min(P, 100)``).
            seed: Seeds the start vector.
            return_eigenvectors: Keep the Ritz vectors (P floats each) in the result.
            blocks: Per parameter block instead (:meth:`blocks_of`): the extreme eigenvalues
                of each principal sub-block ``A_bb``.
            k: The former name of ``top_k``, still accepted with a DeprecationWarning.

        Returns:
            An :class:`~sharpcli.curvature.EigenResult`: eigenvalues descending, their
            residuals and converged flags, the products spent. With ``blocks``: a list, per
            block, of ``{name, parameters, numel, eigenvalues, residuals, converged,
            matvecs}`` (``results.blocks`` of ``sharp eigen --blocks``; a block smaller than
            ``top_k`` gives all its eigenvalues).

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        if k is not None:
            warnings.warn(
                "Curvature.eigenvalues(k=...) is deprecated; use top_k=...",
                DeprecationWarning,
                stacklevel=2,
            )
            top_k = k
        integer_argument(top_k, "top_k")
        seed_argument(seed)
        self.refresh()
        if blocks is not None and return_eigenvectors:
            raise UsageError("not with `blocks`", source="return_eigenvectors")
        settings: dict[str, Any] = dict(
            which=which, method=method, tol=tol, max_matvecs=max_matvecs, seed=seed
        )
        with self._analysis_mode():
            if blocks is not None:
                return eigen_blocks(
                    self.blocks_of(blocks), operator=operator, top_k=top_k, **settings
                )
            return eigen_result(
                self.engine,
                operator,
                top_k=top_k,
                return_eigenvectors=return_eigenvectors,
                **settings,
            )

    def trace(
        self,
        operator: str = HESSIAN,
        *,
        estimator: str = DEFAULT_ESTIMATOR,
        square: bool = False,
        tol: float = 1e-2,
        max_matvecs: int = 1000,
        seed: int = 0,
        blocks: str | Mapping[str, str] | None = None,
    ) -> TraceResult | list[dict[str, Any]]:
        r"""``tr(A)`` of ``operator`` (or ``Tr(A^2)``), with standard error and per-layer traces.

        The per-layer traces are those of the diagonal blocks.

        .. math::

            \mathrm{tr}(A) \approx \frac{1}{n} \sum_{j=1}^n g_j^\top A g_j, \qquad
            \mathrm{Tr}(A^2) \approx \frac{1}{n} \sum_{j=1}^n \lVert A g_j \rVert^2

        for Rademacher probes :math:`g_j`, the number of probes sized by a pilot so that the
        standard error reaches ``tol`` ([Stein1945]).

        Args:
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.
            estimator: ``"hutchpp"`` ([Hutch++]), ``"hutchinson"`` ([Hutchinson1989]),
                ``"exact"`` (any operator: per-sample squared gradient norms for ``ggn``,
                ``ef`` and ``fisher``; ``tr(H) - tr(G)`` for ``nme``; one product per
                parameter for the Hessian, other operators and ``square``, refused above
                :data:`~sharpcli.curvature.trace.exact.EXACT_MAX_PARAMS` parameters) or
                ``"gn-split"`` (tr(H) as exact tr(G) plus an estimated tr(N)).
            square: Estimate ``Tr(A^2)`` instead of ``tr(A)``.
            tol: The relative standard error wanted.
            max_matvecs: The most products.
            seed: Seeds the probes.
            blocks: Per parameter block instead (:meth:`blocks_of`): the trace of each
                principal sub-block ``A_bb`` (their sum over a partition is ``tr(A)``).

        Returns:
            A :class:`~sharpcli.curvature.TraceResult` (``estimate``, ``stderr``,
            ``by_layer``, ``matvecs``, ``samples``, ``converged``). With ``blocks``: a list,
            per block, of ``{name, parameters, numel, estimate, stderr, data_stderr,
            data_method, matvecs, converged}``
            (``results.blocks`` of ``sharp trace --blocks``).

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        seed_argument(seed)
        self.refresh()
        settings: dict[str, Any] = dict(
            estimator=estimator, square=square, tol=tol, max_matvecs=max_matvecs
        )
        with self._analysis_mode():
            if blocks is not None:
                passes = self.blocks_of(blocks)
                return trace_blocks(passes, operator=operator, seed=seed, summed=False, **settings)[
                    0
                ]
            return trace_result(self.engine, operator, seed=seed, **settings)

    def diagonal(
        self,
        operator: str | None = None,
        *,
        estimator: str = DEFAULT_DIAGONAL_ESTIMATOR,
        probes: int = 100,
        max_products: int = 10000,
        seed: int = 0,
    ) -> DiagonalResult:
        r"""``diag(A)`` of ``operator`` per parameter, as ``sharp diagonal`` computes it.

        Args:
            operator: any registered operator; None: ``"hessian"`` for ``exact`` and
                ``hutchinson``, ``"ggn"`` for ``gnb`` and ``per-sample``.
            estimator: ``"hutchinson"`` (mean of :math:`v \odot A v` over Rademacher probes,
                [Bekas2007]), ``"exact"`` (one product per parameter), ``"gnb"`` (Sophia's
                Gauss-Newton-Bartlett estimator of diag(G), [Sophia]) or ``"per-sample"``
                (the exact ggn diagonal as BackPACK's DiagGGN, [BackPACK], the ef's or the
                fisher's at its own label draws).
            probes: Rademacher probes or label draws (at least 2).
            max_products: the products ``exact`` may spend, or the backward passes per sample
                ``per-sample`` may.
            seed: seeds the probes or draws.

        Returns:
            A :class:`~sharpcli.curvature.diagonal.DiagonalResult`: ``diagonal`` and
            ``stderr`` flat, ``tensors()`` by parameter name and shape.

        Raises:
            UsageError: an argument out of range or an estimator that does not give
                ``operator``'s diagonal, named by its keyword.
        """
        seed_argument(seed)
        self.refresh()
        with self._analysis_mode():
            return diagonal_result(
                self.engine,
                operator,
                estimator=estimator,
                probes=probes,
                max_products=max_products,
                seed=seed,
            )[1]

    def density(
        self,
        operator: str = HESSIAN,
        *,
        probes: int = 4,
        steps: int = 64,
        grid_points: int = 512,
        broadening: float | None = None,
        seed: int = 0,
        blocks: str | Mapping[str, str] | None = None,
    ) -> SpectralDensity | list[dict[str, Any]]:
        r"""Spectral density of ``operator`` by stochastic Lanczos quadrature.

        As in [Ubaru2017] and [Ghorbani2019].

        .. math::

            \phi(t) \approx \frac{1}{n_v} \sum_{l=1}^{n_v} \sum_{i=1}^{m}
            \tau_i^{(l)} \, g_\sigma\bigl(t - \theta_i^{(l)}\bigr)

        with the nodes :math:`\theta_i` and weights :math:`\tau_i` of each probe's
        ``steps``-step Lanczos tridiagonal and :math:`g_\sigma` a Gaussian of width
        ``broadening``.

        Args:
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.
            probes: Rademacher probes :math:`n_v`.
            steps: Lanczos steps :math:`m` per probe.
            grid_points: Points of the evaluation grid (at least 2).
            broadening: :math:`\sigma`; None: 1% of the node range.
            seed: Seeds the probes.
            blocks: Per parameter block instead (:meth:`blocks_of`): the density of each
                principal sub-block ``A_bb`` ([Zhang2024]), ``steps`` at most its size.

        Returns:
            A :class:`~sharpcli.curvature.SpectralDensity` (``grid``, ``density``,
            ``nodes``, ``weights``, ``trace_estimate``, ``trace_stderr``). With ``blocks``: a
            list, per block, of ``{name, parameters, numel, grid, density, nodes, weights,
            sigma, lambda_min, lambda_max, trace_estimate, trace_stderr, matvecs}``
            (``results.blocks`` of ``sharp density --blocks``).

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        integer_argument(probes, "probes")
        integer_argument(steps, "steps")
        integer_argument(grid_points, "grid_points", minimum=2)
        seed_argument(seed)
        if blocks is not None:
            self.refresh()
            with self._analysis_mode():
                return density_blocks(
                    self.blocks_of(blocks),
                    operator=operator,
                    probes=probes,
                    steps=steps,
                    grid_points=grid_points,
                    broadening=broadening,
                    seed=seed,
                )
        op = self.operator(operator)
        with self._analysis_mode():
            return spectral_density(
                op,
                probes=probes,
                steps=steps,
                grid_points=grid_points,
                broadening=broadening,
                seed=seed,
            )

    def gn_nme(
        self,
        *,
        tol: float = 1e-2,
        eig_tol: float = 1e-3,
        max_matvecs: int = 1000,
        seed: int = 0,
        label_samples: int = 4,
        ggn_estimator: str = "auto",
    ) -> dict[str, Any]:
        r"""The split of the Hessian into Gauss-Newton and nonlinear-modeling-error parts.

        [NME] eq. 2:

        .. math::

            H = G + N, \qquad G = \frac{1}{N} \sum_i J_i^\top H_{z,i} J_i.

        For each of ``hessian``, ``ggn`` and ``nme``: the trace with its standard error
        (shared probes, so the identity holds for the estimates), ``frobenius_sq``,
        ``lambda_max`` and ``lambda_min``; ``nme_share = tr(N)/tr(H)``,
        ``nme_frobenius_ratio``, per-layer rows (``layers``) and tr(G) cross-checked by other
        estimators (``ggn_trace_check``).

        Args:
            tol: The relative standard error wanted of tr(H) and tr(G).
            eig_tol: The relative residual of the extreme eigenvalues.
            max_matvecs: The most joint products for the traces.
            seed: Seeds the probes.
            label_samples: Label draws per sample of the sampled-label tr(G).
            ggn_estimator: ``"auto"``, ``"exact"``, ``"sampled"`` or ``"hutchinson"``: which
                tr(G) cross-checks run (:func:`sharpcli.analyses.spectrum.ggn_check_plan`).

        Returns:
            The dict that is the ``results`` of ``sharp gn-nme --json``.

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        seed_argument(seed)
        self.refresh()
        with self._analysis_mode():
            return gn_nme_result(
                self.engine,
                loss=self.loss,
                num_outputs=self.num_outputs,
                labels=self.data.y,
                seed=seed,
                tol=tol,
                eig_tol=eig_tol,
                max_matvecs=max_matvecs,
                label_samples=label_samples,
                ggn_estimator=ggn_estimator,
            )

    # ----------------------------------------------------------------- preconditioned eigenvalues
    def preconditioned_eigenvalues(
        self,
        preconditioner: torch.optim.Optimizer | torch.Tensor | Sequence[torch.Tensor],
        top_k: int = 1,
        which: str = "largest",
        operator: str = HESSIAN,
        *,
        tol: float = 1e-3,
        max_matvecs: int | None = None,
        seed: int = 0,
        start: torch.Tensor | None = None,
        return_eigenvectors: bool = False,
    ) -> EigenResult:
        r"""The ``top_k`` extreme eigenvalues of :math:`P^{-1} A`, each certified by its residual.

        They are those of the symmetric :math:`\tilde A = P^{-1/2} A P^{-1/2}`, on which Lanczos
        ([Lanczos1950]) runs; a Ritz pair is converged when
        :math:`\lVert \tilde A u - \theta u \rVert \le \mathrm{tol}\,|\theta|`. With an Adam
        optimizer's ``P = diag(sqrt(v_hat) + eps)`` the largest is the preconditioned sharpness
        of [Cohen2022], which training holds near ``(2 + 2 beta1)/((1 - beta1) lr)``
        (:func:`sharpcli.analyses.stability.stability_threshold`).

        Args:
            preconditioner: an optimizer whose state gives ``P`` now (``Adam``, ``AdamW``:
                ``sqrt(v / (1 - beta2^t)) + eps``; ``RMSprop``: ``sqrt(v) + eps``), or ``P``
                itself: one flat positive tensor of length P, or one per parameter in scope.
            top_k: How many eigenvalues (per end with ``which="both"``).
            which: ``"largest"``, ``"smallest"`` or ``"both"``.
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.
            tol: The relative residual each pair must reach.
            max_matvecs: The most products (default ``min(P, 100)``).
            seed: Seeds the start vector.
            start: A start vector (length P, in the preconditioned coordinates: an earlier
                result's eigenvector warm-starts the next), instead of the seeded Gaussian.
            return_eigenvectors: Keep the Ritz vectors :math:`u` of :math:`\tilde A` (an
                eigenvector of :math:`P^{-1} A` is :math:`P^{-1/2} u`).

        Returns:
            An :class:`~sharpcli.curvature.EigenResult`, eigenvalues descending.

        Raises:
            UsageError: an argument out of range, named by its keyword; an optimizer that has
                no diagonal preconditioner or has taken no step (``preconditioner``).
        """
        integer_argument(top_k, "top_k")
        seed_argument(seed)
        check_choice(which, WHICH, "which")
        if start is not None and (
            not isinstance(start, torch.Tensor) or start.numel() != self.num_params
        ):
            raise UsageError(f"a vector of length {self.num_params} expected", source="start")
        diagonal = diagonal_preconditioner(preconditioner, self.scope)
        self.refresh()
        with self._analysis_mode():
            op = PreconditionedOperator(operator_of(self.engine, operator), diagonal)
            return lanczos(
                op,
                top_k=top_k,
                which=which,
                tol=tol,
                max_matvecs=max_matvecs,
                seed=seed,
                start=start,
                return_eigenvectors=return_eigenvectors,
            )

    # ----------------------------------------------------------------- along a training step
    def batch_sharpness(
        self, batch_size: int, *, max_batches: int | None = None, seed: int = 0
    ) -> BatchSharpness:
        r"""Batch sharpness [Andreyev2024], with its standard error over the mini-batches.

        The mean over mini-batches B of :math:`g_B^\top H_B g_B / \lVert g_B \rVert^2`. The
        mini-batches are drawn without replacement from the analysis set (a seeded
        permutation cut into ``N // batch_size`` batches); each costs one gradient and one
        Hessian product of its own loss. Mini-batch SGD at learning rate lr holds it near
        2/lr (the edge of stochastic stability).

        Args:
            batch_size: The mini-batch size (the training batch size); above N: the whole
                set, once.
            max_batches: The most mini-batches (None: all ``N // batch_size``).
            seed: Seeds the draw.

        Returns:
            A :class:`~sharpcli.analyses.step_curvature.BatchSharpness`.

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        integer_argument(batch_size, "batch_size")
        if max_batches is not None:
            integer_argument(max_batches, "max_batches")
        seed_argument(seed)
        self.refresh()
        reduction = self.token_reduction

        def own_tokens(data: AnalysisData) -> contextlib.AbstractContextManager[Any]:
            # a token loss averaged over the mini-batch's own labelled tokens
            if reduction is None:
                return contextlib.nullcontext()
            return token_reduction(reduction, data.y)

        with self._analysis_mode():
            return batch_sharpness(
                self.engine,
                batch_size,
                seed=seed,
                max_batches=max_batches,
                batch_context=own_tokens,
            )

    def critical_sharpness(
        self,
        optimizer: Any = None,
        *,
        direction: torch.Tensor | None = None,
        start: float | None = None,
        tol: float = 0.05,
        max_passes: int = 30,
    ) -> CriticalSharpness:
        r"""Critical sharpness [Kalra2026], by a line search in forward passes.

        :math:`2/\eta_c`, :math:`\eta_c` the learning rate at which one step along the update
        direction d starts to raise the loss (no Hessian product).

        Equal to :math:`d^\top H d / (-g^\top d)` on a quadratic loss (the Rayleigh quotient of
        H along g for gradient descent); in general the mean curvature along the step over the
        slope (:mod:`sharpcli.analyses.step_curvature`).

        Args:
            optimizer: A ``torch.optim`` SGD (momentum, Nesterov), Adam, AdamW or RMSprop over
                this Curvature's model: d is its next step per unit learning rate, from its
                state and the gradient on the analysis set (neither it nor the model is
                changed). None: gradient descent, ``d = -g``.
            direction: d itself, a flat tensor of :attr:`num_params` values (the scope's
                layout), instead of an optimizer's.
            start: The first rate tried (None: the optimizer's learning rate, else |L| / |g.d|).
            tol: The relative width of the bracket on the rate, in (0, 1).
            max_passes: The most forward passes of the search.

        Returns:
            A :class:`~sharpcli.analyses.step_curvature.CriticalSharpness` (its ``threshold``:
            2/lr, above which the optimizer's next step raises the loss).

        Raises:
            UsageError: an argument out of range or an optimizer not supported, named by its
                keyword.
        """
        if not isinstance(tol, (int, float)) or not (0.0 < float(tol) < 1.0):
            raise UsageError(f"must be in (0, 1), got {tol!r}", source="tol")
        integer_argument(max_passes, "max_passes")
        if start is not None and not (
            isinstance(start, (int, float)) and math.isfinite(start) and start > 0
        ):
            raise UsageError(f"must be a positive number, got {start!r}", source="start")
        self.refresh()
        with self._analysis_mode():
            return critical_sharpness(
                self.engine,
                optimizer,
                direction=direction,
                start=start,
                tol=float(tol),
                max_passes=max_passes,
            )

    def gradient_share(
        self,
        k: int | None = None,
        *,
        tol: float = 1e-3,
        max_matvecs: int | None = None,
        seed: int = 0,
    ) -> GradientShare:
        r"""The gradient's share in the top-k Hessian eigenspace [GurAri2018].

        :math:`\lVert V_k^\top g \rVert^2 / \lVert g \rVert^2`, :math:`V_k` the top-k
        eigenvectors (Lanczos).

        Args:
            k: The top eigenvectors (None: the number of classes, the model's outputs per
                sample, as in the paper).
            tol: The Lanczos relative residual.
            max_matvecs: The most Hessian products (default ``min(P, 100)``).
            seed: Seeds the Lanczos start vector.

        Returns:
            A :class:`~sharpcli.analyses.step_curvature.GradientShare`.

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        if k is not None:
            integer_argument(k, "k")
        if max_matvecs is not None:
            integer_argument(max_matvecs, "max_matvecs")
        seed_argument(seed)
        self.refresh()
        with self._analysis_mode():
            return gradient_share(self.engine, k, tol=tol, max_matvecs=max_matvecs, seed=seed)

    # ----------------------------------------------------------------- the loss at moved weights
    def sharpness(
        self,
        *,
        kind: str = "worst-case",
        norm: str = "l2",
        rho: float | tuple[float, ...] = 0.05,
        adaptive: bool = True,
        m: int | None = None,
        steps: int = 20,
        restarts: int = 1,
        noise_draws: int = 100,
        seed: int = 0,
    ) -> dict[str, Any]:
        r"""Worst-case or average-case sharpness, adaptive or standard [Andriushchenko2023].

        Adaptive: c = |w|; standard: c = 1.

        .. math::

            \max_{\|\delta / c\|_p \le \rho} L_S(w + \delta) - L_S(w), \qquad
            \mathbb{E}_{\delta \sim N(0, \rho^2 \mathrm{diag}(c^2))} L_S(w + \delta) - L_S(w),

        averaged over batches S of ``m`` samples (:mod:`sharpcli.analyses.sharpness`).

        Args:
            kind: ``"worst-case"`` (Auto-PGD) or ``"average"``.
            norm: ``"l2"`` or ``"linf"``.
            rho: one radius or several.
            adaptive: c = |w| rather than 1.
            m: samples per sharpness batch (None: the whole set).
            steps: Auto-PGD steps per restart.
            restarts: Auto-PGD restarts.
            noise_draws: draws per batch (average case).
            seed: seeds the restarts and the noise.

        Returns:
            The dict that is the ``results`` of ``sharp sharpness --json``.

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        rhos = tuple(rho) if isinstance(rho, (list, tuple)) else (rho,)
        config = SharpnessConfig(
            kind=kind, norm=norm, rhos=tuple(float(r) for r in rhos), adaptive=adaptive, m=m,
            params=self.scope.spec, steps=steps, restarts=restarts, noise_draws=noise_draws,
            seed=seed_argument(seed),
        )  # fmt: skip
        with self._analysis_mode():
            return sharpness(self._view, self.data, config).to_dict()

    def landscape(
        self,
        *,
        along: str = "random",
        other: nn.Module | None = None,
        dims: int = 2,
        steps: int = 21,
        span: float | None = None,
        bias_bn: str = "zero",
        seed: int = 0,
    ) -> dict[str, Any]:
        """The loss and accuracy on a line or plane through the weights [Li2018].

        Along filter-normalized random directions, the top Hessian eigenvectors, or the line to
        ``other`` (a model of the same architecture); :mod:`sharpcli.analyses.landscape`.

        Args:
            along: ``"random"``, ``"eigen"`` or ``"checkpoint"`` (with ``other``).
            other: the second model of ``along="checkpoint"``.
            dims: 1 (a line) or 2 (a plane).
            steps: grid points per axis.
            span: the grid's half-width (default 1; along a checkpoint the extrapolation, 0.5).
            bias_bn: random directions on 1-D parameters: ``"zero"`` or ``"weights"``.
            seed: seeds the random directions.

        Returns:
            The dict that is the ``results`` of ``sharp landscape --json``.

        Raises:
            UsageError: an argument out of range, or ``other`` of another architecture.
        """
        config = LandscapeConfig(
            along=along, dims=dims, steps=steps, span=span, bias_bn=bias_bn,
            params=self.scope.spec, seed=seed_argument(seed),
        )  # fmt: skip
        if other is not None:
            other = copy.deepcopy(unwrap(other)).to(device=self.device, dtype=self.dtype)
        with self._analysis_mode():
            result, _, _ = loss_landscape(self._view, self.data, config, other=other)
        return result.to_dict()

    def __repr__(self) -> str:
        return (
            f"Curvature({type(self.model).__name__}, loss={self.loss!r}, "
            f"samples={self.num_samples}, params={self.num_params}, dtype={self.dtype}, "
            f"device={self.device})"
        )


# ------------------------------------------------------------ the model as Curvature runs it
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
