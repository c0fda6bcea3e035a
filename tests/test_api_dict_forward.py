"""Dict batches reach a model the way its ``forward`` signature takes them: keys as keyword
arguments (``forward(self, x1, x2)``) or the dict as one argument (``forward(self, batch)``),
decided from the signature (``sharpcli.models.outputs.input_call_style``), never by trying.

References: dense float64 Hessians by double backward of torch's cross-entropy
(tests/hessian_helpers.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharpcli import Curvature
from sharpcli.errors import UsageError
from sharpcli.models.outputs import KEYWORDS, ONE_DICT, input_call_style
from tests.hessian_helpers import double_backward_hessian

D = torch.float64


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(3, 4)
        self.right = nn.Linear(2, 4)
        self.head = nn.Linear(4, 3)

    def logits(self, x1, x2):
        return self.head(torch.tanh(self.left(x1) + self.right(x2)))


class KeywordPair(_Pair):
    def forward(self, x1, x2):
        return self.logits(x1, x2)


class DictPair(_Pair):
    def forward(self, batch):
        return self.logits(batch["x1"], batch["x2"])


def _problem():
    gen = torch.Generator().manual_seed(0)
    x1 = torch.randn(13, 3, dtype=D, generator=gen)
    x2 = torch.randn(13, 2, dtype=D, generator=gen)  # another shape: dict batches need none
    y = torch.randint(0, 3, (13,), generator=gen)
    return x1, x2, y


@pytest.mark.parametrize("cls", [KeywordPair, DictPair])
def test_dict_batches_match_the_dense_hessian_in_either_forward_style(cls):
    torch.manual_seed(1)
    model = cls().double()
    x1, x2, y = _problem()
    reference = double_backward_hessian(
        lambda _: model.logits(x1, x2), list(model.parameters()), None, y
    )
    whole = Curvature(model, nn.CrossEntropyLoss(), {"x1": x1, "x2": x2, "labels": y})
    assert torch.allclose(whole.operator().to_dense(), reference, atol=1e-12, rtol=1e-10)
    batches = [({"x1": x1[i : i + 5], "x2": x2[i : i + 5]}, y[i : i + 5]) for i in (0, 5, 10)]
    loader = Curvature(model, "cross-entropy", batches)
    top = loader.eigenvalues(top_k=1, tol=1e-10).eigenvalues[0]
    assert top == pytest.approx(float(torch.linalg.eigvalsh(reference)[-1]), rel=1e-8)


def test_call_style_is_read_from_the_signature():
    keys = ("x1", "x2")

    def keywords(x1, x2): ...

    def keywords_with_defaults(x1, x2=None, mask=None): ...

    def hugging_face(input_ids=None, attention_mask=None, **kwargs): ...

    def one_dict(batch): ...

    def one_dict_with_options(batch, scale=1.0): ...

    for forward in (keywords, keywords_with_defaults, hugging_face):
        assert input_call_style(forward, keys) == KEYWORDS, forward.__name__
    for forward in (one_dict, one_dict_with_options):
        assert input_call_style(forward, keys) == ONE_DICT, forward.__name__
    # one input named after a parameter is a keyword, even alone (nn.Sequential's `input`)
    assert input_call_style(nn.Sequential(nn.Linear(2, 2)).forward, ("input",)) == KEYWORDS
    # a single key not named after the one parameter: the dict (curvlinops' {"x": X} batches)
    assert input_call_style(one_dict, ("x",)) == ONE_DICT


@pytest.mark.parametrize(
    "signature",
    ["a, b", "x1, batch", "*args"],
)
def test_signatures_that_take_neither_style_are_refused(signature):
    namespace: dict = {}
    exec(f"def forward({signature}): ...", namespace)
    with pytest.raises(UsageError, match="takes neither the inputs x1, x2") as err:
        input_call_style(namespace["forward"], ("x1", "x2"), source="data")
    assert err.value.source == "data"


def test_library_refuses_a_forward_that_takes_neither():
    class Neither(_Pair):
        def forward(self, a, b):
            return self.logits(a, b)

    x1, x2, y = _problem()
    with pytest.raises(UsageError, match=r"forward\(a, b\)"):
        Curvature(Neither().double(), "cross-entropy", {"x1": x1, "x2": x2, "labels": y})


def test_positional_tensors_are_unchanged_by_the_rule():
    """(x, y) batches call forward(x) whatever its parameter is called."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x1, _, y = _problem()
    reference = double_backward_hessian(model, list(model.parameters()), x1, y)
    dense = Curvature(model, "cross-entropy", (x1, y))
    assert torch.allclose(dense.operator().to_dense(), reference, atol=1e-12, rtol=1e-10)
