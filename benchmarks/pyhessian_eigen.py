"""PyHessian 0.1 on its own, as a user scripts it: the top Hessian eigenvalue of an MLP.

The contender of ``sharp eigen --top-k 1`` in ``benchmarks/bench_startup.py``: a whole
process that imports torch and PyHessian only (no sharpcli), rebuilds the MLP (``Linear``
layers at the state_dict indices ``0, 2, 4, ...`` with GELU between them, the layout of the
zoo's ``mlp``), loads its weights and the data from ``BUNDLE`` (a ``torch.save`` of
``{"state": state_dict, "x": features, "y": labels}``, read with ``weights_only=True``) and
calls ``hessian(model, CrossEntropyLoss(), data=(x, y), cuda=False).eigenvalues(maxIter=100,
tol=1e-3, top_n=1)``: PyHessian's defaults, the same relative tolerance as ``sharp eigen``'s
default ``--tol 1e-3``, one batch of the whole set.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/pyhessian_eigen.py BUNDLE.pt [--seed S] [--json OUT.json]

Prints (or writes) ``{"eigenvalue", "products", "compute_seconds"}``; ``products`` counts
PyHessian's Hessian-vector products, ``compute_seconds`` the wall time of ``hessian(...)``
and ``eigenvalues()``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import torch
from pyhessian import hessian
from torch import nn


def build_mlp(state: dict) -> nn.Sequential:
    """The MLP whose ``state_dict`` is ``state``: Linear layers at indices 0, 2, 4, ... with GELU
    between them."""
    indices = sorted({int(key.split(".")[0]) for key in state})
    layers: list[nn.Module] = []
    for position, index in enumerate(indices):
        if index != 2 * position:
            raise SystemExit(f"unexpected layer index {index}: not the zoo mlp layout")
        weight = state[f"{index}.weight"]
        layers.append(nn.Linear(weight.shape[1], weight.shape[0]))
        if position < len(indices) - 1:
            layers.append(nn.GELU())
    model = nn.Sequential(*layers)
    model.load_state_dict(state)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random start vector")
    args = parser.parse_args(argv)
    bundle = torch.load(args.bundle, weights_only=True)
    model = build_mlp(bundle["state"])
    products = 0
    module = importlib.import_module("pyhessian.hessian")
    original = module.hessian_vector_product

    def counting(*a, **k):  # one call per power-iteration step
        nonlocal products
        products += 1
        return original(*a, **k)

    module.hessian_vector_product = counting
    torch.manual_seed(args.seed)  # PyHessian's random start vector
    start = time.perf_counter()
    engine = hessian(model, nn.CrossEntropyLoss(), data=(bundle["x"], bundle["y"]), cuda=False)
    eigenvalues, _ = engine.eigenvalues(maxIter=100, tol=1e-3, top_n=1)
    seconds = time.perf_counter() - start
    out = json.dumps(
        {"eigenvalue": float(eigenvalues[0]), "products": products, "compute_seconds": seconds}
    )
    if args.json_path:
        with open(args.json_path, "w") as handle:
            handle.write(out)
    else:
        print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
