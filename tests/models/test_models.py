"""The model zoo: specs, shapes, state_dict names, parameter counts, head and activation lookup."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from sharpcli.errors import UsageError
from sharpcli.models import (
    ACTIVATION_TYPES,
    MODEL_NAMES,
    AugmentedReLU,
    activation_modules,
    build_model,
    default_model_args,
    final_linear,
    model_input_shape,
    validate_model_spec,
)

# tiny configurations of every model, with the input shape they are built for and the number of
# activation layers they must expose
TINY = {
    "mlp": ((1, 4, 4), {"depth": 2, "width": 8}, 2),
    "cnn": ((3, 8, 8), {"channels": [4, 6]}, 2),
    "vgg-small": ((3, 8, 8), {"width_multiplier": 1 / 16}, 4),
    "resnet": ((3, 8, 8), {"depth": 8, "width": 4}, 1 + 2 * 3),
}
NUM_CLASSES = 5


def tiny_model(name: str, seed: int = 0, **extra) -> nn.Module:
    shape, overrides, _ = TINY[name]
    torch.manual_seed(seed)
    return build_model(
        {
            "name": name,
            "args": default_model_args(name, shape, NUM_CLASSES, **{**overrides, **extra}),
        }
    )


def resnet_parameter_count(depth: int, width: int, in_channels: int, classes: int) -> int:
    """Hand count for the CIFAR ResNet (option A shortcuts, BN weight+bias, conv without bias)."""
    n = (depth - 2) // 6
    total = 9 * in_channels * width + 2 * width  # stem conv + BN
    prev = width
    for out in (width, 2 * width, 4 * width):
        for _ in range(n):
            total += 9 * prev * out + 9 * out * out + 4 * out
            prev = out
    return total + prev * classes + classes


def test_model_names():
    from sharpcli import catalogue
    from sharpcli.catalogue import DEFAULT_MODEL
    from sharpcli.models import zoo
    from sharpcli.registry import declaration

    assert MODEL_NAMES == ("mlp", "cnn", "vgg-small", "resnet")
    assert set(TINY) == set(MODEL_NAMES)
    # the catalogue's names are the zoo's declared classes, in their order, each with its
    # argument table; mlp is the default
    declared = [zoo.MLP, zoo.SmallCNN, zoo.VGGSmall, zoo.CifarResNet]
    assert tuple(declaration(cls)[1].name for cls in declared) == MODEL_NAMES
    assert [catalogue.MODELS.get(name) for name in MODEL_NAMES] == declared
    assert all(cls.ARGS for cls in declared) and DEFAULT_MODEL == "mlp"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_builds_runs_and_round_trips_its_state_dict(name):
    shape, _, activation_count = TINY[name]
    model = tiny_model(name, seed=0)
    assert model.input_shape == ((16,) if name == "mlp" else shape)  # the mlp flattens its input
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(1))
    model.eval()
    logits = model(x)
    assert logits.shape == (3, NUM_CLASSES) and torch.isfinite(logits).all()

    # the spec is JSON-serialisable and complete: a fresh model (other init) loads the weights
    spec = json.loads(json.dumps(model.model_spec))
    assert spec == model.model_spec
    other = build_model(spec)
    other.eval()
    first_key = next(iter(model.state_dict()))
    assert not torch.equal(model.state_dict()[first_key], other.state_dict()[first_key])
    other.load_state_dict(model.state_dict())
    assert torch.equal(other(x), logits)

    # activations: distinct module instances, as many as the architecture has, seen by hooks
    acts = activation_modules(model)
    assert len(acts) == activation_count
    assert len({id(m) for _, m in acts}) == activation_count
    assert all(isinstance(m, ACTIVATION_TYPES) for _, m in acts)
    seen = []
    handles = [
        m.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape)) for _, m in acts
    ]
    model(x)
    for handle in handles:
        handle.remove()
    assert len(seen) == activation_count

    # the head is the last Linear; its input is the penultimate representation
    head_name, head = final_linear(model)
    assert isinstance(head, nn.Linear) and head.out_features == NUM_CLASSES
    assert head_name == [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    captured = {}
    handle = head.register_forward_hook(lambda mod, inp, out: captured.update(h=inp[0], z=out))
    model(x)
    handle.remove()
    assert captured["h"].shape == (3, head.in_features)
    assert torch.equal(captured["z"], logits)


def test_mlp_state_dict_names_and_layout():
    model = tiny_model("mlp")
    assert list(model.state_dict()) == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
        "4.weight",
        "4.bias",
    ]
    assert isinstance(model, nn.Sequential)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert (
        model[0].in_features == 16
        and model[0].out_features == 8
        and model[4].out_features == NUM_CLASSES
    )

    with_dropout = tiny_model("mlp", dropout=0.25)
    assert list(with_dropout.state_dict()) == [
        "0.weight",
        "0.bias",
        "3.weight",
        "3.bias",
        "6.weight",
        "6.bias",
    ]
    assert [m.p for m in with_dropout if isinstance(m, nn.Dropout)] == [0.25, 0.25]

    no_bias = tiny_model("mlp", bias=False, depth=1)
    assert list(no_bias.state_dict()) == ["0.weight", "2.weight"]

    logistic = tiny_model("mlp", depth=0)
    assert (
        list(logistic.state_dict()) == ["0.weight", "0.bias"] and activation_modules(logistic) == []
    )
    assert final_linear(logistic)[0] == "0"


def test_mlp_flattens_image_inputs_and_slices_to_plain_sequential():
    model = tiny_model("mlp", activation="augmented-relu:beta=2")
    x = torch.randn(4, 1, 4, 4)
    assert torch.equal(model(x), model(x.reshape(4, 16)))
    assert isinstance(model[1], AugmentedReLU)
    hidden = model[0:2]
    assert type(hidden) is nn.Sequential and hidden[0] is model[0]
    manual = model[4](model[3](model[2](model[1](model[0](x.reshape(4, 16))))))
    assert torch.equal(model(x), manual)


def test_cnn_layout():
    model = tiny_model("cnn")
    kinds = [type(m).__name__ for m in model.features]
    assert kinds == ["Conv2d", "ReLU", "MaxPool2d"] * 2
    assert final_linear(model)[0] == "classifier.1"
    assert model.classifier[1].in_features == 6 * 2 * 2  # 8x8 pooled twice
    bn = tiny_model("cnn", batch_norm=True, dropout=0.5)
    assert [type(m).__name__ for m in bn.features] == [
        "Conv2d",
        "BatchNorm2d",
        "ReLU",
        "MaxPool2d",
    ] * 2
    assert final_linear(bn)[0] == "classifier.2" and isinstance(bn.classifier[1], nn.Dropout)
    wide = build_model(
        {"name": "cnn", "args": default_model_args("cnn", (1, 6, 10), 3, channels=[2])}
    )
    assert wide.model_spec["args"]["image_size"] == [6, 10]
    assert wide.classifier[1].in_features == 2 * 3 * 5
    assert wide(torch.randn(2, 1, 6, 10)).shape == (2, 3)


def test_vgg_small_is_man_table_6():
    """MAN Appendix B.2, Table 6: conv 64-128-256-512 (k=3, pad=1), ReLU, MaxPool2d(2) after each,
    AdaptiveAvgPool2d(2x2), Linear(2048 -> classes, bias=False); no batch norm by default."""
    torch.manual_seed(0)
    args = default_model_args("vgg-small", (3, 32, 32), 10)
    assert args["batch_norm"] is False and args["width_multiplier"] == 1.0
    model = build_model({"name": "vgg-small", "args": args})
    convs = {int(n): m for n, m in model.features.named_children() if isinstance(m, nn.Conv2d)}
    assert sorted(convs) == [0, 3, 6, 9]
    assert [(c.in_channels, c.out_channels) for c in convs.values()] == [
        (3, 64),
        (64, 128),
        (128, 256),
        (256, 512),
    ]
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) for c in convs.values())
    assert all(isinstance(model.features[i], nn.ReLU) for i in (1, 4, 7, 10))
    assert all(isinstance(model.features[i], nn.MaxPool2d) for i in (2, 5, 8, 11))
    pool, _, head = model.classifier
    assert isinstance(pool, nn.AdaptiveAvgPool2d) and pool.output_size == (2, 2)
    assert head.in_features == 2048 and head.out_features == 10 and head.bias is None
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    features = model.features(torch.zeros(1, 3, 32, 32))
    assert features.shape == (1, 512, 2, 2)  # H/16

    # 8x8 images: the fourth pool would shrink 1x1 to nothing, so it is an Identity (indices kept)
    small = tiny_model("vgg-small")
    assert isinstance(small.features[11], nn.Identity)
    assert [small.features[i].out_channels for i in (0, 3, 6, 9)] == [4, 8, 16, 32]
    with_bn = tiny_model("vgg-small", batch_norm=True)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in with_bn.modules()) == 4


def test_resnet20_has_the_standard_parameter_count():
    torch.manual_seed(0)
    model = build_model({"name": "resnet", "args": default_model_args("resnet", (3, 32, 32), 10)})
    count = sum(p.numel() for p in model.parameters())
    assert count == resnet_parameter_count(20, 16, 3, 10) == 269_722  # He et al. 2016: 0.27M
    assert model.model_spec["args"]["depth"] == 20 and model.model_spec["args"]["width"] == 16
    blocks = [m for m in model.modules() if type(m).__name__ == "BasicBlock"]
    assert len(blocks) == 9
    assert final_linear(model) == ("fc", model.fc)
    assert len(activation_modules(model)) == 1 + 2 * 9


def test_resnet56_parameter_count_and_tiny_shapes():
    model = build_model(
        {"name": "resnet", "args": default_model_args("resnet", (3, 32, 32), 10, depth=56)}
    )
    assert (
        sum(p.numel() for p in model.parameters())
        == resnet_parameter_count(56, 16, 3, 10)
        == 853_018
    )
    tiny = tiny_model("resnet")
    x = torch.randn(2, 3, 8, 8)
    out = tiny.layer2(tiny.layer1(tiny.act1(tiny.bn1(tiny.conv1(x)))))
    assert out.shape == (2, 8, 4, 4)
    shortcut = tiny.layer2[0].shortcut
    y = torch.randn(2, 4, 8, 8)
    padded = shortcut(y)
    assert padded.shape == (2, 8, 4, 4)
    assert torch.equal(padded[:, 2:6], y[:, :, ::2, ::2])
    assert torch.equal(padded[:, :2], torch.zeros(2, 2, 4, 4)) and torch.equal(
        padded[:, 6:], torch.zeros(2, 2, 4, 4)
    )


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_activation_option_and_dropout_reach_every_model(name):
    model = tiny_model(name, activation="beta-gelu:beta=4", dropout=0.3)
    acts = activation_modules(model)
    assert all(m.spec == "beta-gelu:beta=4.0" for _, m in acts)
    assert model.model_spec["args"]["activation"] == "beta-gelu:beta=4.0"
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.p == 0.3 for m in dropouts)
    assert not any(isinstance(m, nn.Dropout) for m in tiny_model(name).modules())
    model.eval()
    x = torch.randn(2, *TINY[name][0])
    assert torch.equal(model(x), model(x))  # dropout off in eval mode


def test_parameters_are_float32_under_a_float64_default_and_convert():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = tiny_model("cnn")
    finally:
        torch.set_default_dtype(previous)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model64 = model.to(torch.float64)
    assert model64(torch.randn(2, 3, 8, 8, dtype=torch.float64)).dtype == torch.float64


def test_default_model_args_fill_from_the_data():
    assert default_model_args("mlp", (2, 3, 4), 7) == {
        "in_features": 24,
        "num_classes": 7,
        "depth": 2,
        "width": 64,
        "activation": "relu",
        "bias": True,
        "dropout": 0.0,
        "mask_ratio": 0.0,
        "mask_seed": 0,
        "per_sample_norm": False,
    }
    assert default_model_args("resnet", (1, 28, 28), 10)["in_channels"] == 1
    assert (
        default_model_args("mlp", (16,), 3, in_features=16, activation=None)["activation"] == "relu"
    )
    assert default_model_args("mlp", (16,), 3, dropout=0)["dropout"] == 0.0
    assert default_model_args("mlp", (16,), 3, depth=3.0)["depth"] == 3
    assert model_input_shape({"name": "cnn", "args": default_model_args("cnn", (3, 8, 8), 2)}) == (
        3,
        8,
        8,
    )
    assert model_input_shape({"name": "mlp", "args": {"in_features": 5, "num_classes": 2}}) == (5,)
    # build_model fills optional args that a hand-written spec leaves out
    assert (
        validate_model_spec({"name": "mlp", "args": {"in_features": 5, "num_classes": 2}})["args"][
            "width"
        ]
        == 64
    )


@pytest.mark.parametrize(
    "call, source, fragment",
    [
        (
            lambda: default_model_args("transformer", (4,), 2),
            "model",
            "unknown model 'transformer'",
        ),
        (
            lambda: build_model({"name": "vgg", "args": {}}),
            "model",
            "accepted: mlp, cnn, vgg-small, resnet",
        ),
        (lambda: build_model(["mlp"]), "model", "JSON object"),
        (lambda: default_model_args("cnn", (16,), 2), "model", "needs image inputs"),
        (
            lambda: default_model_args("mlp", (4,), 2, heads=3),
            "model_args",
            "unknown argument(s) heads",
        ),
        (
            lambda: default_model_args("mlp", (4,), 2, depth="2"),
            "model_args",
            "depth must be an integer",
        ),
        (
            lambda: default_model_args("mlp", (4,), 2, depth=True),
            "model_args",
            "depth must be an integer",
        ),
        (lambda: default_model_args("mlp", (4,), 2, width=0), "model_args", "width must be >= 1"),
        (
            lambda: default_model_args("mlp", (4,), 2, dropout=1.0),
            "model_args",
            "dropout must be < 1",
        ),
        (
            lambda: default_model_args("mlp", (4,), 2, bias="yes"),
            "model_args",
            "bias must be true or false",
        ),
        (
            lambda: default_model_args("mlp", (4,), 2, in_features=5),
            "model_args",
            "contradicts the data",
        ),
        (
            lambda: default_model_args("cnn", (3, 8, 8), 2, channels=[]),
            "model_args",
            "non-empty list",
        ),
        (
            lambda: default_model_args("cnn", (3, 8, 8), 2, channels=[2, 2, 2, 2]),
            "model_args",
            "at least 16 pixels",
        ),
        (
            lambda: default_model_args("vgg-small", (3, 8, 8), 2, width_multiplier=0),
            "model_args",
            "must be > 0",
        ),
        (lambda: default_model_args("resnet", (3, 8, 8), 2, depth=21), "model_args", "6n+2"),
        (
            lambda: build_model({"name": "mlp", "args": {"num_classes": 2}}),
            "model_args",
            "missing required argument in_features",
        ),
        (
            lambda: default_model_args("mlp", (4,), 2, activation="swish"),
            "activation",
            "unknown activation",
        ),
    ],
)
def test_bad_model_specs_raise_usage_errors(call, source, fragment):
    with pytest.raises(UsageError) as info:
        call()
    assert info.value.source == source
    assert fragment in info.value.message
    assert "\n" not in info.value.one_line()


def test_final_linear_on_foreign_modules():
    foreign = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3)
    )
    assert final_linear(foreign) == ("4", foreign[4])
    assert [n for n, _ in activation_modules(foreign)] == ["3"]
    with pytest.raises(UsageError) as info:
        final_linear(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()))
    assert info.value.source == "params" and "no nn.Linear" in info.value.message
