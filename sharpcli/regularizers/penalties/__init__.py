"""The regularizer classes of ``sharp train``, one module per paper family.

:mod:`~sharpcli.regularizers.base` (hyper-parameters, modes, kinds),
:mod:`~sharpcli.regularizers.penalties.decay` ([AD]: ``none``, ``wd``, ``dropout``, ``ad``),
:mod:`~sharpcli.regularizers.penalties.nme` ([NME]: ``gp``, ``hessian-trace``, ``gn-trace``),
:mod:`~sharpcli.regularizers.penalties.flatness` ([FA]: ``fa``),
:mod:`~sharpcli.regularizers.perturbed.sam` ([SAM], [USAM], [ASAM]) and
:mod:`~sharpcli.regularizers.perturbed.noise` ([NSO]: ``weight-noise``, ``nso``).
:mod:`sharpcli.regularizers.registry` registers them.
"""
