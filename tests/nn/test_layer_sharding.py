"""Logical-axis sharding metadata on the layers' parameters: every row of the table in
docs/guide/layers.md ("Sharding metadata") is what ``nnx.get_partition_spec`` reads, every
parameter of the main layers is named (one name per axis), a stacked Transformer adds
"layers"; models placed by the names run on a 1-device mesh and on 4 (forced host) CPU devices
(experts over one mesh axis of 2, heads / mlp / inner / vocab over another) with the unsharded
model's outputs."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from probjax.nn.layers import _sharding as shd
from probjax.nn.layers.mamba import Mamba, Mamba2
from probjax.nn.layers.mlp import MLP
from probjax.nn.layers.moe import MoELayer
from probjax.nn.layers.multi_head_attention import MultiHeadAttention
from probjax.nn.layers.rattention import RAttention
from probjax.nn.layers.transformer import Transformer, TransformerBlock, TransformerLM

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide" / "layers.md"
RULES = [("embed", None), ("heads", "model"), ("kv", None), ("mlp", "model"), ("experts", "expert"),
         ("vocab", "model"), ("inner", "model"), ("layers", None)]
AXES = ("data", "expert", "model")


def _layers():
  """Small instances (abstract: nnx.eval_shape) of every layer the table names; a layer with
  two configurations (self- and cross-attention) has both."""
  r = lambda: nnx.Rngs(0)
  make = {
      "MultiHeadAttention": [lambda: MultiHeadAttention(num_heads=2, in_features=8, use_bias=True,
                                                        qk_norm=True, rngs=r()),
                             lambda: MultiHeadAttention(num_heads=2, in_features=8, context_features=6,
                                                        rngs=r())],
      "MLP": [lambda: MLP(features=8, use_bias=True, rngs=r())],
      "MoELayer": [lambda: MoELayer(8, 16, 4, 2, shared_hidden=8, rngs=r())],
      "Mamba": [lambda: Mamba(d_model=8, d_state=4, rngs=r())],
      "Mamba2": [lambda: Mamba2(d_model=8, d_state=4, head_dim=4, rngs=r())],
      "RAttention": [lambda: RAttention(num_heads=2, in_features=8, window_size=2, rngs=r())],
      "TransformerBlock": [lambda: TransformerBlock(features=8, num_heads=2, norm="layernorm", rngs=r())],
      "TransformerLM": [lambda: TransformerLM(vocab_size=11, features=8, num_layers=2, num_heads=2,
                                              tie_embeddings=False, rngs=r())],
  }
  return {k: [nnx.eval_shape(f) for f in fs] for k, fs in make.items()}


def _table():
  """``[(layer, parameter path, axes)]`` from the guide's table (the Transformer row apart)."""
  text = GUIDE.read_text()
  text = text[text.index("## Sharding metadata"):]
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 3 or not cells[0].startswith("`") or cells[0] == "`Transformer`":
      continue
    layer = cells[0].strip("`")
    axes = ast.literal_eval(re.search(r"`(\(.*\))`", cells[2]).group(1))
    for path in re.findall(r"`([^`=]+)`", cells[1]):
      rows.append((layer, path, axes))
  return rows


def _names(var):
  return var.get_metadata().get("out_sharding")


def _lookup(module, path):
  for part in path.split("."):
    module = getattr(module, part)
  return module


def test_the_guides_table_is_the_metadata():
  layers = _layers()
  rows = _table()
  assert len(rows) >= 40 and {l for l, _, _ in rows} == set(layers)
  for layer, path, axes in rows:
    found = []
    for m in layers[layer]:
      try:
        found.append(_lookup(m, path))
      except AttributeError:
        pass
    found = [v for v in found if v is not None]
    assert found, (layer, path)
    for var in found:
      assert _names(var) == axes, (layer, path, _names(var), axes)
      spec = nnx.get_partition_spec(nnx.State({"v": var}))["v"].get_value()
      assert spec == P(*axes), (layer, path, spec)


def test_every_parameter_is_named():
  """Every parameter of these layers has one logical name (or None) per axis, from the
  documented set; a stacked Transformer's blocks lead with "layers", and its unstacked blocks
  drop it."""
  for layer, modules in _layers().items():
    for m in modules:
      for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        names = _names(var)
        assert names is not None and len(names) == var.get_value().ndim, (layer, path, names)
        assert all(a is None or a in shd.AXES for a in names), (layer, path, names)
  tr = Transformer(num_layers=2, features=8, num_heads=2, ffn="moe", ffn_kwargs=dict(num_experts=4, top_k=2),
                   rngs=nnx.Rngs(0))
  block = tr.unstacked()[1]
  single = dict(nnx.to_flat_state(nnx.state(block, nnx.Param)))
  for path, var in nnx.to_flat_state(nnx.state(tr.blocks, nnx.Param)):
    assert _names(var) == ("layers",) + _names(single[path]), (path, _names(var))
  with pytest.raises(ValueError, match="unknown logical axis 'embd'"):
    shd.names("embd")


def _place(model, mesh):
  with nnx.logical_axis_rules(RULES):
    specs = nnx.get_partition_spec(nnx.state(model))
  state = jax.device_put(nnx.state(model), jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  nnx.update(model, state)
  return model


def _hybrid_lm():
  return TransformerLM(vocab_size=12, features=16, num_layers=2, num_heads=2, tie_embeddings=False,
                       mixer=["attention", "mamba"], mixer_kwargs={"mamba": dict(d_state=4)},
                       ffn=["moe", "mlp"], ffn_kwargs={"moe": dict(num_experts=4, top_k=2, dispatch="dense")},
                       rngs=nnx.Rngs(0))


def _stacked_moe_lm(scan_layers=True):
  return TransformerLM(vocab_size=12, features=16, num_layers=2, num_heads=2, ffn="moe",
                       ffn_kwargs=dict(num_experts=4, top_k=2, dispatch="dense"), scan_layers=scan_layers,
                       rngs=nnx.Rngs(0))


def test_models_run_on_a_one_device_mesh():
  """Created under a mesh (no eager sharding, so no error), placed by the names, run: the
  unsharded model's outputs."""
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), AXES)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 12, (2, 6)), jnp.int32)
  forward = nnx.jit(lambda m, t: m(t))
  for make in (_stacked_moe_lm,):  # (the hybrid one: the 4-device test)
    want = forward(make(), tokens)
    with jax.set_mesh(mesh):
      lm = _place(make(), mesh)
      got = forward(lm, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


_TWO_DEVICES = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec as P
    from tests.nn import test_layer_sharding as T
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2), T.AXES)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 12, (2, 6)), jnp.int32)
    forward = nnx.jit(lambda m, t: m(t))
    for make in (T._stacked_moe_lm, T._hybrid_lm, lambda: T._stacked_moe_lm(scan_layers=False)):
      want = forward(make(), tokens)
      got = forward(T._place(make(), mesh), tokens)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    lm = T._place(T._hybrid_lm(), mesh)
    blocks = lm.transformer.blocks
    assert blocks[1].mlp.up.kernel.sharding.spec == P(None, "model"), blocks[1].mlp.up.kernel.sharding
    assert blocks[0].mlp.w_in.sharding.spec == P("expert", None, "model"), blocks[0].mlp.w_in.sharding
    assert blocks[1].mixer.in_proj.kernel.sharding.spec == P(None, "model")
    assert lm.embed.embedding.sharding.spec == P("model", None)
    print("OK")
""")


@pytest.mark.slow  # a fresh interpreter with 4 forced host devices: imports and compiles again (~15 s)
def test_hybrid_lm_runs_sharded_on_four_cpu_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", _TWO_DEVICES], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
