"""``eigen --blocks ... --plot`` (sharpcli/report/block_heatmap.py): the layers x kinds grid of
a tiny GPT-2's blocks as the model names them, the PNG written at the plots' size, the bar
chart where the blocks form no grid, and ``--plot`` without ``--blocks`` refused."""

from __future__ import annotations

import pytest
from cli_helpers import assert_one_line_error, run_cli
from png_helpers import png_size

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.analyses.blocks import block_partition
from sharpcli.report.block_heatmap import block_grid, block_top_eigenvalue
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=48,dim=4,classes=3,seed=4"
GPT2_KINDS = [
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
    "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
    "mlp.c_proj.weight", "mlp.c_proj.bias",
]  # fmt: skip


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=12, n_positions=8, n_embd=8, n_layer=3, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    return model, [n for n, _ in model.named_parameters()]


def test_the_grid_of_a_tiny_gpt2s_parameter_blocks(gpt2):
    model, names = gpt2
    blocks = [b for b, _ in block_partition(names, "params", model)]
    grid = block_grid(blocks)
    assert grid is not None
    assert grid.layers == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert grid.kinds == GPT2_KINDS
    assert grid.cells["transformer.h.1.mlp.c_fc.weight"] == (1, 8)
    assert grid.cells["transformer.h.2.attn.c_attn.bias"] == (2, 3)
    assert len(grid.cells) == 3 * 12
    assert grid.outside == [
        "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ]  # fmt: skip


def test_the_grid_of_module_blocks_and_none_for_layers(gpt2):
    model, names = gpt2
    modules = block_grid([b for b, _ in block_partition(names, "modules", model)])
    assert modules is not None
    assert modules.kinds == ["ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"]
    assert modules.cells["transformer.h.0.ln_2"] == (0, 3)
    # whole layers, or globs, have no kind within a layer: a bar chart
    assert block_grid([b for b, _ in block_partition(names, "layers", model)]) is None
    assert block_grid(["attn", "mlp"]) is None


def test_the_plotted_value_is_the_chosen_end():
    block = {"eigenvalues": [3.0, -1.0, 2.0]}
    assert block_top_eigenvalue(block, "largest") == 3.0
    assert block_top_eigenvalue(block, "both") == 3.0
    assert block_top_eigenvalue(block, "smallest") == -1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = tiny_mlp_spec(d_in=4, classes=3, width=5, depth=1, activation="gelu")
    folder = tmp_path_factory.mktemp("heatmap")
    return write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5)


@pytest.mark.parametrize("blocks", ["params", "hidden=0.*,head=2.*"], ids=["grid", "bars"])
def test_eigen_blocks_plot_is_written_at_the_plots_size(tiny, capsys, tmp_path, blocks):
    png = tmp_path / "blocks.png"
    run = run_cli(capsys, "eigen", tiny, "--blocks", blocks, "--plot", str(png), "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    assert report["results"]["plot"] == str(png)
    assert png_size(png) == (960, 600)


def test_plot_needs_blocks(tiny, capsys, tmp_path):
    run = run_cli(capsys, "eigen", tiny, "--plot", str(tmp_path / "x.png"))
    assert_one_line_error(run, 2, "--plot", "needs --blocks")
    assert not (tmp_path / "x.png").exists()
