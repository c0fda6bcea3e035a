"""Curvature products: the analysis set, the parameter scope, the engine and its graphs."""
