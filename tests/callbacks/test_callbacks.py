"""Sharpness tracked in training loops: ``sharpcli.Tracker`` in a plain loop, the Lightning and
Hugging Face Trainer callbacks in 2-step runs on tiny models built from code and configs (no
downloads). Each logs through the host's logger, and the values logged at the last step equal
``Curvature`` on the final weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharpcli import Curvature, Tracker
from sharpcli.errors import UsageError


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(n=48, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _lambda_max(model, loss, data):
    return Curvature(model, loss, data).eigenvalues(top_k=1, tol=1e-3).eigenvalues[0]


def test_tracker_in_a_plain_loop_measures_every_n_steps_without_touching_the_rng():
    model = _mlp()
    x, y = _data()
    probe = (x[:16], y[:16])
    tracker = Tracker(
        nn.CrossEntropyLoss(), probe, every=2, metrics=["eigen", "trace", "gn-nme"], max_matvecs=60
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    results = []
    for _ in range(4):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        state = torch.get_rng_state()
        results.append(tracker.step(model))
        assert torch.equal(state, torch.get_rng_state())
    assert [r is None for r in results] == [True, False, True, False]
    assert [h["step"] for h in tracker.history] == [2, 4]
    last = results[-1]
    assert last["sharpness/lambda_max"] == pytest.approx(
        _lambda_max(model, "cross-entropy", probe), rel=1e-6
    )
    assert last["sharpness/trace"] > 0 and 0 < last["sharpness/matvecs"] <= 3 * 60 + 60
    assert last["sharpness/ggn_trace"] + last["sharpness/nme_trace"] == pytest.approx(
        last["sharpness/nme_trace"] / last["sharpness/nme_share"], rel=1e-9
    )
    assert model.training
    # the budget bounds each metric's products
    lean = Tracker("cross-entropy", probe, every=1, metrics=["eigen"], max_matvecs=4)
    assert lean.step(model)["sharpness/matvecs"] <= 4


@pytest.mark.parametrize(
    "options, source",
    [
        ({"every": 0}, "every"),
        ({"metrics": ["curvature"]}, "metrics"),
        ({"metrics": []}, "metrics"),
        ({"max_matvecs": 0}, "max_matvecs"),
        ({"tol": -1.0}, "tol"),
    ],
)
def test_tracker_options_are_checked(options, source):
    with pytest.raises(UsageError) as info:
        Tracker("cross-entropy", _data(), **options)
    assert info.value.source == source


def test_tracker_hands_one_step_context_with_the_optimizer_to_each_measurement():
    """``Tracker(optimizer=...)``: one StepContext for the Tracker's life (warm starts kept
    in it persist), filled at each measurement with the optimizer, the step count and the
    training batch size; an optimizer given to ``step`` replaces it."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = Tracker(
        nn.CrossEntropyLoss(), (x[:16], y[:16]), every=1, optimizer=optimizer, train_batch_size=32
    )
    context = tracker.context
    tracker.step(model)
    context.warm["probe"] = "kept"
    assert (context.optimizer, context.step, context.batch_size) == (optimizer, 1, 32)
    other = torch.optim.Adam(model.parameters(), lr=0.1)
    tracker.step(model, optimizer=other)
    assert tracker.context is context and context.warm["probe"] == "kept"
    assert set(context.warm) == {"probe", "eigen"}  # eigen's warm start, kept beside it
    assert (context.optimizer, context.step) == (other, 2)


def test_lightning_callback_logs_through_the_trainers_loggers(tmp_path):
    lightning = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import Logger
    from torch.utils.data import DataLoader, TensorDataset

    from sharpcli.callbacks.lightning import SharpnessCallback

    class Recorder(Logger):
        def __init__(self):
            super().__init__()
            self.rows = []

        name, version = "recorder", 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    x, y = _data()
    probe = (x[:16], y[:16])
    callback = SharpnessCallback(nn.CrossEntropyLoss(), probe, every=1, metrics=["eigen", "trace"])
    recorder = Recorder()
    trainer = lightning.Trainer(
        max_steps=2,
        callbacks=[callback],
        logger=recorder,
        log_every_n_steps=1,
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    logged = [(step, m) for step, m in recorder.rows if "sharpness/lambda_max" in m]
    assert len(logged) == 2 and [h["step"] for h in callback.tracker.history] == [1, 2]
    assert {"sharpness/trace", "sharpness/matvecs", "sharpness/seconds"} <= set(logged[-1][1])
    assert logged[-1][1]["sharpness/lambda_max"] == pytest.approx(
        _lambda_max(module, "cross-entropy", probe), rel=1e-5
    )
    assert "sharpness/lambda_max" in trainer.callback_metrics
    # the trainer's optimizer and batch size reach the stability quantities (StepContext)
    context = callback.tracker.context
    assert context.optimizer is trainer.optimizers[0] and context.step == 2
    assert context.batch_size == 16


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=8,
        num_labels=3,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers, transformers.BertForSequenceClassification(config)


def _token_batch(n=16, length=6, seed=3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 20, (n, length), generator=gen)
    lengths = torch.randint(3, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (n,), generator=gen),
    }


def test_hugging_face_trainer_callback_logs_through_trainer_log(tmp_path):
    transformers, model = _tiny_bert()
    from sharpcli.callbacks.hf import SharpnessCallback

    train = _token_batch(32, seed=4)
    rows = [{k: v[i] for k, v in train.items()} for i in range(32)]
    probe = _token_batch(12)

    class Seen(transformers.TrainerCallback):  # a reporting integration's view of the logs
        logs: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[Seen()])
    callback = SharpnessCallback(nn.CrossEntropyLoss(), probe, every=1, metrics=["eigen"])
    callback.attach(trainer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "sharpness/lambda_max" in h]
    assert [h["step"] for h in logged] == [1, 2]
    assert [h["step"] for h in callback.tracker.history] == [1, 2]
    assert any("sharpness/lambda_max" in logs for logs in Seen.logs)
    assert model.training  # the trainer's mode is left as it was
    assert logged[-1]["sharpness/lambda_max"] == pytest.approx(
        _lambda_max(model, nn.CrossEntropyLoss(), probe), rel=1e-5
    )
    # the trainer's own torch optimizer (accelerate's wrapper taken off) and batch size
    context = callback.tracker.context
    assert isinstance(context.optimizer, torch.optim.AdamW) and context.step == 2
    assert context.optimizer.param_groups[0]["params"][0] is next(model.parameters())
    assert context.batch_size == 8


def test_hugging_face_callback_without_attach_is_refused(tmp_path):
    transformers, model = _tiny_bert()
    from sharpcli.callbacks.hf import SharpnessCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no"
    )
    rows = [{k: v[i] for k, v in _token_batch(4).items()} for i in range(4)]
    callback = SharpnessCallback("cross-entropy", _token_batch(4), every=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
    with pytest.raises(UsageError, match="attach") as info:
        trainer.train()
    assert info.value.source == "trainer"


@pytest.mark.parametrize(
    "module, framework, extra",
    [
        ("sharpcli.callbacks.lightning", "lightning.pytorch", "lightning"),
        ("sharpcli.callbacks.hf", "transformers", "hf"),
    ],
)
def test_a_missing_framework_names_the_extra(module, framework, extra, monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, framework, None)  # import of it fails
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=rf"pip install sharpcli\[{extra}\]"):
        importlib.import_module(module)
