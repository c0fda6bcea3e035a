"""``--blocks`` on eigen and trace (sharpcli/analyses/blocks.py): each block's eigenvalues are
those of the dense principal sub-block, exact block traces add up to the full trace, the
partitions by spec, and bad specs."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from hessian_helpers import double_backward_hessian

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.analyses.blocks import block_partition, refuse_overlaps
from sharpcli.errors import UsageError
from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.io.data.loading import load_dataset
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=48,dim=4,classes=3,seed=4"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A GELU MLP checkpoint, its dense float64 Hessian and its parameters' slices."""
    folder = tmp_path_factory.mktemp("blocks")
    spec = tiny_mlp_spec(d_in=4, classes=3, width=5, depth=1, activation="gelu")
    path = write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5)
    model = load_checkpoint(path).model.double().eval()
    x, y = load_dataset(DATA).split("train")
    named = dict(model.named_parameters())
    H = double_backward_hessian(model, list(named.values()), x.double(), y)
    slices, start = {}, 0
    for name, p in named.items():
        slices[name] = slice(start, start + p.numel())
        start += p.numel()
    return path, H, slices


def test_each_blocks_eigenvalues_are_the_dense_principal_sub_blocks(tiny, capsys):
    path, H, slices = tiny
    run = run_cli(
        capsys, "eigen", path, "--blocks", "params", "--top-k", "2", "--which", "both",
        "--eig-tol", "1e-9", "--dtype", "float64", "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    blocks = report["results"]["blocks"]
    assert [b["name"] for b in blocks] == list(slices)
    for block in blocks:
        sl = slices[block["name"]]
        exact = torch.linalg.eigvalsh(H[sl, sl])
        k = len(block["eigenvalues"]) // 2
        expected = torch.cat([exact[:k], exact[-k:]])  # ascending, as sorted below
        assert block["numel"] == sl.stop - sl.start and all(block["converged"])
        assert torch.allclose(
            torch.tensor(sorted(block["eigenvalues"]), dtype=H.dtype), expected, atol=1e-7, rtol=0
        )
    # the full operator's figures stay: the top eigenvalue of H itself
    top = float(torch.linalg.eigvalsh(H)[-1])
    assert report["results"]["eigenvalues"][0] == pytest.approx(top, rel=1e-6)


def test_named_glob_blocks_and_their_exact_traces_sum_to_the_full_trace(tiny, capsys):
    path, H, slices = tiny
    run = run_cli(
        capsys, "trace", path, "--operator", "ggn", "--estimator", "exact",
        "--blocks", "hidden=0.*,head=2.*", "--dtype", "float64", "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    results = run.json()["results"]
    hidden, head = results["blocks"]
    assert (hidden["name"], hidden["parameters"]) == ("hidden", ["0.weight", "0.bias"])
    assert (head["name"], head["parameters"]) == ("head", ["2.weight", "2.bias"])
    assert results["blocks_sum"]["estimate"] == pytest.approx(
        results["trace"]["estimate"], rel=1e-12
    )
    assert results["blocks_sum"]["numel"] == H.shape[0]


def test_hessian_block_traces_match_the_dense_diagonal_blocks(tiny, capsys):
    path, H, slices = tiny
    run = run_cli(
        capsys, "trace", path, "--blocks", "modules", "--estimator", "hutchpp",
        "--trace-tol", "1e-3", "--dtype", "float64", "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    blocks = run.json()["results"]["blocks"]
    assert [b["name"] for b in blocks] == ["0", "2"]
    for block, layer in zip(blocks, (("0.weight", "0.bias"), ("2.weight", "2.bias"))):
        exact = sum(float(torch.diagonal(H)[slices[n]].sum()) for n in layer)
        assert abs(block["estimate"] - exact) <= 4 * block["stderr"] + 1e-9


def test_block_partition_by_spec():
    names = ["emb.weight", "h.0.attn.w", "h.0.mlp.w", "h.1.attn.w", "head"]
    assert block_partition(names, "params") == [(n, [n]) for n in names]
    assert block_partition(names, "modules") == [
        ("emb", ["emb.weight"]),
        ("h.0.attn", ["h.0.attn.w"]),
        ("h.0.mlp", ["h.0.mlp.w"]),
        ("h.1.attn", ["h.1.attn.w"]),
        ("(root)", ["head"]),
    ]
    assert block_partition(names, "attn=*.attn.*, *.mlp.*") == [
        ("attn", ["h.0.attn.w", "h.1.attn.w"]),
        ("*.mlp.*", ["h.0.mlp.w"]),
    ]
    for bad in ("", "a=*.attn.*,a=*.mlp.*", "x=conv.*", "layers"):
        with pytest.raises(UsageError) as info:
            block_partition(names, bad)
        assert info.value.source == "blocks"


def test_bad_blocks_are_one_line_and_exit_2(tiny, capsys):
    path = tiny[0]
    run = run_cli(capsys, "eigen", path, "--blocks", "x=nothing*")
    assert_one_line_error(run, 2, "--blocks", "matches no parameter")
    run = run_cli(capsys, "trace", path, "--blocks", "params", "--engine", "pyhessian")
    assert_one_line_error(run, 2, "--blocks")


@pytest.mark.parametrize("command", ["trace", "eigen"])
def test_an_empty_blocks_value_is_told_about_blocks_not_params(tiny, capsys, command):
    """The refusal of ``--blocks ''`` lists the values of --blocks: the spec ``params`` is
    one of them, not the option --params (the word was rewritten into an option)."""
    run = run_cli(capsys, command, tiny[0], "--blocks", "")
    assert_one_line_error(run, 2, "--blocks", "params, modules, layers")
    assert "--params" not in run.err, run.err


def test_overlapping_blocks_are_refused_by_trace_not_counted_twice(tiny, capsys):
    """``a=0.*,b=0.weight``: 0.weight in both blocks, so trace's blocks_sum would count its
    trace twice (45 of 43 parameters): refused naming both blocks and the parameter, before
    any block's work. eigen takes them (each block stands alone: no sum)."""
    run = run_cli(capsys, "trace", tiny[0], "--blocks", "a=0.*,b=0.weight")
    assert_one_line_error(run, 2, "--blocks", "'a'", "'b'", "0.weight")
    with pytest.raises(UsageError) as info:
        refuse_overlaps([("all", ["0.weight", "0.bias"]), ("w", ["0.weight"])])
    assert info.value.source == "blocks"
    refuse_overlaps([("w", ["0.weight"]), ("b", ["0.bias"])])  # disjoint: no error
    run = run_cli(capsys, "eigen", tiny[0], "--blocks", "a=0.*,b=0.weight", "--json", "-")
    assert run.code == 0, run.err
    assert [b["name"] for b in run.json()["results"]["blocks"]] == ["a", "b"]


def test_layers_of_a_tiny_gpt2_are_named_as_the_model_names_them():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=12, n_positions=8, n_embd=8, n_layer=3, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    names = [n for n, _ in model.named_parameters()]
    blocks = block_partition(names, "layers", model)
    labels = [b for b, _ in blocks]
    assert labels == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
        "transformer.ln_f",
    ]
    layer = dict(blocks)["transformer.h.1"]
    assert layer == [n for n in names if n.startswith("transformer.h.1.")]
    assert sorted(n for _, members in blocks for n in members) == sorted(names)  # a partition
    with pytest.raises(UsageError, match="no repeated blocks"):
        block_partition(["w"], "layers", torch.nn.Linear(2, 2))


def test_density_blocks_span_the_dense_sub_blocks_spectra(tiny, capsys):
    """With as many Lanczos steps as a block has parameters, its SLQ nodes are the sub-block's
    eigenvalues: the extremes match the dense ones."""
    path, H, slices = tiny
    run = run_cli(
        capsys, "density", path, "--blocks", "params", "--steps", "40", "--probes", "2",
        "--dtype", "float64", "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    blocks = report["results"]["blocks"]
    assert [b["name"] for b in blocks] == list(slices)
    for block in blocks:
        exact = torch.linalg.eigvalsh(H[slices[block["name"]], slices[block["name"]]])
        assert block["lambda_max"] == pytest.approx(float(exact[-1]), abs=1e-8)
        assert block["lambda_min"] == pytest.approx(float(exact[0]), abs=1e-8)
        assert len(block["grid"]) == len(block["density"]) == 512
