"""Extreme eigenvalues: Lanczos (its basis, Ritz pairs, warm starts) and power iteration."""
