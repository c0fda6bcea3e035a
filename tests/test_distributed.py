"""Data-parallel commands (README.md): 2 gloo ranks on CPU equal 1 process, rank 0 alone prints.

One ``torch.multiprocessing`` spawn of 2 ranks runs, through ``sharpcli.cli.app.main`` with
torchrun's environment variables, eigen, trace and gn-nme (float64), a command that hits
Inf on rank 1's shard and ``train`` (weight-noise + wd, exact under DDP; the ascent family and
the per-replica penalties: tests/training/test_data_parallel_ascent.py). Each rank's stdout
goes to its own file. The single-process references run in the
test process. A slow test runs the real ``torch.distributed.run`` launcher once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from cli_helpers import run_cli

RELATIVE = 1e-10


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _make_files(tmp_path):
    """A tiny GELU MLP checkpoint on 120 samples (16 features, 4 classes) and a data file whose
    sample 100 is 1e25 (its Hessian products overflow float32: Inf on batch 6 of 16 samples,
    i.e. batch 2 of rank 1's shard [60, 120))."""
    from safetensors.torch import save_file

    from sharpcli.io.checkpoints import save_checkpoint
    from sharpcli.models import build_model, default_model_args

    spec = {
        "name": "mlp",
        "args": default_model_args("mlp", (16,), 4, width=10, depth=2, activation="gelu"),
    }
    torch.manual_seed(0)
    ckpt = tmp_path / "model.safetensors"
    save_checkpoint(ckpt, build_model(spec), spec, data_spec="blobs:n=120,dim=16,classes=4,seed=3")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(120, 16, generator=gen)
    y = torch.randint(0, 4, (120,), generator=gen)
    x[100] = 1e25
    bad = tmp_path / "overflow.safetensors"
    save_file({"x": x, "y": y}, str(bad))
    return ckpt, bad


def _commands(tmp_path, ckpt, bad, out_name: str) -> dict[str, list[str]]:
    # batches of 15: each rank's 45 of the 90 training samples make 3 whole batches, the same
    # 6 batches as one process's (the data error's batch means then agree too)
    common = ["--dtype", "float64", "--batch-size", "15", "--json", "-", "--quiet"]
    train = [
        "train",
        "--data",
        "blobs:n=90,dim=6,classes=3",
        "--epochs",
        "2",
        "--batch-size",
        "25",
        "--dtype",
        "float64",
        "--width",
        "6",
        "--depth",
        "2",
        "--json",
        "-",
        "--quiet",
    ]
    return {
        "eigen": ["eigen", str(ckpt), "--top-k", "2", "--which", "both", *common],
        "trace": [
            "trace",
            str(ckpt),
            "--estimator",
            "hutchinson",
            "--tol",
            "1e-9",
            "--max-matvecs",
            "24",
            *common,
        ],
        "gn-nme": ["gn-nme", str(ckpt), "--tol", "1e-9", "--max-matvecs", "16", *common],
        "overflow": [
            "eigen",
            str(ckpt),
            "--data",
            str(bad),
            "--batch-size",
            "16",
            "--json",
            "-",
            "--quiet",
        ],
        "train": [
            *train,
            "--reg",
            "wd",
            "--reg",
            "weight-noise",
            "--out",
            str(tmp_path / out_name),
        ],
        "sharpness": [
            "sharpness",
            str(ckpt),
            "--rho",
            "0.05,0.1",
            "--m",
            "30",
            "--steps",
            "8",
            "--restarts",
            "2",
            *common,
        ],
        "sharpness-average": [
            "sharpness",
            str(ckpt),
            "--kind",
            "average",
            "--norm",
            "linf",
            "--rho",
            "0.1",
            "--m",
            "40",
            "--noise-draws",
            "5",
            *common,
        ],
        "landscape": [
            "landscape",
            str(ckpt),
            "--steps",
            "5",
            "--span",
            "0.5",
            "--csv",
            str(tmp_path / ("landscape-" + out_name + ".csv")),
            *common,
        ],
    }


def _rank_main(
    rank: int, world: int, ports: list[int], tmp: str, ckpt: str, bad: str, codes
) -> None:
    """One rank: torchrun's environment, then ``main`` per command with stdout in a per-rank file."""
    from pathlib import Path

    from sharpcli.cli import runner
    from sharpcli.cli.app import main

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    commands = _commands(Path(tmp), ckpt, bad, "ddp.safetensors")
    for (name, argv), port in zip(commands.items(), ports):
        os.environ["MASTER_PORT"] = str(port)
        runner.state()["debug"] = False
        with (
            open(Path(tmp) / f"{name}.rank{rank}.out", "w") as out,
            open(Path(tmp) / f"{name}.rank{rank}.err", "w") as err,
        ):
            sys.stdout, sys.stderr = out, err
            try:
                main(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        codes[f"{name}.{rank}"] = code


def _one_json_document(text: str) -> dict:
    decoder = json.JSONDecoder()
    doc, end = decoder.raw_decode(text.lstrip())
    assert text.lstrip()[end:].strip() == "", "more than one JSON document on stdout"
    return doc


def _close(a: float, b: float, scale: float = 0.0) -> bool:
    """Equal to ``RELATIVE`` relative; ``scale`` (the operator's norm) for values at rounding level,
    e.g. the Gauss-Newton matrix's smallest eigenvalue, zero up to ``eps ||G||``."""
    return abs(a - b) <= RELATIVE * max(abs(a), abs(b), abs(scale), 1e-300)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    ckpt, bad = _make_files(tmp)
    manager = mp.Manager()
    codes = manager.dict()
    ports = [_free_port() for _ in _commands(tmp, ckpt, bad, "ddp.safetensors")]
    mp.spawn(_rank_main, args=(2, ports, str(tmp), str(ckpt), str(bad), codes), nprocs=2, join=True)
    outputs = {}
    for name in _commands(tmp, ckpt, bad, "ddp.safetensors"):
        for rank in (0, 1):
            outputs[name, rank] = (
                (tmp / f"{name}.rank{rank}.out").read_text(),
                (tmp / f"{name}.rank{rank}.err").read_text(),
                codes[f"{name}.{rank}"],
            )
    return tmp, ckpt, bad, outputs


@pytest.mark.parametrize("name", ["eigen", "trace", "gn-nme"])
def test_two_ranks_equal_one_process_and_only_rank0_prints(two_ranks, capsys, name):
    tmp, ckpt, bad, outputs = two_ranks
    out0, err0, code0 = outputs[name, 0]
    out1, err1, code1 = outputs[name, 1]
    assert (code0, code1) == (0, 0), (err0, err1)
    assert out1 == "" and err1 == ""  # rank 1 prints and writes nothing
    parallel = _one_json_document(out0)
    assert parallel["environment"]["world_size"] == 2
    single = run_cli(capsys, *_commands(tmp, ckpt, bad, "single.safetensors")[name])
    assert single.code == 0, single.err
    reference = single.json()
    assert reference["environment"]["world_size"] == 1
    ref, par = reference["results"], parallel["results"]
    if name == "eigen":
        assert len(ref["eigenvalues"]) == 4
        norm = max(abs(v) for v in ref["eigenvalues"])
        assert all(_close(a, b, norm) for a, b in zip(ref["eigenvalues"], par["eigenvalues"]))
        assert ref["converged"] == par["converged"] and ref["matvecs"] == par["matvecs"]
        # the data error's per-batch parts gathered from both ranks: the same batches
        assert ref["data_method"] == par["data_method"]
        assert all(_close(a, b) for a, b in zip(ref["data_stderr"], par["data_stderr"]))
    elif name == "trace":
        # a pilot of 10 probes sizes the sample: the estimate is the other 14 of 24 products
        assert ref["trace"]["samples"] == par["trace"]["samples"] == 14
        assert _close(ref["trace"]["estimate"], par["trace"]["estimate"])
        assert _close(ref["trace"]["stderr"], par["trace"]["stderr"])
        assert ref["trace"]["data_batches"] == par["trace"]["data_batches"] > 1
        assert _close(ref["trace"]["data_stderr"], par["trace"]["data_stderr"])
        for layer, value in ref["by_layer"].items():
            assert _close(value["estimate"], par["by_layer"][layer]["estimate"])
    else:
        for op in ("hessian", "ggn", "nme"):
            norm = max(abs(ref[op]["lambda_max"]), abs(ref[op]["lambda_min"]))
            for key in ("lambda_max", "lambda_min"):
                assert _close(ref[op][key], par[op][key], norm), (op, key)
            assert _close(ref[op]["frobenius_sq"], par[op]["frobenius_sq"]), op
            assert _close(ref[op]["trace"]["estimate"], par[op]["trace"]["estimate"])
            # the data errors' per-batch parts gathered from both ranks: the same batches
            for error in (ref[op]["trace"]["data_stderr"], ref[op]["frobenius_sq_data_stderr"]):
                assert error is not None and error > 0, op
            assert _close(ref[op]["trace"]["data_stderr"], par[op]["trace"]["data_stderr"]), op
            assert _close(ref[op]["frobenius_sq_data_stderr"], par[op]["frobenius_sq_data_stderr"])
        assert ref["data_matvecs"] == par["data_matvecs"] > 0
        assert _close(ref["nme_share"], par["nme_share"])
        # exact GN trace (all-reduced per-parameter sums) and the sampled-label estimator, whose
        # label draws are keyed by the global sample index, hence rank-independent
        for key in ("exact", "sampled_label", "sampled_label_stderr"):
            assert _close(ref["ggn_trace_check"][key], par["ggn_trace_check"][key]), key
        assert (
            abs(par["ggn_trace_check"]["sampled_label"] - par["ggn_trace_check"]["exact"])
            <= 4 * par["ggn_trace_check"]["sampled_label_stderr"]
        )


def test_landscape_on_two_ranks_is_the_single_process_grid_bitwise(two_ranks, capsys):
    # the 25 points split 13 / 12 over the ranks, each evaluated on the whole set in one
    # process's batches: the same floats, not merely close ones
    tmp, ckpt, bad, outputs = two_ranks
    out0, err0, code0 = outputs["landscape", 0]
    out1, err1, code1 = outputs["landscape", 1]
    assert (code0, code1) == (0, 0), (err0, err1)
    assert out1 == "" and err1 == ""
    parallel = _one_json_document(out0)
    assert parallel["environment"]["world_size"] == 2
    single = run_cli(capsys, *_commands(tmp, ckpt, bad, "single.safetensors")["landscape"])
    assert single.code == 0, single.err
    ref, par = single.json()["results"], parallel["results"]
    assert len(ref["loss"]) == 5 and len(ref["loss"][0]) == 5
    for key in ("x", "y", "loss", "accuracy", "centre_loss", "loss_min", "loss_max"):
        assert par[key] == ref[key], key
    assert par["directions"]["norms"] == ref["directions"]["norms"]
    # one pass per point plus the centre: once in one process, once per rank in two
    assert (ref["evaluations"], par["evaluations"]) == (26, 27)
    csv_single = (tmp / "landscape-single.safetensors.csv").read_text()
    assert (tmp / "landscape-ddp.safetensors.csv").read_text() == csv_single


@pytest.mark.parametrize("name", ["sharpness", "sharpness-average"])
def test_sharpness_on_two_ranks_is_the_single_process_result_bitwise(two_ranks, capsys, name):
    # the batches of m samples split over the ranks (4 or 3 of them), each rank drawing and
    # discarding the other's random starts or noise: every batch as in one process
    tmp, ckpt, bad, outputs = two_ranks
    out0, err0, code0 = outputs[name, 0]
    out1, err1, code1 = outputs[name, 1]
    assert (code0, code1) == (0, 0), (err0, err1)
    assert out1 == "" and err1 == ""
    parallel = _one_json_document(out0)
    assert parallel["environment"]["world_size"] == 2
    single = run_cli(capsys, *_commands(tmp, ckpt, bad, "single.safetensors")[name])
    assert single.code == 0, single.err
    ref, par = single.json()["results"], parallel["results"]
    assert ref["batches"] == par["batches"] > 2
    assert ref["rows"] == par["rows"]
    assert ref["rows"][0]["sharpness"] != 0


def test_inf_on_one_rank_stops_every_rank_with_exit_3(two_ranks):
    _, _, _, outputs = two_ranks
    out0, err0, code0 = outputs["overflow", 0]
    out1, err1, code1 = outputs["overflow", 1]
    assert (code0, code1) == (3, 3)  # every rank exits with the numerical-failure code
    assert out1 == "" and err1 == ""
    lines = [line for line in err0.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err0
    assert "Hessian" in lines[0] and "batch 2" in lines[0] and "rank 1 of 2" in lines[0]
    error = _one_json_document(out0)["error"]
    assert error["exit_code"] == 3 and error["type"] == "numerical" and error["rank"] == 1


def test_data_parallel_training_equals_one_process(two_ranks, capsys):
    from safetensors.torch import load_file

    tmp, ckpt, bad, outputs = two_ranks
    out0, err0, code0 = outputs["train", 0]
    assert (code0, outputs["train", 1][2]) == (0, 0), err0
    assert outputs["train", 1][0] == ""
    parallel = _one_json_document(out0)
    single = run_cli(capsys, *_commands(tmp, ckpt, bad, "single.safetensors")["train"])
    assert single.code == 0, single.err
    # wd + weight-noise: the same noise on every rank, gradients linear in the batch -> same weights
    a, b = load_file(str(tmp / "single.safetensors")), load_file(str(tmp / "ddp.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-10, atol=1e-12), key
    for row_a, row_b in zip(single.json()["results"]["history"], parallel["results"]["history"]):
        assert _close(row_a["train_loss"], row_b["train_loss"])
        assert _close(row_a["penalties"]["wd"], row_b["penalties"]["wd"])


def _registry():
    from sharpcli.regularizers.registry import REGISTRY

    return REGISTRY


@pytest.mark.parametrize("name", sorted(_registry()))
def test_every_regularizer_declares_data_parallel_exactness(name):
    """Each class, and each class of one of its modes, holds its exactness in its own namespace
    (never inherited), as its catalogue record states; the ones not exact are the regularizers whose penalty or ascent step is nonlinear in the
    batch gradient or Hessian."""
    from sharpcli import catalogue
    from sharpcli.regularizers.base import modes_of
    from sharpcli.regularizers.registry import data_parallel_refusal

    cls = _registry()[name]
    assert "data_parallel" in vars(cls), f"{name} must set data_parallel in its own class body"
    reason = cls.data_parallel
    assert reason is None or (isinstance(reason, str) and reason.strip())
    assert reason == catalogue.REGULARIZERS.entry(name).data_parallel
    for mode_class in modes_of(cls).values():  # a mode class answers with its family's
        assert data_parallel_refusal(mode_class) == reason, mode_class
    if reason is not None:
        assert "nonlinear" in reason or "global" in reason, reason


@pytest.mark.parametrize("name", sorted(_registry()))
def test_every_regularizer_runs_under_torchrun_exactly_or_per_replica(name):
    """Each built-in is exact under data parallelism or states what a rank computes on its own
    rows (gp, fa, gn-trace and the ascent family), so the check lets each one through."""
    from sharpcli.regularizers.registry import parse_reg
    from sharpcli.training import loop
    from sharpcli.training.data_parallel import per_replica_statement

    reg = parse_reg(name)
    statement = per_replica_statement(reg)
    assert (statement is None) == (_registry()[name].data_parallel is None), name
    if statement is not None:
        assert "each rank" in statement and "own" in statement
    loop.check_data_parallel_regs([reg])


def test_refusal_under_torchrun_names_the_declared_reason(tmp_path, monkeypatch):
    """``train`` as one of 2 ranks: a regularizer that is not exact and states no per-replica
    semantics is refused on ``--reg`` with its class's reason, before any data is read."""
    from sharpcli.errors import UsageError
    from sharpcli.regularizers.penalties.decay import WeightDecay
    from sharpcli.training import loop

    class GlobalOnly(WeightDecay):
        """``wd-global``: weight decay, declared not exact under torchrun (for this test)."""

        name = "wd-global"
        data_parallel = "its penalty needs the whole batch"

    monkeypatch.setattr(loop, "data_parallel_rank_and_world", lambda: (0, 2))
    cfg = loop.TrainConfig(
        data=str(tmp_path / "never-read.safetensors"), regs=[GlobalOnly(), "wd", "sam"]
    )
    with pytest.raises(UsageError) as info:
        loop.train(cfg, tmp_path / "model.safetensors")
    assert info.value.source == "regs"
    message = info.value.message
    assert "wd-global: its penalty needs the whole batch" in message
    assert "wd," not in message and "sam" not in message  # exact, and per replica


@pytest.mark.slow
def test_torchrun_launcher_prints_one_json_document(tmp_path):
    ckpt, _ = _make_files(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["eigen", str(ckpt), "--dtype", "float64", "--batch-size", "16", "--json", "-"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "sharpcli",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    parallel = _one_json_document(proc.stdout)
    single = subprocess.run(
        [sys.executable, "-m", "sharpcli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    reference = json.loads(single.stdout)
    assert parallel["environment"]["world_size"] == 2
    assert _close(parallel["results"]["eigenvalues"][0], reference["results"]["eigenvalues"][0])


# ---------------------------------------------------------------------------------------------- peers
# A rank that stalls (SIGSTOP) or dies without torchrun: the others fail after SHARP_DIST_TIMEOUT
# (not gloo's 30 minutes) with exit 3 and one line naming the rank, never exit 4. The same
# wait bounds the join: 4 s let a loaded machine's rank 1 give up before rank 0 had started
# (exit 2, "could not join"), so the wait is 8 s.
PEER_TIMEOUT = "8"


def _peer_rank_main(rank: int, port: int, tmp: str, ckpt: str, culprit: int, fate: str, codes):
    """One of 2 ranks running ``eigen``; rank ``culprit`` stalls or dies in its 3rd all-reduce."""
    import signal
    import time
    from pathlib import Path

    from sharpcli.cli import runner
    from sharpcli.cli.app import main

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SHARP_DIST_TIMEOUT=PEER_TIMEOUT,
    )
    if rank == culprit:
        real, calls = torch.distributed.all_reduce, []

        def all_reduce(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                if fate == "stall":
                    os.kill(os.getpid(), signal.SIGSTOP)
                os._exit(9)
            return real(*args, **kwargs)

        torch.distributed.all_reduce = all_reduce
    runner.state()["debug"] = False
    start = time.monotonic()
    with (
        open(Path(tmp) / f"rank{rank}.out", "w") as out,
        open(Path(tmp) / f"rank{rank}.err", "w") as err,
    ):
        sys.stdout, sys.stderr = out, err
        try:
            main(["eigen", ckpt, "--batch-size", "16", "--max-matvecs", "6", "--json", "-"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    codes[rank] = (code, time.monotonic() - start)


def _run_peers(tmp_path, culprit: int, fate: str):
    """Both ranks' ``(exit code, seconds, stdout, stderr)`` of the healthy one, the culprit killed."""
    ckpt, _ = _make_files(tmp_path)
    context = mp.get_context("spawn")
    codes = context.Manager().dict()
    port = _free_port()
    procs = [
        context.Process(
            target=_peer_rank_main,
            args=(rank, port, str(tmp_path), str(ckpt), culprit, fate, codes),
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    healthy = 1 - culprit
    procs[healthy].join(240)
    alive = procs[healthy].is_alive()
    for proc in procs:
        proc.kill()
        proc.join()
    assert not alive, "the healthy rank still waits"
    code, seconds = codes[healthy]
    out = (tmp_path / f"rank{healthy}.out").read_text()
    err = (tmp_path / f"rank{healthy}.err").read_text()
    return code, seconds, out, err


@pytest.mark.parametrize(
    "culprit,fate,words",
    [
        (1, "stall", ("rank 1 of 2", f"within {PEER_TIMEOUT} s", "SHARP_DIST_TIMEOUT")),
        (1, "die", ("rank 1 of 2", "is gone")),
        (0, "stall", ("rank 0 of 2",)),
    ],
)
def test_stalled_or_dead_peer_is_exit_3_naming_the_rank(tmp_path, culprit, fate, words):
    code, seconds, out, err = _run_peers(tmp_path, culprit, fate)
    assert code == 3, (code, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("sharp eigen: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    error = _one_json_document(out)["error"]
    assert error["exit_code"] == 3 and error["source"] == f"rank {culprit}"
    assert error["rank"] == culprit
    assert seconds < 120  # the timeout, not gloo's 30 minutes


def test_dist_timeout_must_be_a_positive_number(monkeypatch):
    from sharpcli.distributed import DEFAULT_TIMEOUT, timeout_seconds
    from sharpcli.errors import UsageError

    monkeypatch.delenv("SHARP_DIST_TIMEOUT", raising=False)
    assert timeout_seconds() == DEFAULT_TIMEOUT == 600
    monkeypatch.setenv("SHARP_DIST_TIMEOUT", "2.5")
    assert timeout_seconds() == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv("SHARP_DIST_TIMEOUT", bad)
        with pytest.raises(UsageError) as info:
            timeout_seconds()
        assert info.value.source == "SHARP_DIST_TIMEOUT"


def test_joining_a_master_that_never_answers_fails_within_the_timeout(tmp_path):
    """Outside torchrun, rank 1 of 2 whose MASTER_PORT is held by a process that accepts the
    connection and never answers (a stopped rank 0, or a foreign server on a reused port):
    the join ends within ``SHARP_DIST_TIMEOUT`` with one line naming the master's address and
    the variable, exit 2, instead of waiting for good (torch's store client waits for the
    handshake's answer without a timeout)."""
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # the kernel accepts connections; nobody ever reads or answers
        port = silent.getsockname()[1]
        env = {
            **os.environ,
            "WORLD_SIZE": "2",
            "RANK": "1",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SHARP_DIST_TIMEOUT": "2",
        }
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        start = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "sharpcli", "trace", str(tmp_path / "none.safetensors")],
                env=env,
                capture_output=True,
                text=True,
                timeout=45,
            )
        except subprocess.TimeoutExpired:
            pytest.fail("the rank still waits to join after 45 s (SHARP_DIST_TIMEOUT=2)")
        seconds = time.monotonic() - start
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "SHARP_DIST_TIMEOUT" in lines[0], lines[0]
    assert "within 2 s" in lines[0], lines[0]
    assert seconds < 40, seconds  # the 2 s bound plus start-up, not a hang
