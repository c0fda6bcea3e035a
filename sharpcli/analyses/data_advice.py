r"""How many samples a number needs: the advisor line beside a data standard error.

A mean over N samples has a data error falling as :math:`1/\sqrt N`. From the measured
relative data error :math:`r = \mathrm{se}_{\mathrm{data}} / |t|` on N samples, the samples at
which it would reach a relative size :math:`\tau` are

.. math::

    N_\tau = \lceil N\, (r / \tau)^2 \rceil ,

(the spread per sample taken as measured; the estimate of :math:`r` itself is uncertain by
about :math:`1/\sqrt{2 (K - 1)}` for K batches). Above :data:`TOO_NOISY` the report says the
analysis set is too small for the number to mean what a reader takes it to: another sample of
the same size would give a visibly different value.
"""

from __future__ import annotations

import math

from sharpcli.curvature.products.batch_forms import combined_stderr

__all__ = [
    "DEFAULT_DATA_TOL",
    "FEW_BATCHES",
    "TOO_NOISY",
    "annotate_eigen",
    "annotate_trace",
    "data_advice",
]

#: The relative data error the eigenvalue reports size their sample advice for.
DEFAULT_DATA_TOL = 0.05
#: A relative data error above which the report warns that the set is too small.
TOO_NOISY = 0.10
#: Fewer batches than this: the data error itself is rough (relative sd 1/sqrt(2 (K - 1))).
FEW_BATCHES = 10


def data_advice(
    estimate: float, data_stderr: float | None, samples: int, data_tol: float, name: str
) -> dict | None:
    """The advice on the samples a number needs (module docstring).

    Args:
        estimate: the number.
        data_stderr: its data standard error (None: no advice).
        samples: the analysis set's samples N.
        data_tol: the relative data error wanted.
        name: the number's name in the note.

    Returns:
        ``{"relative_data_stderr", "data_tol", "samples_needed", "note"}`` (``note`` None when
        the data error is below :data:`TOO_NOISY`), or None without a data error or for a
        zero estimate.

    Example:
        >>> data_advice(10.0, 2.0, 500, 0.05, "tr(H)")["samples_needed"]  # 500 (0.2 / 0.05)^2
        8000
    """
    if data_stderr is None or estimate == 0 or not math.isfinite(estimate):
        return None
    relative = abs(data_stderr / estimate)
    needed = max(1, math.ceil(samples * (relative / data_tol) ** 2))
    note = None
    if relative > TOO_NOISY:
        note = (
            f"{name}: the data error is {relative:.0%} of the value on {samples} samples; "
            f"another sample of the same size could differ by that much (about {needed} "
            f"samples bring it to {data_tol:.0%})"
        )
    return {
        "relative_data_stderr": relative,
        "data_tol": data_tol,
        "samples_needed": needed,
        "note": note,
    }


def _batches_note(batches: int | None) -> str | None:
    """A note on a data error from too few batches to be trusted, or to exist."""
    if batches is None:
        return None
    if 2 <= batches < FEW_BATCHES:  # one batch: no data error at all (data_stderr null)
        rough = 1 / math.sqrt(2 * (batches - 1))
        return (
            f"the data error rests on {batches} batches: itself uncertain by about "
            f"{rough:.0%} (smaller batches give more)"
        )
    return None


def annotate_trace(trace: dict, name: str, data_tol: float) -> dict:
    """Add ``combined_stderr`` and ``data_advice`` to a trace's ``results.trace`` dict, and the
    advisor's notes to its ``notes``.

    Args:
        trace: :meth:`TraceResult.to_dict <sharpcli.curvature.TraceResult.to_dict>`'s dict.
        name: the quantity (``tr(H)``) in the notes.
        data_tol: the relative data error to size the sample advice for.

    Returns:
        ``trace``, updated.
    """
    trace["combined_stderr"] = combined_stderr(trace.get("stderr"), trace.get("data_stderr"))
    samples = trace.get("data_samples")
    advice = None
    if samples:
        advice = data_advice(trace["estimate"], trace.get("data_stderr"), samples, data_tol, name)
    trace["data_advice"] = advice
    notes = trace.setdefault("notes", [])
    for note in (_batches_note(trace.get("data_batches")), advice and advice["note"]):
        if note:
            notes.append(note)
    return trace


def annotate_eigen(out: dict, samples: int, name: str, data_tol: float = DEFAULT_DATA_TOL) -> dict:
    r"""Add ``combined_stderr`` (per eigenvalue: residual and data error in quadrature) and the
    largest-magnitude first eigenvalue's ``data_advice`` to an eigen result's dict.

    The residual :math:`\lVert A u - \theta u \rVert` bounds the distance from the Ritz value
    to an eigenvalue; it stands for the solver's error in the combined error.

    Args:
        out: :meth:`EigenResult.to_dict <sharpcli.curvature.EigenResult.to_dict>`'s dict.
        samples: the analysis set's samples.
        name: the operator's symbol (``H``) in the notes.
        data_tol: the relative data error to size the sample advice for.

    Returns:
        ``out``, updated.
    """
    data = out.get("data_stderr")
    if data is None:
        out["combined_stderr"], out["data_advice"] = None, None
        return out
    out["combined_stderr"] = [
        combined_stderr(r, d) for r, d in zip(out.get("residuals") or [], data)
    ]
    advice = None
    if out.get("eigenvalues"):
        advice = data_advice(out["eigenvalues"][0], data[0], samples, data_tol, f"lambda_1({name})")
    out["data_advice"] = advice
    batches = _batches_in(out.get("data_method"))
    for note in (_batches_note(batches), advice and advice["note"]):
        if note:
            out.setdefault("notes", []).append(note)
    return out


def _batches_in(method: str | None) -> int | None:
    """K of a method named ``... over K batches ...``."""
    if not method or " over " not in method:
        return None
    words = method.split(" over ", 1)[1].split()
    return int(words[0]) if words and words[0].isdigit() else None
