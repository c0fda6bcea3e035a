"""The runs behind docs/blocks.md: ``sharp density --blocks params`` on a small GPT-2 (built from a
config, random initialisation) and on the built-in CNN (trained 2 epochs on ``images``), and
``sharp eigen --blocks params --plot`` on the same GPT-2.

Usage: ``python docs/reproduce/blocks_figure.py OUTDIR`` (needs ``transformers``); writes
``OUTDIR/{gpt2,cnn,gpt2_eigen}.json`` and the figures ``docs/blocks_gpt2.png``,
``docs/blocks_cnn.png``, ``docs/blocks_gpt2_eigen.png``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

DOCS = Path(__file__).resolve().parents[1]
SLQ = ["--probes", "2", "--steps", "32", "--seed", "0", "--quiet"]


def sharp(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "sharpcli", *args], check=True)


def gpt2(out: Path) -> None:
    """A 2-layer GPT-2 (width 32, 4 heads, vocabulary 64, 16 positions), 64 random sequences."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    GPT2LMHeadModel(config).eval().save_pretrained(str(out / "gpt2"))
    ids = np.random.default_rng(1).integers(0, 64, size=(64, 16)).astype(np.int64)
    np.savez(out / "gpt2.npz", input_ids=ids, labels=ids)
    sharp(
        "density", str(out / "gpt2"), "--data", str(out / "gpt2.npz"), "--shift-labels",
        "--blocks", "params", *SLQ, "--top", "15", "--plot", str(DOCS / "blocks_gpt2.png"), "--json",
        str(out / "gpt2.json"),
    )  # fmt: skip


def gpt2_eigen(out: Path) -> None:
    """The top eigenvalue of each of the GPT-2's parameter blocks, by layer (after gpt2())."""
    sharp(
        "eigen", str(out / "gpt2"), "--data", str(out / "gpt2.npz"), "--shift-labels",
        "--blocks", "params", "--seed", "0", "--quiet", "--top", "15", "--plot",
        str(DOCS / "blocks_gpt2_eigen.png"), "--json", str(out / "gpt2_eigen.json"),
    )  # fmt: skip


def cnn(out: Path) -> None:
    sharp(
        "train", "--model", "cnn", "--data", "images:n=512", "--epochs", "2", "--seed", "0",
        "--quiet", "--out", str(out / "cnn.safetensors"),
    )  # fmt: skip
    sharp(
        "density", str(out / "cnn.safetensors"), "--blocks", "params", *SLQ, "--plot",
        str(DOCS / "blocks_cnn.png"), "--json", str(out / "cnn.json"),
    )  # fmt: skip


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    gpt2(folder)
    gpt2_eigen(folder)
    cnn(folder)
