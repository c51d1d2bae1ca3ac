"""Multi-head latent attention (MLA, DeepSeek-V2): attention whose keys and values are
expanded per head from one shared latent.

Shapes: ``q_nope [B, Tq, H, d_nope]``, ``q_rope [B, Tq, H, d_rope]``, ``kv_latent [B, S, d_c]``,
``k_rope [B, S, d_rope]`` (shared by all heads), ``w_uk [d_c, H, d_nope]``, ``w_uv [d_c, H, d_v]``.
Head ``h`` attends with query ``[q_nope_h, q_rope_h]`` over keys ``[latent @ w_uk_h, k_rope]``
and values ``latent @ w_uv_h``; the output is ``[B, Tq, H, d_v]``. The softmax scale defaults to
``(d_nope + d_rope) ** -0.5`` (the model's key width) in both forms:

* ``"expanded"``: K and V are formed, then one attention call with ``d_qk = d_nope + d_rope``;
* ``"absorbed"``: ``w_uk`` is absorbed into the queries and ``w_uv`` applied after: multi-query
  attention of the H heads over the latent (``d_qk = d_c + d_rope``, values the latent itself);
* ``"auto"``: by arithmetic (:func:`probjax.ops.mla.dispatch.absorbed_is_cheaper`): expanded for
  training and prefill, absorbed for a few queries over a long cache.

>>> import jax, jax.numpy as jnp
>>> from probjax.ops.mla import mla
>>> ks = jax.random.split(jax.random.key(0), 6)
>>> B, T, S, H, dn, dr, dc, dv = 1, 5, 9, 2, 8, 4, 16, 8
>>> args = [jax.random.normal(k, s) for k, s in zip(ks, [(B, T, H, dn), (B, T, H, dr), (B, S, dc),
...         (B, S, dr), (dc, H, dn), (dc, H, dv)])]
>>> e, a = mla(*args, form="expanded"), mla(*args, form="absorbed")
>>> e.shape, bool(jnp.allclose(e, a, atol=1e-4))
((1, 5, 2, 8), True)
"""

from probjax.ops.mla.api import FORMS, REGISTRY, Decision, MLACall, explain, explain_dispatch, make_call, mla

__all__ = ["mla", "explain_dispatch", "explain", "Decision", "MLACall", "make_call", "FORMS", "REGISTRY"]
