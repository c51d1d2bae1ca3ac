"""Kernels of multi-head latent attention's own (not attention's)."""
