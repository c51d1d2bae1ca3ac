"""bench/interleaved.py's 192/128 command (``--v-head-dim``) at tiny sizes on CPU (``--cpu-smoke``)."""

from bench import harness, interleaved

IMPLS = ("probjax_default,probjax_cudnn,probjax_mosaic_bwd,probjax_mosaic,probjax_triton,"
         "jaxnn_cudnn_padded_v,probjax_xla")


def test_value_width_command_cpu_smoke(tmp_path):
  out = tmp_path / "interleaved.json"
  assert interleaved.main(["--lengths", "4096", "--head-dims", "192", "--v-head-dim", "128", "--causal", "both",
                           "--batch", "2", "--heads", "16", "--modes", "fwd,fwd_bwd", "--impls", IMPLS,
                           "--cpu-smoke", "--no-progress", "--output", str(out)]) == 0
  rows = harness.load_rows(str(out))
  keys = {(r["impl"], r["causal"], r["mode"]) for r in rows}
  n_impls = len(IMPLS.split(","))
  # causal and not, fwd and fwd_bwd; probjax_mosaic_bwd's forward is probjax_mosaic's (no fwd row)
  assert len(rows) == len(keys) == 4 * n_impls - 2
  assert ("probjax_mosaic_bwd", False, "fwd") not in keys and ("probjax_mosaic_bwd", True, "fwd_bwd") in keys
  for r in rows:
    assert harness.validate_row(r) == [], r
    assert (r["batch"], r["q_heads"], r["q_len"], r["head_dim"], r["variant"]) == (1, 2, 64, 16, "dv8"), r
    if r["impl"] in ("probjax_default", "probjax_xla"):
      assert r["status"] == "ok", r
      fwd = 2.0 * 1 * 2 * 64 * 64 * (16 + 8) * (0.5 if r["causal"] else 1.0)
      assert r["flops"] == fwd * (3.5 if r["mode"] == "fwd_bwd" else 1.0)
      assert r["compiled_total_bytes"] >= r["argument_bytes"] > 0, r   # the compiled program's memory
      assert r["impl"] != "probjax_default" or "xla" in r["dispatch"]
      assert r["mode"] == "fwd_bwd" or r["max_abs_err"] < 1e-5
    else:
      assert r["status"] in ("unsupported", "error"), r   # GPU kernels, 16-bit only


def test_padded_v_matches_the_narrow_call():
  """jaxnn_cudnn_padded_v's call (v zero-padded to the keys' width, the output sliced) is
  attention with the narrow v, forward and gradients: checked through jax.nn's XLA path."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench import impls
  from probjax.ops.attention.api import dot_product_attention

  q, k, v, do = impls.inputs(1, 32, 32, 2, 2, 16)
  v, do = v[..., :8], do[..., :8]
  padded = interleaved.padded_v_attention(True, 16, implementation="xla")
  ref = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True)
  a, b = (jax.vjp(f, *(jnp.asarray(x) for x in (q, k, v))) for f in (padded, ref))
  assert a[0].shape == (1, 32, 2, 8)
  np.testing.assert_allclose(a[0], b[0], atol=1e-5)
  for ga, gb in zip(a[1](jnp.asarray(do)), b[1](jnp.asarray(do))):
    np.testing.assert_allclose(ga, gb, atol=1e-5)
