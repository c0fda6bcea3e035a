"""The curvature operators by ``--operator`` name: H, G, N, the Fisher, the empirical Fisher."""
