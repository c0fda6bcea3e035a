"""Peers at equal accuracy: sharp, PyHessian 0.1 and hessian-eigenthings 1.0 on ResNet-18 and GPT-2 small.

Every tool runs as its own child process on one thread; its CPU seconds (user + system) and
peak resident memory are read from outside, by ``os.wait4`` on that child (its own rusage, not
the maximum over the children so far). The models are those of ``benchmarks/bench_scale.py``
(``benchmarks/scale_models.py``, random weights, seeded random data of the right shapes, no
downloads):

- ``resnet18``: CIFAR ResNet-18 (11,173,962 parameters, BatchNorm), 64 images 3x32x32;
- ``gpt2``: GPT-2 small shape (124,439,808 parameters, tied head), 4 x 64 tokens.

Three tasks, each at one accuracy for every tool:

- ``eigen``: lambda_max to 1e-3 relative. The reference is a long tight sharp run (``sharp
  eigen --top-k 1 --eig-tol 1e-6``, residual-certified), computed once per workdir and kept in
  ``reference-<case>.json`` (``--reference`` gives it instead). sharp: ``eigen --top-k 1
  --eig-tol 1e-3`` (Lanczos, stops on the explicit residual ``||H u - theta u|| <= 1e-3
  theta``). hessian-eigenthings: ``lanczos(HessianOperator(...), k=1, max_iter=m, which="LA",
  tol=1e-3)``; it has a residual estimate (``|beta_m s_m|``, its ``converged`` flag) but no
  stopping rule, so ``m`` starts at ``--eigenthings-steps`` and grows by 4 until the flag is
  set (every try is a row). Its defaults are ``k=10``, ``max_iter=2k`` (2 steps for ``k=1``),
  ``which="LM"`` (largest *magnitude*), ``tol=1e-4``. PyHessian: ``eigenvalues(top_n=1,
  maxIter, tol)`` (power iteration; ``tol`` is the relative change between iterates, not an
  error), first at ``--pyhessian-tol`` (default its own 1e-3, ``maxIter=100``), then ten times
  tighter at each step until
  its error against the reference is at most 1e-3 (power iteration has no certificate: only the
  reference says when it got there).
- ``trace``: tr(H) to 1% relative standard error. sharp: ``trace --trace-tol 0.01`` (Hutch++,
  its default, stops on its own standard error). hessian-eigenthings: ``trace(op,
  num_matvecs=m, method="hutch++")`` (its default method; ``num_matvecs=100`` by default, no
  stopping rule), ``m`` = sharp's product count rounded up to a multiple of 3, doubled until
  its reported standard error is at most 1%. PyHessian: ``trace(maxIter, tol)`` (Hutchinson,
  stops when the running mean changes by less than ``tol``, relative to the *signed* previous
  mean, so a negative mean stops it at once); at its defaults first, then with ``tol=-1e300``
  (every probe taken) and ``maxIter`` = the probes its first run's sample variance says 1% needs (capped
  by ``--max-probes``; the row says so). Standard errors are each tool's own (sample standard
  deviation of the probes over sqrt(probes); for PyHessian computed here from the probe
  values it returns). The estimates are compared with sharp's, in units of their combined
  standard error.
- ``density``: a 12-step SLQ density from one Rademacher probe. sharp: ``density --probes 1
  --steps 12``; PyHessian: ``density(iter=12, n_v=1)`` (it calls ``torch.eig``, which torch
  removed: the child puts back a ``torch.eig`` built on ``torch.linalg.eigh``, as a user must);
  hessian-eigenthings: ``spectral_density(op, num_runs=1, lanczos_steps=12)``. The accuracy
  shown is the largest node against the reference lambda_max.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_peers.py --cases resnet18 --workdir DIR \
        [--tasks eigen,trace,density] [--timeout 3600] [--json OUT.json]
    python benchmarks/bench_peers.py --workdir DIR --from-json A.json B.json  # the tables again

``--trace-products N`` runs every trace at N products instead of to 1% (a 1% trace of an
untrained ResNet-18 takes tens of thousands of products) and reads the products 1% needs from the
standard error reached. ``--reference`` skips the reference run; ``--pyhessian-tol`` sets
PyHessian's first ``tol`` of the ladder. ``--tools`` runs only the named tools' rows (a run
split across processes); ``--budget SIZE`` adds sharp's eigen row under ``--max-memory SIZE``
(tool ``sharp --max-memory``). ``--lock FILE`` holds that file's ``flock`` around each child
only (its ``--timeout`` starts once the lock is held), so that large runs on a shared machine
take turns. ``--cases mlp,gpt2-tiny`` is a smoke run of seconds.

Needs ``pip install -c constraints.txt -e .[bench]`` (PyHessian 0.1, hessian-eigenthings
1.0.0a5). GPT-2 small rows hold 4-14 GiB each. Prints Markdown tables; progress on stderr.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPT2_SMALL = {"vocab": 50257, "positions": 1024, "d": 768, "layers": 12, "heads": 12}
EIGEN_TOL = 1e-3
TRACE_TOL = 0.01
DENSITY_STEPS = 12
BUDGETED = "sharp --max-memory"  # --budget's row; --tools names it so
TOOLS = ("sharp", BUDGETED, "hessian-eigenthings", "PyHessian")
# PyHessian's trace stops when |mean_k - mean_(k-1)| / (mean_(k-1) + 1e-6) < tol: the signed
# mean divides, so with tol=0 it stops at the second probe whenever the running mean is negative.
# A tol no quotient reaches makes it take all maxIter probes.
EVERY_PROBE = -1e300

CASES = {
    "resnet18": {"factory": "resnet18", "args": {}, "label": "CIFAR ResNet-18, 64 images 3x32x32"},
    "gpt2": {"factory": "gpt2", "args": GPT2_SMALL, "label": "GPT-2 small shape, 4 x 64 tokens"},
    # a smoke case (seconds): every child and the tables, not a measurement
    "mlp": {"factory": "mlp", "args": {"width": 64, "depth": 2}, "label": "ReLU MLP 256-64-64-10"},
    # a smoke case of the attention path (the peers' double backward through causal attention)
    "gpt2-tiny": {
        "factory": "gpt2",
        "args": {"vocab": 500, "positions": 128, "d": 64, "layers": 2, "heads": 2},
        "label": "GPT-2-shaped smoke model, 4 x 64 tokens",
    },
}


def write_case(workdir: Path, name: str) -> tuple[Path, Path, int]:
    """The case's checkpoint and data file, as ``bench_scale.py`` writes them (the same seeds)."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(HERE))
    import scale_models

    from sharpcli.io.checkpoints import save_checkpoint

    case = CASES[name]
    g = torch.Generator().manual_seed(0)
    if name == "resnet18":
        x = torch.randn(64, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
    elif name == "mlp":
        x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    else:
        seq = torch.randint(0, case["args"]["vocab"], (4, 65), generator=g)
        x, y = seq[:, :-1], seq[:, 1:]
    model = getattr(scale_models, case["factory"])(**case["args"])
    ckpt, data = workdir / f"{name}.safetensors", workdir / f"{name}-data.safetensors"
    if not ckpt.exists():
        spec = {"name": f"factory:scale_models:{case['factory']}", "args": case["args"]}
        save_checkpoint(ckpt, model, spec)
        save_file({"x": x.contiguous(), "y": y.contiguous()}, str(data))
    return ckpt, data, sum(p.numel() for p in model.parameters())


def measure(argv: list[str], env: dict, timeout: float) -> dict:
    """Run ``argv`` as a child: its own CPU seconds and peak RSS (``os.wait4``), exit code, stdout.

    Past ``timeout`` wall seconds the child is killed (exit -9) and what it used is still read.
    """
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                child.kill()
                _, status, usage = os.wait4(child.pid, 0)
                break
            time.sleep(0.5)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    return {
        "cpu": usage.ru_utime + usage.ru_stime,
        "rss": usage.ru_maxrss * 1024,
        "wall": time.perf_counter() - start,
        "code": code,
        "out": stdout,
        "err": stderr,
    }


# What every peer child does first: the model from its factory with the checkpoint's weights, the
# data, the token-mean cross-entropy, torch's math attention kernel (its fused CPU kernel has no
# double backward) and a counter of Hessian products.
PRELUDE = """
import json, math, sys, torch
sys.path.insert(0, {here!r})
import scale_models
from safetensors.torch import load_file
from sharpcli.io.checkpoints import load_checkpoint
torch.set_num_threads(1)
model = getattr(scale_models, {factory!r})(**{args!r})
model.load_state_dict(load_checkpoint({ckpt!r}).model.state_dict())
model = model.eval()
data = load_file({data!r})
x, y = data["x"], data["y"]
def criterion(out, target):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
from torch.nn.attention import SDPBackend, sdpa_kernel
math_attention = sdpa_kernel(SDPBackend.MATH)  # kept: collected, it would restore the fused kernel
math_attention.__enter__()
products = 0
params = dict(task={task!r}, **{params!r})
def stderr_of(values):
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
"""

PYHESSIAN = """
import importlib
module = importlib.import_module("pyhessian.hessian")  # the package's name is the class
original = module.hessian_vector_product
def counting(*a, **k):
    global products
    products += 1
    return original(*a, **k)
module.hessian_vector_product = counting
def eig_shim(T, eigenvectors=False):  # torch.eig is gone: the real symmetric case by eigh
    values, vectors = torch.linalg.eigh(T)
    return torch.stack([values, torch.zeros_like(values)], 1), vectors
torch.eig = eig_shim
torch.manual_seed(params["seed"])
h = module.hessian(model, criterion, data=(x, y), cuda=False)
if params["task"] == "eigen":
    values, _ = h.eigenvalues(top_n=1, maxIter=params["max_iter"], tol=params["tol"])
    out = dict(value=float(values[0]))
elif params["task"] == "trace":
    samples = h.trace(maxIter=params["max_iter"], tol=params["tol"])
    out = dict(value=sum(samples) / len(samples), stderr=stderr_of(samples), probes=len(samples),
               sample_std=stderr_of(samples) * math.sqrt(len(samples)))
else:
    nodes, weights = h.density(iter=params["steps"], n_v=1)
    out = dict(value=float(max(nodes[0])), nodes=[float(v) for v in nodes[0]])
out["products"] = products
print(json.dumps(out))
"""

EIGENTHINGS = """
import hessian_eigenthings as he
class Counting(he.HessianOperator):
    def matvec(self, v):
        global products
        products += 1
        return super().matvec(v)
op = Counting(model, [(x, y)], he.supervised_loss(criterion))
if params["task"] == "eigen":
    r = he.lanczos(op, k=1, max_iter=params["steps"], which="LA", tol=params["tol"], seed=params["seed"])
    out = dict(value=float(r.eigenvalues[0]), residual=float(r.residuals[0]),
               converged=bool(r.converged[0]), steps=r.iterations)
elif params["task"] == "trace":
    r = he.trace(op, num_matvecs=params["matvecs"], method="hutch++", seed=params["seed"])
    out = dict(value=r.estimate, stderr=r.stderr)
else:
    r = he.spectral_density(op, num_runs=1, lanczos_steps=params["steps"], seed=params["seed"])
    nodes = [float(v) for v in r.raw_eigenvalues[0] if v == v]
    out = dict(value=max(nodes), nodes=nodes)
out["products"] = products
print(json.dumps(out))
"""


class Bench:
    """One case's runs: the child processes, their rows and the reference."""

    def __init__(
        self, name: str, workdir: Path, timeout: float, max_probes: int, lock: str | None = None
    ) -> None:
        self.name = name
        self.lock = lock
        self.workdir = workdir
        self.timeout = timeout
        self.max_probes = max_probes
        self.ckpt, self.data, self.count = write_case(workdir, name)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        # the checkpoint names its factory's module: sharp imports it from PYTHONPATH only
        self.env["PYTHONPATH"] = os.pathsep.join([str(HERE), self.env.get("PYTHONPATH", "")])
        self.rows: list[dict] = []
        self.reference: float | None = None
        self.tools = TOOLS
        self.budget: str | None = None

    def sharp(self, command: str, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "sharpcli", command, str(self.ckpt), "--data", str(self.data),
            "--batch-size", "64", "--threads", "1", "--quiet", "--json", "-", *extra,
        ]  # fmt: skip

    def peer(self, script: str, task: str, **params) -> list[str]:
        case = CASES[self.name]
        code = PRELUDE.format(
            here=str(HERE), factory=case["factory"], args=case["args"], ckpt=str(self.ckpt),
            data=str(self.data), task=task, params=params,
        )  # fmt: skip
        return [sys.executable, "-c", code + script]

    def run(self, task: str, tool: str, label: str, argv: list[str], keep: bool = True) -> dict:
        if tool not in self.tools and task != "reference":  # --tools: the others' rows only
            return {"result": None, "skipped": True}
        wait = self.timeout
        if self.lock:  # the lock is held for this child only; its time limit starts once held
            limit = f"{self.timeout:.0f}"
            argv = ["flock", self.lock, "timeout", "--kill-after=30", limit, *argv]
            wait = self.timeout + 4 * 3600  # the outer limit also waits for the lock
        info = measure(argv, self.env, wait)
        info.update(task=task, tool=tool, label=label, result=None)
        if info["code"] == 0:
            report = json.loads(info["out"])
            info["result"] = report["results"] if "results" in report else report
            if "timing" in report:
                info["result"]["products"] = report["timing"]["matvecs"]
        else:
            tail = info["err"].strip()[-600:]
            print(f"  {label}: exit {info['code']}: {tail}", file=sys.stderr)
        print(
            f"  [{self.name}] {label}: {info['cpu']:.1f} CPU s, {info['rss'] / 2**30:.2f} GiB, "
            f"exit {info['code']}, {json.dumps(summary(info))[:300]}",
            file=sys.stderr,
            flush=True,
        )
        info.pop("out")
        info.pop("err")
        if keep:
            self.rows.append(info)
        return info

    # -- the reference ------------------------------------------------------------------------
    def ensure_reference(self, given: float | None, note: str | None = None) -> None:
        path = self.workdir / f"reference-{self.name}.json"
        if given is not None:
            self.reference = given
            self.reference_note = note or f"{given:.7g}, given by --reference"
            return
        if not path.exists():
            info = self.run(
                "reference", "sharp", "sharp eigen --top-k 1 --eig-tol 1e-6 (reference)",
                self.sharp("eigen", "--top-k", "1", "--eig-tol", "1e-6"), keep=False,
            )  # fmt: skip
            if info["result"] is None:
                raise SystemExit("the reference run failed")
            res = info["result"]
            saved = {
                "value": res["eigenvalues"][0], "residual": res["residuals"][0],
                "converged": res["converged"][0], "products": res["products"],
                "cpu": info["cpu"], "rss": info["rss"],
                "date": _dt.date.today().isoformat(),
            }  # fmt: skip
            path.write_text(json.dumps(saved))
        saved = json.loads(path.read_text())
        self.reference = saved["value"]
        self.reference_note = (
            f"sharp eigen --top-k 1 --eig-tol 1e-6: {saved['value']:.7g}, residual "
            f"{saved['residual']:.2g}, {saved['products']} products, {saved['cpu']:.0f} CPU s"
        )

    def error(self, value: float | None) -> float | None:
        if value is None or self.reference is None:
            return None
        return abs(value - self.reference) / abs(self.reference)

    # -- the tasks ----------------------------------------------------------------------------
    def eigen(
        self, eigenthings_steps: int, pyhessian_tol: float, eigenthings_last: int | None = None
    ) -> None:
        """lambda_max rows: sharp to its residual, hessian-eigenthings from ``eigenthings_steps``
        steps growing by 4 (to ``eigenthings_last``, default 24 more) until its flag is set, and
        PyHessian down its ladder of ``tol`` (see the module's docstring)."""
        if eigenthings_last is None:
            eigenthings_last = eigenthings_steps + 24
        self.run(
            "eigen", "sharp", f"sharp eigen --top-k 1 --eig-tol {EIGEN_TOL:g}",
            self.sharp("eigen", "--top-k", "1", "--eig-tol", f"{EIGEN_TOL:g}"),
        )  # fmt: skip
        if self.budget:  # the same run held to a memory budget (PyHessian's peak, say)
            self.run(
                "eigen", BUDGETED,
                f"sharp eigen --top-k 1 --eig-tol {EIGEN_TOL:g} --max-memory {self.budget}",
                self.sharp("eigen", "--top-k", "1", "--eig-tol", f"{EIGEN_TOL:g}",
                           "--max-memory", self.budget),
            )  # fmt: skip
        steps = eigenthings_steps
        while True:
            info = self.run(
                "eigen", "hessian-eigenthings",
                f'lanczos(k=1, max_iter={steps}, which="LA", tol={EIGEN_TOL:g})',
                self.peer(EIGENTHINGS, "eigen", steps=steps, tol=EIGEN_TOL, seed=0),
            )  # fmt: skip
            res = info["result"]
            if res is None or res["converged"] or steps >= eigenthings_last:
                break
            steps += 4
        tol = pyhessian_tol
        while True:
            info = self.run(
                "eigen", "PyHessian", f"eigenvalues(top_n=1, maxIter=100, tol={tol:g})",
                self.peer(PYHESSIAN, "eigen", max_iter=100, tol=tol, seed=0),
            )  # fmt: skip
            err = self.error((info["result"] or {}).get("value"))
            # err > 0.5: power iteration settled on another eigenvalue (the largest magnitude,
            # negative on GPT-2 small); a tighter tol converges further to that one
            if err is None or err <= EIGEN_TOL or err > 0.5 or tol <= 1e-6:
                break
            tol /= 10

    def trace(self, cap: int | None) -> None:
        """Each tool to a 1% standard error; with ``cap`` (``--trace-products``), each at that
        many products instead, and the products 1% needs read from the standard error reached
        (it falls as one over the square root of the probes: ``cap * (stderr / 1%)^2``)."""
        bound = ["--trace-max-matvecs", str(cap)] if cap else []
        mine = self.run(
            "trace", "sharp", " ".join(["sharp trace --trace-tol 0.01", *bound]) + " (Hutch++)",
            self.sharp("trace", "--trace-tol", f"{TRACE_TOL:g}", *bound),
        )  # fmt: skip
        used = (mine["result"] or {}).get("products") or 99
        matvecs = 3 * math.ceil((cap or used) / 3)
        for _ in range(1 if cap else 3):
            info = self.run(
                "trace", "hessian-eigenthings", f'trace(num_matvecs={matvecs}, method="hutch++")',
                self.peer(EIGENTHINGS, "trace", matvecs=matvecs, seed=0),
            )  # fmt: skip
            res = info["result"]
            if res is None or res["stderr"] <= TRACE_TOL * abs(res["value"]):
                break
            matvecs *= 2
        if cap:
            self.run(
                "trace", "PyHessian", f"trace(maxIter={cap}, tol={EVERY_PROBE:g})",
                self.peer(PYHESSIAN, "trace", max_iter=cap, tol=EVERY_PROBE, seed=0),
            )  # fmt: skip
            return
        first = self.run(
            "trace", "PyHessian", "trace(maxIter=100, tol=1e-3) (its defaults)",
            self.peer(PYHESSIAN, "trace", max_iter=100, tol=1e-3, seed=0),
        )  # fmt: skip
        res = first["result"]
        if res is None or res["stderr"] <= TRACE_TOL * abs(res["value"]):
            return
        needed = math.ceil((res["sample_std"] / (TRACE_TOL * abs(res["value"]))) ** 2)
        probes = min(needed, self.max_probes)
        info = self.run(
            "trace", "PyHessian", f"trace(maxIter={probes}, tol={EVERY_PROBE:g})",
            self.peer(PYHESSIAN, "trace", max_iter=probes, tol=EVERY_PROBE, seed=1),
        )  # fmt: skip
        info["needed"] = needed

    def density(self) -> None:
        steps = DENSITY_STEPS
        self.run(
            "density", "sharp", f"sharp density --probes 1 --steps {steps}",
            self.sharp("density", "--probes", "1", "--steps", str(steps)),
        )  # fmt: skip
        self.run(
            "density", "hessian-eigenthings", f"spectral_density(num_runs=1, lanczos_steps={steps})",
            self.peer(EIGENTHINGS, "density", steps=steps, seed=0),
        )  # fmt: skip
        self.run(
            "density", "PyHessian", f"density(iter={steps}, n_v=1) (torch.eig shimmed)",
            self.peer(PYHESSIAN, "density", steps=steps, seed=0),
        )  # fmt: skip


def summary(info: dict) -> dict:
    """The value, its accuracy figure and the products of a row, from any tool's result."""
    res = info.get("result")
    if res is None:
        return {}
    if info["task"] in ("eigen", "reference"):
        if "eigenvalues" in res:
            return {
                "value": res["eigenvalues"][0], "residual": res["residuals"][0],
                "converged": res["converged"][0], "products": res["products"],
            }  # fmt: skip
        return {k: res.get(k) for k in ("value", "residual", "converged", "products")}
    if info["task"] == "trace":
        if "trace" in res:
            return {
                "value": res["trace"]["estimate"], "stderr": res["trace"]["stderr"],
                "products": res["products"], "converged": res["trace"].get("converged"),
            }  # fmt: skip
        return {k: res.get(k) for k in ("value", "stderr", "products", "probes")}
    value = res.get("lambda_max", res.get("value"))
    return {"value": value, "products": res.get("products")}


def table(bench: Bench) -> None:
    print(f"\n### {CASES[bench.name]['label']}, P = {bench.count:,} (CPU, one thread)\n")
    print(f"Reference lambda_max: {bench.reference_note}.\n")
    print("| task | tool | call | value | accuracy | products | CPU s | peak RSS GiB | exit |")
    print("|---|---|---|---|---|---|---|---|---|")
    sharp_trace = next(
        (summary(r) for r in bench.rows if r["task"] == "trace" and r["tool"] == "sharp"), {}
    )
    for r in bench.rows:
        s = summary(r)
        value = s.get("value")
        acc = ""
        if r["task"] == "eigen" and value is not None:
            acc = f"rel. error {bench.error(value):.1e}"
            if s.get("residual") is not None:
                kind = "residual estimate" if r["tool"] == "hessian-eigenthings" else "residual"
                acc += f"; {kind} {s['residual'] / abs(value):.1e} rel."
                acc += " (converged)" if s.get("converged") else " (not converged)"
        elif r["task"] == "trace" and value is not None:
            acc = f"rel. stderr {s['stderr'] / abs(value):.2%}"
            if r["tool"] != "sharp" and sharp_trace.get("value") is not None:
                z = (value - sharp_trace["value"]) / math.hypot(s["stderr"], sharp_trace["stderr"])
                acc += f"; {z:+.1f} combined stderr from sharp's"
            if r.get("needed") and r["needed"] > (s.get("probes") or 0):
                acc += f"; 1% needs about {r['needed']} probes, capped"
            elif s["stderr"] > TRACE_TOL * abs(value) and s.get("products"):
                # the standard error falls as one over the square root of the products; the
                # CPU time is this run's seconds a product (its fixed costs included) times those
                needed = s["products"] * (s["stderr"] / (TRACE_TOL * abs(value))) ** 2
                hours = needed * r["cpu"] / s["products"] / 3600
                acc += f"; 1% needs about {needed:.3g} products, {hours:.3g} CPU h"
        elif r["task"] == "density" and value is not None:
            acc = f"top node rel. error {bench.error(value):.1e}"
        shown = "" if value is None else f"{value:.6g}"
        print(
            f"| {r['task']} | {r['tool']} | `{r['label']}` | {shown} | {acc} | "
            f"{s.get('products', '')} | {r['cpu']:.1f} | {r['rss'] / 2**30:.2f} | {r['code']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="resnet18,gpt2")
    parser.add_argument("--tasks", default="eigen,trace,density")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--reference", type=float, default=None, help="lambda_max, not computed")
    parser.add_argument(
        "--reference-note", default=None, help="how --reference was certified (the tables say)"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="wall seconds per child")
    parser.add_argument("--max-probes", type=int, default=400, help="PyHessian's trace at most")
    parser.add_argument("--eigenthings-steps", type=int, default=16, help="its first max_iter")
    parser.add_argument(
        "--eigenthings-max-steps", type=int, default=None, help="its last max_iter (first + 24)"
    )
    parser.add_argument(
        "--lock", default=None, help="flock this file around each child only (a shared machine)"
    )
    parser.add_argument(
        "--pyhessian-tol", type=float, default=1e-3, help="its first tol (its default 1e-3)"
    )
    parser.add_argument(
        "--trace-products", type=int, default=None,
        help="every trace at this many products; 1%% extrapolated from the stderr reached",
    )  # fmt: skip
    parser.add_argument(
        "--budget", default=None, help="eigen: sharp again under --max-memory BUDGET (e.g. 1931M)"
    )
    parser.add_argument("--tools", default=",".join(TOOLS), help="run only these tools' rows")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument(
        "--from-json", nargs="+", default=None, help="print the tables of earlier --json runs"
    )
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sharp-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        merged: dict = {}
        for path in args.from_json:
            for name, saved in json.loads(Path(path).read_text()).items():
                merged.setdefault(name, {**saved, "rows": []})["rows"] += saved["rows"]
        for name, saved in merged.items():
            bench = Bench(name, workdir, args.timeout, args.max_probes)
            bench.reference = saved["reference"]
            bench.reference_note = saved.get(
                "reference_note", f"{bench.reference:.7g}, given by --reference"
            )
            if args.reference is not None:  # a reference computed after the rows ran
                bench.reference = args.reference
                bench.reference_note = args.reference_note or f"{args.reference:.7g}, given"
            order = {"eigen": 0, "density": 1, "trace": 2}
            bench.rows = sorted(saved["rows"], key=lambda r: order.get(r["task"], 3))
            table(bench)
        return
    import hessian_eigenthings
    import torch

    print(
        f"# bench_peers {_dt.date.today().isoformat()}: torch {torch.__version__}, "
        f"hessian-eigenthings {hessian_eigenthings.__version__}, pyhessian 0.1, workdir {workdir}"
    )
    everything = {}
    for name in args.cases.split(","):
        bench = Bench(name, workdir, args.timeout, args.max_probes, args.lock)
        bench.ensure_reference(args.reference, args.reference_note)
        bench.tools = tuple(args.tools.split(","))
        bench.budget = args.budget
        for task in args.tasks.split(","):
            if task == "eigen":
                bench.eigen(args.eigenthings_steps, args.pyhessian_tol, args.eigenthings_max_steps)
            elif task == "trace":
                bench.trace(args.trace_products)
            elif task == "density":
                bench.density()
            else:
                raise SystemExit(f"unknown task {task!r}")
            if args.json_path:
                everything[name] = {
                    "reference": bench.reference, "reference_note": bench.reference_note,
                    "rows": bench.rows,
                }  # fmt: skip
                Path(args.json_path).write_text(json.dumps(everything, indent=1))
        table(bench)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
