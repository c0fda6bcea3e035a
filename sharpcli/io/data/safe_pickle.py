"""A restricted, allocation-bounded unpickler for data files that were distributed as pickles.

The CIFAR-10/100 "python version" downloads are pickled dicts of numpy arrays
and lists. A plain ``pickle.load`` runs whatever callable the file names (a
pickle is a small program: ``GLOBAL os system`` + ``REDUCE`` calls
``os.system``), so it is never used for data. ``RestrictedUnpickler``
resolves a global only if it is on a short allow-list of the callables that
rebuild numpy arrays and plain containers; any other name raises
``InputError("refusing to unpickle <module>.<name>")`` *before* anything is
called. Opcodes that build dicts, lists, tuples, ints, floats, strings and
bytes need no global and work as usual.

Allowed names, and why each is harmless:

- ``numpy.core.multiarray._reconstruct`` / ``numpy._core.multiarray._reconstruct``:
  ``ndarray.__reduce__`` in numpy 1.x / 2.x (protocols 0-4); it allocates an
  empty array of the given ndarray subtype, and the only subtype reachable is
  ``numpy.ndarray`` itself.
- ``numpy.core.numeric._frombuffer`` / ``numpy._core.numeric._frombuffer``:
  the protocol-5 reduction, ``frombuffer(buf, dtype).reshape(shape)``.
- ``numpy.ndarray`` and ``numpy.dtype``: constructors whose ``__setstate__``
  only reads shapes, dtype descriptions and raw bytes.
- ``_codecs.encode`` restricted to the latin-1 codec: how Python 3 spells a
  ``bytes`` object in protocols 0-2 (``encode(text, "latin1")``).
- ``builtins.set``, ``builtins.frozenset``, ``builtins.bytearray`` (and their
  Python 2 ``__builtin__`` spelling): plain containers without an opcode of
  their own in protocol 2.

Allocation is bounded by the file's size. Several of these callables allocate whatever
their arguments ask for: ``numpy.ndarray((200000, 3072), "u1")`` is 8 bytes of shape in the
stream and 614 MB in memory, ``bytearray(10**9)`` a gigabyte from a 39-byte file. So every
load has one :class:`_Budget` of ``ALLOCATION_FACTOR * len(data) + ALLOCATION_SLACK`` bytes,
and each of these is charged against it *before* it allocates:

- every array a constructor or ``BUILD`` (``ndarray.__setstate__``) would create: the
  number of elements its shape declares times its dtype's item size;
- every ``bytes``/``bytearray`` and set a constructor would create: its size;
- every opcode: :data:`OPCODE_COST` bytes, the most one opcode can allocate without a
  length the file pays for (an empty list or dict and the slot that holds it).

A real CIFAR batch stores its pixels once and so spends about one file size (two in the
protocol-2 pickles of Python 3, which encode the bytes, then copy them into the array).
A request beyond the budget is an ``InputError`` naming the file; nothing is allocated.
The unpickler is the pure-Python one (``pickle._Unpickler``), whose opcodes can be
counted and whose memo is a dict (the C unpickler sizes its memo table by the largest
index a ``LONG_BINPUT`` names, another allocation on request). ``BUILD`` applies only to
numpy arrays and dtypes, the only objects a data pickle sets state on.

Every failure while reading (a refused global, a truncated stream, a bad
opcode, a memory or recursion error from a hostile stream) surfaces as one
``InputError`` naming the file.
"""

from __future__ import annotations

import importlib
import io
import math
import pickle

import numpy as np

try:  # numpy >= 2
    _np_multiarray = importlib.import_module("numpy._core.multiarray")
    _np_numeric = importlib.import_module("numpy._core.numeric")
except ImportError:  # numpy 1.x
    _np_multiarray = importlib.import_module("numpy.core.multiarray")
    _np_numeric = importlib.import_module("numpy.core.numeric")

from sharpcli.errors import InputError
from sharpcli.io.data.dataset import describe_exception

ALLOCATION_FACTOR = 2
"""Bytes a load may allocate per byte of the file (pixels encoded, then copied: twice)."""
ALLOCATION_SLACK = 1 << 20
"""Bytes every load may allocate on top (small files: dict keys, label lists)."""
OPCODE_COST = 64
"""Bytes charged for each opcode (an empty container and its slot in a list or dict)."""

_LATIN1_NAMES = frozenset(
    {"latin1", "latin-1", "latin_1", "iso-8859-1", "iso8859-1", "iso_8859_1", "l1"}
)

_ALLOWED_NAMES = (
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
    ("__builtin__", "set"),
    ("__builtin__", "frozenset"),
    ("__builtin__", "bytearray"),
)

ALLOWED_GLOBALS = tuple(sorted(f"{module}.{name}" for module, name in _ALLOWED_NAMES))


class RefusedGlobal(pickle.UnpicklingError):
    """Raised inside the unpickler when the stream names a callable not on the allow-list."""

    def __init__(self, module: str, name: str):
        super().__init__(f"refusing to unpickle {module}.{name}")
        self.module = module
        self.name = name


class OverBudget(pickle.UnpicklingError):
    """Raised inside the unpickler when an object would take more memory than the file justifies."""

    def __init__(self, what: str, requested: int, file_size: int, spent: int):
        super().__init__(f"{what} of {requested} bytes")
        self.what = what
        self.requested = requested
        self.file_size = file_size
        self.spent = spent


class _Budget:
    """The bytes one load may still allocate (module docstring)."""

    def __init__(self, file_size: int):
        self.file_size = file_size
        self.limit = ALLOCATION_FACTOR * file_size + ALLOCATION_SLACK
        self.spent = 0

    def charge(self, nbytes: int, what: str) -> None:
        """Account for ``nbytes`` about to be allocated, or raise ``OverBudget`` (nothing is)."""
        if nbytes < 0 or self.spent + nbytes > self.limit:
            raise OverBudget(what, nbytes, self.file_size, self.spent)
        self.spent += nbytes


def _array_bytes(shape, dtype) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` as given in a stream, computed without
    allocating; a malformed shape or dtype is an ``UnpicklingError``."""
    dims = (shape,) if isinstance(shape, int) else shape
    if not isinstance(dims, (tuple, list)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        raise pickle.UnpicklingError("an array shape must be non-negative integers")
    try:
        itemsize = np.dtype(dtype).itemsize
    except Exception as exc:
        raise pickle.UnpicklingError(f"not an array dtype ({type(exc).__name__})") from None
    return math.prod(dims) * max(itemsize, 1)


def _sized(value, what: str) -> int:
    """``len(value)`` of a container argument; a value without a length is refused."""
    try:
        return len(value)
    except TypeError:
        raise pickle.UnpicklingError(f"{what} of a {type(value).__name__}") from None


class RestrictedUnpickler(pickle._Unpickler):
    """The pure-Python unpickler, restricted to ``ALLOWED_GLOBALS`` and bounded by a budget.

    ``find_class(module, name)`` is the single place where a pickle stream turns a name into a
    callable (opcodes GLOBAL, STACK_GLOBAL, INST, OBJ and the extension registry all go
    through it), so refusing there blocks code execution. What it returns are this instance's
    charging wrappers (plain methods: ``NEWOBJ`` cannot instantiate them, and ``BUILD`` cannot
    set attributes on them); each charges its allocation to the budget before making it.
    Persistent ids are refused as well (the base class raises for them).
    """

    dispatch = dict(pickle._Unpickler.dispatch)
    stack: list[object]  # the pure-Python unpickler's stack (pickle._Unpickler.load sets it)

    def __init__(self, file, *, file_size: int, **kwargs):
        super().__init__(file, **kwargs)
        self.budget = _Budget(file_size)
        self._allowed = {
            "_reconstruct": self._reconstruct,
            "_frombuffer": self._frombuffer,
            "ndarray": self._ndarray,
            "dtype": np.dtype,
            "encode": self._latin1_encode,
            "set": self._set,
            "frozenset": self._frozenset,
            "bytearray": self._bytearray,
        }
        # an instance's table of charged opcodes: the pure-Python unpickler looks dispatch up on
        # the instance, which typeshed declares a class variable
        self.dispatch = {  # type: ignore[misc]
            code: self._charged(load) for code, load in RestrictedUnpickler.dispatch.items()
        }

    def _charged(self, load):
        def step(unpickler):
            unpickler.budget.charge(OPCODE_COST, "the pickle's opcodes")
            return load(unpickler)

        return step

    def find_class(self, module: str, name: str):
        """Return the allowed object for ``module.name`` or raise ``RefusedGlobal``."""
        if (module, name) not in _ALLOWED_NAMES:
            raise RefusedGlobal(module, name)
        return self._allowed[name]

    # ------------------------------------------------------------------ the charged callables
    def _reconstruct(self, subtype, shape, dtype):
        """``numpy``'s ``_reconstruct`` for ``numpy.ndarray`` only, charged by the array's bytes."""
        if subtype not in (np.ndarray, self._ndarray):
            raise pickle.UnpicklingError("_reconstruct builds numpy.ndarray only")
        self.budget.charge(_array_bytes(shape, dtype), "a numpy array")
        return _np_multiarray._reconstruct(np.ndarray, shape, dtype)

    def _ndarray(self, shape, dtype=float, *args, **kwargs):
        """``numpy.ndarray(shape, dtype, ...)``, charged by the array's bytes."""
        self.budget.charge(_array_bytes(shape, dtype), "a numpy array")
        return np.ndarray(shape, dtype, *args, **kwargs)

    def _frombuffer(self, buf, dtype, shape, order):
        """``numpy``'s protocol-5 ``_frombuffer``, charged by the array's bytes."""
        self.budget.charge(_array_bytes(shape, dtype), "a numpy array")
        return _np_numeric._frombuffer(buf, dtype, shape, order)

    def _latin1_encode(self, text, encoding="latin1", errors="strict"):
        """``_codecs.encode`` admitted only as ``str -> bytes`` through latin-1.

        Python 3 pickles ``bytes`` under protocols 0-2 as ``_codecs.encode(s, "latin1")``
        where ``s`` holds one code point per byte; any other codec (some of which transform
        bytes in arbitrary ways) is refused.
        """
        if not isinstance(text, str) or str(encoding).lower() not in _LATIN1_NAMES:
            raise pickle.UnpicklingError(
                "refusing to unpickle _codecs.encode with another codec (only latin-1 is allowed)"
            )
        self.budget.charge(len(text), "a bytes object")
        return text.encode("latin1", errors="strict")

    def _bytearray(self, source=b"", *args):
        """``bytearray(n)`` or ``bytearray(content[, encoding])``, charged by its size."""
        if isinstance(source, int) and not isinstance(source, bool):
            self.budget.charge(source, "a bytearray")
        else:
            self.budget.charge(_sized(source, "a bytearray"), "a bytearray")
        return bytearray(source, *args)

    def _set(self, items=()):
        """``set(items)``, charged by its hash table (about 32 bytes an item)."""
        self.budget.charge(32 * _sized(items, "a set"), "a set")
        return set(items)

    def _frozenset(self, items=()):
        """``frozenset(items)``, charged as :meth:`_set`."""
        self.budget.charge(32 * _sized(items, "a frozenset"), "a frozenset")
        return frozenset(items)

    # ------------------------------------------------------------------ BUILD
    def load_build(self):
        """``BUILD`` on a numpy array (charged by the shape its state declares) or dtype only."""
        state, inst = self.stack[-1], self.stack[-2] if len(self.stack) > 1 else None
        if isinstance(inst, np.ndarray):
            if not isinstance(state, tuple) or len(state) not in (4, 5):
                raise pickle.UnpicklingError("malformed numpy array state")
            shape, dtype = state[-4], state[-3]
            if not isinstance(dtype, np.dtype):
                raise pickle.UnpicklingError("malformed numpy array state")
            self.budget.charge(_array_bytes(shape, dtype), "a numpy array")
        elif not isinstance(inst, np.dtype):
            kind = type(inst).__name__ if inst is not None else "nothing"
            raise pickle.UnpicklingError(f"refusing to set the state of a {kind}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # typeshed omits the opcode methods

    # typeshed types the table's entries as methods of the base class (any Unpickler)
    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]


def restricted_loads(data: bytes, *, source: str, encoding: str = "bytes"):
    """Unpickle ``data`` with ``RestrictedUnpickler``; any failure -> ``InputError(source=source)``.

    ``encoding="bytes"`` reads Python 2 ``str`` objects as ``bytes``, which is how
    the CIFAR python batches (written by Python 2 cPickle, protocol 2) expose their
    keys (``b"data"``, ``b"labels"``). The stream is read from memory, so a hostile
    length field cannot make the reader allocate more than the file holds, and every
    object the stream asks for is charged to a budget proportional to ``len(data)``
    (module docstring).
    """
    unpickler = RestrictedUnpickler(io.BytesIO(data), file_size=len(data), encoding=encoding)
    try:
        return unpickler.load()
    except RefusedGlobal as exc:
        raise InputError(
            f"refusing to unpickle {exc.module}.{exc.name}: this file is not a plain data pickle "
            "(loading it would call that function)",
            source=source,
        ) from None
    except OverBudget as exc:
        raise InputError(
            f"refusing to unpickle: it asks for {exc.what} of {exc.requested:,} bytes, more than "
            f"a file of {exc.file_size:,} bytes justifies (the limit is {ALLOCATION_FACTOR} x its "
            f"size + {ALLOCATION_SLACK >> 20} MiB)",
            source=source,
        ) from None
    except Exception as exc:  # a corrupt or hostile stream: report it, never a traceback
        raise InputError(
            f"cannot read pickle data ({describe_exception(exc)})", source=source
        ) from exc
