"""The CLI as people use it: tables at 80 and 60 columns never fold a number, help and usage
errors never import torch, --threads, --fail-if checked before any work, bare ``sharp`` and
``--debug`` after the command."""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import typer
from cli_helpers import assert_one_line_error, run_cli, run_in_process
from rich.console import Console

from sharpcli.cli import runner
from sharpcli.report.tables import fmt

DATA = "blobs:n=160"
WIDTHS = (80, 60)


# ----------------------------------------------------------------------------- start-up
_STARTUP = r"""
import contextlib, io, json, sys
from sharpcli.cli.app import main
heavy = ("torch", "pandas", "matplotlib")
seen = {}
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code
    seen[" ".join(argv)] = [code, len(out.getvalue()), [m for m in heavy if m in sys.modules]]
print(json.dumps(seen))
"""


def test_help_version_and_usage_errors_import_no_torch_pandas_or_matplotlib():
    """Help, version and usage errors answer without the heavy imports (docs/benchmarks.md,
    "Start-up"): checked on ``sys.modules`` in a fresh interpreter, not by timing."""
    argvs = [
        [],
        ["--help"],
        ["--version"],
        ["eigen", "--help"],
        ["train", "--help"],
        ["sweep", "--help"],
        ["compare", "--help"],
        ["analyze", "--bogus"],
        ["eigen"],
        ["no-such-command"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _STARTUP, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    for argv in argvs:
        code, printed, heavy = seen[" ".join(argv)]
        assert heavy == [], (argv, heavy)
        assert code == (
            2 if argv in (["analyze", "--bogus"], ["eigen"], ["no-such-command"]) else 0
        )
        if code == 0:
            assert printed > 0, argv


_CURVATURE_IMPORTS = r"""
import contextlib, io, json, sys
import torch
from sharpcli.cli.app import main
from sharpcli.io.checkpoints import save_checkpoint
from sharpcli.models import build_model

spec = {"name": "mlp", "args": {"in_features": 2, "num_classes": 3, "depth": 1, "width": 8,
                                "activation": "gelu"}}
torch.manual_seed(0)
save_checkpoint(sys.argv[1], build_model(spec), spec, data_spec="blobs:n=60,dim=2,classes=3")
seen = {}
for command in ("eigen", "trace"):
    report = sys.argv[1] + "." + command + ".json"
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main([command, sys.argv[1], "-q", "--json", report])
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
    heavy = [m for m in ("pandas", "pyarrow", "sympy") if m in sys.modules]
    seen[command] = [json.load(open(report))["results"], heavy]
print(json.dumps(seen))
"""


def test_curvature_commands_import_no_pandas_pyarrow_or_sympy(tmp_path):
    """``eigen`` and ``trace`` on built-in data import neither pandas/pyarrow (only tables
    need them) nor sympy (torch imports it for ``autograd.grad(..., grad_outputs=...)``,
    which the products avoid on CPU): about 1 s of start-up (docs/benchmarks.md,
    "Start-up"). ``gn-nme``'s sampled-label trace still meets sympy through ``torch.func``."""
    proc = subprocess.run(
        [sys.executable, "-c", _CURVATURE_IMPORTS, str(tmp_path / "m.safetensors")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout)
    for command, (results, heavy) in seen.items():
        assert heavy == [], (command, heavy)
    assert seen["eigen"][0]["eigenvalues"][0] > 0
    assert seen["trace"][0]["trace"]["estimate"] > 0


def test_operator_help_is_the_catalogue_s():
    """--operator's help is made from the catalogue (no copy), torch-free."""
    import sharpcli.cli.app  # noqa: F401  (registers the commands; cmd_* import it)
    from sharpcli import catalogue
    from sharpcli.cli import cmd_spectrum

    assert cmd_spectrum._operator_help() == catalogue.operator_help() + "."
    shown = catalogue.operator_help()
    # each declared operator, in the registry's order, with its symbol and its declared summary
    places = [shown.index(f"{e.name} ({e.info['symbol']}: {e.summary})") for e in (
        catalogue.OPERATORS.entry(name) for name in catalogue.OPERATORS.names()
    )]  # fmt: skip
    assert places == sorted(places) and places[0] == 0


# ----------------------------------------------------------------------------- bare sharp, --debug
def test_bare_sharp_prints_help_and_exits_0(capsys):
    run = run_cli(capsys)
    assert run.code == 0 and "Usage" in run.out and "eigen" in run.out
    assert run.err == ""


def test_debug_after_the_command_shows_the_traceback(capsys, tmp_path):
    missing = str(tmp_path / "missing.safetensors")
    plain = run_cli(capsys, "eigen", missing)
    assert_one_line_error(plain, 2, "no such file")
    for args in (("--debug", "eigen", missing), ("eigen", missing, "--debug")):
        run = run_cli(capsys, *args)
        assert run.code == 2 and "Traceback" in run.err, args
        assert run.err.strip().splitlines()[-1] == plain.err.strip(), args


# ----------------------------------------------------------------------------- tiny runs
class _TwoWidths:
    """Stands in for the table console: renders everything at every width of WIDTHS."""

    def __init__(self):
        self.consoles = {
            w: Console(file=io.StringIO(), width=w, highlight=False, color_system=None)
            for w in WIDTHS
        }

    def print(self, *args, **kwargs):
        for console in self.consoles.values():
            console.print(*args, **kwargs)

    def text(self, width: int) -> str:
        return self.consoles[width].file.getvalue()

    @contextlib.contextmanager
    def capture(self):
        """As ``Console.capture``: the commands print tables into it; here they stay in the
        consoles above, and what the caller writes to stdout is empty."""
        yield _NothingCaptured()


class _NothingCaptured:
    def get(self) -> str:
        return ""


def _commands(folder) -> dict[str, tuple[str, ...]]:
    ckpt = str(folder / "m.safetensors")
    small = ("--max-matvecs", "20", "--tol", "0.5")
    return {
        "train": (
            "train",
            "--data",
            DATA,
            "--width",
            "8",
            "--epochs",
            "2",
            "--track",
            "trace,eigen",
            "--track-samples",
            "32",
            "--out",
            ckpt,
        ),
        "eigen": ("eigen", ckpt, "--top-k", "2"),
        "trace": ("trace", ckpt, *small),
        "gn-nme": ("gn-nme", ckpt, *small),
        "density": ("density", ckpt, "--probes", "1", "--steps", "8"),
        "analyze": (
            "analyze",
            ckpt,
            *small,
            "--metrics",
            "eigen,trace,frobenius,gn-nme,activation-stats,sharpness,pac-bayes,fisher-rao",
            "--fail-if",
            "hessian.lambda_max > 0.001",
            "--fail-if",
            "accuracy < 0",
        ),
        "activation-stats": ("activation-stats", ckpt),
        "weight-rescale": (
            "weight-rescale",
            ckpt,
            "--trace-max-matvecs",
            "10",
            "--trace-tol",
            "0.5",
        ),
        "bound-check": (
            "bound-check",
            ckpt,
            "--perturbations",
            "2",
            "--bootstrap",
            "20",
            "--mc-samples",
            "4",
            "--noise-pairs",
            "2",
            "--trace-max-matvecs",
            "10",
            "--check",
            "theorem2,noise-stability",
        ),
        "sweep": (
            "sweep",
            "--reg",
            "ad",
            "--grid",
            "sigma=0.01,0.1",
            "--data",
            DATA,
            "--width",
            "8",
            "--epochs",
            "1",
            "--metrics",
            "eigen,trace",
            "--analyze-samples",
            "32",
            "--out-dir",
            str(folder / "sweep"),
        ),
        "compare": ("compare", str(folder / "train.json"), str(folder / "analyze.json")),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every command on tiny data, in order: ``{name: (exit code, report, {width: text})}``."""
    folder = tmp_path_factory.mktemp("usability")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, args in _commands(folder).items():
            shown: list[_TwoWidths] = []
            mp.setattr(
                runner, "table_console", lambda shown=shown: shown.append(_TwoWidths()) or shown[-1]
            )
            report_path = folder / f"{name}.json"
            run = run_in_process(*args, "--json", str(report_path))
            assert run.code in (0, 1), (name, run.err)
            (tables,) = shown
            out[name] = (
                run.code,
                json.loads(report_path.read_text()),
                {w: tables.text(w) for w in WIDTHS},
            )
    out["_folder"] = folder
    return out


# JSON numbers each command's tables show: (significant digits, paths in ``results``; "*" is
# any key or index).
SHOWN = {
    "train": [
        (6, "history.*.train_loss history.*.train_accuracy history.*.test_loss"),
        (6, "history.*.test_accuracy history.*.grad_evals history.*.tracked.*"),
        (3, "history.*.seconds"),
        (6, "final.*"),
    ],
    "eigen": [(8, "eigenvalues.*"), (3, "residuals.*")],
    "trace": [(6, "trace.estimate trace.stderr trace.matvecs by_layer.*.estimate")],
    "gn-nme": [
        (6, "*.trace.estimate *.lambda_max *.lambda_min *.frobenius_sq"),
        (3, "*.trace.stderr"),
        (6, "nme_share nme_frobenius_ratio ggn_trace_check.* layers.*.*"),
    ],
    "density": [(6, "lambda_min lambda_max trace_estimate trace_stderr sigma matvecs")],
    "analyze": [
        (6, "loss accuracy hessian.lambda_max hessian.trace hessian.trace_stderr"),
        (6, "hessian.frobenius_sq hessian.lambda_min ggn.* nme.* nme_share gates.*.value"),
    ],
    "activation-stats": [
        (6, "layers.*.outputs layers.*.activation_frequency layers.*.death_frequency"),
        (6, "layers.*.activation_frequency_including_dead layers.*.dead_outputs"),
        (6, "layers.*.mean_sq_norm output.* penultimate_sq_norm input_jacobian_fro"),
        (6, "input_jacobian_fro_softmax"),
    ],
    "weight-rescale": [
        (6, "rows.*.alpha rows.*.accuracy rows.*.loss rows.*.max_logit_change"),
        (6, "rows.*.lambda_max rows.*.trace rows.*.trace_stderr rows.*.invariant_lambda_max"),
        (6, "baseline.lambda_max baseline.trace baseline.invariant_lambda_max"),
    ],
    "bound-check": [
        (6, "rows.*.sigma rows.*.H rows.*.epsilon rows.*.bound rows.*.empirical"),
        (6, "rows.*.plain_lambda_max rows.*.ratio rows.*.epsilon_region rows.*.bound_region"),
        (6, "theorem2.*.cross_entropy theorem2.*.smoothed_cross_entropy theorem2.*.bound"),
        (6, "theorem2.*.taylor theorem2.*.fraction_holds theorem2.*.min_margin"),
        (6, "noise_stability.rows.*.gap noise_stability.rows.*.gap_stderr"),
        (6, "noise_stability.rows.*.gap_control_variate noise_stability.rows.*.predicted"),
        (6, "noise_stability.rows.*.relative_error noise_stability.rows.*.taylor_residual"),
        (6, "noise_stability.rows.*.relative_error_plain"),
    ],
    "sweep": [
        (6, "summary.*.sigma summary.*.test_accuracy_* summary.*.lambda_max_* summary.*.trace_*")
    ],
    "compare": [(6, "rows.*.train_accuracy rows.*.loss rows.*.lambda_max rows.*.trace")],
}


def _numbers(node, parts: list[str]):
    """The numbers at a dotted path (each part a glob: "*" any key or index)."""
    if not parts:
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            yield node
        return
    head, rest = parts[0], parts[1:]
    if isinstance(node, list):
        items = list(enumerate(node))
    elif isinstance(node, dict):
        items = list(node.items())
    else:
        return
    for key, value in items:
        key = str(key)
        if fnmatch.fnmatchcase(key, head):
            yield from _numbers(value, rest)


def _cells(text: str) -> list[list[list[str]]]:
    """The body rows of every table in ``text``: per table, per line, the stripped cells."""
    tables, body = [], None
    for line in text.splitlines():
        if line.startswith("┡"):
            body = []
        elif line.startswith("└") and body is not None:
            tables.append(body)
            body = None
        elif line.startswith("│") and body is not None:
            body.append([c.strip() for c in line.strip().strip("│").split("│")])
    return tables


@pytest.mark.parametrize("name", list(SHOWN))
@pytest.mark.parametrize("width", WIDTHS)
def test_tables_never_fold_a_number(runs, name, width):
    """Every number the tables show appears whole, formatted as the table does; no table is
    wider than the console, no header or cell wraps onto a second line, no number is cut."""
    _, report, texts = runs[name]
    text = texts[width]
    assert text.strip(), name
    assert max(len(line) for line in text.splitlines()) <= width
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("┏"):  # one header line, then the rule
            assert lines[i + 2].startswith("┡"), (name, width, lines[i : i + 4])
    tables = _cells(text)
    assert tables, name
    shown_cells = set()
    for rows in tables:
        for cells in rows:
            assert cells[0] != "" or not any(cells[1:]), (name, width, "wrapped row", cells)
            for cell in cells:
                assert not (cell.endswith("…") and cell[:-1].replace(".", "").isdigit()), cell
            shown_cells.update(cells)
    count = 0
    for digits, paths in SHOWN[name]:
        for path in paths.split():
            for value in _numbers(report["results"], path.split(".")):
                formatted = fmt(value, digits)
                assert formatted in shown_cells, (name, width, path, formatted)
                count += 1
    assert count >= 3, name


def test_gate_result_keys_cover_every_number_of_a_full_report(runs):
    """analyze's result_keys (what --fail-if is checked against before any work) match every
    number of a report with all metrics, and no key of a metric that was not requested."""
    from sharpcli.analyses.analyze import METRICS, REPORT_KEYS, result_keys
    from sharpcli.report.gate import _known

    code, report, _ = runs["analyze"]
    assert code == 1  # the first gate trips
    patterns = [*REPORT_KEYS, *(k for m in ("", *METRICS) for k in result_keys(m))]

    def leaves(node, prefix=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from leaves(v, f"{prefix}{k}.")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from leaves(v, f"{prefix}{i}.")
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            yield prefix[:-1]

    keys = [k for k in leaves(report["results"]) if not k.startswith("gates.")]
    assert len(keys) > 40
    for key in keys:
        assert _known(key, patterns), key
    for key in ("timing.seconds", "environment.threads", "settings.top_k", "results.loss"):
        assert _known(key, patterns), key


# ----------------------------------------------------------------------------- --fail-if
@pytest.mark.parametrize(
    ("gate", "needles"),
    [
        (
            "lambda_max > 5",
            ("the report has no key 'lambda_max'", "did you mean 'hessian.lambda_max'"),
        ),
        ("hessian.lambda_mx > 1", ("did you mean 'hessian.lambda_max'",)),
        ("timing.second > 600", ("did you mean 'timing.seconds'",)),
        ("nme_share > 0.2", ("'nme_share' is only reported with --metrics eigen,trace,gn-nme",)),
        ("activations.layers.0.death_frequency > 0.5", ("--metrics eigen,trace,activation-stats",)),
    ],
)
def test_fail_if_keys_are_checked_before_any_work(capsys, tmp_path, gate, needles):
    """The checkpoint does not even exist: the gate's key is refused before it is read."""
    missing = str(tmp_path / "missing.safetensors")
    run = run_cli(capsys, "analyze", missing, "--fail-if", gate, "--json", "-")
    assert run.code == 2
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and "--fail-if" in lines[0] and "missing" not in lines[0], run.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert run.json()["error"]["source"] == "--fail-if"


def test_fail_if_known_keys_pass_the_early_check(capsys, tmp_path):
    missing = str(tmp_path / "missing.safetensors")
    for gate in (
        "hessian.lambda_max > 5",
        "results.hessian.eigenvalues.1 > 5",
        "hessian.trace_by_layer.0 > 1",
        "accuracy < 0.9",
        "settings.top_k > 0",
    ):
        run = run_cli(capsys, "analyze", missing, "--fail-if", gate)
        assert_one_line_error(run, 2, "missing.safetensors", "no such file")
    run = run_cli(capsys, "analyze", missing, "--metrics", "gn-nme", "--fail-if", "nme_share > 1")
    assert_one_line_error(run, 2, "no such file")


def test_a_tripped_gate_is_one_line_on_stderr_even_under_quiet(runs, capsys, tmp_path):
    ckpt = str(_folder(runs) / "m.safetensors")
    for extra in (("--quiet",), ("--json", "-")):
        run = run_cli(
            capsys,
            "analyze",
            ckpt,
            "--metrics",
            "trace",
            "--max-matvecs",
            "4",
            "--fail-if",
            "loss > 0",
            "--fail-if",
            "accuracy > 2",
            *extra,
        )
        assert run.code == 1, run.err
        lines = run.err.strip().splitlines()
        assert len(lines) == 1, run.err
        assert "--fail-if tripped: loss > 0 (value " in lines[0] and "accuracy" not in lines[0]
        if extra == ("--quiet",):
            assert run.out == ""
        else:
            assert run.json()["results"]["gates"][0]["tripped"] is True


def _folder(runs):
    return runs["_folder"]


# ----------------------------------------------------------------------------- --threads
def test_threads_is_applied_and_recorded(runs, capsys, monkeypatch, tmp_path):
    ckpt = str(_folder(runs) / "m.safetensors")
    try:
        run = run_cli(capsys, "eigen", ckpt, "--threads", "2", "--json", "-")
        assert run.code == 0, run.err
        assert run.json()["environment"]["threads"] == 2
        assert "threads" not in run.json()["settings"]
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        run = run_cli(capsys, "eigen", ckpt, "--json", "-")  # the default: one thread
        assert run.json()["environment"]["threads"] == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # unless OMP_NUM_THREADS says otherwise
        assert run_cli(capsys, "eigen", ckpt, "--json", "-").json()["environment"]["threads"] == 2
        run = run_cli(
            capsys,
            "train",
            "--data",
            DATA,
            "--width",
            "4",
            "--epochs",
            "1",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "t.safetensors"),
            "--json",
            "-",
        )
        assert run.code == 0, run.err
        assert run.json()["environment"]["threads"] == 1
    finally:
        torch.set_num_threads(1)
    assert_one_line_error(run_cli(capsys, "eigen", ckpt, "--threads", "0"), 2, "--threads")
    from sharpcli.cli.app import app

    group = typer.main.get_command(app)
    for name in group.commands:
        if name != "compare":
            params = {p.name for p in group.commands[name].params}
            assert {"threads", "debug"} <= params, name


def test_a_profiler_still_gets_its_report_at_exit():
    """The console process skips the interpreter's teardown, but not under a profiler: cProfile
    writes its table at exit."""
    done = subprocess.run(
        [sys.executable, "-m", "cProfile", "-m", "sharpcli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "function calls" in done.stdout and "Ordered by" in done.stdout
