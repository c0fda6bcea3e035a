"""Curvature operators: symmetric P x P matrices known by their products, and their algebra.

For the analysis loss :math:`L(\\theta) = \\frac{1}{N} \\sum_i \\ell(z_i, y_i)` with logits
:math:`z_i = f(\\theta, x_i)`, Jacobians :math:`J_i = \\partial z_i / \\partial \\theta` and logit
Hessians :math:`H_{z,i} = \\partial^2 \\ell / \\partial z_i^2`:

.. math::

    H = \\nabla^2_\\theta L, \\qquad
    G = \\frac{1}{N} \\sum_i J_i^\\top H_{z,i} J_i, \\qquad
    N = H - G = \\frac{1}{N} \\sum_i \\sum_c
        \\frac{\\partial \\ell_i}{\\partial z_{ic}} \\nabla^2_\\theta z_{ic}

(the Gauss-Newton matrix of [Schraudolph2002], see also [Martens2020]; the split and the name
NME, nonlinear modelling error, are [NME] eq. 2). :class:`HessianOperator`, :class:`GGNOperator`
and :class:`NMEOperator` multiply through one shared :class:`~sharpcli.curvature.products.engine.CurvatureEngine`
(the cache of first-order graphs). Operators add, subtract and scale (``A + B``, ``A - B``,
``c * A``, ``-A``, ``A / c``): the result is a :class:`LinearCombination`, and terms on one
engine are multiplied in one pass over the data (``H - G`` in the NME's own product, ``a H + b G``
in the joint H and G pass). Estimators only call ``op @ V``; :func:`joint_matmat` multiplies
several operators by one block, sharing that pass.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
    >>> engine = CurvatureEngine(model, AnalysisData(x, y, "cross-entropy", 5), ParamScope.resolve(model))
    >>> H, G = engine.hessian(), engine.ggn()
    >>> N = H - G                                    # the NME as algebra ([NME] eq. 2)
    >>> v = torch.randn(H.shape[0], dtype=torch.float64)
    >>> torch.allclose(N @ v, engine.nme() @ v)
    True
    >>> torch.allclose((2 * H - G / 2) @ v, 2 * (H @ v) - 0.5 * (G @ v))
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sharpcli.curvature.products.data import AnalysisData, subsample_data
from sharpcli.curvature.products.engine import DEFAULT_CACHE_BYTES, CurvatureEngine
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.errors import UsageError

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "CurvatureEngine",
    "CurvatureOperator",
    "GGNOperator",
    "HessianOperator",
    "LinearCombination",
    "MatrixOperator",
    "NMEOperator",
    "joint_matmat",
]

# An operator's place in the plane spanned by one engine's H and G: (engine, a, b) for a H + b G.
_Coordinates = tuple[CurvatureEngine, float, float]


class CurvatureOperator:
    """A symmetric P x P linear operator :math:`A` given by its products :math:`A V`.

    Subclasses define ``_matmat(V)``; the base class checks shapes and counts products
    (``matvecs``), and gives ``matvec``, ``@``, ``to_dense`` and the algebra ``A + B``,
    ``A - B``, ``c * A``, ``-A``, ``A / c`` (a :class:`LinearCombination`).

    An operator built on a :class:`~sharpcli.curvature.products.engine.CurvatureEngine` (``engine``)
    also knows its per-layer blocks (:meth:`blocks`), the loss gradient of its analysis set
    (:meth:`loss_and_gradient`) and itself on a data subsample (:meth:`on_subsample`). A
    class in the registry's convention (its constructor takes the engine and it keeps
    ``model``, ``data`` and ``scope``) gets these too.

    Args:
        dim: the size P.
        dtype: the dtype of the products.
        device: the device of the products.
    """

    name: str = "operator"
    engine: CurvatureEngine | None = None

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device | str):
        self.shape = (dim, dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.matvecs = 0

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:  # each subclass supplies its product
        raise TypeError(
            f"{type(self).__name__} defines no product; subclass CurvatureOperator and define _matmat"
        )

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """The product with a block of columns.

        Args:
            V: a ``(P, k)`` block.

        Returns:
            :math:`A V`, shape ``(P, k)``, in one pass over the data.
        """
        if V.dim() != 2 or V.shape[0] != self.shape[1]:
            raise ValueError(
                f"{self.name}: expected a ({self.shape[1]}, k) block, got {tuple(V.shape)}"
            )
        out = self._matmat(V.to(dtype=self.dtype, device=self.device))
        self.matvecs += V.shape[1]
        return out

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """The product with one vector.

        Args:
            v: a flat vector of length P.

        Returns:
            :math:`A v`, shape ``(P,)``.
        """
        return self.matmat(v.reshape(-1, 1))[:, 0]

    def __matmul__(self, other: torch.Tensor) -> torch.Tensor:
        return self.matvec(other) if other.dim() == 1 else self.matmat(other)

    def to_dense(self, block: int = 64) -> torch.Tensor:
        """The dense matrix, from products with identity columns (only for tiny P).

        Args:
            block: identity columns per product.

        Returns:
            :math:`A` as a ``(P, P)`` tensor.
        """
        dim = self.shape[0]
        eye = torch.eye(dim, dtype=self.dtype, device=self.device)
        return torch.cat([self.matmat(eye[:, s : s + block]) for s in range(0, dim, block)], dim=1)

    def clear_cache(self) -> None:
        """Drop the engine's cached graphs (nothing for operators without an engine)."""
        if self.engine is not None:
            self.engine.clear_cache()

    # ----------------------------------------------------------------- analysis set
    def blocks(self) -> dict[str, slice]:
        """The per-layer diagonal blocks of the parameter vector.

        Returns:
            ``{module name: slice}`` of the engine's scope; empty without an engine.
        """
        return dict(self.engine.scope.blocks()) if self.engine is not None else {}

    def _analysis_engine(self) -> CurvatureEngine:
        """The engine of the operator, or one over the registry convention's ``model``,
        ``data`` and ``scope``; UsageError (source ``operator``) when it has neither."""
        if self.engine is not None:
            return self.engine
        model, data, scope = (getattr(self, name, None) for name in ("model", "data", "scope"))
        if isinstance(model, nn.Module) and isinstance(data, AnalysisData):
            if isinstance(scope, ParamScope):
                return CurvatureEngine(model, data, scope)
        raise UsageError(
            f"{type(self).__name__} is not a curvature operator over an analysis set",
            source="operator",
        )

    def _rebuild(self, engine: CurvatureEngine) -> CurvatureOperator:
        """The same operator on another engine: the registry's convention, ``type(self)(engine)``."""
        try:
            return type(self)(engine)  # type: ignore[call-arg, arg-type]
        except TypeError as error:
            raise UsageError(
                f"cannot rebuild {type(self).__name__} on another engine ({error})",
                source="operator",
            ) from error

    def on_subsample(self, fraction: float, seed: int = 0) -> tuple[CurvatureOperator, int, int]:
        """The same operator over a seeded random subsample of its analysis set.

        On its own engine (same model, scope, cache budget and vectorisation) over
        :func:`~sharpcli.curvature.products.data.subsample_data`: the mean curvature over the subset,
        :math:`A_S = \\frac{1}{|S|} \\sum_{i \\in S} A_i`.

        Args:
            fraction: the fraction of samples kept, in (0, 1].
            seed: seeds the choice of samples.

        Returns:
            ``(operator on the subsample, samples kept, samples of the whole set)``.
        """
        engine = self._analysis_engine()
        sub = subsample_data(engine.data, fraction, seed)
        sub_engine = CurvatureEngine(
            engine.model,
            sub,
            engine.scope,
            cache_bytes=engine.cache_bytes,
            vectorize=engine.vectorize,
        )
        return self._rebuild(sub_engine), int(sub.num_samples), int(engine.data.num_samples)

    def loss_and_gradient(self) -> tuple[float, torch.Tensor]:
        """The analysis loss and its gradient (one plain backward pass over the data).

        Returns:
            ``(L(theta), grad L(theta))``, the gradient flat in the scope's layout.
        """
        return self._analysis_engine().loss_and_gradient()

    # ----------------------------------------------------------------- algebra
    def _coordinates(self) -> _Coordinates | None:
        """``(engine, a, b)`` when this operator is ``a H + b G`` of one engine, else None."""
        return None

    def _terms(self) -> list[tuple[float, CurvatureOperator]]:
        return [(1.0, self)]

    def __add__(self, other: object) -> CurvatureOperator:
        if not isinstance(other, CurvatureOperator):
            return NotImplemented
        return LinearCombination(self._terms() + other._terms())

    def __sub__(self, other: object) -> CurvatureOperator:
        if not isinstance(other, CurvatureOperator):
            return NotImplemented
        return LinearCombination(self._terms() + [(-c, op) for c, op in other._terms()])

    def __mul__(self, scalar: object) -> CurvatureOperator:
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
            return NotImplemented
        return LinearCombination([(float(scalar) * c, op) for c, op in self._terms()])

    __rmul__ = __mul__

    def __truediv__(self, scalar: object) -> CurvatureOperator:
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
            return NotImplemented
        return self * (1.0 / float(scalar))

    def __neg__(self) -> CurvatureOperator:
        return self * -1.0


class _EngineOperator(CurvatureOperator):
    """An operator whose product is ``a H + b G`` of its engine (``_A``, ``_B``)."""

    _A: float = 1.0
    _B: float = 0.0

    def __init__(
        self,
        model: nn.Module | None = None,
        data: AnalysisData | None = None,
        scope: ParamScope | None = None,
        *,
        engine: CurvatureEngine | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        if engine is None:
            if model is None or data is None or scope is None:
                raise TypeError(f"{type(self).__name__} needs model, data and scope, or engine")
            engine = CurvatureEngine(model, data, scope, cache_bytes=cache_bytes)
        if self._B != 0:  # G's product needs the engine's first-order graphs
            engine.require_gauss_newton(self.name)
        super().__init__(engine.scope.numel, engine.scope.dtype, engine.scope.device)
        self.engine = engine

    @property
    def model(self) -> nn.Module:
        """The engine's model."""
        return self._engine.model

    @property
    def data(self) -> AnalysisData:
        """The engine's analysis set."""
        return self._engine.data

    @property
    def scope(self) -> ParamScope:
        """The engine's parameter scope."""
        return self._engine.scope

    @property
    def _engine(self) -> CurvatureEngine:
        assert self.engine is not None  # set in __init__
        return self.engine

    def _coordinates(self) -> _Coordinates:
        return (self._engine, self._A, self._B)

    def _rebuild(self, engine: CurvatureEngine) -> CurvatureOperator:
        return type(self)(engine=engine)

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        return _engine_product(self._engine, self._A, self._B, V, self.name)


class HessianOperator(_EngineOperator):
    """The Hessian of the analysis loss with respect to the scope's parameters.

    .. math::

        H v = \\frac{1}{N} \\sum_i \\nabla^2_\\theta \\ell_i \\, v

    A double backward through each batch's cached first-order graph :math:`g = J^\\top g_z`.

    Args:
        model: the model (with ``data`` and ``scope``, when no ``engine`` is given).
        data: the analysis set.
        scope: the parameters differentiated.
        engine: an engine to share (its cache with it) instead of a new one.
        cache_bytes: the new engine's cache budget.
    """

    name = "Hessian"
    _A, _B = 1.0, 0.0


class GGNOperator(_EngineOperator):
    """The generalised Gauss-Newton matrix [Schraudolph2002] ([NME] eq. 2, first term).

    .. math::

        G v = \\frac{1}{N} \\sum_i J_i^\\top H_{z,i} J_i \\, v

    :math:`J v` comes from differentiating :math:`\\langle J^\\top g_z, v \\rangle` with respect
    to :math:`g_z`; :math:`H_{z,i}` is the logit Hessian of the loss (cross-entropy:
    :math:`\\mathrm{diag}(p) - p p^\\top`; mse: :math:`(2/C) I`). G is positive semi-definite.

    Constructed as :class:`HessianOperator`.
    """

    name = "Gauss-Newton"
    _A, _B = 0.0, 1.0


class NMEOperator(_EngineOperator):
    """The nonlinear modelling error ([NME] eq. 2, second term), zero where :math:`dl/dz = 0`.

    .. math::

        N v = (H - G) v = \\frac{1}{N} \\sum_i \\sum_c
            \\frac{\\partial \\ell_i}{\\partial z_{ic}} \\nabla^2_\\theta z_{ic} \\, v

    Computed directly as the Hessian of :math:`\\langle z, g_z \\rangle` with :math:`g_z` held
    constant (one double backward, about the cost of :math:`H v`); equal to ``H - G`` of the
    same engine, which the algebra multiplies the same way.

    Constructed as :class:`HessianOperator`.
    """

    name = "NME"
    _A, _B = 1.0, -1.0


class MatrixOperator(CurvatureOperator):
    """A dense symmetric matrix as an operator (exact small problems, tests): :math:`A v`.

    Args:
        matrix: a square ``(P, P)`` tensor.
        name: the operator's name in messages.

    Example:
        >>> import torch
        >>> A = MatrixOperator(torch.diag(torch.tensor([1.0, 2.0, 3.0])))
        >>> (A + 2 * A) @ torch.ones(3)
        tensor([3., 6., 9.])
    """

    name = "matrix"

    def __init__(self, matrix: torch.Tensor, name: str = "matrix"):
        if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"expected a square matrix, got shape {tuple(matrix.shape)}")
        super().__init__(matrix.shape[0], matrix.dtype, matrix.device)
        self.matrix = matrix
        self.name = name

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        return self.matrix @ V


def _term_name(c: float, op: CurvatureOperator, first: bool) -> str:
    sign = "-" if c < 0 else "+"
    scale = "" if abs(c) == 1.0 else f"{abs(c):g} "
    if first:
        return f"{'-' if c < 0 else ''}{scale}{op.name}"
    return f"{sign} {scale}{op.name}"


class LinearCombination(CurvatureOperator):
    """A weighted sum of operators of one size: :math:`A = \\sum_j c_j A_j`.

    Made by the algebra of :class:`CurvatureOperator` (``H - G``, ``2 * H``, ...). Terms on
    one engine are multiplied together in one pass over the data, as ``a H + b G`` of that
    engine (``H`` alone, ``G`` alone, the NME's product for ``a (H - G)``, else the joint
    H and G pass); other terms by their own products.

    Args:
        terms: ``(coefficient, operator)`` pairs; nested combinations are flattened and
            repeated operators merged.
    """

    def __init__(self, terms: Sequence[tuple[float, CurvatureOperator]]):
        merged: dict[int, list] = {}
        for c, op in terms:
            for c2, op2 in op._terms():
                entry = merged.setdefault(id(op2), [0.0, op2])
                entry[0] += float(c) * c2
        self.terms: list[tuple[float, CurvatureOperator]] = [(c, op) for c, op in merged.values()]
        if not self.terms:
            raise ValueError("a linear combination needs at least one operator")
        first = self.terms[0][1]
        for _, op in self.terms:
            if op.shape != first.shape:
                raise ValueError(f"cannot combine operators of shapes {first.shape} and {op.shape}")
        super().__init__(first.shape[0], first.dtype, first.device)
        self.name = " ".join(_term_name(c, op, i == 0) for i, (c, op) in enumerate(self.terms))
        engines = {id(op.engine): op.engine for _, op in self.terms}
        self.engine = next(iter(engines.values())) if len(engines) == 1 else None

    def _terms(self) -> list[tuple[float, CurvatureOperator]]:
        return list(self.terms)

    def _coordinates(self) -> _Coordinates | None:
        engine, a, b = None, 0.0, 0.0
        for c, op in self.terms:
            coords = op._coordinates()
            if coords is None or (engine is not None and coords[0] is not engine):
                return None
            engine, a, b = coords[0], a + c * coords[1], b + c * coords[2]
        return None if engine is None else (engine, a, b)

    def blocks(self) -> dict[str, slice]:
        """The per-layer blocks of the first term that has any (see :meth:`CurvatureOperator.blocks`).

        Returns:
            ``{module name: slice}``; empty when no term has blocks.
        """
        for _, op in self.terms:
            blocks = op.blocks()
            if blocks:
                return blocks
        return {}

    def _rebuild(self, engine: CurvatureEngine) -> CurvatureOperator:
        return LinearCombination([(c, op._rebuild(engine)) for c, op in self.terms])

    def on_subsample(self, fraction: float, seed: int = 0) -> tuple[CurvatureOperator, int, int]:
        """The combination of its terms on a subsample (see :meth:`CurvatureOperator.on_subsample`).

        Terms on one engine share one engine on the subsample; other terms are each
        subsampled with the same ``fraction`` and ``seed``.

        Args:
            fraction: the fraction of samples kept, in (0, 1].
            seed: seeds the choice of samples.

        Returns:
            ``(operator on the subsample, samples kept, samples of the whole set)``.
        """
        if self.engine is not None:
            return super().on_subsample(fraction, seed)
        parts = [op.on_subsample(fraction, seed) for _, op in self.terms]
        combined = LinearCombination([(c, part[0]) for (c, _), part in zip(self.terms, parts)])
        return combined, parts[0][1], parts[0][2]

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        groups: dict[int, list] = {}
        out = torch.zeros_like(V)
        for c, op in self.terms:
            coords = op._coordinates()
            if coords is None:
                out += c * op.matmat(V)
                continue
            entry = groups.setdefault(id(coords[0]), [coords[0], 0.0, 0.0])
            entry[1] += c * coords[1]
            entry[2] += c * coords[2]
        for engine, a, b in groups.values():
            out += _engine_product(engine, a, b, V, self.name)
        return out


def _engine_product(
    engine: CurvatureEngine, a: float, b: float, V: torch.Tensor, name: str
) -> torch.Tensor:
    """:math:`(a H + b G) V` of one engine in one pass over the data, the cheapest way.

    A recorder of per-batch forms on the engine (``engine.forms``) gets the same coefficients.
    """
    forms = engine.forms
    coefficients: tuple[float, ...]
    if b == 0.0:
        HV = engine.hessian_matmat(V, operator=name)
        coefficients, out = (a,), (HV if a == 1.0 else a * HV)
    elif a == 0.0:
        GV = engine.ggn_matmat(V, operator=name)
        coefficients, out = (b,), (GV if b == 1.0 else b * GV)
    elif a == -b:
        NV = engine.nme_matmat(V, operator=name)
        coefficients, out = (a,), (NV if a == 1.0 else a * NV)
    else:
        HV, GV = engine.hessian_and_ggn_matmat(V)
        coefficients, out = (a, b), a * HV + b * GV
    if forms is not None:
        forms.combine(coefficients)
    return out


def joint_matmat(
    operators: Sequence[CurvatureOperator], V: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The products of several operators with one block, sharing passes over the data.

    When every operator is ``a_j H + b_j G`` of one engine and they need both H and G, one
    joint pass gives :math:`H V` and :math:`G V` and each product is
    :math:`a_j H V + b_j G V` (so ``H V = G V + N V`` holds exactly, per column); otherwise
    each operator multiplies on its own.

    Args:
        operators: the operators, all of one size.
        V: a ``(P, k)`` block.

    Returns:
        :math:`A_j V` for each operator, in order.

    Example:
        >>> import torch
        >>> A = MatrixOperator(torch.eye(2))
        >>> [p.tolist() for p in joint_matmat([A, 3 * A], torch.ones(2, 1))]
        [[[1.0], [1.0]], [[3.0], [3.0]]]
    """
    coords = [op._coordinates() for op in operators]
    known = [c for c in coords if c is not None]
    one_engine = len(known) == len(coords) > 0 and len({id(c[0]) for c in known}) == 1
    if not (one_engine and any(c[1] for c in known) and any(c[2] for c in known)):
        return tuple(op @ V for op in operators)
    HV, GV = known[0][0].hessian_and_ggn_matmat(V)
    for op in operators:
        op.matvecs += 1 if V.dim() == 1 else V.shape[1]
    return tuple(a * HV + b * GV for _, a, b in known)
