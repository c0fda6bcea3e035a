"""Extreme eigenvalues: Lanczos (with thick restarts and deflated rounds), its Krylov basis,
Ritz pairs and warm starts, and power iteration."""
