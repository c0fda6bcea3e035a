"""The additive penalties and model regularizers of ``sharp train``, one module per paper family.

:mod:`~sharpcli.regularizers.penalties.decay` ([AD]: ``none``, ``dropout``, ``wd``, ``ad``),
:mod:`~sharpcli.regularizers.penalties.flatness` ([FA]: ``fa``) and
:mod:`~sharpcli.regularizers.penalties.nme` ([NME]: ``gp``, ``hessian-trace``, ``gn-trace``).
Their base classes are in :mod:`sharpcli.regularizers.base`; each class declares its record
in its body, and :mod:`sharpcli.regularizers.registry` parses ``--reg`` into them.
"""
