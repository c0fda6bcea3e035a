"""Bad input, everywhere: the error contract of docs/json.md, one table of cases across all commands.

Each case is a command line with one thing wrong (a corrupt, truncated or wrong-format
checkpoint or data file, a shape or dtype mismatch, NaN/Inf in weights or data, labels out of
range, an empty set, contradictory options, an unwritable output path, a pickle without
``--trust-pickle``, a NaN produced during a computation). For every case:

- the exit code is 2 (bad usage or input) or 3 (numerical failure);
- stderr is exactly one line, ``sharp COMMAND: error: ...``, naming the file or option
  (the case's needles) and holding no traceback;
- with ``--json PATH`` the file at PATH (an old report there already) is replaced by the JSON
  error object ``{"schema", "command", "version", "error": {"type", "message", "exit_code",
  "source"}}``; with ``--json -`` that object is the only thing on stdout;
- nothing else in the output folder changes: a pre-existing ``--out`` checkpoint and ``--plot``
  image keep their exact bytes and permission bits, no temporary, state or history file is left
  behind, and the input files are untouched; a replaced ``--json`` report keeps its mode.

The section "outputs never destroy what the user has" adds the cases where the output is the
problem: an output that is also an input (a side file ``<out>.history.csv``/``<out>.state.pt``,
a sweep run file, the data a checkpoint's metadata names), a side file's path that is a folder,
a disk that fills up while the state, the checkpoint, the history, the plot or the report is
written (``disk_full``: writes to those temporaries fail with ENOSPC). Further down, outside the
table, the guarantees on successful runs (modes, devices, FIFOs), signals (subprocesses sent
SIGINT/SIGTERM) and a closed stdout.

Where the product misses the contract a case is marked ``xfail(strict=True)`` with the
observed behaviour as its reason, so a fix flips it to a (strict) failure and the mark must go.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template

import numpy as np
import pandas as pd
import pytest
import torch
from cli_helpers import Run, run_cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from fixtures.make_checkpoint_fixtures import (
    tiny_mlp_spec,
    write_broken_files,
    write_foreign_state_dict,
    write_own_checkpoint,
    write_pickled_module,
)
from sharpcli import SCHEMA_ID, __version__
from sharpcli.io.checkpoints import load_checkpoint, save_checkpoint
from sharpcli.models import build_model

DATA = "blobs:n=64"  # dim 16, 4 classes: the own checkpoints' data, 48 train samples
OLD_OUT = b"an existing checkpoint that a failed run must not touch\n"
OLD_PLOT = b"\x89PNG an existing plot that a failed run must not touch\n"
OLD_REPORT = b'{"old": "report"}\n'


@dataclass(frozen=True)
class Case:
    """One bad command line and what the user must see.

    ``argv`` and ``needles`` may name fixture files as ``$name`` (see ``files``) and the
    per-test output folder's pre-existing files as ``$out``, ``$plot``, ``$report`` (and the
    folder itself as ``$outdir``). ``json=False`` when ``--json`` itself is the bad input.
    """

    id: str
    argv: tuple[str, ...]
    code: int
    needles: tuple[str, ...]
    json: bool = True
    xfail: str | None = None
    needs_non_root: bool = False  # a read-only folder stops only non-root users
    setup: str | None = None  # a SETUPS entry that adds files to the output folder first
    disk_full: str | None = None  # regex: writes to matching temporaries fail with ENOSPC


C = Case
CASES = [
    # ------------------------------------------------------------------ checkpoints: corrupt, wrong format
    C(
        "ckpt-garbage-safetensors",
        ("eigen", "$garbage_st"),
        2,
        ("$garbage_st", "not a readable safetensors"),
    ),
    C("ckpt-truncated-safetensors", ("trace", "$truncated_st"), 2, ("$truncated_st",)),
    C("ckpt-empty-safetensors", ("gn-nme", "$empty_st"), 2, ("$empty_st",)),
    C(
        "ckpt-garbage-pt",
        ("density", "$garbage_pt"),
        2,
        ("$garbage_pt", "not a readable PyTorch file"),
    ),
    C(
        "ckpt-truncated-pt",
        ("analyze", "$truncated_pt", "--arch", "mlp", "--arch-args", "$args"),
        2,
        ("$truncated_pt",),
    ),
    C(
        "ckpt-wrong-extension",
        ("eigen", "$own_txt"),
        2,
        ("$own_txt", "unknown checkpoint format .txt"),
    ),
    C("ckpt-torch-zip-named-safetensors", ("eigen", "$zip_st"), 2, ("$zip_st",)),
    C(
        "ckpt-missing-file",
        ("trace", "$fixdir/no_such.safetensors"),
        2,
        ("$fixdir/no_such.safetensors", "no such file"),
    ),
    C("ckpt-is-a-folder", ("eigen", "$fixdir"), 2, ("$fixdir", "folder")),
    C(
        "ckpt-pickled-module-without-trust",
        ("eigen", "$pickled"),
        2,
        ("$pickled", "--trust-pickle"),
    ),
    C(
        "ckpt-list-not-state-dict",
        ("trace", "$list_pt", "--arch", "mlp", "--arch-args", "$args"),
        2,
        ("$list_pt", "state_dict"),
    ),
    C(
        "ckpt-shape-mismatch-arch-args",
        ("eigen", "$foreign_st", "--arch", "mlp", "--arch-args", "$wide_args"),
        2,
        ("$foreign_st", "shape mismatch"),
    ),
    C(
        "ckpt-missing-keys-arch-args",
        ("gn-nme", "$foreign_pt", "--arch", "mlp", "--arch-args", "$deep_args"),
        2,
        ("$foreign_pt", "missing"),
    ),
    C(
        "ckpt-nan-weights",
        ("analyze", "$nan_st", "--arch", "mlp", "--arch-args", "$args"),
        2,
        ("$nan_st", "NaN or Inf", "0.weight"),
    ),
    C("ckpt-inf-weights-own", ("gn-nme", "$inf_own"), 2, ("$inf_own", "NaN or Inf", "2.bias")),
    C(
        "ckpt-integer-weights-dtype-mismatch",
        ("eigen", "$int_st", "--arch", "mlp", "--arch-args", "$args", "--data", "blobs:n=64"),
        2,
        ("$int_st", "dtype"),
    ),
    C("ckpt-metadata-not-json", ("eigen", "$badmeta"), 2, ("$badmeta", "sharpcli.model")),
    C("ckpt-metadata-unknown-model", ("trace", "$unkmodel"), 2, ("$unkmodel", "transformer")),
    C("ckpt-metadata-data-file-missing", ("eigen", "$missingdata"), 2, ("$fixdir/gone.npz",)),
    C("ckpt-foreign-without-arch", ("eigen", "$foreign_st"), 2, ("$foreign_st", "--arch")),
    # ------------------------------------------------------------------ data: content and format
    C(
        "data-wrong-feature-count",
        ("trace", "$own", "--data", "$wrongfeat_npz"),
        2,
        ("$wrongfeat_npz", "(5,)"),
    ),
    C(
        "data-labels-out-of-range",
        ("eigen", "$own", "--data", "$labels_npz"),
        2,
        ("$labels_npz", "4 classes"),
    ),
    C("data-nan-features", ("gn-nme", "$own", "--data", "$nan_npz"), 2, ("$nan_npz", "non-finite")),
    C("data-inf-in-csv", ("analyze", "$own", "--data", "$inf_csv"), 2, ("$inf_csv", "non-finite")),
    C("data-empty", ("eigen", "$own", "--data", "$empty_npz"), 2, ("$empty_npz", "empty")),
    C(
        "data-csv-without-label-column",
        ("trace", "$own", "--data", "$nolabel_csv"),
        2,
        ("$nolabel_csv", "label"),
    ),
    C(
        "data-label-column-not-in-csv",
        ("eigen", "$own", "--data", "$ok_csv", "--label-column", "klass"),
        2,
        ("$ok_csv", "klass"),
    ),
    C(
        "data-npz-without-x",
        ("eigen", "$own", "--data", "$nox_npz"),
        2,
        ("$nox_npz", "keys found: features, y", "--x-key"),  # plain names: what --x-key takes
    ),
    C(
        "data-length-mismatch",
        ("trace", "$own", "--data", "$mismatch_npz"),
        2,
        ("$mismatch_npz", "7 labels"),
    ),
    C("data-string-features", ("eigen", "$own", "--data", "$strx_npz"), 2, ("$strx_npz", "dtype")),
    C(
        "data-float-labels-for-classifier",
        ("eigen", "$own", "--data", "$floaty_npz"),
        2,
        ("$floaty_npz", "4 outputs"),
    ),
    C(
        "data-x-test-without-y-test",
        ("gn-nme", "$own", "--data", "$xtestonly_npz"),
        2,
        ("$xtestonly_npz", "y_test"),
    ),
    C("data-garbage-npz", ("trace", "$own", "--data", "$garbage_npz"), 2, ("$garbage_npz",)),
    C("data-unknown-extension", ("eigen", "$own", "--data", "$data_xyz"), 2, ("$data_xyz",)),
    C(
        "data-missing-file",
        ("eigen", "$own", "--data", "$fixdir/nothere.npz"),
        2,
        ("$fixdir/nothere.npz",),
    ),
    C(
        "data-no-test-split",
        ("trace", "$own", "--data", "$ok_npz", "--split", "test"),
        2,
        ("$ok_npz", "test"),
    ),
    C(
        "data-builtin-bad-argument",
        ("eigen", "$own", "--data", "blobs:n=abc"),
        2,
        ("--data", "n must be an integer"),
    ),
    # ------------------------------------------------------------------ common options
    C("opt-unknown-split", ("eigen", "$own", "--split", "val"), 2, ("--split", "'val'")),
    C(
        "opt-samples-larger-than-set",
        ("trace", "$own", "--samples", "100000"),
        2,
        ("--samples", "only 48"),
    ),
    C("opt-samples-zero", ("gn-nme", "$own", "--samples", "0"), 2, ("--samples",)),
    C("opt-batch-size-zero", ("analyze", "$own", "--batch-size", "0"), 2, ("--batch-size",)),
    C("opt-dtype-float16", ("eigen", "$own", "--dtype", "float16"), 2, ("--dtype", "float16")),
    C(
        "opt-device-cuda-on-cpu-machine",
        ("trace", "$own", "--device", "cuda"),
        2,
        ("--device", "CUDA"),
    ),
    C("opt-device-unknown", ("eigen", "$own", "--device", "quantum"), 2, ("--device", "quantum")),
    C(
        "opt-device-meta-holds-no-data",
        ("gn-nme", "$own", "--device", "meta"),
        2,
        ("--device", "'meta'"),
    ),
    C(
        "opt-arch-with-model-factory",
        ("eigen", "$foreign_st", "--arch", "mlp", "--model-factory", "usermodel:make"),
        2,
        ("--arch", "--model-factory"),
    ),
    C(
        "opt-arch-args-bad-json",
        ("eigen", "$foreign_st", "--arch", "mlp", "--arch-args", "{in_features: 16"),
        2,
        ("--arch-args", "not valid JSON"),
    ),
    C(
        "opt-arch-args-not-object",
        ("trace", "$foreign_st", "--arch", "mlp", "--arch-args", "[16, 4]"),
        2,
        ("--arch-args", "JSON object"),
    ),
    C(
        "opt-arch-args-unknown-key",
        ("eigen", "$foreign_st", "--arch", "mlp", "--arch-args", "$bogus_args"),
        2,
        ("--arch-args", "bogus"),
    ),
    C(
        "opt-arch-unknown",
        ("eigen", "$foreign_st", "--arch", "transformer"),
        2,
        ("--arch", "transformer"),
    ),
    C(
        "opt-model-factory-no-colon",
        ("eigen", "$foreign_st", "--model-factory", "usermodel"),
        2,
        ("--model-factory", "module:function"),
    ),
    C(
        "opt-model-factory-unimportable",
        ("eigen", "$foreign_st", "--model-factory", "no_such_module_xyz:make"),
        2,
        ("--model-factory", "no_such_module_xyz"),
    ),
    C(
        "opt-json-into-missing-folder",
        ("eigen", "$own", "--json", "$outdir/missing/report.json"),
        2,
        ("$outdir/missing/report.json", "does not exist"),
        json=False,
    ),
    C(
        "opt-json-onto-directory",
        ("trace", "$own", "--json", "$outdir"),
        2,
        ("$outdir", "directory"),
        json=False,
    ),
    C(
        "opt-json-into-read-only-folder",
        ("eigen", "$own", "--json", "$outdir/readonly/report.json"),
        2,
        ("$outdir/readonly/report.json", "not writable"),
        json=False,
        needs_non_root=True,
    ),
    C(
        "opt-json-below-a-regular-file",
        ("eigen", "$own", "--quiet", "--json", "$plain/report.json"),
        2,
        ("$plain/report.json",),
        json=False,
    ),
    C("opt-typer-bad-integer", ("eigen", "$own", "--top-k", "abc"), 2, ("--top-k",)),
    C("opt-typer-unknown-option", ("trace", "$own", "--no-such-option"), 2, ("--no-such-option",)),
    C(
        "opt-json-onto-the-checkpoint",
        ("eigen", "$own", "--json", "$own"),
        2,
        ("--json", "$own", "also an input"),
        json=False,
    ),
    C(
        "opt-plot-onto-the-checkpoint",
        ("density", "$own", "--steps", "4", "--probes", "1", "--plot", "$own"),
        2,
        ("--plot", "$own", "also an input"),
    ),
    # ------------------------------------------------------------------ eigen / trace / gn-nme / density options
    C("eigen-top-k-zero", ("eigen", "$own", "--top-k", "0"), 2, ("--top-k",)),
    C("eigen-tol-negative", ("eigen", "$own", "--eig-tol", "-1"), 2, ("--eig-tol", "> 0")),
    C(
        "eigen-unknown-operator",
        ("eigen", "$own", "--operator", "jacobian"),
        2,
        ("--operator", "jacobian"),
    ),
    C("eigen-unknown-which", ("eigen", "$own", "--which", "sideways"), 2, ("--which", "sideways")),
    C(
        "eigen-power-cannot-find-smallest",
        ("eigen", "$own", "--method", "power", "--which", "smallest"),
        2,
        ("--which", "lanczos"),
    ),
    C(
        "eigen-pyhessian-only-hessian",
        ("eigen", "$own", "--engine", "pyhessian", "--operator", "ggn"),
        2,
        ("--engine",),
    ),
    C(
        "eigen-params-glob-matches-nothing",
        ("eigen", "$own", "--params", "encoder.*"),
        2,
        ("--params", "encoder.*"),
    ),
    C(
        "eigen-max-matvecs-zero",
        ("eigen", "$own", "--eig-max-matvecs", "0"),
        2,
        ("--eig-max-matvecs",),
    ),
    C("trace-tol-negative", ("trace", "$own", "--trace-tol", "-1"), 2, ("--trace-tol",)),
    C(
        "trace-unknown-operator",
        ("trace", "$own", "--operator", "jacobian"),
        2,
        ("--operator", "jacobian"),
    ),
    C(
        "trace-unknown-estimator",
        ("trace", "$own", "--estimator", "magic"),
        2,
        ("--estimator", "magic"),
    ),
    C(
        "trace-params-glob-matches-nothing",
        ("trace", "$own", "--params", "*.gamma"),
        2,
        ("--params", "*.gamma"),
    ),
    C(
        "trace-max-matvecs-one",
        ("trace", "$own", "--trace-max-matvecs", "1"),
        2,
        ("--trace-max-matvecs",),
    ),
    C("gn-nme-eig-tol-zero", ("gn-nme", "$own", "--eig-tol", "0"), 2, ("--eig-tol",)),
    C(
        "density-unknown-operator-keeps-plot",
        ("density", "$own", "--operator", "nme2", "--plot", "$plot"),
        2,
        ("--operator", "nme2"),
    ),
    C("density-steps-one", ("density", "$own", "--steps", "1", "--plot", "$plot"), 2, ("--steps",)),
    C(
        "density-plot-into-missing-folder",
        ("density", "$own", "--plot", "$outdir/none/density.png"),
        2,
        ("$outdir/none/density.png", "does not exist"),
    ),
    C(
        "density-plot-onto-directory",
        ("density", "$own", "--plot", "$outdir"),
        2,
        ("$outdir", "directory"),
    ),
    C(
        "density-plot-below-a-regular-file",
        ("density", "$own", "--steps", "4", "--probes", "1", "--plot", "$plain/density.png"),
        2,
        ("$plain/density.png",),
    ),
    # ------------------------------------------------------------------ analyze
    C("analyze-top-k-zero", ("analyze", "$own", "--top-k", "0"), 2, ("--top-k",)),
    C(
        "analyze-unknown-metric",
        ("analyze", "$own", "--metrics", "eigen,curvyness"),
        2,
        ("--metrics", "curvyness"),
    ),
    C(
        "analyze-fail-if-malformed",
        ("analyze", "$own", "--fail-if", "hessian.lambda_max >> 3"),
        2,
        ("--fail-if", ">>"),
    ),
    C(
        "analyze-fail-if-not-a-number",
        ("analyze", "$own", "--fail-if", "hessian.lambda_max > lots"),
        2,
        ("--fail-if",),
    ),
    C(
        "analyze-fail-if-unknown-key",
        ("analyze", "$own", "--quiet", "--fail-if", "hessian.sharpness > 1"),
        2,
        ("--fail-if", "hessian.sharpness"),
    ),
    # ------------------------------------------------------------------ numerical failures (exit 3)
    C("nan-during-eigen", ("eigen", "$huge_own"), 3, ("nan",)),
    C("nan-during-trace", ("trace", "$huge_own"), 3, ("nan",)),
    C("nan-during-gn-nme", ("gn-nme", "$huge_own"), 3, ("nan",)),
    C("nan-during-analyze", ("analyze", "$huge_own"), 3, ("nan",)),
    C("nan-during-density-keeps-plot", ("density", "$huge_own", "--plot", "$plot"), 3, ("nan",)),
    C(
        "nan-during-training-keeps-out",
        (
            "train",
            "--data",
            "blobs:n=64",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--lr",
            "1e30",
            "--out",
            "$out",
        ),
        3,
        ("nan",),
    ),
    # ------------------------------------------------------------------ train
    C("train-unknown-reg", ("train", "--reg", "sharpen", "--out", "$out"), 2, ("--reg", "sharpen")),
    C(
        "train-bad-reg-hyperparameter",
        ("train", "--reg", "sam:rho=-1", "--out", "$out"),
        2,
        ("--reg", "rho"),
    ),
    C(
        "train-reg-hyperparameter-not-number",
        ("train", "--reg", "wd:sigma=big", "--out", "$out"),
        2,
        ("--reg", "sigma"),
    ),
    C(
        "train-reg-unknown-hyperparameter",
        ("train", "--reg", "sam:radius=0.1", "--out", "$out"),
        2,
        ("--reg", "radius"),
    ),
    C(
        "train-reg-given-twice",
        ("train", "--reg", "sam", "--reg", "sam:rho=0.1", "--out", "$out"),
        2,
        ("--reg", "sam"),
    ),
    C("train-out-onto-directory", ("train", "--out", "$outdir"), 2, ("$outdir", "directory")),
    C(
        "train-out-into-missing-folder",
        ("train", "--out", "$outdir/none/model.safetensors"),
        2,
        ("$outdir/none/model.safetensors", "does not exist"),
    ),
    C(
        "train-out-into-read-only-folder",
        ("train", "--out", "$outdir/readonly/model.safetensors"),
        2,
        ("$outdir/readonly/model.safetensors", "not writable"),
        needs_non_root=True,
    ),
    C(
        "train-out-below-a-regular-file",
        ("train", "--data", "blobs:n=64", "--epochs", "1", "--out", "$plain/model.safetensors"),
        2,
        ("$plain/model.safetensors",),
    ),
    C(
        "train-dtype-float16",
        ("train", "--dtype", "float16", "--out", "$out"),
        2,
        ("--dtype", "float16"),
    ),
    C(
        "train-device-cuda",
        ("train", "--device", "cuda", "--data", "blobs:n=64", "--out", "$out"),
        2,
        ("--device", "CUDA"),
    ),
    C(
        "train-device-meta",
        ("train", "--device", "meta", "--data", "blobs:n=64", "--out", "$out"),
        2,
        ("--device", "'meta'"),
    ),
    C("train-epochs-zero", ("train", "--epochs", "0", "--out", "$out"), 2, ("--epochs",)),
    C("train-negative-lr", ("train", "--lr", "-0.1", "--out", "$out"), 2, ("--lr",)),
    C(
        "train-unknown-optimizer",
        ("train", "--optimizer", "lion", "--out", "$out"),
        2,
        ("--optimizer", "lion"),
    ),
    C(
        "train-label-noise-above-one",
        ("train", "--label-noise", "1.5", "--out", "$out"),
        2,
        ("--label-noise",),
    ),
    C(
        "train-model-args-bad-json",
        ("train", "--model-args", "{width: 3}", "--out", "$out"),
        2,
        ("--model-args",),
    ),
    C(
        "train-cnn-on-vector-data",
        ("train", "--model", "cnn", "--data", "blobs:n=64", "--out", "$out"),
        2,
        ("--model", "cnn"),
    ),
    C(
        "train-unknown-activation",
        ("train", "--activation", "swishy", "--data", "blobs:n=64", "--out", "$out"),
        2,
        ("swishy",),
    ),
    C(
        "train-unknown-track",
        ("train", "--track", "wobble", "--data", "blobs:n=64", "--out", "$out"),
        2,
        ("--track", "wobble"),
    ),
    C(
        "train-resume-without-state",
        ("train", "--resume", "--data", "blobs:n=64", "--out", "$out"),
        2,
        ("$out.state.pt", "resum"),
    ),
    C(
        "train-nan-in-data",
        ("train", "--data", "$nan_npz", "--out", "$out"),
        2,
        ("$nan_npz", "non-finite"),
    ),
    C(
        "train-csv-without-label-column",
        ("train", "--data", "$nolabel_csv", "--out", "$out"),
        2,
        ("$nolabel_csv", "label"),
    ),
    C(
        "train-empty-data",
        ("train", "--data", "$empty_npz", "--out", "$out"),
        2,
        ("$empty_npz", "empty"),
    ),
    C(
        "train-out-onto-the-data-file",
        ("train", "--data", "$ok_npz", "--epochs", "1", "--out", "$ok_npz"),
        2,
        ("--out", "$ok_npz", "also an input"),
    ),
    C(
        "train-json-onto-out",
        ("train", "--data", "blobs:n=64", "--epochs", "1", "--out", "$out", "--json", "$out"),
        2,
        ("--json", "$out", "--out"),
        json=False,
    ),
    # ------------------------------------------------------------------ sweep
    C(
        "sweep-unknown-reg",
        ("sweep", "--reg", "sharpen", "--grid", "sigma=0.1", "--out-dir", "$outdir/sweep"),
        2,
        ("--reg", "sharpen"),
    ),
    C(
        "sweep-grid-malformed",
        ("sweep", "--reg", "ad", "--grid", "sigma", "--out-dir", "$outdir/sweep"),
        2,
        ("--grid", "NAME=V1,V2"),
    ),
    C(
        "sweep-seeds-not-integers",
        (
            "sweep",
            "--reg",
            "ad",
            "--grid",
            "sigma=0.1",
            "--seeds",
            "a,b",
            "--out-dir",
            "$outdir/sweep",
        ),
        2,
        ("--seeds",),
    ),
    C(
        "sweep-unknown-setting",
        (
            "sweep",
            "--reg",
            "ad",
            "--grid",
            "sigma=0.1",
            "--set",
            "warp=9",
            "--out-dir",
            "$outdir/sweep",
        ),
        2,
        ("--set", "warp"),
    ),
    C(
        "sweep-out-dir-is-a-file",
        ("sweep", "--reg", "ad", "--grid", "sigma=0.1", "--out-dir", "$plain"),
        2,
        ("$plain", "not a folder"),
    ),
    C(
        "sweep-grid-name-repeated",
        (
            "sweep",
            "--reg",
            "ad",
            "--grid",
            "sigma=0.1",
            "--grid",
            "sigma=0.2",
            "--out-dir",
            "$outdir/sweep",
        ),
        2,
        ("--grid", "'sigma' is given twice"),
    ),
    # ------------------------------------------------------------------ compare
    C(
        "compare-garbage-report",
        ("compare", "$garbage_json", "--format", "csv", "--out", "$out"),
        2,
        ("$garbage_json", "not a JSON report"),
    ),
    C("compare-binary-file", ("compare", "$own"), 2, ("$own",)),
    C("compare-error-report", ("compare", "$error_json"), 2, ("$error_json", "failed run")),
    C(
        "compare-report-with-results-not-an-object",
        ("compare", "$weird_json"),
        2,
        ("$weird_json", "not a valid sharpcli.report/2 report", "results"),
    ),
    C(
        "compare-missing-report",
        ("compare", "$fixdir/nope.json"),
        2,
        ("$fixdir/nope.json", "no such file"),
    ),
    C(
        "compare-unknown-format",
        ("compare", "$garbage_json", "--format", "xlsx"),
        2,
        ("--format", "xlsx"),
    ),
    # ------------------------------------------------------------------ activation-stats / weight-rescale / bound-check
    C(
        "activation-stats-garbage-checkpoint",
        ("activation-stats", "$garbage_st"),
        2,
        ("$garbage_st",),
    ),
    C(
        "activation-stats-labels-out-of-range",
        ("activation-stats", "$own", "--data", "$labels_npz"),
        2,
        ("$labels_npz", "4 classes"),
    ),
    C(
        "activation-stats-pickle-without-trust",
        ("activation-stats", "$pickled"),
        2,
        ("$pickled", "--trust-pickle"),
    ),
    C("activation-stats-nan-during-forward", ("activation-stats", "$huge_own"), 3, ("not finite",)),
    C("weight-rescale-alpha-zero", ("weight-rescale", "$own", "--alpha", "0"), 2, ("--alpha",)),
    C(
        "weight-rescale-alpha-not-numbers",
        ("weight-rescale", "$own", "--alpha", "ten"),
        2,
        ("--alpha", "ten"),
    ),
    C(
        "weight-rescale-unknown-mode",
        ("weight-rescale", "$own", "--mode", "shuffle", "--plot", "$plot"),
        2,
        ("--mode", "shuffle"),
    ),
    C(
        "weight-rescale-unknown-layer",
        ("weight-rescale", "$own", "--mode", "layer", "--layer", "encoder.9"),
        2,
        ("--layer", "encoder.9"),
    ),
    C(
        "weight-rescale-gelu-not-homogeneous",
        ("weight-rescale", "$gelu_own", "--mode", "layer"),
        2,
        ("homogeneous",),
    ),
    C(
        "weight-rescale-nan-weights",
        ("weight-rescale", "$nan_st", "--arch", "mlp", "--arch-args", "$args"),
        2,
        ("$nan_st", "NaN or Inf"),
    ),
    C(
        "weight-rescale-plot-into-missing-folder",
        ("weight-rescale", "$own", "--plot", "$outdir/none/r.png"),
        2,
        ("$outdir/none/r.png", "does not exist"),
    ),
    C(
        "weight-rescale-plot-below-a-regular-file",
        ("weight-rescale", "$own", "--alpha", "2", "--plot", "$plain/rescale.png"),
        2,
        ("$plain/rescale.png",),
    ),
    C("bound-check-negative-sigma", ("bound-check", "$own", "--sigma", "-0.1"), 2, ("--sigma",)),
    C(
        "bound-check-unknown-check",
        ("bound-check", "$own", "--check", "theorem9"),
        2,
        ("--check", "theorem9"),
    ),
    C(
        "bound-check-unknown-epsilon",
        ("bound-check", "$own", "--epsilon", "sometimes"),
        2,
        ("--epsilon",),
    ),
    C(
        "bound-check-ci-level-above-one",
        ("bound-check", "$own", "--ci-level", "1.5"),
        2,
        ("--ci-level",),
    ),
    C(
        "bound-check-params-glob-matches-nothing",
        ("bound-check", "$own", "--params", "decoder.*"),
        2,
        ("--params", "decoder.*"),
    ),
    C(
        "bound-check-shape-mismatch",
        ("bound-check", "$foreign_st", "--arch", "mlp", "--arch-args", "$wide_args"),
        2,
        ("$foreign_st", "shape mismatch"),
    ),
    C(
        "bound-check-nan-during-gradient",
        ("bound-check", "$huge_own", "--sigma", "0.1"),
        3,
        ("not finite",),
    ),
    # ------------------------------------------------------------------ outputs never destroy what the user has
    # an output that is also an input: side files, sweep run files, data named in metadata
    C(
        "train-history-csv-is-the-data",
        ("train", "--data", "$history", "--epochs", "1", "--out", "$out"),
        2,
        ("$history", "history CSV", "also an input", "--data"),
        setup="history-is-data",
    ),
    C(
        "train-state-is-the-data",
        ("train", "--data", "$state", "--epochs", "1", "--out", "$out"),
        2,
        ("$state", "resumable state", "also an input", "--data"),
        setup="state-is-data",
    ),
    C(
        "eigen-json-onto-the-data-named-in-metadata",
        ("eigen", "$meta_ckpt", "--json", "$meta_data"),
        2,
        ("--json", "$meta_data", "also an input", "$meta_ckpt"),
        json=False,
        setup="metadata-names-data",
    ),
    C(
        "density-plot-onto-the-data-named-in-metadata",
        ("density", "$meta_ckpt", "--steps", "4", "--probes", "1", "--plot", "$meta_data"),
        2,
        ("--plot", "$meta_data", "also an input"),
        setup="metadata-names-data",
    ),
    C(
        "sweep-data-is-its-runs-table",
        (
            "sweep",
            "--reg",
            "wd",
            "--grid",
            "sigma=0.1",
            "--epochs",
            "1",
            "--data",
            "$sweepdir/sweep-runs.csv",
            "--out-dir",
            "$sweepdir",
        ),
        2,
        ("--out-dir", "$sweepdir/sweep-runs.csv", "also an input"),
        setup="sweep-table-is-data",
    ),
    # (a run's own files cannot be the data any more: their names end in a hash of the run's
    # whole configuration, the data path included; the runs table above still can)
    # every output path is checked before the work: the run used to exit 4 after replacing --out
    C(
        "train-history-csv-path-is-a-folder",
        ("train", "--data", "blobs:n=64", "--epochs", "1", "--out", "$out"),
        2,
        ("$history", "directory"),
        setup="history-is-a-folder",
    ),
    C(
        "train-state-path-is-a-folder",
        ("train", "--data", "blobs:n=64", "--epochs", "1", "--out", "$out"),
        2,
        ("$state", "directory"),
        setup="state-is-a-folder",
    ),
    # a full disk: exit 2 naming the file (was exit 4, "internal error"); nothing replaced
    C(
        "disk-full-writing-the-state",
        ("train", "--data", "blobs:n=64", "--epochs", "2", "--out", "$out", "--plot", "$plot"),
        2,
        ("$state", "No space left on device"),
        setup="old-state",
        disk_full=r"/\.out\.safetensors\.state\.pt\.[0-9a-f]{8}\.tmp$",
    ),
    C(
        "disk-full-writing-the-checkpoint",
        ("train", "--data", "blobs:n=64", "--epochs", "1", "--out", "$out", "--plot", "$plot"),
        2,
        ("$out", "No space left on device"),
        setup="old-state",
        disk_full=r"/\.out\.safetensors\.[0-9a-f]{8}\.tmp$",
    ),
    C(
        "disk-full-writing-the-history",
        ("train", "--data", "blobs:n=64", "--epochs", "1", "--out", "$out"),
        2,
        ("$history", "No space left on device"),
        setup="old-state",
        disk_full=r"/\.out\.history\.csv\.[0-9a-f]{8}\.tmp$",
    ),
    C(
        "disk-full-writing-the-plot",
        ("train", "--data", "blobs:n=64", "--epochs", "1", "--out", "$out", "--plot", "$plot"),
        2,
        ("$plot", "No space left on device"),
        setup="old-state",
        disk_full=r"/\.plot\.png\.[0-9a-f]{8}\.tmp$",
    ),
    C(
        "disk-full-writing-the-report",
        ("eigen", "$own", "--max-matvecs", "6", "--json", "$report"),
        2,
        ("$report", "No space left on device"),
        json=False,
        disk_full=r"/\.report\.json\.[0-9a-f]{8}\.tmp$",
    ),
    C("compare-a-folder", ("compare", "$fixdir"), 2, ("$fixdir", "folder")),
    # ------------------------------------------------------------------ diagonal
    C(
        "diagonal-exact-over-its-budget",
        ("diagonal", "$own", "--estimator", "exact", "--max-products", "10", "--out", "$out"),
        2,
        ("--max-products", "products (one per parameter"),
    ),
    C(
        "diagonal-gnb-needs-ggn",
        ("diagonal", "$own", "--estimator", "gnb", "--operator", "hessian", "--out", "$out"),
        2,
        ("--operator ggn",),
    ),
    C(
        "diagonal-out-onto-the-checkpoint",
        ("diagonal", "$own", "--out", "$own"),
        2,
        ("--out", "$own", "also an input"),
    ),
    C(
        "disk-full-writing-the-diagonal",
        ("diagonal", "$own", "--estimator", "per-sample", "--out", "$out"),
        2,
        ("$out", "No space left on device"),
        disk_full=r"/\.out\.safetensors\.[0-9a-f]{8}\.tmp$",
    ),
    # ------------------------------------------------------------------ sharpness, landscape
    C("sharpness-rho-not-positive", ("sharpness", "$own", "--rho", "0"), 2, ("--rho",)),
    C("landscape-span-zero", ("landscape", "$own", "--span", "0"), 2, ("--span",)),
]


def registered_commands() -> set[str]:
    from sharpcli.cli.app import app

    return {c.name for c in app.registered_commands}


def params():
    """The table as pytest params: xfail marks for contract misses, skips for commands not yet registered."""
    available = registered_commands()
    out = []
    for case in CASES:
        marks = []
        if case.needs_non_root and os.geteuid() == 0:
            marks.append(pytest.mark.skip(reason="root writes into read-only folders"))
        if case.argv[0] not in available:
            marks.append(
                pytest.mark.skip(
                    reason=f"command {case.argv[0]!r} is not registered in sharpcli.cli.app"
                )
            )
        if case.xfail:
            marks.append(pytest.mark.xfail(strict=True, reason=case.xfail))
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


def test_table_covers_every_command_and_enough_cases():
    """At least 25 cases; every registered command has bad-input cases (new commands need rows here)."""
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)
    covered = {c.argv[0] for c in CASES}
    assert registered_commands() <= covered, registered_commands() - covered
    assert {2, 3} == {c.code for c in CASES}


# ---------------------------------------------------------------------------------------------- fixtures


def _digest(folder: Path) -> dict[str, str]:
    """Name -> sha256 and permission bits of every file (``"folder"`` for folders) below
    ``folder``, hidden temporaries included: what a run must not change."""
    return {
        str(p.relative_to(folder)): f"{hashlib.sha256(p.read_bytes()).hexdigest()} {_mode(p):o}"
        if p.is_file()
        else "folder"
        for p in sorted(folder.rglob("*"))
    }


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Every bad (and the few good) input files, built once: name -> path or JSON text."""
    root = tmp_path_factory.mktemp("bad_input")
    spec = tiny_mlp_spec()  # 16 -> 8 -> 4, ReLU: state_dict 0.weight, 0.bias, 2.weight, 2.bias
    torch.manual_seed(0)
    model = build_model(spec)
    f: dict[str, Path | str] = {"fixdir": root}

    f["own"] = write_own_checkpoint(root / "own.safetensors", spec, data_spec=DATA)
    f["gelu_own"] = write_own_checkpoint(
        root / "gelu.safetensors", tiny_mlp_spec(activation="gelu"), data_spec=DATA
    )
    broken = write_broken_files(root)
    f["garbage_st"], f["truncated_st"] = (
        broken["garbage.safetensors"],
        broken["truncated.safetensors"],
    )
    f["empty_st"], f["garbage_pt"] = broken["empty.safetensors"], broken["garbage.pt"]
    f["foreign_st"] = write_foreign_state_dict(root / "foreign.safetensors", model)
    f["foreign_pt"] = write_foreign_state_dict(root / "foreign.pt", model)
    f["truncated_pt"] = root / "truncated.pt"
    f["truncated_pt"].write_bytes(f["foreign_pt"].read_bytes()[:700])
    f["own_txt"] = root / "own.txt"
    shutil.copy(f["own"], f["own_txt"])
    f["zip_st"] = root / "zip.safetensors"
    shutil.copy(f["foreign_pt"], f["zip_st"])
    f["pickled"] = write_pickled_module(root / "pickled.pt", model)
    f["list_pt"] = root / "list.pt"
    torch.save(list(model.state_dict().values()), f["list_pt"])

    state = {k: v.clone() for k, v in model.state_dict().items()}
    with_nan = {k: v.clone() for k, v in state.items()}
    with_nan["0.weight"][2, 3] = float("nan")
    save_file(with_nan, str(root / "nan.safetensors"))
    f["nan_st"] = root / "nan.safetensors"
    save_file(
        {k: (v * 100).round().to(torch.int64) for k, v in state.items()},
        str(root / "int.safetensors"),
    )
    f["int_st"] = root / "int.safetensors"

    inf_model = build_model(spec)
    with torch.no_grad():
        inf_model[2].bias[1] = float("inf")
    save_checkpoint(
        root / "inf_own.safetensors",
        inf_model,
        spec,
        data_spec={"kind": "builtin", "name": "blobs", "args": {"n": 64}},
    )
    f["inf_own"] = root / "inf_own.safetensors"
    huge = build_model(spec)  # finite weights ~1e25: the logits overflow to Inf, the loss is NaN
    with torch.no_grad():
        for p in huge.parameters():
            p.mul_(1e25)
    f["huge_own"] = root / "huge.safetensors"
    save_checkpoint(
        f["huge_own"], huge, spec, data_spec={"kind": "builtin", "name": "blobs", "args": {"n": 64}}
    )

    f["badmeta"] = root / "badmeta.safetensors"
    save_file(
        state, str(f["badmeta"]), metadata={"sharpcli.format": "1", "sharpcli.model": "{not json"}
    )
    f["unkmodel"] = root / "unkmodel.safetensors"
    save_file(
        state,
        str(f["unkmodel"]),
        metadata={
            "sharpcli.format": "1",
            "sharpcli.model": json.dumps({"name": "transformer", "args": {}}),
        },
    )
    f["missingdata"] = root / "missingdata.safetensors"
    save_file(
        state,
        str(f["missingdata"]),
        metadata={
            "sharpcli.format": "1",
            "sharpcli.model": json.dumps(spec),
            "sharpcli.data": json.dumps(
                {"kind": "file", "path": str(root / "gone.npz"), "format": "npz"}
            ),
        },
    )

    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 16)).astype(np.float32)
    y = rng.integers(0, 4, size=20)
    arrays = {
        "ok_npz": {"x": x, "y": y},
        "wrongfeat_npz": {"x": x[:, :5], "y": y},
        "labels_npz": {"x": x, "y": y + 10},
        "nan_npz": {"x": np.where(np.arange(16) == 3, np.nan, x).astype(np.float32), "y": y},
        "empty_npz": {"x": x[:0], "y": y[:0]},
        "nox_npz": {"features": x, "y": y},
        "mismatch_npz": {"x": x, "y": y[:7]},
        "strx_npz": {"x": np.full((20, 16), "a"), "y": y},
        "floaty_npz": {"x": x, "y": y.astype(np.float32) + 0.5},
        "xtestonly_npz": {"x": x, "y": y, "x_test": x[:3]},
    }
    for name, content in arrays.items():
        f[name] = root / name.replace("_npz", ".npz")
        np.savez(f[name], **content)
    f["garbage_npz"] = root / "garbage.npz"
    f["garbage_npz"].write_bytes(b"PK\x03\x04 this is not a zip archive")
    f["data_xyz"] = root / "data.xyz"
    f["data_xyz"].write_bytes(b"1,2,3\n")
    table = pd.DataFrame({f"f{j}": x[:, j] for j in range(16)})
    f["nolabel_csv"] = root / "nolabel.csv"
    table.to_csv(f["nolabel_csv"], index=False)
    f["ok_csv"] = root / "ok.csv"
    table.assign(label=y).to_csv(f["ok_csv"], index=False)
    f["inf_csv"] = root / "inf.csv"
    table.assign(label=y).assign(f4=np.where(np.arange(20) == 5, np.inf, x[:, 4])).to_csv(
        f["inf_csv"], index=False
    )

    f["plain"] = root / "plain.txt"
    f["plain"].write_text("a regular file, not a folder\n")
    f["garbage_json"] = root / "garbage.json"
    f["garbage_json"].write_text("{this is not json")
    f["error_json"] = root / "error.json"
    f["error_json"].write_text(
        json.dumps(
            {
                "schema": SCHEMA_ID,
                "command": "eigen",
                "version": __version__,
                "error": {
                    "type": "input",
                    "message": "x: no such file",
                    "exit_code": 2,
                    "source": "x",
                },
            }
        )
    )

    f["weird_json"] = (
        root / "weird.json"
    )  # a report's envelope around results that are not an object
    f["weird_json"].write_text(
        json.dumps(
            {
                "schema": SCHEMA_ID,
                "command": "compare",
                "version": __version__,
                "checkpoint": None,
                "data": None,
                "settings": {},
                "results": "not an object",
                "timing": {"seconds": 0.0, "matvecs": 0},
                "environment": {
                    "python": "3",
                    "torch": "2",
                    "device": "cpu",
                    "dtype": "float32",
                    "threads": 1,
                },
            }
        )
    )
    f["args"] = json.dumps(spec["args"])
    f["wide_args"] = json.dumps(spec["args"] | {"width": 9})
    f["deep_args"] = json.dumps(spec["args"] | {"depth": 2})
    f["bogus_args"] = json.dumps(spec["args"] | {"bogus": 1})
    return {k: str(v) for k, v in f.items()}


@pytest.fixture(scope="module", autouse=True)
def click_command_built_once():
    """Typer rebuilds the click command tree from the annotations on every call (~0.1 s, most of
    an error case's time); build it once for this module. Parsing and error handling are unchanged:
    ``sharpcli.cli.app.main`` still runs ``app(argv, standalone_mode=False)`` on the same tree."""
    import typer.main

    from sharpcli.cli.app import app

    original = typer.main.get_command
    built = original(app)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            typer.main,
            "get_command",
            lambda instance: built if instance is app else original(instance),
        )
        yield


@pytest.fixture
def outdir(tmp_path) -> Path:
    """A fresh output folder with an old checkpoint, plot and report in it, and a read-only subfolder."""
    folder = tmp_path / "out"
    folder.mkdir()
    for name, content, mode in OLD_FILES:  # modes no umask gives: a replaced file must keep its
        (folder / name).write_bytes(content)
        (folder / name).chmod(mode)
    (folder / "readonly").mkdir(mode=0o555)
    return folder


OLD_FILES = (
    ("out.safetensors", OLD_OUT, 0o640),
    ("plot.png", OLD_PLOT, 0o604),
    ("report.json", OLD_REPORT, 0o660),
)
OLD_STATE = b"an old resumable state that a failed run must not touch\n"


def _data_csv(path: Path) -> None:
    """20 rows of 16 features and a label in 0..3: data the tiny checkpoints and train accept."""
    rng = np.random.default_rng(0)
    table = pd.DataFrame({f"f{j}": rng.standard_normal(20) for j in range(16)})
    table.assign(label=rng.integers(0, 4, size=20)).to_csv(path, index=False)


def _setup_metadata_names_data(folder: Path) -> None:
    """``data.npz`` and ``meta.safetensors``, whose metadata names ``data.npz`` as its data."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 16)).astype(np.float32)
    np.savez(folder / "data.npz", x=x, y=rng.integers(0, 4, size=20))
    write_own_checkpoint(folder / "meta.safetensors", tiny_mlp_spec(), str(folder / "data.npz"))


def _setup_state_is_data(folder: Path) -> None:
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((20, 16)), dtype=torch.float32)
    torch.save({"x": x, "y": torch.tensor(rng.integers(0, 4, size=20))}, STATE_OF(folder))


def _setup_sweep(folder: Path, name: str) -> None:
    (folder / "sweep").mkdir()
    _data_csv(folder / "sweep" / name)


def _setup_old_state(folder: Path) -> None:
    STATE_OF(folder).write_bytes(OLD_STATE)
    STATE_OF(folder).chmod(0o600)


def HISTORY_OF(folder: Path) -> Path:
    """train's history CSV beside ``$out`` (``out.safetensors``)."""
    return folder / "out.history.csv"


def STATE_OF(folder: Path) -> Path:
    """train's resumable state beside ``$out``."""
    return folder / "out.safetensors.state.pt"


SETUPS = {
    "history-is-data": lambda folder: _data_csv(HISTORY_OF(folder)),
    "state-is-data": _setup_state_is_data,
    "metadata-names-data": _setup_metadata_names_data,
    "sweep-table-is-data": lambda folder: _setup_sweep(folder, "sweep-runs.csv"),
    "history-is-a-folder": lambda folder: HISTORY_OF(folder).mkdir(),
    "state-is-a-folder": lambda folder: STATE_OF(folder).mkdir(),
    "old-state": _setup_old_state,
}


@pytest.fixture
def disk_full(monkeypatch):
    """``disk_full(pattern)``: from then on, ``os.write`` to a file whose path matches the regex
    fails with ENOSPC, as on a full disk (sharpcli.atomic writes through ``os.write``)."""
    import errno
    import re

    real_write = os.write

    def arm(pattern: str) -> None:
        def write(fd, data):
            try:
                name = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                name = ""
            if re.search(pattern, name):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write)

    return arm


# ---------------------------------------------------------------------------------------------- checks


def expand(text: str, files: dict, outdir: Path) -> str:
    names = files | {
        "outdir": str(outdir),
        "out": str(outdir / "out.safetensors"),
        "plot": str(outdir / "plot.png"),
        "report": str(outdir / "report.json"),
        "history": str(HISTORY_OF(outdir)),
        "state": str(STATE_OF(outdir)),
        "meta_ckpt": str(outdir / "meta.safetensors"),
        "meta_data": str(outdir / "data.npz"),
        "sweepdir": str(outdir / "sweep"),
    }
    return Template(text).substitute(names)


def check_one_line(run: Run, case: Case, needles: list[str]) -> str:
    """Exit code, one stderr line ``sharp CMD: error: ...`` with every needle, no traceback; the message."""
    command = case.argv[0]
    assert run.code == case.code, (run.code, run.err, run.out[:300])
    assert "Traceback" not in run.err and "Traceback" not in run.out
    lines = [line for line in run.err.splitlines() if line.strip()]
    assert len(lines) == 1, run.err
    prefix = f"sharp {command}: error: "
    assert lines[0].startswith(prefix), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0][len(prefix) :]


def check_error_document(doc: dict, case: Case, message: str) -> None:
    """The JSON error object of docs/json.md ("The error object"), agreeing with the stderr line."""
    assert set(doc) == {"schema", "command", "version", "error"}, doc
    assert (
        doc["schema"] == SCHEMA_ID
        and doc["command"] == case.argv[0]
        and doc["version"] == __version__
    )
    error = doc["error"]
    assert error["exit_code"] == case.code
    expected_types = ("numerical",) if case.code == 3 else ("usage", "input")
    assert error["type"] in expected_types, error
    assert error["message"] == message
    assert isinstance(error.get("source"), str) and error["source"], error


def check_untouched(
    outdir: Path, before: dict, files_before: dict, files: dict, allowed_new: set[str] = frozenset()
):
    """The old outputs keep their bytes, nothing else appears, the input files are unchanged."""
    after = _digest(outdir)
    assert set(after) - set(before) <= allowed_new, sorted(set(after) - set(before))
    assert set(before) <= set(after), sorted(set(before) - set(after))
    for name, digest in before.items():
        if name not in allowed_new:
            assert after[name] == digest, f"{name} was modified"
    assert _digest(Path(files["fixdir"])) == files_before


@pytest.mark.parametrize("case", params())
def test_bad_input(case: Case, files, outdir, capsys, disk_full):
    argv = [expand(a, files, outdir) for a in case.argv]
    needles = [expand(n, files, outdir) for n in case.needles]
    if case.setup is not None:
        SETUPS[case.setup](outdir)
    if case.disk_full is not None:
        disk_full(case.disk_full)
    before, files_before = _digest(outdir), _digest(Path(files["fixdir"]))

    run = run_cli(capsys, *argv)
    check_one_line(run, case, needles)
    check_untouched(outdir, before, files_before, files)
    if not case.json:
        return

    # --json PATH over an old report: replaced (atomically) by the error object, nothing else changes.
    report = outdir / "report.json"
    run = run_cli(capsys, *argv, "--json", str(report))
    message = check_one_line(run, case, needles)
    assert report.read_bytes() != OLD_REPORT, "no JSON error object was written to --json PATH"
    assert _mode(report) == 0o660, "the replaced report lost its permission bits"
    check_error_document(json.loads(report.read_text()), case, message)
    check_untouched(outdir, before, files_before, files, allowed_new={"report.json"})

    # --json -: the error object is the only thing on stdout.
    run = run_cli(capsys, *argv, "--json", "-")
    message = check_one_line(run, case, needles)
    check_error_document(json.loads(run.out), case, message)


# ---------------------------------------------------------------------------------------------- outputs of runs that succeed


@pytest.mark.parametrize(
    "umask, old_mode",
    [(0o022, None), (0o027, None), (0o022, 0o600), (0o077, 0o644)],
    ids=["new-umask-022", "new-umask-027", "old-0600-kept", "old-0644-kept-under-umask-077"],
)
def test_written_files_follow_the_umask_or_keep_their_mode(umask, old_mode, tmp_path, capsys):
    """Every file a run writes (checkpoint, history, state, plot, report) is created
    ``0666 & ~umask`` like any new file (it was 0600), and a file it replaces keeps its mode."""
    out = tmp_path / "m.safetensors"
    written = [out, tmp_path / "m.history.csv", tmp_path / "m.safetensors.state.pt"]
    written += [tmp_path / "curves.png", tmp_path / "report.json"]
    if old_mode is not None:
        for path in written:
            path.write_bytes(OLD_OUT)
            path.chmod(old_mode)
    previous = os.umask(umask)
    try:
        run = run_cli(
            capsys,
            *("train", "--data", "blobs:n=64", "--epochs", "1", "--quiet"),
            *("--out", out, "--plot", written[3], "--json", written[4]),
        )
    finally:
        os.umask(previous)
    assert run.code == 0, run.err
    expected = old_mode if old_mode is not None else 0o666 & ~umask
    for path in written:
        assert path.read_bytes() != OLD_OUT, f"{path.name} was not written"
        assert _mode(path) == expected, (path.name, oct(_mode(path)), oct(expected))
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.fixture
def no_rename_into_dev(monkeypatch):
    """A test that writes to /dev/null must never replace it, even when the code under test is
    wrong (the tests run as root here): renames onto /dev fail the test instead."""
    real_replace = os.replace

    def replace(src, dst, **kwargs):
        assert not os.path.abspath(dst).startswith("/dev/"), f"os.replace onto {dst}"
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def _device_identity(path: str):
    st = os.stat(path)
    return stat.S_ISCHR(st.st_mode), st.st_ino, st.st_rdev, st.st_mode


@pytest.mark.parametrize(
    "argv",
    [
        ("eigen", "$own", "--max-matvecs", "6", "--json", "/dev/null"),
        ("density", "$own", "--steps", "4", "--probes", "1", "--plot", "/dev/null", "--quiet"),
    ],
    ids=["json", "plot"],
)
def test_output_to_dev_null_leaves_the_device(argv, files, tmp_path, capsys, no_rename_into_dev):
    """``--json /dev/null`` (or a plot there) is written into the device, never renamed over it
    (as root the old rename replaced /dev/null by a regular file)."""
    before = _device_identity("/dev/null")
    run = run_cli(capsys, *[expand(a, files, tmp_path) for a in argv])
    assert run.code == 0, run.err
    assert _device_identity("/dev/null") == before
    assert before[0], "/dev/null is a character device"


def test_output_to_a_fifo_is_written_through_it(files, tmp_path, capsys):
    """A FIFO stays a FIFO and its reader gets the whole report."""
    import threading

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    run = run_cli(capsys, "eigen", files["own"], "--max-matvecs", "6", "--json", fifo)
    reader.join(timeout=60)
    assert run.code == 0, run.err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(received[0])["command"] == "eigen"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.fifo"]


def test_output_through_a_symlink_replaces_the_file_it_points_to(files, tmp_path, capsys):
    """A symbolic link stays a link; the file it names gets the report and keeps its mode."""
    real = tmp_path / "reports" / "report.json"
    real.parent.mkdir()
    real.write_bytes(OLD_REPORT)
    real.chmod(0o640)
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    run = run_cli(capsys, "eigen", files["own"], "--max-matvecs", "6", "--json", link)
    assert run.code == 0, run.err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["command"] == "eigen" and _mode(real) == 0o640


# ---------------------------------------------------------------------------------------------- signals and stdout (subprocesses)


def _handlers_installed(pid: int) -> bool:
    """Whether process ``pid`` catches SIGTERM: sharp's handlers are in (Python alone does not
    catch SIGTERM), installed before the heavy imports start."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


def _default_signals() -> None:
    """In the child before ``exec``: SIGINT and SIGTERM at their default dispositions, as a
    command started from an interactive shell has them. A test process that inherited SIGINT
    ignored (pytest started in the background by a non-interactive shell: ``pytest &``,
    ``nohup``, some CI runners) would pass that on, and sharp rightly keeps a signal its parent
    ignores ignored (``interrupts.install``): the run then trained on, and the SIGINT cases
    failed or timed out depending only on how the suite was launched."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def _sharp(*args, cwd: Path, preexec_fn=None, **popen):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "sharpcli", *map(str, args)]

    def child_setup() -> None:
        _default_signals()
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen(command, cwd=cwd, env=env, text=True, preexec_fn=child_setup, **popen)


def _wait_for(condition, proc, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, "sharp ended before the signal was sent"
        assert time.monotonic() < deadline, "timed out waiting to send the signal"
        time.sleep(0.005)


SIGNAL_CASES = [  # training: a process starts (torch: seconds) and trains an epoch or more
    pytest.param("start-up", signal.SIGINT, id="sigint-while-importing"),
    pytest.param("start-up", signal.SIGTERM, id="sigterm-while-importing"),
    pytest.param("training", signal.SIGINT, id="sigint-while-training", marks=pytest.mark.slow),
    pytest.param("training", signal.SIGTERM, id="sigterm-while-training", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("when, signum", SIGNAL_CASES)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_signal_stops_the_run_and_replaces_nothing(when, signum, tmp_path):
    """SIGINT (Ctrl-C) and SIGTERM (timeout, torchrun, Docker, Slurm) while modules import or
    while training: exit 128 + signal, one stderr line, the old checkpoint and report keep their
    bytes and mode, no hidden temporary is left (before: a traceback, a run that trained on and
    replaced --out, exit 4, or a 4 MB ``.*.tmp`` left behind)."""
    out, report = tmp_path / "m.safetensors", tmp_path / "report.json"
    for path, content, mode in ((out, OLD_OUT, 0o640), (report, OLD_REPORT, 0o660)):
        path.write_bytes(content)
        path.chmod(mode)
    state = tmp_path / "m.safetensors.state.pt"
    proc = _sharp(
        *("train", "--data", "blobs:n=4000", "--epochs", "500", "--out", out, "--json", report),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        if when == "start-up":
            _wait_for(lambda: _handlers_installed(proc.pid), proc)
        else:
            _wait_for(state.exists, proc)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, (proc.returncode, stderr)
    assert stderr.splitlines() == [f"sharp train: interrupted by {name}"], stderr
    assert stdout == ""
    assert out.read_bytes() == OLD_OUT and _mode(out) == 0o640
    assert report.read_bytes() == OLD_REPORT and _mode(report) == 0o660
    assert not list(tmp_path.glob(".*.tmp"))
    assert not (tmp_path / "m.history.csv").exists()


@pytest.mark.slow  # a process that imports torch and trains one epoch
@pytest.mark.parametrize("how", ["reader-gone", "closed"])
def test_stdout_without_a_reader_is_a_quiet_141(how, files, tmp_path):
    """``sharp ... --json - | true`` (the reader closes the pipe) and ``--json - 1>&-`` end
    quietly with 141, the status of a process SIGPIPE killed (before: exit 1, the gate's code).
    Files are still published: ``--out`` is the new checkpoint."""
    out = tmp_path / "m.safetensors"
    out.write_bytes(OLD_OUT)
    argv = ("train", "--data", "blobs:n=64", "--epochs", "1", "--out", out, "--json", "-")
    if how == "closed":
        proc = _sharp(*argv, cwd=tmp_path, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
    else:
        proc = _sharp(*argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 141, (proc.returncode, stderr)
    assert stderr == ""
    assert out.read_bytes()[:8] != OLD_OUT[:8] and load_checkpoint(out).model_spec["name"] == "mlp"
    assert not list(tmp_path.glob(".*.tmp"))


# ---------------------------------------------------------------------------------------------- random data contents

EXTREME_VALUES = [float("nan"), float("inf"), -float("inf"), 1e39, -1e39]


@st.composite
def data_contents(draw):
    """x of a random shape (right or wrong feature count, 1-D, 3-D, empty), Gaussian values with a few
    NaN/Inf/beyond-float32 entries poked in or not; y of a right or wrong length, labels 0..3 with or
    without some outside the model's 4 classes, stored as int, float or bool."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.sampled_from([5, 2, 6, 1, 0]))
    x_shape = draw(st.sampled_from([(n, 16), (n, 16), (n, 16), (n, 5), (n,), (n, 4, 4), (n, 0)]))
    x = rng.standard_normal(x_shape)
    for _ in range(draw(st.sampled_from([0, 0, 1, 3])) if x.size else 0):
        x.flat[rng.integers(x.size)] = draw(st.sampled_from(EXTREME_VALUES))
    with np.errstate(over="ignore"):
        x = x.astype(draw(st.sampled_from([np.float32, np.float64])))
    n_y = draw(st.sampled_from([n, n, n, n + 1, max(n - 1, 0)]))
    y = rng.integers(0, 4, size=n_y)
    if n_y and draw(st.booleans()):
        y[rng.integers(n_y)] = draw(st.sampled_from([-1, 4, 9]))
    return {
        "x": x,
        "y": y.astype(draw(st.sampled_from([np.int64, np.int64, np.int32, np.float32, np.bool_]))),
    }


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(arrays=data_contents())
def test_random_data_contents_through_the_cli(files, capsys, tmp_path_factory, arrays):
    """Any x/y content in a --data file: exit 0 with a report, or the error contract (2, or 3 for numerics).

    Non-finite features (after the cast to float32) are always bad input: exit 2 naming the file.
    """
    folder = tmp_path_factory.mktemp("random_data")
    path = folder / "data.npz"
    np.savez(path, **arrays)
    data_bytes = path.read_bytes()
    run = run_cli(
        capsys, "eigen", files["own"], "--data", str(path), "--max-matvecs", "6", "--json", "-"
    )
    assert "Traceback" not in run.err
    event(f"exit {run.code}")
    if run.code == 0:
        assert path.read_bytes() == data_bytes
        report = json.loads(run.out)
        assert report["data"]["samples"] == arrays["x"].shape[0] > 0
        assert all(np.isfinite(report["results"]["eigenvalues"]))
        return
    assert run.code in (2, 3), (run.code, run.err)
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sharp eigen: error: "), run.err
    doc = json.loads(run.out)
    assert doc["error"]["exit_code"] == run.code and doc["error"]["message"] in lines[0]
    with np.errstate(over="ignore", invalid="ignore"):
        nonfinite = arrays["x"].size and not np.isfinite(arrays["x"].astype(np.float32)).all()
    if nonfinite:
        assert run.code == 2 and str(path) in lines[0], lines[0]
    assert path.read_bytes() == data_bytes
