"""Attention's tolerances are the shared ones: :mod:`probjax.core.tolerances`."""

from probjax.core.tolerances import max_error, scaled_tolerance, tolerance  # noqa: F401
