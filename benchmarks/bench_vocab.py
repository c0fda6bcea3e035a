"""Language-model vocabularies: one curvature product over (tokens x 50257) logits, by chunks or not.

A GPT-2-shaped causal LM built from a ``transformers`` ``GPT2Config`` (never downloaded; seeded
random weights, the output head tied to the token embedding, eager attention) with GPT-2's
vocabulary, 50257, reads ``--batch`` x ``--tokens`` random tokens (default 8 x 512: float32
logits of 823 MB). Each measurement is a whole child process on one thread: it builds the
curvature engine (:class:`sharpcli.curvature.CurvatureEngine`) under the default memory budget,
lets it plan its memory (``plan_memory``: the first batch's first-order graph, measured), and
computes ONE product of ``--what``:

- ``hvp``: the Hessian product ``H v``;
- ``ggn``: the Gauss-Newton product ``G v``;
- ``joint``: ``H v`` and ``G v`` from one pass (what ``gn-nme`` uses);
- ``gradient``: the loss and its gradient (no graph kept).

``--vocab-chunk 0`` is the engine before chunking (autograd's cross-entropy differentiated
twice); ``auto`` (the default) chunks the cross-entropy's part by rows of 16 MiB
(:mod:`sharpcli.curvature.products.softmax_chunks`). The parent reads each child's peak resident set
and CPU seconds from ``os.wait4`` (``resource.getrusage`` of the child), prints them beside
the planned peak the child's memory plan reports, the CPU seconds of the product alone, and
the relative difference of the chunked products from the unchunked ones (``<v', H v>`` for a
fixed ``v'``; float32).

``--cli`` instead runs ``sharp eigen --top-k 1 --eig-max-matvecs 4`` as a whole process on the
model written with ``save_pretrained`` (a Hugging Face folder) and the tokens in an ``.npz``,
with this checkout and, given ``--before DIR`` (a checkout of the code before chunking, e.g.
``git archive 25c0bc1 | tar -x -C DIR``), with that one: peak RSS, CPU seconds, the eigenvalue and
the report's memory notes.

Usage: ``python benchmarks/bench_vocab.py [--batch 8] [--tokens 512] [--layers 1]
[--what hvp,ggn,joint,gradient] [--chunks 0,auto] [--cli --workdir DIR [--before DIR]]``
(docs/benchmarks.md, "Language-model vocabularies").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 50257


def build_model(layers: int, d: int, heads: int, positions: int):
    """A GPT-2-shaped causal LM from ``GPT2Config`` (seed 0), returning its logits alone."""
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=positions,
        n_embd=d,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    lm = GPT2LMHeadModel(config).eval()

    class Logits(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, use_cache=False).logits

    return Logits(lm)


def child(args) -> None:
    """One measurement in this process: plan, then one product; prints a JSON line."""
    import torch

    from sharpcli import memory
    from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
    from sharpcli.losses import set_token_reduction

    torch.set_num_threads(1)
    model = build_model(args.layers, args.d, args.heads, args.tokens)
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (args.batch, args.tokens), generator=generator)
    y = torch.randint(0, VOCAB, (args.batch, args.tokens), generator=generator)
    y[:, : args.tokens // 16] = -100  # unlabelled positions (a prompt), as LM data have
    set_token_reduction("tokens", y)
    data = AnalysisData(x, y, "token-cross-entropy", args.batch)
    scope = ParamScope.resolve(model)
    v = torch.randn(scope.numel, generator=generator)
    probe = torch.randn(scope.numel, generator=generator)
    plan = memory.activate(memory.MemoryPlan.for_run())  # its baseline: model, data, v, probe
    chunk = None if args.vocab_chunk == "auto" else int(args.vocab_chunk)
    engine = CurvatureEngine(model, data, scope, cache_bytes=0, vocab_chunk=chunk)
    start = time.process_time()
    engine.plan_memory(plan)
    plan_cpu = time.process_time() - start
    results = 2 if args.what == "joint" else 1
    plan.reserve("the product's result vectors", results * v.numel() * v.element_size())
    start = time.process_time()
    if args.what == "hvp":
        products = [engine.hessian_matmat(v)]
    elif args.what == "ggn":
        products = [engine.ggn_matmat(v)]
    elif args.what == "joint":
        products = list(engine.hessian_and_ggn_matvec(v))
    else:
        products = [engine.loss_and_gradient()[1]]
    product_cpu = time.process_time() - start
    info = plan.to_dict()
    print(
        json.dumps(
            {
                "planned_peak": info["planned_peak_bytes"],
                "planned": info["planned"],
                "choices": info.get("choices", []),
                "plan_cpu": plan_cpu,
                "product_cpu": product_cpu,
                "params": scope.numel,
                "chunked": engine.chunking.rows(torch.empty(args.batch, args.tokens, VOCAB), y, 1.0)
                is not None,
                "dots": [float(probe.double() @ p.double()) for p in products],
            }
        )
    )


def cli(args, env: dict, measure) -> None:
    """``sharp eigen`` on the model as a Hugging Face folder, with this code and ``--before``."""
    import numpy as np
    import torch

    workdir = Path(args.workdir)
    folder, data = workdir / "gpt2-vocab", workdir / "gpt2-vocab-tokens.npz"
    if not folder.exists():
        build_model(args.layers, args.d, args.heads, args.tokens).lm.save_pretrained(folder)
        generator = torch.Generator().manual_seed(1)
        x = torch.randint(0, VOCAB, (args.batch, args.tokens), generator=generator)
        y = torch.randint(0, VOCAB, (args.batch, args.tokens), generator=generator)
        y[:, : args.tokens // 16] = -100
        np.savez(data, input_ids=x.numpy(), labels=y.numpy())
    print("| code | peak RSS | planned peak | CPU s | eigenvalue | products | memory notes |")
    print("|---|---|---|---|---|---|---|")
    sources = [("this checkout", str(HERE.parent))]
    if args.before:
        sources.insert(0, ("before", str(Path(args.before).resolve())))
    for label, source in sources:
        argv = [sys.executable, "-P", "-m", "sharpcli", "eigen", str(folder), "--data", str(data)]
        argv += ["--top-k", "1", "--eig-max-matvecs", "4", "--batch-size", str(args.batch)]
        argv += ["--seed", "0", "--quiet", "--json", "-"]
        run = measure(argv, {**env, "PYTHONPATH": source})
        if run["code"] != 0:
            print(f"| {label} | failed ({run['code']}): {run['err'][-300:]!r} |")
            continue
        report = json.loads(run["out"])
        plan = report["timing"]["memory"]
        print(
            f"| {label} | {run['rss'] / 2**30:.2f} GiB | {plan['planned_peak_bytes'] / 2**30:.2f}"
            f" GiB | {run['cpu']:.0f} | {report['results']['eigenvalues'][0]:.9g} "
            f"| {report['timing']['matvecs']} | {'; '.join(plan['choices'])} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--what", default="hvp,ggn,joint,gradient")
    parser.add_argument("--chunks", default="0,auto")
    parser.add_argument("--cli", action="store_true", help="time `sharp eigen` instead")
    parser.add_argument("--workdir", default=".", help="--cli: where the model and data go")
    parser.add_argument("--before", help="--cli: a checkout of the code before, run first")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--vocab-chunk", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(HERE))
    from bench_scale import measure

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    if args.cli:
        cli(args, env, measure)
        return
    logits = args.batch * args.tokens * VOCAB * 4
    print(
        f"GPT-2-shaped LM (transformers GPT2Config): vocabulary {VOCAB}, d {args.d}, "
        f"{args.layers} layer(s), {args.batch} x {args.tokens} tokens; float32 logits "
        f"{logits / 1e6:.0f} MB; one thread\n"
    )
    print(
        "| product | vocab chunk | peak RSS (child) | planned peak | CPU s (process) "
        "| CPU s (product) | rel. diff vs unchunked |"
    )
    print("|---|---|---|---|---|---|---|")
    for what in args.what.split(","):
        reference = None
        for chunk in args.chunks.split(","):
            argv = [sys.executable, __file__, "--child", "--what", what, "--vocab-chunk", chunk]
            argv += ["--batch", str(args.batch), "--tokens", str(args.tokens)]
            argv += ["--layers", str(args.layers), "--d", str(args.d), "--heads", str(args.heads)]
            run = measure(argv, env)
            if run["code"] != 0:
                print(f"| {what} | {chunk} | failed ({run['code']}): {run['err'][-300:]!r} |")
                continue
            info = json.loads(run["out"].strip().splitlines()[-1])
            dots = info["dots"]
            if reference is None:
                reference, diff = dots, "-"
            else:
                diff = "{:.1e}".format(
                    max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(reference, dots))
                )
            label = chunk if chunk != "auto" else ("auto (chunked)" if info["chunked"] else chunk)
            print(
                f"| {what} | {label} | {run['rss'] / 2**30:.2f} GiB "
                f"| {info['planned_peak'] / 2**30:.2f} GiB | {run['cpu']:.1f} "
                f"| {info['product_cpu']:.1f} | {diff} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
