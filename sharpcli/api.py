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

import copy

import torch
from torch import nn

from sharpcli.analyses.hvp import FINITE_DIFFERENCE, check_hvp
from sharpcli.api_methods.arguments import device_argument, dtype_argument, integer_argument
from sharpcli.api_methods.estimates import CurvatureEstimates
from sharpcli.api_methods.modes import analysis_mode, eval_mode, unwrap
from sharpcli.api_methods.perturbed import PerturbedLoss
from sharpcli.api_methods.preconditioned import PreconditionedEstimates
from sharpcli.api_methods.step_curvature import StepCurvature
from sharpcli.catalogue import EXACT_HVP
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.curvature.products.finite_difference import FiniteDifferenceEngine
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
from sharpcli.losses import get_loss
from sharpcli.preflight import SECOND_DERIVATIVE_SAMPLES, check_second_derivatives

__all__ = ["Curvature", "LABEL_KEYS"]


# Here: the arguments checked and the data read once. What a Curvature can then be asked is
# inherited, grouped by job (sharpcli.api_methods): the operators and their cache (products),
# the curvature estimates (estimates), the loss at moved weights (perturbed). The bases' order
# makes docs/reference.md list them in that order.
class Curvature(PerturbedLoss, CurvatureEstimates, PreconditionedEstimates, StepCurvature):
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

    @property
    def curvature_pass(self) -> CurvatureEngine:
        """The engine (:attr:`engine`), by the name docs/api.md gave it first."""
        return self.engine

    # ----------------------------------------------------------------- set-up
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

    def __repr__(self) -> str:
        return (
            f"Curvature({type(self.model).__name__}, loss={self.loss!r}, "
            f"samples={self.num_samples}, params={self.num_params}, dtype={self.dtype}, "
            f"device={self.device})"
        )
