"""The decode loop's compiled program (XLA:CPU's optimized HLO): the donated KV cache is updated
in place, never copied, and the stacked layer parameters are sliced once, before the loop; and
its program lowered for an H200 (on CPU): the attention reads only the valid keys.

A copy of the cache shows in the HLO as a ``copy`` (or ``concatenate``) whose result has a
cache buffer's shape: copy insertion adds one wherever a buffer cannot be updated in place
(the old value still read after the write, a carry whose input and output cannot share a
buffer, a donation not honoured). :func:`test_detector_sees_a_copied_cache` checks that the
detector finds such a copy in a loop built to need one.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from probjax.nn.layers.decoding import decode_loop
from probjax.nn.layers.transformer import TransformerLM

B, MAX_LEN, KV_HEADS, HEAD_DIM, LAYERS = 2, 384, 2, 16, 3   # no other arrays of the model have these shapes
STEPS = 4
_OPCODE = re.compile(r"=\s*(\S+)\s+([\w-]+)\(")


def _computations(hlo: str) -> dict[str, list[str]]:
  """The instruction lines of each computation of HLO text, by name."""
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.-]+)\s+\(.*\)\s*->.*\{\s*$", line)
    if head:
      name = head.group(1)
      comps[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None and line.strip():
      comps[name].append(line)
  return comps


def _cache_copies(hlo: str, shape: str) -> list[str]:
  """The ``copy`` and ``concatenate`` instructions of the module whose result is ``shape``
  (e.g. ``bf16[2,384,2,16]``), with the computation each is in."""
  found = []
  for name, lines in _computations(hlo).items():
    for line in lines:
      m = _OPCODE.search(line)
      if m and m.group(2) in ("copy", "concatenate", "copy-start") and m.group(1).split("{")[0] == shape:
        found.append(f"{name}: {line.strip()}")
  return found


def _while_bodies(hlo: str) -> set[str]:
  return set(re.findall(r"\bwhile\(.*body=%?([\w.-]+)", hlo))


def _lm(dtype=jnp.bfloat16):
  return TransformerLM(vocab_size=64, features=32, num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS,
                       head_dim=HEAD_DIM, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))


def _compiled_loop(lm, layout="per_layer", donate=True, **sampling):
  graphdef, state = nnx.split(lm)
  cache = lm.init_cache(B, MAX_LEN, layout=layout)
  cache = cache.replace(lengths=jnp.array([5, 9], jnp.int32))

  def loop(p, cache, tok):
    toks, _, cache, _ = decode_loop(nnx.merge(graphdef, p), cache, tok, jax.random.key(0), num_steps=STEPS,
                                    **sampling)
    return toks, cache

  return jax.jit(loop, donate_argnums=(1,) if donate else ()).lower(state, cache, jnp.array([1, 2], jnp.int32)).compile()


def _shape(dtype, dims=(B, MAX_LEN, KV_HEADS, HEAD_DIM)):
  """HLO's spelling of an array type, e.g. ``bf16[2,384,2,16]``."""
  return f"{jnp.dtype(dtype).name.replace('bfloat16', 'bf16').replace('float32', 'f32')}[{','.join(map(str, dims))}]"


def _stacked_params_in_loop(lm, hlo: str) -> list[str]:
  """The instructions of the while bodies that take or make an array of a stacked layer
  parameter's shape ``[layers, ...]`` (the per-step slicing of the stacked weights)."""
  shapes = {_shape(x.dtype, x.shape) for x in jax.tree.leaves(nnx.state(lm.transformer.blocks))}
  comps = _computations(hlo)
  return [f"{b}: {line.strip()[:200]}" for b in _while_bodies(hlo) for line in comps.get(b, [])
          if any(sh + "{" in line for sh in shapes)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_loop_updates_the_cache_in_place(dtype):
  """No copy of a cache buffer anywhere in the program (inside the loop: one per step), the
  cache's outputs alias the donated inputs, and the loop reads per-layer weights sliced before
  it (no stacked parameter inside it)."""
  lm = _lm(dtype)
  compiled = _compiled_loop(lm)
  hlo = compiled.as_text()
  assert _while_bodies(hlo), "the decode loop is no while loop"
  assert not _cache_copies(hlo, _shape(dtype)), "\n".join(_cache_copies(hlo, _shape(dtype)))
  cache_bytes = 2 * LAYERS * B * MAX_LEN * KV_HEADS * HEAD_DIM * jnp.dtype(dtype).itemsize
  assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes
  assert not _stacked_params_in_loop(lm, hlo), "\n".join(_stacked_params_in_loop(lm, hlo))


def test_sampled_decode_loop_updates_the_cache_in_place():
  """Traced temperature and top_k (generate's program) leave the cache alone too."""
  hlo = _compiled_loop(_lm(), temperature=jnp.float32(0.7), top_k=jnp.int32(5)).as_text()
  assert not _cache_copies(hlo, _shape(jnp.bfloat16))


def test_undonated_cache_is_copied():
  """Without donation the program must copy the cache (its input stays valid): the detector
  finds a copy of every layer's k and v."""
  copies = _cache_copies(_compiled_loop(_lm(), donate=False).as_text(), _shape(jnp.bfloat16))
  assert len(copies) >= 2 * LAYERS, copies


def test_stacked_layout_slices_the_parameters_in_the_loop():
  """The "stacked" cache layout runs the layers as one scanned block, whose parameters are
  sliced from the stacked ones inside the loop: the check of the test above finds them."""
  lm = _lm()
  assert _stacked_params_in_loop(lm, _compiled_loop(lm, layout="stacked").as_text())


def test_detector_sees_a_copied_cache():
  """A scan whose body reads the cache after writing it must copy it every step: the detector
  finds that copy (so a copy in the decode loop would fail the tests above)."""
  shape = (B, MAX_LEN, KV_HEADS, HEAD_DIM)

  def loop(cache, x):
    def body(c, i):
      new = jax.lax.dynamic_update_slice(c, jnp.full((B, 1, KV_HEADS, HEAD_DIM), i, c.dtype), (0, i, 0, 0))
      return new, jnp.sum(c[:, i]) + jnp.sum(new)   # the old value, read after the write
    return jax.lax.scan(body, cache + x, jnp.arange(STEPS))

  hlo = jax.jit(loop, donate_argnums=(0,)).lower(jnp.zeros(shape, jnp.bfloat16), jnp.bfloat16(1)).compile().as_text()
  assert _cache_copies(hlo, _shape(jnp.bfloat16))


def test_gpu_decode_attention_gets_the_key_lengths(monkeypatch):
  """Lowered for an H200 (on CPU), each layer's decode attention is the Triton split-KV kernel
  reading the cache buffers as they are (no pad, slice or copy of K/V before the call), with the
  per-element key lengths as an operand: its programs share the valid key tiles and skip those
  past the lengths, so a step reads ``lengths`` keys, not ``max_len``."""
  from tests.ops.attention.test_gpu_lowering import _fake_dispatch_sm90, _fake_triton_sm90
  _fake_triton_sm90(monkeypatch, device_kind=True)
  _fake_dispatch_sm90(monkeypatch)
  max_len = 2048   # the split-KV kernel's automatic range: at least 1024 keys
  lm = nnx.eval_shape(lambda: TransformerLM(vocab_size=64, features=128, num_layers=LAYERS, num_heads=4,
                                            num_kv_heads=KV_HEADS, head_dim=64, dtype=jnp.bfloat16,
                                            param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(lm)
  cache = jax.eval_shape(lambda: lm.init_cache(B, max_len))

  def loop(p, cache, tok):
    return decode_loop(nnx.merge(graphdef, p), cache, tok, jax.random.key(0), num_steps=STEPS)[:3]

  text = jax.jit(loop, donate_argnums=(1,)).trace(state, cache, jax.ShapeDtypeStruct((B,), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  kv = f"tensor<{B}x{max_len}x{KV_HEADS}x64xbf16>"
  calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*?name = \"(\w+)\".*?: \(([^)]*)\) ->", text)
  assert calls and all(name == "probjax_attention_fwd_split_kv" for name, _ in calls), [c[0] for c in calls]
  for _, operands in calls:
    assert operands.split(", ")[1:] == [kv, kv, f"tensor<{B}xi32>"], operands
