"""Built-in synthetic datasets: need no download, deterministic for a seed (docs/index.md).

- ``blobs``: a Gaussian mixture in ``R^dim`` with ``classes`` balanced classes.
  Class means ``mu_c ~ N(0, (separation^2 / dim) I)`` (so ``||mu_c|| ~= separation``),
  samples ``x = mu_{y} + eps``, ``eps ~ N(0, I)``. At the defaults (dim 16, 4 classes,
  separation 3) the nearest-mean rule is right about 95% of the time: learnable, not
  trivially separable, so curvature is not zero at a minimum.
- ``images``: ``channels x size x size`` images, one smooth template per class
  (a ``N(0, 1)`` pattern on a coarse ``size/4`` grid, bilinearly upsampled), shown as
  ``x = 0.5 + contrast * T_y + noise * eps`` with ``eps ~ N(0, I)``. Class evidence is
  spatially structured, so a small CNN learns it in a few epochs.

Draw order (all from one ``torch.Generator`` seeded with ``seed``, on the CPU, so the
same arguments give the same tensors on every run): class parameters first (so they do
not depend on ``n``), then a random permutation of the balanced labels
``arange(n) % classes``, then the noise. The first ``n - round(n * test_fraction)``
samples are the train split, the rest the test split.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.io.data.dataset import Dataset, finalize_dataset
from sharpcli.registry import Entry, declaration, declare
from sharpcli.specs import Param

MAX_ELEMENTS = 200_000_000  # 800 MB of float32: beyond this a built-in set is a typo

# the built-in datasets' names, each declared on its generator below; blobs is the default
# of ``--data`` (sharpcli.io.data.loading.DEFAULT_DATA, catalogue.DEFAULT_DATASET)
BLOBS, IMAGES = "blobs", "images"

# the arguments every built-in dataset takes, in the order messages list them
_N, _CLASSES = (
    Param("n", "int", 2000, "samples, both splits"),
    Param("classes", "int", 4, "classes"),
)
_SEED = Param("seed", "int", 0, "seed of the generator")
_TEST_FRACTION = Param("test_fraction", "float", 0.25, "share of the samples in the test split")


def _convert(name: str, key: str, value, kind: type):
    """Convert one argument (from a data spec string or a JSON value) to ``kind``."""
    if kind is int:
        if isinstance(value, bool):
            raise UsageError(f"{name}: {key} must be an integer, got {value!r}", source="data")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip())
        except ValueError:
            raise UsageError(
                f"{name}: {key} must be an integer, got {value!r}", source="data"
            ) from None
    if isinstance(value, bool):
        raise UsageError(f"{name}: {key} must be a number, got {value!r}", source="data")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float range
        raise UsageError(f"{name}: {key} must be a number, got {value!r}", source="data") from None
    if not math.isfinite(out):
        raise UsageError(f"{name}: {key} must be finite, got {value!r}", source="data")
    return out


def resolve_builtin_args(name: object, args: dict) -> dict:
    """Complete and check the arguments of built-in ``name``; returns all of them, typed.

    Unknown names or keys and out-of-range values raise ``UsageError(source="data")``.
    """
    if not isinstance(name, str) or name not in BUILTIN_ARGS:  # a spec's name may be any JSON
        raise UsageError(
            f"unknown built-in dataset {name!r}; accepted: {', '.join(BUILTIN_NAMES)}",
            source="data",
        )
    table = BUILTIN_ARGS[name]
    unknown = sorted(set(args) - set(table))
    if unknown:
        raise UsageError(
            f"{name}: unknown argument(s) {', '.join(unknown)}; accepted: {', '.join(table)}",
            source="data",
        )
    out = {
        key: _convert(name, key, args.get(key, default), kind)
        for key, (kind, default) in table.items()
    }

    def need(condition: bool, text: str):
        if not condition:
            raise UsageError(f"{name}: {text}", source="data")

    need(out["n"] >= 2, f"n must be at least 2, got {out['n']}")
    need(out["classes"] >= 2, f"classes must be at least 2, got {out['classes']}")
    need(
        0.0 <= out["test_fraction"] < 1.0,
        f"test_fraction must be in [0, 1), got {out['test_fraction']}",
    )
    need(0 <= out["seed"] < 2**63, f"seed must be in [0, 2^63), got {out['seed']}")
    n_test = round(out["n"] * out["test_fraction"])
    need(
        out["test_fraction"] == 0.0 or 1 <= n_test < out["n"],
        f"n={out['n']} with test_fraction={out['test_fraction']} leaves an empty split",
    )
    if name == BLOBS:
        need(out["dim"] >= 1, f"dim must be at least 1, got {out['dim']}")
        need(out["separation"] >= 0.0, f"separation must be >= 0, got {out['separation']}")
        elements = out["n"] * out["dim"]
    else:
        need(out["size"] >= 1, f"size must be at least 1, got {out['size']}")
        need(out["channels"] >= 1, f"channels must be at least 1, got {out['channels']}")
        need(out["noise"] >= 0.0, f"noise must be >= 0, got {out['noise']}")
        elements = out["n"] * out["channels"] * out["size"] ** 2
    need(
        elements <= MAX_ELEMENTS,
        f"{elements} feature values requested; the limit is {MAX_ELEMENTS}",
    )
    return out


def _balanced_labels(n: int, classes: int, generator: torch.Generator) -> torch.Tensor:
    """``arange(n) % classes`` in a seeded random order (class counts differ by at most one)."""
    return (torch.arange(n, dtype=torch.int64) % classes)[torch.randperm(n, generator=generator)]


@declare(
    "built-in dataset",
    BLOBS,
    "a Gaussian mixture in R^dim",
    params=(
        _N,
        Param("dim", "int", 16, "features"),
        _CLASSES,
        _SEED,
        _TEST_FRACTION,
        Param("separation", "float", 3.0, "norm of the class means"),
    ),
    info={"default": True},
)
def make_blobs(
    n: int, dim: int, classes: int, seed: int, separation: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of the Gaussian mixture described in the module docstring.

    ``mu_c = separation / sqrt(dim) * g_c`` with ``g_c ~ N(0, I_dim)``; ``x_i = mu_{y_i} + eps_i``.
    """
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=generator) * (separation / math.sqrt(dim))
    y = _balanced_labels(n, classes, generator)
    x = means[y] + torch.randn(n, dim, generator=generator)
    return x, y


def class_templates_images(
    size: int, channels: int, classes: int, generator: torch.Generator
) -> torch.Tensor:
    """Per-class templates ``T_c`` (classes, channels, size, size): coarse N(0,1) patterns upsampled bilinearly."""
    coarse = max(2, size // 4)
    patterns = torch.randn(classes, channels, coarse, coarse, generator=generator)
    return F.interpolate(patterns, size=(size, size), mode="bilinear", align_corners=False)


@declare(
    "built-in dataset",
    IMAGES,
    "channels x size x size images, one smooth template per class",
    params=(
        replace(_N, default=1000),
        Param("size", "int", 8, "image side"),
        Param("channels", "int", 3, "image channels"),
        replace(_CLASSES, default=10),
        _SEED,
        _TEST_FRACTION,
        Param("contrast", "float", 0.25, "scale of the class templates"),
        Param("noise", "float", 0.5, "standard deviation of the pixel noise"),
    ),
)
def make_images(
    n: int, size: int, channels: int, classes: int, seed: int, contrast: float, noise: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` with ``x = 0.5 + contrast * T_y + noise * eps`` (module docstring), x of shape (n, C, H, W)."""
    generator = torch.Generator().manual_seed(seed)
    templates = class_templates_images(size, channels, classes, generator)
    y = _balanced_labels(n, classes, generator)
    x = (
        0.5
        + contrast * templates[y]
        + noise * torch.randn(n, channels, size, size, generator=generator)
    )
    return x, y


def _arguments(generator: Callable[..., Any]) -> dict[str, tuple[type, object]]:
    """``{arg: (type, default)}`` of a generator's declared parameters, in their order."""
    entry = cast("tuple[str, Entry]", declaration(generator))[1]
    return {p.name: (int if p.kind == "int" else float, p.default) for p in entry.params}


# name -> {arg: (type, default)}, from the declarations
BUILTIN_ARGS: dict[str, dict[str, tuple[type, object]]] = {
    BLOBS: _arguments(make_blobs),
    IMAGES: _arguments(make_images),
}
BUILTIN_NAMES = tuple(BUILTIN_ARGS)


def load_builtin(name: str, args: dict) -> Dataset:
    """Generate built-in dataset ``name`` with ``args`` (completed by ``resolve_builtin_args``)."""
    full = resolve_builtin_args(name, args)
    generate = catalogue.DATASETS.get(name)
    taken = inspect.signature(generate).parameters  # test_fraction splits what it makes
    x, y = generate(**{key: value for key, value in full.items() if key in taken})
    n_test = round(full["n"] * full["test_fraction"])
    n_train = full["n"] - n_test
    x_test, y_test = (x[n_train:], y[n_train:]) if n_test else (None, None)
    return finalize_dataset(
        x[:n_train],
        y[:n_train],
        x_test,
        y_test,
        source=f"builtin:{name}",
        spec={"kind": "builtin", "name": name, "args": full},
        task="classification",
        num_classes=full["classes"],
    )
