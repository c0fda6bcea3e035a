"""The regularizer classes of ``sharp train``, one module per paper family.

:mod:`~sharpcli.training.penalties.base` (hyper-parameters, modes, kinds),
:mod:`~sharpcli.training.penalties.decay` ([AD]: ``none``, ``wd``, ``dropout``, ``ad``),
:mod:`~sharpcli.training.penalties.nme` ([NME]: ``gp``, ``hessian-trace``, ``gn-trace``),
:mod:`~sharpcli.training.penalties.flatness` ([FA]: ``fa``),
:mod:`~sharpcli.training.penalties.sam` ([SAM], [USAM], [ASAM]) and
:mod:`~sharpcli.training.penalties.noise` ([NSO]: ``weight-noise``, ``nso``).
:mod:`sharpcli.training.regularizers` registers them.
"""
