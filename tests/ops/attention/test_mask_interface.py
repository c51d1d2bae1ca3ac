"""Masks are open to new predicates: backends read a mask through the Mask interface, never a
predicate's fields, and a predicate added as one module (PrefixLMMask) is exact on the XLA path
and refused by the kernels that do not compute it."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention import masks as M
from probjax.ops.attention.backends import triton, xla
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.reference import reference_attention
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.testing import check_against_reference, make_inputs

ROOT = pathlib.Path(__file__).resolve().parents[3] / "probjax"
MASKS = ROOT / "ops" / "attention" / "masks"
# Modules that still read the compatibility attributes (``mask.upper``), owned by other work in
# progress: move each to the interface (``band_bounds``, ``lengths``, ``arrays``) and drop it here.
FIELD_READERS_ALLOWED = {"ops/attention/dispatch.py", "ops/attention/gpu.py", "ops/attention/context_parallel.py"}


def _field_reads(path: pathlib.Path, fields: set[str]):
  """``line: expr.field`` for each read of a predicate field on anything but ``self``/``cls``
  (a class's own attribute of the same name is not a mask's) that is not called (``s.lower()``)."""
  tree = ast.parse(path.read_text())
  called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr in fields and id(node) not in called
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
      yield f"{node.lineno}: {ast.unparse(node)}"


def test_no_module_outside_masks_reads_predicate_fields():
  fields = {f for cls in M.PREDICATES.values() for f in cls.fields}
  assert {"lower", "upper", "kv_lengths", "q_segment_ids", "prefix_lengths"} <= fields
  bad = [f"{rel}:{hit}" for path in sorted(ROOT.rglob("*.py"))
         if MASKS not in path.parents and (rel := path.relative_to(ROOT).as_posix()) not in FIELD_READERS_ALLOWED
         for hit in _field_reads(path, fields)]
  assert not bad, "\n".join(bad) + "\n(read masks through Mask's methods: band_bounds, lengths, operands, ...)"


def test_a_field_read_is_seen(tmp_path):
  src = tmp_path / "m.py"
  src.write_text("def f(mask, self, s):\n  return mask.kv_lengths, self.lower, s.lower()\n")
  assert list(_field_reads(src, {"kv_lengths", "lower"})) == ["2: mask.kv_lengths"]


def test_registry_and_compatibility_view():
  assert list(M.PREDICATES) == ["band", "q_lengths", "kv_lengths", "segments", "prefix_lm", "mask_mod"]
  m = M.PrefixLMMask(jnp.array([3, 0])) & M.KVLenMask(jnp.array([5, 4])) & M.CausalMask(2)
  assert m.components == ("causal", "kv_lengths", "prefix_lm") and m.name == "causal&kv_lengths&prefix_lm"
  assert m.upper == 2 and m.lower is None and m.q_lengths is None
  assert m.prefix_lengths.tolist() == [3, 0] and m.band_bounds == (None, 2)
  assert M.Mask(prefix_lengths=jnp.array([3, 0])).kinds == ("prefix_lm",)
  assert [r for r, _ in m.arrays()] == ["b", "b"]
  assert (M.PrefixLMMask(jnp.array([2])) & M.PrefixLMMask(jnp.array([1]))).prefix_lengths.tolist() == [1]
  with pytest.raises(TypeError, match="unexpected keyword"):
    M.Mask(prefix=1)


@pytest.mark.parametrize("q_len, kv_len, block_q, block_k", [(7, 8, 2, 3), (9, 9, 4, 4), (5, 11, 3, 2)])
def test_prefix_lm_tile_classes_are_exact(q_len, kv_len, block_q, block_k):
  """EMPTY and FULL exactly where the dense mask says so (PARTIAL tiles are not all-or-nothing)."""
  for p in range(kv_len + 1):
    m = M.PrefixLMMask(jnp.array([p]))
    cls = np.asarray(m.classify_tiles(1, q_len, kv_len, block_q, block_k))[0]
    dense = np.asarray(m.dense(1, q_len, kv_len))[0, 0]
    for i, j in np.ndindex(cls.shape):
      t = dense[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]
      whole = t.shape == (block_q, block_k)
      assert cls[i, j] == (M.EMPTY if not t.any() else M.FULL if t.all() and whole else M.PARTIAL), (p, i, j)


def test_prefix_lm_element():
  m = M.PrefixLMMask(jnp.array([2, 0]))
  d = np.asarray(m.dense(2, 4, 4))[:, 0].astype(int)
  assert d[0].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]  # prefix 2: bidirectional
  assert d[1].tolist() == np.tril(np.ones((4, 4), int)).tolist()  # prefix 0: causal
  for b in range(2):
    assert np.array_equal(np.asarray(m.element(jnp.arange(4)[:, None], jnp.arange(4)[None], b)), d[b] == 1)


@pytest.mark.parametrize("formulation", ["dense", "flash"])
@pytest.mark.parametrize("extra", ["none", "kv_lengths", "window"])
def test_prefix_lm_xla_matches_reference(formulation, extra):
  x = make_inputs(3, 2, 300, 300, 4, 2, 32)
  m = M.PrefixLMMask(jnp.array([70, 0]))
  if extra == "kv_lengths":
    m = m & M.KVLenMask(jnp.array([250, 300]))
  elif extra == "window":
    m = m & M.LocalWindowMask(100, None)
  blocks = dict(block_q=128, block_k=64) if formulation == "flash" else {}
  f = lambda q, k, v, bias: xla.attention(q, k, v, mask=m, formulation=formulation, scale=0.2, **blocks)
  check_against_reference(f, x, mask=m, scale=0.2)


def test_prefix_lm_flash_skips_empty_tiles():
  """Every key tile past the prefix and the diagonal is EMPTY for the first query tile."""
  cls = np.asarray(M.PrefixLMMask(jnp.array([64, 64])).classify_tiles(2, 512, 512, 128, 128))
  assert cls[:, 0].tolist() == [[M.PARTIAL, M.EMPTY, M.EMPTY, M.EMPTY]] * 2
  assert (cls[:, 1:, 0] == M.FULL).all()


def test_prefix_lm_public_api_and_jit():
  from probjax.nn.layers.attention import PrefixLMMask, dot_product_attention
  import probjax
  assert PrefixLMMask is M.PrefixLMMask is probjax.masks.PrefixLMMask is probjax.PrefixLMMask
  x = make_inputs(5, 2, 96, 96, 2, 2, 16)
  lengths = jnp.array([40, 200])  # traced out of range: clamped to kv_len, as lengths are
  out = jax.jit(lambda q, k, v, p: dot_product_attention(q, k, v, mask=PrefixLMMask(p)))(x.q, x.k, x.v, lengths)
  ref = reference_attention(x.q, x.k, x.v, mask=M.PrefixLMMask(jnp.array([40, 96])))
  assert max_error(out, ref) <= tolerance(jnp.float32)
  with pytest.raises(ValueError, match="prefix_lengths must lie in"):
    dot_product_attention(x.q, x.k, x.v, mask=PrefixLMMask(lengths))


def test_kernels_refuse_prefix_lm():
  m = M.PrefixLMMask(jnp.array([4, 0])) & M.CausalMask()
  why = triton.supports((2, 256, 4, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m, interpret=True)
  assert why and "'prefix_lm'" in why and "Triton" in why
  call = AttentionCall((2, 256, 4, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m, interpret=True)
  assert "'prefix_lm'" in call.not_for_kernels()  # every kernel's supports (registry) starts with it
  from probjax.ops.attention.backends import cudnn
  assert cudnn.supports((2, 256, 4, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m, platform="gpu")
  x = make_inputs(1, 2, 64, 64, 2, 2, 32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="prefix_lm"):
    triton.attention(x.q, x.k, x.v, mask=m, interpret=True)


def test_explicit_kernel_request_names_the_predicate():
  from probjax.nn.layers.attention import dot_product_attention
  x = make_inputs(1, 2, 64, 64, 2, 2, 32, dtype=jnp.bfloat16)
  for impl in ("triton", "mosaic"):
    with pytest.raises(ValueError, match="prefix_lm"):
      dot_product_attention(x.q, x.k, x.v, mask=M.PrefixLMMask(jnp.array([4, 0])), implementation=impl,
                            interpret=True)
