"""``sharpcli.Curvature``: an in-memory MLP and a tiny masked-attention transformer, given as
tensors, a DataLoader and dict batches, against dense float64 Hessians by double backward of
the loss written out by hand (``torch.autograd.functional.hessian``); ``ignore_index``
honoured; every user error a UsageError naming its argument."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

import sharpcli
from sharpcli import Curvature
from sharpcli.errors import UsageError

D = torch.float64


class TinyTransformer(nn.Module):
    """Token embedding, one masked single-head attention layer, then a classifier head on the
    masked mean (``per_position=False``) or a vocabulary head per position (a tiny LM)."""

    def __init__(self, vocab=6, dim=4, classes=3, per_position=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, vocab if per_position else classes)
        self.per_position = per_position

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        h = self.emb(input_ids)
        scores = self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5
        scores = scores + (attention_mask[:, None, :].to(h.dtype) - 1) * 1e4
        h = h + torch.softmax(scores, -1) @ torch.tanh(self.v(h))
        if self.per_position:
            return self.head(h)
        m = attention_mask.to(h.dtype).unsqueeze(-1)
        return self.head((h * m).sum(1) / m.sum(1))


def dense_hessian(model, loss_of_outputs, args=(), kwargs=None):
    """Float64 ``d^2 loss / dtheta^2`` over every parameter of ``model`` (named_parameters
    order), by double backward of ``loss_of_outputs(model(*args, **kwargs))``."""
    params = dict(model.named_parameters())
    names, shapes = list(params), [p.shape for p in params.values()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in params.values()])

    def loss(flat):
        values, start = {}, 0
        for name, shape in zip(names, shapes):
            values[name] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return loss_of_outputs(functional_call(model, values, args, kwargs or {}))

    return torch.autograd.functional.hessian(loss, flat0)


def _mlp_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(D)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(21, 4, dtype=D, generator=gen)
    y = torch.randint(0, 3, (21,), generator=gen)
    return model, x, y


def dense_ggn(model, loss_of_outputs, args=()):
    """Float64 Gauss-Newton matrix ``J^T (d^2 loss / dz^2) J`` over every parameter of
    ``model``, ``z`` all of its outputs on ``args``."""
    params = dict(model.named_parameters())
    names, shapes = list(params), [p.shape for p in params.values()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in params.values()])

    def outputs(flat):
        values, start = {}, 0
        for name, shape in zip(names, shapes):
            values[name] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return functional_call(model, values, args)

    z = outputs(flat0).detach()
    J = torch.autograd.functional.jacobian(outputs, flat0).reshape(z.numel(), -1)
    Hz = torch.autograd.functional.hessian(
        lambda t: loss_of_outputs(t.view(z.shape)), z.reshape(-1)
    )
    return J.T @ Hz @ J


def _transformer_problem(per_position=False, n=10, length=5):
    torch.manual_seed(0)
    model = TinyTransformer(per_position=per_position).to(D)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 6, (n, length), generator=gen)
    lengths = torch.randint(2, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    ids = ids * mask  # padding id 0
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, ids, mask, y


def _check_spectrum(curvature, H):
    dense = curvature.operator().to_dense()
    assert torch.allclose(dense, H, atol=1e-10, rtol=1e-8)
    exact = torch.linalg.eigvalsh(H)
    top = curvature.eigenvalues(top_k=2, tol=1e-9)
    assert torch.allclose(torch.tensor(top.eigenvalues, dtype=D), exact[-2:].flip(0), rtol=1e-7)
    low = curvature.eigenvalues(top_k=1, which="smallest", tol=1e-9)
    assert low.eigenvalues[0] == pytest.approx(float(exact[0]), rel=1e-6, abs=1e-9)


def test_mlp_tensors_match_the_dense_hessian():
    model, x, y = _mlp_problem()
    H = dense_hessian(model, lambda z: F.cross_entropy(z, y), (x,))
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y), batch_size=8)
    assert (curvature.loss, curvature.num_samples, curvature.num_params) == (
        "cross-entropy",
        21,
        43,
    )
    _check_spectrum(curvature, H)
    # hutchpp's sketch is exact once it spans the 43 dimensions
    assert curvature.trace(tol=1e-6).estimate == pytest.approx(float(H.trace()), rel=1e-6)
    split = curvature.gn_nme(tol=5e-2, max_matvecs=64)
    h, g, n = (split[name]["trace"]["estimate"] for name in ("hessian", "ggn", "nme"))
    assert h == pytest.approx(g + n, rel=1e-12)
    assert split["ggn_trace_check"]["exact"] == pytest.approx(
        curvature.operator("ggn").to_dense().trace().item(), rel=1e-10
    )
    density = curvature.density(probes=2, steps=43)
    assert density.dimension == 43 and max(max(n) for n in density.nodes) == pytest.approx(
        float(torch.linalg.eigvalsh(H)[-1]), rel=1e-6
    )


def test_eigenvalues_former_k_keyword_still_works_with_a_deprecation_warning():
    model, x, y = _mlp_problem()
    H = dense_hessian(model, lambda z: F.cross_entropy(z, y), (x,))
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    with pytest.warns(DeprecationWarning, match="use top_k"):
        top = curvature.eigenvalues(k=2, tol=1e-9).eigenvalues
    exact = torch.linalg.eigvalsh(H)[-2:].flip(0).tolist()
    assert top == pytest.approx(exact, rel=1e-7)


def test_mlp_dataloader_and_dict_batches_match_the_dense_hessian():
    model, x, y = _mlp_problem()
    H = dense_hessian(model, lambda z: F.cross_entropy(z, y), (x,))
    loader = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True)
    curvature = Curvature(model, "cross-entropy", loader)
    assert curvature.batch_size == 5 and curvature.num_samples == 21
    _check_spectrum(curvature, H)
    # dict batches: nn.Sequential.forward takes `input`; labels under `y`
    batches = [{"input": x[i : i + 4], "y": y[i : i + 4]} for i in range(0, 21, 4)]
    assert torch.allclose(Curvature(model, "cross-entropy", batches).operator().to_dense(), H)
    # one dict, and (dict, y) batches
    whole = Curvature(model, nn.CrossEntropyLoss(), {"input": x, "labels": y})
    assert torch.allclose(whole.operator().to_dense(), H)
    pairs = [({"input": x[:9]}, y[:9]), ({"input": x[9:]}, y[9:])]
    assert torch.allclose(Curvature(model, "cross-entropy", iter(pairs)).operator().to_dense(), H)


def test_transformer_tensors_dataloader_and_masked_dict_batches_match_the_dense_hessian():
    model, ids, mask, y = _transformer_problem()
    # token ids alone (positional): every position attended
    H_plain = dense_hessian(model, lambda z: F.cross_entropy(z, y), (ids,))
    plain = Curvature(model, nn.CrossEntropyLoss(), (ids, y))
    assert plain.num_params == 6 * 4 + 3 * 20 + 15
    _check_spectrum(plain, H_plain)
    loader = DataLoader(TensorDataset(ids, y), batch_size=3)
    assert torch.allclose(Curvature(model, "cross-entropy", loader).operator().to_dense(), H_plain)
    # input_ids + attention_mask by keyword, as a Hugging Face model takes them
    H = dense_hessian(
        model, lambda z: F.cross_entropy(z, y), kwargs={"input_ids": ids, "attention_mask": mask}
    )
    assert not torch.allclose(H, H_plain)  # the mask matters
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": y[i]} for i in range(len(y))]
    masked = Curvature(model, nn.CrossEntropyLoss(), DataLoader(rows, batch_size=4))
    _check_spectrum(masked, H)


def test_float32_model_analysed_in_float64_stays_untouched():
    model, x, y = _mlp_problem()
    H = dense_hessian(model, lambda z: F.cross_entropy(z, y), (x,))
    model32 = model.float()
    curvature = Curvature(model32, "cross-entropy", (x.float(), y), dtype=torch.float64)
    assert next(model32.parameters()).dtype == torch.float32
    assert curvature.dtype == torch.float64
    assert torch.allclose(curvature.operator().to_dense(), H.to(D), atol=1e-6)


def test_cross_entropy_ignore_index_drops_ignored_samples():
    model, x, y = _mlp_problem()
    y = y.clone()
    y[[0, 3, 4, 11]] = -100
    valid = y != -100

    def masked_mean(z):  # (1/|V|) sum_{i in V} CE_i, written out
        per_sample = -torch.log_softmax(z, -1)[torch.arange(21), y.clamp_min(0)]
        return (per_sample * valid).sum() / valid.sum()

    H = dense_hessian(model, masked_mean, (x,))
    curvature = Curvature(model, nn.CrossEntropyLoss(ignore_index=-100), (x, y))
    assert curvature.num_samples == 17
    assert torch.allclose(curvature.operator().to_dense(), H, atol=1e-12)
    # another ignore_index value
    y7 = torch.where(valid, y, torch.full_like(y, 7))
    other = Curvature(model, nn.CrossEntropyLoss(ignore_index=7), (x, y7))
    assert torch.allclose(other.operator().to_dense(), H, atol=1e-12)


def test_token_ignore_index_matches_the_loss_module_on_flattened_positions():
    model, ids, mask, _ = _transformer_problem(per_position=True, n=8, length=5)
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 6, (8, 5), generator=gen)
    # three labelled positions per sample, at different places; ignored ones marked -1
    for i in range(8):
        labels[i, torch.randperm(5, generator=gen)[:2]] = -1
    module = nn.CrossEntropyLoss(ignore_index=-1)
    H = dense_hessian(model, lambda z: module(z.reshape(-1, 6), labels.reshape(-1)), (ids,))
    curvature = Curvature(model, module, (ids, labels), batch_size=3)
    assert curvature.loss == "token-cross-entropy"
    assert curvature.token_reduction == "tokens"
    assert torch.allclose(curvature.operator().to_dense(), H, atol=1e-12)


def _padded_lm_problem():
    """A tiny LM with next-token labels of 1 to 5 labelled positions, -100 on the others."""
    model, ids, _, _ = _transformer_problem(per_position=True, n=8, length=5)
    labels = torch.randint(0, 6, (8, 5), generator=torch.Generator().manual_seed(4))
    for i, t in enumerate((1, 5, 2, 3, 5, 4, 1, 2)):
        labels[i, t:] = -100
    return model, ids, labels


def _per_sample_token_mean(z, labels):
    ce = F.cross_entropy(z.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    valid = (labels != -100).to(ce.dtype)
    return ((ce * valid).sum(1) / valid.sum(1)).mean()


def test_the_loss_module_on_variable_length_labels_is_the_mean_over_labelled_tokens():
    """``nn.CrossEntropyLoss(ignore_index=-100)`` on (N, T) labels with -100 padding of
    different lengths: the mean over every labelled token, against the dense float64 Hessian
    of the module itself; the same from the name with ``token_reduction="tokens"`` (the
    default), and the per-sample mean with ``"samples"``."""
    model, ids, labels = _padded_lm_problem()
    module = nn.CrossEntropyLoss(ignore_index=-100)
    H = dense_hessian(model, lambda z: module(z.reshape(-1, 6), labels.reshape(-1)), (ids,))
    H_samples = dense_hessian(model, lambda z: _per_sample_token_mean(z, labels), (ids,))
    assert not torch.allclose(H, H_samples, atol=1e-3)  # the two reductions differ here
    curvature = Curvature(model, module, (ids, labels), batch_size=3)
    assert curvature.token_reduction == "tokens"
    assert torch.allclose(curvature.operator().to_dense(), H, atol=1e-12)
    top = curvature.eigenvalues(top_k=2, tol=1e-10).eigenvalues
    assert top == pytest.approx(torch.linalg.eigvalsh(H)[-2:].flip(0).tolist(), rel=1e-8)
    ggn = curvature.trace("ggn", estimator="exact").estimate
    G = dense_ggn(model, lambda z: module(z.reshape(-1, 6), labels.reshape(-1)), (ids,))
    assert ggn == pytest.approx(float(G.trace()), rel=1e-9)
    by_name = Curvature(model, "token-cross-entropy", (ids, labels))
    assert torch.allclose(by_name.operator().to_dense(), H, atol=1e-12)
    samples = Curvature(model, "token-cross-entropy", (ids, labels), token_reduction="samples")
    assert torch.allclose(samples.operator().to_dense(), H_samples, atol=1e-12)
    # the averaging holds inside this object's products only
    from sharpcli.losses import token_weights

    assert torch.equal(token_weights(ids.double(), labels)[0, 0], torch.tensor(1.0, dtype=D))


def test_a_token_loss_module_with_reduction_sum_and_the_refusals_naming_the_argument():
    model, ids, labels = _padded_lm_problem()
    module = nn.CrossEntropyLoss(reduction="sum")
    H = dense_hessian(model, lambda z: module(z.reshape(-1, 6), labels.reshape(-1)), (ids,))
    summed = Curvature(model, module, (ids, labels), batch_size=3)
    assert torch.allclose(summed.operator().to_dense(), H, atol=1e-11 * float(H.abs().max()))
    with pytest.raises(UsageError, match="reduction='none'") as info:
        Curvature(model, nn.CrossEntropyLoss(reduction="none"), (ids, labels))
    assert info.value.source == "loss"
    with pytest.raises(UsageError, match="token_reduction='samples'") as info:
        Curvature(model, nn.CrossEntropyLoss(), (ids, labels), token_reduction="samples")
    assert info.value.source == "token_reduction"
    with pytest.raises(UsageError, match="accepted: tokens, samples") as info:
        Curvature(model, "token-cross-entropy", (ids, labels), token_reduction="token")
    assert info.value.source == "token_reduction"
    with pytest.raises(UsageError, match="ignore_index") as info:
        Curvature(model, nn.CrossEntropyLoss(), (ids, torch.full_like(labels, -100)))
    assert info.value.source == "data"


def test_model_mode_restored_and_results_in_eval_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 3)).to(D)
    x, y = torch.randn(12, 4, dtype=D), torch.randint(0, 3, (12,))
    model.train()
    curvature = Curvature(model, "cross-entropy", (x, y))
    first = curvature.eigenvalues(tol=1e-9).eigenvalues
    assert model.training and model[1].training
    model.eval()
    H = dense_hessian(model, lambda z: F.cross_entropy(z, y), (x,))
    model.train()
    assert first[0] == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-7)
    assert torch.allclose(curvature.operator().to_dense(), H)  # the operator too
    assert model.training


def test_hugging_face_style_output_and_params():
    class WithLogits(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 5)
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            return {"logits": self.head(torch.tanh(self.body(x))), "hidden": x}

    torch.manual_seed(0)
    model = WithLogits().to(D)
    x, y = torch.randn(9, 4, dtype=D), torch.randint(0, 3, (9,))
    H = dense_hessian(model, lambda out: F.cross_entropy(out["logits"], y), (x,))
    curvature = Curvature(model, "cross-entropy", (x, y), params="head.*")
    assert curvature.scope.names == ["head.weight", "head.bias"]
    assert torch.allclose(curvature.operator().to_dense(), H[-18:, -18:])


def test_sharpcli_exports_the_api_lazily():
    import subprocess
    import sys

    code = "import sys, sharpcli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert sharpcli.Curvature is Curvature
    assert {"Curvature", "Tracker"} <= set(dir(sharpcli))
    with pytest.raises(AttributeError):
        sharpcli.NotThere  # noqa: B018


@pytest.mark.parametrize(
    "case, source, words",
    [
        ("loss-module", "loss", "KLDivLoss is not a supported loss"),
        ("loss-sum", "loss", "reduction='none'"),
        ("loss-weight", "loss", "negative entries"),
        ("loss-name", "loss", "unknown loss"),
        ("loss-function", "loss", "function"),
        ("data-tensor", "data", "one tensor"),
        ("data-dataset", "data", "DataLoader(dataset"),
        ("data-no-labels", "data", "neither of the label keys"),
        ("data-lengths", "data", "pad every batch"),
        ("data-counts", "data", "different numbers of samples"),
        ("data-int", "data", "expected (x, y)"),
        ("data-shape", "data", "cannot run on the inputs"),
        ("data-labels", "data", "labels range"),
        ("model", "model", "nn.Module"),
        ("params", "params", ""),
        ("batch-size", "batch_size", ">= 1"),
        ("dtype", "dtype", "float"),
        ("operator", "operator", "accepted"),
        ("k", "top_k", ""),
        ("which", "which", "accepted"),
        ("estimator", "estimator", "accepted"),
        ("unshifted", "data", "equal its token inputs"),
        ("token-id", "data", "samples 8..9"),
        ("k-text", "top_k", "integer"),
        ("k-beyond-budget", "top_k", "Krylov space"),
        ("seed", "seed", "0.."),
        ("steps", "steps", ">= 1"),
        ("grid", "grid_points", ">= 2"),
        ("tol", "tol", "> 0"),
        ("power-both", "which", "method=lanczos"),
    ],
)
def test_user_errors_name_their_argument(case, source, words):
    model, x, y = _mlp_problem()
    data = (x, y)
    calls = {
        "loss-module": lambda: Curvature(model, nn.KLDivLoss(), data),
        "loss-sum": lambda: Curvature(model, nn.CrossEntropyLoss(reduction="none"), data),
        "loss-weight": lambda: Curvature(model, nn.CrossEntropyLoss(weight=-torch.ones(3)), data),
        "loss-name": lambda: Curvature(model, "hinge", data),
        "loss-function": lambda: Curvature(model, F.cross_entropy, data),
        "data-tensor": lambda: Curvature(model, "cross-entropy", x),
        "data-dataset": lambda: Curvature(model, "cross-entropy", TensorDataset(x, y)),
        "data-no-labels": lambda: Curvature(model, "cross-entropy", {"input": x}),
        "data-lengths": lambda: Curvature(
            model, "cross-entropy", [(x[:3], y[:3]), (x[3:6, :2], y[3:6])]
        ),
        "data-counts": lambda: Curvature(model, "cross-entropy", (x, y[:5])),
        "data-int": lambda: Curvature(model, "cross-entropy", 3),
        "data-shape": lambda: Curvature(model, "cross-entropy", (x[:, :3], y)),
        "data-labels": lambda: Curvature(model, "cross-entropy", (x, y + 5)),
        "model": lambda: Curvature(lambda t: t, "cross-entropy", data),
        "params": lambda: Curvature(model, "cross-entropy", data, params="nothing.*"),
        "batch-size": lambda: Curvature(model, "cross-entropy", data, batch_size=0),
        "dtype": lambda: Curvature(model, "cross-entropy", data, dtype="float16"),
        "operator": lambda: Curvature(model, "cross-entropy", data).eigenvalues(operator="X"),
        "k": lambda: Curvature(model, "cross-entropy", data).eigenvalues(top_k=0),
        "which": lambda: Curvature(model, "cross-entropy", data).eigenvalues(which="middle"),
        "estimator": lambda: Curvature(model, "cross-entropy", data).trace(estimator="magic"),
        "k-text": lambda: Curvature(model, "cross-entropy", data).eigenvalues(top_k="3"),
        "k-beyond-budget": lambda: Curvature(model, "cross-entropy", data).eigenvalues(
            top_k=6, max_matvecs=5
        ),
        "seed": lambda: Curvature(model, "cross-entropy", data).trace(seed=-1),
        "steps": lambda: Curvature(model, "cross-entropy", data).density(steps=0),
        "grid": lambda: Curvature(model, "cross-entropy", data).density(grid_points=1),
        "tol": lambda: Curvature(model, "cross-entropy", data).gn_nme(tol=0),
        "power-both": lambda: Curvature(model, "cross-entropy", data).eigenvalues(
            which="both", method="power"
        ),
    }
    if case == "token-id":
        tiny, ids, mask, labels = _transformer_problem(n=10)
        ids = ids.clone()
        ids[9, 0] = 6  # one id beyond the 6 rows of the embedding, in the last batch
        calls[case] = lambda: Curvature(tiny, "cross-entropy", (ids, labels), batch_size=4)
    if case == "unshifted":
        lm, ids, _, _ = _transformer_problem(per_position=True)
        calls[case] = lambda: Curvature(
            lm, nn.CrossEntropyLoss(), {"input_ids": ids, "labels": ids}
        )
    with pytest.raises(UsageError) as info:
        calls[case]()
    assert info.value.source == source
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_results_follow_weights_moved_by_a_fused_optimizer():
    # torch.optim.AdamW(fused=True) updates in place without moving the version counters that
    # invalidate the engine's cached graphs; every method starts from the current weights
    model, x, y = _mlp_problem()
    curvature = Curvature(model, "cross-entropy", (x, y))
    before = curvature.eigenvalues(tol=1e-9).eigenvalues[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    H = dense_hessian(model, lambda z: F.cross_entropy(z, y), (x,))
    after = curvature.eigenvalues(tol=1e-9).eigenvalues[0]
    assert after != pytest.approx(before, rel=1e-3)
    assert after == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-7)
    assert torch.allclose(curvature.operator().to_dense(), H)


def _dense_hessian_of(model, names, loss_of_outputs, kwargs):
    """Float64 Hessian over the parameters ``names`` only (the others held fixed)."""
    params = dict(model.named_parameters())
    shapes = [params[n].shape for n in names]
    flat0 = torch.cat([params[n].detach().reshape(-1) for n in names])

    def loss(flat):
        values, start = {}, 0
        for name, shape in zip(names, shapes):
            values[name] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return loss_of_outputs(functional_call(model, values, (), kwargs))

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # torch's fused CPU attention has no double backward
        return torch.autograd.functional.hessian(loss, flat0)


def test_hugging_face_bert_with_attention_masks_matches_the_dense_hessian():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=8,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).to(D).eval()
    _, ids, mask, y = _transformer_problem(n=9, length=6)
    inputs = {"input_ids": ids + mask * 5, "attention_mask": mask}
    names = [n for n, _ in model.named_parameters() if "self.query" in n or "classifier" in n]
    H = _dense_hessian_of(model, names, lambda out: F.cross_entropy(out.logits, y), inputs)
    rows = [{**{k: v[i] for k, v in inputs.items()}, "labels": y[i]} for i in range(9)]
    curvature = Curvature(
        model,
        nn.CrossEntropyLoss(),
        DataLoader(rows, batch_size=4),
        params="*attention.self.query.*,classifier.*",
    )
    assert curvature.scope.names == names
    _check_spectrum(curvature, H)


def test_hugging_face_gpt2_with_shifted_labels_matches_the_dense_hessian():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=12, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(D).eval()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 12, (6, 6), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]  # the shift GPT2LMHeadModel makes inside its own loss
    names = ["transformer.h.0.attn.c_attn.bias", "transformer.h.0.attn.c_proj.weight"]
    module = nn.CrossEntropyLoss()
    H = _dense_hessian_of(
        model,
        names,
        lambda out: module(out.logits.reshape(-1, 12), labels.reshape(-1)),
        {"input_ids": ids},
    )
    batch = {"input_ids": ids, "labels": labels}
    curvature = Curvature(model, module, batch, params=",".join(names), batch_size=4)
    assert curvature.loss == "token-cross-entropy"
    _check_spectrum(curvature, H)
    # the labels of HF's habit (labels = input_ids, shifted inside the model) are refused
    with pytest.raises(UsageError, match="equal its token inputs"):
        Curvature(model, module, {"input_ids": ids, "labels": ids})


def test_a_layer_torch_differentiates_twice_wrongly_is_refused():
    from torch.autograd.function import once_differentiable

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * t

        @staticmethod
        @once_differentiable
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            return 2 * t * grad

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x):
            return self.b(Square.apply(self.a(x)))

    torch.manual_seed(0)
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    with pytest.raises(UsageError, match="second derivatives wrongly") as info:
        Curvature(Model(), nn.CrossEntropyLoss(), (x, y))
    assert info.value.source == "model"


def test_wrapped_models_are_analysed_through_the_plain_module():
    model, x, y = _mlp_problem()
    H = dense_hessian(model, lambda z: F.cross_entropy(z, y), (x,))
    for wrapped in (nn.DataParallel(model), torch.compile(model)):
        curvature = Curvature(wrapped, "cross-entropy", (x, y))
        assert curvature.scope.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert torch.allclose(curvature.operator().to_dense(), H)
