"""The regularizers of sharpcli.regularizers in host frameworks: a Hugging Face ``Trainer``
(RegularizedTrainer, with gradient accumulation) and a Lightning fit (automatic optimization,
the wrapper's ``step(closure)``), each 2 steps on a tiny model built from code or a config (no
downloads), ending with the weights of the plain loop with the same wrapper (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharpcli import regularizers

RHO, LR = 0.1, 0.1


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _plain_loop(model, batches, spec="sam:rho=0.1", steps=2):
    """The reference: the wrapper's closure form, each step on the whole of ``batches``."""
    opt = regularizers.make(spec, torch.optim.SGD(model.parameters(), lr=LR), model=model)
    for _ in range(steps):

        def closure():
            loss = batches()
            loss.backward()
            return loss

        opt.step(closure)
    return _flat(model)


def _tiny_bert(transformers):
    config = transformers.BertConfig(
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).double()


def _token_batch(n=8, length=6, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1, 20, (n, length), generator=gen),
        "attention_mask": torch.ones(n, length, dtype=torch.long),
        "labels": torch.randint(0, 3, (n,), generator=gen),
    }


def _hf_args(transformers, tmp_path, **options):
    return transformers.TrainingArguments(
        **{"max_steps": 2, **options},
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )


@pytest.mark.parametrize("spec", ["sam:rho=0.1", "asam:rho=0.5"])
def test_hugging_face_trainer_with_accumulation_takes_the_plain_loop_steps(tmp_path, spec):
    """2 updates of 2 accumulated micro-batches of 4: each update sees the whole 8-row set
    (in the sampler's order), so it is the plain loop's full-batch step."""
    transformers = pytest.importorskip("transformers")
    from sharpcli.callbacks.hf_trainer import RegularizedTrainer

    data = _token_batch()
    rows = [{k: v[i] for k, v in data.items()} for i in range(8)]
    model = _tiny_bert(transformers)
    reference = _tiny_bert(transformers)
    start = _flat(model).clone()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer = regularizers.make(spec, sgd, model=model)
    constant = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)
    trainer = RegularizedTrainer(
        model=model,
        args=_hf_args(transformers, tmp_path),
        train_dataset=rows,
        optimizers=(optimizer, constant),
    )
    trainer.train()
    want = _plain_loop(reference, lambda: reference(**data).loss, spec=spec)
    torch.testing.assert_close(_flat(model), want, rtol=0, atol=1e-13)
    assert (want - start).abs().max() > 1e-3


def test_hugging_face_trainer_under_bf16_autocast_is_the_float32_step_within_precision(tmp_path):
    """bf16=True on CPU (accelerate's autocast, no grad scaler): 2 SAM updates of 2 micro-batches
    end within bfloat16 precision of the float32 plain loop."""
    transformers = pytest.importorskip("transformers")
    from sharpcli.callbacks.hf_trainer import RegularizedTrainer

    data = _token_batch()
    model = _tiny_bert(transformers).float()
    reference = _tiny_bert(transformers).float()
    start = _flat(model).clone()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = RegularizedTrainer(
        model=model,
        args=_hf_args(transformers, tmp_path, bf16=True),
        train_dataset=[{k: v[i] for k, v in data.items()} for i in range(8)],
        optimizers=(
            regularizers.make("sam:rho=0.1", sgd, model=model),
            torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0),
        ),
    )
    trainer.train()
    want = _plain_loop(reference, lambda: reference(**data).loss)
    moved, error = (want - start).norm(), (_flat(model) - want).norm()
    assert 0 < error <= 2 * torch.finfo(torch.bfloat16).eps * moved  # bf16 ran, and is close


def test_hugging_face_trainer_adds_a_penalty_per_micro_batch(tmp_path):
    """gp through penalties=: each update is SGD on the mean over its 2 micro-batches (rows
    0-3 and 4-7, sequential sampling) of (loss + gp term)."""
    transformers = pytest.importorskip("transformers")
    from sharpcli.callbacks.hf_trainer import RegularizedTrainer

    data = _token_batch()
    model = _tiny_bert(transformers)
    reference = _tiny_bert(transformers)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = RegularizedTrainer(
        model=model,
        args=_hf_args(transformers, tmp_path, train_sampling_strategy="sequential"),
        train_dataset=[{k: v[i] for k, v in data.items()} for i in range(8)],
        optimizers=(sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)),
        penalties=[regularizers.make("gp:rho=0.1", model=model)],
    )
    trainer.train()
    plain = torch.optim.SGD(reference.parameters(), lr=LR)
    penalty = regularizers.make("gp:rho=0.1", model=reference)
    for _ in range(2):
        plain.zero_grad()
        for half in (slice(0, 4), slice(4, 8)):
            batch = {k: v[half] for k, v in data.items()}
            out = reference(**batch)
            ((out.loss + penalty(out.loss, out.logits, batch["labels"])) / 2).backward()
        plain.step()
    torch.testing.assert_close(_flat(model), _flat(reference), rtol=0, atol=1e-12)


def test_lightning_fit_takes_the_plain_loop_steps(tmp_path):
    lightning = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=gen)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            return nn.functional.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self):
            sgd = torch.optim.SGD(self.parameters(), lr=LR)
            return regularizers.make(f"sam:rho={RHO}", sgd, model=self)

    module = Module()
    start = _flat(module).clone()
    trainer = lightning.Trainer(
        max_steps=2,
        accelerator="cpu",
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    reference = mlp()
    want = _plain_loop(reference, lambda: nn.functional.cross_entropy(reference(x), y))
    torch.testing.assert_close(_flat(module), want, rtol=0, atol=1e-14)
    assert (want - start).abs().max() > 1e-3


def test_a_plain_step_without_the_perturbed_pass_is_refused():
    from sharpcli.errors import UsageError

    model = nn.Linear(2, 2)
    opt = regularizers.make("sam", torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(UsageError, match="step\\(closure\\)"):
        opt.step()


def _tiny_gpt2(transformers):
    config = transformers.GPT2Config(
        vocab_size=20,
        n_embd=8,
        n_layer=1,
        n_head=2,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


class _GradientAtStep:
    """A Trainer callback keeping the accumulated gradient the optimizer is about to apply."""

    def __init__(self, transformers, model):
        class Callback(transformers.TrainerCallback):
            def on_pre_optimizer_step(inner, args, state, control, **kwargs):
                self.grads.append(
                    torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])
                )

        self.grads: list[torch.Tensor] = []
        self.callback = Callback()


def _causal_batch(n=8, length=6, seed=5):
    """Token rows whose labels are the ids with -100 (unlabelled) at uneven counts per row:
    the two micro-batches of 4 rows hold different numbers of labelled tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (n, length), generator=gen)
    labels = ids.clone()
    for row, cut in enumerate([6, 6, 6, 6, 2, 3, 6, 4]):
        labels[row, cut:] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("which", ["bert-ignores-num-items", "gpt2-reads-num-items"])
def test_hugging_face_trainer_accumulated_gradient_is_the_full_batch_gradient(tmp_path, which):
    """2 micro-batches of 4 accumulated into one update: the gradient the optimizer applies
    is the float64 reference, the full 8-row batch's loss gradient plus
    the (batch-independent) ``wd`` penalty's. The Trainer decides the accumulation scaling
    from ``model_accepts_loss_kwargs`` alone: both models take ``**kwargs``; BERT's
    sequence-classification loss ignores ``num_items_in_batch`` (a per-micro-batch mean, to be
    divided by the steps), GPT-2's causal-LM loss divides by it (the token mean over the whole
    update, uneven token counts per micro-batch here)."""
    transformers = pytest.importorskip("transformers")
    from sharpcli.callbacks.hf_trainer import RegularizedTrainer

    build, data = (
        (_tiny_bert, _token_batch()) if which.startswith("bert") else (_tiny_gpt2, _causal_batch())
    )
    model, reference = build(transformers), build(transformers)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    seen = _GradientAtStep(transformers, model)
    trainer = RegularizedTrainer(
        model=model,
        args=_hf_args(transformers, tmp_path, max_steps=1, train_sampling_strategy="sequential"),
        train_dataset=[{k: v[i] for k, v in data.items()} for i in range(8)],
        optimizers=(sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)),
        penalties=[regularizers.make("wd:sigma=0.3", model=model)],
        callbacks=[seen.callback],
    )
    assert trainer.model_accepts_loss_kwargs  # the case the Trainer gets wrong for BERT
    trainer.train()
    params = list(reference.parameters())
    full = reference(**data).loss + 0.5 * 0.3**2 * sum(p.square().sum() for p in params)
    want = torch.cat([g.reshape(-1) for g in torch.autograd.grad(full, params)])
    assert len(seen.grads) == 1
    # GPT-2's causal-LM loss upcasts the logits to float32: float32 precision there
    torch.testing.assert_close(seen.grads[0], want, rtol=0, atol=1e-13 if "bert" in which else 1e-6)
