"""Parameter scopes: which parameters the curvature is taken with respect to (``--params``).

A scope selects trainable parameters ``theta_S``; curvature w.r.t. a subset is
the principal sub-block ``H_SS`` of the full Hessian. Vectors in scope are flat
(length ``numel``), laid out parameter by parameter in ``named_parameters``
order; ``blocks()`` gives the per-layer diagonal blocks (a layer = the module
that owns the parameters) used for per-layer traces.
"""

from __future__ import annotations

import fnmatch
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from sharpcli.errors import UsageError
from sharpcli.models.zoo import final_linear

__all__ = ["ParamScope", "is_frozen"]


def is_frozen(p: torch.nn.Parameter) -> bool:
    """Whether the model froze ``p`` (``requires_grad=False``), even if a scope later thawed it.

    Args:
        p: a parameter.

    Returns:
        True when the model had it frozen.
    """
    return bool(getattr(p, "_sharp_frozen", False)) or not p.requires_grad


@dataclass
class ParamScope:
    """An ordered selection of parameters and the flat layout of vectors over them.

    ``frozen`` names the parameters in scope that the model froze (included only because a
    glob named them); ``frozen_excluded`` the frozen parameters left out of the scope.
    """

    names: list[str]
    params: list[torch.nn.Parameter]
    spec: str = "all"
    frozen: list[str] = field(default_factory=list)
    frozen_excluded: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.shapes = [p.shape for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)

    @property
    def numel(self) -> int:
        """Number of scalar parameters P in scope."""
        return self.offsets[-1]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the scope's parameters (those of the first one)."""
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        """The device of the scope's parameters (that of the first one)."""
        return self.params[0].device

    @property
    def notes(self) -> list[str]:
        """What a reader must know about frozen parameters and this scope (empty if none)."""
        out = []
        if self.frozen:
            numel = sum(p.numel() for n, p in zip(self.names, self.params) if n in self.frozen)
            out.append(
                f"the scope includes {len(self.frozen)} frozen parameter tensor(s) ({numel} "
                f"values, requires_grad=False in the model) because --params {self.spec!r} "
                f"names them: {_short_list(self.frozen)}"
            )
        elif self.frozen_excluded:
            out.append(
                f"{len(self.frozen_excluded)} frozen parameter tensor(s) (requires_grad=False) "
                f"are not in the scope: {_short_list(self.frozen_excluded)}; name them with "
                "--params to include them"
            )
        return out

    def info(self) -> dict:
        """The JSON ``results.scope`` record.

        Returns:
            ``spec``, ``parameters``, ``numel``, ``layers`` and the frozen parameters included and
            excluded, with the scope's notes.
        """
        return {
            "spec": self.spec,
            "parameters": list(self.names),
            "numel": int(self.numel),
            "layers": list(self.blocks().keys()),
            "frozen_included": list(self.frozen),
            "frozen_excluded": list(self.frozen_excluded),
            "notes": self.notes,
        }

    @classmethod
    def resolve(cls, model: nn.Module, spec: str | None = None) -> "ParamScope":
        """Build a scope from ``spec``.

        - ``None`` / ``"all"``: every trainable parameter (``requires_grad``); frozen ones,
          as in fine-tuning with a frozen backbone, are left out and listed in
          ``frozen_excluded``;
        - ``"last"``: the trainable weight and bias of the last ``nn.Linear`` in
          ``named_modules()`` order (the classifier head);
        - otherwise comma-separated ``fnmatch`` globs on parameter names (``"0.*,4.weight"``).
          A glob may name frozen parameters: they are included, listed in ``frozen`` (the
          report says so), and their ``requires_grad`` is switched on so that curvature can be
          taken with respect to them.

        Args:
            model: the model.
            spec: None, ``"all"``, ``"last"`` or comma-separated globs.

        Returns:
            The scope.

        Raises:
            UsageError: on ``params`` when nothing matches.
        """
        named = list(model.named_parameters())
        trainable = [(n, p) for n, p in named if not is_frozen(p)]
        frozen_names = [n for n, p in named if is_frozen(p)]
        text = "all" if spec is None else str(spec).strip()
        if text in ("", "all"):
            text = "all"
            chosen = trainable
            if not chosen:
                raise UsageError(
                    f"the model has no trainable parameters (all {len(named)} have "
                    "requires_grad=False); name them with `params=GLOB` to analyse them anyway",
                    source="params",
                )
        elif text == "last":
            chosen = _last_linear(model, trainable)
        else:
            chosen = _matching(text, named)
        frozen = [n for n, p in chosen if is_frozen(p)]
        for _, p in chosen:
            if not p.requires_grad:
                setattr(
                    p, "_sharp_frozen", True
                )  # remembered, so a later default scope still skips it
                p.requires_grad_(True)
        dtypes = {p.dtype for _, p in chosen}
        if len(dtypes) > 1:
            raise UsageError(
                f"parameters in scope mix dtypes {sorted(map(str, dtypes))}; use one `dtype`",
                source="params",
            )
        names = [n for n, _ in chosen]
        return cls(
            names,
            [p for _, p in chosen],
            spec=text,
            frozen=frozen,
            frozen_excluded=[n for n in frozen_names if n not in names],
        )

    def flatten(self, tensors) -> torch.Tensor:
        """Concatenate parameter-shaped tensors (one per parameter in scope) into a flat vector.

        Args:
            tensors: one tensor per parameter in scope, in order.

        Returns:
            The flat ``(numel,)`` vector.
        """
        return torch.cat([t.reshape(-1) for t in tensors])

    def unflatten(self, vec: torch.Tensor) -> list[torch.Tensor]:
        """Split a flat vector of length ``numel`` into parameter-shaped views.

        Args:
            vec: a flat vector of length ``numel``.

        Returns:
            One view per parameter in scope, shaped like it.
        """
        if vec.shape[0] != self.numel:
            raise ValueError(
                f"vector of length {vec.shape[0]} does not match scope size {self.numel}"
            )
        return [
            vec[start:stop].view(shape)
            for start, stop, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes)
        ]

    def module_of(self, name: str) -> str:
        """The owning module of a parameter name (``"features.3.weight" -> "features.3"``).

        Args:
            name: a parameter name.

        Returns:
            The name of the module that owns it (``""`` for the root).
        """
        return name.rsplit(".", 1)[0] if "." in name else ""

    def blocks(self) -> "OrderedDict[str, slice]":
        """Per-layer diagonal blocks ``{module_name: slice}`` in layout order.

        The parameters a module owns directly are contiguous in ``named_parameters`` order,
        so each layer is one slice; the root module's own parameters are called ``"(root)"``.

        Returns:
            ``{module name: slice}`` of the flat parameter vector.
        """
        out: OrderedDict[str, slice] = OrderedDict()
        for name, start, stop in zip(self.names, self.offsets[:-1], self.offsets[1:]):
            layer = self.module_of(name) or "(root)"
            if layer in out:
                previous = out[layer]
                if previous.stop != start:
                    raise ValueError(f"parameters of layer {layer!r} are not contiguous")
                out[layer] = slice(previous.start, stop)
            else:
                out[layer] = slice(start, stop)
        return out

    def rademacher(self, generator: torch.Generator, columns: int | None = None) -> torch.Tensor:
        """Seeded Rademacher probe(s) (+-1 entries), shape ``(numel,)`` or ``(numel, columns)``.

        Drawn on the CPU generator and moved to the scope's device/dtype, so a seed gives
        the same probes on every device.

        Args:
            generator: a seeded CPU generator.
            columns: that many columns, or None for one vector.

        Returns:
            The probe(s) in the scope's dtype and device.
        """
        return rademacher_like(self.numel, generator, self.dtype, self.device, columns)

    def gaussian(self, generator: torch.Generator, columns: int | None = None) -> torch.Tensor:
        """Seeded standard Gaussian probe(s), shape ``(numel,)`` or ``(numel, columns)``.

        Args:
            generator: a seeded CPU generator.
            columns: that many columns, or None for one vector.

        Returns:
            The probe(s) in the scope's dtype and device.
        """
        return gaussian_like(self.numel, generator, self.dtype, self.device, columns)


# Signs per generator draw: one full-range int64 word gives 64 independent fair bits, so a
# probe takes P / 64 draws (0.015 CPU s at 124M entries) where one int8 ``randint`` per entry
# took 0.55 s.
SIGNS_PER_WORD = 64
# Bytes of bits expanded into signs at a time: a small index buffer that stays in cache.
_EXPAND_BYTES = 1 << 16


def rademacher_bits(dim: int, generator: torch.Generator, columns: int = 1) -> torch.Tensor:
    """The random bits of ``columns`` Rademacher vectors of length ``dim``, packed 8 to a byte.

    Column ``j`` takes the next ``ceil(dim / 64)`` full-range int64 words of ``generator``
    after column ``j - 1``'s, so the ``m``-th vector drawn from a seed is the same whether the
    vectors are drawn one at a time or in blocks of any size. Every bit is an independent fair
    coin (the generator's 64-bit outputs, uniform over all words).

    Args:
        dim: the vectors' length.
        generator: a seeded CPU generator.
        columns: the vectors.

    Returns:
        ``(columns, 8 * ceil(dim / 64))`` uint8: the words' bytes, little-endian.
    """
    drawn = torch.empty(int(columns), rademacher_bits_bytes(dim) // 8, dtype=torch.int64)
    drawn.random_(-(1 << 63), None, generator=generator)  # the full 64-bit range
    return drawn.view(torch.uint8)


def rademacher_bits_bytes(dim: int, columns: int = 1) -> int:
    """The bytes :func:`rademacher_bits` holds for ``columns`` vectors of length ``dim``.

    Args:
        dim: the vectors' length.
        columns: the vectors.

    Returns:
        ``8 * ceil(dim / 64) * columns``.
    """
    return 8 * (-(-int(dim) // SIGNS_PER_WORD)) * int(columns)


_SIGN_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _sign_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(256, 8)``: row ``b`` holds ``1 - 2 bit_i(b)`` for ``i = 0..7``, in ``dtype``."""
    key = (dtype, device)
    table = _SIGN_TABLES.get(key)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _SIGN_TABLES[key] = (1 - 2 * bits).to(dtype=dtype, device=device).contiguous()
    return table


def rademacher_signs(bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Expand one vector's packed bits into its signs: ``out_i = 1 - 2 bit_i``, in ``out``.

    Bit ``i`` is bit ``i mod 8`` of byte ``i // 8`` of ``bits`` (a row of
    :func:`rademacher_bits`). Each byte selects a row of 8 signs from a 256-row table: one
    write of ``out`` (0.08 CPU s at 124M float32 entries), no int8 copy and no conversion.

    Args:
        bits: ``(bytes,)`` uint8 with ``8 * bytes >= len(out)``, on ``out``'s device.
        out: a contiguous vector of any real dtype, written whole.

    Returns:
        ``out``.
    """
    dim = out.shape[0]
    table = _sign_table(out.dtype, out.device)
    whole = dim // 8
    grouped = out[: whole * 8].view(whole, 8)
    for start in range(0, whole, _EXPAND_BYTES):
        stop = min(start + _EXPAND_BYTES, whole)
        index = bits[start:stop].to(torch.int32)
        torch.index_select(table, 0, index, out=grouped[start:stop])
    if dim > whole * 8:
        out[whole * 8 :] = table[bits[whole].long()][: dim - whole * 8]
    return out


def rademacher_like(
    dim: int, generator: torch.Generator, dtype, device, columns: int | None = None
):
    """Rademacher vector(s) of length ``dim`` drawn from a CPU ``generator`` (the one probe helper).

    Each vector is expanded from :func:`rademacher_bits` (:func:`rademacher_signs`) on
    ``device``, so a seed gives the same ``m``-th vector whatever the number of columns drawn
    together, on every device.

    Args:
        dim: the length.
        generator: a seeded CPU generator.
        dtype: the dtype of the result.
        device: the device of the result.
        columns: that many columns, or None for one vector.

    Returns:
        ``(dim,)`` or ``(dim, columns)`` entries of +-1; the columns are contiguous (the block
        is column-major), as a product reads them.
    """
    count = 1 if columns is None else int(columns)
    bits = rademacher_bits(dim, generator, count).to(device)
    signs = torch.empty(count, int(dim), dtype=dtype, device=device)
    for j in range(count):
        rademacher_signs(bits[j], signs[j])
    return signs[0] if columns is None else signs.T


class RademacherColumns:
    """Seeded Rademacher probes handed out a block of ``columns`` at a time, each probe
    expanded straight into its contiguous column of one reused column-major buffer.

    A block of ``k`` probes is drawn as bits (:func:`rademacher_bits`, ``k P / 8`` bytes) and
    expanded ``columns`` at a time: no int8 block, no conversion, no strided gather, and the
    buffer is not mapped afresh for every product (0.2 CPU s a probe at 124M parameters).
    The m-th probe is the seed's whatever ``k`` and ``columns``.

    Args:
        dim: the probes' length.
        generator: a seeded CPU generator.
        dtype: the probes' dtype.
        device: the probes' device.
        columns: the most probes a product takes.
    """

    def __init__(self, dim: int, generator: torch.Generator, dtype, device, columns: int):
        self.dim, self.generator, self.columns = int(dim), generator, int(columns)
        self.dtype, self.device = dtype, torch.device(device)
        self.buffer: torch.Tensor | None = None

    def blocks(self, k: int):
        """The next ``k`` probes, as ``(P, width)`` column-major views of the buffer.

        Each view is overwritten by the next one: use it (the product and its sums) first.

        Args:
            k: the probes.

        Yields:
            ``(P, width)`` blocks, ``width <= columns``, ``k`` columns in all.
        """
        if self.buffer is None or self.buffer.shape[0] < min(self.columns, k):
            self.buffer = None  # released before its successor is allocated
            width = min(self.columns, k)
            self.buffer = torch.empty(width, self.dim, dtype=self.dtype, device=self.device)
        bits = rademacher_bits(self.dim, self.generator, k).to(self.device)
        for first in range(0, k, self.columns):
            width = min(self.columns, k - first)
            for j in range(width):
                rademacher_signs(bits[first + j], self.buffer[j])
            yield self.buffer[:width].T


def gaussian_like(dim: int, generator: torch.Generator, dtype, device, columns: int | None = None):
    """Standard Gaussian vector(s) of length ``dim`` from a CPU ``generator`` (float64 draw, then cast).

    Args:
        dim: the length.
        generator: a seeded CPU generator.
        dtype: the dtype of the result.
        device: the device of the result.
        columns: that many columns, or None for one vector.

    Returns:
        ``(dim,)`` or ``(dim, columns)`` standard Gaussian entries.
    """
    shape = (dim,) if columns is None else (dim, columns)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(
        dtype=dtype, device=device
    )


def _short_list(names: list[str], most: int = 4) -> str:
    """The first ``most`` names, and how many there are in all, for a message."""
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def _last_linear(model: nn.Module, trainable: list) -> list:
    """The trainable ``(name, parameter)`` pairs of the classifier head (``params="last"``).

    Raises:
        UsageError: the model has no ``nn.Linear``, or its head has no trainable parameter.
    """

    last_name, _ = final_linear(
        model, missing="'last' needs an nn.Linear layer, the model has none"
    )
    prefix = f"{last_name}." if last_name else ""
    chosen = [(n, p) for n, p in trainable if n.startswith(prefix) and "." not in n[len(prefix) :]]
    if not chosen:
        raise UsageError(
            f"the last linear layer {last_name!r} has no trainable parameters; name them with "
            "`params=GLOB` to include frozen ones",
            source="params",
        )
    return chosen


def _matching(text: str, named: list) -> list:
    """The ``(name, parameter)`` pairs matching any of the comma-separated globs in ``text``.

    Raises:
        UsageError: no parameter matches.
    """
    patterns = [pat.strip() for pat in text.split(",") if pat.strip()]
    chosen = [(n, p) for n, p in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
    if not chosen:
        available = ", ".join(n for n, _ in named[:8])
        raise UsageError(
            f"{text!r} matches no parameter (names: {available}{', ...' if len(named) > 8 else ''})",
            source="params",
        )
    return chosen
