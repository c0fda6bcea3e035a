"""Where a Lanczos basis lives and how large it may grow: the memory plan of a Krylov run.

The basis (:class:`~sharpcli.curvature.krylov.KrylovBasis`) grows one P-vector per step,
stored in the products' dtype (4 P bytes a vector for a float32 model). Memory buys speed: a
basis whose rows all fit in what the run's memory plan (:mod:`sharpcli.memory`) leaves stays
in memory; one that does not is thick-restarted in memory [Wu2000] when enough rows for a
restart fit, and otherwise, on the CPU, lives in an anonymous scratch file
(:func:`scratch_directory`) read a slice at a time, where it costs two P-vectors of memory
whatever its length (:func:`basis_room`). The choice, and why, is one of the report's
``timing.memory.choices``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from sharpcli import memory
from sharpcli.catalogue.values import SCRATCH_OFF
from sharpcli.curvature.krylov import SLICE_BYTES, KrylovBasis
from sharpcli.errors import UsageError

__all__ = [
    "BASIS_FLOOR_BYTES",
    "IN_MEMORY_BASIS_BYTES",
    "MAX_IN_MEMORY_BYTES",
    "RESTART_ROWS",
    "basis_room",
    "krylov_work_bytes",
    "plan_basis",
    "scratch_directory",
    "storage_dtype",
]

BASIS_FLOOR_BYTES = 1 << 30  # a Krylov basis may always take this much (budget permitting)
IN_MEMORY_BASIS_BYTES = 256 << 20  # a larger basis kept in memory is a reported choice
MAX_IN_MEMORY_BYTES: int | None = None  # a cap on the rows kept in memory (tests: 0, disk)
RESTART_ROWS = 20  # a basis restarted in memory keeps at least this many rows; fewer: disk
_F64 = torch.float64


def storage_dtype(op_dtype: torch.dtype) -> torch.dtype:
    """The dtype a Krylov basis is stored in.

    Args:
        op_dtype: the dtype the operator's products run in.

    Returns:
        The products' own dtype (float32 or float64); float32 for half-precision products,
        whose rounding is too coarse to keep a basis orthonormal.

    Example:
        >>> storage_dtype(torch.bfloat16)
        torch.float32
    """
    return op_dtype if op_dtype in (torch.float32, _F64) else torch.float32


def krylov_work_bytes(dim: int, dtype: torch.dtype, returned: int = 0) -> int:
    """Bytes a Lanczos run holds beside its basis's rows.

    A step holds the vector multiplied (the newest row, kept in memory also when the basis is
    in a scratch file), the product ``w = A q`` being assembled and, until each is copied
    into it, the product's per-parameter pieces (one more P-vector in the product's dtype at
    the end of the double backward), plus the three slice buffers of
    :mod:`~sharpcli.curvature.krylov` (rows read from the file, the widened rows and the
    vector's slice); the end, after the basis is released, holds each of the ``returned``
    Ritz vectors with its explicit residual's product, assembled the same way.

    Args:
        dim: the number of parameters P.
        dtype: the dtype the products run in.
        returned: Ritz vectors returned or checked explicitly at the end.

    Returns:
        The larger of the step's and the end's bytes.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    stored = torch.empty((), dtype=storage_dtype(dtype)).element_size()
    pieces = dim * itemsize  # the product's per-parameter results before they are copied
    step = dim * (2 * stored + (itemsize if dtype != storage_dtype(dtype) else 0)) + pieces
    end = int(returned) * dim * (stored + itemsize) + (pieces if returned else 0)
    return int(max(step, end) + 3 * SLICE_BYTES)


def scratch_directory() -> str | None:
    """Where a large Krylov basis is kept out of core.

    Returns:
        ``SHARP_SCRATCH`` when set, else the system's temporary folder (``TMPDIR``); ``None``
        when ``SHARP_SCRATCH`` is ``off`` (or empty, ``memory``, ``none``): every basis stays
        in memory.
    """
    value = os.environ.get("SHARP_SCRATCH")
    if value is None:
        return tempfile.gettempdir()
    if value.strip().lower() in SCRATCH_OFF:
        return None
    return value


def basis_room(op, steps: int, *, extra_vectors: int = 0, minimum: int = 1, lower: str):
    """How many basis rows a run keeps, and where: memory buys speed, disk only as needed.

    In the order tried:

    1. All ``steps`` rows fit in what the memory plan leaves (beside
       :func:`krylov_work_bytes` for ``extra_vectors`` returned Ritz vectors): in memory, no
       restart. Every Gram-Schmidt pass then reads the rows from memory, not from a file.
    2. At least :data:`RESTART_ROWS` rows (and ``minimum``) fit: in memory, thick-restarted
       at that many rows (at most :data:`BASIS_FLOOR_BYTES` or one product's workspace,
       whichever is larger: a longer basis buys fewer products than its reads cost).
    3. On the CPU with a scratch folder (:func:`scratch_directory`): every row in an
       anonymous scratch file, read back a slice at a time, two P-vectors in memory whatever
       the length; bounded by half the free disk space there.
    4. Otherwise in memory, restarted at as many rows as fit.

    Args:
        op: the operator (``shape``, ``dtype``, ``device``).
        steps: the most rows the run could use.
        extra_vectors: Ritz vectors returned at the end.
        minimum: the fewest rows the run can work with.
        lower: what the user may lower, for the error message.

    Returns:
        ``(vectors, bytes held in memory, scratch folder or None)``.

    Raises:
        UsageError: not even ``minimum`` rows fit (``max_memory``, or ``scratch`` for disk).
    """
    dim = op.shape[0]
    steps = int(steps)
    per_vector = KrylovBasis.bytes_for(dim, storage_dtype(op.dtype), 1)
    work = krylov_work_bytes(dim, op.dtype, extra_vectors)
    plan = memory.current()
    fit = plan.count_that_fit(per_vector, reserve=work)
    if MAX_IN_MEMORY_BYTES is not None:
        fit = min(fit, MAX_IN_MEMORY_BYTES // per_vector)
    if fit >= steps:
        if steps * per_vector > IN_MEMORY_BASIS_BYTES:
            plan.note(
                f"Krylov basis in memory ({steps} vectors, "
                f"{memory.format_bytes(steps * per_vector)}): the memory budget holds it"
            )
        return steps, steps * per_vector + work, None
    product = plan.items.get(memory.PRODUCT_WORKSPACE, 0)
    lean = min(fit, max(RESTART_ROWS, minimum, max(BASIS_FLOOR_BYTES, product) // per_vector))
    if lean >= max(RESTART_ROWS, minimum):
        return lean, lean * per_vector + work, None
    scratch = scratch_directory()
    on_cpu = torch.device(op.device if op.device is not None else "cpu").type == "cpu"
    if on_cpu and scratch is not None:
        return _scratch_basis(plan, dim, steps, per_vector, work, minimum, scratch, lower)
    if fit < minimum:
        plan.require(
            f"a Krylov basis of {minimum} vectors of {dim:,} parameters",
            minimum * per_vector + work,
            lower,
        )
    vectors = min(steps, fit)
    return vectors, vectors * per_vector + work, None


def _scratch_basis(plan, dim, steps, per_vector, work, minimum, scratch, lower):
    """:func:`basis_room`'s out-of-core case: ``(vectors, bytes in memory, scratch)``."""
    plan.require(f"Lanczos vectors of {dim:,} parameters", work, lower)
    try:
        free = shutil.disk_usage(scratch).free
    except OSError:
        free = 0
    fit = int(free // 2 // per_vector)
    if fit < minimum:
        raise UsageError(
            f"a Krylov basis of {minimum} vectors of {dim:,} parameters needs "
            f"{memory.format_bytes(minimum * per_vector)} of disk in {scratch} (it is kept "
            f"out of memory), which has {memory.format_bytes(free)} free; point "
            "SHARP_SCRATCH (or TMPDIR) elsewhere or lower `max_matvecs`",
            source="scratch",
        )
    vectors = min(steps, fit)
    plan.note(
        f"Krylov basis in a scratch file in {scratch} (up to {vectors} vectors, "
        f"{memory.format_bytes(vectors * per_vector)} of disk), not in memory: the memory "
        "budget does not hold it"
    )
    return vectors, work, scratch


def plan_basis(op, wanted: int, returned: int, budget: int, max_basis: int | None):
    """The basis and product budget of a :func:`~sharpcli.curvature.lanczos.lanczos` run.

    A thick restart keeps the ``wanted`` Ritz vectors and needs room for two more.

    Args:
        op: the operator.
        wanted: the Ritz values asked for (both ends counted).
        returned: Ritz vectors returned or checked explicitly at the end.
        budget: the most products (``max_matvecs``).
        max_basis: the user's bound on the basis rows, if any.

    Returns:
        ``(room, held, scratch, limit)``: the basis rows the run may keep, the bytes it holds
        in memory, its scratch folder (``None``: in memory) and its product budget (past the
        dimension when the run restarts).

    Raises:
        UsageError: ``max_basis`` below 1 or too small to restart, or the basis does not fit.
    """
    dim = op.shape[0]
    if max_basis is not None and int(max_basis) < 1:
        raise UsageError(f"max basis must be >= 1, got {max_basis}", source="max_basis")
    room, held, scratch = basis_room(
        op,
        min(dim, budget),
        extra_vectors=returned,
        minimum=min(dim, budget, wanted + 2),
        lower="lower `top_k`, `batch_size` or `cache_mb`",
    )
    if max_basis is not None:
        room = min(room, int(max_basis))
    restarting = room < min(dim, budget)
    limit = budget if restarting else min(dim, budget)  # products; restarts may pass dim
    if restarting and room < wanted + 2:
        raise UsageError(
            f"a thick restart keeps the {wanted} wanted Ritz vectors and needs room for two "
            f"more, but `max_basis` is {room}; raise it or lower `top_k`",
            source="max_basis",
        )
    if restarting and max_basis is None:
        memory.current().note(
            f"Krylov basis limited to {room} vectors by the memory plan: thick-restarted Lanczos"
        )
    return room, held, scratch, limit
