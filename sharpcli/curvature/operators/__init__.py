"""The curvature operators by name: H, G, N, the Fisher and the empirical Fisher, and their
registry (``--operator NAME``)."""
