"""Analyses built on the curvature engine (analyze, spectrum, bounds, rescale, tracking, ...)."""
