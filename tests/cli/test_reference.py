"""docs/cli-reference.md is what the commands make: every command, every shown option.

``python -m sharpcli.cli.reference --check`` (also in .ci/run) fails on a stale page; the
declared kinds' names are links to their generated tables, so an extension of those kinds
leaves the page as it is.
"""

from __future__ import annotations

import typer

from sharpcli import catalogue
from sharpcli.cli import helptext, reference
from sharpcli.cli.app import app
from sharpcli.registry import declare


def test_the_checked_in_reference_is_fresh():
    assert reference.main(["--check"]) == 0


def test_every_command_and_shown_option_has_its_row_and_default():
    page = reference.render()
    group = typer.main.get_command(app)
    root = typer.Context(group, info_name="sharp")
    assert set(group.list_commands(root)) == set(catalogue.COMMANDS.names())
    sections = page.split("\n## sharp ")[1:]
    assert [s.split("\n", 1)[0] for s in sections] == [
        n for n in helptext.WORKFLOW if n in group.list_commands(root)
    ]
    for section in sections:
        name = section.split("\n", 1)[0]
        command = group.get_command(root, name)
        ctx = typer.Context(command, info_name=name, parent=root)
        shown = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
        rows = [line for line in section.splitlines() if line.startswith("| <code>")]
        assert len(rows) == len(shown), name
        for param, row in zip(sorted(shown, key=lambda p: helptext.names_of(p)), sorted(rows)):
            assert row.startswith(f"| {reference._code(helptext.names_of(param))} |"), row
            default = helptext.default_of(param, ctx)
            if default is not None and not param.required:
                assert row.endswith(f"| {reference._code(default)} |"), row
    assert "| <code>--top-k N</code> | How many eigenvalues" in page
    assert "| <code>--which WHICH</code> |" in page and "<code>largest</code>, " in page


def test_declared_kinds_are_links_so_an_extension_leaves_the_page_as_it_is():
    page = reference.render()
    assert "| <code>--reg NAME[:k=v,...]</code> | Regularizer, e.g. sam:rho=0.05" in page
    assert "the [regularizers](commands/train.md#regularizers)" in page
    assert "| One of the trace estimators, by name. | the [trace estimators]" in page
    assert "hutchpp (top subspace" not in page  # the lazy help's listing is not copied

    @declare("estimator", "toy-trace", "a toy estimator")
    def toy_trace(request):
        """A toy."""

    catalogue.ESTIMATORS.add(toy_trace)
    try:
        assert reference.render() == page
    finally:
        catalogue.ESTIMATORS.unregister("toy-trace")


def test_cells_keep_markdown_and_pipes_literal():
    assert reference._code("--json PATH|-") == "<code>--json PATH&#124;-</code>"
    assert reference._cell("a | *.weight [x] <= 1") == r"a \| \*.weight \[x\] &lt;= 1"


def test_check_names_a_stale_page_and_writes_nothing(tmp_path, monkeypatch, capsys):
    page = tmp_path / "cli-reference.md"
    page.write_text("old\n", encoding="utf-8")
    monkeypatch.setattr(reference, "PAGE", page)
    assert reference.main(["--check"]) == 1
    assert "run `python -m sharpcli.cli.reference`" in capsys.readouterr().err
    assert page.read_text(encoding="utf-8") == "old\n"
    assert reference.main([]) == 0 and page.read_text(encoding="utf-8") == reference.render()
    assert reference.main(["--check"]) == 0
