"""docs/own-loop.md runs as written: its ``python`` blocks in page order, in one namespace (each
section builds on the first block's model and data), in a scratch folder. The DDP block runs
as one gloo rank of one, with the environment torchrun would set."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "own-loop.md"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_own_loop_page_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    blocks = re.findall(
        r"^```python\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), flags=re.S | re.M
    )
    assert len(blocks) == 6  # plain loop, AMP, accumulation, DDP, Trainer, Lightning
    monkeypatch.chdir(tmp_path)
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
    namespace: dict = {"__name__": "own_loop"}
    for index, block in enumerate(blocks):
        # torchrun's variables for the DDP block only: the other blocks are plain processes
        # (with LOCAL_RANK set, the Trainer block's accelerate joins a process group of its
        # own and keeps it for the life of the process: every later `--hvp fsdp` refusal
        # in the same test process then found a group and ran)
        with monkeypatch.context() as scoped:
            if "DistributedDataParallel" in block:
                for key, value in torchrun.items():
                    scoped.setenv(key, value)
            exec(compile(block, f"own-loop.md block {index + 1}", "exec"), namespace)
    import torch

    assert not torch.distributed.is_initialized(), "the page left a process group running"
    out = capsys.readouterr().out
    for line in ["sam: loss", "gp: penalty", "asam under bf16 autocast", "torch.float32",
                 "accumulated sam step taken", "rank 0 of 1", "Trainer: 2 sam updates",
                 "Lightning: 2 sam steps"]:  # fmt: skip
        assert line in out, line
