"""Training: the loop around the regularised step, its epochs, resume and sweeps."""
