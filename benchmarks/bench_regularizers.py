"""Per-epoch cost of the ``sharp train`` regularizers relative to ``--reg none``.

Runs ``python -m sharpcli train`` as whole processes (public CLI only), one process per
(regularizer, repetition). Each repetition alternates ``--reg none`` runs with
regularizer runs, ``none A B none C D none ...`` (the regularizer order reversed on
every other repetition), so every regularizer run has a ``none`` run of the same model
and data beside it and slow drifts of a shared machine's load hit both. Per run it
reads the per-epoch ``seconds`` of the JSON report's ``results.history`` and drops
epoch 1 (warm-up: allocator, lazy imports).

Reported per regularizer:

- ``median s/epoch``: median over every kept epoch of every repetition;
- ``ratio``: median over repetitions of (median kept epoch of the run) / (mean of the
  median kept epochs of the ``none`` runs on either side of it), the cost relative to
  plain training;
- ``grad evals/step``: ``results.final.grad_evals`` of the run over that of its ``none``
  run (one evaluation per plain step), the counted cost;
- ``target`` and whether the ratio meets it.

Usage (the defaults are those of docs/benchmarks.md, "Training regularizers")::

    OMP_NUM_THREADS=1 python benchmarks/bench_regularizers.py --reps 5 [--markdown out.md]

Prints a Markdown table and the exact ``sharp train`` command line of each run.

``--in-process`` instead times ``training_step`` + ``optimizer.step`` per step inside one
process (public library API) in CPU time, against hand-written floors doing the same
gradient evaluations (a plain ``loss.backward(); optimizer.step()``, a minimal SAM step, ...:
:func:`floor_steps`), every contender interleaved every 20 steps: much less noisy on a
shared machine, but without data loading and evaluation.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Budgets (epoch time / epoch time of ``--reg none``) the regularizers are held to.
TARGETS: dict[str, float] = {
    "ad": 1.1,
    "weight-noise": 1.2,
    "sam": 2.2,
    "usam": 2.2,
    "asam": 2.2,
    "nso": 2.2,
    "gp": 4.0,
    "gn-trace": 4.0,
    "hessian-trace": 4.0,
    "fa": 4.0,
}

DEFAULT_REGS = [
    "ad",
    "weight-noise",
    "sam",
    "usam",
    "asam",
    "nso",
    "gp",
    "gn-trace",
    "hessian-trace",
    "fa",
    # non-default modes, for reference
    "weight-noise:report=clean",
    "hessian-trace:mode=fd",
    "fa:mode=fd",
]


def train_command(args: argparse.Namespace, reg: str, out_dir: Path, tag: str) -> list[str]:
    """The ``sharp train`` command line of one run (``python -m sharpcli train ...``)."""
    return [
        sys.executable,
        "-m",
        "sharpcli",
        "train",
        "--data",
        args.data,
        "--model",
        args.model,
        "--width",
        str(args.width),
        "--depth",
        str(args.depth),
        "--activation",
        args.activation,
        "--batch-size",
        str(args.batch_size),
        "--epochs",
        str(args.epochs),
        "--seed",
        str(args.seed),
        "--lr",
        str(args.lr),
        "--reg",
        reg,
        "--out",
        str(out_dir / f"{tag}.safetensors"),
        "--json",
        str(out_dir / f"{tag}.json"),
    ]


def run_once(args: argparse.Namespace, reg: str, out_dir: Path, tag: str) -> dict:
    """Run one training process; return its kept epoch seconds and gradient evaluations."""
    cmd = train_command(args, reg, out_dir, tag)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    done = subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    if done.returncode != 0:
        raise SystemExit(
            f"bench: {shlex.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
        )
    report = json.loads((out_dir / f"{tag}.json").read_text())
    history = report["results"]["history"]
    seconds = [row["seconds"] for row in history[1:]]  # epoch 1 is warm-up
    return {
        "seconds": seconds,
        "median": statistics.median(seconds),
        "grad_evals": report["results"]["final"]["grad_evals"],
        "threads": report["environment"]["threads"],
    }


#: Hand-written floor of each regularizer: the minimal step doing the same gradient
#: evaluations (see :func:`floor_steps`). Unlisted specs take the floor of their name.
FLOOR_OF: dict[str, str] = {
    "none": "plain",
    "wd": "wd",
    "ad": "ad",
    "dropout": "plain",
    "weight-noise": "noise",
    "weight-noise:report=clean": "noise",
    "sam": "sam",
    "usam": "sam",
    "asam": "asam",
    "nso": "noise-pair",
    "nso:report=clean": "noise-pair",
    "gp": "double-backward",
    "gn-trace": "gn-trace",
    "gp:mode=fd": "fd-3",
    "hessian-trace": "third-order",
    "hessian-trace:mode=fd": "hessian-trace-fd",
    "fa": "third-order",
    "fa:mode=exact": "third-order",
    "hessian-trace:mode=exact": "third-order",
    "fa:mode=fd": "fd-7",
}

#: Budgets against plain training (in-process step time / plain hand-written step).
PLAIN_TARGETS: dict[str, float] = {"fa": 4.0}

#: Budget of every regularizer against its hand-written floor.
FLOOR_TARGET = 1.1


def floor_steps(model, x, y, optimizer, rho: float = 0.05, eps: float = 0.1) -> dict:
    """Hand-written minimal steps (plain torch, no sharpcli), one per cost structure:

    - ``plain``: ``loss.backward(); optimizer.step()`` (1 gradient evaluation);
    - ``wd``: the same with ``sigma^2/2 ||theta||^2`` added to the loss (1);
    - ``ad``: the same with ``sigma^2/2`` times the mean squared norm of the head's input
      (a forward hook) added to the loss (1);
    - ``noise``: one flat Gaussian draw ``U``, weights moved by ``U``, the gradient there,
      moved back by subtracting ``U`` (WP-SGD; 1);
    - ``noise-pair``: the gradients at ``theta + U`` and ``theta - U``, averaged (NSO, k = 1: 2);
    - ``sam``: SAM as in its paper [SAM] (Foret et al. 2021, Algorithm 1): gradient, ascent
      step ``e = rho g / ||g||`` (one fused norm), gradient at ``theta + e``, weights restored
      by subtracting ``e``, optimizer step (2 evaluations);
    - ``asam``: ASAM as in its paper [ASAM] (Kwon et al. 2021): SAM with the ascent step
      ``e = rho T^2 g / ||T g||``, ``T = |w| + eta`` on weight matrices (2 evaluations);
    - ``double-backward``: ``g = grad L`` with ``create_graph``, backward of
      ``L + rho ||g||`` (the gradient penalty: 1 + 2 = 3 evaluations);
    - ``gn-trace``: labels drawn from the model's softmax (``torch.multinomial``), ``g = grad
      L(yhat)`` with ``create_graph``, backward of ``L + sigma2 B ||g||^2`` (3 evaluations);
    - ``hessian-trace-fd``: ``g0 = grad L``, one flat Rademacher ``v``, ``g+-`` at
      ``theta +- s v`` (``s = eps/||v||``), the value ``v.(g+ - g-)/(2 s)`` and the gradient
      ``g0 + sigma2 ((g+ - g0) + (g- - g0)) / s^2`` (3 evaluations);
    - ``fd-3``: ``grad L`` and two gradients at ``theta +- s v`` (a central difference along a
      Rademacher ``v``: 3 evaluations);
    - ``third-order``: ``g`` with graph, ``H v`` with graph, backward of
      ``L + lambda ||H v||^2 / B`` (1 + 2 + 4 = 7 evaluations);
    - ``fd-7``: seven plain gradients at seven points (7 evaluations).
    """
    import torch
    import torch.nn.functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    batch = x.shape[0]
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    captured = {}
    head.register_forward_pre_hook(lambda module, inputs: captured.__setitem__("h", inputs[0]))
    total = sum(p.numel() for p in params)

    def loss_at():
        return F.cross_entropy(model(x), y)

    def plain():
        optimizer.zero_grad(set_to_none=True)
        loss_at().backward()
        optimizer.step()

    def wd():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_at()
        (loss + 0.5 * 1e-6 * torch.stack(torch._foreach_norm(params)).square().sum()).backward()
        optimizer.step()

    def ad():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_at()
        h = captured["h"]
        (loss + 0.5 * 0.01 * h.reshape(batch, -1).pow(2).sum(dim=1).mean()).backward()
        optimizer.step()

    def noise_draw():
        flat = torch.empty(total).normal_().mul_(0.01)
        return [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]), params)]

    def noise():
        optimizer.zero_grad(set_to_none=True)
        u = noise_draw()
        with torch.no_grad():
            torch._foreach_add_(params, u)
        loss_at().backward()
        with torch.no_grad():
            torch._foreach_sub_(params, u)
        optimizer.step()

    def noise_pair():
        optimizer.zero_grad(set_to_none=True)
        u = noise_draw()
        plus, minus = gradients_at([u, torch._foreach_neg(u)])
        for p, a, b in zip(params, plus, minus):
            p.grad = (a + b) / 2
        optimizer.step()

    def sam():
        optimizer.zero_grad(set_to_none=True)
        loss_at().backward()
        with torch.no_grad():
            grads = [p.grad for p in params]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            e = torch._foreach_mul(grads, rho / (norm + 1e-12))
            torch._foreach_add_(params, e)
        optimizer.zero_grad(set_to_none=True)
        loss_at().backward()
        with torch.no_grad():
            torch._foreach_sub_(params, e)
        optimizer.step()

    def asam(eta: float = 0.01, radius: float = 0.5):
        optimizer.zero_grad(set_to_none=True)
        loss_at().backward()
        with torch.no_grad():
            grads = [p.grad for p in params]
            scales = [p.abs() + eta if p.dim() > 1 else None for p in params]
            tg = [g if t is None else t * g for t, g in zip(scales, grads)]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tg)))
            e = [u if t is None else t * u for t, u in zip(scales, tg)]
            torch._foreach_mul_(e, radius / (norm + 1e-12))
            torch._foreach_add_(params, e)
        optimizer.zero_grad(set_to_none=True)
        loss_at().backward()
        with torch.no_grad():
            torch._foreach_sub_(params, e)
        optimizer.step()

    def gn_trace(sigma2: float = 0.01):
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        y_hat = torch.multinomial(torch.softmax(logits.detach(), dim=-1), 1).squeeze(1)
        g = torch.autograd.grad(F.cross_entropy(logits, y_hat), params, create_graph=True)
        (loss + sigma2 * batch * sum((t * t).sum() for t in g)).backward()
        optimizer.step()

    def hessian_trace_fd(sigma2: float = 0.01, eps: float = 0.1):
        optimizer.zero_grad(set_to_none=True)
        loss_at().backward()
        g0 = [p.grad for p in params]
        flat = torch.randint(0, 2, (total,), dtype=x.dtype).mul_(2).sub_(1)
        v = [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]), params)]
        s = eps / total**0.5
        plus, minus = gradients_at([torch._foreach_mul(v, s), torch._foreach_mul(v, -s)])
        value = sigma2 * torch.dot(
            flat, torch.cat([(a - b).reshape(-1) for a, b in zip(plus, minus)])
        )
        curvature = torch._foreach_sub(plus, g0)
        torch._foreach_add_(curvature, torch._foreach_sub(minus, g0))
        torch._foreach_add_(g0, curvature, alpha=sigma2 / s**2)
        optimizer.step()
        return value / (2 * s)

    def double_backward():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_at()
        g = torch.autograd.grad(loss, params, create_graph=True)
        (loss + rho * torch.sqrt(sum((t * t).sum() for t in g))).backward()
        optimizer.step()

    def gradients_at(deltas):
        out = []
        for d in deltas:
            with torch.no_grad():
                torch._foreach_add_(params, d)
            out.append(torch.autograd.grad(loss_at(), params))
            with torch.no_grad():
                torch._foreach_sub_(params, d)
        return out

    def rademacher():
        return [torch.randint(0, 2, p.shape, dtype=p.dtype).mul_(2).sub_(1) for p in params]

    def fd(points: int):
        def step():
            optimizer.zero_grad(set_to_none=True)
            loss_at().backward()
            v = torch._foreach_mul(rademacher(), eps / 100.0)
            signs = [1.0 if k % 2 == 0 else -1.0 for k in range(points - 1)]
            diffs = gradients_at([torch._foreach_mul(v, s) for s in signs])
            with torch.no_grad():
                for g in diffs:
                    torch._foreach_add_([p.grad for p in params], g, alpha=1e-6)
            optimizer.step()

        return step

    def third_order():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_at()
        g = torch.autograd.grad(loss, params, create_graph=True)
        v = rademacher()
        hv = torch.autograd.grad(
            sum((a * b).sum() for a, b in zip(g, v)), params, create_graph=True
        )
        (loss + 0.01 * sum((h * h).sum() for h in hv) / batch).backward()
        optimizer.step()

    return {
        "plain": plain,
        "wd": wd,
        "ad": ad,
        "noise": noise,
        "noise-pair": noise_pair,
        "sam": sam,
        "asam": asam,
        "double-backward": double_backward,
        "gn-trace": gn_trace,
        "hessian-trace-fd": hessian_trace_fd,
        "fd-3": fd(3),
        "third-order": third_order,
        "fd-7": fd(7),
    }


def in_process(args: argparse.Namespace) -> str:
    """Per-step CPU time inside one process: ``training_step`` + ``optimizer.step`` on one
    fixed batch, against hand-written floors (:func:`floor_steps`) doing the same gradient
    evaluations. Every contender (regularizers and floors) runs in rounds of 20 steps,
    interleaved, so load drifts hit all alike; the median per-step ``time.process_time``
    over ``7 * reps`` rounds. Cheaper and far less noisy than whole processes on a loaded
    machine; it leaves out data loading and evaluation."""
    import torch

    from sharpcli.io.data.loading import load_dataset
    from sharpcli.models import build_model, default_model_args
    from sharpcli.regularizers.registry import parse_reg
    from sharpcli.regularizers.step import training_step

    torch.set_num_threads(args.threads)
    data = load_dataset(args.data)
    x, y = data.split("train")
    x, y = x[: args.batch_size].float(), y[: args.batch_size]
    sizes = (
        {"depth": args.depth, "width": args.width} if args.model == "mlp" else {}
    )  # image models: zoo defaults
    model_args = default_model_args(
        args.model,
        tuple(data.input_shape),
        int(data.num_classes),
        activation=args.activation,
        **sizes,
    )
    torch.manual_seed(args.seed)
    model = build_model({"name": args.model, "args": model_args})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    generator = torch.Generator().manual_seed(args.seed)
    specs = ["none", *[s for s in args.regs if s != "none"]]
    regs = {spec: [parse_reg(spec)] for spec in specs}
    floors = floor_steps(model, x, y, optimizer)
    floor_of = {
        spec: FLOOR_OF.get(spec, FLOOR_OF.get(spec.split(":")[0], "plain")) for spec in specs
    }
    used_floors = [f for f in floors if f == "plain" or f in floor_of.values()]
    evals: dict[str, int] = {}

    def reg_step(spec: str):
        def step():
            evals[spec] = training_step(
                model, x, y, "cross-entropy", regs[spec], generator
            ).grad_evals
            optimizer.step()

        return step

    contenders = {**{f"floor:{f}": floors[f] for f in used_floors}}
    contenders.update({spec: reg_step(spec) for spec in specs})

    def steps(fn, n: int) -> float:
        start = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - start) / n

    for fn in contenders.values():
        steps(fn, 5)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(7 * args.reps):
        for name, fn in contenders.items():
            times[name].append(steps(fn, 20))
    med = {name: statistics.median(t) for name, t in times.items()}
    plain = med["floor:plain"]
    params = sum(p.numel() for p in model.parameters())
    lines = [
        f"Model `{args.model}` ({params:,} parameters), batch {x.shape[0]} of `{args.data}`; "
        f"CPU time per step (`time.process_time`), median of {7 * args.reps} rounds of 20 "
        "steps, every contender interleaved.",
        "",
        "| step | grad evals | median ms/step | floor | ratio to floor | ratio to plain | "
        "target | met |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for f in used_floors:
        lines.append(
            f"| floor `{f}` (hand-written) |  | {med['floor:' + f] * 1e3:.3f} |  |  | "
            f"{med['floor:' + f] / plain:.2f}x |  |  |"
        )
    for spec in specs:
        floor = floor_of[spec]
        to_floor = med[spec] / med["floor:" + floor]
        to_plain = med[spec] / plain
        checks = [f"<= {FLOOR_TARGET:g}x floor"]
        ok = to_floor <= FLOOR_TARGET
        if spec in PLAIN_TARGETS:
            checks.append(f"<= {PLAIN_TARGETS[spec]:g}x plain")
            ok = ok and to_plain <= PLAIN_TARGETS[spec]
        lines.append(
            f"| `{spec}` | {evals[spec]} | {med[spec] * 1e3:.3f} | `{floor}` | {to_floor:.2f}x | "
            f"{to_plain:.2f}x | {', '.join(checks)} | {'yes' if ok else '**no**'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regs", nargs="+", default=DEFAULT_REGS, help="regularizer specs to time")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per regularizer")
    parser.add_argument(
        "--group", type=int, default=2, help="regularizer runs between two none runs"
    )
    parser.add_argument("--data", default="blobs:n=8192,dim=64,classes=10")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--activation", default="gelu")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lr", type=float, default=0.01, help="small enough that no penalty diverges"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS unless already set")
    parser.add_argument("--markdown", type=Path, help="also write the Markdown table here")
    parser.add_argument("--raw", type=Path, help="write every run's numbers as JSON here")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="time training_step per step inside one process instead of whole runs",
    )
    args = parser.parse_args(argv)
    if args.in_process:
        table = in_process(args)
        command = (
            "OMP_NUM_THREADS="
            + os.environ.get("OMP_NUM_THREADS", str(args.threads))
            + " python benchmarks/bench_regularizers.py "
            + shlex.join(argv if argv is not None else sys.argv[1:])
        )
        text = f"Date: {_dt.date.today().isoformat()}; per step, in process.\n\n{table}\n\nBenchmark command: `{command}`"
        print(text)
        if args.markdown:
            args.markdown.write_text(text + "\n")
        return 0
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (epoch 1 is dropped as warm-up)")

    rows = []
    raw: dict = {"none": [], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-regs-") as tmp:
        out_dir = Path(tmp)
        for rep in range(args.reps):
            regs = list(args.regs) if rep % 2 == 0 else list(reversed(args.regs))
            base = [run_once(args, "none", out_dir, f"r{rep}-none0")]
            raw["none"].append(base[0])
            for j in range(0, len(regs), args.group):
                group = regs[j : j + args.group]
                results = {
                    reg: run_once(args, reg, out_dir, f"r{rep}-{j + k}")
                    for k, reg in enumerate(group)
                }
                after = run_once(args, "none", out_dir, f"r{rep}-none{j + 1}")
                raw["none"].append(after)
                for reg, res in results.items():
                    flank = [base[-1], after]
                    none_median = statistics.mean(r["median"] for r in flank)
                    none_evals = flank[0][
                        "grad_evals"
                    ]  # a plain step is 1 evaluation: the step count
                    raw["runs"].setdefault(reg, []).append(
                        {
                            **res,
                            "ratio": res["median"] / none_median,
                            "grad_evals_per_step": res["grad_evals"] / none_evals,
                        }
                    )
                    print(
                        f"rep {rep + 1}/{args.reps} {reg:28s} {res['median']:.3f} s/epoch vs none "
                        f"{none_median:.3f} -> {res['median'] / none_median:.2f}x",
                        file=sys.stderr,
                        flush=True,
                    )
                base.append(after)
        example = train_command(args, "REG", Path("OUT"), "run")

    none_epochs = [s for run in raw["none"] for s in run["seconds"]]
    none_median = statistics.median(none_epochs)
    rows.append(("none", none_median, 1.0, 1.0, None))
    for reg in args.regs:
        runs = raw["runs"][reg]
        epochs = [s for run in runs for s in run["seconds"]]
        ratio = statistics.median(run["ratio"] for run in runs)
        evals = statistics.median(run["grad_evals_per_step"] for run in runs)
        rows.append((reg, statistics.median(epochs), ratio, evals, TARGETS.get(reg)))

    threads = raw["none"][0]["threads"]
    lines = [
        f"Date: {_dt.date.today().isoformat()}; host: {platform.machine()}, {os.cpu_count()} cores "
        f"(shared); torch threads: {threads}; {args.reps} repetitions per regularizer, a none run "
        f"every {args.group} regularizer runs; "
        f"epochs 2-{args.epochs} of each run kept.",
        "",
        "| regularizer | median s/epoch | ratio to none | grad evals/step | target | met |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for reg, median, ratio, evals, target in rows:
        met = "" if target is None else ("yes" if ratio <= target else "**no**")
        target_text = "" if target is None else f"<= {target:g}x"
        lines.append(
            f"| `{reg}` | {median:.3f} | {ratio:.2f}x | {evals:.2f} | {target_text} | {met} |"
        )
    lines += [
        "",
        "Each run: `OMP_NUM_THREADS="
        + os.environ.get("OMP_NUM_THREADS", str(args.threads))
        + " python "
        + shlex.join(example[1:])
        + "` (REG the row's spec, or `none`).",
        "",
        "Benchmark command: `OMP_NUM_THREADS="
        + os.environ.get("OMP_NUM_THREADS", str(args.threads))
        + " python benchmarks/bench_regularizers.py "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        + "`",
    ]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.raw:
        args.raw.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
