"""The grouped-matmul backends, one package each; :mod:`probjax.ops.grouped_matmul.registry`
lists them, and none imports another."""
