"""Every common layer's second derivative, as sharp computes it, against central differences.

Curvature is only as right as torch's double backward through each layer; torch got weight
normalisation wrong (tests/models/test_weight_norm.py) and ``torch.func.hessian`` LayerNorm
(tests/curvature/test_reference_hessian.py). This audit builds a tiny float64 classifier around each
layer a user's model commonly holds (activations, normalisations, convolutions, pooling,
attention, parametrizations), takes its Hessian by double backward inside
:func:`sharpcli.curvature.products.differentiable.twice_differentiable` (as every analysis does) and
compares it with central differences of the gradient, which need first derivatives only. A
torch upgrade (pyproject allows a range) that breaks a layer's second derivative fails here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli.curvature.products.differentiable import twice_differentiable
from tests.hessian_helpers import central_difference_hessian, double_backward_hessian

D = 8  # features of the data; layers reshape them as they need


class View(nn.Module):
    """``(B, D)`` features as ``(B, *shape)``."""

    def __init__(self, *shape: int):
        super().__init__()
        self.shape = shape

    def forward(self, x):
        return x.reshape(x.shape[0], *self.shape)


class Normalize(nn.Module):
    def forward(self, x):
        return F.normalize(x, dim=-1)


class CosineHead(nn.Module):
    def __init__(self, d: int, classes: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, d))

    def forward(self, x):
        return 5 * F.normalize(x, dim=-1) @ F.normalize(self.weight, dim=-1).T


class Bag(nn.Module):
    """Token ids from the features (``|x| * 3`` rounded down, ``padding_idx`` 0) into an
    ``nn.EmbeddingBag``, then a linear head."""

    def __init__(self, mode: str):
        super().__init__()
        self.bag = nn.EmbeddingBag(11, 4, mode=mode, padding_idx=0)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.bag((x.abs() * 3).long().clamp_max(10))))


class Tokens(nn.Module):
    """``(B, D)`` features as 2 tokens of 4, through ``module`` (its first output when it
    returns a tuple), flattened for the head."""

    def __init__(self, module: nn.Module, out: int):
        super().__init__()
        self.module = module
        self.head = nn.Linear(out, 3)

    def forward(self, x):
        out = self.module(x.reshape(x.shape[0], 2, 4))
        out = out[0] if isinstance(out, tuple) else out
        return self.head(out.reshape(x.shape[0], -1))


class CausalAttention(nn.Module):
    """``F.scaled_dot_product_attention`` with ``is_causal=True`` over one head."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, t):
        q, k, v = self.qkv(t).reshape(t.shape[0], 2, 3, 4).unbind(2)
        return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)[
            :, 0
        ]


class Decoder(nn.Module):
    """``nn.TransformerDecoderLayer`` attending to its own input under a causal mask."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True)

    def forward(self, t):
        mask = nn.Transformer.generate_square_subsequent_mask(2, dtype=t.dtype)
        return self.layer(t, t, tgt_mask=mask)


def _mlp(layer: nn.Module, width: int = 6) -> nn.Module:
    return nn.Sequential(nn.Linear(D, width), layer, nn.Linear(width, 3))


LAYERS = {
    "gelu-tanh": lambda: _mlp(nn.GELU(approximate="tanh")),
    "silu": lambda: _mlp(nn.SiLU()),
    "mish": lambda: _mlp(nn.Mish()),
    "softplus": lambda: _mlp(nn.Softplus()),
    "elu": lambda: _mlp(nn.ELU()),
    "selu": lambda: _mlp(nn.SELU()),
    "hardswish": lambda: _mlp(nn.Hardswish()),
    "logsigmoid": lambda: _mlp(nn.LogSigmoid()),
    "prelu": lambda: _mlp(nn.PReLU(6, 0.1)),
    "layernorm": lambda: _mlp(nn.Sequential(nn.LayerNorm(6), nn.Tanh())),
    "rmsnorm": lambda: _mlp(nn.Sequential(nn.RMSNorm(6), nn.Tanh())),
    "batchnorm-eval": lambda: _mlp(nn.Sequential(nn.BatchNorm1d(6), nn.Tanh())),
    "groupnorm": lambda: nn.Sequential(
        View(2, 2, 2),
        nn.Conv2d(2, 4, 1),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(16, 3),
    ),  # fmt: skip
    "instancenorm": lambda: nn.Sequential(
        View(2, 2, 2),
        nn.Conv2d(2, 3, 1),
        nn.InstanceNorm2d(3, affine=True),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, 3),
    ),  # fmt: skip
    "conv2d-depthwise-padded": lambda: nn.Sequential(
        View(2, 2, 2),
        nn.Conv2d(2, 4, 2, padding=1, groups=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(36, 3),
    ),  # fmt: skip
    "conv2d-dilated": lambda: nn.Sequential(
        View(2, 2, 2),
        nn.Conv2d(2, 3, 2, padding=1, dilation=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, 3),
    ),  # fmt: skip
    "conv-transpose2d": lambda: nn.Sequential(
        View(2, 2, 2), nn.ConvTranspose2d(2, 2, 2), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3)
    ),
    "conv1d": lambda: nn.Sequential(
        View(2, 4), nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)
    ),
    "avgpool": lambda: nn.Sequential(
        View(2, 2, 2),
        nn.Conv2d(2, 3, 1),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(3, 3),
    ),  # fmt: skip
    "normalize": lambda: _mlp(Normalize()),
    "cosine-head": lambda: nn.Sequential(nn.Linear(D, 6), nn.Tanh(), CosineHead(6, 3)),
    "transformer-encoder": lambda: nn.Sequential(
        View(2, 4),
        nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(8, 3),
    ),
    "transformer-encoder-norm-first": lambda: nn.Sequential(
        View(2, 4),
        nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True, norm_first=True),
        nn.Flatten(),
        nn.Linear(8, 3),
    ),
    "lstm-bidirectional-2-layers": lambda: Tokens(
        nn.LSTM(4, 3, num_layers=2, bidirectional=True, batch_first=True), 12
    ),
    "gru": lambda: Tokens(nn.GRU(4, 3, batch_first=True), 6),
    "sdpa-causal": lambda: Tokens(CausalAttention(), 8),
    "transformer-decoder-causal": lambda: Tokens(Decoder(), 8),
    "embedding-bag-sum": lambda: Bag("sum"),
    "embedding-bag-mean": lambda: Bag("mean"),
    "weight-norm": lambda: nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(D, 6)), nn.GELU(), nn.Linear(6, 3)
    ),
    "spectral-norm": lambda: nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(D, 6)), nn.Tanh(), nn.Linear(6, 3)
    ),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_double_backward_hessian_matchescentral_difference_hessian(name):
    torch.manual_seed(0)
    model = LAYERS[name]().double().eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24, D, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 3, (24,), generator=generator)
    params = [p for p in model.parameters() if p.requires_grad]
    with twice_differentiable():  # for the reference too: attention's fused kernels differ
        hessian = double_backward_hessian(model, params, x, y)
        reference = central_difference_hessian(model, params, x, y)
    scale = float(reference.abs().max())
    assert scale > 1e-3  # a Hessian worth comparing
    assert float((hessian - hessian.T).abs().max()) <= 1e-13 * scale
    assert float((hessian - reference).abs().max()) <= 1e-8 * scale


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_bag_composite_is_torchs_embedding_bag(mode, padding_idx):
    from sharpcli.curvature.products.differentiable import embedding_bag_composite

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(11, 4, dtype=torch.float64, generator=generator)
    rows = torch.randint(0, 11, (5, 3), generator=generator)
    flat = torch.randint(0, 11, (9,), generator=generator)
    weights_2d = torch.rand(5, 3, dtype=torch.float64, generator=generator)
    calls = [
        dict(input=rows),
        dict(input=flat, offsets=torch.tensor([0, 2, 2, 5])),  # an empty bag
        dict(input=flat, offsets=torch.tensor([0, 2, 2, 5, 9]), include_last_offset=True),
    ]
    if mode == "sum":
        calls.append(dict(input=rows, per_sample_weights=weights_2d))
    for call in calls:
        expected = F.embedding_bag(weight=weight, mode=mode, padding_idx=padding_idx, **call)
        got = embedding_bag_composite(weight=weight, mode=mode, padding_idx=padding_idx, **call)
        assert torch.equal(got, expected), call


BAG_MODULE = """
import torch
from torch import nn


class BagNet(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(11, 4, mode=mode)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.bag(ids)))


def make(mode="mean"):
    return BagNet(mode)
"""


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_embedding_bag_model_from_the_command_line(tmp_path, monkeypatch, capsys, mode):
    """``mean``: analysed (the composite); ``max`` (torch's kernel, no second derivative): a
    one-line error saying so, exit 2, not an internal error."""
    import numpy as np

    from tests.cli_helpers import assert_one_line_error, run_cli

    (tmp_path / "bagmodel.py").write_text(BAG_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)
    namespace: dict = {}
    exec(compile(BAG_MODULE, "bagmodel.py", "exec"), namespace)
    torch.save(namespace["make"](mode).state_dict(), tmp_path / "bag.pt")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 11, size=(30, 4)).astype(np.int64)
    np.savez(tmp_path / "ids.npz", x=ids, y=(ids.sum(1) % 3).astype(np.int64))
    run = run_cli(
        capsys, "eigen", "bag.pt", "--model-factory", "bagmodel:make", "--arch-args",
        f'{{"mode": "{mode}"}}', "--data", "ids.npz", "--quiet",
    )  # fmt: skip
    if mode == "mean":
        assert run.code == 0, run.err
    else:
        assert_one_line_error(run, 2, "cannot differentiate twice", "_embedding_bag_backward")


class Checkpointed(nn.Module):
    """A first block under activation checkpointing (``use_reentrant`` as given; ``None``: not
    checkpointed), then a head."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(D, 6), nn.GELU(), nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        if self.reentrant is None:
            return self.head(self.block(x))
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_blocks_have_the_hessian_of_the_plain_model(reentrant):
    """Reentrant checkpointing drops the block's gradients when the data do not require them
    (torch only warns): the Hessian lost the block. Inside twice_differentiable it is the
    Hessian of the same model without checkpointing."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant).double().eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24, D, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 3, (24,), generator=generator)
    params = list(model.parameters())
    with twice_differentiable():
        hessian = double_backward_hessian(model, params, x, y)
    model.reentrant = None
    plain = double_backward_hessian(model, params, x, y)
    assert float((hessian - plain).abs().max()) <= 1e-12 * float(plain.abs().max())


CHECKPOINT_MODULE = """
from torch import nn
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        if self.reentrant is None:
            return self.head(self.block(x))
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def make(reentrant=None):
    return Net(reentrant)
"""


def test_training_a_reentrant_checkpointed_block_is_training_the_plain_model(
    tmp_path, monkeypatch, capsys
):
    """Reentrant checkpointing left the block's parameters untrained (no gradient reached
    them); now ``sharp train`` gives bit for bit the weights of the model without it."""
    from safetensors.torch import load_file

    from tests.cli_helpers import run_cli

    (tmp_path / "ckptmodel.py").write_text(CHECKPOINT_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    weights = {}
    for tag, value in (("plain", "null"), ("reentrant", "true")):
        out = tmp_path / f"{tag}.safetensors"
        run = run_cli(
            capsys, "train", "--model-factory", "ckptmodel:make", "--model-args",
            f'{{"reentrant": {value}}}', "--data", "blobs:n=64,dim=8,classes=3", "--epochs", "2",
            "--seed", "0", "--out", str(out), "--quiet",
        )  # fmt: skip
        assert run.code == 0, run.err
        weights[tag] = load_file(str(out))
    assert weights["plain"].keys() == weights["reentrant"].keys()
    for name, tensor in weights["plain"].items():
        assert torch.equal(tensor, weights["reentrant"][name]), name
