"""The core every op uses: the device description, the backend contract and registry,
forward-mode AD for reverse-mode kernels, batch/head partitioning, timing, and the one
module that touches JAX internals (:mod:`probjax.core.compat`)."""
