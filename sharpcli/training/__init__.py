"""Training: the loop, the step, regularizers and hyper-parameter sweeps."""
