"""``linear_call``'s batching and JVP rules, which the XLA flash path needs (``jax.vmap`` of its
derivatives, second derivatives). The rules are JAX-internals patches and live in
:mod:`probjax.core.jax_patches`; importing this module applies them (:mod:`.flash` does)."""

from probjax.core import jax_patches

jax_patches.apply()
