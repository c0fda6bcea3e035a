"""Trace estimators (``--estimator NAME``): Hutchinson, Hutch++, the Gauss-Newton split and the
exact traces, with the probes they share."""
