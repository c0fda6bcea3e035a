"""Research-scale models built by hand from their published shapes (no downloads).

- :func:`resnet18`: the CIFAR ResNet-18 of [He2016] as the field trains it on 32x32 images
  (3x3 stem, no max-pool, BasicBlocks [2, 2, 2, 2] of 64-512 channels, BatchNorm):
  11,173,962 parameters for 10 classes.
- :func:`gpt2`: a GPT-2-shaped causal language model (token and position embeddings,
  pre-LayerNorm blocks of causal multi-head attention and a GELU MLP of 4 d, a final
  LayerNorm, the output head tied to the token embedding). ``gpt2()`` is GPT-2 small:
  vocabulary 50257, 1024 positions, d = 768, 12 layers and heads, 124,439,808 parameters;
  ``gpt2(d=1024, layers=24, heads=16)`` is GPT-2 medium (354,823,168).
- :func:`mlp`: a plain ReLU MLP whose size is set by its width, for the growth plot.

``benchmarks/bench_scale.py`` writes checkpoints of these as ``--model-factory`` models
(this file is importable as ``scale_models``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR ResNet-18: 3x3 stem, four stages of two BasicBlocks, global pooling, linear head."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def resnet18(num_classes: int = 10) -> nn.Module:
    """The CIFAR ResNet-18 (11.2M parameters for 10 classes)."""
    torch.manual_seed(0)
    return ResNet18(num_classes)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2-shaped causal LM; logits ``(B, T, vocab)`` from a head tied to ``wte``."""

    def __init__(self, vocab: int, positions: int, d: int, layers: int, heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("weight") and p.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * layers)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)

    def forward(self, x):
        T = x.shape[1]
        h = self.wte(x) + self.wpe(torch.arange(T, device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.ln_f(h) @ self.wte.weight.T


def gpt2(
    vocab: int = 50257, positions: int = 1024, d: int = 768, layers: int = 12, heads: int = 12
) -> nn.Module:
    """GPT-2 small by default (124M parameters, tied head)."""
    torch.manual_seed(0)
    return GPT2(vocab, positions, d, layers, heads)


def mlp(inputs: int = 256, width: int = 1024, depth: int = 4, classes: int = 10) -> nn.Module:
    """A ReLU MLP with ``depth`` hidden layers of ``width`` units."""
    torch.manual_seed(0)
    layers, cin = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(cin, width), nn.ReLU()]
        cin = width
    return nn.Sequential(*layers, nn.Linear(cin, classes))
