"""Research scale: sharp against PyHessian on ResNet-18, GPT-2 small and a 5.3M LM.

Builds the models of ``benchmarks/scale_models.py`` by hand (no downloads), writes them as
``--model-factory`` checkpoints with seeded random data of the right shapes, and runs every
command as a whole child process on one thread, reading its CPU time (user + system) from
``os.wait4`` and its peak resident memory from outside it (GNU ``time``, :func:`measure`).
PyHessian 0.1 runs the way its users run it (``hessian(model, criterion, data=(x,
y)).eigenvalues(top_n=1)``, its defaults) in the same run. Accuracy: each top eigenvalue against a long reference run of sharp (``--eig-tol
1e-6``, residual-certified).

Cases (``--cases``, comma-separated; default all but ``medium``):

- ``resnet18``: CIFAR ResNet-18 (11.2M), 64 images 3x32x32, ``sharp eigen --top-k 1`` vs
  PyHessian, plus the reference run.
- ``gpt2``: GPT-2 small shape (124M, tied head), 4 x 64 tokens: ``eigen --top-k 1``,
  ``trace --estimator hutchinson --trace-tol 0.05`` and ``density`` (1 probe, 16 steps),
  PyHessian ``eigenvalues(top_n=1)``.
- ``lm5m``: the 5.3M LM (vocabulary 8192, d 256, 4 layers), 8 x 128 tokens: ``gn-nme`` and
  ``analyze`` (the planner picks the sampled-label Gauss-Newton estimator).
- ``growth``: ``eigen`` at P = 1M (MLP), 11M (ResNet-18), 124M (GPT-2): peak memory and
  CPU time per product, plotted to ``--plot``.
- ``medium``: GPT-2 medium shape (355M), for a device (``--device cuda``).
- ``ratio-all``: ``ratio`` for a probe-product of ``trace`` and a step of ``density`` too.
- ``converged``: GPT-2 small's lambda_max to ``sharp eigen``'s default tolerance (CPU
  seconds, products, residual) against PyHessian ``eigenvalues(top_n=1)`` at its defaults
  (``maxIter=100``, ``tol=1e-3``) in the same run: its value, products and whether it is the
  largest eigenvalue at all.
- ``ratio``: only the CPU seconds of a product inside ``eigen`` (12 products against 2)
  against the bare graph-kept HVP, on ResNet-18 and GPT-2 small.
- ``fixed``: whole runs of GPT-2 small's ``eigen`` (20 matvecs and 2) against the bare HVP:
  compute seconds over products, the 3-product run against three bare HVPs plus loading,
  the CPU seconds by phase (``timing.cpu_seconds``), peak RSS from outside; ``--trees
  /path/to/other/checkout`` runs another tree's sharp beside this one (before/after).

Usage: ``python benchmarks/bench_scale.py [--cases resnet18,gpt2] [--workdir DIR]
[--device cpu|cuda] [--plot docs/scale.png] [--budget 4944M]``; prints Markdown tables and, per
case, the CPU seconds of a product inside ``eigen`` against the bare HVP (docs/benchmarks.md,
"Research scale").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPT2_SMALL = {"vocab": 50257, "positions": 1024, "d": 768, "layers": 12, "heads": 12}
GPT2_MEDIUM = {"vocab": 50257, "positions": 1024, "d": 1024, "layers": 24, "heads": 16}
LM5M = {"vocab": 8192, "positions": 128, "d": 256, "layers": 4, "heads": 4}


def write_case(workdir: Path, name: str, factory: str, args: dict, x, y) -> tuple[Path, Path, int]:
    """Checkpoint and data file of one case; returns their paths and the parameter count."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(HERE))
    import scale_models

    from sharpcli.io.checkpoints import save_checkpoint

    model = getattr(scale_models, factory)(**args)
    ckpt, data = workdir / f"{name}.safetensors", workdir / f"{name}-data.safetensors"
    if not ckpt.exists():
        save_checkpoint(ckpt, model, {"name": f"factory:scale_models:{factory}", "args": args})
        save_file({"x": x.contiguous(), "y": y.contiguous()}, str(data))
    count = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return ckpt, data, count


TIME = "/usr/bin/time"  # GNU time: the peak RSS of its own child, read from outside it


def measure(argv: list[str], env: dict, cwd=None) -> dict:
    """Run ``argv`` as a child; its CPU seconds, peak RSS, wall seconds, exit code, stdout.

    The peak RSS is that child's alone, read by GNU ``time`` (``%M``) from outside it. The
    ``ru_maxrss`` this process's ``os.wait4`` reads is not: Linux starts an exec'd child's
    high-water mark at the resident set of the process that forked it (``vfork``: this one's
    own peak), and this process has built the largest model so far, so every later row read
    at least that (the column showed the largest model built so far, not the run). Without
    GNU time the ``wait4`` figure is kept, marked as an upper bound. CPU seconds (user +
    system) are ``wait4``'s: the child's, with GNU time's few milliseconds.
    """
    start = time.perf_counter()
    outside = os.path.exists(TIME)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as peak:  # fmt: skip
        wrapped = [TIME, "-f", "%M", "-o", peak.name, *argv] if outside else argv
        child = subprocess.Popen(wrapped, stdout=out, stderr=err, env=env, cwd=cwd)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
        lines = [ln for ln in peak.read().splitlines() if ln.strip().isdigit()]
    # GNU time exits with its child's status; a child killed by a signal leaves a line before %M
    rss = int(lines[-1]) * 1024 if outside and lines else usage.ru_maxrss * 1024
    return {
        "cpu": usage.ru_utime + usage.ru_stime,
        "user": usage.ru_utime,
        "sys": usage.ru_stime,
        "rss": rss,
        "rss_outside": bool(outside and lines),
        "wall": time.perf_counter() - start,
        "code": child.returncode,
        "out": stdout,
        "err": stderr,
    }


PYHESSIAN = """
import json, sys, time, torch
sys.path.insert(0, {here!r})
import scale_models
from safetensors.torch import load_file
from pyhessian import hessian
torch.set_num_threads(1)
model = getattr(scale_models, {factory!r})(**{args!r})
from sharpcli.io.checkpoints import load_checkpoint
model.load_state_dict(load_checkpoint({ckpt!r}).model.state_dict())
model = model.to({device!r}).eval()
data = load_file({data!r})
x, y = data["x"].to({device!r}), data["y"].to({device!r})
def criterion(out, target):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
# torch's fused CPU attention kernel has no double backward: PyHessian users must pick the
# math kernel themselves (sharp does it for them, sharpcli.curvature.products.differentiable)
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel(SDPBackend.MATH):
    h = hessian(model, criterion, data=(x, y), cuda={cuda!r})
    if {what!r} == "eigen":
        values, _ = h.eigenvalues(top_n=1, maxIter={max_iter!r})
        print(json.dumps({{"value": float(values[0])}}))
    else:
        print(json.dumps({{"value": float(sum(h.trace()) / len(h.trace()))}}))
"""


BARE_HVP = """
import json, sys, time, torch
sys.path.insert(0, {here!r})
import scale_models
from safetensors.torch import load_file
from sharpcli.io.checkpoints import load_checkpoint
torch.set_num_threads(1)
model = getattr(scale_models, {factory!r})(**{args!r})
model.load_state_dict(load_checkpoint({ckpt!r}).model.state_dict())
model = model.to({device!r}).eval()
data = load_file({data!r})
x, y = data["x"].to({device!r}), data["y"].to({device!r})
params = [p for p in model.parameters() if p.requires_grad]
loaded = time.process_time()  # the interpreter, torch, the checkpoint, the model and the data
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel(SDPBackend.MATH):
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    grads = torch.autograd.grad(loss, params, create_graph=True)
    graph = time.process_time() - loaded  # the first-order graph the products reuse
    v = [torch.randn_like(p) for p in params]
    times = []
    # on a GPU the kernels run asynchronously: wall seconds after a synchronisation
    cuda = {device!r}.startswith("cuda")
    clock = time.perf_counter if cuda else time.process_time
    for _ in range({count!r}):  # PyHessian's product: the first-order graph kept between HVPs
        torch.cuda.synchronize() if cuda else None
        start = clock()
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        torch.cuda.synchronize() if cuda else None
        times.append(clock() - start)
        # the next vector, outside the timed product: the norm once over all pieces (recomputing
        # it per piece made this benchmark's floor O(pieces x P): 4x the HVP on GPT-2 small)
        norm = sum(float((t * t).sum()) for t in hv) ** 0.5
        v = [h / norm for h in hv]
print(json.dumps({{"seconds": times, "load_cpu": loaded, "graph_cpu": graph}}))
"""


def bare_hvp(factory, args, ckpt, data, device, count=3, details=None) -> float:
    """CPU seconds (wall seconds on a GPU) of one graph-kept double-backward HVP (the median of
    ``count``), in a child on one thread: the floor a product inside ``sharp`` is measured
    against. ``details`` (a dict) receives the child's CPU seconds to load (interpreter,
    torch, checkpoint, model, data: ``load_cpu``), of its first-order graph (``graph_cpu``),
    its whole run (``cpu``) and its peak RSS (``rss``)."""
    code = BARE_HVP.format(
        here=str(HERE), factory=factory, args=args, ckpt=str(ckpt), data=str(data),
        device=device, count=count,
    )  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    # the checkpoint names its factory's module: sharp imports it from PYTHONPATH only
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    info = measure([sys.executable, "-c", code], env)
    if info["code"] != 0:
        raise SystemExit(f"bare HVP failed: {info['err'][-400:]}")
    found = json.loads(info["out"])
    times = sorted(found["seconds"])
    if details is not None:
        details.update(
            load_cpu=found["load_cpu"], graph_cpu=found["graph_cpu"], cpu=info["cpu"],
            rss=info["rss"], seconds=found["seconds"],
        )  # fmt: skip
    return times[len(times) // 2]


def per_product(
    label, argv, env, rows, few: int = 2, bound_flag="--eig-max-matvecs"
) -> float | None:
    """CPU seconds (wall seconds on a GPU) a product costs inside ``argv`` (an ``eigen``,
    ``trace`` or ``density`` run): its time less a run's with ``bound_flag`` set to ``few``,
    over the products between them, so start-up, loading and the planning pass cancel and each
    product's orthogonalisation, I/O and bookkeeping count."""
    clock = "wall" if "cuda" in argv[argv.index("--device") + 1] else "cpu"
    full = run(label, argv, env, rows)
    bound = argv.index(bound_flag) + 1
    short_argv = [*argv[:bound], str(few), *argv[bound + 1 :]]
    short = run(f"{label} (at {few})", short_argv, env, [])
    if full["report"] is None or short["report"] is None:
        return None
    extra = full["report"]["timing"]["matvecs"] - short["report"]["timing"]["matvecs"]
    return (full[clock] - short[clock]) / max(1, extra)


def print_ratio(name: str, inside: float | None, bare: float, where: str = "eigen") -> None:
    """The per-product line of a case: inside ``where`` against the bare HVP."""
    ratio = "" if inside is None else f"{inside / bare:.2f}x"
    inside_text = "failed" if inside is None else f"{inside:.2f}"
    print(f"\n{name}: seconds per product (CPU; wall on a GPU) inside {where} {inside_text}, bare "
          f"graph-kept double-backward HVP {bare:.2f}, ratio {ratio}")  # fmt: skip


def sharp(command: str, ckpt: Path, data: Path, *extra: str, device: str) -> list[str]:
    return [
        sys.executable, "-m", "sharpcli", command, str(ckpt), "--data", str(data),
        "--batch-size", "64", "--device", device, "--threads", "1", "--quiet", "--json", "-",
        *extra,
    ]  # fmt: skip


def pyhessian(factory, args, ckpt, data, device, what="eigen", max_iter=100) -> list[str]:
    code = PYHESSIAN.format(
        here=str(HERE), factory=factory, args=args, ckpt=str(ckpt), data=str(data),
        device=device, cuda=device.startswith("cuda"), what=what, max_iter=max_iter,
    )  # fmt: skip
    return [sys.executable, "-c", code]


EIGEN_RUNS: dict = {}  # case name -> its `sharp eigen --top-k 1` run, reused by `growth`
SAVED: list = []  # the workdir's file of finished eigen runs, so a later `growth` reuses them


def save_eigen_run(name: str, info: dict) -> dict:
    """Keep ``info`` as case ``name``'s eigen run, in memory and in the workdir's file."""
    EIGEN_RUNS[name] = info
    if SAVED:
        path = SAVED[0]
        runs = json.loads(path.read_text()) if path.exists() else {}
        runs[name] = {k: v for k, v in info.items() if k not in ("out", "err")}
        path.write_text(json.dumps(runs))
    return info


def run(label: str, argv: list[str], env: dict, rows: list, cwd=None) -> dict:
    info = measure(argv, env, cwd)
    if info["code"] != 0:
        print(f"{label}: exit {info['code']}: {info['err'].strip()[-400:]}", file=sys.stderr)
        info["report"] = None
    else:
        info["report"] = json.loads(info["out"])
    info["label"] = label
    rows.append(info)
    print(
        f"  {label}: {info['cpu']:.1f} CPU s, {info['rss'] / 2**30:.2f} GiB, exit {info['code']}",
        file=sys.stderr,
        flush=True,
    )
    return info


def value_of(info: dict) -> float | None:
    rep = info.get("report")
    if rep is None:
        return None
    if "value" in rep:
        return rep["value"]
    results = rep["results"]
    if "eigenvalues" in results:
        return results["eigenvalues"][0]
    if "trace" in results:
        return results["trace"]["estimate"]
    return results.get("lambda_max")


def table(title: str, rows: list, reference: float | None = None) -> None:
    print(f"\n{title}\n")
    print(
        "| run | CPU s | user s | sys s | wall s | peak RSS GiB | products | value | rel. error "
        "| exit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rep = r.get("report") or {}
        timing = rep.get("timing", {})
        value = value_of(r)
        err = abs(value - reference) / abs(reference) if value and reference else None
        print(
            f"| {r['label']} | {r['cpu']:.1f} | {r['user']:.1f} | {r['sys']:.1f} | "
            f"{r['wall']:.1f} | {r['rss'] / 2**30:.2f} | {timing.get('matvecs', '')} | "
            f"{'' if value is None else f'{value:.6g}'} | {'' if err is None else f'{err:.1e}'} | "
            f"{r['code']} |"
        )


def case_resnet18(workdir, env, device):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    ckpt, data, count = write_case(workdir, "resnet18", "resnet18", {}, x, y)
    rows: list = []
    ref = run(
        "sharp eigen --eig-tol 1e-6 (reference)",
        sharp("eigen", ckpt, data, "--eig-tol", "1e-6", device=device),
        env,
        [],
    )
    argv = sharp("eigen", ckpt, data, "--top-k", "1", "--eig-max-matvecs", "20", device=device)
    inside = per_product("sharp eigen --top-k 1 --eig-max-matvecs 20", argv, env, rows)
    run("PyHessian eigenvalues(top_n=1)", pyhessian("resnet18", {}, ckpt, data, device), env, rows)
    table(f"ResNet-18 (CIFAR), P = {count:,}, 64 images, {device}", rows, value_of(ref))
    print_ratio("ResNet-18", inside, bare_hvp("resnet18", {}, ckpt, data, device))
    return rows


def case_gpt2(
    workdir, env, device, shape=GPT2_SMALL, name="gpt2", tokens=(4, 64), products=20, budget=None
):
    """Every run bounded to ``products`` Hessian products (PyHessian's ``maxIter`` too); with
    ``budget`` (``--budget``, e.g. PyHessian's peak x 1.2) the eigen run again under
    ``--max-memory budget``."""
    import torch

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, shape["vocab"], (tokens[0], tokens[1] + 1), generator=g)
    ckpt, data, count = write_case(workdir, name, "gpt2", shape, seq[:, :-1], seq[:, 1:])
    rows: list = []
    bound = str(products)
    argv = sharp("eigen", ckpt, data, "--top-k", "1", "--eig-max-matvecs", bound, device=device)
    inside = per_product(f"sharp eigen --top-k 1 --eig-max-matvecs {bound}", argv, env, rows)
    save_eigen_run(name, rows[-1])
    if budget is not None:  # the same run under --max-memory, its peak measured outside
        tight = run(
            f"sharp eigen --top-k 1 --eig-max-matvecs {bound} --max-memory {budget}",
            [*argv, "--max-memory", budget], env, rows,
        )  # fmt: skip
        plan = (tight["report"] or {}).get("timing", {}).get("memory", {})
        print(f"  --max-memory {budget}: peak RSS {tight['rss']:,} bytes (outside), planned "
              f"peak {plan.get('planned_peak_bytes', 0):,}, budget {plan.get('budget_bytes', 0):,}",
              file=sys.stderr)  # fmt: skip
    run(
        f"PyHessian eigenvalues(top_n=1, maxIter={bound})",
        pyhessian("gpt2", shape, ckpt, data, device, max_iter=products),
        env,
        rows,
    )
    run(
        f"sharp trace --estimator hutchinson --trace-tol 0.05 --trace-max-matvecs {bound}",
        sharp(
            "trace", ckpt, data, "--estimator", "hutchinson", "--trace-tol", "0.05",
            "--trace-max-matvecs", bound, device=device,
        ),
        env,
        rows,
    )  # fmt: skip
    run(
        "sharp density --probes 1 --steps 12",
        sharp("density", ckpt, data, "--probes", "1", "--steps", "12", device=device),
        env,
        rows,
    )
    table(f"{name} shape, P = {count:,}, {tokens[0]} x {tokens[1]} tokens, {device}", rows)
    print_ratio(name, inside, bare_hvp("gpt2", shape, ckpt, data, device))
    return rows


def case_lm5m(workdir, env, device):
    import torch

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, LM5M["vocab"], (8, 129), generator=g)
    ckpt, data, count = write_case(workdir, "lm5m", "gpt2", LM5M, seq[:, :-1], seq[:, 1:])
    rows: list = []
    bounds = ["--eig-tol", "1e-2", "--trace-max-matvecs", "64"]
    for command in ("gn-nme", "analyze"):
        argv = sharp(command, ckpt, data, *bounds, device=device)
        info = run(f"sharp {command} {' '.join(bounds)}", argv, env, rows)
        rep = info.get("report")
        if rep is not None:
            res = rep["results"]
            check = res.get("ggn_trace_check") or res.get("gn_nme", {}).get("ggn_trace_check", {})
            print(f"  {command}: ggn_trace_check = {json.dumps(check)[:400]}", file=sys.stderr)
    table(f"5.3M LM (vocabulary 8192), P = {count:,}, 8 x 128 tokens, {device}", rows)
    return rows


def case_growth(workdir, env, device, plot):
    import torch

    g = torch.Generator().manual_seed(0)
    points = []
    x = torch.randn(64, 256, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    cases = [("mlp1m", "mlp", {"width": 560, "depth": 4}, x, y)]
    for name, factory, args, xs, ys in cases:
        ckpt, data, count = write_case(workdir, name, factory, args, xs, ys)
        info = run(f"{name} eigen", sharp("eigen", ckpt, data, device=device), env, [])
        points.append((count, info))
    for name in ("resnet18", "gpt2"):
        ckpt, data = workdir / f"{name}.safetensors", workdir / f"{name}-data.safetensors"
        if name not in EIGEN_RUNS:  # run the case (or its eigen) unless this workdir has it
            if not ckpt.exists():
                (case_resnet18 if name == "resnet18" else case_gpt2)(workdir, env, device)
            else:
                argv = sharp("eigen", ckpt, data, "--top-k", "1", device=device)
                save_eigen_run(name, run(f"{name} eigen", argv, env, []))
        info = EIGEN_RUNS[name]
        count = info["report"]["results"]["scope"]["numel"] if info["report"] else None
        points.append((count, info))
    print("\nGrowth with P (sharp eigen --top-k 1)\n")
    print("| P | peak RSS GiB | planned peak GiB | CPU s | products | CPU s per product |")
    print("|---|---|---|---|---|---|")
    for count, info in points:
        rep = info["report"] or {}
        timing = rep.get("timing", {})
        products = timing.get("matvecs") or 1
        planned = timing.get("memory", {}).get("planned_peak_bytes", 0)
        print(
            f"| {count:,} | {info['rss'] / 2**30:.2f} | {planned / 2**30:.2f} | "
            f"{info['cpu']:.1f} | {products} | {info['cpu'] / products:.2f} |"
        )
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
        ps = [p for p, _ in points]
        a.loglog(ps, [i["rss"] / 2**30 for _, i in points], "o-", label="peak RSS")
        a.loglog(
            ps,
            [
                (i["report"] or {}).get("timing", {}).get("memory", {}).get("planned_peak_bytes", 0)
                / 2**30
                for _, i in points
            ],
            "s--",
            label="planned",
        )
        a.set_xlabel("parameters P")
        a.set_ylabel("GiB")
        a.legend()
        a.set_title("memory of sharp eigen")
        b.loglog(
            ps,
            [
                i["cpu"] / max(1, (i["report"] or {}).get("timing", {}).get("matvecs", 1))
                for _, i in points
            ],
            "o-",
        )
        b.set_xlabel("parameters P")
        b.set_ylabel("CPU s per Hessian product")
        b.set_title("time per product")
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
    return points


def case_ratio(workdir, env, device, products=12, commands=("eigen",), models=("resnet18", "gpt2")):
    """``ratio``: a product inside ``eigen`` (``products`` against 2, default budget), and with
    ``commands`` also a probe-product inside ``trace`` (Hutchinson, its tolerance out of
    reach) and a Lanczos step inside ``density`` (1 probe), against the bare graph-kept HVP on
    ResNet-18 and GPT-2 small, without the other runs of their cases (issue acceptance: the
    per-product ratio)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    cases = [("resnet18", "resnet18", {}, x, y)]
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, GPT2_SMALL["vocab"], (4, 65), generator=g)
    cases.append(("gpt2", "gpt2", GPT2_SMALL, seq[:, :-1], seq[:, 1:]))
    bound = str(products)
    runs = {
        "eigen": (("--top-k", "1", "--eig-max-matvecs", bound), "--eig-max-matvecs", 2),
        "trace": (
            ("--estimator", "hutchinson", "--trace-tol", "1e-9", "--trace-max-matvecs", bound),
            "--trace-max-matvecs",
            4,
        ),
        "density": (("--probes", "1", "--steps", bound), "--steps", 2),
    }
    for name, factory, args, inputs, targets in cases:
        if name not in models:
            continue
        ckpt, data, _ = write_case(workdir, name, factory, args, inputs, targets)
        bare = bare_hvp(factory, args, ckpt, data, device)
        for command in commands:
            options, flag, few = runs[command]
            argv = sharp(command, ckpt, data, *options, device=device)
            label = f"{name} sharp {command} {' '.join(options)}"
            inside = per_product(label, argv, env, [], few=few, bound_flag=flag)
            print_ratio(name, inside, bare, where=command)


PHASES = ("startup", "load", "preflight", "first_graph", "products", "report")


def case_fixed(workdir, env, device, products=20, trees=(), shape=None):
    """``fixed``: whole runs of GPT-2 small (4 x 64 tokens) against the bare graph-kept HVP of
    the same checkpoint, in one run: ``sharp eigen --top-k 1`` at ``products`` matvecs and at 2
    (a 3-product run: two Lanczos steps and the residual check), their CPU seconds (user and
    system), peak RSS read from outside each child, CPU seconds by phase (the report's
    ``timing.cpu_seconds``) and the ratios of the issue's targets:

    - compute seconds over products (the run's CPU less its start-up, over ``timing.matvecs``)
      against the bare HVP (target 1.25x at 20 matvecs);
    - the 3-product run's whole CPU against three bare HVPs plus the bare child's loading (the
      interpreter, torch, the checkpoint and the data; target 1.5x).

    ``trees``: other source trees of sharp (e.g. the main branch's checkout) run the same two
    commands with their ``sharpcli`` first on the path, for a before/after in one run; a tree
    whose reports have no ``timing.cpu_seconds`` gets this tree's start-up CPU seconds.

    ``shape``: GPT-2 small's shape with these entries changed (``--fixed-shape
    d=384,layers=4,heads=6``: a 27M-parameter model that fits in 4 GiB, to iterate on).
    """
    import torch

    args = {**GPT2_SMALL, **(shape or {})}
    name = "gpt2" if not shape else "gpt2-" + "-".join(f"{k}{v}" for k, v in shape.items())
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, args["vocab"], (4, 65), generator=g)
    ckpt, data, count = write_case(workdir, name, "gpt2", args, seq[:, :-1], seq[:, 1:])
    bare_info: dict = {}
    bare = bare_hvp("gpt2", args, ckpt, data, device, count=3, details=bare_info)
    print(f"\nbare graph-kept HVP ({name}, P = {count:,}): median {bare:.2f} CPU s of "
          f"{', '.join(f'{t:.2f}' for t in bare_info['seconds'])}; loading (interpreter, torch, "
          f"checkpoint, data) {bare_info['load_cpu']:.2f} CPU s, first-order graph "
          f"{bare_info['graph_cpu']:.2f}, whole child {bare_info['cpu']:.1f} CPU s, peak RSS "
          f"{bare_info['rss'] / 2**30:.2f} GiB")  # fmt: skip
    sources = [("this tree", env)]
    for tree in trees:  # `python -m` puts its working directory first: run in the tree
        tree_env = dict(env, PYTHONPATH=os.pathsep.join([str(tree), env["PYTHONPATH"]]))
        sources.append((str(tree), tree_env))
    print(f"\nWhole runs, {name} (P = {count:,}, 4 x 64 tokens), {device}, one thread; "
          "CPU seconds (user + system)\n")  # fmt: skip
    print("| tree | matvecs bound | CPU s | user s | sys s | peak RSS GiB (outside) | "
          "planned peak GiB (report) | products | compute s / product | x bare HVP | "
          "whole run / (3 bare + loading) | " + " | ".join(PHASES) + " | lambda_max |",
          flush=True)  # fmt: skip
    print("|---" * (12 + len(PHASES)) + "|", flush=True)
    runs: list = []
    own_startup = None
    for (source, source_env), bound in [(s, b) for s in sources for b in (products, 2)]:
        argv = sharp(
            "eigen", ckpt, data, "--top-k", "1", "--eig-max-matvecs", str(bound),
            "--verbose", device=device,
        )  # fmt: skip
        cwd = None if source == "this tree" else source
        info = run(f"{source}: sharp eigen --top-k 1 --eig-max-matvecs {bound}", argv,
                   source_env, [], cwd=cwd)  # fmt: skip
        runs.append((source, bound, info))
        rep = info["report"] or {}
        if own_startup is None:
            own_startup = rep.get("timing", {}).get("cpu_seconds", {}).get("startup")
        timing = rep.get("timing", {})
        split = timing.get("cpu_seconds", {})
        matvecs = timing.get("matvecs") or 0
        startup = split.get("startup", own_startup) or 0.0
        per = (info["cpu"] - startup) / matvecs if matvecs else float("nan")
        short = f"{info['cpu'] / (3 * bare + bare_info['load_cpu']):.2f}x" if bound == 2 else ""
        phases = " | ".join(f"{split[p]:.1f}" if p in split else "" for p in PHASES)
        # the memory plan's upper bound, to hold against the peak read from outside
        planned = timing.get("memory", {}).get("planned_peak_bytes")
        planned_text = f"{planned / 2**30:.2f}" if planned else ""
        print(f"| {source} | {bound} | {info['cpu']:.1f} | {info['user']:.1f} | "
              f"{info['sys']:.1f} | {info['rss'] / 2**30:.2f} | {planned_text} | {matvecs} | {per:.2f} | "
              f"{per / bare:.2f}x | {short} | {phases} | {value_of(info)!r} |", flush=True)  # fmt: skip
    return runs


def case_converged(workdir, env, device, extra=()):
    """``converged``: time to a converged lambda_max of GPT-2 small, sharp at its defaults
    (``extra``: a method choice to compare) against PyHessian at its defaults."""
    import torch

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, GPT2_SMALL["vocab"], (4, 65), generator=g)
    ckpt, data, count = write_case(workdir, "gpt2", "gpt2", GPT2_SMALL, seq[:, :-1], seq[:, 1:])
    rows: list = []
    label = " ".join(["sharp eigen --top-k 1", *extra]).strip()
    mine = run(label, sharp("eigen", ckpt, data, "--top-k", "1", *extra, device=device), env, rows)
    theirs = run(
        "PyHessian eigenvalues(top_n=1) (maxIter=100, tol=1e-3)",
        pyhessian("gpt2", GPT2_SMALL, ckpt, data, device),
        env,
        rows,
    )
    table(f"gpt2 shape to convergence, P = {count:,}, 4 x 64 tokens, {device}", rows)
    report = mine["report"] or {}
    results, timing = report.get("results", {}), report.get("timing", {})
    top = value_of(mine)
    print(f"\nsharp: lambda_max {top}, converged {results.get('converged')}, residuals "
          f"{results.get('residuals')}, {timing.get('matvecs')} products, {mine['cpu']:.1f} CPU s, "
          f"Gram-Schmidt at {results.get('reorthogonalized')} steps")  # fmt: skip
    value = value_of(theirs)
    if value is not None and top is not None:
        verdict = (
            "the largest eigenvalue" if abs(value - top) <= 1e-2 * abs(top)
            else "NOT the largest eigenvalue" + (" (negative)" if value < 0 else "")
        )  # fmt: skip
        print(f"PyHessian: {value} in {theirs['cpu']:.1f} CPU s: {verdict}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--cases", default="resnet18,gpt2,lm5m,growth")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plot", default=None, help="PNG of the growth with P")
    parser.add_argument("--budget", default=None, help="gpt2: eigen again under --max-memory")
    parser.add_argument("--models", default="resnet18,gpt2", help="ratio-all: the models")
    parser.add_argument(
        "--commands", default="eigen,trace,density", help="ratio-all: the commands measured"
    )
    parser.add_argument(
        "--sharp-args", default="", help="converged: options added to sharp eigen (a method choice)"
    )
    parser.add_argument(
        "--trees", default="", help="fixed: other sharp source trees to run too (before/after)"
    )
    parser.add_argument(
        "--fixed-shape",
        default="",
        help="fixed: GPT-2 small's shape with entries changed, e.g. d=384,layers=4,heads=6",
    )
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sharp-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    SAVED.append(workdir / "eigen-runs.json")
    if SAVED[0].exists():
        EIGEN_RUNS.update(json.loads(SAVED[0].read_text()))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    print(f"# bench_scale on {args.device}, workdir {workdir}", flush=True)
    for case in args.cases.split(","):
        if case == "resnet18":
            case_resnet18(workdir, env, args.device)
        elif case == "gpt2":
            case_gpt2(workdir, env, args.device, budget=args.budget)
        elif case == "medium":
            case_gpt2(workdir, env, args.device, GPT2_MEDIUM, "gpt2-medium")
        elif case == "lm5m":
            case_lm5m(workdir, env, args.device)
        elif case == "growth":
            case_growth(workdir, env, args.device, args.plot)
        elif case == "ratio":
            case_ratio(workdir, env, args.device)
        elif case == "ratio-all":
            case_ratio(
                workdir, env, args.device, commands=tuple(args.commands.split(",")),
                models=tuple(args.models.split(",")),
            )  # fmt: skip
        elif case == "fixed":
            case_fixed(
                workdir, env, args.device, trees=[Path(t) for t in args.trees.split(",") if t],
                shape={k: int(v) for k, v in (e.split("=") for e in args.fixed_shape.split(",") if e)},
            )  # fmt: skip
        elif case == "converged":
            case_converged(workdir, env, args.device, tuple(args.sharp_args.split()))
        else:
            raise SystemExit(f"unknown case {case!r}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
