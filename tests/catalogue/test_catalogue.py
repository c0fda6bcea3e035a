"""The catalogue of named things (the sharpcli.catalogue package) and its generic registry
(sharpcli/registry.py): one error type, uniform registration, the one ``NAME[:k=v,...]``
grammar, lazy ``"module:attr"`` resolution, no torch; and the one check that the docs' tables
of names and the report schema agree with the catalogue."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sharpcli import catalogue
from sharpcli.errors import EXIT_USAGE, UsageError
from sharpcli.registry import Entry, Registry
from sharpcli.specs import Param, RegistryError, parse_spec

ROOT = Path(__file__).resolve().parents[2]


def _toy() -> Registry:
    """A registry of two declared entries whose implementations are standard-library objects."""
    return Registry(
        "widget",
        source="widget",
        entries=[
            Entry(
                "gear",
                "a gear",
                "fractions:Fraction",
                (
                    Param("teeth", "int", 12, "number of teeth", minimum=3),
                    Param("ratio", "float", 1.0, "gear ratio", positive=True, auto=True),
                    Param("kind", "choice", "spur", "its shape", choices=("spur", "helical")),
                ),
            ),
            Entry("axle", "an axle", "decimal:Decimal"),
        ],
        protected=("axle",),
        protected_reason="every machine needs one",
    )


# ----------------------------------------------------------------------------- one error type
def test_unknown_name_is_one_usage_error_naming_kind_name_and_accepted():
    toy = _toy()
    for lookup in (toy.get, toy.entry, toy.__getitem__):
        with pytest.raises(RegistryError) as info:
            lookup("sprocket")
        error = info.value
        assert isinstance(error, UsageError) and error.exit_code == EXIT_USAGE
        assert str(error) == "unknown widget 'sprocket'; accepted: gear, axle"
        assert error.source == "widget"
    with pytest.raises(RegistryError, match="unknown widget 'x'") as info:
        toy.get("x", source="--part")
    assert info.value.source == "--part"
    # the registries of the package raise the same type, each naming its kind
    for registry, name in [
        (catalogue.REGULARIZERS, "samm"),
        (catalogue.OPERATORS, "jacobian"),
        (catalogue.DATA_FORMATS, "tsv"),
        (catalogue.LOSSES, "hinge"),
        (catalogue.ACTIVATIONS, "swish"),
        (catalogue.DATASETS, "moons"),
    ]:
        with pytest.raises(RegistryError, match=f"unknown {registry.kind} '{name}'; accepted: "):
            registry.get(name)


def test_registration_is_uniform_duplicates_replace_and_removal():
    toy = _toy()
    assert toy.register("gear", int) is int
    with pytest.raises(RegistryError, match="widget 'gear' is already registered"):
        toy.register("gear", float)
    assert toy.register("gear", float, replace=True) is float and toy["gear"] is float
    toy.register("cog", str, entry=Entry("cog", "a cog"))
    assert toy.names() == ("gear", "axle", "cog") and toy.builtin_names() == ("gear", "axle")
    for bad in ("Cog", "cog_2", "2cog", "", "c o g", "cog:x"):
        with pytest.raises(RegistryError, match="use lower case letters, digits and '-'"):
            toy.register(bad, str)
    with pytest.raises(RegistryError, match="cannot be removed: every machine needs one"):
        toy.unregister("axle")
    assert toy.unregister("cog") is str and "cog" not in toy
    with pytest.raises(RegistryError, match="widget 'cog' is not registered"):
        toy.unregister("cog")
    assert toy.pop("cog", None) is None
    # the kind declares its validation ("module:attr", imported at the first registration): an
    # extension without an entry gets one from make_entry, and the check may refuse it
    kind = Registry(
        "widget",
        source="widget",
        check=f"{__name__}:_summarised",
        make_entry=f"{__name__}:_first_doc_line",
    )
    kind.register("list", list)
    assert kind.entry("list").summary == list.__doc__.splitlines()[0]
    with pytest.raises(RegistryError, match="widget 'blank': no summary"):
        kind.register("blank", object, entry=Entry("blank", ""))
    assert "blank" not in kind


def _first_doc_line(name: str, obj: object) -> Entry:
    """The widget kind's make_entry: the object's docstring's first line as its summary."""
    return Entry(name, (obj.__doc__ or "").splitlines()[0])


def _summarised(entry: Entry, obj: object) -> object:
    """The widget kind's check: an entry needs a summary."""
    if not entry.summary:
        raise RegistryError(f"widget {entry.name!r}: no summary", source="widget")
    return obj


def test_each_kind_of_the_package_declares_its_validation_where_it_can_be_imported():
    """The kinds whose implementations are checked name their validation in the torch-free
    registry, not patched on by the implementing module; each name resolves to a function."""
    from sharpcli.registry import resolve

    checked = {
        catalogue.REGULARIZERS: True,
        catalogue.OPERATORS: False,
        catalogue.DATA_FORMATS: True,
        catalogue.LOSSES: True,
    }
    for registry, makes_entries in checked.items():
        assert callable(resolve(registry.check_impl)), registry.kind
        assert bool(registry.make_entry_impl) == makes_entries, registry.kind
        if makes_entries:
            assert callable(resolve(registry.make_entry_impl)), registry.kind


def test_implementations_resolve_lazily_from_module_attr():
    toy = _toy()
    code = (
        "import sys; from sharpcli import catalogue, registry; "
        "assert 'torch' not in sys.modules; "
        "assert 'sharpcli.regularizers.registry' not in sys.modules; "
        "print(catalogue.REGULARIZERS.names()[:3], catalogue.REGULARIZERS.entry('sam').paper); "
        "cls = catalogue.REGULARIZERS['sam']; "
        "assert 'sharpcli.regularizers.perturbed.sam' in sys.modules; "
        # the kind's check, which the registry names, was imported to validate it
        "assert 'sharpcli.regularizers.registry' in sys.modules; "
        "print(cls.__name__, cls.summary == catalogue.REGULARIZERS.entry('sam').summary)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == "('none', 'dropout', 'wd') SAM" and out[1] == "SAM True"
    from decimal import Decimal
    from fractions import Fraction

    assert toy["gear"] is Fraction and dict(toy.items()) == {"gear": Fraction, "axle": Decimal}
    broken = Registry("widget", source="widget", entries=[Entry("w", "w", "json")])
    with pytest.raises(RegistryError, match="widget 'w': json does not register it"):
        broken.get("w")


# ----------------------------------------------------------------------------- the grammar
def test_one_grammar_positional_keyword_defaults_and_typing():
    toy = _toy()
    assert toy.parse("gear") == (toy.entry("gear"), {"teeth": 12, "ratio": 1.0, "kind": "spur"})
    entry, values = toy.parse(" GEAR : 20, kind=HELICAL ")
    assert values == {"teeth": 20, "ratio": 1.0, "kind": "helical"}
    assert toy.parse("gear:ratio=auto")[1]["ratio"] == "auto"
    assert toy.parse("axle:")[1] == {}
    assert entry.spec_hint() == "gear:teeth=12,ratio=1.0,kind=spur"
    with pytest.raises(RegistryError, match="expected key=value, got '20'"):
        toy.parse("gear:20", positional=False)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "widget must be a non-empty NAME[:k=v,...]; got ''; accepted: gear, axle"),
        ("sprocket:1", "unknown widget 'sprocket'; accepted: gear, axle"),
        ("gear:size=3", "gear: unknown parameter 'size'; accepted: teeth, ratio, kind"),
        ("axle:1", "axle: takes at most 0 positional parameter(s) ((none)); got 1 in 'axle:1'"),
        ("gear:1,2,spur,4", "gear: takes at most 3 positional parameter(s)"),
        ("gear:teeth=5,7", "gear: positional value '7' after a keyword in 'gear:teeth=5,7'"),
        ("gear:teeth=5,teeth=6", "gear: teeth given twice in"),
        ("gear:5,,spur", "gear: empty parameter in 'gear:5,,spur'; accepted: teeth, ratio, kind"),
        ("gear:teeth=", "gear: expected key=value, got 'teeth='"),
        ("gear:teeth=2", "gear: teeth must be >= 3; got '2'"),
        ("gear:teeth=3.5", "gear: teeth must be an integer; got '3.5'"),
        ("gear:teeth=many", "gear: teeth must be a number; got 'many'"),
        ("gear:ratio=0", "gear: ratio must be > 0; got '0'"),
        ("gear:ratio=inf", "gear: ratio must be finite; got 'inf'"),
        ("gear:ratio=big", "gear: ratio must be a number or auto; got 'big'"),
        ("gear:kind=bevel", "gear: kind must be one of spur, helical; got 'bevel'"),
    ],
)
def test_grammar_errors_name_what_is_accepted(text, message):
    with pytest.raises(RegistryError) as info:
        _toy().parse(text)
    assert message in info.value.message and info.value.source == "widget"


def test_the_three_specs_share_the_grammar():
    """--reg, --activation and a built-in --data report the same problem in the same words."""
    from sharpcli.io.data.loading import parse_data_spec
    from sharpcli.models.activations import parse_activation_spec
    from sharpcli.regularizers.registry import parse_reg

    for call, text, source in [
        (parse_reg, "sam:rho=1,rho=2", "regs"),
        (parse_activation_spec, "beta-gelu:beta=1,beta=2", "activation"),
        (parse_data_spec, "blobs:n=10,n=20", "data"),
    ]:
        with pytest.raises(RegistryError, match="given twice") as info:
            call(text)
        assert info.value.source == source
    assert parse_activation_spec("Beta_GELU:beta=4") == ("beta-gelu", {"beta": 4.0})
    assert parse_spec(
        "blobs:n=3", lambda n: ("n",), positional=False, source="spec", unknown=KeyError
    ) == ("blobs", {"n": "3"})


# ----------------------------------------------------------------------------- the one check of copies
def test_docs_tables_schema_and_commands_agree_with_the_catalogue():
    """Where names are written down outside the catalogue, they are the catalogue's."""
    from sharpcli.io.data.builtin import BUILTIN_ARGS

    # the tables of regularizers, estimators and operators are generated from the
    # declarations (python -m sharpcli.catalogue.generate --check: tests/catalogue/test_generated.py)
    docs = ROOT / "docs" / "commands"
    # activations: each with its parameters (docs/commands/train.md)
    train = (docs / "train.md").read_text(encoding="utf-8")
    for entry in catalogue.ACTIVATIONS.entries():
        spelled = entry.name + "".join(f":{p.name}={p.name[0].upper()}" for p in entry.params)
        assert f"`{spelled}`" in train, spelled
    # the built-in datasets' generators, the commands of `sharp` and of the report schema
    assert tuple(BUILTIN_ARGS) == catalogue.DATASETS.builtin_names()
    import typer

    from sharpcli.cli.app import app

    assert set(typer.main.get_command(app).commands) == set(catalogue.COMMANDS.names())
    schema = json.loads((ROOT / "sharpcli" / "report" / "schema.json").read_text())
    reported = [rule["if"]["properties"]["command"]["const"] for rule in schema["allOf"]]
    assert set(reported) <= set(catalogue.COMMANDS.names())


def test_every_paper_key_is_in_the_references():
    references = (ROOT / "docs" / "references.md").read_text(encoding="utf-8")
    for registry in catalogue.KINDS.values():
        for entry in registry.entries():
            assert not entry.paper or f"**[{entry.paper}]**" in references, entry


def test_the_catalogue_and_the_cli_choices_import_no_torch():
    code = (
        "import sys; import sharpcli.catalogue, sharpcli.cli.choices, sharpcli.registry; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
