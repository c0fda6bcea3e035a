"""Datasets for analysis and training: ``load_dataset``, ``subset``, ``validate_for_model``.

docs/index.md (``--data``) and docs/architecture.md ("datasets"). A data spec is
either a string (what ``--data`` takes) or a dict (what a checkpoint stores):

- built-ins, no download, the default: ``blobs[:k=v,...]`` (Gaussian mixture; args
  n, dim, classes, seed, test_fraction, separation) and ``images[:k=v,...]`` (small
  class-template images; args n, size, channels, classes, seed, test_fraction,
  contrast, noise); see ``builtin``. As a dict:
  ``{"kind": "builtin", "name": "blobs", "args": {...}}``.
- a path: ``.safetensors``/``.pt``/``.pth``/``.npz`` tensor files and ``.csv``/``.parquet``
  tables (``tensor_files``, ``tables``), or a directory holding a CIFAR-10/100 (python or
  binary) or MNIST idx layout (``vision``). As a dict:
  ``{"kind": "file", "path": "<absolute path>", "format": "<format>", "label_column": ...}``
  with the format a name in the registry ``sharpcli.io.data.formats.FORMATS``, which routes a
  path to its format and holds each format's reader (plus the optional spec keys the
  format reads). Any file spec may hold ``x_shape`` (``--x-shape``): every sample's input
  reshaped to it, e.g. ``[1, 28, 28]`` for ``(N, 28, 28)`` arrays fed to a Conv2d; without
  it the inputs reach the model in the shape the file stores (:func:`apply_x_shape`).

A built-in name wins over a file of the same name in the working directory (write
``./blobs`` for the file). ``Dataset.spec`` is always the complete dict form, so
``load_dataset(ds.spec)`` rebuilds the same tensors. Bad files raise
``InputError(source=<path>)`` and bad spec arguments ``UsageError(source="data")``,
each with a one-line message; no library exception escapes.
"""

from __future__ import annotations

import math
import os

import torch

from sharpcli import ledger
from sharpcli.bounded import check_data_path
from sharpcli.catalogue import DATASETS
from sharpcli.catalogue.values import TEST, TRAIN
from sharpcli.errors import InputError, UsageError
from sharpcli.io.data.builtin import (
    BLOBS,
    BUILTIN_ARGS,
    BUILTIN_NAMES,
    load_builtin,
    resolve_builtin_args,
)
from sharpcli.io.data.dataset import Dataset
from sharpcli.io.data.formats import FORMATS, DataFormat, data_format, optional_spec_keys, route
from sharpcli.io.torch_losses.causal_lm import (
    input_ids_of,
    labels_shifted_by_hand,
    shift_token_labels,
)
from sharpcli.losses import IGNORE_INDEX
from sharpcli.specs import parse_spec

__all__ = [
    "BUILTIN_ARGS",
    "BUILTIN_NAMES",
    "DEFAULT_DATA",
    "Dataset",
    "apply_x_shape",
    "FORMATS",
    "format_data_spec",
    "load_dataset",
    "parse_data_spec",
    "subset",
    "validate_for_model",
]

DEFAULT_DATA = BLOBS


def _parse_builtin_args(name: str, text: str) -> dict:
    """``"n=100,seed=3"`` -> ``{"n": "100", "seed": "3"}`` (typed later by ``resolve_builtin_args``).

    The grammar is :func:`sharpcli.specs.parse_spec`, every item ``key=value``.

    Args:
        name: the built-in dataset.
        text: what follows ``name:``.

    Returns:
        The values given, by key.

    Raises:
        RegistryError: (a UsageError, source ``spec``) an item without ``=``, an unknown key
            (listing the accepted) or a key given twice.
    """
    _, args = parse_spec(
        f"{name}:{text}",
        lambda n: tuple(BUILTIN_ARGS[n]) if n in BUILTIN_ARGS else None,
        positional=False,
        source="data",
        unknown=DATASETS.unknown,
    )
    return args


def parse_data_spec(
    data: str | dict,
    *,
    label_column: str | None = None,
    x_key: str | None = None,
    y_key: str | None = None,
    shift_labels: bool | None = None,
    x_shape: str | list | tuple | None = None,
) -> dict:
    """Turn a ``--data`` string or a spec dict into the complete dict form (without loading data).

    Built-in arguments are completed with their defaults and type-checked; a path is
    made absolute and its format detected (by extension, or by probing a directory
    for CIFAR/MNIST layouts). ``label_column`` fills the dict's ``label_column`` when
    that is unset; a conflicting value raises ``UsageError(source="label_column")``. ``x_key``,
    ``y_key`` (the arrays of a tensor file or the columns of an Arrow table that are the
    inputs and the labels, :mod:`sharpcli.io.data.keyed`) and ``shift_labels`` (the
    causal-LM label convention, :func:`apply_label_convention`) and ``x_shape`` (one sample's
    input shape, ``"1,28,28"`` or a list, :func:`apply_x_shape`) fill the spec the same way.
    """
    given = {
        "x_key": x_key,
        "y_key": y_key,
        "shift_labels": shift_labels,
        "x_shape": None if x_shape is None else parse_x_shape(x_shape, "x_shape"),
    }
    if isinstance(data, dict):
        return _normalise_dict(data, label_column, given)
    if not isinstance(data, str):
        raise UsageError(
            f"a data spec is a string or a dict, got {type(data).__name__}", source="data"
        )
    text = data.strip()
    if not text:
        raise UsageError("empty data spec", source="data")
    name, sep, rest = text.partition(":")
    if name in BUILTIN_NAMES:
        if label_column is not None:
            raise UsageError(f"built-in {name!r} has no label column", source="label_column")
        _no_file_options(name, given)
        args = _parse_builtin_args(name, rest) if sep else {}
        return {"kind": "builtin", "name": name, "args": resolve_builtin_args(name, args)}
    return _normalise_dict({"kind": "file", "path": text}, label_column, given)


def parse_x_shape(value, source: str) -> list[int]:
    """One sample's input shape from ``"1,28,28"`` (``--x-shape``) or a list of sizes (a
    spec's ``x_shape``): positive integers, at least one; else a UsageError on ``source``."""
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        sizes: list = []
        for part in parts:
            if not part.isdigit():
                sizes = []
                break
            sizes.append(int(part))
    elif isinstance(value, (list, tuple)):
        sizes = list(value)
    else:
        sizes = []
    if not sizes or not all(
        isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in sizes
    ):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UsageError(
            f"must be one sample's input shape, positive sizes separated by commas (e.g. "
            f"1,28,28), got {shown}",
            source=source,
        )
    return [int(size) for size in sizes]


def apply_x_shape(dataset: Dataset, shape) -> Dataset:
    """``dataset`` with every sample's input reshaped to ``shape`` (the spec's ``x_shape``),
    both splits: ``x.reshape(N, *shape)``, the values in their stored (row-major) order.

    This is the one place an axis is added to a data file's inputs: ``(N, 28, 28)`` with
    ``[1, 28, 28]`` gives single-channel images; nothing is reshaped without it (a 3-D array
    is a Conv1d's ``(N, C, L)`` as much as images). A shape holding another number of values
    than a sample is an InputError naming the file; several keyword inputs (travelling
    stacked) are a UsageError: reshape them in the file.
    """
    if shape is None:
        return dataset
    shape = parse_x_shape(shape, "x_shape")
    if dataset.input_keys is not None and len(dataset.input_keys) > 1:
        raise UsageError(
            f"reshapes one input, but {dataset.source} gives the model "
            f"{len(dataset.input_keys)} ({', '.join(dataset.input_keys)}); store them in the "
            "shapes the model takes",
            source="x_shape",
        )
    wanted = math.prod(shape)
    for name in ("x_train", "x_test"):
        x = getattr(dataset, name)
        if x is None:
            continue
        per_sample = int(x[0].numel())
        if per_sample != wanted:
            shown = ",".join(str(size) for size in shape)
            raise InputError(
                f"samples of shape {tuple(x.shape[1:])} hold {per_sample} values but `x_shape` "
                f"{shown} holds {wanted}",
                source=dataset.source,
            )
        setattr(dataset, name, x.reshape(x.shape[0], *shape).contiguous())
    return dataset


def _no_file_options(name, given: dict) -> None:
    """UsageError for a file option (``x_key``, ``y_key``, ``shift_labels``, ``x_shape``) given
    with a built-in."""
    for key, value in given.items():
        if value is not None:
            raise UsageError(f"applies to data files, not to built-in {name!r}", source=key)


def _merge_given(spec: dict, given: dict) -> dict:
    """``spec`` with the file options of the command line filled in (each must agree with the
    spec's own value, as a checkpoint's stored spec may hold one)."""
    merged = dict(spec)
    for key, value in given.items():
        if value is None:
            continue
        if merged.get(key) is not None and merged[key] != value:
            raise UsageError(f"{value!r} contradicts the data spec's {merged[key]!r}", source=key)
        merged[key] = value
    for key in ("x_key", "y_key"):
        if merged.get(key) is not None and (
            not isinstance(merged[key], str) or not merged[key].strip()
        ):
            raise UsageError(f"must be a non-empty key name, got {merged[key]!r}", source=key)
    if merged.get("x_shape") is not None:
        merged["x_shape"] = parse_x_shape(merged["x_shape"], "x_shape")
    shift = merged.get("shift_labels")
    if shift is not None and not isinstance(shift, bool):
        raise UsageError(f"spec 'shift_labels' must be true or false, got {shift!r}", source="data")
    return merged


def _normalise_dict(spec: dict, label_column: str | None, given: dict | None = None) -> dict:
    """Check a dict spec and complete it (absolute path, detected format, full built-in args)."""
    kind = spec.get("kind")
    given = given or {}
    if kind == "builtin":
        _no_file_options(spec.get("name"), given)
        return _normalise_builtin(spec, label_column)
    if kind == "file":
        return _normalise_file(_merge_given(spec, given), label_column)
    raise UsageError(f"data spec 'kind' must be 'builtin' or 'file', got {kind!r}", source="data")


def _normalise_builtin(spec: dict, label_column: str | None) -> dict:
    """The complete form of ``{"kind": "builtin", "name", "args"}`` (arguments typed, defaults in)."""
    unknown = sorted(set(spec) - {"kind", "name", "args"})
    if unknown:
        raise UsageError(
            f"builtin data spec has unknown key(s) {', '.join(unknown)}", source="data"
        )
    name, args = spec.get("name"), spec.get("args") or {}
    if not isinstance(args, dict):
        raise UsageError(
            f"builtin data spec 'args' must be a dict, got {type(args).__name__}",
            source="data",
        )
    if label_column is not None:
        raise UsageError(f"built-in {name!r} has no label column", source="label_column")
    return {"kind": "builtin", "name": name, "args": resolve_builtin_args(name, args)}


def _normalise_file(spec: dict, label_column: str | None) -> dict:
    """The complete form of a file spec: absolute path, its format, the format's spec keys."""
    unknown = sorted(
        set(spec) - {"kind", "path", "format", "shift_labels", "x_shape", *optional_spec_keys()}
    )
    if unknown:
        raise UsageError(f"file data spec has unknown key(s) {', '.join(unknown)}", source="data")
    given_path = spec.get("path")
    if not isinstance(given_path, str) or not given_path:
        raise UsageError("file data spec needs a 'path' string", source="data")
    column = _label_column(spec.get("label_column"), label_column)
    named = None if spec.get("format") is None else data_format(spec["format"])
    path, fmt = route(_existing_path(given_path), named)
    options = _format_options(fmt, spec, column)
    if spec.get("shift_labels") is not None:
        options["shift_labels"] = spec["shift_labels"]
    if spec.get("x_shape") is not None:
        options["x_shape"] = spec["x_shape"]
    return {"kind": "file", "path": path, "format": fmt.name, "label_column": column, **options}


def _label_column(in_spec, from_option: str | None) -> str | None:
    """The label column of the spec or of the ``label_column`` argument (which must agree), or
    None."""
    if in_spec is not None and not isinstance(in_spec, str):  # a spec from a checkpoint
        raise UsageError(f"spec 'label_column' must be a string, got {in_spec!r}", source="data")
    if from_option is not None and in_spec is not None and from_option != in_spec:
        raise UsageError(
            f"label column {from_option!r} contradicts the data spec's {in_spec!r}",
            source="label_column",
        )
    column = in_spec if in_spec is not None else from_option
    if column is not None and not isinstance(column, str):
        raise UsageError(f"label column must be a string, got {column!r}", source="label_column")
    return column


def _existing_path(given: str) -> str:
    """``given`` made absolute; a missing path is an InputError (hinting at the built-ins
    when it looks like a misspelt built-in name rather than a path)."""
    path = os.path.abspath(os.path.expanduser(given))
    if not os.path.exists(path):
        hint = f"; built-in datasets: {', '.join(BUILTIN_NAMES)}" if os.sep not in given else ""
        raise InputError(f"no such file or directory{hint}", source=path)
    check_data_path(path)  # a FIFO or device is refused before any format probes it
    return path


def _format_options(fmt: DataFormat, spec: dict, column: str | None) -> dict:
    """The values of ``fmt``'s own spec keys (besides ``label_column``); a key (or the
    ``label_column`` argument) that only other formats read is a UsageError."""
    if column is not None and "label_column" not in fmt.spec_keys:
        takers = [other.name for other in FORMATS.values() if "label_column" in other.spec_keys]
        raise UsageError(
            f"applies to {', '.join(takers)} data, not to {fmt.name} data",
            source="label_column",
        )
    foreign = [
        key
        for key in optional_spec_keys()
        if key != "label_column" and key not in fmt.spec_keys and spec.get(key) is not None
    ]
    if foreign:
        raise UsageError(
            f"file data spec key(s) {', '.join(foreign)} do not apply to {fmt.name} data",
            source="data",
        )
    return {key: spec.get(key) for key in fmt.spec_keys if key != "label_column"}


def format_data_spec(spec: dict) -> str:
    """The ``--data`` string of a complete spec dict (``blobs:n=2000,...`` or the path)."""
    if spec.get("kind") == "builtin":
        args = ",".join(f"{key}={value}" for key, value in spec.get("args", {}).items())
        return f"{spec['name']}:{args}" if args else spec["name"]
    return spec["path"]


def load_dataset(
    data: str | dict = DEFAULT_DATA,
    *,
    label_column: str | None = None,
    x_key: str | None = None,
    y_key: str | None = None,
    shift_labels: bool | None = None,
    x_shape: str | list | None = None,
    trust_pickle: bool = False,
    what: str = "the `data` file",
    causal_lm: str | None = None,
) -> Dataset:
    """Load the dataset a spec names (module docstring); the result's ``spec`` reproduces it.

    A file (or folder) is recorded as an input of the command (:mod:`sharpcli.ledger`,
    ``what`` says where it was named), so that no output of the command replaces it.

    A file spec is read by its format's ``read`` in ``sharpcli.io.data.formats.FORMATS``; a
    path no format claims is an ``InputError`` and an unknown format a ``UsageError``,
    both listing the accepted ones.

    Returns a ``Dataset`` whose features are float32 ``(N, ...)`` in the shape the source
    stores them, or the spec's ``x_shape`` (:func:`apply_x_shape`) (int64
    when the file stores integers: token ids stay exact; see ``dataset``) and
    whose targets are int64 class labels or float32 regression targets, checked for
    matching lengths, finiteness and non-emptiness. Raises ``InputError`` (bad file)
    or ``UsageError`` (bad spec or option); nothing else escapes for a bad input.

    ``trust_pickle`` lets a ``.pt`` file holding a pickled ``TensorDataset`` be unpickled (it
    runs code from the file); it is never stored in the spec, so a checkpoint naming such a
    file needs it again. Token labels equal to the input ids are refused or shifted
    (:func:`apply_label_convention`; ``causal_lm``, the class of a Hugging Face causal LM whose
    own loss is analysed, reads them as that model does).
    """
    full = parse_data_spec(
        data,
        label_column=label_column,
        x_key=x_key,
        y_key=y_key,
        shift_labels=shift_labels,
        x_shape=x_shape,
    )
    if full["kind"] == "builtin":
        return load_builtin(full["name"], full["args"])
    ledger.record_input(full["path"], what)
    fmt = data_format(full["format"])
    dataset = fmt.read({**full, "trust_pickle": True} if trust_pickle else full)
    dataset.spec = full
    dataset = apply_x_shape(dataset, full.get("x_shape"))
    return apply_label_convention(dataset, full.get("shift_labels"), causal_lm)


def labels_equal_inputs(
    x: torch.Tensor, y: torch.Tensor, input_keys=None, input_shapes=None
) -> bool:
    """Whether token labels ``y`` (N, T) equal the input ids at every labelled position:
    Hugging Face's causal-LM habit (``labels=input_ids``, the model shifts inside)."""
    ids = input_ids_of(x, input_keys, input_shapes)
    if ids is None or y.is_floating_point() or y.ndim != 2 or ids.shape != y.shape:
        return False
    labelled = y != IGNORE_INDEX
    return bool(labelled.any()) and bool((ids[labelled] == y[labelled]).all())


def apply_label_convention(
    dataset: Dataset, shift_labels: bool | None, causal_lm: str | None = None
) -> Dataset:
    """Token labels and the causal-LM convention (``--shift-labels``).

    ``shift_labels`` True: every split's ``(N, T)`` labels are shifted
    (:func:`~sharpcli.io.torch_losses.causal_lm.shift_token_labels`). False: labels are used as given.
    None (the default): labels equal to the input ids (:func:`labels_equal_inputs`) are refused
    with an ``InputError`` saying what to do, since a model that predicts position ``t`` from
    tokens ``<= t`` would be analysed against its own input (lambda_max 134 instead of 8.6 on a
    tiny GPT-2).

    ``causal_lm`` (the class name of a Hugging Face causal LM whose own loss is analysed, no
    loss named: :mod:`sharpcli.io.torch_losses.causal_lm`) reads the labels as that model does when
    ``shift_labels`` is None: labels equal to the input ids are Hugging Face's and are shifted
    (the spec records ``shift_labels`` true), labels already shifted by hand are kept
    (:func:`~sharpcli.io.torch_losses.causal_lm.labels_shifted_by_hand`), and any other labels are refused
    naming ``shift_labels`` and ``loss``, the two readings that fit.
    """
    if shift_labels is None and causal_lm is not None:
        shift_labels = _causal_lm_labels(dataset, causal_lm)
        if shift_labels:
            dataset.spec = {**(dataset.spec or {}), "shift_labels": True}
    if shift_labels is True:
        if dataset.y_train.ndim != 2 or dataset.y_train.is_floating_point():
            raise UsageError(
                "needs token labels (N, T), one per position; these labels are "
                f"{tuple(dataset.y_train.shape)}",
                source="shift_labels",
            )
        dataset.y_train = shift_token_labels(dataset.y_train)
        if dataset.y_test is not None:
            dataset.y_test = shift_token_labels(dataset.y_test)
        return dataset
    if shift_labels is None and labels_equal_inputs(
        dataset.x_train, dataset.y_train, dataset.input_keys, dataset.input_shapes
    ):
        raise InputError(
            "token labels equal the input ids (Hugging Face's labels=input_ids, which the "
            "model shifts inside), while sharp compares the logits at position t with the label "
            "at t: pass `shift_labels` to predict token t+1 (or set it off explicitly to use "
            "the labels as given)",
            source=dataset.source,
        )
    return dataset


def _causal_lm_labels(dataset: Dataset, causal_lm: str) -> bool:
    """Whether the labels of a Hugging Face causal LM's data are shifted (True: they are the
    input ids, Hugging Face's labels) or read as given (False: shifted by hand already);
    InputError for any other labels (two readings fit)."""
    if labels_equal_inputs(
        dataset.x_train, dataset.y_train, dataset.input_keys, dataset.input_shapes
    ):
        return True
    ids = input_ids_of(dataset.x_train, dataset.input_keys, dataset.input_shapes)
    if labels_shifted_by_hand(ids, dataset.y_train):
        return False
    raise InputError(
        f"the labels are neither the input ids (Hugging Face's causal-LM labels, which "
        f"{causal_lm} shifts inside to compute its own loss) nor the ids shifted by one: pass "
        "`shift_labels` to shift them as the model does, or name a `loss` to read them as given",
        source=dataset.source,
    )


def subset(
    x: torch.Tensor, y: torch.Tensor, samples: int | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random subset of ``samples`` rows without replacement (``--samples N``, ``--seed``).

    Indices are the first ``samples`` entries of ``randperm(N)`` drawn from a CPU
    ``torch.Generator`` seeded with ``seed``, then sorted, so the subset keeps the data
    order, is the same on every run, and the subsets of one seed are nested
    (``samples=m`` is contained in ``samples=m'`` for ``m <= m'``). ``samples=None``
    returns the data unchanged; ``samples`` outside ``1..N`` raises
    ``UsageError(source="samples")``.
    """
    if samples is None:
        return x, y
    n = x.shape[0]
    if isinstance(samples, bool) or not isinstance(samples, int):
        raise UsageError(f"must be an integer, got {samples!r}", source="samples")
    if samples < 1:
        raise UsageError(f"must be at least 1, got {samples}", source="samples")
    if samples > n:
        raise UsageError(
            f"{samples} samples requested but the split has only {n}", source="samples"
        )
    generator = torch.Generator().manual_seed(int(seed))
    index = torch.randperm(n, generator=generator)[:samples].sort().values
    return x[index], y[index]


def validate_for_model(
    data: Dataset | tuple[torch.Tensor, torch.Tensor],
    input_shape: tuple[int, ...] | list[int],
    num_classes: int | None,
    source: str | None = None,
) -> None:
    """Check data against a model: per-sample feature shape, labels in ``[0, num_classes)``, finiteness.

    ``data`` is a ``Dataset`` (every split present is checked) or one ``(x, y)`` pair.
    ``input_shape`` is the model's per-sample input shape (``(16,)``, ``(3, 32, 32)``);
    ``num_classes`` is its number of outputs (``None`` skips the target check): class
    labels must lie in ``[0, num_classes)``, regression targets must have
    ``num_classes`` values per sample. ``source`` names the data in messages (default:
    the dataset's own). Raises ``InputError(source=source)`` with a one-line message,
    e.g. ``features have 12 columns but the model expects 16``.
    """
    if isinstance(data, Dataset):
        source = source or data.source
        pairs = [(TRAIN, data.x_train, data.y_train)]
        if data.x_test is not None and data.y_test is not None:  # both or neither
            pairs.append((TEST, data.x_test, data.y_test))
        task = data.task
    else:
        x, y = data
        pairs = [("", x, y)]
        task = "regression" if torch.is_floating_point(y) else "classification"
    expected = tuple(int(d) for d in input_shape)
    for split, x, y in pairs:
        where = f"{split} " if split else ""
        _check_features(x, y, expected, where, source)
        if num_classes is None:
            continue
        if task == "classification":
            _check_labels(y, num_classes, where, source)
        else:
            _check_targets(y, num_classes, where, source)


def _check_features(
    x: torch.Tensor, y: torch.Tensor, expected: tuple, where: str, source: str | None
) -> None:
    """One split's features: not empty, one row per target, the model's shape, finite."""
    if x.shape[0] == 0:
        raise InputError(f"{where}split is empty", source=source)
    if y.shape[0] != x.shape[0]:
        raise InputError(
            f"{where}features have {x.shape[0]} rows but targets {y.shape[0]}", source=source
        )
    got = tuple(x.shape[1:])
    if got != expected:
        if len(got) == 1 and len(expected) == 1:
            problem = f"{where}features have {got[0]} columns but the model expects {expected[0]}"
        else:
            problem = f"{where}samples have shape {got} but the model expects {expected}"
        raise InputError(problem, source=source)
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise InputError(f"{where}features have {bad} non-finite value(s)", source=source)


def _check_labels(y: torch.Tensor, num_classes: int, where: str, source: str | None) -> None:
    """Class labels in ``[0, num_classes)``."""
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= num_classes:
        label = low if low < 0 else high
        raise InputError(
            f"{where}labels include {label} but the model has {num_classes} classes "
            f"(labels 0..{num_classes - 1})",
            source=source,
        )


def _check_targets(y: torch.Tensor, num_outputs: int, where: str, source: str | None) -> None:
    """Regression targets: ``num_outputs`` finite values per sample."""
    per_sample = 1 if y.dim() == 1 else int(y[0].numel())
    if per_sample != num_outputs:
        raise InputError(
            f"{where}targets have {per_sample} value(s) per sample but the model has "
            f"{num_outputs} outputs",
            source=source,
        )
    bad = int((~torch.isfinite(y)).sum())
    if bad:
        raise InputError(f"{where}targets have {bad} non-finite value(s)", source=source)
