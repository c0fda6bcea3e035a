"""The ``Dataset`` container and the checks every loader's arrays go through.

Every reader (built-in generators, tensor files, tables, CIFAR, MNIST) hands its
raw arrays to ``finalize_dataset``, which turns them into the one representation
the rest of sharpcli relies on (docs/architecture.md, "datasets"):

- features ``x``: ``float32``; ``float64`` when a tensor file stores float64 (a
  ``--dtype float64`` analysis then sees them unrounded; every analysis casts them to its
  own dtype, and refuses values beyond the float32 range in a float32 one); or ``int64`` when the source stores integers
  (token ids for an ``nn.Embedding``, counts, raw bytes: kept exact, see ``_features``), in
  the shape they were stored with, any rank: ``(N, D)`` vectors, ``(N, C, L)`` for a Conv1d,
  ``(N, T)`` token ids, ``(N, C, H, W)`` images, ``(N, C, D, H, W)`` for a Conv3d (only a 1-D
  array becomes ``(N, 1)``). Nothing is given a channel axis here: image formats (CIFAR,
  MNIST folders) make their own ``(N, C, H, W)``, and a file's ``(N, H, W)`` reaches the model
  as ``(N, H, W)`` unless the data spec's ``x_shape`` reshapes it
  (:func:`sharpcli.io.data.loading.apply_x_shape`);
- classification targets (integer or boolean ``y``): ``int64`` labels of shape
  ``(N,)`` (an ``(N, 1)`` column is squeezed) in ``[0, num_classes)``;
- regression targets (floating ``y``): ``float32`` (``float64`` as features) of shape
  ``(N,)`` or ``(N, K)``;
- ``N > 0``, ``x`` and ``y`` of equal length, every value finite, test features
  shaped like the training features.

Anything else raises ``InputError(source=<file>)`` with a one-line message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sharpcli import catalogue
from sharpcli.catalogue.values import TEST, TRAIN
from sharpcli.errors import InputError, UsageError
from sharpcli.losses import IGNORE_INDEX

TASKS = ("classification", "regression")
SPLITS = catalogue.SPLITS
MAX_CLASSES = 1_000_000  # a label above this is a corrupt file, not a class


@dataclass
class Dataset:
    """A loaded dataset: train split, optional test split, task and provenance.

    ``x_*`` are float32 (or, for integer sources, int64) feature tensors ``(N, ...)`` of the
    shape the source stores (``(N, D)``, ``(N, C, L)``, ``(N, C, H, W)``, ...); ``y_*`` are int64 labels ``(N,)`` (or per-position token labels ``(N, T)``, -100 for padding) for ``task == "classification"``
    (with ``num_classes`` classes) or float32 targets ``(N,)``/``(N, K)`` for
    ``task == "regression"`` (``num_classes is None``). ``x_test``/``y_test`` are both
    ``None`` when the source has no test split. ``spec`` is a JSON-serialisable dict that
    ``load_dataset`` accepts to rebuild exactly this data (a checkpoint stores it);
    ``source`` is the file path or ``builtin:<name>`` that error messages name.
    ``class_names`` lists the label names when the source had textual labels.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor | None
    y_test: torch.Tensor | None
    num_classes: int | None
    task: str
    spec: dict
    source: str
    class_names: list[str] | None = field(default=None)
    # keyword inputs (sharpcli.io.data.keyed): the forward arguments x holds, stacked on
    # axis 1 when there are several; None: x is the model's one positional input
    input_keys: tuple[str, ...] | None = field(default=None)
    # several keyword inputs of different per-sample shapes: x holds each flattened, concatenated
    # on axis 1 in input_keys' order, and these are their shapes (sharpcli.models.outputs.
    # keyword_batch views them back); None: one key, or keys of one shape stacked on axis 1
    input_shapes: tuple[tuple[int, ...], ...] | None = field(default=None)

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(x, y)`` of split ``"train"`` or ``"test"``.

        A missing test split raises ``InputError`` naming the source; an unknown
        split name raises ``UsageError(source="split")``.
        """
        if name == TRAIN:
            return self.x_train, self.y_train
        if name == TEST:
            if self.x_test is None or self.y_test is None:
                raise InputError(
                    f"has no test split ({_how_to_add_test(self.spec)})", source=self.source
                )
            return self.x_test, self.y_test
        raise UsageError(f"unknown split {name!r}; accepted: {', '.join(SPLITS)}", source="split")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample's features, e.g. ``(16,)`` or ``(3, 32, 32)``."""
        return tuple(self.x_train.shape[1:])

    @property
    def output_size(self) -> int:
        """Number of model outputs the data calls for: classes, or regression targets per sample."""
        if self.num_classes is not None:  # classification
            return int(self.num_classes)
        return 1 if self.y_train.dim() == 1 else int(self.y_train.shape[1])


# the optional spec keys of the formats whose arrays are named (x and y by default)
NAMED_KEYS = ("x_key", "y_key")
# how a folder layout without its test files provides a test split: it does not
_NO_TEST_FILES = "the folder holds no test files"


def format_info(
    order: int,
    read: str,
    *,
    extensions: tuple[str, ...] = (),
    spec_keys: tuple[str, ...] = (),
    directory: bool = False,
    test_split: str = _NO_TEST_FILES,
) -> dict[str, Any]:
    """The ``info`` of a data format's declaration (:class:`sharpcli.io.data.formats.DataFormat`).

    Args:
        order: where it is listed in messages and probed among the built-in formats (folder
            layouts are probed in this order: CIFAR-10 batches win over a CIFAR-100 pair).
        read: its reader, ``"module:function"``.
        extensions: the lower-case file extensions, with their dot, routed to it.
        spec_keys: the optional file-spec keys it reads.
        directory: a folder layout rather than a single file.
        test_split: how data in this format provides a test split (for the message when
            one is missing).
    """
    return {
        "order": order,
        "read": read,
        "extensions": extensions,
        "spec_keys": spec_keys,
        "directory": directory,
        "test_split": test_split,
    }


def _how_to_add_test(spec: dict) -> str:
    """A hint on how the given kind of source would provide a test split (a file format's
    ``test_split`` in its registry record)."""
    if isinstance(spec, dict) and spec.get("kind") == "builtin":
        return "use test_fraction > 0"
    name = spec.get("format") if isinstance(spec, dict) else None
    if not isinstance(name, str) or name not in catalogue.DATA_FORMATS:
        return _NO_TEST_FILES
    return catalogue.DATA_FORMATS.entry(name).info["test_split"]


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|\x1b")  # terminal escapes (torch's ESC[1m)
_QUOTED = re.compile(r"b?'[^']*'|b?\"[^\"]*\"")


def describe_exception(exc: BaseException) -> str:
    """One-line, bounded ``Type: message`` text of a library exception for an InputError.

    The message is sanitised: a data path may come from a checkpoint's metadata and name
    any local file, so nothing the file holds may reach the message. Library messages quote
    the content they choke on (``could not convert string to float: 'AWS_SECRET...'``); every
    quoted part is replaced by ``'...'`` and the rest cut at 120 characters, which keeps the
    templated part (``Expected 3 fields in line 5, saw 4``).
    """
    text = _QUOTED.sub("'...'", " ".join(_ANSI.sub("", str(exc)).split()))
    text = "".join(ch for ch in text if ch.isprintable())
    if len(text) > 120:
        text = text[:117] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_failure(what: str, exc: BaseException, source: str) -> InputError:
    """``InputError`` for a file a library could not parse, naming the file and the cause."""
    return InputError(f"cannot read {what} ({describe_exception(exc)})", source=source)


_TORCH_REAL_DTYPES = frozenset(
    [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    ]
    + [
        getattr(torch, name)
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, name)
    ]
)


def as_tensor(value, name: str, source: str) -> torch.Tensor:
    """Convert a numpy array or tensor holding real numbers to a CPU strided tensor.

    Object, string, complex or sparse arrays raise ``InputError`` naming ``name``.
    """
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise InputError(f"{name} has dtype {value.dtype}, expected numbers", source=source)
        if value.dtype.kind == "f" and value.dtype.itemsize > 8:  # float128: no torch dtype
            value = value.astype(np.float64)
        if value.dtype.byteorder not in "=|":  # big-endian data (as in idx files)
            value = value.astype(value.dtype.newbyteorder("="))
        if not value.flags.writeable:
            value = value.copy()
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise InputError(
                f"{name} is a {value.layout} tensor, expected a dense tensor", source=source
            )
        if value.dtype not in _TORCH_REAL_DTYPES:
            raise InputError(
                f"{name} has dtype {value.dtype}, expected real numbers", source=source
            )
        if value.device.type == "meta":
            raise InputError(f"{name} is a meta tensor (shape only, no data)", source=source)
        return value.detach().to("cpu")
    raise InputError(f"{name} is a {type(value).__name__}, expected a tensor", source=source)


def _integer_features(x: torch.Tensor) -> bool:
    """Whether features ``x`` are kept as int64 (see :func:`_features`).

    Signed and unsigned integer dtypes qualify; ``uint64`` only when every value fits in
    int64 (a value of 2**63 or more cannot be a token id and keeps the float32 path).
    Booleans are flags, not ids: they become 0.0/1.0 floats as before.
    """
    if x.dtype == torch.bool or x.is_floating_point():
        return False
    if x.dtype == torch.uint64:
        return not bool((x.view(torch.int64) < 0).any())
    return True


def _features(x: torch.Tensor, name: str, source: str, keep_float64: bool = False) -> torch.Tensor:
    """Features ``(N, ...)`` in their stored shape (a 1-D array as ``(N, 1)``), non-empty and
    finite: int64 or float32.

    No axis is added or removed: a 3-D array is ``(N, C, L)`` for a Conv1d as much as
    ``(N, H, W)`` images, so it reaches the model as stored (the data spec's ``x_shape``
    reshapes it explicitly, :func:`sharpcli.io.data.loading.apply_x_shape`).

    Integer features (token ids, counts, raw bytes) are kept exact as int64 rather than cast
    to float32: a model whose first layer is an ``nn.Embedding`` needs the ids as integers,
    and float32 holds integers exactly only up to 2**24. Whether they reach the model as
    int64 or in the analysis dtype is decided against the model in
    :func:`sharpcli.io.data.features.prepare_features`. float64 stays float64 when ``keep_float64``
    (a tensor file's stored dtype); every other dtype becomes float32.
    """
    if x.dim() == 0:
        raise InputError(f"{name} is a scalar, expected one row per sample", source=source)
    if x.dim() == 1:
        x = x.unsqueeze(1)
    if x.shape[0] == 0:
        raise InputError(f"{name} is empty (0 samples)", source=source)
    if x[0].numel() == 0:
        raise InputError(f"{name} has no features (shape {tuple(x.shape)})", source=source)
    if _integer_features(x):
        return x.to(torch.int64).contiguous()
    return _finite_floats(x, name, source, keep_float64)


def _finite_floats(x: torch.Tensor, name: str, source: str, keep_float64: bool) -> torch.Tensor:
    """``x`` as float64 when it is float64 and ``keep_float64`` (a ``--dtype float64``
    analysis then sees the values as stored, not rounded to float32), else as float32; every
    value finite."""
    dtype = torch.float64 if keep_float64 and x.dtype == torch.float64 else torch.float32
    x = x.to(dtype).contiguous()
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        kind = "" if dtype == torch.float64 else ", or beyond the float32 range"
        raise InputError(f"{name} has {bad} non-finite value(s) (NaN, Inf{kind})", source=source)
    return x


def _labels(y: torch.Tensor, name: str, n: int, source: str) -> torch.Tensor:
    """Integer/boolean class labels as int64: ``(N,)``, or per position: ``(N, T)`` token
    labels, ``(N, d1, ..., dk)`` for outputs ``(N, C, d1, ..., dk)`` (segmentation).

    Labels per position (a sequence model's next-token targets, a segmentation's pixels) may
    mark unlabelled positions (padding) with ``-100``, the ignore index of
    ``torch.nn.functional.cross_entropy`` and of sharp's ``token-cross-entropy``; every other
    label is in ``0..C-1``.
    """
    if y.dim() == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.dim() == 0:
        raise InputError(
            f"{name} is a scalar; class labels are one per sample (N,) or one per position "
            "(N, d1, ..., dk)",
            source=source,
        )
    if y.shape[0] != n:
        raise InputError(
            f"{name} has {y.shape[0]} labels but the features have {n} rows", source=source
        )
    wide = y.to(torch.float64)  # exact for every label below 2**53; larger ones are refused anyway
    labelled = wide[wide != IGNORE_INDEX] if y.dim() >= 2 else wide.reshape(-1)
    if labelled.numel() == 0:
        raise InputError(f"{name} has no labelled position (every label is -100)", source=source)
    low, high = float(labelled.min()), float(labelled.max())
    if low < 0:
        ignored = " other than -100 (unlabelled positions)" if y.dim() >= 2 else ""
        raise InputError(
            f"{name} has a negative label{ignored} ({low:.0f}); labels must be 0..C-1",
            source=source,
        )
    if high >= MAX_CLASSES:
        raise InputError(
            f"{name} has label {high:.0f}, beyond {MAX_CLASSES} classes", source=source
        )
    return y.to(torch.int64).contiguous()


def _targets(
    y: torch.Tensor, name: str, n: int, source: str, keep_float64: bool = False
) -> torch.Tensor:
    """Regression targets as float32 (float64 when stored so), finite: ``(N,)``, ``(N, K)`` or
    shaped as the outputs of any shape ``(N, ...)`` (``mse`` is their mean over all elements)."""
    if y.dim() == 0:
        raise InputError(
            f"{name} is a scalar; regression targets are one row per sample (N, ...)",
            source=source,
        )
    if y.shape[0] != n:
        raise InputError(
            f"{name} has {y.shape[0]} targets but the features have {n} rows", source=source
        )
    if y.dim() >= 2 and y[0].numel() == 0:
        raise InputError(f"{name} has no target columns", source=source)
    return _finite_floats(y, name, source, keep_float64)


def _common_float(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The float dtype two splits' features share: float64 when either is, else float32."""
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def infer_task(y) -> str:
    """``"classification"`` for integer or boolean targets, ``"regression"`` for floating ones."""
    if isinstance(y, np.ndarray):
        return "regression" if y.dtype.kind == "f" else "classification"
    return "regression" if torch.is_floating_point(y) else "classification"


def finalize_dataset(
    x_train,
    y_train,
    x_test,
    y_test,
    *,
    source: str,
    spec: dict,
    task: str | None = None,
    num_classes: int | None = None,
    class_names: list[str] | None = None,
    names: tuple[str, str, str, str] = ("x", "y", "x_test", "y_test"),
    keep_float64: bool = False,
    input_keys: tuple[str, ...] | None = None,
    input_shapes: tuple[tuple[int, ...], ...] | None = None,
) -> Dataset:
    """Check and convert raw arrays into a ``Dataset`` (rules in the module docstring).

    ``keep_float64=True`` keeps float64 features and targets float64: for readers whose
    float64 is the file's stored dtype (tensor files). The default makes them float32 like
    every other floating dtype (tables: text has no stored dtype, and a parser's float64 is
    not the file's; images are bytes).

    ``task`` defaults to ``infer_task(y_train)``; for classification ``num_classes``
    defaults to ``1 + max label`` over both splits, and a given ``num_classes`` is
    enforced as an upper bound on the labels. ``names`` are what messages call the
    four arrays (the keys of a tensor file, ``images``/``labels`` for CIFAR, ...).
    """
    n_x, n_y, n_xt, n_yt = names
    if (x_test is None) != (y_test is None):
        present, missing = (n_xt, n_yt) if y_test is None else (n_yt, n_xt)
        raise InputError(f"has {present} but no {missing}; give both or neither", source=source)
    x_train = _features(as_tensor(x_train, n_x, source), n_x, source, keep_float64)
    y_train = as_tensor(y_train, n_y, source)
    task = task or infer_task(y_train)
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    n = x_train.shape[0]
    if task == "classification":
        y_train = _labels(y_train, n_y, n, source)
    else:
        y_train = _targets(y_train, n_y, n, source, keep_float64)
    if x_test is not None:
        x_test = _features(as_tensor(x_test, n_xt, source), n_xt, source, keep_float64)
        if x_test.shape[1:] != x_train.shape[1:]:
            raise InputError(
                f"{n_xt} has per-sample shape {tuple(x_test.shape[1:])} but {n_x} has {tuple(x_train.shape[1:])}",
                source=source,
            )
        if x_test.dtype != x_train.dtype:  # integers in one split only, or float32 and float64
            dtype = _common_float(x_train.dtype, x_test.dtype)
            x_train, x_test = x_train.to(dtype), x_test.to(dtype)
        y_test = as_tensor(y_test, n_yt, source)
        if infer_task(y_test) != task:
            raise InputError(
                f"{n_yt} has dtype {y_test.dtype} but {n_y} has {y_train.dtype}", source=source
            )
        if task == "classification":
            y_test = _labels(y_test, n_yt, x_test.shape[0], source)
        else:
            y_test = _targets(y_test, n_yt, x_test.shape[0], source, keep_float64)
            if y_test.shape[1:] != y_train.shape[1:]:
                raise InputError(
                    f"{n_yt} has per-sample shape {tuple(y_test.shape[1:])} but {n_y} has {tuple(y_train.shape[1:])}",
                    source=source,
                )
            if y_test.dtype != y_train.dtype:
                dtype = _common_float(y_train.dtype, y_test.dtype)
                y_train, y_test = y_train.to(dtype), y_test.to(dtype)
    if task == "classification":
        seen = int(y_train.max()) + 1
        if y_test is not None:
            seen = max(seen, int(y_test.max()) + 1)
        if num_classes is None:
            num_classes = seen
        elif seen > num_classes:
            raise InputError(
                f"has label {seen - 1} but the format has {num_classes} classes", source=source
            )
    else:
        num_classes = None
    return Dataset(
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        task=task,
        spec=spec,
        source=source,
        class_names=class_names,
        input_keys=tuple(input_keys) if input_keys else None,
        input_shapes=input_shapes,
    )
