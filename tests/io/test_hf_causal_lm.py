"""Hugging Face causal-LM batches as Hugging Face defines them (sharpcli.io.torch_losses.causal_lm).

``{"input_ids": ids, "labels": ids}`` with ``-100`` on padding: with no loss named, the loss is
the model's own (transformers' ``ForCausalLMLoss``: logits ``t`` against label ``t + 1``, the mean
over every labelled token), through ``Curvature(model, data=...)`` and through the CLI with a
data file and a ``--model-factory`` building a tiny ``GPT2LMHeadModel`` from a ``GPT2Config``
(no download). The references are dense float64 Hessians by double backward of
``model(**batch).loss`` itself (transformers computes that loss in float32, so it is compared to
float32 rounding) and of the same loss written out in float64 (compared to 1e-9).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from sharpcli import Curvature  # noqa: E402
from sharpcli.errors import UsageError  # noqa: E402
from sharpcli.io.torch_losses.causal_lm import causal_lm_name, model_labels, shift_token_labels  # noqa: E402
from sharpcli.losses import token_reduction  # noqa: E402
from tests.cli_helpers import assert_one_line_error, run_cli  # noqa: E402

VOCAB = 50
# a slice of the parameters small enough for a dense Hessian (48 + 16 + 16 entries)
NAMES = ["transformer.h.0.attn.c_attn.bias", "transformer.h.0.ln_2.weight", "transformer.ln_f.bias"]

GPT2_FACTORY = """
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.loss.loss_utils import ForCausalLMLoss


def build():
    config = GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=1,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(config)


def build_doubled():  # a model whose own loss is twice the causal-LM cross-entropy
    model = build()
    model.loss_function = lambda logits, labels, **kw: 2 * ForCausalLMLoss(logits, labels, **kw)
    return model
"""


def gpt2(seed: int = 0) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=1,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).double().eval()


def padded_batch(n: int = 6, length: int = 10, seed: int = 3) -> dict:
    """Hugging Face's causal-LM batch: labels = input_ids, -100 (and mask 0) on padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[3, 4:] = 0
    ids = ids.masked_fill(mask == 0, 0)  # the pad id
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def dense_hessian(model: nn.Module, loss_of_model) -> torch.Tensor:
    """The Hessian of ``loss_of_model(model)`` w.r.t. NAMES by double backward."""
    params = [dict(model.named_parameters())[name] for name in NAMES]
    grads = torch.autograd.grad(loss_of_model(model), params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    rows = []
    for i in range(flat.numel()):
        row = torch.autograd.grad(flat[i], params, retain_graph=True)
        rows.append(torch.cat([r.reshape(-1) for r in row]))
    return torch.stack(rows).double()


def model_loss(batch: dict):
    """``model(**batch).loss``: the model's own loss, shifted inside (float32 in transformers)."""
    return lambda model: model(**batch).loss


def written_out_loss(batch: dict):
    """The same loss in float64: logits t against label t + 1, -100 ignored, mean over tokens."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def loss(model):
        logits = model(**inputs).logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)
        )

    return loss


def test_the_causal_lm_rule_reads_the_model_not_the_data():
    assert causal_lm_name(gpt2()) == "GPT2LMHeadModel"
    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=8,
        )
    )  # fmt: skip
    assert causal_lm_name(bert) is None
    assert causal_lm_name(nn.Linear(2, 2)) is None

    class MyLM(transformers.GPT2LMHeadModel):  # a subclass keeps its base's reading
        pass

    assert causal_lm_name(MyLM(gpt2().config)) == "MyLM"
    y = torch.tensor([[4, 5, -100, 7]])
    assert torch.equal(shift_token_labels(y), torch.tensor([[5, -100, 7, -100]]))
    assert torch.equal(model_labels(shift_token_labels(y))[:, 1:], y[:, 1:])


def test_library_uses_the_models_own_loss_on_hugging_face_batches():
    model, batch = gpt2(), padded_batch()
    curvature = Curvature(model, data=batch, params=",".join(NAMES), batch_size=4)
    assert curvature.loss == "token-cross-entropy"
    assert curvature.loss_from_model
    assert "the model's own (GPT2LMHeadModel" in curvature.loss_note
    assert "label t + 1 at position t" in curvature.loss_note

    H_own = dense_hessian(model, model_loss(batch))
    H64 = dense_hessian(model, written_out_loss(batch))
    got = curvature.operator().to_dense()
    scale = float(H64.abs().max())
    assert torch.allclose(got, H64, rtol=0, atol=1e-9 * scale)
    assert torch.allclose(got, H_own, rtol=0, atol=1e-5 * scale)  # float32 loss of transformers
    top = curvature.eigenvalues(top_k=1, tol=1e-10).eigenvalues[0]
    assert top == pytest.approx(float(torch.linalg.eigvalsh(H64)[-1]), rel=1e-8)

    with token_reduction("tokens", curvature.data.y):  # as the Curvature methods average
        value, gradient = curvature.engine.loss_and_gradient()
    own = model(**batch).loss
    params = [dict(model.named_parameters())[name] for name in NAMES]
    expected = torch.cat([g.reshape(-1) for g in torch.autograd.grad(own, params)])
    assert value == pytest.approx(float(written_out_loss(batch)(model).detach()), rel=1e-12)
    assert value == pytest.approx(float(own.detach()), rel=1e-6)
    assert torch.allclose(gradient, expected.double(), rtol=0, atol=1e-6)

    # batches in a list (concatenated: the mean over every labelled token of the set, what
    # Hugging Face computes with num_items_in_batch the set's tokens) and a datasets.Dataset
    halves = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
    listed = Curvature(model, data=halves, params=",".join(NAMES))
    assert torch.allclose(listed.operator().to_dense(), H64, rtol=0, atol=1e-9 * scale)
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({k: v.tolist() for k, v in batch.items()})
    from_table = Curvature(model, data=table, params=",".join(NAMES))
    assert torch.allclose(from_table.operator().to_dense(), H64, rtol=0, atol=1e-9 * scale)


def test_library_keeps_pre_shifted_labels_and_named_losses():
    model, batch = gpt2(), padded_batch()
    H64 = dense_hessian(model, written_out_loss(batch))
    scale = float(H64.abs().max())
    shifted = {**batch, "labels": shift_token_labels(batch["labels"])}
    # shifted by hand and no loss: the same (the model's own) loss, labels kept as given
    by_hand = Curvature(model, data=shifted, params=",".join(NAMES))
    assert "already shifted" in by_hand.loss_note
    assert torch.allclose(by_hand.operator().to_dense(), H64, rtol=0, atol=1e-9 * scale)
    # shifted by hand with a loss module: as before, no note
    named = Curvature(model, nn.CrossEntropyLoss(), shifted, params=",".join(NAMES))
    assert named.loss_note is None and not named.loss_from_model
    assert torch.allclose(named.operator().to_dense(), H64, rtol=0, atol=1e-9 * scale)
    # labels equal to the ids with a loss module: refused, saying the model's own loss shifts
    with pytest.raises(UsageError, match="equal its token inputs.*left out"):
        Curvature(model, nn.CrossEntropyLoss(), batch)


def test_library_refusals_name_the_argument():
    model, batch = gpt2(), padded_batch()
    mlp = nn.Sequential(nn.Linear(4, 3)).double()
    with pytest.raises(UsageError, match="not a Hugging Face causal LM") as err:
        Curvature(mlp, data=(torch.randn(5, 4, dtype=torch.float64), torch.zeros(5).long()))
    assert err.value.source == "loss"
    with pytest.raises(UsageError, match="pass `data`") as err:
        Curvature(model)
    assert err.value.source == "data"
    with pytest.raises(UsageError, match="mean over every labelled token") as err:
        Curvature(model, data=batch, token_reduction="samples")
    assert err.value.source == "token_reduction"
    with pytest.raises(UsageError, match="token labels") as err:
        Curvature(model, data={"input_ids": batch["input_ids"], "labels": torch.zeros(6).long()})
    assert err.value.source == "data"
    # a model whose own loss is not the causal-LM cross-entropy: the guard trips
    from transformers.loss.loss_utils import ForCausalLMLoss

    model.loss_function = lambda logits, labels, **kw: 2 * ForCausalLMLoss(logits, labels, **kw)
    with pytest.raises(UsageError, match="own loss is .* computes another loss") as err:
        Curvature(model, data=batch)
    assert err.value.source == "loss"


@pytest.fixture
def factory(tmp_path, monkeypatch):
    """The user's factory module ``hf_lm`` and the weights of ``hf_lm.build()`` (seed 0)."""
    import importlib
    import sys

    from safetensors.torch import save_file

    (tmp_path / "hf_lm.py").write_text(textwrap.dedent(GPT2_FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hf_lm", raising=False)
    module = importlib.import_module("hf_lm")
    torch.manual_seed(0)
    model = module.build()
    weights = tmp_path / "lm.safetensors"
    # the tied lm_head / wte weight saved as two tensors (safetensors refuses shared storage)
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(weights))
    return model.double().eval(), str(weights)


def write_npz(path, batch: dict) -> str:
    np.savez(path, **{k: v.numpy() for k, v in batch.items()})
    return str(path)


def eigen(capsys, weights, data, *extra, build="hf_lm:build"):
    return run_cli(
        capsys, "eigen", weights, "--model-factory", build, "--data", data, "--dtype",
        "float64", "--params", ",".join(NAMES), "--top-k", "2", "--tol", "1e-12", "--json", "-",
        *extra,
    )  # fmt: skip


def test_cli_uses_the_models_own_loss_on_a_hugging_face_data_file(tmp_path, capsys, factory):
    model, weights = factory
    batch = padded_batch(n=8)
    H_own = dense_hessian(model, model_loss(batch))
    H64 = dense_hessian(model, written_out_loss(batch))
    top64 = torch.linalg.eigvalsh(H64).flip(0)[:2].tolist()
    top_own = torch.linalg.eigvalsh(H_own).flip(0)[:2].tolist()

    run = eigen(capsys, weights, write_npz(tmp_path / "lm.npz", batch), "--batch-size", "3")
    assert run.code == 0, run.err
    report = run.json()
    assert report["data"]["loss"] == "token-cross-entropy"
    assert report["data"]["spec"]["shift_labels"] is True  # the spec reproduces the shift
    assert report["data"]["loss_source"] == "model"
    assert report["data"]["loss_reason"].startswith("the model's own (GPT2LMHeadModel")
    assert report["results"]["eigenvalues"] == pytest.approx(top64, rel=1e-8)
    assert report["results"]["eigenvalues"] == pytest.approx(top_own, rel=1e-5)

    # labels shifted by hand: the same loss, read as given (as before)
    shifted = {**batch, "labels": shift_token_labels(batch["labels"])}
    pre = write_npz(tmp_path / "pre.npz", shifted)
    run = eigen(capsys, weights, pre)
    assert run.code == 0, run.err
    assert run.json()["results"]["eigenvalues"] == pytest.approx(top64, rel=1e-8)
    assert run.json()["data"]["loss_source"] == "model"
    assert "already shifted" in run.json()["data"]["loss_reason"]
    run = eigen(capsys, weights, pre, "--loss", "token-cross-entropy")
    assert run.code == 0, run.err
    assert run.json()["results"]["eigenvalues"] == pytest.approx(top64, rel=1e-8)
    assert run.json()["data"]["loss_source"] == "option"


def test_cli_refusals_are_one_line(tmp_path, capsys, factory):
    _, weights = factory
    batch = padded_batch(n=8)
    data = write_npz(tmp_path / "lm.npz", batch)
    # labels neither the ids nor the ids shifted: two readings fit, the options that choose
    other = {**batch, "labels": torch.where(batch["labels"] >= 0, (batch["labels"] + 1) % 50, -100)}
    run = eigen(capsys, weights, write_npz(tmp_path / "other.npz", other))
    assert_one_line_error(run, 2, "other.npz", "neither the input ids", "--shift-labels", "--loss")
    # a loss named: the labels are read as given, and labels equal to the ids are refused
    run = eigen(capsys, weights, data, "--loss", "token-cross-entropy")
    assert_one_line_error(run, 2, "token labels equal the input ids", "--shift-labels")
    run = eigen(capsys, weights, data, "--token-reduction", "samples")
    assert_one_line_error(run, 2, "--token-reduction", "mean over every labelled token", "--loss")
    # the model computes another loss than the causal-LM cross-entropy: the guard trips
    run = eigen(capsys, weights, data, build="hf_lm:build_doubled")
    assert_one_line_error(run, 2, "own loss is", "computes another loss", "--loss")
