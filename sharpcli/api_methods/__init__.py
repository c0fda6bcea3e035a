"""The methods of :class:`sharpcli.api.Curvature`, grouped by job, and the helpers they share.

``Curvature`` (:mod:`sharpcli.api`) checks its arguments and reads the data once; what it can
then be asked lives here, as the bases it inherits: :mod:`.products` (the matrix-free
operators, the cache of first-order graphs, the parameter blocks), :mod:`.estimates`
(eigenvalues, traces, the diagonal, the spectral density, the Gauss-Newton/NME split) and
:mod:`.perturbed` (the loss at moved weights: sharpness and the landscape). :mod:`.modes`
runs a model as the analyses see it (eval mode, twice differentiable) and :mod:`.arguments`
checks the arguments a user passes.
"""
