"""Recurrent models (``nn.LSTM``, ``nn.GRU``): every per-sample computation falls back from vmap.

On CPU the recurrent layers' ``mkldnn_rnn_layer`` has no working vmap batching rule, which made
``gn-nme`` (exact and sampled-label tr(G) use per-sample Jacobians and gradients) exit 4 with a
RuntimeError. sharp now computes those per sample where vmap fails. Checked against dense
float64 matrices of the same model and data: the Hessian's eigenvalues and the exact trace of
the Gauss-Newton matrix ``G = (1/N) sum_i J_i^T H_z,i J_i``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.recurrent_model import (
    rnn_arrays,
    rnn_model,
    write_rnn_checkpoint,
    write_rnn_data,
    write_rnn_module,
)
from tests.cli_helpers import run_cli
from tests.hessian_helpers import double_backward_hessian


@pytest.fixture
def rnn_dir(tmp_path, monkeypatch):
    write_rnn_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_rnn_data(tmp_path / "ids.npz")
    return tmp_path


def _dense(cell: str):
    """(Hessian, Gauss-Newton matrix) of the mean cross-entropy, float64, by autograd loops."""
    model = rnn_model(cell).double().eval()
    x, y = (torch.from_numpy(a) for a in rnn_arrays())
    params = list(model.parameters())

    def flat(tensors):
        return torch.cat([t.reshape(-1) for t in tensors])

    hessian = double_backward_hessian(model, params, x, y)
    ggn = torch.zeros_like(hessian)
    for i in range(x.shape[0]):
        z = model(x[i : i + 1]).reshape(-1)
        jac = torch.stack(
            [flat(torch.autograd.grad(z[c], params, retain_graph=True)) for c in range(z.numel())]
        )
        p = torch.softmax(z.detach(), dim=0)
        ggn += jac.T @ (torch.diag(p) - torch.outer(p, p)) @ jac
    return hessian, ggn / x.shape[0]


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_recurrent_eigen_and_gauss_newton_match_dense(rnn_dir, cell, capsys):
    ckpt = write_rnn_checkpoint(rnn_dir / f"{cell}.pt", cell)
    common = ("--model-factory", "rnnmodel:make", "--arch-args", f'{{"cell": "{cell}"}}')
    common += ("--data", "ids.npz", "--dtype", "float64", "--json", "-")
    eigen = run_cli(capsys, "eigen", str(ckpt), *common, "--top-k", "2", "--eig-tol", "1e-10")
    assert eigen.code == 0, eigen.err
    split = run_cli(capsys, "gn-nme", str(ckpt), *common, "--trace-max-matvecs", "40")
    assert split.code == 0, split.err
    assert "batching rule" not in split.err
    hessian, ggn = _dense(cell)
    expected = torch.linalg.eigvalsh(hessian).flip(0)[:2].numpy()
    np.testing.assert_allclose(eigen.json()["results"]["eigenvalues"], expected, rtol=1e-8)
    check = split.json()["results"]["ggn_trace_check"]
    exact = float(torch.trace(ggn))
    assert abs(check["exact"] - exact) <= 1e-10 * exact
    assert abs(check["sampled_label"] - exact) <= 4 * check["sampled_label_stderr"]
