"""A restricted unpickler for data files that were distributed as pickles.

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

Every failure while reading (a refused global, a truncated stream, a bad
opcode, a memory or recursion error from a hostile stream) surfaces as one
``InputError`` naming the file.
"""

from __future__ import annotations

import io
import pickle

import numpy as np

try:  # numpy >= 2
    from numpy._core import multiarray as _np_multiarray
    from numpy._core import numeric as _np_numeric
except ImportError:  # numpy 1.x
    from numpy.core import multiarray as _np_multiarray
    from numpy.core import numeric as _np_numeric

from sharpcli.errors import InputError

_LATIN1_NAMES = frozenset(
    {"latin1", "latin-1", "latin_1", "iso-8859-1", "iso8859-1", "iso_8859_1", "l1"}
)


def _latin1_encode(text, encoding="latin1", errors="strict"):
    """``_codecs.encode`` admitted only as ``str -> bytes`` through latin-1.

    Python 3 pickles ``bytes`` under protocols 0-2 as ``_codecs.encode(s, "latin1")``
    where ``s`` holds one code point per byte; any other codec (some of which
    transform bytes in arbitrary ways) is refused.
    """
    if not isinstance(text, str) or str(encoding).lower() not in _LATIN1_NAMES:
        raise pickle.UnpicklingError(
            f"refusing to unpickle _codecs.encode with codec {encoding!r} (only latin-1 is allowed)"
        )
    return text.encode("latin1", errors="strict")


_ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    ("numpy.core.multiarray", "_reconstruct"): _np_multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _np_multiarray._reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _np_numeric._frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _np_numeric._frombuffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("__builtin__", "set"): set,
    ("__builtin__", "frozenset"): frozenset,
    ("__builtin__", "bytearray"): bytearray,
}

ALLOWED_GLOBALS = tuple(sorted(f"{module}.{name}" for module, name in _ALLOWED_GLOBALS))


class RefusedGlobal(pickle.UnpicklingError):
    """Raised inside the unpickler when the stream names a callable not on the allow-list."""

    def __init__(self, module: str, name: str):
        super().__init__(f"refusing to unpickle {module}.{name}")
        self.module = module
        self.name = name


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits only ``ALLOWED_GLOBALS``.

    ``find_class(module, name)`` is the single place where a pickle stream turns a
    name into a callable (opcodes GLOBAL, STACK_GLOBAL, INST, OBJ and the extension
    registry all go through it), so refusing there blocks code execution. Persistent
    ids are refused as well (the base class raises for them).
    """

    def find_class(self, module: str, name: str):
        """Return the allowed object for ``module.name`` or raise ``RefusedGlobal``."""
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise RefusedGlobal(module, name) from None


def restricted_loads(data: bytes, *, source: str, encoding: str = "bytes"):
    """Unpickle ``data`` with ``RestrictedUnpickler``; any failure -> ``InputError(source=source)``.

    ``encoding="bytes"`` reads Python 2 ``str`` objects as ``bytes``, which is how
    the CIFAR python batches (written by Python 2 cPickle, protocol 2) expose their
    keys (``b"data"``, ``b"labels"``). The stream is read from memory, so a hostile
    length field cannot make the reader allocate more than the file holds.
    """
    unpickler = RestrictedUnpickler(io.BytesIO(data), encoding=encoding)
    try:
        return unpickler.load()
    except RefusedGlobal as exc:
        raise InputError(
            f"refusing to unpickle {exc.module}.{exc.name}: this file is not a plain data pickle "
            "(loading it would call that function)",
            source=source,
        ) from None
    except Exception as exc:  # a corrupt or hostile stream: report it, never a traceback
        raise InputError(f"cannot read pickle data ({_describe(exc)})", source=source) from exc


def _describe(exc: BaseException) -> str:
    """One-line, bounded description of a low-level exception for an error message."""
    text = " ".join(str(exc).split())
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
