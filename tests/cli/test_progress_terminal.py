"""What a person sees in an 80-column terminal while ``sharp train`` runs: the process is run
under a pseudo-terminal and its screen output parsed. Progress shows the steps done (monotone),
no remaining time before it is stable, nothing cut or wider than 80 columns, and one line per
epoch as it ends (sharpcli/cli/bars.py)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest

from sharpcli.cli import bars

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pty")

CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
EPOCHS = 6


def _run_in_terminal(argv: list[str], cwd, columns: int = 80, timeout: float = 240.0) -> str:
    """Run ``python -m sharpcli ARGV`` with stdout and stderr on a pty ``columns`` wide; the
    text it drew, escape sequences removed."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS=str(columns), TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sharpcli", *argv],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    finally:
        proc.kill()
        os.close(master)
    return CSI.sub("", b"".join(chunks).decode("utf-8", errors="replace"))


def test_train_progress_and_epoch_lines_in_an_80_column_terminal(tmp_path):
    argv = ["train", "--data", "blobs:n=3000", "--epochs", str(EPOCHS), "--out", "m.safetensors"]
    screen = _run_in_terminal(argv, tmp_path)
    lines = [line for part in screen.split("\n") for line in part.split("\r") if line.strip()]
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)

    # one line per epoch as it ends, in order, with the train and test loss and accuracy
    epochs = [line for line in lines if line.startswith("epoch ")]
    numbers = [int(re.match(r"epoch +(\d+)/", line).group(1)) for line in epochs]
    assert sorted(set(numbers)) == list(range(1, EPOCHS + 1)), epochs
    assert all(re.search(r"train loss \S+ acc \S+  test loss \S+ acc \S+", e) for e in epochs)

    # the bar: steps done out of the total, monotone; an ETA only once stable
    bar = re.compile(r"^train +\S* +(\d+)/(\d+) steps .*?(\d+:\d\d)(<\d+:\d\d)? *$")
    frames = [m for line in lines if (m := bar.match(line))]
    shown = epochs + [m.group(0) for m in frames]
    assert not any("…" in line for line in shown), [line for line in shown if "…" in line]
    assert len(frames) >= 3, lines[:20]
    done = [int(m.group(1)) for m in frames]
    assert done == sorted(done), done
    total = int(frames[0].group(2))
    assert {int(m.group(2)) for m in frames} == {total} and total % EPOCHS == 0
    # The first frame drawn can come late when the steps are fast (a loaded machine drew its
    # first at step 180 of 216), so only the frames drawn before the estimate is stable are
    # checked for having none.
    with_eta = [int(m.group(1)) for m in frames if m.group(4)]
    assert all(d >= 1 + bars.ETA_UNITS for d in with_eta), with_eta
