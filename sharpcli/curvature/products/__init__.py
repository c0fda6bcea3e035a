"""Curvature products: the analysis set, the parameter scope and the engine that multiplies.

The engine (:class:`~sharpcli.curvature.products.engine.CurvatureEngine`) keeps the first-order
graphs of the analysis set and gives H, G and N products from them; the finite-difference
engine gives Hessian products from gradients instead."""
