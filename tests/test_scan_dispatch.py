"""The scan room's dispatch on fake devices (pure rules, no arrays), its registry, and that the
Triton kernels lower for an H200 (sm_90) on CPU."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import gpu_info

from probjax.core.device import Device
from probjax.ops import scan
from probjax.ops.scan import dispatch, registry
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall
from probjax.testing import verify_triton_lowering

CPU = Device("cpu")
H200 = Device("gpu", (9, 0), 140 << 30)
RTX3090 = Device("gpu", (8, 6), 24 << 30)
INTERPRET = Device.interpreter()

MAMBA = MambaCall(8, 2048, 1536, 16, "float32")
SSD = SSDCall(8, 2048, 24, 64, 1, 128, "bfloat16")
RLA = RLACall(4, 4096, 8, 8, 64, 64, 512, "softmax", "bfloat16")
CALLS = {"mamba": MAMBA, "ssd": SSD, "rla": RLA}


@pytest.mark.parametrize("op, expect", [("mamba", "scan"), ("ssd", "chunked"), ("rla", "chunked")])
def test_cpu_default_is_the_fastest_exact_xla_form(op, expect):
  d = scan.explain_dispatch(CALLS[op], device=CPU)
  assert d.implementation == expect == dispatch.CPU_DEFAULT[dispatch.registry_of(CALLS[op]).op]
  assert "cpu" in d.rule


@pytest.mark.parametrize("device", [H200, RTX3090, INTERPRET])
@pytest.mark.parametrize("op", list(CALLS))
def test_gpu_default_is_the_fastest_measured_form(op, device):
  d = scan.explain_dispatch(CALLS[op], device=device)
  # Forward: the Mamba-1 kernel; SSD's and RLA's chunked XLA forms. Differentiated: the
  # Mamba-1 kernels, the chunked forms (one form forward and backward: no grad_implementation).
  assert d.implementation == {"mamba": "triton", "ssd": "chunked", "rla": "chunked"}[op], d
  assert d.grad_implementation is None, d
  if op == "mamba":
    assert d.chunk_size == 32
  # The kernels asked for: SSD has no backward kernel (the chunked form runs), Mamba-1's and
  # RLA's run.
  asked = scan.explain_dispatch(CALLS[op], implementation="triton", device=device)
  assert asked.grad_implementation == ("chunked" if op == "ssd" else None), asked


def test_gpu_grad_default_falls_back_to_chunked_for_memory():
  """A Mamba-1 call the kernels refuse (state 512) is differentiated by the associative form,
  which keeps every position's state: past a quarter of the device's memory (3 float32 copies
  of [B, L, D, N]) the chunked form runs instead."""
  fits = MambaCall(2, 1024, 1536, 512, "float32")        # 3 x 6.4 GB of 140 GB
  too_big = MambaCall(8, 8192, 1536, 512, "float32")     # 3 x 206 GB
  assert scan.explain_dispatch(fits, device=H200).grad_implementation == "associative"
  big = scan.explain_dispatch(too_big, device=H200)  # the forward is chunked too: one form
  assert (big.implementation, big.grad_implementation) == ("chunked", None)


@pytest.mark.parametrize("call, why", [
    (MambaCall(2, 100, 64, 512, "float32"), "state = 512"),
    (MambaCall(2, 100, 64, 16, "float64"), "float64"),
    (MambaCall(2, 100, 64, 16, "float32", chunk_size=24), "chunk_size"),
    (SSDCall(2, 100, 4, 64, 1, 16, "float32", chunk_size=24), "chunk_size"),
    (RLACall(2, 100, 4, 4, 256, 64, 8, "softmax", "float32"), "features = 512"),
    (RLACall(2, 100, 4, 4, 64, 512, 8, "relu", "float32"), "v_head_dim = 512"),
])
def test_gpu_default_falls_back_to_chunked_with_the_reason(call, why):
  d = scan.explain_dispatch(call, device=H200)
  assert d.implementation == "chunked"
  if isinstance(call, MambaCall):  # SSD and RLA run the chunked form by default anyway
    assert why in d.rule
  with pytest.raises(ValueError, match=why):
    scan.explain_dispatch(call, implementation="triton", device=H200)


def test_explicit_triton_off_gpu_says_why():
  with pytest.raises(ValueError, match="interpret=True"):
    scan.explain_dispatch(MAMBA, implementation="triton", device=CPU)
  assert scan.explain_dispatch(MAMBA, implementation="pallas", device=INTERPRET).implementation == "triton"


def test_explicit_requests_are_kept():
  for op, call in CALLS.items():
    for name in dispatch.registry_of(call).names():
      d = scan.explain_dispatch(call, implementation=name, device=H200)
      assert d.implementation == name and d.rule == "requested"


def test_unknown_implementation():
  with pytest.raises(ValueError, match="associative"):  # RLA has no associative form
    scan.explain_dispatch(RLA, implementation="associative", device=CPU)
  with pytest.raises(TypeError):
    scan.explain_dispatch(MAMBA, implementation=3, device=CPU)


def test_chunk_sizes():
  chunked = lambda call: scan.explain_dispatch(call, implementation="chunked", device=CPU).chunk_size
  assert chunked(MAMBA) == 64 and chunked(MambaCall(1, 1, 1, 1, "float32")) == 1
  assert chunked(SSD) == 64 and chunked(SSDCall(1, 20, 2, 4, 1, 4, "float32")) == 32
  assert chunked(RLACall(1, 20, 2, 2, 4, 4, 0, "relu", "float32", chunk_size=5)) == 5
  short = RLACall(1, 20, 2, 2, 4, 4, 0, "relu", "float32")
  assert scan.explain_dispatch(short, device=H200).chunk_size == 32
  assert scan.explain_dispatch(RLACall(1, 9, 2, 2, 4, 4, 0, "relu", "float32"), device=H200).chunk_size == 16


def test_registries_and_availability():
  assert registry.MAMBA.names() == ("scan", "associative", "chunked", "triton")
  assert registry.RLA.names() == ("scan", "chunked", "triton")
  assert scan.available_implementations(MAMBA, CPU) == ["scan", "associative", "chunked"]
  assert scan.available_implementations(SSD, H200)[-1] == "triton"


@pytest.mark.parametrize("kw, match", [(dict(batch=0), "batch"), (dict(length=1.5), "length"),
                                        (dict(groups=5), "groups"), (dict(chunk_size=-2), "chunk_size")])
def test_bad_calls(kw, match):
  fields = dict(batch=2, length=10, heads=4, head_dim=8, groups=2, state=4, dtype="float32")
  with pytest.raises(ValueError, match=match):
    SSDCall(**{**fields, **kw})


def test_interpret_call_dispatches_as_on_a_gpu():
  call = MambaCall(2, 10, 4, 4, "float32", interpret=True)
  assert scan.explain_dispatch(call).implementation == "triton"


# -- lowering for sm_90 (Pallas -> Triton IR; Triton's own compilation needs the GPU) ----------

@pytest.fixture
def fake_h200(monkeypatch):
  monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
  monkeypatch.setattr(Device, "current", classmethod(lambda cls: H200))
  verify_triton_lowering(monkeypatch)


def _kernels(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return sorted(set(re.findall(r"probjax_(?:mamba|ssd|rla)\w*", text)))


S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _loss(fn):
  return lambda *a: jnp.sum(fn(*a).astype(jnp.float32))


def test_mamba_kernel_lowers_for_sm90(fake_h200):
  x, A, B = S((2, 300, 100), BF16), S((100, 16), jnp.float32), S((2, 300, 16), BF16)
  fn = lambda x, A, B: scan.mamba_scan(x, x, A, B, B, z=x)
  assert _kernels(fn, x, A, B) == ["probjax_mamba_scan_fwd"]
  # Differentiated, by default and asked for, the kernels run forward (saving the
  # chunk-boundary states) and backward.
  assert _kernels(jax.grad(_loss(fn), argnums=(0, 1, 2)), x, A, B) == [
      "probjax_mamba_scan_bwd", "probjax_mamba_scan_fwd_res"]
  asked = lambda x, A, B: scan.mamba_scan(x, x, A, B, B, z=x, initial_state=jnp.zeros((2, 100, 16)),
                                          implementation="triton")
  assert _kernels(jax.grad(_loss(asked), argnums=(0, 1, 2)), x, A, B) == [
      "probjax_mamba_scan_bwd", "probjax_mamba_scan_fwd_res"]


def test_ssd_kernel_lowers_for_sm90(fake_h200):
  x, dt = S((2, 300, 8, 64), BF16), S((2, 300, 8), BF16)
  A, B = S((8,), jnp.float32), S((2, 300, 2, 128), BF16)
  fn = lambda x, dt, A, B: scan.ssd_scan(x, dt, A, B, B, implementation="triton")
  assert _kernels(fn, x, dt, A, B) == ["probjax_ssd_scan_fwd"]


def test_rla_kernels_lower_for_sm90(fake_h200):
  q, k = S((2, 300, 8, 64), BF16), S((2, 300, 2, 64), BF16)
  fn = lambda q, k: scan.residual_linear_attention(q, k, k, window_size=64)
  grad = lambda fn: jax.grad(lambda q, k: jnp.sum(fn(q, k).astype(jnp.float32) ** 2), argnums=(0, 1))
  # The default is the chunked XLA form's, forward and backward (faster than the kernels);
  # asked for, the kernels run forward and backward.
  assert _kernels(fn, q, k) == [] and _kernels(grad(fn), q, k) == []
  asked = lambda q, k: scan.residual_linear_attention(q, k, k, window_size=64, implementation="triton")
  assert _kernels(grad(asked), q, k) == ["probjax_rla_bwd_dkv", "probjax_rla_bwd_dq", "probjax_rla_fwd"]
