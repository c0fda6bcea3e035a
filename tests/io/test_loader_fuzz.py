"""Property tests for the checkpoint loader ``sharpcli.io.checkpoints.load_checkpoint``.

Whatever a checkpoint file holds (random bytes under any accepted extension, a valid file with
bytes overwritten or cut off, random tensor dicts with random dtypes, shapes, NaN/Inf values and
random metadata), the loader either returns a model that meets the contract (the state_dict of
the rebuilt model has exactly the file's names and shapes, every weight finite) or raises a
``sharpcli.errors.SharpError`` subclass with a one-line message. Any other exception is a bug:
the CLI would show it as an internal error instead of exit code 2.

The dataset loader has its own fuzz suite (tests/io/test_datasets_fuzz.py); this file covers
checkpoints only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from fixtures.make_checkpoint_fixtures import (
    tiny_mlp_spec,
    write_foreign_state_dict,
    write_own_checkpoint,
)
from sharpcli.errors import SharpError
from sharpcli.io.checkpoints import (
    META_DATA,
    META_FORMAT,
    META_METRICS,
    META_MODEL,
    META_TRAIN,
    LoadedCheckpoint,
    load_checkpoint,
)

FUZZ = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
EXTENSIONS = [".safetensors", ".pt", ".pth", ".bin"]

# A 4 -> 3 -> 2 ReLU MLP: state_dict names 0.weight (3, 4), 0.bias (3,), 2.weight (2, 3), 2.bias (2,).
TINY_MLP = tiny_mlp_spec(d_in=4, classes=2, width=3, depth=1)
ARCH_ARGS = TINY_MLP["args"]
TRUE_SHAPES = {"0.weight": (3, 4), "0.bias": (3,), "2.weight": (2, 3), "2.bias": (2,)}


def load_or_sharp_error(
    path: str, *, override: bool, trust_pickle: bool = False
) -> LoadedCheckpoint | None:
    """Load ``path``; only SharpError may escape, and a successful load must meet the contract."""
    kwargs = {"arch": "mlp", "arch_args": dict(ARCH_ARGS)} if override else {}
    try:
        loaded = load_checkpoint(path, trust_pickle=trust_pickle, **kwargs)
    except SharpError as exc:
        line = exc.one_line()
        assert line and "\n" not in line
        assert exc.exit_code == 2, (
            type(exc).__name__,
            line,
        )  # a bad file is bad input, never "numerical"
        return None
    check_loaded(loaded, path)
    return loaded


def check_loaded(loaded: LoadedCheckpoint, path: str) -> None:
    """What every successful load guarantees: a module with finite weights and a sha256 of the file."""
    assert isinstance(loaded.model, torch.nn.Module)
    for name, tensor in loaded.model.state_dict().items():
        if tensor.is_floating_point():
            assert bool(torch.isfinite(tensor).all()), name
    assert loaded.path == str(path)
    assert len(loaded.sha256) == 64
    json.dumps(loaded.info())  # the report's checkpoint block is JSON-serialisable


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    """Overwrite bytes at (position mod length), then optionally truncate to ``cut`` bytes."""
    buffer = bytearray(data)
    for position, value in edits:
        buffer[position % len(buffer)] = value
    return bytes(buffer[:cut] if cut is not None else buffer)


byte_edits = st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8)


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory) -> dict[str, bytes]:
    """Bytes of valid checkpoints to mutate: own .safetensors, foreign .safetensors and .pt state_dicts."""
    from sharpcli.models import build_model

    root = tmp_path_factory.mktemp("valid_checkpoints")
    torch.manual_seed(0)
    model = build_model(TINY_MLP)
    own = write_own_checkpoint(
        root / "own.safetensors",
        spec=TINY_MLP,
        data_spec={"kind": "builtin", "name": "blobs", "args": {"n": 8, "dim": 4, "classes": 2}},
    )
    return {
        "own.safetensors": own.read_bytes(),
        "foreign.safetensors": write_foreign_state_dict(
            root / "foreign.safetensors", model
        ).read_bytes(),
        "foreign.pt": write_foreign_state_dict(root / "foreign.pt", model).read_bytes(),
    }


def test_unmutated_fixtures_load(valid_bytes, tmp_path):
    """The mutation sources are themselves valid: every one loads (own without flags, foreign with --arch)."""
    for name, data in valid_bytes.items():
        path = tmp_path / name
        path.write_bytes(data)
        loaded = load_or_sharp_error(str(path), override=not name.startswith("own"))
        assert loaded is not None, name
        assert {k: tuple(v.shape) for k, v in loaded.model.state_dict().items()} == TRUE_SHAPES


@FUZZ
@given(
    ext=st.sampled_from(EXTENSIONS),
    payload=st.binary(max_size=600),
    override=st.booleans(),
    trust_pickle=st.booleans(),
)
def test_random_bytes_under_every_extension(ext, payload, override, trust_pickle):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model" + ext)
        Path(path).write_bytes(payload)
        load_or_sharp_error(path, override=override, trust_pickle=trust_pickle)


@FUZZ
@given(
    source=st.sampled_from(["own.safetensors", "foreign.safetensors", "foreign.pt"]),
    edits=byte_edits,
    cut=st.none() | st.integers(0, 4000),
    override=st.booleans(),
    rename=st.sampled_from([None, ".safetensors", ".pt", ".pth"]),
)
def test_mutated_and_truncated_valid_checkpoints(valid_bytes, source, edits, cut, override, rename):
    """Flipped bytes, truncation, and a valid file under the other format's extension."""
    ext = rename or Path(source).suffix
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model" + ext)
        Path(path).write_bytes(mutate(valid_bytes[source], edits, cut))
        load_or_sharp_error(path, override=override)


TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
special_values = st.sampled_from(
    [0.0, -1.0, 0.5, 2.0, 1e39, -1e39, float("nan"), float("inf"), float("-inf"), 1e30, -3.0]
)


@st.composite
def tensors(draw, shape=None):
    """One tensor: a random (or given) small shape, a random dtype, values with NaN/Inf/huge numbers."""
    if shape is None:
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    size = int(np.prod(shape)) if shape else 1
    values = torch.tensor(
        draw(st.lists(special_values | st.floats(-4, 4), min_size=size, max_size=size)),
        dtype=torch.float64,
    ).reshape(shape)
    if not dtype.is_floating_point:
        values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0).clamp(-100, 100)
        if dtype == torch.uint8:
            values = values.abs()
    return values.to(dtype)


@st.composite
def state_dicts(draw):
    """Names drawn from the MLP's own (with right or wrong shapes) plus strays; any subset."""
    names = draw(
        st.lists(
            st.sampled_from([*TRUE_SHAPES, "1.weight", "head.bias", "", "0.weight.extra"]),
            unique=True,
            max_size=6,
        )
    )
    out = {}
    for name in names:
        right_shape = name in TRUE_SHAPES and draw(st.booleans())
        out[name] = draw(tensors(TRUE_SHAPES[name] if right_shape else None))
    return out


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.floats(allow_nan=False, width=32)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
model_args = st.fixed_dictionaries(
    {},
    optional={
        "in_features": st.integers(-2, 6),
        "num_classes": st.integers(-2, 4),
        "width": st.integers(-1, 5),
        "depth": st.integers(-1, 2),
        "activation": st.sampled_from(["relu", "gelu", "tanh", "beta-gelu:beta=x", ""]),
        "bias": st.booleans() | st.integers(0, 2),
        "bogus": json_scalars,
    },
)
model_meta = st.one_of(
    st.builds(
        lambda name, args: json.dumps({"name": name, "args": args}),
        st.sampled_from(["mlp", "cnn", "resnet", "transformer", ""]),
        model_args,
    ),
    json_values.map(json.dumps),
    st.text(max_size=20),  # not JSON at all
)
metadata = st.fixed_dictionaries(
    {},
    optional={
        META_FORMAT: st.sampled_from(["1", "2", "", "x"]),
        META_MODEL: model_meta | st.just(json.dumps(TINY_MLP)),
        META_DATA: json_values.map(json.dumps) | st.text(max_size=10),
        META_TRAIN: json_values.map(json.dumps) | st.text(max_size=10),
        META_METRICS: json_values.map(json.dumps) | st.text(max_size=10),
        "other": st.text(max_size=10),
    },
)


@FUZZ
@given(state=state_dicts(), meta=metadata, override=st.booleans())
def test_random_safetensors_state_dicts_with_random_metadata(state, meta, override):
    """A safetensors file of random tensors and metadata, loaded as is or with --arch mlp."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata=meta or None)
        loaded = load_or_sharp_error(path, override=override)
        if loaded is not None and override:
            # Loaded under --arch mlp: exactly the file's names and shapes, nothing invented or dropped.
            assert set(state) == set(TRUE_SHAPES)
            assert {k: tuple(v.shape) for k, v in state.items()} == TRUE_SHAPES


@FUZZ
@given(
    dtypes=st.lists(st.sampled_from(TORCH_DTYPES), min_size=4, max_size=4),
    data=st.data(),
    own=st.booleans(),
)
def test_right_names_and_shapes_with_random_dtypes_and_values(dtypes, data, own):
    """Names and shapes fit the model; dtypes and values are random (NaN, Inf, beyond float32).

    Loaded (as an own checkpoint with the spec in its metadata, or with --arch mlp) the weights
    are the file's values cast, bit for bit, to the model's dtype: float32, or the file's widest
    floating dtype where that is wider (a float64 checkpoint must reach a float64 analysis
    exactly); whenever that cast has a NaN or Inf anywhere the load is refused with an
    InputError naming the file.
    """
    from sharpcli.errors import InputError

    state = {name: data.draw(tensors(shape)) for name, shape in TRUE_SHAPES.items()}
    state = {
        name: t.to(dtype) if t.dtype != dtype else t
        for (name, t), dtype in zip(state.items(), dtypes)
    }
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    wide = any(torch.finfo(d).bits > 32 for d in floating)
    model_dtype = torch.float64 if wide else torch.float32
    cast = {name: t.to(model_dtype) for name, t in state.items()}
    all_finite = all(bool(torch.isfinite(t).all()) for t in cast.values())
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.safetensors")
        meta = {META_FORMAT: "1", META_MODEL: json.dumps(TINY_MLP)} if own else None
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata=meta)
        if not all_finite:
            with pytest.raises(InputError) as info:
                load_checkpoint(
                    path, **({} if own else {"arch": "mlp", "arch_args": dict(ARCH_ARGS)})
                )
            assert info.value.source == path
            return
        loaded = load_or_sharp_error(path, override=not own)
        if loaded is not None:
            for name, value in loaded.model.state_dict().items():
                assert torch.equal(value, cast[name]), name


@FUZZ
@given(
    state=state_dicts(),
    wrap=st.sampled_from(["plain", "state_dict", "list", "tensor"]),
    ext=st.sampled_from([".pt", ".pth", ".bin"]),
    trust_pickle=st.booleans(),
)
def test_random_torch_state_dicts(state, wrap, ext, trust_pickle):
    """``torch.save`` of a random state_dict, a {'state_dict': ...} wrapper, a list, or a bare tensor."""
    payload = {
        "plain": state,
        "state_dict": {"state_dict": state, "epoch": 3},
        "list": list(state.values()),
        "tensor": torch.zeros(2),
    }[wrap]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model" + ext)
        torch.save(payload, path)
        loaded = load_or_sharp_error(path, override=True, trust_pickle=trust_pickle)
        if loaded is not None:
            assert wrap in ("plain", "state_dict")
            assert {k: tuple(v.shape) for k, v in state.items()} == TRUE_SHAPES


def test_nan_and_inf_weights_are_refused_naming_the_tensor(tmp_path):
    """A finite-shaped, right-named state_dict with one NaN (or Inf) is an InputError naming the tensor."""
    from sharpcli.errors import InputError
    from sharpcli.models import build_model

    torch.manual_seed(0)
    state = build_model(TINY_MLP).state_dict()
    for bad in (float("nan"), float("inf")):
        broken = {k: v.clone() for k, v in state.items()}
        broken["2.bias"][1] = bad
        path = tmp_path / f"bad_{bad}.safetensors"
        save_file(broken, str(path))
        with pytest.raises(InputError) as info:
            load_checkpoint(path, arch="mlp", arch_args=dict(ARCH_ARGS))
        assert info.value.source == str(path)
        assert "2.bias" in info.value.message and "NaN or Inf" in info.value.message
