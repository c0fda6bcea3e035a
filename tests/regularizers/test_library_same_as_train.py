"""Same numbers everywhere: a loop with sharpcli.regularizers and ``sharp train --reg`` with the
same settings (float64, fixed seeds) end with identical weights.

The loop repeats what the trainer draws (docs/own-loop.md, "Same numbers as sharp train"):
the model built from ``seed``, the epoch's permutation from a generator seeded ``seed + 1``,
the regularizer's draws from one seeded ``seed + 2``, and SGD with momentum.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from sharpcli import regularizers
from sharpcli.losses import get_loss
from sharpcli.training.config import TrainConfig
from sharpcli.training.loop import _build_model, _load_splits, _place_splits, train


def _config(spec: str) -> TrainConfig:
    return TrainConfig(
        model="mlp",
        model_args={"width": 12, "depth": 2, "activation": "gelu"},
        data="blobs:n=48,dim=6,classes=3,seed=2",
        epochs=2,
        batch_size=16,
        lr=0.1,
        momentum=0.9,
        regs=[spec],
        dtype="float64",
        seed=7,
    )


def _library_loop(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    splits = _load_splits(cfg)
    model, _ = _build_model(cfg, splits, list(cfg.regs), torch.float64, torch.device("cpu"))
    _place_splits(cfg, splits, model, torch.float64, torch.device("cpu"))
    loss_of = get_loss(cfg.loss).mean
    shuffle = torch.Generator().manual_seed(cfg.seed + 1)
    draws = torch.Generator().manual_seed(cfg.seed + 2)
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # an oracle wraps the optimizer; a penalty takes none (it is added to the loss)
    oracle = regularizers.names()[cfg.regs[0].name] == "oracle"
    made = regularizers.make(cfg.regs[0], sgd if oracle else None, model=model, generator=draws)
    model.train()
    x, y = splits.x_train, splits.y_train
    for _ in range(cfg.epochs):
        perm = torch.randperm(x.shape[0], generator=shuffle)
        for start in range(0, x.shape[0], cfg.batch_size):
            xb, yb = (
                x[perm[start : start + cfg.batch_size]],
                y[perm[start : start + cfg.batch_size]],
            )
            if isinstance(made, regularizers.PerturbedOptimizer):

                def closure():
                    loss = loss_of(model(xb), yb)
                    loss.backward()
                    return loss

                made.step(closure)
            else:
                sgd.zero_grad()
                logits = model(xb)
                loss = loss_of(logits, yb)
                (loss + made(loss, logits, yb)).backward()
                sgd.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("spec", ["sam:rho=0.1", "asam", "gp:rho=0.05", "gn-trace:sigma2=0.05"])
def test_a_library_loop_ends_where_sharp_train_ends(spec, tmp_path):
    cfg = _config(spec)
    train(copy.deepcopy(cfg), tmp_path / "model.safetensors")
    trained = load_file(str(tmp_path / "model.safetensors"))
    mine = _library_loop(copy.deepcopy(cfg))
    assert set(mine) <= set(trained)
    for name, value in mine.items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=1e-14, msg=f"{spec}: {name}")
    start = _config("none")
    splits = _load_splits(start)
    initial, _ = _build_model(start, splits, [], torch.float64, torch.device("cpu"))
    moved = max((initial.state_dict()[k] - v).abs().max() for k, v in mine.items())
    assert moved > 1e-3  # the runs trained
