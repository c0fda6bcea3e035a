"""Hugging Face models (tiny GPT-2, padded BERT with attention masks, ViT, built from configs by
``fixtures/make_hf_fixtures.py``; no download) through the CLI: a ``save_pretrained`` folder is
the checkpoint, keyword inputs come from the data file's keys, and the eigenvalues match the
dense float64 Hessian of the same loss by double backward. Causal-LM labels equal to the inputs
are the model's own loss (shifted as it shifts them) unless a loss is named; a checkpoint
trained with ``--model-factory`` loads back into transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from fixtures import make_hf_fixtures as hf  # noqa: E402
from tests.cli_helpers import assert_one_line_error, run_cli  # noqa: E402


def dense_top(model, loss_of_model, k: int) -> np.ndarray:
    """Top-k eigenvalues of the float64 Hessian of ``loss_of_model(model)`` w.r.t. every
    trainable parameter by double backward (all rows in one batched backward)."""
    model = model.double().eval()
    for module in model.modules():  # the loss's own derivative (sharp releases padding_idx)
        if isinstance(module, torch.nn.Embedding):
            module.padding_idx = None
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_of_model(model), params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    eye = torch.eye(flat.numel(), dtype=flat.dtype)  # every row at once (vmapped backward)
    rows = torch.autograd.grad(flat, params, eye, is_grads_batched=True, allow_unused=True)
    hessian = torch.cat(
        [
            (
                torch.zeros(len(eye), p.numel(), dtype=eye.dtype)
                if r is None
                else r.reshape(len(eye), -1)
            )
            for p, r in zip(params, rows)
        ],
        dim=1,
    )
    assert torch.allclose(hessian, hessian.T, atol=1e-9)
    return torch.linalg.eigvalsh(hessian).flip(0)[:k].numpy()


def eigen(capsys, folder, data, *extra):
    return run_cli(
        capsys,
        "eigen",
        folder,
        "--data",
        data,
        "--top-k",
        "2",
        "--tol",
        "1e-10",
        "--dtype",
        "float64",
        "--json",
        "-",
        *extra,
    )


def _tensors(arrays: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def test_gpt2_labels_equal_to_inputs_are_the_models_own_loss(tmp_path, capsys):
    """Hugging Face's labels (= input_ids), no --loss: the model's own loss, its shift applied
    (tests/io/test_hf_causal_lm.py); --shift-labels says the same; a named loss refuses them."""
    folder = hf.save_model(hf.gpt2(), tmp_path / "gpt2")
    arrays = hf.gpt2_data()
    data = hf.write_npz(tmp_path / "lm.npz", arrays)
    refused = eigen(capsys, folder, data, "--loss", "token-cross-entropy")
    assert_one_line_error(
        refused, 2, "lm.npz", "token labels equal the input ids", "--shift-labels"
    )
    own = eigen(capsys, folder, data)
    assert own.code == 0, own.err
    assert own.json()["data"]["loss_source"] == "model"
    run = eigen(capsys, folder, data, "--shift-labels")
    assert run.code == 0, run.err
    report = run.json()
    assert report["results"]["eigenvalues"] == own.json()["results"]["eigenvalues"]
    assert report["checkpoint"]["origin"] == "huggingface"
    assert report["checkpoint"]["model"]["name"] == "hf:GPT2LMHeadModel"
    assert report["data"]["loss"] == "token-cross-entropy"
    assert report["data"]["spec"]["shift_labels"] is True
    ids = torch.from_numpy(arrays["input_ids"])

    def loss(model):  # what GPT2LMHeadModel(labels=input_ids) computes: logits t vs token t+1
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, hf.VOCAB), ids[:, 1:].reshape(-1))

    expected = dense_top(hf.gpt2(), loss, 2)
    np.testing.assert_allclose(report["results"]["eigenvalues"], expected, rtol=1e-6)
    # HF's own loss with labels=input_ids is the same function
    model = hf.gpt2()  # (HF computes its loss in float32)
    assert torch.allclose(model(input_ids=ids, labels=ids).loss, loss(model))


def test_bert_with_attention_mask_matches_dense_hessian(tmp_path, capsys):
    folder = hf.save_model(hf.bert(), tmp_path / "bert")
    arrays = hf.bert_data()
    assert (arrays["attention_mask"] == 0).any()  # padded sequences
    run = eigen(capsys, folder, hf.write_npz(tmp_path / "bert.npz", arrays))
    assert run.code == 0, run.err
    report = run.json()
    assert report["data"]["loss"] == "cross-entropy"
    inputs = _tensors(arrays)
    labels = inputs.pop("labels")
    expected = dense_top(hf.bert(), lambda m: F.cross_entropy(m(**inputs).logits, labels), 2)
    np.testing.assert_allclose(report["results"]["eigenvalues"], expected, rtol=1e-6)
    # without the mask the pad id reaches the loss: padding_idx is released for the analysis
    no_mask = {k: arrays[k] for k in ("input_ids", "labels")}
    run = eigen(capsys, folder, hf.write_npz(tmp_path / "nomask.npz", no_mask))
    assert run.code == 0, run.err
    assert "padding_idx=0 released" in run.err
    ids = torch.from_numpy(no_mask["input_ids"])
    expected = dense_top(hf.bert(), lambda m: F.cross_entropy(m(input_ids=ids).logits, labels), 2)
    np.testing.assert_allclose(run.json()["results"]["eigenvalues"], expected, rtol=1e-6)


def test_vit_pixel_values_match_dense_hessian(tmp_path, capsys):
    folder = hf.save_model(hf.vit(), tmp_path / "vit")
    arrays = hf.vit_data()
    run = eigen(capsys, folder, hf.write_npz(tmp_path / "vit.npz", arrays))
    assert run.code == 0, run.err
    pixels, labels = (torch.from_numpy(arrays[k]) for k in ("pixel_values", "labels"))
    expected = dense_top(
        hf.vit(), lambda m: F.cross_entropy(m(pixel_values=pixels.double()).logits, labels), 2
    )
    np.testing.assert_allclose(run.json()["results"]["eigenvalues"], expected, rtol=1e-6)


def test_padding_idx_without_mask_names_the_layer_in_training(tmp_path, capsys, monkeypatch):
    """train does not release padding_idx (the pad row stays untrained): a regularizer that
    differentiates twice is refused with the layer, the cause and what to do."""
    monkeypatch.chdir(tmp_path)
    arrays = hf.bert_data()
    data = hf.write_npz(tmp_path / "nomask.npz", {k: arrays[k] for k in ("input_ids", "labels")})
    run = run_cli(
        capsys,
        "train",
        "--model-factory",
        "fixtures.make_hf_fixtures:bert",
        "--data",
        data,
        "--reg",
        "gn-trace",
        "--epochs",
        "1",
        "--out",
        str(tmp_path / "b.safetensors"),
    )
    assert_one_line_error(
        run, 2, "'bert.embeddings.word_embeddings' has padding_idx=0", "attention_mask"
    )
    assert "once_differentiable" not in run.err


def test_trained_hf_checkpoint_loads_back_into_transformers(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    data = hf.write_npz(tmp_path / "lm.npz", hf.gpt2_data(n=16))
    out = tmp_path / "trained.safetensors"
    run = run_cli(
        capsys,
        "train",
        "--model-factory",
        "fixtures.make_hf_fixtures:gpt2",
        "--data",
        data,
        "--shift-labels",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--lr",
        "0.1",
        "--out",
        str(out),
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    state = load_file(str(out))
    model = hf.gpt2()
    before = model.transformer.wte.weight.detach().clone()
    model.load_state_dict(state, strict=True)
    assert not torch.equal(model.transformer.wte.weight, before)  # trained weights
    # as a save_pretrained folder: config.json beside the weights, built by from_pretrained
    folder = tmp_path / "back"
    hf.save_model(hf.gpt2(), folder)
    (folder / "model.safetensors").write_bytes(out.read_bytes())
    loaded = GPT2LMHeadModel.from_pretrained(str(folder), local_files_only=True).eval()
    ids = torch.from_numpy(hf.gpt2_data()["input_ids"])
    assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    # and sharp analyses the trained checkpoint on its own stored (shifted) data spec
    again = run_cli(capsys, "eigen", str(out), "--json", "-")
    assert again.code == 0, again.err
    assert again.json()["data"]["spec"]["shift_labels"] is True


def test_folder_without_config_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    run = run_cli(capsys, "eigen", str(tmp_path / "empty"), "--data", "blobs")
    assert_one_line_error(run, 2, "is a folder, not a checkpoint file", "config.json")


@pytest.mark.slow
def test_keyword_inputs_under_torchrun_match_one_process(tmp_path):
    """Two ranks shard the stacked keyword inputs (input_ids, attention_mask, token_type_ids)."""
    import json
    import os
    import socket
    import subprocess
    import sys

    folder = hf.save_model(hf.bert(), tmp_path / "bert")
    data = hf.write_npz(tmp_path / "bert.npz", hf.bert_data())
    argv = [
        "eigen",
        folder,
        "--data",
        data,
        "--dtype",
        "float64",
        "--batch-size",
        "3",
        "--json",
        "-",
    ]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    parallel = subprocess.run(
        [*launcher, "--master_port", str(port), "-m", "sharpcli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert parallel.returncode == 0, parallel.stderr
    single = subprocess.run(
        [sys.executable, "-m", "sharpcli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert single.returncode == 0, single.stderr
    got, ref = json.loads(parallel.stdout), json.loads(single.stdout)
    assert got["environment"]["world_size"] == 2
    np.testing.assert_allclose(
        got["results"]["eigenvalues"], ref["results"]["eigenvalues"], rtol=1e-9
    )
