"""The catalogue: every built-in thing of ``sharp`` that has a name, as torch-free records.

One :class:`~sharpcli.registry.Registry` per kind holds the :class:`~sharpcli.registry.Entry`
of each built-in: name, one-line summary, typed parameters with defaults and ranges, the
paper key of docs/references.md, data-parallel exactness where it applies, and the
implementation as ``"module:attr"``, imported only when it is used. The implementing modules
register into these registries (``sharpcli.training.regularizers.REGISTRY`` *is*
:data:`REGULARIZERS`), and everything that lists names reads them from here: the CLI's
choices, ``--help``, shell completion and metavars, the docs' tables and the report schema
(``tests/test_catalogue.py`` checks the last two). Adding a built-in is its module plus its
record here (docs/architecture.md works one example of each kind).

This module imports no torch: ``sharp --help`` reads it.
"""

from __future__ import annotations

from typing import Sequence

from sharpcli.registry import Entry, Param, Registry

__all__ = [
    "ACTIVATIONS",
    "COMMANDS",
    "DATASETS",
    "DATA_FORMATS",
    "ESTIMATORS",
    "KINDS",
    "LOSSES",
    "OPERATORS",
    "REGULARIZERS",
    "operator_help",
    "operator_table",
]

P = Param


def _reg(
    name: str,
    kind: str,
    summary: str,
    impl: str,
    params: tuple[Param, ...],
    *,
    paper: str,
    data_parallel: str | None,
    needs_penultimate: bool,
) -> Entry:
    """A regularizer's record; ``info``: its ``kind`` (none, model, penalty or oracle) and
    whether it needs the input of the final ``nn.Linear``."""
    info = {"kind": kind, "needs_penultimate": needs_penultimate}
    return Entry(name, summary, impl, params, paper, data_parallel, info)


_REPORT = P(
    "report",
    "choice",
    "perturbed",
    "reported loss: at the perturbed weights (free) or clean at theta (one more forward)",
    choices=("perturbed", "clean"),
)

# ``--reg NAME[:k=v,...]`` (sharpcli.training.regularizers); parameters in positional order
REGULARIZERS: Registry = Registry(
    "regularizer",
    source="regs",
    entries=[
        _reg(
            "none",
            "none",
            "plain loss",
            "sharpcli.training.regularizers:NoRegularizer",
            (),
            paper="",
            data_parallel=None,
            needs_penultimate=False,
        ),
        _reg(
            "wd",
            "penalty",
            "L + s^2/2 ||theta||^2 (AD 2.3)",
            "sharpcli.training.regularizers:WeightDecay",
            (P("sigma", "float", 0.001, "smoothing scale; coefficient sigma^2/2", minimum=0.0),),
            paper="AD",
            data_parallel=None,
            needs_penultimate=False,
        ),
        _reg(
            "dropout",
            "model",
            "dropout p: after each hidden activation (mlp); before the head only (conv nets) (AD 4.2)",
            "sharpcli.training.regularizers:Dropout",
            (P("p", "float", 0.1, "drop probability", minimum=0.0, below=1.0),),
            paper="AD",
            data_parallel=None,
            needs_penultimate=False,
        ),
        _reg(
            "ad",
            "penalty",
            "CE + s^2/2 mean ||h||^2, h = the head's input (conv nets: pooled features) (AD Thm 2)",
            "sharpcli.training.regularizers:ActivationDecay",
            (P("sigma", "float", 0.1, "weight-noise scale of the final layer", minimum=0.0),),
            paper="AD",
            data_parallel=None,
            needs_penultimate=True,
        ),
        _reg(
            "sam",
            "oracle",
            "gradient at theta + rho g/||g|| (NME App. B eq. 42)",
            "sharpcli.training.regularizers:SAM",
            (P("rho", "float", 0.05, "radius of the ascent step", minimum=0.0),),
            paper="SAM",
            data_parallel="its ascent step needs the global gradient norm before the second pass",
            needs_penultimate=False,
        ),
        _reg(
            "usam",
            "oracle",
            "gradient at theta + rho g (NME App. B eq. 43)",
            "sharpcli.training.regularizers:USAM",
            (P("rho", "float", 0.05, "scale of the ascent step", minimum=0.0),),
            paper="USAM",
            data_parallel="its ascent step needs the global gradient before the second pass",
            needs_penultimate=False,
        ),
        _reg(
            "asam",
            "oracle",
            "gradient at theta + rho T^2 g/||T g||, T = |w| + eta (ASAM, Kwon et al. 2021)",
            "sharpcli.training.regularizers:ASAM",
            (
                P("rho", "float", 0.5, "radius of the ascent step", minimum=0.0),
                P("eta", "float", 0.01, "offset of the adaptive scale |w| + eta", minimum=0.0),
            ),
            paper="ASAM",
            data_parallel="its ascent step needs the global scaled gradient norm before the second pass",
            needs_penultimate=False,
        ),
        _reg(
            "gp",
            "penalty",
            "L + rho ||grad L||^p, p in {1,2} (NME eq. 7)",
            "sharpcli.training.regularizers:GradientPenalty",
            (
                P("rho", "float", 0.01, "penalty strength", minimum=0.0),
                P("p", "choice", 1, "power of the gradient norm", choices=(1, 2)),
                P(
                    "mode",
                    "choice",
                    "exact",
                    "exact double backprop or finite-difference HVP",
                    choices=("exact", "fd"),
                ),
                P("eps", "float", 0.001, "finite-difference step length (mode=fd)", positive=True),
            ),
            paper="NME",
            data_parallel="its penalty ||grad L||^p is nonlinear in the batch gradient",
            needs_penultimate=False,
        ),
        _reg(
            "hessian-trace",
            "penalty",
            "L + s^2 v^T H v, v Rademacher (NME eq. 19; s^2 = 2x the tr(H) weight of weight-noise sigma^2); fd: finite-difference curvature at step eps, exact: autograd Hessian",
            "sharpcli.training.regularizers:HessianTrace",
            (
                P("sigma2", "float", 0.01, "penalty strength (noise variance)", minimum=0.0),
                P("probes", "int", 1, "Rademacher probes averaged per step", minimum=1),
                P(
                    "mode",
                    "choice",
                    "exact",
                    "exact: the autograd Hessian (zero at kinks), third-order autograd; fd: finite-difference curvature at step eps (sees ReLU kinks: on ReLU nets a different regularizer, which diverged at its defaults on the built-in nets)",
                    choices=("exact", "fd"),
                ),
                P(
                    "eps",
                    "float",
                    0.1,
                    "finite-difference step length in parameter space (mode=fd)",
                    positive=True,
                ),
            ),
            paper="NME",
            data_parallel=None,
            needs_penultimate=False,
        ),
        _reg(
            "gn-trace",
            "penalty",
            "L + s^2 tr(G), sampled-label estimator (NME eq. 20; s^2 = 2x the tr weight of weight-noise sigma^2)",
            "sharpcli.training.regularizers:GaussNewtonTrace",
            (P("sigma2", "float", 0.01, "penalty strength (noise variance)", minimum=0.0),),
            paper="NME",
            data_parallel="its estimate B ||grad L(y^)||^2 is nonlinear in the batch gradient",
            needs_penultimate=False,
        ),
        _reg(
            "weight-noise",
            "oracle",
            "gradient at theta + U, U ~ N(0, s^2 I) (NSO 2.1); to 2nd order L + s^2/2 tr(H), = hessian-trace:sigma2=s^2/2",
            "sharpcli.training.regularizers:WeightNoise",
            (P("sigma", "float", 0.01, "noise standard deviation", minimum=0.0), _REPORT),
            paper="NSO",
            data_parallel=None,
            needs_penultimate=False,
        ),
        _reg(
            "nso",
            "oracle",
            "gradient averaged over theta +- U_j, j = 1..k (NSO Alg. 1)",
            "sharpcli.training.regularizers:NSO",
            (
                P("sigma", "float", 0.01, "noise standard deviation", minimum=0.0),
                P("k", "int", 1, "number of noise pairs per step", minimum=1),
                _REPORT,
            ),
            paper="NSO",
            data_parallel=None,
            needs_penultimate=False,
        ),
        _reg(
            "fa",
            "penalty",
            "L + lambda Tr(H^2)/B, Tr(H^2) = ||Hv||^2 (FA eq. 1); exact autograd or fd",
            "sharpcli.training.regularizers:FlatnessAware",
            (
                P("lambda", "float", 0.01, "penalty strength", minimum=0.0),
                P(
                    "mode",
                    "choice",
                    "exact",
                    "exact: the FA penalty by third-order autograd; fd: central finite differences of grad L (no third-order graph; on ReLU/max-pool nets a different, kink-dominated regularizer)",
                    choices=("exact", "fd"),
                ),
                P(
                    "eps",
                    "float",
                    "auto",
                    "finite-difference step length in parameter space (mode=fd); auto: eta(dtype) * ||theta||",
                    positive=True,
                    auto=True,
                ),
            ),
            paper="FA",
            data_parallel="its penalty ||H v||^2 is nonlinear in the batch Hessian product",
            needs_penultimate=False,
        ),
    ],
)

# ``--operator NAME`` (sharpcli.curvature.registry): the curvature operators. ``info``: the
# symbol in tables and whether the operator is positive semi-definite.
OPERATORS: Registry = Registry(
    "operator",
    source="operator",
    entries=[
        Entry(
            "hessian",
            "Hessian of the loss",
            "sharpcli.curvature.registry:build_hessian",
            info={"symbol": "H", "psd": False},
        ),
        Entry(
            "ggn",
            "Gauss-Newton J^T H_z J",
            "sharpcli.curvature.registry:build_ggn",
            paper="Schraudolph2002",
            info={"symbol": "G", "psd": True},
        ),
        Entry(
            "nme",
            "nonlinear modelling error H - G",
            "sharpcli.curvature.registry:build_nme",
            paper="NME",
            info={"symbol": "N", "psd": False},
        ),
    ],
    protected=("hessian", "ggn", "nme"),
    protected_reason="it is part of the H = G + N split",
)

# ``sharp trace --estimator NAME`` (sharpcli.analyses.spectrum), the default first
ESTIMATORS: Registry = Registry(
    "estimator",
    source="estimator",
    entries=[
        Entry(
            "hutchpp",
            "Hutch++: the top subspace exactly, Hutchinson on the rest",
            "sharpcli.curvature.hutchpp:hutchpp",
            paper="Hutch++",
        ),
        Entry(
            "hutchinson",
            "Rademacher probes averaged until the standard error meets tol",
            "sharpcli.curvature.trace:hutchinson",
            paper="Hutchinson1989",
        ),
        Entry(
            "gn-split",
            "tr(G) and tr(N) from shared probes, tr(H) their sum",
            "sharpcli.curvature.split:gn_nme_split",
            paper="NME",
        ),
        Entry(
            "exact", "the trace of the dense matrix (small models)", "sharpcli.analyses.spectrum"
        ),
    ],
)

# the losses of the analyses and of training (sharpcli.losses); ``info``: whether the labels
# are classes (accuracy is defined)
LOSSES: Registry = Registry(
    "loss",
    source="loss",
    entries=[
        Entry(
            "cross-entropy",
            "softmax cross-entropy on (batch, classes) logits and class labels",
            "sharpcli.losses",
            info={"classification": True},
        ),
        Entry(
            "mse",
            "mean squared error (mean over the outputs) on regression targets",
            "sharpcli.losses",
            info={"classification": False},
        ),
        Entry(
            "binary-cross-entropy",
            "binary cross-entropy with logits: one logit per sample, labels 0/1",
            "sharpcli.losses",
            info={"classification": True},
        ),
        Entry(
            "token-cross-entropy",
            "cross-entropy per position of (batch, length, vocabulary) outputs, labels -100 ignored",
            "sharpcli.losses",
            info={"classification": True},
        ),
    ],
)


def _format(
    name: str,
    summary: str,
    probe: str,
    read: str,
    extensions: Sequence[str] = (),
    spec_keys: Sequence[str] = (),
    *,
    test_split: str,
    directory: bool = False,
) -> Entry:
    """A data format's record: ``info`` holds what :class:`sharpcli.io.formats.DataFormat`
    is made of (``probe`` and ``read`` as ``"module:function"``, imported with the format
    module)."""
    info = {
        "probe": probe,
        "read": read,
        "extensions": tuple(extensions),
        "spec_keys": tuple(spec_keys),
        "directory": directory,
        "test_split": test_split,
    }
    return Entry(name, summary, "sharpcli.io.formats", info=info)


_TENSOR_TEST = "add tensors x_test and y_test (or <key>_test for named keys)"
_KEYS = ("x_key", "y_key")
_TABLE_TEST = "add a column named 'split' with values train/test"
_FOLDER_TEST = "the folder holds no test files"
_FILES = "sharpcli.io.datasets_files"
_VISION = "sharpcli.io.datasets_vision"
_ARROW = "sharpcli.io.datasets_arrow"

# ``--data PATH`` (sharpcli.io.formats). Order matters twice: it is the order of the lists in
# messages, and folder layouts are probed in it (CIFAR-10 batches win over a CIFAR-100
# train/test pair in the same folder).
DATA_FORMATS: Registry = Registry(
    "data format",
    source="spec",
    entries=[
        _format(
            "safetensors",
            "safetensors file with tensors x, y (optional x_test, y_test) or named keys",
            f"{_FILES}:is_safetensors",
            f"{_FILES}:read_tensor_file",
            (".safetensors",),
            _KEYS,
            test_split=_TENSOR_TEST,
        ),
        _format(
            "pt",
            "torch.save dict of tensors x, y (optional x_test, y_test) or named keys; a "
            "TensorDataset with trust_pickle",
            f"{_FILES}:is_torch_file",
            f"{_FILES}:read_tensor_file",
            (".pt", ".pth"),
            _KEYS,
            test_split=_TENSOR_TEST,
        ),
        _format(
            "npz",
            "numpy.savez archive with arrays x, y (optional x_test, y_test) or named keys",
            f"{_FILES}:is_npz",
            f"{_FILES}:read_tensor_file",
            (".npz",),
            _KEYS,
            test_split=_TENSOR_TEST,
        ),
        _format(
            "npy",
            "numpy .npy features beside their labels file (x.npy and y.npy, X_train.npy and "
            "y_train.npy)",
            f"{_FILES}:is_npy",
            f"{_FILES}:read_npy_pair",
            (".npy",),
            ("y_key",),
            test_split="add the test files (train -> test in both names)",
        ),
        _format(
            "arrow",
            "Arrow file (a Hugging Face dataset shard): number and list-of-ids columns",
            f"{_ARROW}:is_arrow",
            f"{_ARROW}:read_arrow",
            (".arrow",),
            _KEYS,
            test_split="use a save_to_disk DatasetDict folder with a test split",
        ),
        _format(
            "csv",
            "csv table: numeric feature columns, a label column, an optional split column",
            f"{_FILES}:is_csv",
            f"{_FILES}:read_table",
            (".csv",),
            ("label_column",),
            test_split=_TABLE_TEST,
        ),
        _format(
            "parquet",
            "parquet table: numeric feature columns, a label column, an optional split "
            "column; list columns (token ids) as named keys",
            f"{_FILES}:is_parquet",
            f"{_FILES}:read_table",
            (".parquet",),
            ("label_column", *_KEYS),
            test_split=_TABLE_TEST,
        ),
        _format(
            "hf-dataset",
            "Hugging Face datasets save_to_disk folder (Dataset or DatasetDict)",
            f"{_ARROW}:is_hf_dataset_folder",
            f"{_ARROW}:read_hf_dataset_folder",
            spec_keys=_KEYS,
            directory=True,
            test_split="save a DatasetDict with a test split",
        ),
        _format(
            "cifar10-python",
            "CIFAR-10 python batches (cifar-10-batches-py)",
            f"{_VISION}:is_cifar10_python",
            f"{_VISION}:read_cifar",
            directory=True,
            test_split=_FOLDER_TEST,
        ),
        _format(
            "cifar10-binary",
            "CIFAR-10 binary batches (cifar-10-batches-bin)",
            f"{_VISION}:is_cifar10_binary",
            f"{_VISION}:read_cifar",
            directory=True,
            test_split=_FOLDER_TEST,
        ),
        _format(
            "cifar100-binary",
            "CIFAR-100 binary train/test files (cifar-100-binary); fine or coarse labels",
            f"{_VISION}:is_cifar100_binary",
            f"{_VISION}:read_cifar",
            spec_keys=("label_column",),
            directory=True,
            test_split=_FOLDER_TEST,
        ),
        _format(
            "cifar100-python",
            "CIFAR-100 python train/test pickles (cifar-100-python); fine or coarse labels",
            f"{_VISION}:is_cifar100_python",
            f"{_VISION}:read_cifar",
            spec_keys=("label_column",),
            directory=True,
            test_split=_FOLDER_TEST,
        ),
        _format(
            "mnist-idx",
            "MNIST-family idx files, plain or .gz (MNIST, Fashion-MNIST, KMNIST)",
            f"{_VISION}:is_mnist_idx",
            f"{_VISION}:read_mnist",
            directory=True,
            test_split=_FOLDER_TEST,
        ),
    ],
)

# ``--activation NAME[:beta=B]`` (sharpcli.models.activations), [NME] sections 4.3-4.4
ACTIVATIONS: Registry = Registry(
    "activation",
    source="activation",
    entries=[
        Entry("relu", "ReLU", "sharpcli.models.activations:ReLU"),
        Entry("gelu", "GELU", "sharpcli.models.activations:GELU"),
        Entry(
            "beta-gelu",
            "x Phi(beta x): GELU with sharpness beta",
            "sharpcli.models.activations:BetaGELU",
            (P("beta", "float", 1.0, "sharpness, > 0; 1 = GELU", positive=True),),
            paper="NME",
        ),
        Entry(
            "augmented-relu",
            "ReLU forward, a Gaussian of inverse width beta as its second derivative",
            "sharpcli.models.activations:AugmentedReLU",
            (P("beta", "float", 1.0, "inverse width of the Gaussian, > 0", positive=True),),
            paper="NME",
        ),
        Entry(
            "diminished-gelu",
            "GELU forward, no second derivative",
            "sharpcli.models.activations:DiminishedGELU",
            paper="NME",
        ),
    ],
)

# ``--data NAME[:k=v,...]``: the built-in synthetic datasets (sharpcli.io.datasets_builtin);
# their parameters are typed and checked there
DATASETS: Registry = Registry(
    "built-in dataset",
    source="spec",
    entries=[
        Entry("blobs", "a Gaussian mixture in R^dim", "sharpcli.io.datasets_builtin:make_blobs"),
        Entry(
            "images",
            "channels x size x size images, one smooth template per class",
            "sharpcli.io.datasets_builtin:make_images",
        ),
    ],
)

# the ``sharp`` commands, in the order a person uses them (the order of ``sharp --help``)
COMMANDS: Registry = Registry(
    "command",
    source="command",
    entries=[
        Entry(
            "train",
            "Train a model, optionally under a sharpness regularizer.",
            "sharpcli.cli.cmd_train:train_command",
        ),
        Entry(
            "eigen",
            "Largest or smallest curvature eigenvalues (how sharp the minimum is).",
            "sharpcli.cli.cmd_spectrum:eigen_command",
            paper="Lanczos1950",
        ),
        Entry(
            "trace",
            "Trace of the curvature: the sum of all its eigenvalues.",
            "sharpcli.cli.cmd_spectrum:trace_command",
            paper="Hutchinson1989",
        ),
        Entry(
            "gn-nme",
            "Split the Hessian into its Gauss-Newton and nonlinear parts.",
            "sharpcli.cli.cmd_spectrum:gn_nme_command",
            paper="NME",
        ),
        Entry(
            "density",
            "The whole eigenvalue spectrum, estimated and plotted.",
            "sharpcli.cli.cmd_spectrum:density_command",
            paper="Ghorbani2019",
        ),
        Entry(
            "analyze",
            "Several of these measures in one report; a gate for CI.",
            "sharpcli.cli.cmd_analyze:analyze_command",
        ),
        Entry(
            "activation-stats",
            "How often activations are active or dead, per layer.",
            "sharpcli.cli.cmd_diagnostics:activation_stats_command",
        ),
        Entry(
            "weight-rescale",
            "Show which sharpness measures change when weights are rescaled.",
            "sharpcli.cli.cmd_diagnostics:weight_rescale_command",
            paper="MAN",
        ),
        Entry(
            "bound-check",
            "Check the papers' curvature bounds on a trained model.",
            "sharpcli.cli.cmd_diagnostics:bound_check_command",
            paper="AD",
        ),
        Entry(
            "compare",
            "Runs side by side in one table and plot.",
            "sharpcli.cli.cmd_compare:compare_command",
        ),
        Entry(
            "sweep",
            "Train and measure over a grid of regularizer settings and seeds.",
            "sharpcli.cli.cmd_sweep:sweep_command",
        ),
    ],
)

# every kind, by the name the docs' tables use
KINDS: dict[str, Registry] = {
    "regularizers": REGULARIZERS,
    "operators": OPERATORS,
    "estimators": ESTIMATORS,
    "losses": LOSSES,
    "data formats": DATA_FORMATS,
    "activations": ACTIVATIONS,
    "datasets": DATASETS,
    "commands": COMMANDS,
}


def operator_help() -> str:
    """The ``--operator`` help: every operator with its symbol and description.

    Returns:
        ``hessian (H: Hessian of the loss), ggn (...) or nme (...)``, extensions included.
    """
    items = [f"{e.name} ({e.info['symbol']}: {e.summary})" for e in OPERATORS.entries()]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def operator_table() -> str:
    """The docs' Markdown table of the operators (docs/commands/eigen.md).

    Returns:
        The table, extensions included.
    """
    rows = ["| `--operator` | symbol | what it is | PSD |", "|---|---|---|---|"]
    rows += [
        f"| `{e.name}` | {e.info['symbol']} | {e.summary} | {'yes' if e.info['psd'] else 'no'} |"
        for e in OPERATORS.entries()
    ]
    return "\n".join(rows)
