"""The user guide (``docs/``) cannot drift from the code.

- Every ``sharp`` command in a guide page's ```` ```sh ```` blocks parses against the real
  CLI (option names and value types), and every CLI command has a page.
- The command pages' examples run, in page order, in one folder (in-process, slow).
- ``docs/reproduce.md`` runs as written (``python -m sharpcli`` subprocesses, in order), each
  command exits as documented, and the number relation each claim's verdict states is
  asserted on the command's ``--json`` output (slow: about 3-5 minutes on 2 cores).

The page parser is ``docs/reproduce/run_guide.py``, the same one users and CI run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import typer
from cli_helpers import run_cli
from typer.exceptions import TyperException

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COMMAND_PAGES = sorted((DOCS / "commands").glob("*.md"))
# Order matters: the quick start writes model.safetensors, which the other pages use.
EXAMPLE_PAGES = [DOCS / "index.md", *COMMAND_PAGES, DOCS / "ci.md", DOCS / "json.md"]
REPRODUCE = DOCS / "reproduce.md"


def _load_runner():
    spec = importlib.util.spec_from_file_location("run_guide", DOCS / "reproduce" / "run_guide.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_guide", module)
    spec.loader.exec_module(module)
    return module


run_guide = _load_runner()


def _commands(page: Path):
    return run_guide.extract_commands(
        page.read_text(encoding="utf-8"), source=str(page.relative_to(ROOT))
    )


def _python_blocks(page: Path) -> list[str]:
    """The page's fenced ``python`` blocks, in order."""
    return re.findall(
        r"^```python\n(.*?)^```$", page.read_text(encoding="utf-8"), flags=re.S | re.M
    )


def _cli_group():
    from sharpcli.cli.app import app

    return typer.main.get_command(app)


def _schema() -> dict:
    import sharpcli

    return json.loads((Path(sharpcli.__file__).parent / "report" / "schema.json").read_text())


# ----------------------------------------------------------------------------- fast checks
def test_page_parser_refuses_what_it_would_not_run():
    text = (
        '```sh\nsharp analyze m.safetensors --fail-if "hessian.lambda_max > 500"  # exit 1\n```\n'
    )
    (command,) = run_guide.extract_commands(text)
    assert command.args == ("analyze", "m.safetensors", "--fail-if", "hessian.lambda_max > 500")
    assert command.expected_exit == 1 and command.line == 2
    assert command.option("--fail-if") == "hessian.lambda_max > 500"
    for bad in (
        "sharp eigen m | head",
        "sharp eigen $CKPT",
        "sharp eigen m > out.txt",
        "python -m sharpcli eigen m",
        "sharp train && sharp eigen m",
        "python fixtures/make_digits_data.py d.npz > log",
        "python ../fixtures/make_digits_data.py d.npz",
        "python tests/conftest.py",
    ):
        with pytest.raises(ValueError):
            run_guide.extract_commands(f"```sh\n{bad}\n```\n")
    # other fenced blocks (text, yaml, json) are never run
    assert run_guide.extract_commands("```yaml\nrun: sharp eigen m | head\n```\n") == []
    # a fixture script of the repository writes a data file for later commands
    (fixture,) = run_guide.extract_commands(
        "```sh\npython fixtures/make_digits_data.py d.npz\n```\n"
    )
    assert fixture.program == "python" and fixture.args == ("fixtures/make_digits_data.py", "d.npz")


def test_every_command_has_a_page_linked_from_the_index():
    names = set(_cli_group().commands)
    assert {page.stem for page in COMMAND_PAGES} == names
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for name in names:
        assert f"commands/{name}.md" in index, name
    for page in ("json.md", "ci.md", "reproduce.md"):
        assert page in index


def test_every_guide_command_parses_against_the_cli():
    group = _cli_group()
    total = 0
    for page in [*EXAMPLE_PAGES, REPRODUCE]:
        commands = _commands(page)
        assert commands, f"{page.name}: no sharp commands"
        for command in commands:
            where = f"{page.name}:{command.line}: {command.text}"
            assert command.expected_exit in (0, 1, 2, 3), where
            if command.program == "python":  # a fixture script that writes a data file
                assert (ROOT / command.args[0]).is_file(), where
                continue
            name, *args = command.args
            assert name in group.commands, where
            try:
                group.commands[name].make_context(name, list(args))
            except TyperException as exc:  # unknown option, bad value type, missing argument
                pytest.fail(f"{where}: {exc}")
            total += 1
    assert total >= 60


# ----------------------------------------------------------------------------- command pages
@pytest.mark.slow
def test_command_page_examples_run_as_documented(tmp_path, monkeypatch, capsys):
    """Every example of index, command pages, ci and json, in page order, in one folder;
    exit codes as documented and every report written validates against the schema."""
    monkeypatch.chdir(tmp_path)
    schema = _schema()
    for page in EXAMPLE_PAGES:
        for command in _commands(page):
            where = f"{page.name}:{command.line}: {command.text}"
            assert command.program == "sharp", where  # fixture scripts: reproduce.md only
            run = run_cli(capsys, *command.args)
            assert run.code == command.expected_exit, (
                f"{where}\nexit {run.code}\n{run.out[-2000:]}\n{run.err[-2000:]}"
            )
            target = command.option("--json")
            if target == "-":
                jsonschema.validate(json.loads(run.out), schema)
            elif target is not None and (tmp_path / target).exists():  # a report or an error object
                jsonschema.validate(json.loads((tmp_path / target).read_text()), schema)
        for block in _python_blocks(page):  # e.g. json.md's "reading a report in a script"
            exec(compile(block, f"{page.name}:python", "exec"), {"__name__": "__docs__"})


# ----------------------------------------------------------------------------- reproduce.md
def _rows_by_sigma(rows):
    return {round(row["sigma"], 6): row for row in rows}


@pytest.mark.slow
def test_reproduce_guide_claims(tmp_path):
    """docs/reproduce.md, every command in order as a subprocess; then each claim's relation."""
    commands = _commands(REPRODUCE)
    for command in commands:
        result = run_guide.run_command(command, tmp_path)
        assert result.as_documented, (
            f"reproduce.md:{command.line}: {command.text}\nexit {result.code}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        )

    def report(name: str) -> dict:
        return json.loads((tmp_path / name).read_text())

    schema = _schema()
    for path in tmp_path.glob("*.json"):
        jsonschema.validate(json.loads(path.read_text()), schema)

    # 1. AD Theorem 2: smoothed CE <= CE + sigma^2/2 ||h||^2 for every sample; Taylor (Thm 3)
    #    tight at small sigma, below the smoothed loss (not a bound) at large sigma.
    theorem2 = _rows_by_sigma(report("theorem2.json")["results"]["theorem2"])
    assert sorted(theorem2) == [0.1, 0.5, 1.0]
    for row in theorem2.values():
        assert row["fraction_holds"] == 1.0 and row["violations"] == 0
        assert row["cross_entropy"] <= row["smoothed_cross_entropy"] <= row["bound"]
    assert (
        abs(theorem2[0.1]["taylor"] - theorem2[0.1]["smoothed_cross_entropy"])
        < 0.01 * theorem2[0.1]["smoothed_cross_entropy"]
    )
    assert theorem2[1.0]["taylor"] < 0.5 * theorem2[1.0]["smoothed_cross_entropy"]

    # 2. AD Corollary 1 over models trained with ad:sigma: bound and smoothed norm fall with
    #    sigma, the bound holds; the plain lambda_max at theta falls then ticks up at sigma=1.
    corollary = [report(f"corollary1-{s}.json")["results"]["rows"][0] for s in ("0.1", "0.3", "1")]
    bounds = [row["bound"] for row in corollary]
    smoothed = [row["empirical"] for row in corollary]
    plain = [row["plain_lambda_max"] for row in corollary]
    assert bounds[0] > bounds[1] > bounds[2]
    assert smoothed[0] > smoothed[1] > smoothed[2]
    assert all(row["holds_at_theta"] and row["holds"] for row in corollary)
    # with eps over the sampled points the erf is ~1: the rows hold by construction
    assert all(row["verdict"] == "holds by construction" for row in corollary)
    assert plain[0] > plain[1] and plain[2] > plain[1]
    assert (
        report("ad-1-train.json")["results"]["final"]["train_accuracy"] < 0.6
    )  # sigma=1 underfits

    # 3. H = G + N; ReLU: tr(N) = 0 within noise (zero diagonal), N itself not zero;
    #    GELU: tr(N) clearly positive. tr(G) by Hutchinson agrees with the exact tr(G).
    split = {kind: report(f"gn-nme-{kind}.json")["results"] for kind in ("relu", "gelu")}
    for kind, res in split.items():
        h, g, n = (res[op]["trace"]["estimate"] for op in ("hessian", "ggn", "nme"))
        assert abs(h - (g + n)) <= 1e-5 * abs(h), kind
        check = res["ggn_trace_check"]
        assert abs(check["exact"] - check["hutchinson"]) <= 3 * check["hutchinson_stderr"], kind
    relu_nme, gelu_nme = split["relu"]["nme"]["trace"], split["gelu"]["nme"]["trace"]
    assert abs(relu_nme["estimate"]) <= 3 * relu_nme["stderr"]
    assert split["relu"]["nme_frobenius_ratio"] > 0.1
    assert gelu_nme["estimate"] >= 5 * gelu_nme["stderr"]
    assert split["gelu"]["nme_share"] > 0.03 > abs(split["relu"]["nme_share"])

    # 4. NSO: E L(W+U) - L(W) ~ sigma^2/2 tr(H): GELU within 2 % at sigma=0.01 and 10 % at 0.03,
    #    off by > 10 % at 0.1; ReLU off by > 20 % at every sigma.
    nso_gelu = _rows_by_sigma(report("nso-gelu.json")["results"]["noise_stability"]["rows"])
    nso_relu = _rows_by_sigma(report("nso-relu.json")["results"]["noise_stability"]["rows"])
    assert nso_gelu[0.01]["relative_error"] < 0.02
    assert nso_gelu[0.03]["relative_error"] < 0.10
    assert nso_gelu[0.1]["relative_error"] > 0.10
    assert all(row["relative_error"] > 0.20 for row in nso_relu.values())
    for rows in (nso_gelu, nso_relu):
        assert all(row["gap_control_variate"] > row["predicted"] > 0 for row in rows.values())

    # 5. times-10 scaling. Global: accuracy within 1 point, loss explodes, lambda_max FALLS.
    #    Layer (Dinh et al.): function identical, lambda_max up > 10x, invariant unchanged.
    glob = report("rescale-global.json")["results"]
    base, scaled = glob["baseline"], glob["rows"][0]
    assert scaled["alpha"] == 10.0
    assert abs(scaled["accuracy"] - base["accuracy"]) <= 0.01
    assert scaled["loss"] > 100 * base["loss"]
    assert scaled["lambda_max"] < base["lambda_max"]
    layer = report("rescale-layer.json")["results"]
    base, scaled = layer["baseline"], layer["rows"][0]
    assert scaled["accuracy"] == base["accuracy"]
    assert scaled["max_logit_change"] < 1e-4
    assert scaled["lambda_max"] > 10 * base["lambda_max"]
    assert scaled["invariant_lambda_max"] == pytest.approx(base["invariant_lambda_max"], rel=1e-3)

    # 6. Dead units (fixed 70 % mask): most units dead, lower trace and lambda_max.
    layers = report("dead-activations.json")["results"]["layers"]
    assert all(layer["death_frequency"] >= 0.6 for layer in layers)
    plain_h, masked_h = (
        report("dead-relu.json")["results"]["hessian"],
        report("dead-masked.json")["results"]["hessian"],
    )
    assert (
        masked_h["trace"] + 3 * (masked_h["trace_stderr"] + plain_h["trace_stderr"])
        < plain_h["trace"]
    )
    assert masked_h["lambda_max"] < plain_h["lambda_max"]

    # 7. FA: Tr(H^2) falls as lambda grows, means over 3 seeds, error bars = std over seeds;
    #    blobs (SGD): monotone, lambda = 0.1 clear of the lambda = 0 spread, accuracy within
    #    2 points; digits (Adam): monotone, lambda = 0.01 clear of the spread, accuracy cost.
    for name, top, cost in (("fa-blobs", 0.1, 0.02), ("fa-digits", 0.01, 0.06)):
        sweep = report(f"{name}.json")["results"]
        assert not sweep["diverged"]
        rows = sorted(sweep["summary"], key=lambda row: row["lambda"])
        assert [row["seeds"] for row in rows] == [3, 3, 3]
        means = [row["frobenius_sq_mean"] for row in rows]
        assert means[0] > means[1] > means[2], (name, means)
        base, strongest = rows[0], rows[-1]
        assert strongest["lambda"] == top
        assert (
            strongest["frobenius_sq_mean"] + strongest["frobenius_sq_std"]
            < base["frobenius_sq_mean"] - base["frobenius_sq_std"]
        ), name
        drop = base["test_accuracy_mean"] - strongest["test_accuracy_mean"]
        assert drop < cost, (name, drop)
    assert (tmp_path / "digits.npz").is_file()

    # 8. AD Corollary 1 on the final layer: with eps over the sampled points the check holds
    #    on every row and holds by construction at sigma = 0.01 (erf = 1, bound = H); with eps
    #    at theta it fails at sigma = 1 on every model, where the perturbed gradient norms
    #    are 10 to 130 times the one at theta.
    for name in ("relu", "gelu", "digits-relu", "digits-gelu"):
        rows = _rows_by_sigma(report(f"corollary1-{name}.json")["results"]["rows"])
        assert sorted(rows) == [0.01, 0.1, 1.0], name
        for row in rows.values():
            assert row["holds"] and row["holds_region"] and row["points"] == 5, name
            assert row["epsilon_region"] >= row["epsilon"] and row["bound_region"] >= row["bound"]
            assert row["empirical"] <= row["H_perturbed_mean"] * (1 + 1e-3), name
        assert rows[0.01]["verdict"] == "holds by construction" and rows[0.01]["erf_factor"] > 0.999
        assert not rows[1.0]["holds_at_theta"], name
        assert rows[1.0]["epsilon_region"] > 5 * rows[1.0]["epsilon"], name
    for name in ("digits-relu", "digits-gelu"):
        assert report(f"{name}-train.json")["results"]["final"]["test_accuracy"] > 0.85
