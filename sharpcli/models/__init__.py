"""Model zoo and activations with controlled second derivatives.

- :mod:`sharpcli.models.zoo`: ``mlp``, ``cnn``, ``vgg-small`` ([MAN] Table 6), CIFAR ``resnet``
  ([He2016]) built from JSON-serialisable specs ``{"name": ..., "args": {...}}``, and
  introspection helpers (``final_linear``, ``activation_modules``) that work on any module.
- :mod:`sharpcli.models.specs`: each architecture's arguments, their checks and defaults.
- :mod:`sharpcli.models.state_size`: a spec's state_dict size, computed without building it.
- :mod:`sharpcli.models.activation_functions`: their closed forms and custom autograd.
- :mod:`sharpcli.models.activations`: ``relu``, ``gelu``, ``beta-gelu``, ``augmented-relu``,
  ``diminished-gelu`` ([NME] sections 4.3-4.4) and ``make_activation("name[:k=v,...]")``.
"""

from sharpcli.models.activation_functions import augmented_relu, beta_gelu, diminished_gelu
from sharpcli.models.activations import (
    ACTIVATION_NAMES,
    ACTIVATION_TYPES,
    GELU,
    AugmentedReLU,
    BetaGELU,
    DiminishedGELU,
    ReLU,
    activation_modules,
    activation_spec,
    canonical_activation_spec,
    is_positively_homogeneous,
    make_activation,
    parse_activation_spec,
)
from sharpcli.models.specs import default_model_args, model_input_shape, validate_model_spec
from sharpcli.models.state_size import StateSize, estimate_state_size
from sharpcli.models.zoo import (
    MLP,
    MODEL_NAMES,
    CifarResNet,
    SmallCNN,
    VGGSmall,
    build_model,
    final_linear,
)

__all__ = [
    "ACTIVATION_NAMES",
    "ACTIVATION_TYPES",
    "AugmentedReLU",
    "BetaGELU",
    "DiminishedGELU",
    "GELU",
    "ReLU",
    "activation_spec",
    "augmented_relu",
    "beta_gelu",
    "canonical_activation_spec",
    "diminished_gelu",
    "is_positively_homogeneous",
    "make_activation",
    "parse_activation_spec",
    "MODEL_NAMES",
    "MLP",
    "CifarResNet",
    "SmallCNN",
    "StateSize",
    "VGGSmall",
    "activation_modules",
    "build_model",
    "default_model_args",
    "estimate_state_size",
    "final_linear",
    "model_input_shape",
    "validate_model_spec",
]
