"""The optimizer wrapper of sharpcli.regularizers: SAM against a hand-written SAM step, the
oracles against sharp train's step, gradient accumulation, BatchNorm buffers, ASAM's scale,
mixed precision and the grad scaler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli import regularizers
from sharpcli.errors import UsageError
from sharpcli.regularizers import registry as registry
from sharpcli.regularizers.base import Oracle, PerturbationOracle
from sharpcli.regularizers.perturbed.sam import SAM
from sharpcli.regularizers.registry import parse_reg
from sharpcli.regularizers.step import training_step
from sharpcli.specs import Param


def _mlp(dtype=torch.float64, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(n=16, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen, dtype=dtype), torch.randint(0, 3, (n,), generator=gen)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _closure(model, x, y):
    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return closure


def _hand_sam(model, x, y, rho, lr):
    """SAM (Foret et al. 2021, Alg. 1) written out: e = rho g/||g||, w -= lr grad L(w + e)."""
    params = list(model.parameters())
    g = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    norm = torch.sqrt(sum((a * a).sum() for a in g))
    e = [rho * a / norm for a in g]
    with torch.no_grad():
        for p, d in zip(params, e):
            p.add_(d)
    g_perturbed = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    with torch.no_grad():
        for p, d, a in zip(params, e, g_perturbed):
            p.sub_(d)
            p.sub_(lr * a)


@pytest.mark.parametrize("form", ["closure", "two-call"])
def test_sam_equals_a_hand_written_sam_step(form):
    model, x, y = _mlp(), *_batch()
    reference = copy.deepcopy(model)
    opt = regularizers.make("sam:rho=0.1", torch.optim.SGD(model.parameters(), lr=0.5))
    for _ in range(3):
        if form == "closure":
            opt.step(_closure(model, x, y))
        else:
            F.cross_entropy(model(x), y).backward()
            opt.first_step(zero_grad=True)
            F.cross_entropy(model(x), y).backward()
            opt.second_step(zero_grad=True)
        _hand_sam(reference, x, y, rho=0.1, lr=0.5)
    torch.testing.assert_close(_flat(model), _flat(reference), rtol=0, atol=1e-14)
    assert (_flat(model) - _flat(_mlp())).abs().max() > 1e-3  # the weights moved


@pytest.mark.parametrize(
    "spec",
    [
        "sam",
        "usam:rho=0.3",
        "asam:rho=0.5,eta=0.01",
        "weight-noise:sigma=0.05",
        "nso:sigma=0.05,k=2",
    ],
)
def test_each_oracle_takes_the_step_sharp_train_takes(spec):
    """One step of the wrapper = sharp train's step gradient (training_step) applied by SGD."""
    model, x, y = _mlp(), *_batch()
    trainer_model = copy.deepcopy(model)
    training_step(
        trainer_model, x, y, "cross-entropy", [parse_reg(spec)], torch.Generator().manual_seed(3)
    )
    want = _flat(trainer_model) - torch.cat(
        [p.grad.reshape(-1) for p in trainer_model.parameters()]
    )
    opt = regularizers.make(
        spec, torch.optim.SGD(model.parameters(), lr=1.0), model=model,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    opt.step(_closure(model, x, y))
    torch.testing.assert_close(_flat(model), want, rtol=0, atol=1e-14)


def test_asam_scales_weights_by_name_as_the_official_code():
    """T = |w| + eta on every parameter named *weight* (BatchNorm's scale included), T = I on
    biases (github SamsungLabs/ASAM asam.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    opt = regularizers.make(
        "asam:rho=0.5,eta=0.01", torch.optim.SGD(model.parameters(), lr=0.1), model=model
    )
    F.cross_entropy(model(x), y).backward()
    names = [n for n, _ in model.named_parameters()]
    theta = [p.detach().clone() for p in model.parameters()]
    g = [p.grad.clone() for p in model.parameters()]
    opt.first_step()
    t = [(w.abs() + 0.01) if "weight" in n else torch.ones_like(w) for n, w in zip(names, theta)]
    norm = torch.sqrt(sum(((a * b) ** 2).sum() for a, b in zip(t, g)))
    for p, w, s, a, n in zip(model.parameters(), theta, t, g, names):
        torch.testing.assert_close(p.detach() - w, 0.5 * s * s * a / norm, rtol=1e-12, atol=1e-15)
    assert "1.weight" in names  # the BatchNorm scale is scaled, not the identity
    opt.second_step()


def test_accumulated_micro_batches_equal_the_large_batch_step():
    """The ascent on the accumulated gradient of k micro-batches (loss / k each) and the
    accumulated gradient at the perturbed weights: the large-batch SAM step (float64)."""
    model, x, y = _mlp(), *_batch(24)
    large = copy.deepcopy(model)
    opt = regularizers.make(
        "sam:rho=0.2", torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    )
    opt_large = regularizers.make(
        "sam:rho=0.2", torch.optim.SGD(large.parameters(), lr=0.3, momentum=0.9)
    )
    k = 3
    for _ in range(2):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (F.cross_entropy(model(xb), yb) / k).backward()
        opt.first_step(zero_grad=True)
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (F.cross_entropy(model(xb), yb) / k).backward()
        opt.second_step(zero_grad=True)
        opt_large.step(_closure(large, x, y))
    torch.testing.assert_close(_flat(model), _flat(large), rtol=0, atol=1e-14)


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).double()


@pytest.mark.parametrize("keep", [False, True])
def test_batchnorm_statistics_advance_once_per_step(keep):
    model = _bn_model()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    clean = copy.deepcopy(model)
    opt = regularizers.make(
        "sam:rho=0.5", torch.optim.SGD(model.parameters(), lr=0.1), model=model,
        perturbed_updates_buffers=keep,
    )  # fmt: skip
    bn = model[1]
    for step in range(1, 4):
        clean.load_state_dict(model.state_dict())
        clean(x)  # the clean pass's running statistics
        opt.step(_closure(model, x, y))
        assert int(bn.num_batches_tracked) == step * (2 if keep else 1)
        if not keep:
            torch.testing.assert_close(bn.running_mean, clean[1].running_mean, rtol=0, atol=0)
    if keep:
        assert not torch.equal(bn.running_mean, clean[1].running_mean)


def test_the_wrapper_refuses_what_it_cannot_run():
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="wraps an optimizer"):
        regularizers.make("sam")
    with pytest.raises(UsageError, match="ascent_sync"):
        regularizers.make("sam", sgd, ascent_sync="local")
    with pytest.raises(UsageError, match="step\\(closure\\)"):
        regularizers.make("nso", sgd).first_step()
    with pytest.raises(UsageError, match="nn.Dropout"):
        regularizers.make("dropout", sgd)
    with pytest.raises(UsageError, match="unknown parameter 'radius'"):
        regularizers.make("sam:radius=0.1", sgd)
    opt = regularizers.make("sam", sgd)
    assert opt.state_dict() == sgd.state_dict()
    assert opt.param_groups is sgd.param_groups


@pytest.mark.parametrize(
    "handed, words",
    [
        ("model", r"got the model \(Sequential\)"),
        ("iterator", r"got parameters \(generator\)"),
        ("list", r"got parameters \(list\)"),
    ],
)
def test_something_else_than_an_optimizer_is_named_not_an_attribute_error(handed, words):
    """The model or its parameters in the optimizer's place: a UsageError on ``optimizer``
    saying what it got and the call that works (was an AttributeError on ``param_groups``
    from inside the wrapper); the same from the wrapper's own constructor, None too."""
    model = _mlp()
    wrong = {"model": model, "iterator": model.parameters(), "list": list(model.parameters())}
    with pytest.raises(UsageError, match=words) as info:
        regularizers.make("sam:rho=0.1", wrong[handed], model=model)
    assert info.value.source == "optimizer"
    assert "torch.optim.SGD(model.parameters()" in info.value.message
    with pytest.raises(UsageError, match="got None") as info:
        regularizers.PerturbedOptimizer(None, parse_reg("sam"))
    assert info.value.source == "optimizer"


def test_a_penalty_handed_an_optimizer_refuses_it_rather_than_ignore_it():
    """A penalty is a loss term: an optimizer (or the model) in the optimizer's place was
    silently unused; now a UsageError on ``optimizer`` with the call that works."""
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for handed, words in ((sgd, "got an optimizer"), (model, "got the model")):
        with pytest.raises(UsageError, match=words) as info:
            regularizers.make("gp:rho=0.1", handed, model=model)
        assert info.value.source == "optimizer" and "model=model" in info.value.message
    assert isinstance(regularizers.make("gp:rho=0.1", model=model), regularizers.LossPenalty)


# --------------------------------------------------------------------------- mixed precision
def _sam_step_update(dtype, autocast=None, scaler=None, rho=0.05, lr=0.1):
    model = _mlp(torch.float32)
    x, y = _batch(32, torch.float32)
    opt = regularizers.make(
        f"sam:rho={rho}",
        torch.optim.SGD(model.parameters(), lr=lr),
        model=model,
        grad_scaler=scaler,
    )
    before = _flat(model).clone()

    def closure():
        with torch.autocast("cpu", dtype=dtype, enabled=autocast is not None):
            loss = F.cross_entropy(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    opt.step(closure)
    return _flat(model) - before, scaler


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_gives_the_float32_update_within_its_precision(dtype):
    reference, _ = _sam_step_update(torch.float32)
    try:
        update, _ = _sam_step_update(dtype, autocast=True)
    except RuntimeError as exc:  # float16 autocast on CPU needs a recent torch
        pytest.skip(f"CPU autocast {dtype}: {exc}")
    eps = torch.finfo(dtype).eps
    assert (update - reference).norm() <= 2 * eps * reference.norm()
    assert (update - reference).norm() > 0  # it did run in the lower precision


def test_grad_scaler_ascent_uses_unscaled_gradients():
    """A forced scale 2^12: the same update as without a scaler (powers of two scale exactly)."""
    reference, _ = _sam_step_update(torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    update, scaler = _sam_step_update(torch.float32, scaler=scaler)
    torch.testing.assert_close(update, reference, rtol=1e-6, atol=1e-9)
    assert scaler.get_scale() == 2.0**12  # no inf: the scale stays (growth after 2000 steps)


@pytest.mark.parametrize("which", ["clean", "perturbed"])
def test_a_non_finite_pass_skips_the_step_and_backs_off_the_scale(which):
    model = _mlp(torch.float32)
    x, y = _batch(16, torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = regularizers.make(
        "sam", torch.optim.SGD(model.parameters(), lr=0.1), model=model, grad_scaler=scaler
    )
    before = _flat(model).clone()
    calls = []

    def closure():
        calls.append(1)
        poisoned = (len(calls) == 1) == (which == "clean")
        xb = x * float("inf") if poisoned else x
        loss = F.cross_entropy(model(xb), y)
        scaler.scale(loss).backward()
        return loss

    opt.step(closure)
    assert torch.equal(_flat(model), before)  # skipped, theta restored
    assert scaler.get_scale() == 2.0**11  # backed off
    calls.clear()
    opt.step(_closure_scaled(model, x, y, scaler))
    assert not torch.equal(_flat(model), before)  # the next finite step is taken


def _closure_scaled(model, x, y, scaler):
    def closure():
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        return loss

    return closure


def test_every_regularizer_has_the_names_and_defaults_of_sharp_train_reg():
    """make(NAME) holds the hyper-parameters --reg NAME holds (one declaration for both)."""
    model = _mlp()
    classes = dict(registry.REGISTRY.items())
    assert set(regularizers.names()) == {
        n for n, cls in classes.items() if cls.kind in ("oracle", "penalty")
    }
    for name, kind in regularizers.names().items():
        sgd = torch.optim.SGD(model.parameters(), lr=0.1) if kind == "oracle" else None
        made = regularizers.make(name, sgd, model=model)
        assert isinstance(
            made, regularizers.PerturbedOptimizer if kind == "oracle" else regularizers.LossPenalty
        )
        defaults = {h.name: h.default for h in classes[name].HYPERPARAMS}
        assert made.regularizer.params == defaults
        assert made.regularizer == parse_reg(name)


def test_an_extension_oracle_is_refused_and_a_sam_variant_runs():
    """An oracle of one's own defines gradient(engine), which only sharp train runs; a
    subclass of SAM moves along SAM's perturbation, which the wrapper applies."""
    own = type(
        "OwnOracle",
        (Oracle,),
        {
            "__doc__": "``own-oracle``: one's own.",
            "name": "own-oracle",
            "summary": "one's own",
            "data_parallel": None,
        },
    )
    variant = type(
        "SAM2",
        (SAM,),
        {"__doc__": "``sam2:rho``: a SAM variant.", "name": "sam2", "data_parallel": "global"},
    )
    registry.register(own)
    registry.register(variant)
    try:
        assert "own-oracle" not in regularizers.names()
        assert regularizers.names()["sam2"] == "oracle"
        model = _mlp()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(UsageError, match="train this oracle with `sharp train`"):
            regularizers.make("own-oracle", sgd)
        x, y = _batch()
        reference = copy.deepcopy(model)
        regularizers.make("sam2:rho=0.1", sgd).step(_closure(model, x, y))
        regularizers.make("sam:rho=0.1", torch.optim.SGD(reference.parameters(), lr=0.1)).step(
            _closure(reference, x, y)
        )
        torch.testing.assert_close(_flat(model), _flat(reference), rtol=0, atol=0)
    finally:
        registry.unregister("own-oracle")
        registry.unregister("sam2")


def _mirror_oracle(reads_clean_gradient: bool) -> type[Oracle]:
    """An oracle of one's own, no built-in's subclass: the gradients at the two points
    ``theta +- c sign(theta)`` averaged, told to the wrapper by PerturbationOracle's methods."""

    def perturbations(self, weights, grads, names, generator):
        delta = [self.params["c"] * torch.sign(w) for w in weights]
        yield delta, 1.0
        yield delta, -1.0

    return type(
        "Mirror",
        (Oracle,),
        {
            "__doc__": "``mirror:c``: gradients at theta +- c sign(theta), averaged.",
            "name": "mirror",
            "summary": "mean gradient at theta +- c sign(theta)",
            "HYPERPARAMS": (Param("c", "float", 0.1, "offset", minimum=0.0),),
            "data_parallel": None,
            "reads_clean_gradient": lambda self: reads_clean_gradient,
            "perturbed_passes": lambda self: 2,
            "perturbations": perturbations,
        },
    )


def test_an_oracle_with_the_protocol_methods_runs_in_ones_own_loop():
    """A new oracle needs no edit of the wrapper: the step is SGD on the mean of the gradients
    at its points, computed here by autograd in float64; one reading the clean gradient at
    several points is refused (the wrapper runs no clean pass there)."""
    mirror = _mirror_oracle(reads_clean_gradient=False)
    assert isinstance(mirror(), PerturbationOracle)
    registry.register(mirror)
    try:
        assert regularizers.names()["mirror"] == "oracle"
        model, (x, y), c, lr = _mlp(), _batch(), 0.1, 0.1
        theta = [p.detach().clone() for p in model.parameters()]
        grads = []
        for sign in (1.0, -1.0):
            moved = copy.deepcopy(model)
            with torch.no_grad():
                for p in moved.parameters():
                    p.add_(sign * c * torch.sign(p))
            grads.append(
                torch.autograd.grad(F.cross_entropy(moved(x), y), list(moved.parameters()))
            )
        expected = torch.cat(
            [(t - lr * (gp + gm) / 2).reshape(-1) for t, gp, gm in zip(theta, *grads)]
        )
        optimizer = regularizers.make(
            "mirror:c=0.1", torch.optim.SGD(model.parameters(), lr=lr), model=model
        )
        assert optimizer.perturbed_passes == 2 and not optimizer.reads_clean_gradient
        optimizer.step(_closure(model, x, y))
        torch.testing.assert_close(_flat(model), expected, rtol=1e-14, atol=1e-15)
        with pytest.raises(UsageError, match="averages 2 passes"):
            optimizer.first_step()
    finally:
        registry.unregister("mirror")
    with pytest.raises(UsageError, match="reads no clean gradient"):
        regularizers.make(
            _mirror_oracle(reads_clean_gradient=True)(),
            torch.optim.SGD(_mlp().parameters(), lr=0.1),
        )
