"""The perturbation oracles of ``sharp train``: the gradient taken at perturbed weights.

:mod:`~sharpcli.regularizers.perturbed.sam` ([SAM], [USAM], [ASAM]: the ascent family) and
:mod:`~sharpcli.regularizers.perturbed.noise` ([NSO]: ``weight-noise``, ``nso``). Each runs
in ``sharp train`` (``gradient(engine)``) and, through the methods of
:class:`~sharpcli.regularizers.base.PerturbationOracle`, in one's own loop
(:class:`sharpcli.regularizers.PerturbedOptimizer`).
"""
