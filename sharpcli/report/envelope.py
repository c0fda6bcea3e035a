"""The JSON envelope every command's report shares (docs/json.md, "The envelope").

``{"schema", "command", "version", "checkpoint", "data", "settings", "results",
"timing", "environment"}``; ``schema.json`` beside this file validates it, and
the tests validate every command's output against it.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from importlib import resources

from sharpcli import SCHEMA_ID, __version__


def environment_info(device: str = "cpu", dtype: str = "float32", world_size: int = 1) -> dict:
    """The report's ``environment`` section: Python and torch versions, device, dtype, threads and
    world size."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "world_size": world_size,
    }


def make_report(
    command: str,
    *,
    settings: dict,
    results: dict,
    checkpoint: dict | None = None,
    data: dict | None = None,
    timing: dict | None = None,
    environment: dict | None = None,
) -> dict:
    """Wrap a command's results in the versioned envelope."""
    return {
        "schema": SCHEMA_ID,
        "command": command,
        "version": __version__,
        "checkpoint": checkpoint,
        "data": data,
        "settings": settings,
        "results": results,
        "timing": timing or {"seconds": 0.0, "matvecs": 0},
        "environment": environment or environment_info(),
    }


def to_jsonable(obj):
    """Plain JSON types: tensors and numpy scalars become numbers/lists; NaN/Inf become null."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    torch = sys.modules.get("torch")  # no tensors before torch is imported
    if torch is not None and isinstance(obj, torch.Tensor):
        return to_jsonable(obj.detach().cpu().tolist())
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "shape", None) == ():
        obj = obj.item()
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return to_jsonable(obj.tolist())
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj


def dumps(report: dict) -> str:
    """``report`` as indented JSON text (no NaN or Inf), ending in a newline."""
    return json.dumps(to_jsonable(report), indent=2, allow_nan=False) + "\n"


def load_schema() -> dict:
    """The report JSON schema shipped with the package (``sharpcli/report/schema.json``)."""
    return json.loads(resources.files("sharpcli.report").joinpath("schema.json").read_text())


def validate_report(report: dict) -> None:
    """Raise ``jsonschema.ValidationError`` when ``report`` breaks the contract."""
    import jsonschema

    jsonschema.validate(to_jsonable(report), load_schema())


def lookup(report_or_results: dict, dotted: str):
    """Value at a dotted key path (``hessian.lambda_max``), searched in ``results`` first."""
    for root in (report_or_results.get("results", {}), report_or_results):
        node = root
        ok = True
        for part in dotted.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif (
                isinstance(node, list)
                and part.lstrip("-").isdigit()
                and -len(node) <= int(part) < len(node)
            ):
                node = node[int(part)]
            else:
                ok = False
                break
        if ok:
            return node
    raise KeyError(dotted)
