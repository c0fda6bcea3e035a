"""Curvature per parameter block in one run: ``--blocks`` of ``sharp eigen``, ``trace`` and ``density``.

A block is a set of parameters; its curvature is the principal sub-block ``A_bb`` of the
operator (the rows and columns of its parameters), multiplied by a curvature engine whose scope
is the block alone. ``A_bb``'s eigenvalues are those Zhang et al. compare across the blocks of
a transformer ([Zhang2024]: "block heterogeneity"); the block traces of a partition add up to
the full trace. The session (model, data) is loaded once for every block.

Each block's number carries its data error as the whole model's does
(:mod:`sharpcli.curvature.products.batch_forms`): a block's trace by batch means of its
probes' per-batch parts (no extra product), a block's eigenvalues by batch means of their
Rayleigh quotients per batch (one product per eigenvalue,
:mod:`sharpcli.curvature.eigen.data_error`). The blocks see the same batches, so the data
error of the blocks' trace sum is the batch means of the summed per-batch parts
(:func:`~sharpcli.curvature.products.batch_forms.summed_error`), not the blocks' errors in
quadrature.

``blocks`` specs (:func:`block_partition`), within the command's ``params`` scope:

- ``params``: each parameter tensor ([Zhang2024]'s choice);
- ``modules``: the parameters each module owns directly (the per-layer blocks of ``trace``);
- ``layers``: the model's repeated blocks (each child of the ``nn.ModuleList`` or
  ``nn.Sequential`` whose children of one class hold the most parameters: a transformer's
  blocks, ``transformer.h.0``, ...), the other parameters by module;
- ``NAME=GLOB,...`` (or bare globs, named by themselves): the scope's parameters whose names
  match each glob, e.g. ``attn=*.attn.*,mlp=*.mlp.*``; the API also takes them as a mapping
  ``{"attn": "*.attn.*", "mlp": "*.mlp.*"}``.

The figures (:func:`eigen_blocks`, :func:`trace_blocks`, :func:`density_blocks`) are computed
over :func:`block_engines`, one engine per block, whether the command's session
(:func:`session_block_engines`) or ``Curvature``'s in-memory data builds them.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from sharpcli.analyses.spectrum import curvature_engine, eigen_result, operator_of, trace_result
from sharpcli.catalogue.values import DENSITY_KEY
from sharpcli.curvature.density import spectral_density
from sharpcli.curvature.products.batch_forms import summed_error
from sharpcli.errors import UsageError

__all__ = [
    "block_partition",
    "block_engines",
    "density_blocks",
    "eigen_blocks",
    "refuse_overlaps",
    "session_block_engines",
    "trace_blocks",
]

BlockSpec = str | Mapping[str, str]


def _escape(name: str) -> str:
    """``name`` as an fnmatch glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _repeated_children(model) -> list[str]:
    """The names of the repeated blocks: the children of one class of the ``nn.ModuleList``
    or ``nn.Sequential`` in which such children (two or more) hold the most parameters."""
    from torch import nn

    best: tuple[int, list[str]] = (0, [])
    for prefix, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[tuple[str, int]]] = {}
        for child_name, child in module.named_children():
            size = sum(p.numel() for p in child.parameters())
            if size:
                name = f"{prefix}.{child_name}" if prefix else child_name
                by_class.setdefault(type(child), []).append((name, size))
        for children in by_class.values():
            total = sum(size for _, size in children)
            if len(children) >= 2 and total > best[0]:
                best = (total, [name for name, _ in children])
    return best[1]


def _by_module(names: list[str]) -> list[tuple[str, list[str]]]:
    grouped: dict[str, list[str]] = {}
    for n in names:
        grouped.setdefault(n.rsplit(".", 1)[0] if "." in n else "(root)", []).append(n)
    return list(grouped.items())


def _layers(names: list[str], model) -> list[tuple[str, list[str]]]:
    layers = _repeated_children(model) if model is not None else []
    if not layers:
        raise UsageError(
            "found no repeated blocks (a ModuleList or Sequential of two or more modules of "
            "one class); use `blocks=modules` or NAME=GLOB,...",
            source="blocks",
        )
    owned = {layer: [n for n in names if n.startswith(layer + ".")] for layer in layers}
    taken = {n for members in owned.values() for n in members}
    rest = _by_module([n for n in names if n not in taken])
    out = [(layer, members) for layer, members in owned.items() if members]
    # the other parameters by module, each before or after the layers as the model has them
    first = names.index(out[0][1][0]) if out else len(names)
    before = [(b, m) for b, m in rest if names.index(m[0]) < first]
    return before + out + [(b, m) for b, m in rest if names.index(m[0]) >= first]


def _named_globs(spec: BlockSpec) -> list[tuple[str, str]]:
    """``(block name, glob)`` pairs of ``NAME=GLOB,...`` (a bare glob names itself) or a
    mapping."""
    if isinstance(spec, Mapping):
        return [(str(label).strip(), str(glob).strip()) for label, glob in spec.items()]
    pairs = []
    for item in spec.split(","):
        label, _, glob = item.strip().rpartition("=")
        pairs.append(((label.strip() or glob.strip()), glob.strip()))
    return pairs


def block_partition(names: list[str], spec: BlockSpec, model=None) -> list[tuple[str, list[str]]]:
    """The blocks of ``spec`` over the parameter ``names`` of a scope, in order.

    Args:
        names: the scope's parameter names.
        spec: ``params``, ``modules``, ``layers``, ``NAME=GLOB,...`` or a mapping
            ``{NAME: GLOB}`` (module docstring).
        model: the model (``layers`` reads its module tree).

    Returns:
        ``[(block name, [parameter names])]``.

    Raises:
        UsageError: (source ``blocks``) an empty spec, a repeated block name, or a glob that
            matches no parameter in scope.
    """
    text = spec if isinstance(spec, Mapping) else str(spec).strip()
    if not text:
        # the values unquoted: `params` would be read as the parameter (option) of that name
        raise UsageError(
            "is empty: give one of params, modules, layers or NAME=GLOB,...", source="blocks"
        )
    if text == "params":
        return [(n, [n]) for n in names]
    if text == "modules":
        return _by_module(names)
    if text == "layers":
        return _layers(names, model)
    out: list[tuple[str, list[str]]] = []
    for label, glob in _named_globs(text):
        matched = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not glob or not matched:
            raise UsageError(
                f"block {label!r}: {glob!r} matches no parameter in scope "
                f"(e.g. {', '.join(names[:3])})",
                source="blocks",
            )
        if label in (b for b, _ in out):
            raise UsageError(f"block {label!r} is named twice", source="blocks")
        out.append((label, matched))
    return out


def refuse_overlaps(partition: list[tuple[str, list[str]]]) -> None:
    """UsageError (source ``blocks``) when two blocks share a parameter: a sum over the
    blocks (``trace``'s ``blocks_sum``) would count it twice. Overlapping blocks are fine
    where each block stands alone (eigenvalues, densities)."""
    seen: dict[str, str] = {}
    for label, members in partition:
        shared = [n for n in members if n in seen]
        if shared:
            raise UsageError(
                f"blocks {seen[shared[0]]!r} and {label!r} overlap ({', '.join(shared[:3])}"
                f"{', ...' if len(shared) > 3 else ''}): their traces' sum would count them "
                "twice; give blocks that share no parameter",
                source="blocks",
            )
        seen.update((n, label) for n in members)


BlockEngines = Iterable[tuple[str, list[str], Any]]


class _BlockEngines:
    """The blocks' engines, built one at a time as iterated; the partition known up front
    (:func:`trace_blocks` checks it before any block's work)."""

    def __init__(self, partition: list[tuple[str, list[str]]], make_engine: Callable[[str], Any]):
        self.partition = partition
        self._make_engine = make_engine

    def __iter__(self) -> Iterator[tuple[str, list[str], Any]]:
        for label, members in self.partition:
            engine = self._make_engine(",".join(_escape(n) for n in members))
            try:
                yield label, members, engine
            finally:
                engine.clear_cache()


def block_engines(
    names: list[str], spec: BlockSpec, model, make_engine: Callable[[str], Any]
) -> BlockEngines:
    """``(block name, parameter names, curvature engine on the block)``, one at a time.

    The spec is resolved here (its errors before any work); the engines as iterated.

    Each engine's cached graphs are dropped before the next is built, so one block's graphs
    are held at a time.

    Args:
        names: the scope's parameter names (the blocks partition them).
        spec: the blocks' spec (:func:`block_partition`).
        model: the model (``layers`` reads its module tree).
        make_engine: a ``params`` glob -> a curvature engine on those parameters.
    """
    return _BlockEngines(block_partition(names, spec, model), make_engine)


def session_block_engines(session, params: str | None, blocks: BlockSpec) -> BlockEngines:
    """:func:`block_engines` over a command's session: its ``params`` scope, one engine per
    block as the command's own (:func:`~sharpcli.analyses.spectrum.curvature_engine`)."""
    names = session.scope(params).names
    return block_engines(names, blocks, session.model, lambda glob: curvature_engine(session, glob))


def eigen_blocks(
    passes: BlockEngines,
    *,
    operator: str,
    top_k: int,
    which: str,
    method: str,
    tol: float,
    max_matvecs: int | None,
    seed: int,
) -> list[dict]:
    """Each block's extreme eigenvalues, residual-certified as ``sharp eigen``'s.

    Args:
        passes: the blocks and their engines (:func:`block_engines`).
        operator: a registered operator.
        top_k: eigenvalues per end.
        which: ``largest``, ``smallest`` or ``both``.
        method: ``lanczos`` or ``power``.
        tol: the relative residual each Ritz pair must reach.
        max_matvecs: products per block (None: the method's default).
        seed: the start vectors' seed.

    Returns:
        ``[{name, parameters, numel, eigenvalues, residuals, converged, matvecs, data_stderr,
        data_method, data_matvecs}]``; a block smaller than ``top_k`` gives all its
        eigenvalues; ``data_stderr`` (each eigenvalue's data error, first order) costs
        ``data_matvecs`` products, one per eigenvalue, not in ``matvecs``.
    """
    rows = []
    for label, members, engine in passes:
        k = min(int(top_k), engine.scope.numel)
        if which == "both":
            k = max(1, min(k, engine.scope.numel // 2))
        result = eigen_result(
            engine,
            operator,
            top_k=k,
            which=which,
            method=method,
            tol=tol,
            max_matvecs=max_matvecs,
            seed=seed,
        ).to_dict()
        keys = ("eigenvalues", "residuals", "converged", "matvecs")
        rows.append(
            {
                "name": label,
                "parameters": members,
                "numel": engine.scope.numel,
                **{key: result[key] for key in keys},
                "data_stderr": result.get("data_stderr"),
                "data_method": result.get("data_method"),
                "data_matvecs": result.get("data_matvecs") or 0,
            }
        )
    return rows


def trace_blocks(
    passes: BlockEngines,
    *,
    operator: str,
    estimator: str,
    tol: float,
    max_matvecs: int,
    square: bool,
    seed: int,
    summed: bool = True,
) -> tuple[list[dict], dict]:
    """Each block's trace with its standard error, and their sum.

    For a partition of the scope the block traces add up to the full trace (its diagonal is
    theirs); the blocks' estimates are independent, so the sum's standard error is the root
    of the sum of their squares. ``square`` gives each block's ``Tr(A_bb^2)``, whose sum is
    at most ``Tr(A^2)``.

    Args:
        passes: the blocks and their engines (:func:`block_engines`).
        operator: a registered operator.
        estimator: as ``sharp trace``'s.
        tol: the relative standard error to stop at.
        max_matvecs: products per block.
        square: estimate ``Tr(A_bb^2)`` instead.
        seed: the probes' seed.
        summed: the sum is wanted: blocks that share a parameter are refused before any
            block's work (:func:`refuse_overlaps`; a lazy iterable of passes without a
            ``partition`` is checked as it goes).

    Returns:
        ``([{name, parameters, numel, estimate, stderr, data_stderr, data_method,
        data_matvecs, matvecs, converged}], {estimate, stderr, data_stderr, numel})``:
        ``data_stderr`` the data's error by batch means (None with one batch), the sum's from
        the blocks' summed per-batch parts; ``data_matvecs`` its products beyond ``matvecs``
        (``Tr(A^2)``'s one block).
    """
    partition = getattr(passes, "partition", None)
    if summed and partition is not None:
        refuse_overlaps(partition)
    rows: list[dict] = []
    errors = []
    taken: list[tuple[str, list[str]]] = []
    for label, members, engine in passes:
        if summed and partition is None:
            refuse_overlaps([*taken, (label, members)])
            taken.append((label, members))
        result = trace_result(
            engine,
            operator,
            estimator=estimator,
            square=square,
            tol=tol,
            max_matvecs=max_matvecs,
            seed=seed,
        )
        errors.append(result.data)
        rows.append(
            {
                "name": label,
                "parameters": members,
                "numel": engine.scope.numel,
                "estimate": result.estimate,
                "stderr": result.stderr,
                "data_stderr": None if result.data is None else result.data.stderr,
                "data_method": None if result.data is None else result.data.method,
                "data_matvecs": result.data_matvecs,
                "matvecs": result.matvecs,
                "converged": result.converged,
            }
        )
    sum_error = summed_error(errors)
    total = {
        "estimate": sum(r["estimate"] for r in rows),
        "stderr": math.sqrt(sum((r["stderr"] or 0.0) ** 2 for r in rows)),
        "data_stderr": None if sum_error is None else sum_error.stderr,
        "numel": sum(r["numel"] for r in rows),
    }
    return rows, total


def density_blocks(
    passes: BlockEngines,
    *,
    operator: str,
    probes: int,
    steps: int,
    grid_points: int,
    broadening: float | None,
    seed: int,
) -> list[dict]:
    """Each block's spectral density by stochastic Lanczos quadrature ([Ubaru2017]), as
    ``sharp density`` computes the full one ([Zhang2024] compares these across blocks).

    Args:
        passes: the blocks and their engines (:func:`block_engines`).
        operator: a registered operator.
        probes: SLQ probes per block.
        steps: Lanczos steps per probe (at most the block's size).
        grid_points: points of each block's grid.
        broadening: the Gaussian width (None: from each block's spectrum).
        seed: the probes' seed.

    Returns:
        ``[{name, parameters, numel, grid, density, nodes, weights, sigma, lambda_min,
        lambda_max, trace_estimate, trace_stderr, trace_data_stderr, matvecs}]``.
    """

    rows = []
    for label, members, engine in passes:
        result = spectral_density(
            operator_of(engine, operator),
            probes=probes,
            steps=min(int(steps), engine.scope.numel),
            grid_points=grid_points,
            broadening=broadening,
            seed=seed,
        ).to_dict()
        nodes = [t for probe in result["nodes"] for t in probe]
        keep = ("grid", DENSITY_KEY, "nodes", "weights", "sigma", "trace_estimate")
        rows.append(
            {
                "name": label,
                "parameters": members,
                "numel": engine.scope.numel,
                **{key: result[key] for key in keep},
                "trace_stderr": result["trace_stderr"],
                "trace_data_stderr": result["trace_data_stderr"],
                "lambda_min": min(nodes),
                "lambda_max": max(nodes),
                "matvecs": result["matvecs"],
            }
        )
    return rows
