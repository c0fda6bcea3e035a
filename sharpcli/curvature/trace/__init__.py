"""Trace estimators (``--estimator NAME``) and the probes they share."""
